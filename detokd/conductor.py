"""Between a wire dialect and delivery: one frame's way, and the stall policy's decisions.

A frame goes one way: the dialect handles it (the core decides) and returns what it
produced, encoded (`detokd.output.Output`); delivery sends it and returns what it could not.
Where the stall policy needs requests failed or error rows encoded (a message a full
queue lost, rows a broken connection took, rows owed to a worker), the conductor asks
the dialect (which asks the core) and hands delivery the result: delivery never calls
back into the dialect or the core. A peer's register goes the same way: delivery
connects the worker, then the conductor tells the core it may route rows there.
"""

from __future__ import annotations

from . import logs
from .core.api import Core
from .core.records import INTERNAL, WORKER_STALLED
from .core.stats import Stats
from .delivery import Delivery
from .output import Output, WorkerOut
from .wire.dialect import Dialect

log = logs.get(__name__)


class Conductor:
    def __init__(self, dialect: Dialect, core: Core, delivery: Delivery, stats: Stats) -> None:
        self.dialect = dialect
        self.core = core
        self.delivery = delivery
        self.stats = stats

    def frame(self, frame: bytes) -> bool:
        """One inbound frame: handled by the dialect, what it produced sent. A bug costs
        that frame, never the process. False when the frame held no message at all."""
        try:
            out = self.dialect.handle(frame)
            if out is None:
                return False  # counted as a bad frame, nothing to deliver
        except Exception:
            self.stats.error(INTERNAL)
            log.exception("internal error handling a frame")
            out = self._leftovers()
        try:
            self.deliver(out)
        except Exception:
            self.stats.error(INTERNAL)
            log.exception("internal error delivering a frame's output")
        return True

    def deliver(self, out: Output) -> None:
        """Send `out`; a worker's message lost to a full queue fails its requests, and the
        worker is owed their error rows."""
        delivery = self.delivery
        if out.register is not None and delivery.register(out.register.worker, out.register.address):
            self.core.add_worker(out.register.worker)
        for lost in delivery.deliver(out):
            if lost.passthrough:  # no request's rows: counted only
                self.stats.error(WORKER_STALLED)
                continue
            log.warning("worker %d's queue is full: %d rows lost, their requests failed", lost.worker, len(lost.rows))
            delivery.owe(lost.worker, self.dialect.stalled(lost))
        if delivery.broken:  # a register moved a connected worker
            self.fail_broken()

    def _leftovers(self) -> Output:
        """What the core produced for a frame whose handling failed: sent as rows of no
        frame in hand (the dialect's `encode_loose`), so no row waits for the next frame."""
        encode = self.dialect.encode_loose
        rows = self.core.take().rows
        return Output([WorkerOut(worker, encode(worker, held), held) for worker, held in rows.items()])

    def between_batches(self) -> None:
        """Connections that broke fail what was in flight on them; error rows owed to
        workers (a full queue, a broken connection) go out once they have room."""
        delivery = self.delivery
        delivery.watch_connections()
        if delivery.broken:
            self.fail_broken()
        self.send_owed()

    def fail_broken(self) -> None:
        """Rows of live requests that broken connections took: their requests fail; the
        error rows of those with rows still queued go ahead of them, the others are owed."""
        delivery, dialect = self.delivery, self.dialect
        for lost in delivery.take_broken():
            errors = dialect.stalled(lost)
            ahead = delivery.ahead(lost.worker, errors)
            delivery.fail_going(lost.worker, errors, ahead, dialect.encode_loose(lost.worker, ahead) if ahead else [])

    def send_owed(self) -> None:
        """Owed error rows to each worker whose queue has room, but for rids that began a
        new request since (the error is not theirs)."""
        live = self.core.live
        for w in self.delivery.owed_ready():
            rows = [row for rid, row in w.owed.items() if not live(rid)]
            self.delivery.settle_owed(w, self.dialect.encode_loose(w.index, rows) if rows else [], rows)
