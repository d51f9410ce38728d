"""The scheduler side the tools and the tests play where detokd.client would not do:
raw PUSH sockets.

Honest traffic goes through detokd's own SchedulerClient; these send frames as they
are built (dicts through plain msgspec, independent of detokd.wire; templates filled
in; hostile bytes; frames of 64 MiB).
"""

from __future__ import annotations

import msgspec
import zmq

COPY_BELOW = 65536  # bigger frames go without a copy (ZMQ keeps a reference while it sends)


def socket(ctx: zmq.Context, kind: int, address: str, **options: int | None) -> zmq.Socket:
    """A PUSH socket connected to `address`, or a PULL socket bound there, that drops
    what is queued when closed; `options` are zmq's (SNDHWM=...), None leaves one be."""
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        if value is not None:
            s.setsockopt(getattr(zmq, name), value)
    if kind == zmq.PULL:
        s.bind(address)
    else:
        s.connect(address)
    return s


def push(ctx: zmq.Context, address: str, *, hwm: int | None = None, send_ms: int | None = None) -> zmq.Socket:
    """`hwm` 0 queues without bound, `send_ms` bounds how long a send may block."""
    return socket(ctx, zmq.PUSH, address, SNDHWM=hwm, SNDTIMEO=send_ms)


class Engine:
    """A peer at detokd's input. A send that cannot leave within `send_ms` raises
    TimeoutError: detokd takes no input, the run (or the test) has failed."""

    def __init__(self, ctx: zmq.Context, address: str, send_ms: int = 10_000) -> None:
        self.send_ms = send_ms
        self.sock = push(ctx, address, send_ms=send_ms)

    def send(self, msg: dict) -> None:
        self.raw(msgspec.msgpack.encode(msg))

    def rows(self, rows: list[dict]) -> None:
        self.send({"type": "tokens", "rows": rows})

    def raw(self, frame: bytes) -> None:
        try:
            self.sock.send(frame, copy=len(frame) < COPY_BELOW)
        except zmq.Again:
            raise TimeoutError(f"detokd took no input for {self.send_ms} ms") from None

    def multipart(self, frames: list[bytes]) -> None:
        try:
            self.sock.send_multipart(frames)
        except zmq.Again:
            raise TimeoutError(f"detokd took no input for {self.send_ms} ms") from None

    def close(self) -> None:
        self.sock.close(linger=0)
