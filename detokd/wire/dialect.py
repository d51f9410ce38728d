"""What the loop asks of a wire dialect, whichever protocol it speaks.

A dialect turns an inbound frame into calls on the core (detokd.core.api.Core) and
returns what the frame produced, encoded (`detokd.output.Output`): the loop hands that to
delivery, which only moves bytes. It holds no request state, and nothing of one frame
waits on it for the next: what it needs to know of a request it asks the core. Both
dialects (detokd.wire.native, detokd.sglang.dialect) implement it, and the loop knows
no other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ..core.records import OutRow
from ..output import Output, WorkerOut

if TYPE_CHECKING:
    from ..config import Config
    from ..core.api import Core
    from ..core.stats import Stats
    from ..delivery import Delivery
    from ..gc_policy import GcPolicy


class Dialect(Protocol):
    name: str

    def handle(self, frame: bytes) -> Output | None:
        """One inbound frame, done: what it produced, encoded; None when it held no
        message at all (counted)."""

    def stalled(self, out: WorkerOut) -> list[OutRow]:
        """`out` will never reach its worker (a full queue), or was lost with its
        connection: fail the requests of its rows with worker_stalled (and any the
        message held that the core never saw as rows), and return the error rows the
        worker is owed."""

    def encode_loose(self, worker: int, rows: list[OutRow]) -> list[bytes]:
        """Rows of no frame in hand (error rows owed after a loss, rows a failed
        `handle` left with the core) as the frames that tell `worker`: none where the
        protocol places rows only within their own batch (the rows' requests are then
        answered from their tombstones)."""


# A dialect is built over the parts it drives, once the server has made them.
DialectFactory = Callable[["Core", "Delivery", "GcPolicy", "Stats", "Config"], Dialect]
