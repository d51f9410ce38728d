"""The core's accumulator of one batch's output, by destination, and what it hands back.

The core appends output rows to the list of the row's worker (a live request holds
its worker's list, so the hot path is one `append`); `take` hands back what the batch
produced (`Produced`) and leaves the lists empty, in place. Only workers delivery has
connected have a list (the config's from the start, the others by `Detokenizer.add_worker`):
a row for any other worker is the caller's error to catch first.
"""

from __future__ import annotations

from collections.abc import Iterable

from msgspec import Struct

from .records import OutRow, StoppedRow


class Produced(Struct, gc=False):
    """What the core produced since the last take: each worker's rows in order (a
    worker with none is left out), and the feedback for the scheduler."""

    rows: dict[int, list[OutRow]]
    stopped: list[StoppedRow]


class Outbox:
    __slots__ = ("rows", "stopped")

    def __init__(self, workers: Iterable[int] = ()) -> None:
        self.rows: dict[int, list[OutRow]] = {w: [] for w in workers}  # worker -> this batch's rows, in order
        self.stopped: list[StoppedRow] = []  # this batch's feedback for the scheduler

    def open(self, worker: int) -> None:
        self.rows.setdefault(worker, [])

    def known(self, worker: int) -> bool:
        return worker in self.rows

    def rows_of(self, worker: int) -> list[OutRow]:
        """The list a request appends its rows to; it stays the same list for good."""
        return self.rows[worker]

    def add(self, worker: int, row: OutRow) -> None:
        self.rows[worker].append(row)

    def broadcast(self, row: OutRow) -> None:
        """A row whose worker nobody knows: every worker drops rids it does not own."""
        for rows in self.rows.values():
            rows.append(row)

    def take(self) -> Produced:
        """What was produced since the last take; the lists are left empty, in place."""
        out = {}
        for worker, rows in self.rows.items():
            if rows:
                out[worker] = rows[:]
                rows.clear()
        stopped, self.stopped = self.stopped, []
        return Produced(out, stopped)
