"""detokd.client.scheduler: SchedulerClient and shard_for.

Real PULL sockets stand where detokd's shards would (utils.FakeShards) and decode
what the client sends: these test the client, not the server.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
import zlib
from pathlib import Path

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from utils import FakeShards

from detokd.client import SchedulerClient, shard_for
from detokd.wire import native

# --------------------------------------------------------------------------- sharding


def test_shard_for_is_crc32_mod_n() -> None:
    for rid in ["", "a", "cmpl-1", "请求-7", "x" * 300]:
        for n in (1, 2, 3, 8):
            assert shard_for(rid, n) == zlib.crc32(rid.encode()) % n


def test_shard_for_is_stable_across_processes() -> None:
    rids = [f"req-{i}" for i in range(50)] + ["日本語", "émoji-🙂"]
    here = [shard_for(r, 7) for r in rids]
    code = (
        "import json, sys; from detokd.client import shard_for; "
        "print(json.dumps([shard_for(r, 7) for r in json.loads(sys.argv[1])]))"
    )
    for seed in ("1", "2"):  # a salted hash() would differ between these
        out = subprocess.run(
            [sys.executable, "-c", code, json.dumps(rids)],
            env=dict(os.environ, PYTHONHASHSEED=seed),
            capture_output=True, text=True, check=True,
        ).stdout
        assert json.loads(out) == here


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("kind", ["uuid", "counter"])
def test_shard_balance(n: int, kind: str) -> None:
    rng = random.Random(n)
    if kind == "uuid":
        rids = [str(uuid.UUID(int=rng.getrandbits(128))) for _ in range(100_000)]
    else:  # engines often number requests
        rids = [f"cmpl-{i}" for i in range(100_000)]
    counts = [0] * n
    for r in rids:
        counts[shard_for(r, n)] += 1
    mean = len(rids) / n
    assert max(counts) <= 1.10 * mean, counts


# --------------------------------------------------------------------------- rows, seq and shards


@pytest.fixture
def shards3():
    f = FakeShards(3)
    yield f
    f.close()


def test_seq_tracking_and_finish(shards3: FakeShards) -> None:
    c = shards3.client()
    rid = "r1"
    sh = shard_for(rid, 3)
    c.begin(rid, [1, 2, 3], worker=1, prompt_tail=[9, 9])
    c.flush()
    c.add(rid, [4])
    c.add(rid, [])  # an empty delta is a row too (meta only, say)
    c.flush()
    c.add(rid, [5, 6], finish=native.Finish("length"))
    assert c.seq_of(rid) is None  # finished: forgotten right away
    c.flush()
    msgs = shards3.drain()
    assert all(not m for i, m in enumerate(msgs) if i != sh)
    rows = [r for m in msgs[sh] for r in m.rows]
    assert [(r.ids, r.seq) for r in rows] == [([1, 2, 3], 0), ([4], 3), ([], 4), ([5, 6], 4)]
    assert rows[0].start == native.Start(worker=1, prompt_tail=[9, 9])
    assert all(r.start is None for r in rows[1:])
    assert rows[-1].finish == native.Finish("length")
    # The rid may start a new request after its finish: seq counts from 0 again.
    c.begin(rid, [7])
    c.add(rid, [8])
    c.flush()
    rows = shards3.recv(sh).rows
    assert [(r.seq, r.start is not None) for r in rows] == [(0, True), (1, False)]
    c.close()


def test_new_vid_resets_seq_same_vid_does_not(shards3: FakeShards) -> None:
    c = shards3.client()
    c.begin("a", [1, 2], vid=0)
    c.add("a", [3])
    c.add("a", [4], start=native.Start(vid=0))  # same vid: detokd keeps the state, so does seq
    c.begin("a", [10, 11], vid=1)  # retracted and re-run
    c.add("a", [12])
    c.flush()
    rows = shards3.recv(shard_for("a", 3)).rows
    assert [r.seq for r in rows] == [0, 2, 3, 0, 2]
    assert c.seq_of("a") == 3
    c.close()


def test_flush_sends_one_message_per_shard_in_order(shards3: FakeShards) -> None:
    c = shards3.client()
    c.flush()  # nothing queued: nothing sent
    rids = [f"req-{i}" for i in range(60)]
    added: list[tuple[str, int]] = []
    for step in range(2):
        for rid in rids:
            if step == 0:
                c.begin(rid, [step])
            else:
                c.add(rid, [step])
            added.append((rid, step))
    c.flush()
    msgs = shards3.drain()
    for shard, got in enumerate(msgs):
        want = [a for a in added if shard_for(a[0], 3) == shard]
        assert len(got) == (1 if want else 0)
        if want:
            assert isinstance(got[0], native.Tokens)
            assert [(r.rid, r.ids[0]) for r in got[0].rows] == want
    assert sum(len(m) for m in msgs) == 3  # 60 rids cover every shard
    c.close()


def test_take_encodes_what_flush_would_send_and_sends_nothing(shards3: FakeShards) -> None:
    c = shards3.client()
    rids = [f"t-{i}" for i in range(30)]
    for rid in rids:
        c.begin(rid, [1, 2])
    taken = c.take()
    assert [shard for shard, _ in taken] == sorted({shard_for(r, 3) for r in rids})
    for shard, frame in taken:
        rows = native.decode_inbound(frame).rows
        assert [r.rid for r in rows] == [r for r in rids if shard_for(r, 3) == shard]
    assert c.take() == []  # taken rows are gone from the queue
    for rid in rids:
        c.add(rid, [3])
    c.flush()
    sent = [r for m in shards3.drain() for msg in m for r in msg.rows]
    assert sorted(r.rid for r in sent) == sorted(rids)  # nothing taken was sent twice
    assert {r.seq for r in sent} == {2}  # seq went on past the taken rows
    c.close()


def test_rows_leave_keys_at_their_default_out(shards3: FakeShards) -> None:
    c = shards3.client()
    c.begin("d", [7], prompt_tail=[1, 2], stop=["x"])
    c.add("e", [9], meta={"n": 1})
    c.add("d", [8])
    frames = [frame for _, frame in c.take()]  # the bytes flush() would send
    rows = [r for f in frames for r in msgspec.msgpack.decode(f)["rows"]]
    first, second = (r for r in rows if r["rid"] == "d")
    assert next(r for r in rows if r["rid"] == "e") == {"rid": "e", "ids": [9], "meta": {"n": 1}}
    assert first == {"rid": "d", "ids": [7], "start": {"prompt_tail": [1, 2], "stop": ["x"]}}
    assert second == {"rid": "d", "ids": [8], "seq": 1}
    # and what is left out decodes back to the defaults
    decoded = [r for f in frames for r in native.decode_inbound(f).rows if r.rid == "d"]
    assert decoded == [native.Row("d", [7], 0, native.Start(prompt_tail=[1, 2], stop=["x"])), native.Row("d", [8], 1)]
    c.close()


def test_meta_passes_as_msgpack(shards3: FakeShards) -> None:
    c = shards3.client()
    meta = {"logprobs": [-0.5, -1.25], "n": 3, "tag": "é"}
    c.begin("m", [1], meta=meta)
    c.add("m", [2])
    c.add("m", [3], meta=msgspec.Raw(msgspec.msgpack.encode([1, 2])))  # pre-encoded passes as is
    c.flush()
    rows = shards3.recv(shard_for("m", 3)).rows
    assert msgspec.msgpack.decode(rows[0].meta) == meta
    assert bytes(rows[1].meta) == bytes(native.NIL)
    assert msgspec.msgpack.decode(rows[2].meta) == [1, 2]
    c.close()


def test_numpy_ids_become_ints(shards3: FakeShards) -> None:
    np = pytest.importorskip("numpy")
    c = shards3.client()
    c.begin("np", np.array([5, 6, 7], dtype=np.int64), prompt_tail=np.array([1], dtype=np.int32))
    c.flush()
    row = shards3.recv(shard_for("np", 3)).rows[0]
    assert row.ids == [5, 6, 7] and row.start.prompt_tail == [1]
    c.close()


def test_abort_goes_to_the_rid_shard_and_drops_queued_rows(shards3: FakeShards) -> None:
    c = shards3.client()
    rids = [f"q{i}" for i in range(12)]
    for r in rids:
        c.begin(r, [1, 2])
    c.flush()
    shards3.drain()
    for r in rids:
        c.add(r, [3])
    c.abort(rids[:6])
    assert all(c.seq_of(r) is None for r in rids[:6])
    c.flush()
    msgs = shards3.drain()
    aborted: list[str] = []
    sent_rows: list[str] = []
    for shard, got in enumerate(msgs):
        for m in got:
            if isinstance(m, native.Abort):
                assert all(shard_for(r, 3) == shard for r in m.rids)
                aborted += m.rids
            else:
                sent_rows += [r.rid for r in m.rows]
    assert sorted(aborted) == sorted(rids[:6])
    assert sorted(sent_rows) == sorted(rids[6:])
    c.close()


def test_register_control_go_to_every_shard(shards3: FakeShards) -> None:
    c = shards3.client()
    c.begin("x", [1])
    c.register(2, "tcp://10.0.0.2:7000")
    c.control("flush")  # queued rows first, then the op; and the client forgets the rids
    assert len(c) == 0
    msgs = shards3.drain()
    for shard, got in enumerate(msgs):
        kinds = [type(m).__name__ for m in got]
        if shard == shard_for("x", 3):
            assert kinds == ["Register", "Tokens", "Control"]
        else:
            assert kinds == ["Register", "Control"]
        assert got[0] == native.Register(2, "tcp://10.0.0.2:7000")
        assert got[-1] == native.Control("flush")
    c.close()


def test_embeddings_go_to_the_rid_shard(shards3: FakeShards) -> None:
    c = shards3.client()
    c.embeddings(
        [{"rid": f"e{i}", "worker": i % 2, "data": [0.5, float(i)], "meta": {"i": i}} for i in range(9)]
        + [native.EmbeddingRow("raw", 1, msgspec.Raw(msgspec.msgpack.encode("d")))]
    )
    seen = {}
    for shard, got in enumerate(shards3.drain()):
        for m in got:
            assert isinstance(m, native.Embeddings)
            for r in m.rows:
                assert shard_for(r.rid, 3) == shard
                seen[r.rid] = r
    assert len(seen) == 10
    assert msgspec.msgpack.decode(seen["e4"].data) == [0.5, 4.0]
    assert msgspec.msgpack.decode(seen["e4"].meta) == {"i": 4} and seen["e4"].worker == 0
    assert msgspec.msgpack.decode(seen["raw"].data) == "d"
    c.close()


def test_single_address_string_and_close_delivers_queued(tmp_path: Path) -> None:
    addr = f"ipc://{tmp_path}/in"
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(addr)
    c = SchedulerClient(addr)  # its own context; close() flushes and waits for delivery
    assert c.n_shards == 1
    c.begin("one", [1])
    c.close()
    assert pull.poll(2000)
    assert native.decode_inbound(pull.recv()).rows[0].rid == "one"
    pull.close(0)
    ctx.term()


_op = st.one_of(
    st.tuples(st.just("add"), st.sampled_from("abcdef"), st.integers(0, 4)),
    st.tuples(st.just("begin"), st.sampled_from("abcdef"), st.integers(0, 2)),
    st.tuples(st.just("finish"), st.sampled_from("abcdef"), st.integers(0, 4)),
    st.tuples(st.just("abort"), st.sampled_from("abcdef"), st.just(0)),
    st.tuples(st.just("flush"), st.just(""), st.just(0)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, max_size=60), n=st.integers(1, 4))
def test_seq_matches_a_model(ops: list[tuple[str, str, int]], n: int) -> None:
    """Every sent row's seq = ids of its rid sent since its last (re)start."""
    shards = FakeShards(n)
    c = shards.client()
    live: dict[str, tuple[int, int]] = {}  # rid -> (seq, vid)
    pending: list[tuple[str, int, int]] = []  # (rid, seq, n ids) queued, in add order
    sent: list[tuple[str, int, int]] = []
    for kind, rid, k in ops:
        if kind == "flush":
            c.flush()
            sent += pending
            pending = []
        elif kind == "abort":
            c.abort([rid])
            live.pop(rid, None)
            pending = [p for p in pending if p[0] != rid]
        else:
            seq, vid = live.get(rid, (0, 0))
            if kind == "begin":
                if rid not in live or k != vid:
                    seq = 0
                vid = k
                c.begin(rid, list(range(k)), vid=k)
            else:
                c.add(rid, list(range(k)), finish=native.Finish("stop") if kind == "finish" else None)
            pending.append((rid, seq, k))
            if kind == "finish":
                live.pop(rid, None)
            else:
                live[rid] = (seq + k, vid)
    c.flush()
    sent += pending
    msgs = shards.drain()
    got = [(r.rid, r.seq, len(r.ids)) for ms in msgs for m in ms if isinstance(m, native.Tokens) for r in m.rows]
    # Order holds per shard, hence per rid; compare each rid's rows.
    assert sorted(got, key=lambda g: g[0]) == sorted(sent, key=lambda g: g[0])
    for rid in live:
        assert c.seq_of(rid) == live[rid][0]
    c.close()
    shards.close()
