"""The scheduler side the tools play where detokd.client would not do: raw PUSH sockets.

Honest traffic goes through detokd's own SchedulerClient; these send frames as they
are built (templates filled in, hostile bytes, frames of 64 MiB).
"""

from __future__ import annotations

import zmq


def push(ctx: zmq.Context, address: str, *, hwm: int | None = None, send_ms: int | None = None) -> zmq.Socket:
    """A PUSH socket connected to `address` that drops what is unsent when closed;
    `hwm` 0 queues without bound, `send_ms` bounds how long a send may block."""
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    if hwm is not None:
        s.setsockopt(zmq.SNDHWM, hwm)
    if send_ms is not None:
        s.setsockopt(zmq.SNDTIMEO, send_ms)
    s.connect(address)
    return s


class Engine:
    """A peer at detokd's input. A send that cannot leave within `send_ms` raises
    zmq.Again: detokd takes no input, the run has failed."""

    def __init__(self, ctx: zmq.Context, address: str, send_ms: int) -> None:
        self.sock = push(ctx, address, send_ms=send_ms)

    def send(self, frame: bytes | list[bytes]) -> None:
        """One frame, or the parts of one multipart message. Big frames go without a
        copy (ZMQ keeps a reference while it sends)."""
        if isinstance(frame, list):
            self.sock.send_multipart(frame)
        else:
            self.sock.send(frame, copy=len(frame) < 65536)

    def close(self) -> None:
        self.sock.close(linger=0)
