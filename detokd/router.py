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

from . import protocol
from .protocol import OutRow

log = logging.getLogger("detokd.router")


@dataclass
class Worker:
    index: int
    address: str
    socket: zmq.Socket | None = None
    sent: int = 0  # messages
    dropped: int = 0  # messages that found the queue full
    rows: list = field(default_factory=list)  # this batch's rows


class Router:
    def __init__(self, ctx: zmq.Context, addresses: list[str], *, hwm: int, linger_ms: int) -> None:
        self.ctx = ctx
        self.hwm = hwm
        self.linger_ms = linger_ms
        self.workers: dict[int, Worker] = {}
        for i, address in enumerate(addresses):
            self.register(i, address)

    def register(self, index: int, address: str) -> None:
        """Add worker `index`, or move it to a new address (it rebound elsewhere)."""
        w = self.workers.get(index)
        if w is None:
            self.workers[index] = Worker(index, address)
        elif w.address != address:
            # Same Worker object: live requests hold its row list as their outbox.
            if w.socket is not None:
                w.socket.close(linger=0)
                w.socket = None
            w.address = address
        else:
            return
        log.info("worker %d at %s", index, address)

    def known(self, index: int) -> bool:
        return index in self.workers

    def _socket(self, w: Worker) -> zmq.Socket:
        if w.socket is None:  # lazily: a registered worker may not be listening yet
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, self.hwm)
            s.setsockopt(zmq.LINGER, self.linger_ms)
            s.connect(w.address)
            w.socket = s
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

    def writable(self, index: int) -> bool:
        """Whether the worker's send queue has room: ZMQ exposes no depth, only this."""
        w = self.workers[index]
        return w.socket is None or bool(w.socket.getsockopt(zmq.EVENTS) & zmq.POLLOUT)

    def close(self) -> None:
        for w in self.workers.values():
            if w.socket is not None:
                w.socket.close(linger=self.linger_ms)
                w.socket = None
