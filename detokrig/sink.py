"""The tokenizer worker the tools and the tests play: PULL sockets bound where detokd
sends text.

A Sink's thread hands every frame to `read` outside its lock (decoding a big answer
does not hold up the threads waiting on it), then what `read` returned to `keep` under
the lock, and wakes the waiters. Subclasses say what a frame means to their tool;
`Recorder` keeps every row, by rid (the tests' worker).
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

import msgspec
import zmq

from .engine import socket
from .waits import wait_on


def pull(ctx: zmq.Context, address: str, *, hwm: int | None = None, rcvbuf: int | None = None) -> zmq.Socket:
    """`hwm` 0 queues without bound, `rcvbuf` shrinks the kernel's buffer (a worker that
    stalls then holds little: the queue fills in detokd)."""
    return socket(ctx, zmq.PULL, address, RCVHWM=hwm, RCVBUF=rcvbuf)


class Sink:
    """Bound at once (detokd connects to it), read by a thread until `close`. `zero_copy`
    hands `read` a memoryview of the frame instead of bytes (for frames of a gigabyte)."""

    def __init__(self, ctx: zmq.Context, addresses: str | list[str], *, rcvhwm: int | None = None,
                 zero_copy: bool = False) -> None:
        addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        self.ctx, self.address = ctx, addresses[0]
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
        """`pred`'s value once it is truthy (run under the lock, whenever a frame
        arrived); TimeoutError naming `what`."""
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


class Recorder(Sink):
    """Keeps every row it receives as a dict, by rid: `text` rows in `by_rid`,
    `embeddings` rows in `embedded`; counts messages."""

    def __init__(self, ctx: zmq.Context, addresses: str | list[str], **kw: Any) -> None:
        self.by_rid: dict[str, list[dict]] = collections.defaultdict(list)
        self.embedded: dict[str, list[dict]] = collections.defaultdict(list)
        self.messages = 0
        super().__init__(ctx, addresses, **kw)

    def read(self, frame: bytes) -> dict:
        return msgspec.msgpack.decode(frame)

    def keep(self, msg: dict) -> None:
        self.messages += 1
        rows = self.by_rid if msg["type"] == "text" else self.embedded
        for row in msg["rows"]:
            rows[row["rid"]].append(row)

    def rows(self, rid: str) -> list[dict]:
        with self.cond:
            return list(self.by_rid.get(rid, ()))

    def text(self, rid: str) -> str:
        return "".join(r["text"] for r in self.rows(rid) if r["error"] is None)

    def ended(self, rid: str) -> bool:
        """Its last row arrived: a finish, or an error."""
        rows = self.rows(rid)
        return bool(rows) and (rows[-1]["finish"] is not None or rows[-1]["error"] is not None)

    def errors(self, rid: str) -> list[str]:
        return [r["error"] for r in self.rows(rid) if r["error"] is not None]
