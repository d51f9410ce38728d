"""Workers, their PUSH sockets, and one outgoing message per worker per batch.

Each worker gets its own PUSH socket with a bounded send queue. Sends never block:
a worker that stops reading fills its own queue and only its requests fail
(`worker_stalled`), while every other worker is served as before (SGLang #29366
fanned out one message per request and stalled everyone behind one slow peer).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import zmq

from .wire import native as protocol
from .wire.native import OutRow

log = logging.getLogger("detokd.delivery")


@dataclass
class Worker:
    index: int
    address: str
    socket: zmq.Socket | None = None
    sent: int = 0  # messages
    dropped: int = 0  # messages that found the queue full
    rows: list = field(default_factory=list)  # this batch's rows
    owed: dict = field(default_factory=dict)  # rid -> error row a full queue kept from this worker


MAX_OWED = 65536  # error rows kept per worker for when it has room again


class Router:
    def __init__(self, ctx: zmq.Context, addresses: list[str], *, hwm: int, linger_ms: int, stats=None) -> None:
        self.ctx = ctx
        self.hwm = hwm
        self.linger_ms = linger_ms
        self.stats = stats  # metrics.Stats: counts refused registers
        self.workers: dict[int, Worker] = {}
        for i, address in enumerate(addresses):
            if not self.register(i, address):
                self.close()
                raise ValueError(f"cannot connect to worker {i} at {address}")

    def register(self, index: int, address: str) -> bool:
        """Add worker `index`, or move it to a new address (it rebound elsewhere).

        Connects at once (ZMQ connects need no listener yet), so an address ZMQ refuses
        (malformed, an unknown transport, a path too long, no sockets left) is refused
        here and the worker stays as it was: a bad `register` from the wire must not
        take the loop down at its next send. False when refused.
        """
        w = self.workers.get(index)
        if w is not None and w.address == address:
            return True
        try:
            sock = self._connect(address)
        except zmq.ZMQError as exc:
            if self.stats is not None:
                self.stats.error("bad_register")
            log.warning("worker %d: cannot connect to %r (%s); register refused", index, address, exc.strerror)
            return False
        if w is None:
            self.workers[index] = Worker(index, address, sock)
        else:
            # Same Worker object: live requests hold its row list as their outbox.
            if w.socket is not None:
                w.socket.close(linger=0)
            w.socket = sock
            w.address = address
        log.info("worker %d at %s", index, address)
        return True

    def known(self, index: int) -> bool:
        return index in self.workers

    def _connect(self, address: str) -> zmq.Socket:
        s = self.ctx.socket(zmq.PUSH)
        try:
            s.setsockopt(zmq.SNDHWM, self.hwm)
            s.setsockopt(zmq.LINGER, self.linger_ms)
            s.connect(address)
        except zmq.ZMQError:
            s.close(linger=0)
            raise
        return s

    def _socket(self, w: Worker) -> zmq.Socket:
        if w.socket is None:  # only after close()
            w.socket = self._connect(w.address)
        return w.socket

    def add(self, index: int, row: OutRow) -> None:
        self.workers[index].rows.append(row)

    def broadcast(self, row: OutRow) -> None:
        for w in self.workers.values():
            w.rows.append(row)

    def send(self, index: int, frame: bytes) -> bool:
        w = self.workers.get(index)
        if w is None:
            return False
        try:
            self._socket(w).send(frame, zmq.NOBLOCK, copy=len(frame) < 65536)
        except zmq.Again:
            w.dropped += 1
            return False
        w.sent += 1
        return True

    def flush(self) -> list[tuple[Worker, list[OutRow]]]:
        """Send each worker its batch rows in one message; return what could not be queued."""
        failed = []
        encode, Text = protocol.encode, protocol.Text
        for w in self.workers.values():
            rows = w.rows
            if not rows:
                continue
            frame = encode(Text(rows))
            if not self.send(w.index, frame):
                failed.append((w, list(rows)))
            rows.clear()  # in place: live requests hold this list as their outbox
        return failed

    def owe(self, index: int, rows: list[OutRow]) -> None:
        """Error rows for requests that failed because this worker's queue was full.

        They leave (`settle`) once the queue has room again, so a worker that comes
        back learns which of its requests failed even when the engine sends no more
        rows for them (the lost message held their finishing rows).
        """
        owed = self.workers[index].owed
        for row in rows:
            owed.pop(row.rid, None)
            owed[row.rid] = row
        while len(owed) > MAX_OWED:
            del owed[next(iter(owed))]

    def settle(self, restarted) -> None:
        """Send owed error rows to each worker whose queue has room; `restarted(rid)`
        says a rid began a new request since, whose error this is not."""
        for w in self.workers.values():
            if not w.owed or not self.has_room(w):
                continue
            rows = [row for rid, row in w.owed.items() if not restarted(rid)]
            if rows:
                try:
                    w.socket.send(protocol.encode(protocol.Text(rows)), zmq.NOBLOCK)
                except zmq.Again:
                    continue
                w.sent += 1
            w.owed.clear()

    @staticmethod
    def has_room(w: Worker) -> bool:
        """Whether the worker's send queue has room: ZMQ exposes no depth, only this."""
        return w.socket is not None and bool(w.socket.getsockopt(zmq.EVENTS) & zmq.POLLOUT)

    def close(self) -> None:
        for w in self.workers.values():
            if w.socket is not None:
                w.socket.close(linger=self.linger_ms)
                w.socket = None
