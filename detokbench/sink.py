"""The tokenizer worker the tools play: PULL sockets bound where detokd sends text.

A Sink's thread hands every frame to `read` outside its lock (decoding a big answer
does not hold up the threads waiting on it), then what `read` returned to `keep` under
the lock, and wakes the waiters. Subclasses say what a frame means to their tool.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import zmq

from .waits import wait_on


def pull(ctx: zmq.Context, address: str, *, hwm: int | None = None) -> zmq.Socket:
    """A PULL socket bound at `address` that drops what is queued when closed; `hwm` 0
    queues without bound."""
    s = ctx.socket(zmq.PULL)
    s.setsockopt(zmq.LINGER, 0)
    if hwm is not None:
        s.setsockopt(zmq.RCVHWM, hwm)
    s.bind(address)
    return s


class Sink:
    """Bound at once (detokd connects to it), read by a thread until `close`.

    `rcvhwm` None keeps ZMQ's default queue; `zero_copy` hands `read` a memoryview of
    the received frame instead of bytes (for frames of a gigabyte)."""

    def __init__(self, ctx: zmq.Context, addresses: list[str], *, rcvhwm: int | None = None, zero_copy: bool = False) -> None:
        self.cond = threading.Condition()
        self.zero_copy = zero_copy
        self.stopping = False
        self.socks = [pull(ctx, a, hwm=rcvhwm) for a in addresses]
        self.thread = threading.Thread(target=self._run, name=type(self).__name__, daemon=True)
        self.thread.start()

    def read(self, frame: bytes | memoryview) -> Any:
        """What a frame says (runs without the lock)."""
        raise NotImplementedError

    def keep(self, got: Any) -> None:
        """Record what `read` returned (runs with the lock held)."""
        raise NotImplementedError

    def wait(self, pred: Callable[[], Any], timeout: float, what: str) -> Any:
        """Until `pred` (run under the lock) holds; TimeoutError naming `what`."""
        return wait_on(self.cond, pred, timeout, what)

    def close(self) -> None:
        self.stopping = True
        self.thread.join(5)

    def _run(self) -> None:
        poller = zmq.Poller()
        for s in self.socks:
            poller.register(s, zmq.POLLIN)
        try:
            while not self.stopping:
                for sock, _ in poller.poll(100):
                    self._drain(sock)
        except zmq.ContextTerminated:
            pass
        finally:
            for s in self.socks:
                s.close(linger=0)

    def _drain(self, sock: zmq.Socket) -> None:
        while True:
            try:
                msg = sock.recv(zmq.NOBLOCK, copy=not self.zero_copy)
            except zmq.Again:
                return
            got = self.read(msg.buffer if self.zero_copy else msg)
            del msg  # a zero-copy frame's memory goes as soon as it is read
            with self.cond:
                self.keep(got)
                self.cond.notify_all()
