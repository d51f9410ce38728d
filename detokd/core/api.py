"""The core as a dialect sees it: every call a wire dialect may make, in one place.

detokd.core.detokenizer.Detokenizer implements it. A dialect hands rows over (`tokens`,
`quick`), asks about requests (`seq_of`, `ended`, `live`, `known`, `takes_whole`), ends
them (`fail`, `bad_rows`, `abort`, `flush`, `stalled`, `too_large_embedding`), and takes
back what all that produced (`take`; `tokens` returns it too). A worker delivery has
connected is the core's to route rows to once the loop or the dialect says so
(`add_worker`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from msgspec import Raw

from .outbox import Produced
from .records import WORKER_STALLED, OutRow, Row

if TYPE_CHECKING:
    from .detokenizer import Limits


class Core(Protocol):
    limits: Limits

    def tokens(self, rows: list[Row], ids_at_most: int | None = None) -> Produced:
        """One engine step's rows; returns what the core produced."""

    def quick(self, rids: list[str], id_rows: list[list[int]], finishes: Sequence[object], metas: list[Raw],
              at: int = 0, in_vocab: bool = False) -> list[str]:
        """The texts of rows `at`, `at + 1`, ... that are a live plain request's next ids,
        up to the first row `tokens` must take. Of `finishes` only whether each is None
        is read (a dialect passes its own finish reasons)."""

    def take(self) -> Produced:
        """What the core produced since the last take."""

    def seq_of(self, rid: str) -> int | None:
        """The ids a live request has consumed (its next row's seq), or None."""

    def ended(self, rid: str) -> bool:
        """Whether detokd ended this rid itself: its rows get that error."""

    def live(self, rid: str) -> bool:
        """Whether the rid is a live request."""

    def known(self, worker: int) -> bool:
        """Whether rows may be routed to `worker`."""

    def add_worker(self, worker: int) -> None:
        """Rows may be routed to `worker` from now on: delivery has connected it."""

    def takes_whole(self, rows: int, ids: int) -> bool:
        """Whether a frame of this many rows and ids is within the frame caps and decoded."""

    def fail(self, rid: str, worker: int, error: str, meta: Raw) -> None:
        """A row the dialect could not read: its request fails with `error`."""

    def end(self, rid: str, worker: int, error: str) -> None:
        """A rid that cannot be decoded here: its rows, from the next on, get `error`."""

    def bad_rows(self, rids: list[str]) -> None:
        """Rows that failed the schema: their requests fail with bad_row."""

    def stalled(self, worker: int, rows: list[OutRow], error: str = WORKER_STALLED) -> list[OutRow]:
        """A message of these rows will never reach `worker`: fail their requests; returns
        the error rows the worker is owed."""

    def too_large_embedding(self, rid: str, worker: int) -> None:
        """An embeddings row beyond the caps."""

    def abort(self, rids: list[str]) -> None:
        """The engine aborted these requests."""

    def flush(self) -> int:
        """Drop every request's state; how many there were."""
