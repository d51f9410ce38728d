"""The dispatcher: the request table, the tombstones, and one output row per input row.

Rows come in, output rows go to the Outbox; nothing here touches a socket or a wire
format, so the whole behaviour is testable in-process. Every row gets exactly one
output row (a text row or an error row), in arrival order, except rows of a request
that detokd already finished on a stop string of its own, which are swallowed until
the engine's finishing row frees the state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from msgspec import Raw

from .. import logs
from . import records as r
from .decoder import Codec, RunTooLong
from .outbox import Outbox, Produced
from .records import OutRow, Row, error_row
from .request import SENT_KEEP, SENT_TAIL, Request
from .stats import Stats
from .stops import StopAutomata, StopScanner
from .table import RequestTable, Tombstones

log = logs.get(__name__)


@dataclass(frozen=True)
class Limits:
    """What one row may make detokd hold: Config's key max_<field> for each field
    (Config.limits()). Rows beyond them get
    `too_large`; a frame of more than `rows` rows is dropped whole, a bad frame.

    Two budgets bound one frame's work, not only its bytes; rows past them get
    `too_large`. `frame_ids`: an id costs one to five bytes on the wire but its text
    up to a vocabulary's longest token (128 characters in every packaged one), and
    each character may pass a stop automaton (~0.2 us), so 64 MiB of ids could ask
    for 1.7 GB of text and minutes of scanning. `frame_stop_chars`: the stop strings
    of automata a frame builds (a list seen before is cached and costs nothing),
    ~1.4 us a character."""

    rows: int = 65536
    frame_ids: int = 65536
    frame_stop_chars: int = 65536
    stop_bytes: int = 256 << 20  # stop automata alive at once, cached or a live request's
    row_ids: int = 65536
    rid_len: int = 1024
    meta_bytes: int = 1024 * 1024
    wire_prompt_tail: int = 65536
    stop_strings: int = 256
    stop_chars: int = 4096
    # Bytes of text a stream=false request holds for its finishing row (~4M tokens of
    # prose); every other request's state is bounded by the caps above.
    held_text_bytes: int = 16 << 20


def _about(rid: str, worker: int | None, error: str) -> dict:
    """A log record's `extra=`: the request, worker and error word a line is about
    (fields of its JSON line; detokd.logs cuts a rid to 64 characters)."""
    return {"rid": rid[:64], "worker": worker, "error": error}


def _n_ids(request: Request | None) -> int:
    """The ids a request had consumed, 0 for none: what its error row reports."""
    return request.n_ids if request is not None else 0


class Columns(NamedTuple):
    """Rows of a dialect that places them by position, a list per field."""

    rids: list[str]
    id_rows: list[list[int]]
    finishes: Sequence[object]  # only whether each is None is read
    metas: list[Raw]


NO_COLUMNS = Columns([], [], [], [])  # what `tokens` passes: its rows are Row structs


def _over_budget(rows: list[Row], budget: int) -> int | None:
    """The index of the first row whose ids take the frame past `budget`, or None."""
    total = 0
    for k, row in enumerate(rows):
        total += len(row.ids)
        if total > budget:
            return k
    return None


class Detokenizer:
    def __init__(
        self,
        codec: Codec,
        vocab_size: int,
        outbox: Outbox,
        *,
        max_states: int,
        max_prompt_tail: int,
        stats: Stats,
        limits: Limits = Limits(),
    ) -> None:
        self.codec = codec
        self.vocab_size = vocab_size
        self.outbox = outbox
        self.table: RequestTable[Request] = RequestTable(max_states)
        self.tombstones = Tombstones(max(1024, max_states))
        self.max_tail = max_prompt_tail
        self.stats = stats
        self.limits = limits
        self.overloaded = False  # set by the loop's RSS guard: new requests and held text that grows are refused
        self.closing = False  # set by the loop when shutdown leaves no time to decode: rows get `shutdown`
        self.stop_chars_left = limits.frame_stop_chars  # this frame's budget for building stop automata
        self.automata = StopAutomata(limits.stop_bytes)

    def tokens(self, rows: list[Row], ids_at_most: int | None = None) -> Produced:
        """One engine step; returns what it produced (with anything produced since the
        last `take`). `ids_at_most` is a bound on the ids the rows hold, where the caller
        has one for free (a frame's size in bytes: no id costs less than a byte); the
        frame's id budget is counted only when it could be exceeded."""
        self._tokens(rows, ids_at_most)
        return self.outbox.take()

    def take(self) -> Produced:
        """What the core produced since the last take (by `fail`, `bad_rows`, `quick`'s
        errors, ...)."""
        return self.outbox.take()

    def _tokens(self, rows: list[Row], ids_at_most: int | None) -> None:
        """The common rows (a live, plain streaming request's next ids) go through
        `_advance`; each row it stops at goes through `_row`."""
        limits = self.limits
        self.stop_chars_left = limits.frame_stop_chars
        # The frame-wide rules cost a call only where they could apply.
        if ((ids_at_most is None or ids_at_most > limits.frame_ids or self.closing)
                and self._answered_whole(rows, ids_at_most)):
            return
        end = len(rows)
        i = self._advance(rows, NO_COLUMNS, 0, end, None, False)
        while i < end:
            self._guarded(rows[i])
            i = self._advance(rows, NO_COLUMNS, i + 1, end, None, False)
        self.stats.rows += end

    def _answered_whole(self, rows: list[Row], ids_at_most: int | None) -> bool:
        """The frame-wide rules, before any row: a frame beyond max_rows is dropped,
        one read while closing answered `shutdown`, and the rows past the frame's id
        budget get too_large (those before it are decoded). True when that answered
        every row. A caller that passes `ids_at_most` within the budget has capped its
        rows at max_rows already (both dialects' decoders refuse more)."""
        limits = self.limits
        if len(rows) > limits.rows:
            self.stats.bad_frames += 1
            log.warning("tokens frame of %d rows dropped: max_rows is %d", len(rows), limits.rows)
            return True
        if self.closing:
            self._shut(rows)
            return True
        if ids_at_most is None or ids_at_most > limits.frame_ids:
            cut = _over_budget(rows, limits.frame_ids)
            if cut is not None:
                self._tokens(rows[:cut], 0)
                for row in rows[cut:]:
                    self._too_large(row, self.table.get(row.rid), self._oversize(row) or "ids per frame")
                return True
        return False

    def quick(self, rids: list[str], id_rows: list[list[int]], finishes: Sequence[object], metas: list[Raw],
              at: int = 0, in_vocab: bool = False) -> list[str]:
        """The fast path of `tokens` for a dialect that places rows by position: from row
        `at` on, each row that is a live plain streaming request's next ids, not
        finishing (`finishes[i] is None`), all in the vocabulary, gets its text with no
        Row or OutRow; an error on the way is answered as `tokens` would, with
        `metas[i]` (its text is then ""). Returns the texts of rows `at`, `at + 1`, ...,
        up to the first row `tokens` must take (a start, a finish, an unknown rid, an id
        to clamp). `in_vocab`: the caller knows every id of id_rows is in the
        vocabulary, so rows of several ids skip min and max."""
        end = len(rids)
        texts = [""] * (end - at)  # cut to the rows taken at the end: a store per row, not an append
        i = self._advance(None, Columns(rids, id_rows, finishes, metas), at, end, texts, in_vocab)
        del texts[i - at :]
        self.stats.rows += i - at
        return texts

    def _advance(self, rows: list[Row] | None, columns: Columns, at: int, end: int, texts: list[str] | None,
                 in_vocab: bool) -> int:
        """The fast path of both dialects: from row `at` on, each row that is a live plain
        streaming request's next ids (all in the vocabulary, at most max_row_ids) advances
        its request by them, up to the first row that must go through `_row`, whose index
        it returns (`end` when it takes them all). The rows are `rows` (an OutRow each
        for its worker) or else `columns` (a dialect that places rows by position: row
        i's text goes to `texts[i - at]`; the columns carry no seq, start or meta to
        check). A row's text is the decoder's settled table's when each of its ids has
        one, else the decoder's step. One loop, not a helper per row: a call per row
        costs ~10% of it (measured)."""
        get = self.table.states.get
        vocab_size = self.vocab_size
        max_ids = self.limits.row_ids
        max_meta = self.limits.meta_bytes
        rids, id_rows, finishes, metas = columns
        n_tok = 0
        for i in range(at, end):
            if rows is None:
                rid = rids[i]
                request = get(rid)
                if finishes[i] is not None or request is None or request.needs_feed:
                    break
                ids = id_rows[i]
            else:
                row = rows[i]
                rid = row.rid
                request = get(rid)
                if (request is None or request.needs_feed or row.start is not None or row.finish is not None
                        or len(row.meta) > max_meta or row.seq != request.n_ids):
                    break
                ids = row.ids
            n = len(ids)
            settled = request.decoder.settled_text
            if n == 1:
                t = ids[0]
                if not 0 <= t < vocab_size:
                    break
                text = settled[t] if settled is not None else None
            elif n and n <= max_ids and (in_vocab or (min(ids) >= 0 and max(ids) < vocab_size)):
                parts = None if settled is None else list(map(settled.__getitem__, ids))
                text = None if parts is None or None in parts else "".join(parts)
            else:
                break
            n_tok += n
            seq = request.n_ids = request.n_ids + n
            if text is None:
                try:
                    text = request.step(ids)
                except Exception as e:  # answered with an error row; the row gets no text
                    row = rows[i] if rows is not None else Row(rid, ids, seq - n, None, None, metas[i])
                    self._step_failed(row, request, e)
                    continue
            if texts is None:
                request.outbox.append(OutRow(rid, text, None, seq, row.meta, None))
            else:
                texts[i - at] = text
            # Request.keep_sent, inline: the sent tail kept for an engine stop string.
            if text:
                sent = request.sent + text
                request.sent = sent if len(sent) <= SENT_KEEP else sent[-SENT_TAIL:]
        else:
            i = end
        self.stats.tokens += n_tok
        return i

    def _step_failed(self, row: Row, request: Request, error: Exception) -> None:
        """The decoder raised on a fast-path row: the request fails as `_guarded` fails it."""
        if isinstance(error, RunTooLong):
            self._too_large(row, request, "open byte run")
        else:
            self._internal(row, request)

    # --- what a dialect may ask and do, besides handing over rows -----------------------

    def seq_of(self, rid: str) -> int | None:
        """The ids a live request has consumed (its next row's seq), or None."""
        request = self.table.states.get(rid)
        return None if request is None else request.n_ids

    def ended(self, rid: str) -> bool:
        """Whether detokd ended this rid itself (evicted, failed): its rows get that error."""
        return self.tombstones.get(rid) is not None

    def live(self, rid: str) -> bool:
        """Whether the rid is a live request (an error owed to its worker from an earlier
        request of the rid is then not its)."""
        return rid in self.table

    def known(self, worker: int) -> bool:
        """Whether rows may be routed to `worker` (delivery has its address)."""
        return self.outbox.known(worker)

    def add_worker(self, worker: int) -> None:
        """Rows may be routed to `worker` from now on: delivery has connected it."""
        self.outbox.open(worker)

    def takes_whole(self, rows: int, ids: int) -> bool:
        """Whether a frame of this many rows and ids is within the frame caps, and the
        core decodes (not stopping): then `quick` may answer its rows."""
        return not self.closing and rows <= self.limits.rows and ids <= self.limits.frame_ids

    def _guarded(self, row: Row) -> None:
        try:
            self._row(row)
        except RunTooLong:
            self._too_large(row, self.table.get(row.rid), "open byte run")
        except Exception:
            self._internal(row, self.table.get(row.rid))

    def _internal(self, row: Row, request: Request | None) -> None:
        log.exception("internal error decoding rid %r; failing that request only", row.rid)
        if request is not None and self.table.get(row.rid) is request:
            self.table.pop(row.rid)
        worker = request.worker if request is not None else None
        self._error(row.rid, worker, r.INTERNAL, row.meta, _n_ids(request))

    def _row(self, row: Row) -> None:
        """Any row off the fast path: its request found or begun (`_request`), checked,
        fed, and answered."""
        request = self._request(row)
        if request is None:
            return
        rid, ids = row.rid, row.ids
        if request.stopped:
            # detokd finished it already and the worker has its finishing row: until the
            # engine catches up, its rows (even malformed ones) get no row at all.
            if row.finish is not None:
                self.table.pop(rid)
            return
        if row.seq != request.n_ids:
            self._fail(rid, request, r.SEQUENCE_GAP, row)
            return
        if ids and (max(ids) >= self.vocab_size or min(ids) < 0):
            self._fail(rid, request, r.BAD_IDS, row)
            return
        self.stats.tokens += len(ids)
        held = request.held
        text, finish, stopped = request.feed(rid, ids, row.finish)
        if request.held != held and finish is None and self._holds_too_much(row, request):
            return
        if stopped is not None:
            self.stats.stops += 1
            self.outbox.stopped.append(stopped)
            if row.finish is not None:
                self.table.pop(rid)
        elif finish is not None:
            self.table.pop(rid)
        request.outbox.append(OutRow(rid, text, finish, request.n_ids, row.meta, None))

    def _request(self, row: Row) -> Request | None:
        """The live request a row is for, begun if the row starts one; None when the row
        is answered already (beyond a cap, a collision, refused, an unknown rid)."""
        rid = row.rid
        request = self.table.get(rid)
        start = row.start
        why = self._oversize(row)
        if why is not None:
            self._too_large(row, request, why)
            return None
        if start is not None and request is not None and start.worker != request.worker:
            self._collision(row, start, request)
            return None
        if start is not None and (request is None or request.vid != start.vid):
            if request is not None:  # a new vid: the engine retracted and re-runs this request
                self.table.pop(rid)
            elif self.overloaded:
                self._refuse_new(row, start)
                return None
            return self._begin(row, start)
        if request is None:
            self._unknown(row)
        return request

    def _holds_too_much(self, row: Row, request: Request) -> bool:
        """A stream=false request's held text grew: beyond held_text_bytes it fails
        too_large, and while the RSS guard is on it fails overloaded. True when failed."""
        if request.held > self.limits.held_text_bytes:
            self._too_large(row, request, "held text")
            return True
        if self.overloaded:  # the RSS guard: a live request that keeps growing is failed
            self._fail(row.rid, request, r.OVERLOADED, row)
            return True
        return False

    def _begin(self, row: Row, start: r.Start) -> Request | None:
        rid = row.rid
        self.tombstones.discard(rid)
        if not self.outbox.known(start.worker):
            log.warning(
                "rid %r names worker %d, which has no address", rid, start.worker,
                extra=_about(rid, start.worker, r.BAD_START),
            )
            self._error(rid, None, r.BAD_START, row.meta, 0)
            return None
        tail = start.prompt_tail[-self.max_tail :] if self.max_tail > 0 else []
        if tail and (max(tail) >= self.vocab_size or min(tail) < 0):
            self._error(rid, start.worker, r.BAD_IDS, row.meta, 0)
            return None
        decoder = self.codec.new(tail, start.skip_special_tokens)
        stops = None
        if any(start.stop):
            built = self.automata.cost(start.stop)
            if built > self.stop_chars_left:
                self._too_large(row, None, "stop characters per frame")
                return None
            if built and not self.automata.make_room(built):
                log.warning("stop automata fill max_stop_bytes = %d: a new stop list is refused (overloaded)",
                            self.limits.stop_bytes)
                self._refuse_new(row, start)
                return None
            self.stop_chars_left -= built
            stops = StopScanner(self.automata.get(start.stop), start.no_stop_trim)
        request = Request(start.worker, self.outbox.rows_of(start.worker), start, decoder, stops)
        for old_rid, old in self.table.put(rid, request):
            self.stats.evictions += 1
            if old.stopped:  # finished from the worker's view; only the engine's row was pending
                continue
            self.stats.error(r.EVICTED)
            self.tombstones.add(old_rid, old.worker, r.EVICTED)
            old.outbox.append(error_row(old_rid, r.EVICTED, n_ids=old.n_ids))
        self.stats.started += 1
        return request

    # --- caps, collisions, overload ---------------------------------------------------

    def _oversize(self, row: Row) -> str | None:
        """Which cap the row is beyond, or None. Only rows off the fast path pay."""
        lim = self.limits
        if len(row.rid) > lim.rid_len:
            return "rid"
        if len(row.ids) > lim.row_ids:
            return "ids"
        if len(row.meta) > lim.meta_bytes:
            return "meta"
        start = row.start
        if start is not None:
            if len(start.prompt_tail) > lim.wire_prompt_tail:
                return "prompt_tail"
            stop = start.stop
            if len(stop) > lim.stop_strings:
                return "stop strings"
            if sum(map(len, stop)) > lim.stop_chars:
                return "stop characters"
        return None

    def _too_large(self, row: Row, request: Request | None, why: str) -> None:
        """Fail the row's request. Its meta is echoed unless it is what is too large (a
        dialect may place the row by it: SGLang's batch position); a rid beyond the
        cap gets no row at all: it would be echoed to every worker."""
        rid = row.rid
        log.warning(
            "row of rid %r beyond the cap on %s: too_large", rid[:64], why, extra=_about(rid, None, r.TOO_LARGE)
        )
        if request is not None:
            self.table.pop(rid)
        if why == "rid":
            self.stats.error(r.TOO_LARGE)
            return
        meta = r.NIL if why == "meta" else row.meta
        if request is not None and row.start is not None and row.start.worker != request.worker:
            # Another scheduler's live rid: a collision first, so the sender's worker
            # hears nothing of that request (its n_ids, its later rows' meta).
            self._collision(row, row.start, request, meta)
            return
        worker = request.worker if request is not None else None
        if row.start is not None and self.outbox.known(row.start.worker):
            worker = row.start.worker
        if worker is not None:
            self.tombstones.add(rid, worker, r.TOO_LARGE)
        self._error(rid, worker, r.TOO_LARGE, meta, _n_ids(request))

    def _collision(self, row: Row, start: r.Start, request: Request, meta: Raw | None = None) -> None:
        """Two schedulers started one rid for two workers: neither can be served
        without the other never hearing of its request, so both are told and the
        state is dropped (later rows of the rid are unknown to every worker). Each
        row carries only its own request's state: the newcomer's n_ids is 0."""
        rid, other = row.rid, start.worker
        meta = row.meta if meta is None else meta
        log.warning(
            "rid %r started for worker %d while live for worker %d: rid_collision", rid, other, request.worker,
            extra=_about(rid, other, r.RID_COLLISION),
        )
        self.table.pop(rid)
        self.tombstones.discard(rid)
        self._error(rid, request.worker, r.RID_COLLISION, r.NIL, request.n_ids)
        if self.outbox.known(other):
            self._error(rid, other, r.RID_COLLISION, meta, 0)
        else:
            self._error(rid, None, r.BAD_START, meta, 0)

    def _refuse_new(self, row: Row, start: r.Start) -> None:
        worker = start.worker if self.outbox.known(start.worker) else None
        self._error(row.rid, worker, r.OVERLOADED if worker is not None else r.BAD_START, row.meta, 0)

    # --- errors -----------------------------------------------------------------------

    def _fail(self, rid: str, request: Request, error: str, row: Row) -> None:
        self.table.pop(rid)
        self.tombstones.add(rid, request.worker, error)
        self._error(rid, request.worker, error, row.meta, request.n_ids)

    def _unknown(self, row: Row) -> None:
        tomb = self.tombstones.get(row.rid)
        if tomb is not None and self.outbox.known(tomb.worker):
            self._error(row.rid, tomb.worker, tomb.error, row.meta, 0)
        else:
            self._error(row.rid, None, r.UNKNOWN_RID, row.meta, 0)

    def _error(self, rid: str, worker: int | None, error: str, meta, n_ids: int) -> None:
        """Send an error row, counted by its word: to the rid's worker, or to every
        worker when nobody here knows whose it is."""
        self.stats.error(error)
        row = error_row(rid, error, n_ids=n_ids, meta=meta)
        if worker is None:
            self.outbox.broadcast(row)
        else:
            self.outbox.add(worker, row)

    def _shut(self, rows: list[Row]) -> None:
        """Rows read while stopping, once there is no time left to decode: each fails its
        request with `shutdown` (to its worker, or every worker), never silence. Rows of
        a request detokd stopped itself are swallowed as ever; a rid beyond max_rid_len
        gets no row."""
        self.stats.rows += len(rows)
        for row in rows:
            rid = row.rid
            request = self.table.pop(rid)
            if (request is not None and request.stopped) or len(rid) > self.limits.rid_len:
                continue
            if request is not None:
                worker = request.worker
            elif row.start is not None and self.outbox.known(row.start.worker):
                worker = row.start.worker
            else:
                worker = None
            self._error(rid, worker, r.SHUTDOWN, row.meta, _n_ids(request))

    def fail(self, rid: str, worker: int, error: str, meta: Raw) -> None:
        """A row its dialect could not read: its request fails with `error` (its state, if
        live, goes; its later rows get the same error), answered to `worker`."""
        request = self.table.pop(rid)
        if request is not None:
            worker = request.worker
        self.tombstones.add(rid, worker, error)
        self._error(rid, worker, error, meta, _n_ids(request))

    def end(self, rid: str, worker: int, error: str) -> None:
        """A rid that is not live and whose rows cannot be decoded here (its request began
        in a process before this one, with the context its first row brought): its rows,
        from the next one handed to `tokens` on, are answered `error`, as an ended
        request's are."""
        self.tombstones.add(rid, worker, error)

    def bad_rows(self, rids: list[str]) -> None:
        """Rows that failed the schema: their request, if live, is failed too. A rid
        beyond max_rid_len gets no row, as in `_too_large`."""
        for rid in rids:
            if len(rid) > self.limits.rid_len:
                self.stats.error(r.TOO_LARGE)
                continue
            request = self.table.pop(rid)
            if request is not None:
                self.tombstones.add(rid, request.worker, r.BAD_ROW)
            self._error(rid, request.worker if request else None, r.BAD_ROW, r.NIL, _n_ids(request))

    def stalled(self, worker: int, rows: list[OutRow], error: str = r.WORKER_STALLED) -> list[OutRow]:
        """A message to `worker` was lost to its full queue (or could not be encoded:
        `error` says which): fail the requests it held.

        Their later rows are answered `error`, so a worker that comes back learns
        which of its requests failed instead of waiting on them forever. Returns the
        error rows the worker is owed in place of the message (the engine may send no
        more rows for them: the lost message held their finishing rows).
        """
        owed = []
        for row in rows:
            owed.append(error_row(row.rid, row.error or error, n_ids=row.n_ids))
            if row.error is not None:  # ended already; its tombstone answers later rows
                continue
            request = self.table.get(row.rid)
            if request is not None and request.worker == worker:
                self.table.pop(row.rid)
            self.tombstones.add(row.rid, worker, error)
            self.stats.error(error)
        return owed

    # --- the other messages -------------------------------------------------------------

    def too_large_embedding(self, rid: str, worker: int) -> None:
        """An embeddings row beyond max_rid_len (no row, as in `_too_large`) or
        max_meta_bytes (a `too_large` row to its worker, meta not echoed)."""
        log.warning(
            "embeddings row of rid %r beyond the caps: too_large", rid[:64], extra=_about(rid, worker, r.TOO_LARGE)
        )
        if len(rid) > self.limits.rid_len or not self.outbox.known(worker):
            self.stats.error(r.TOO_LARGE)
        else:
            self._error(rid, worker, r.TOO_LARGE, r.NIL, 0)

    def abort(self, rids: list[str]) -> None:
        """At most max_rows rids (the dialect's decoder); a rid beyond max_rid_len
        names no request (none can start) and is counted, as a tokens row's."""
        rid_len = self.limits.rid_len
        for rid in rids:
            if len(rid) > rid_len:
                self.stats.error(r.TOO_LARGE)
                continue
            if self.table.pop(rid) is not None:
                self.stats.aborts += 1
            self.tombstones.discard(rid)

    def flush(self) -> int:
        """Drop every request's state; return how many there were."""
        return self.table.clear()
