"""BoundedMap, and the request table and tombstones built on it.

The specification is a naive model: a list of (key, value, cost) in insertion order,
from whose front entries go until at most max_len remain and their costs sum to at
most max_bytes. Cost is counted (evictions, bytes), never timed.
"""

from __future__ import annotations

import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from detokd.core.bounded import BoundedMap
from detokd.core.table import TOMBSTONE_BYTES, RequestTable, Tombstones


def size(key: str, value: int) -> int:
    return len(key) + value


class Model:
    def __init__(self, max_len: int, max_bytes: int | None) -> None:
        self.max_len, self.max_bytes = max_len, max_bytes
        self.entries: list[tuple[str, int]] = []

    def nbytes(self) -> int:
        return sum(size(k, v) for k, v in self.entries) if self.max_bytes is not None else 0

    def put(self, key: str, value: int) -> list[tuple[str, int]]:
        self.entries = [(k, v) for k, v in self.entries if k != key] + [(key, value)]
        evicted = []
        while self.entries and (len(self.entries) > self.max_len or (self.max_bytes is not None and self.nbytes() > self.max_bytes)):
            evicted.append(self.entries.pop(0))
        return evicted

    def pop(self, key: str) -> int | None:
        for k, v in self.entries:
            if k == key:
                self.entries.remove((k, v))
                return v
        return None

    def refresh(self, key: str) -> None:
        value = self.pop(key)
        self.entries.append((key, value))


ops = st.lists(
    st.tuples(st.sampled_from(["put", "put", "put", "pop", "refresh", "get"]), st.sampled_from("abcdefghij"), st.integers(0, 30)),
    max_size=60,
)


@given(st.integers(1, 6), st.one_of(st.none(), st.integers(0, 80)), ops)
def test_a_bounded_map_behaves_like_the_naive_model(max_len: int, max_bytes: int | None, program) -> None:
    m = BoundedMap(max_len, max_bytes, size if max_bytes is not None else None)
    model = Model(max_len, max_bytes)
    evictions = 0
    for op, key, value in program:
        if op == "put":
            got = m.put(key, value)
            assert got == model.put(key, value)
            evictions += len(got)
        elif op == "pop":
            assert m.pop(key) == model.pop(key)
        elif op == "refresh" and key in m:
            m.refresh(key)
            model.refresh(key)
        else:
            assert m.get(key) == dict(model.entries).get(key)
        assert m.items() == model.entries
        assert len(m) == len(model.entries) and m.nbytes == model.nbytes()
        assert m.oldest() == (model.entries[0] if model.entries else None)
        assert m.evictions == evictions
    assert m.clear() == len(model.entries) and len(m) == 0 and m.nbytes == 0


def test_an_entry_costlier_than_the_whole_budget_is_evicted_by_its_own_put() -> None:
    m = BoundedMap(10, 100, size)
    m.put("a", 10)
    assert m.put("b", 500) == [("a", 10), ("b", 500)]
    assert len(m) == 0 and m.nbytes == 0


def test_a_byte_bound_comes_with_a_cost_function() -> None:
    with pytest.raises(ValueError):
        BoundedMap(10, 100)
    with pytest.raises(ValueError):
        BoundedMap(10, cost=size)
    with pytest.raises(ValueError):
        BoundedMap(0)


def test_eviction_at_capacity_takes_one_entry_per_put_after_any_churn() -> None:
    """The pattern that made `next(iter(dict))` walk tens of thousands of deleted slots
    per put: a full table, requests finishing in the middle, and every new request
    evicting the oldest. Each put at capacity evicts exactly one entry, the oldest."""
    n = 4096
    t: RequestTable[int] = RequestTable(n)
    for i in range(n):
        assert t.put(f"r{i}", i) == []
    last, evicted = -1, 0
    for i in range(n, 20 * n):
        if i % 3 == 0:  # a request in the middle finishes
            t.pop(f"r{i - n // 2}")
        full = len(t) == n
        got = t.put(f"r{i}", i)
        assert len(got) == (1 if full else 0) and len(t) == n
        for rid, state in got:
            assert rid == f"r{state}" and state > last  # oldest first, each once
            last = state
        evicted += len(got)
    assert t.evictions == evicted > 10 * n


def test_the_request_table_keeps_its_api() -> None:
    t: RequestTable[str] = RequestTable(2)
    assert t.put("a", "A") == [] and t.put("b", "B") == []
    assert t.put("c", "C") == [("a", "A")]
    assert "b" in t and "a" not in t and len(t) == 2 and t.capacity == 2
    assert t.get("b") == "B" and t.states.get("c") == "C" and t.get("a") is None
    for rid, _ in t.items():  # a snapshot: popping while going through it is safe
        t.pop(rid)
    assert len(t) == 0 and t.pop("b") is None
    t.put("x", "X")
    assert t.clear() == 1 and len(t) == 0
    with pytest.raises(ValueError):
        RequestTable(0)


def test_tombstones_keep_the_newest_per_rid_and_forget_the_oldest() -> None:
    ts = Tombstones(2)
    ts.add("a", 0, "evicted")
    ts.add("b", 1, "bad_ids")
    ts.add("a", 2, "sequence_gap")  # re-added: newest again
    ts.add("c", 3, "bad_row")
    assert ts.get("b") is None and ts.get("a") == (2, "sequence_gap") and ts.get("c") == (3, "bad_row")
    ts.discard("a")
    ts.discard("zz")
    assert len(ts) == 1


def test_tombstones_of_huge_rids_stay_within_the_default_byte_budget() -> None:
    """Rids are the peer's strings: ten of 8 MiB each would hold 80 MiB in 1,024 slots."""
    ts = Tombstones(1024)
    rids = [f"{k}:" + "r" * (8 << 20) for k in range(10)]
    for rid in rids:
        ts.add(rid, 0, "evicted")
    held = [rid for rid in rids if ts.get(rid) is not None]
    assert sum(map(sys.getsizeof, held)) <= ts.nbytes <= TOMBSTONE_BYTES
    assert held == rids[-len(held) :] and 0 < len(held) < len(rids)  # the newest are kept
    ts.add("small", 0, "evicted")
    assert ts.get("small") == (0, "evicted")
