"""Engine-side helpers for talking to detokd (docs/protocol.md v1).

`SchedulerClient` (detokd.client.scheduler) is what an engine's scheduler uses: it
batches one step's rows, tracks each rid's `seq` and sends one `tokens` message per
detokd shard (`shard_for`). `WorkerClient` (detokd.client.worker) is what a tokenizer
worker uses: an asyncio receiver that turns `text` rows into one async iterator of
text deltas per request; what it keeps for rids nobody reads yet is the policy of
detokd.client.buffer. The two run in different processes and share nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from .scheduler import SchedulerClient, shard_for
from .worker import DetokdError, RequestStream, WorkerClient, WorkerClosed

__all__ = [
    "DetokdError",
    "WorkerClosed",
    "SchedulerClient",
    "WorkerClient",
    "RequestStream",
    "shard_for",
    "run",
]

T = TypeVar("T")


def run(main: Awaitable[T]) -> T:
    """Run a coroutine on uvloop when it is installed, else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)  # type: ignore[arg-type]
    return uvloop.run(main)  # type: ignore[arg-type]
