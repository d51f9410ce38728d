"""What one inbound frame produced, encoded: the records a wire dialect hands delivery.

Its own module, below both, so that a dialect's records (and detokd.client, which reads
them) import no socket library.
"""

from __future__ import annotations

from msgspec import Struct

from .core.records import OutRow


class WorkerOut(Struct, gc=False):
    """One worker's share of what a frame produced: the frame(s) to send it, and the
    core's rows they carry (failed if the message is lost)."""

    worker: int
    frames: list[bytes]
    rows: list[OutRow]
    # The dialect's note of what else the frames carry, for its `stalled`: SGLang's
    # quick path answers rows the core never saw as rows.
    carries: object = None
    passthrough: bool = False  # frames sent on as they came (embeddings): a loss is counted, no request fails


class Registration(Struct, gc=False):
    """A peer's `register`: worker `worker` is now at `address`, if the policy allows."""

    worker: int
    address: str


class Output(Struct, gc=False):
    """What one inbound frame produced, encoded, for delivery to send."""

    workers: list[WorkerOut] = []
    feedback: bytes | None = None  # the scheduler's `stopped` message
    feedback_rows: int = 0  # the stopped rows it holds
    register: Registration | None = None
