"""One live request: its decoder, its stop scanner, and what its rows have told so far.

`Request.feed` is the whole per-request text logic of a row: the stop token's trim,
the stop scan, the stream=false buffer and the engine's stop-string trim. The
dispatcher (detokd.core.detokenizer) only checks a row against the table and calls it;
the common row of a plain streaming request never gets here (the dispatcher's fast
path steps the decoder itself).
"""

from __future__ import annotations

from sys import getsizeof

from .decoder import Decoder
from .records import Finish, OutRow, Start, StoppedRow
from .stops import StopScanner, trim_engine_stop

# Characters of sent text a request keeps: an engine's stop string of up to SENT_TAIL + 1
# characters is trimmed exactly wherever it began (stops.trim_engine_stop).
SENT_TAIL = 128
# `sent` grows to this many characters before it is cut back to SENT_TAIL: a row then
# costs one string copy (the append), not two (the append, then the cut).
SENT_KEEP = 2 * SENT_TAIL


class Request:
    __slots__ = ("worker", "outbox", "vid", "n_ids", "step", "stops", "keep_stop", "parts", "held", "stopped",
                 "needs_feed", "decoder", "sent")

    def __init__(
        self, worker: int, outbox: list[OutRow], start: Start, decoder: Decoder, stops: StopScanner | None
    ) -> None:
        self.worker = worker
        self.outbox = outbox  # the Outbox list of this request's worker
        self.vid = start.vid
        self.n_ids = 0  # output ids consumed so far
        self.decoder = decoder
        self.step = decoder.step  # bound once: the loop's one call per row
        self.stops = stops
        self.keep_stop = start.no_stop_trim
        self.parts: list[str] | None = None if start.stream else []
        self.held = 0  # bytes parts holds (each str and its list slot): a running sum, for the cap
        self.stopped = False  # detokd matched a stop string and finished the request
        self.sent = ""  # at least the last SENT_TAIL characters sent (kept)
        # True with stop strings to scan or stream=false text to hold: every row then goes
        # through feed. A plain streaming request's rows take the dispatcher's fast path.
        self.needs_feed = stops is not None or not start.stream

    def keep_sent(self, text: str) -> None:
        """`text` went out: `sent` keeps its last SENT_TAIL characters or more. The rule
        of the sent tail; the dispatcher's fast path (Detokenizer._advance) writes it out
        inline."""
        sent = self.sent + text
        self.sent = sent if len(sent) <= SENT_KEEP else sent[-SENT_TAIL:]

    def feed(self, rid: str, ids: list[int], finish: Finish | None) -> tuple[str, Finish | None, StoppedRow | None]:
        """The text `ids` add (all in the vocabulary, the row's seq checked), the finish
        to send with it, and the feedback row when a stop string of detokd's own
        completed on one of them."""
        if finish is not None:
            return self._last(rid, ids, finish)
        before = self.n_ids
        self.n_ids += len(ids)
        text, found, k = self._decode(ids, False)
        if found is not None:
            self.stopped = True
            if self.parts is not None:  # stream=false: everything comes in the finishing row
                text = "".join(self.parts) + text
            return text, Finish("stop", found), StoppedRow(rid, self.vid, found, before + k)
        if self.parts is not None:
            self.parts.append(text)
            self.held += getsizeof(text) + 8
            return "", None, None
        if text:
            self.keep_sent(text)
        return text, None, None

    def _last(self, rid: str, ids: list[int], finish: Finish) -> tuple[str, Finish, StoppedRow | None]:
        """`feed` of the engine's finishing row: its stop token or stop string trimmed."""
        before = self.n_ids
        self.n_ids += len(ids)
        m = finish.matched
        mark = None  # earlier rows' text not out yet, for the engine's stop string
        # A stop token is not rendered (SGLang #33151: id 0 is falsy, never trimmed).
        if type(m) is int and not self.keep_stop and ids and ids[-1] == m:
            ids = ids[:-1]
        elif type(m) is str and m:
            mark = self._unsent()  # before this row's ids change it
        text, found, k = self._decode(ids, True)
        parted = 0  # characters of the stream=false text that earlier rows made
        if self.parts is not None:
            joined = "".join(self.parts)
            parted, text = len(joined), joined + text
        if found is not None:
            self.stopped = True
            return text, Finish("stop", found), StoppedRow(rid, self.vid, found, before + k)
        if mark is not None:
            earlier = parted + _earlier(mark, text, parted)
            text = trim_engine_stop(self.sent[-SENT_TAIL:], text, earlier, m, self.keep_stop)
        return text, finish, None

    def _unsent(self) -> tuple[int, str]:
        """What of earlier rows' text is not out yet, before a finishing row: how many
        characters the stop scanner holds, and the decoder's uncommitted text as it
        would render it now (word release's held words, a character still split, an
        open byte run, the window codec's last ids)."""
        return (len(self.stops.held) if self.stops is not None else 0), self.decoder.peek()

    def _decode(self, ids: list[int], final: bool) -> tuple[str, str | None, int]:
        """New text of these ids through the stop scanner: (text, the stop string
        that completed, how many of `ids` it took to complete it)."""
        scanner = self.stops
        if scanner is None:
            text = self.step(ids) if ids else ""
            return (text + self.decoder.finish() if final else text), None, 0
        # Id by id, so a stop string is attributed to the id that completed it.
        out = []
        for k, i in enumerate(ids, 1):
            sent, found = scanner.feed(self.step([i]))
            out.append(sent)
            if found is not None:
                return "".join(out), found, k
        if final:
            sent, found = scanner.feed(self.decoder.finish())
            out.append(sent)
            if found is None:
                out.append(scanner.flush())
            return "".join(out), found, len(ids)
        return "".join(out), None, 0


def _earlier(mark: tuple[int, str], text: str, at: int) -> int:
    """How many characters of `text[at:]`, a finishing row's text, earlier rows made:
    those the stop scanner held, then as far as the decoder's rendering of what it held
    agrees with what it made of it once the row's ids came (they may complete a split
    character, or turn a byte run invalid)."""
    scanned, peeked = mark
    at += scanned
    n = 0
    for a, b in zip(peeked, text[at : at + len(peeked)], strict=False):  # the row may have made less
        if a != b:
            break
        n += 1
    return scanned + n
