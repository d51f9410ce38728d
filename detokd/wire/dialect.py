"""What the loop asks of a wire dialect, whichever protocol it speaks.

A dialect turns an inbound frame into calls on the core (rows, aborts, flushes) and
delivery (registers, passthrough frames), and the core's output rows back into frames.
It holds no request state: what it needs to know of a request it asks the core
(`Detokenizer.seq_of`, `ended`, `quick`). Both dialects (detokd.wire.native,
detokd.sglang.dialect) implement it, and the loop knows no other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ..core.records import OutRow, StoppedRow

if TYPE_CHECKING:
    from ..config import Config
    from ..core.detokenizer import Detokenizer
    from ..core.stats import Stats
    from ..delivery import Delivery
    from ..gc_policy import GcPolicy


class Dialect(Protocol):
    name: str

    def handle(self, frame: bytes) -> bool:
        """One inbound frame, done; False when it held no message at all (counted)."""

    def encode_text(self, rows: list[OutRow]) -> bytes | list[bytes]:
        """One worker's rows of this batch as the frame(s) to send it."""

    def unencodable(self, worker: int, rows: list[OutRow], exc: Exception) -> bytes | list[bytes]:
        """`encode_text(rows)` raised `exc` (a value the engine sent that cannot be sent
        on): fail the requests of the rows, and return the frame(s) that tell `worker`
        so, built from nothing the engine sent but the rids."""

    def encode_stopped(self, rows: list[StoppedRow]) -> bytes:
        """The feedback frame of the stop strings detokd found."""

    def stalled(self, worker: int, rows: list[OutRow]) -> list[OutRow]:
        """A message of these rows will never reach `worker`: fail their requests (and
        any the message held that the core never saw as rows), and return the error
        rows the worker is owed once it can be reached again."""


# A dialect is built over the parts it drives, once the server has made them.
DialectFactory = Callable[["Detokenizer", "Delivery", "GcPolicy", "Stats", "Config"], Dialect]
