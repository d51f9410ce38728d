"""What detokd does with each inbound message: the request state machine.

Rows come in, output rows go to the router; nothing here touches a socket, so the
whole behaviour is testable in-process. Every row gets exactly one output row (a
text row or an error row), in arrival order, except rows of a request that detokd
already finished on a stop string of its own, which are swallowed until the
engine's finishing row frees the state.
"""

from __future__ import annotations

import gc
import logging
from ..wire import native as p
from .decoder import Codec
from ..metrics import Stats
from ..delivery import Router
from .stops import StopScanner, trim_engine_stop
from .table import RequestTable, Tombstones

log = logging.getLogger("detokd.core.detokenizer")


class Request:
    __slots__ = ("worker", "outbox", "vid", "n_ids", "step", "stops", "keep_stop", "parts", "stopped", "slow", "decoder")

    def __init__(self, worker: int, outbox: list, start: p.Start, decoder, stops: StopScanner | None) -> None:
        self.worker = worker
        self.outbox = outbox  # the router's row list for this worker
        self.vid = start.vid
        self.n_ids = 0
        self.decoder = decoder
        self.step = decoder.step  # bound once: the loop's one call per row
        self.stops = stops
        self.keep_stop = start.no_stop_trim
        self.parts: list[str] | None = None if start.stream else []
        self.stopped = False  # detokd matched a stop string and finished the request
        # Rows of a plain streaming request take the loop's fast path.
        self.slow = stops is not None or not start.stream


class Detokenizer:
    def __init__(
        self,
        codec: Codec,
        vocab_size: int,
        router: Router,
        *,
        max_states: int,
        max_prompt_tail: int,
        stats: Stats,
    ) -> None:
        self.codec = codec
        self.size = vocab_size
        self.router = router
        self.table: RequestTable[Request] = RequestTable(max_states)
        self.dead = Tombstones(max(1024, max_states))
        self.max_tail = max_prompt_tail
        self.stats = stats
        self.stopped: list[p.StoppedRow] = []  # this batch's feedback for the scheduler

    # --- dispatch ---------------------------------------------------------------------

    def handle(self, msg: p.Inbound) -> None:
        if type(msg) is p.Tokens:
            self.tokens(msg.rows)
        elif type(msg) is p.Embeddings:
            self.embeddings(msg.rows)
        elif type(msg) is p.Abort:
            self.abort(msg.rids)
        elif type(msg) is p.Register:
            self.router.register(msg.worker, msg.address)
        elif type(msg) is p.Control:
            self.control(msg.op)

    def tokens(self, rows: list[p.Row]) -> None:
        """One engine step. The common row (a live, plain streaming request's next ids)
        is handled inline; everything else goes through `_row`."""
        get = self.table.states.get
        size = self.size
        OutRow = p.OutRow
        n_tok = 0
        for row in rows:
            rid = row.rid
            st = get(rid)
            if st is None or st.slow or row.start is not None or row.finish is not None:
                self._guarded(row)
                continue
            ids = row.ids
            n = len(ids)
            seq = st.n_ids
            if row.seq != seq:
                self._guarded(row)
                continue
            if n == 1:
                i = ids[0]
                if not 0 <= i < size:
                    self._guarded(row)
                    continue
                quick = st.decoder.quick
                text = quick[i] if quick is not None else None
            elif n and (max(ids) >= size or min(ids) < 0):
                self._guarded(row)
                continue
            else:
                text = None if n else ""
            seq += n
            st.n_ids = seq
            n_tok += n
            if text is None:
                try:
                    text = st.step(ids)
                except Exception:
                    self._internal(row, st)
                    continue
            st.outbox.append(OutRow(rid, text, None, seq, row.meta, None))
        stats = self.stats
        stats.rows += len(rows)
        stats.tokens += n_tok

    def _guarded(self, row: p.Row) -> None:
        try:
            self._row(row)
        except Exception:
            self._internal(row, self.table.get(row.rid))

    def _internal(self, row: p.Row, st: Request | None) -> None:
        self.stats.error(p.INTERNAL)
        log.exception("internal error decoding rid %r; failing that request only", row.rid)
        if st is not None and self.table.get(row.rid) is st:
            self.table.pop(row.rid)
        self._error(row.rid, st.worker if st is not None else None, p.INTERNAL, row.meta, st.n_ids if st else 0)

    # --- the general row ----------------------------------------------------------------

    def _row(self, row: p.Row) -> None:
        rid = row.rid
        st = self.table.get(rid)
        start = row.start
        if start is not None and (st is None or st.vid != start.vid):
            if st is not None:  # a new vid: the engine retracted and re-runs this request
                self.table.pop(rid)
            st = self._begin(row, start)
            if st is None:
                return
        elif st is None:
            self._unknown(row)
            return
        ids = row.ids
        finish = row.finish
        if st.stopped:
            # detokd finished it already and the worker has its finishing row: until the
            # engine catches up, its rows (even malformed ones) get no row at all.
            if finish is not None:
                self.table.pop(rid)
            return
        if row.seq != st.n_ids:
            self._fail(rid, st, p.SEQUENCE_GAP, row)
            return
        if ids and (max(ids) >= self.size or min(ids) < 0):
            self._fail(rid, st, p.BAD_IDS, row)
            return
        st.n_ids += len(ids)
        self.stats.tokens += len(ids)
        if finish is not None:
            m = finish.matched
            # A stop token is not rendered (SGLang #33151: id 0 is falsy, never trimmed).
            if type(m) is int and not st.keep_stop and ids and ids[-1] == m:
                ids = ids[:-1]
        text, found, k = self._decode(st, ids, finish is not None)
        if found is not None:
            st.stopped = True
            self.stats.stops += 1
            self.stopped.append(p.StoppedRow(rid, st.vid, found, st.n_ids - len(row.ids) + k))
            finish = p.Finish("stop", found)
            if row.finish is not None:
                self.table.pop(rid)
        elif finish is not None:
            self.table.pop(rid)
        if st.parts is not None:  # stream=false: everything comes in the finishing row
            if finish is None:
                st.parts.append(text)
                text = ""
            else:
                text = "".join(st.parts) + text
        if found is None and finish is not None:
            text = trim_engine_stop(text, finish.matched, st.keep_stop)
        st.outbox.append(p.OutRow(rid, text, finish, st.n_ids, row.meta, None))

    def _decode(self, st: Request, ids: list[int], final: bool) -> tuple[str, str | None, int]:
        """New text of these ids through the request's stop scanner: (text, the stop
        string that completed, how many of `ids` it took to complete it)."""
        scanner = st.stops
        if scanner is None:
            text = st.step(ids) if ids else ""
            return (text + st.decoder.finish() if final else text), None, 0
        # Id by id, so a stop string is attributed to the id that completed it.
        out = []
        for k, i in enumerate(ids, 1):
            sent, found = scanner.feed(st.step([i]))
            out.append(sent)
            if found is not None:
                return "".join(out), found, k
        if final:
            sent, found = scanner.feed(st.decoder.finish())
            out.append(sent)
            if found is None:
                out.append(scanner.flush())
            return "".join(out), found, len(ids)
        return "".join(out), None, 0

    def _begin(self, row: p.Row, start: p.Start) -> Request | None:
        rid = row.rid
        self.dead.discard(rid)
        if not self.router.known(start.worker):
            self.stats.error(p.BAD_START)
            log.warning("rid %r names worker %d, which has no address", rid, start.worker)
            self._error(rid, None, p.BAD_START, row.meta, 0)
            return None
        tail = start.prompt_tail[-self.max_tail :] if self.max_tail > 0 else []
        if tail and (max(tail) >= self.size or min(tail) < 0):
            self.stats.error(p.BAD_IDS)
            self._error(rid, start.worker, p.BAD_IDS, row.meta, 0)
            return None
        decoder = self.codec.new(tail, start.skip_special_tokens)
        stops = StopScanner(start.stop, start.no_stop_trim) if any(start.stop) else None
        st = Request(start.worker, self.router.workers[start.worker].rows, start, decoder, stops)
        for old_rid, old in self.table.put(rid, st):
            self.stats.evictions += 1
            if old.stopped:  # finished from the worker's view; only the engine's row was pending
                continue
            self.stats.error(p.EVICTED)
            self.dead.add(old_rid, old.worker, p.EVICTED)
            old.outbox.append(p.OutRow(old_rid, "", None, old.n_ids, p.NIL, p.EVICTED))
        self.stats.started += 1
        return st

    # --- errors -----------------------------------------------------------------------

    def _fail(self, rid: str, st: Request, error: str, row: p.Row) -> None:
        self.table.pop(rid)
        self.stats.error(error)
        self.dead.add(rid, st.worker, error)
        self._error(rid, st.worker, error, row.meta, st.n_ids)

    def _unknown(self, row: p.Row) -> None:
        tomb = self.dead.get(row.rid)
        if tomb is not None and self.router.known(tomb[0]):
            self.stats.error(tomb[1])
            self._error(row.rid, tomb[0], tomb[1], row.meta, 0)
        else:
            self.stats.error(p.UNKNOWN_RID)
            self._error(row.rid, None, p.UNKNOWN_RID, row.meta, 0)

    def _error(self, rid: str, worker: int | None, error: str, meta, n_ids: int) -> None:
        out = p.OutRow(rid, "", None, n_ids, meta, error)
        if worker is None:  # whose it is, nobody here knows: every worker drops rids it does not own
            self.router.broadcast(out)
        else:
            self.router.add(worker, out)

    def bad_rows(self, rids: list[str]) -> None:
        """Rows that failed the schema: their request, if live, is failed too."""
        for rid in rids:
            st = self.table.pop(rid)
            self.stats.error(p.BAD_ROW)
            if st is not None:
                self.dead.add(rid, st.worker, p.BAD_ROW)
            self._error(rid, st.worker if st else None, p.BAD_ROW, p.NIL, st.n_ids if st else 0)

    def stalled(self, worker: int, rows: list[p.OutRow]) -> None:
        """A worker's queue was full and this message was lost: fail its requests.

        Their later rows are answered `worker_stalled`, so a worker that comes back
        learns which of its requests failed instead of waiting on them forever.
        """
        for row in rows:
            if row.error is not None:  # ended already; its tombstone answers later rows
                continue
            st = self.table.get(row.rid)
            if st is not None and st.worker == worker:
                self.table.pop(row.rid)
            self.dead.add(row.rid, worker, p.WORKER_STALLED)
            self.stats.error(p.WORKER_STALLED)

    # --- the other messages -------------------------------------------------------------

    def embeddings(self, rows: list[p.EmbeddingRow]) -> None:
        by_worker: dict[int, list[p.EmbeddingRow]] = {}
        for row in rows:
            by_worker.setdefault(row.worker, []).append(row)
        for worker, batch in by_worker.items():
            if not self.router.known(worker):
                self.stats.error(p.BAD_START)
                log.warning("embeddings for worker %d, which has no address: %d rows dropped", worker, len(batch))
                continue
            if not self.router.send(worker, p.encode(p.Embeddings(batch))):
                self.stats.error(p.WORKER_STALLED)

    def abort(self, rids: list[str]) -> None:
        for rid in rids:
            if self.table.pop(rid) is not None:
                self.stats.aborts += 1
            self.dead.discard(rid)

    def control(self, op: str) -> None:
        if op == "freeze_gc":
            gc.freeze()
            log.info("froze %d objects out of the collector's reach", gc.get_freeze_count())
        elif op == "flush":
            n = self.table.clear()
            log.info("flush: dropped %d request states", n)
        else:
            log.warning("unknown control op %r ignored", op)
