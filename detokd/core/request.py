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
        before = self.n_ids
        self.n_ids += len(ids)
        if finish is not None:
            m = finish.matched
            # A stop token is not rendered (SGLang #33151: id 0 is falsy, never trimmed).
            if type(m) is int and not self.keep_stop and ids and ids[-1] == m:
                ids = ids[:-1]
        text, found, k = self._decode(ids, finish is not None)
        stopped = None
        if found is not None:
            self.stopped = True
            stopped = StoppedRow(rid, self.vid, found, before + k)
            finish = Finish("stop", found)
        if self.parts is not None:  # stream=false: everything comes in the finishing row
            if finish is None:
                self.parts.append(text)
                self.held += getsizeof(text) + 8
                text = ""
            else:
                text = "".join(self.parts) + text
        if found is None and finish is not None:
            text = trim_engine_stop(self.sent[-SENT_TAIL:], text, finish.matched, self.keep_stop)
        elif text:
            self.keep_sent(text)
        return text, finish, stopped

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
