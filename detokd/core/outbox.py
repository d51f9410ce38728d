"""The hand-off from the core to delivery: one batch's output, by destination.

The core appends output rows to the list of the row's worker (a live request holds
its worker's list, so the hot path is one `append`); delivery takes the lists once
the batch is handled and sends each worker one message. Only workers delivery
knows have a list: a row for any other worker is the caller's error to catch first.
"""

from __future__ import annotations

from .records import OutRow, StoppedRow


class Outbox:
    __slots__ = ("rows", "stopped", "must_answer")

    def __init__(self) -> None:
        self.rows: dict[int, list[OutRow]] = {}  # worker -> this batch's rows, in order
        self.stopped: list[StoppedRow] = []  # this batch's feedback for the scheduler
        self.must_answer: set[int] = set()  # workers that get a message this batch even with no rows

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

    def answer_batch(self, worker: int) -> None:
        """This batch owes `worker` a message even with no rows (SGLang answers an empty
        batch with an empty one: its TokenizerManager's health check waits on it)."""
        self.must_answer.add(worker)

    def take(self) -> list[tuple[int, list[OutRow]]]:
        """Each worker's rows of this batch; the lists are left empty, in place."""
        out = []
        for worker, rows in self.rows.items():
            if rows or worker in self.must_answer:
                out.append((worker, rows[:]))
                rows.clear()
        self.must_answer.clear()
        return out

    def take_stopped(self) -> list[StoppedRow]:
        stopped, self.stopped = self.stopped, []
        return stopped
