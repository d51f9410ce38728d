"""The capacity-bounded request table, and a memory of rids that ended in error.

A dict keeps insertion order, so the oldest live request is the first key: making
room evicts it in O(1). The evicted state is handed back to the caller, which tells
its worker at once (SGLang #2812: evicting silently, or rebuilding state later,
drops text).
"""

from __future__ import annotations

from typing import Generic, Iterator, NamedTuple, TypeVar

S = TypeVar("S")


class RequestTable(Generic[S]):
    __slots__ = ("capacity", "states")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.states: dict[str, S] = {}

    def get(self, rid: str) -> S | None:
        return self.states.get(rid)

    def put(self, rid: str, state: S) -> list[tuple[str, S]]:
        """Insert a new request; return the (rid, state) pairs evicted to make room."""
        evicted = []
        states = self.states
        while len(states) >= self.capacity:
            old = next(iter(states))
            evicted.append((old, states.pop(old)))
        states[rid] = state
        return evicted

    def pop(self, rid: str) -> S | None:
        return self.states.pop(rid, None)

    def clear(self) -> int:
        n = len(self.states)
        self.states.clear()
        return n

    def __len__(self) -> int:
        return len(self.states)

    def __contains__(self, rid: str) -> bool:
        return rid in self.states

    def items(self) -> Iterator[tuple[str, S]]:
        return iter(list(self.states.items()))


class Tomb(NamedTuple):
    worker: int  # whose request it was
    error: str  # the error word it ended with


class Tombstones:
    """rid -> Tomb(worker, error) for requests detokd ended itself, bounded.

    A later row of such a rid is answered with the same error, to its own worker,
    instead of a broadcast "unknown_rid".
    """

    __slots__ = ("capacity", "dead")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.dead: dict[str, Tomb] = {}

    def add(self, rid: str, worker: int, error: str) -> None:
        dead = self.dead
        dead.pop(rid, None)
        dead[rid] = Tomb(worker, error)
        while len(dead) > self.capacity:
            del dead[next(iter(dead))]

    def get(self, rid: str) -> Tomb | None:
        return self.dead.get(rid)

    def discard(self, rid: str) -> None:
        self.dead.pop(rid, None)

    def __len__(self) -> int:
        return len(self.dead)
