"""detokd.gc_policy: start-up frozen, the young generations collected between batches
in pauses that do not grow with the requests alive or the rate they start at."""

from __future__ import annotations

import gc

import pytest
from conftest import fast_codec, vocab

from detokd import gc_policy
from detokd.core.detokenizer import Detokenizer
from detokd.core.outbox import Outbox
from detokd.core.stats import Stats
from detokd.gc_policy import GcPolicy
from detokd.wire.native import Row, Start


@pytest.fixture
def policy():
    """A started policy; the test process gets its collector back as it was."""
    stats = Stats()
    p = GcPolicy(stats)
    p.start()
    yield p
    p.stop()
    gc.unfreeze()


def test_start_freezes_what_exists_and_turns_automatic_collection_off(policy) -> None:
    assert gc.get_freeze_count() > 0
    assert not gc.isenabled()
    policy.stop()
    assert gc.isenabled()


def test_the_clock_collects_at_most_a_second_apart(policy) -> None:
    stats, due = policy.stats, policy.next
    policy.tick(due - 0.001)
    assert stats.gc_collections == 0
    policy.tick(due)
    assert stats.gc_collections == 1
    policy.tick(due + gc_policy.INTERVAL - 0.001)
    assert stats.gc_collections == 1
    policy.tick(due + gc_policy.INTERVAL)
    assert stats.gc_collections == 2
    assert stats.gc_seconds > 0


def test_STARTS_starts_collect_before_the_clock(policy) -> None:
    stats, early = policy.stats, policy.next - 0.5
    stats.started += gc_policy.STARTS - 1
    policy.tick(early)
    assert stats.gc_collections == 0
    stats.started += 1
    policy.tick(early)
    assert stats.gc_collections == 1
    stats.started += gc_policy.STARTS - 1
    policy.tick(early)
    assert stats.gc_collections == 1  # counted from the last collection


def test_a_cycle_someone_made_is_freed_and_counted(policy) -> None:
    for _ in range(10):
        a: list = []
        a.append(a)
    del a
    policy.tick(policy.next)
    assert policy.stats.gc_collected >= 10


def _young() -> int:
    return len(gc.get_objects(0)) + len(gc.get_objects(1))


def test_a_pause_traverses_the_latest_starts_not_every_live_request(policy) -> None:
    """Frames into a real core, each with new requests' starts and the next id of every
    live one, the clock never due: a collection comes every STARTS starts, and what it
    traverses (the young generations before it) stays what the starts since the last
    one left, while the live requests grow twentyfold and step."""
    stats = policy.stats
    v = vocab("deepseek")
    outbox = Outbox()
    outbox.open(0)
    core = Detokenizer(fast_codec("deepseek"), v.size, outbox, max_states=4096, max_prompt_tail=8, stats=stats)
    ids = v.backend.encode("User: hello there, how are you? Très bien, 谢谢 🙂", add_special_tokens=False).ids
    per_frame = gc_policy.STARTS // 2
    live: dict[str, int] = {}  # rid -> ids sent
    policy.tick(policy.next)  # the fixture's own objects out of the way
    traversed = []
    for f in range(40):
        rows = [Row(rid, [ids[n % len(ids)]], n) for rid, n in live.items()]
        rows += [Row(f"r{f}-{i}", [ids[0]], 0, Start(prompt_tail=ids[-8:], stop=["</answer>"])) for i in range(per_frame)]
        assert not any(row.error for row in core.tokens(rows).rows[0])
        live = {row.rid: row.seq + 1 for row in rows}
        del rows
        before, young = stats.gc_collections, _young()
        policy.tick(policy.next - 0.5)
        if stats.gc_collections > before:
            traversed.append(young)
    assert len(core.table) == len(live) == 40 * per_frame
    assert stats.gc_collections == 1 + 20
    # Each start leaves objects behind (or the bound below would say nothing) ...
    assert min(traversed) > gc_policy.STARTS
    # ... and the last pauses traverse no more than the first did: under a collection
    # on the clock alone, the last would hold all 2,560 starts' objects.
    assert max(traversed[-5:]) < 1.5 * traversed[0]
