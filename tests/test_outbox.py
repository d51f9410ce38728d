"""detokd.core.outbox.Outbox: one batch's output rows, by worker, handed back by `take`."""

from __future__ import annotations

from detokd.core.outbox import Outbox
from detokd.core.records import OutRow, StoppedRow


def test_take_gives_each_worker_its_rows_in_order_and_empties_the_same_lists() -> None:
    box = Outbox()
    box.open(0)
    box.open(1)
    box.open(1)  # opening twice keeps the list
    held = box.rows_of(0)  # what a live request appends to
    held.append(OutRow("a", "x"))
    box.add(1, OutRow("b", "y"))
    box.add(0, OutRow("a", "z"))
    assert box.take().rows == {0: [OutRow("a", "x"), OutRow("a", "z")], 1: [OutRow("b", "y")]}
    assert box.take().rows == {}  # a worker with no rows this batch gets no message
    assert box.rows_of(0) is held and held == []


def test_broadcast_reaches_every_known_worker_and_no_other() -> None:
    box = Outbox()
    box.open(0)
    box.open(2)
    box.broadcast(OutRow("nobody", error="unknown_rid"))
    assert list(box.take().rows) == [0, 2]
    assert box.known(2) and not box.known(1)


def test_stopped_rows_are_taken_once() -> None:
    box = Outbox()
    box.stopped.append(StoppedRow("r", 0, "###", 7))
    assert box.take().stopped == [StoppedRow("r", 0, "###", 7)]
    assert box.take().stopped == []
