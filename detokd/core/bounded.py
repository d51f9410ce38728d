"""BoundedMap: an insertion-ordered map bounded in entries and, optionally, in bytes.

Every bounded memory detokd keeps (request states, tombstones, stop automata, error
rows owed to a worker, log-rate windows, a client's buffers) is one of these: putting
an entry evicts the oldest ones until both bounds hold, and hands them back so the
caller can tell whoever owned them.

A utility shared by the whole package, not a part of the core's logic: it lives in
core/ because the core needs it (table.py, stops.py) and the core imports nothing of
detokd outside core/ but the tokenizer and logs (tests/test_layers.py); delivery and
the client import it from here.

Eviction is O(1) per entry: an OrderedDict's popitem(last=False) unlinks the head of
its list. A plain dict's `next(iter(d))` is not: it walks the deleted slots at the
front of the dict's entry array, which at 65,536 entries in steady eviction cost
50-90 us per put.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Callable, Generic, Iterator, TypeVar

K = TypeVar("K")
V = TypeVar("V")


def _free(key: object, value: object) -> int:
    return 0


class BoundedMap(Generic[K, V]):
    """At most `max_len` entries and, with a `cost(key, value)` function, at most
    `max_bytes` of their costs; the oldest entries go first.

    `put` of a key already present replaces its value and makes it the newest;
    `refresh` makes an entry the newest without replacing it (least-recently-used
    order). An entry that alone costs more than `max_bytes` is evicted at once, by
    the put that brought it: the bounds always hold after a put.

    `data` is the underlying OrderedDict, for callers that bind `data.get` on a hot
    path; change it only through the methods, or the byte count goes wrong.
    """

    __slots__ = ("max_len", "max_bytes", "cost", "data", "costs", "nbytes", "evictions")

    def __init__(self, max_len: int, max_bytes: int | None = None, cost: Callable[[K, V], int] | None = None) -> None:
        if max_len < 1:
            raise ValueError("max_len must be at least 1")
        if (max_bytes is None) != (cost is None):
            raise ValueError("a byte bound needs a cost function, and a cost function a byte bound")
        self.max_len = max_len
        # Without a byte bound, `costs` is None and these two are never read: typed as
        # always present, so put and _evict need no per-call narrowing.
        self.max_bytes: int = max_bytes if max_bytes is not None else sys.maxsize
        self.cost: Callable[[K, V], int] = cost if cost is not None else _free
        self.data: OrderedDict[K, V] = OrderedDict()
        self.costs: dict[K, int] | None = {} if cost is not None else None  # key -> its cost when put
        self.nbytes = 0  # the sum of the entries' costs (0 without a cost function)
        self.evictions = 0  # entries evicted to keep the bounds, in all

    def put(self, key: K, value: V) -> list[tuple[K, V]]:
        """Insert or replace `key` as the newest entry; return the evicted (key, value)
        pairs, oldest first (the new entry itself last, if it alone breaks max_bytes)."""
        data = self.data
        costs = self.costs
        if key in data:
            data.move_to_end(key)
            if costs is not None:
                self.nbytes -= costs[key]
        data[key] = value
        if costs is not None:
            c = costs[key] = self.cost(key, value)
            self.nbytes += c
        if len(data) <= self.max_len and (costs is None or self.nbytes <= self.max_bytes):
            return []
        return self._evict()

    def _evict(self) -> list[tuple[K, V]]:
        data, costs, max_len, max_bytes = self.data, self.costs, self.max_len, self.max_bytes
        evicted = []
        while data and (len(data) > max_len or (costs is not None and self.nbytes > max_bytes)):
            key, value = data.popitem(last=False)
            if costs is not None:
                self.nbytes -= costs.pop(key)
            evicted.append((key, value))
        self.evictions += len(evicted)
        return evicted

    def get(self, key: K, default: V | None = None) -> V | None:
        return self.data.get(key, default)

    def refresh(self, key: K) -> None:
        """Make a present entry the newest (a cache hit)."""
        self.data.move_to_end(key)

    def pop(self, key: K, default: V | None = None) -> V | None:
        data = self.data
        if key not in data:
            return default
        if self.costs is not None:
            self.nbytes -= self.costs.pop(key)
        return data.pop(key)

    def oldest(self) -> tuple[K, V] | None:
        """The oldest entry, without removing it (None when empty)."""
        for item in self.data.items():
            return item
        return None

    def clear(self) -> int:
        """Drop every entry (not counted as evictions); return how many there were."""
        n = len(self.data)
        self.data.clear()
        if self.costs is not None:
            self.costs.clear()
        self.nbytes = 0
        return n

    def items(self) -> list[tuple[K, V]]:
        """A snapshot, oldest first: safe to pop or put while going through it."""
        return list(self.data.items())

    def keys(self) -> list[K]:
        return list(self.data)

    def values(self) -> list[V]:
        return list(self.data.values())

    def __getitem__(self, key: K) -> V:
        return self.data[key]

    def __contains__(self, key: object) -> bool:
        return key in self.data

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self) -> Iterator[K]:
        return iter(self.data)

    def __repr__(self) -> str:
        bound = f", {self.nbytes}/{self.max_bytes} bytes" if self.costs is not None else ""
        return f"BoundedMap({len(self.data)}/{self.max_len} entries{bound})"
