"""detokd.client.buffer: what a WorkerClient keeps for rids with no open stream.

The policy alone, with no socket and no event loop: rows go in by `offer`, a stream
opening is `claim`, a stream ending is `released`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from utils import out_row

from detokd.client.buffer import Buffer, ends
from detokd.wire import native

REPO = Path(__file__).resolve().parents[1]


def test_rows_of_an_unclaimed_rid_wait_in_order_for_its_claim() -> None:
    b = Buffer(4)
    for r in (out_row("a", "x", 1), out_row("b", "y", 1), out_row("a", "z", 2, finish="stop")):
        b.offer(r)
    assert len(b) == 2
    assert [r.text for r in b.claim("a")] == ["x", "z"]
    assert len(b) == 1 and b.claim("a") == []


def test_at_the_bound_the_oldest_unclaimed_rid_is_dropped_and_counted() -> None:
    b = Buffer(3)
    for i in range(1000):
        b.offer(out_row(f"u{i}", "t", 1))
        assert len(b) == min(i + 1, 3)
    assert b.dropped_rids == 997
    assert [r.rid for rid in ("u997", "u998", "u999") for r in b.claim(rid)] == ["u997", "u998", "u999"]
    assert b.claim("u0") == []


def test_max_buffered_zero_keeps_nothing() -> None:
    b = Buffer(0)
    b.offer(out_row("a", "x", 1))
    assert len(b) == 0 and b.dropped_rids == 1 and b.claim("a") == []


def test_a_negative_bound_is_refused() -> None:
    with pytest.raises(ValueError):
        Buffer(-1)


def test_an_error_row_for_a_rid_never_seen_is_ignored_not_buffered() -> None:
    """detokd sends errors for rids it cannot place to every worker."""
    b = Buffer(4)
    b.offer(out_row("theirs", error=native.UNKNOWN_RID))
    assert len(b) == 0 and b.ignored_errors == 1
    b.offer(out_row("mine", "t", 1))
    b.offer(out_row("mine", error=native.EVICTED))  # a buffered rid's error waits for its reader
    assert [r.error for r in b.claim("mine")] == [None, native.EVICTED] and b.ignored_errors == 1


def test_an_abandoned_rid_drops_its_rows_until_its_end_then_is_buffered_anew() -> None:
    b = Buffer(4)
    b.released("gone", [], finished=False)
    b.offer(out_row("gone", "b", 2))
    b.offer(out_row("gone", "c", 3, finish="abort"))
    assert b.dropped_rows == 2 and len(b) == 0
    b.offer(out_row("gone", "new", 1))  # after its end the rid is a new request's
    assert [r.text for r in b.claim("gone")] == ["new"] and b.dropped_rows == 2


def test_a_stream_released_with_its_end_unread_is_not_abandoned() -> None:
    b = Buffer(4)
    b.released("r", [out_row("r", "late", 2, finish="stop")], finished=False)
    b.offer(out_row("r", "next", 1))
    assert b.dropped_rows == 0 and [r.text for r in b.claim("r")] == ["next"]


def test_rows_left_after_a_finish_belong_to_the_rids_next_request() -> None:
    b = Buffer(4)
    b.released("r", [out_row("r", "again", 1)], finished=True)
    assert [r.text for r in b.claim("r")] == ["again"]


def test_claiming_an_abandoned_rid_forgets_that_it_was_abandoned() -> None:
    b = Buffer(4)
    b.released("r", [], finished=False)
    assert b.claim("r") == []
    b.offer(out_row("r", "x", 1))  # a reader came back: its rows are kept, not dropped
    assert b.dropped_rows == 0 and len(b) == 1


def test_after_an_error_row_the_requests_rows_are_dropped_until_one_that_ends_a_request() -> None:
    """detokd had them queued before the request failed (docs/client.md, "Queues and loss")."""
    b = Buffer(4)
    b.released("r", [out_row("r", "late", 2)], finished=True, failed=True)
    b.offer(out_row("r", "later", 3))
    assert b.stale_rows == 2 and len(b) == 0
    b.offer(out_row("r", "", 3, finish="length"))  # its own finish, queued too: its last row
    assert b.stale_rows == 3
    b.offer(out_row("r", "new", 1))  # after it, a new request's
    assert [r.text for r in b.claim("r")] == ["new"] and b.stale_rows == 3


def test_rows_left_after_an_error_row_and_the_failed_requests_end_belong_to_the_next_request() -> None:
    b = Buffer(4)
    rest = [out_row("r", "late", 2), out_row("r", error=native.WORKER_STALLED), out_row("r", "new", 1)]
    b.released("r", rest, finished=True, failed=True)
    assert b.stale_rows == 2 and [r.text for r in b.claim("r")] == ["new"]


def test_a_stream_opened_for_a_failed_rid_is_a_new_requests() -> None:
    b = Buffer(4)
    b.released("r", [], finished=True, failed=True)
    assert b.claim("r") == []
    b.released("r", [out_row("r", "next", 1)], finished=True)  # its stream ends: the rest waits
    assert b.stale_rows == 0 and len(b) == 1


def test_the_failed_memory_is_bounded_too() -> None:
    b = Buffer(3)
    for i in range(100):
        b.released(f"f{i}", [], finished=True, failed=True)
    assert len(b.failed) == 3
    b.offer(out_row("f0", "x", 1))  # forgotten long ago: buffered like a new rid
    assert b.stale_rows == 0 and len(b) == 1


def test_the_abandoned_memory_is_bounded_too() -> None:
    b = Buffer(3)
    for i in range(100):
        b.released(f"g{i}", [], finished=False)
    assert len(b.abandoned) == 3
    b.offer(out_row("g0", "x", 1))  # forgotten long ago: buffered like a new rid
    assert b.dropped_rows == 0 and len(b) == 1


def test_what_ends_a_request() -> None:
    assert ends(out_row("r", finish="stop")) and ends(out_row("r", error=native.EVICTED))
    assert ends(native.EmbeddingRow("r")) and not ends(out_row("r", "text", 1))


def test_the_policy_runs_where_zmq_cannot_even_be_imported() -> None:
    """Loaded by itself (not through detokd.client, whose clients need sockets)."""
    import subprocess

    code = (
        "import importlib.util, sys; sys.modules['zmq'] = None; "  # None: `import zmq` fails
        "spec = importlib.util.spec_from_file_location('buffer', 'detokd/client/buffer.py'); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        "b = m.Buffer(1); b.released('r', [], False); print(len(b.abandoned))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and r.stdout == "1\n", r.stderr
