"""The capacity-bounded request table, and a memory of rids that ended in error.

Both are BoundedMaps: making room evicts the oldest entry in O(1). The evicted
request states are handed back to the caller, which tells their workers at once
(SGLang #2812: evicting silently, or rebuilding state later, drops text).
"""

from __future__ import annotations

import sys
from typing import Generic, NamedTuple, TypeVar

from .bounded import BoundedMap

S = TypeVar("S")

# What one tombstone costs besides its rid's characters: the OrderedDict's slot and
# link node, the (worker, error) tuple and the worker's int (the error string is one
# of the protocol's constants, shared).
TOMBSTONE_OVERHEAD = 200
TOMBSTONE_BYTES = 64 << 20  # default budget: about 300,000 tombstones of 36-character rids


class RequestTable(BoundedMap[str, S], Generic[S]):
    """rid -> request state, at most `capacity` of them; the oldest is evicted first."""

    __slots__ = ()

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        super().__init__(capacity)

    @property
    def capacity(self) -> int:
        return self.max_len

    @property
    def states(self):
        """The rid -> state mapping itself, for the loop's bound `states.get`."""
        return self.data

    def put(self, rid: str, state: S) -> list[tuple[str, S]]:
        """Insert a request as the newest; return the (rid, state) pairs evicted to make room."""
        return super().put(rid, state)


class Tomb(NamedTuple):
    worker: int  # whose request it was
    error: str  # the error word it ended with


def tombstone_cost(rid: str, tomb: Tomb) -> int:
    return sys.getsizeof(rid) + TOMBSTONE_OVERHEAD


class Tombstones:
    """rid -> Tomb(worker, error) for requests detokd ended itself, bounded in entries and
    in bytes (rids are the peer's strings, of any length).

    A later row of such a rid is answered with the same error, to its own worker,
    instead of a broadcast "unknown_rid". A rid too long for the whole byte budget
    is not remembered: its later rows get "unknown_rid".
    """

    __slots__ = ("tombs",)

    def __init__(self, capacity: int, max_bytes: int = TOMBSTONE_BYTES) -> None:
        self.tombs: BoundedMap[str, Tomb] = BoundedMap(capacity, max_bytes, tombstone_cost)

    @property
    def capacity(self) -> int:
        return self.tombs.max_len

    @property
    def nbytes(self) -> int:
        return self.tombs.nbytes

    def add(self, rid: str, worker: int, error: str) -> None:
        self.tombs.put(rid, Tomb(worker, error))

    def get(self, rid: str) -> Tomb | None:
        return self.tombs.get(rid)

    def discard(self, rid: str) -> None:
        self.tombs.pop(rid)

    def __len__(self) -> int:
        return len(self.tombs)
