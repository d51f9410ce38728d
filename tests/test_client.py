"""detokd.client: the scheduler-side sender and the worker-side receiver.

Unit tests put real ZMQ sockets where detokd would be (a PULL socket receiving
what SchedulerClient sends, a PUSH socket sending `text` to WorkerClient): they
test the client, not the server. The end-to-end tests at the bottom run the real
`detokd serve` and the examples/sse_engine.py demo as subprocesses.
"""

from __future__ import annotations

import asyncio
import gc
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
import zlib
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import alive
from detokd.wire import native as P
from detokd.client import (
    DetokdError,
    SchedulerClient,
    WorkerClient,
    WorkerClosed,
    shard_for,
)

REPO = Path(__file__).resolve().parents[1]
LOOPS = ["asyncio", "uvloop"]


def arun(coro: Coroutine[Any, Any, Any], loop: str = "asyncio", timeout: float = 10.0) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout)

    if loop == "uvloop":
        import uvloop

        return uvloop.run(bounded())
    return asyncio.run(bounded())


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


# --------------------------------------------------------------------------- scheduler


class FakeShards:
    """PULL sockets standing in for detokd shards' input sockets."""

    def __init__(self, n: int, ctx: zmq.Context | None = None) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.addresses = [f"inproc://shard-{uuid.uuid4().hex}" for _ in range(n)]
        self.socks = []
        for a in self.addresses:
            s = self.ctx.socket(zmq.PULL)
            s.bind(a)
            self.socks.append(s)

    def client(self, **kw: Any) -> SchedulerClient:
        return SchedulerClient(self.addresses, context=self.ctx, **kw)

    def recv(self, shard: int, timeout: float = 2.0) -> P.Inbound:
        s = self.socks[shard]
        assert s.poll(int(timeout * 1000)), f"shard {shard} got nothing"
        return P.decode_inbound(s.recv())

    def drain(self) -> list[list[P.Inbound]]:
        out: list[list[P.Inbound]] = []
        for s in self.socks:
            msgs = []
            while s.poll(5):  # inproc: a sent message is already in the pipe
                msgs.append(P.decode_inbound(s.recv()))
            out.append(msgs)
        return out

    def close(self) -> None:
        for s in self.socks:
            s.close(0)


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
    c.add(rid, [5, 6], finish=P.Finish("length"))
    assert c.seq_of(rid) is None  # finished: forgotten right away
    c.flush()
    msgs = shards3.drain()
    assert all(not m for i, m in enumerate(msgs) if i != sh)
    rows = [r for m in msgs[sh] for r in m.rows]
    assert [(r.ids, r.seq) for r in rows] == [([1, 2, 3], 0), ([4], 3), ([], 4), ([5, 6], 4)]
    assert rows[0].start == P.Start(worker=1, prompt_tail=[9, 9])
    assert all(r.start is None for r in rows[1:])
    assert rows[-1].finish == P.Finish("length")
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
    c.add("a", [4], start=P.Start(vid=0))  # same vid: detokd keeps the state, so does seq
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
            assert isinstance(got[0], P.Tokens)
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
        rows = P.decode_inbound(frame).rows
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
    decoded = [r for f in frames for r in P.decode_inbound(f).rows if r.rid == "d"]
    assert decoded == [P.Row("d", [7], 0, P.Start(prompt_tail=[1, 2], stop=["x"])), P.Row("d", [8], 1)]
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
    assert bytes(rows[1].meta) == bytes(P.NIL)
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
            if isinstance(m, P.Abort):
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
        assert got[0] == P.Register(2, "tcp://10.0.0.2:7000")
        assert got[-1] == P.Control("flush")
    c.close()


def test_embeddings_go_to_the_rid_shard(shards3: FakeShards) -> None:
    c = shards3.client()
    c.embeddings(
        [{"rid": f"e{i}", "worker": i % 2, "data": [0.5, float(i)], "meta": {"i": i}} for i in range(9)]
        + [P.EmbeddingRow("raw", 1, msgspec.Raw(msgspec.msgpack.encode("d")))]
    )
    seen = {}
    for shard, got in enumerate(shards3.drain()):
        for m in got:
            assert isinstance(m, P.Embeddings)
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
    assert P.decode_inbound(pull.recv()).rows[0].rid == "one"
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
                c.add(rid, list(range(k)), finish=P.Finish("stop") if kind == "finish" else None)
            pending.append((rid, seq, k))
            if kind == "finish":
                live.pop(rid, None)
            else:
                live[rid] = (seq + k, vid)
    c.flush()
    sent += pending
    msgs = shards.drain()
    got = [(r.rid, r.seq, len(r.ids)) for ms in msgs for m in ms if isinstance(m, P.Tokens) for r in m.rows]
    # Order holds per shard, hence per rid; compare each rid's rows.
    assert sorted(got, key=lambda g: g[0]) == sorted(sent, key=lambda g: g[0])
    for rid in live:
        assert c.seq_of(rid) == live[rid][0]
    c.close()
    shards.close()


# --------------------------------------------------------------------------- worker


class FakeDetokd:
    """A PUSH socket standing in for detokd's connection to one worker."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.connect(address)

    def text(self, *rows: P.OutRow) -> None:
        self.sock.send(P.encode(P.Text(list(rows))))

    def raw(self, frame: bytes) -> None:
        self.sock.send(frame)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def row(rid: str, text: str = "", n: int = 0, *, finish: str | None = None, error: str | None = None, meta: Any = None) -> P.OutRow:
    return P.OutRow(
        rid, text, P.Finish(finish) if finish else None, n,
        msgspec.Raw(msgspec.msgpack.encode(meta)) if meta is not None else P.NIL, error,
    )


@pytest.fixture
def waddr(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/w0"


async def until(pred: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("loop", LOOPS)
def test_stream_yields_deltas_and_ends_at_finish(waddr: str, loop: str) -> None:
    async def main() -> None:
        async with WorkerClient(waddr) as w:
            d = FakeDetokd(waddr)
            s = w.stream("r")
            d.text(row("r", "Hel", 2), row("other", "x", 1))
            d.text(row("r", "", 3))  # nothing ready yet: not yielded
            d.text(row("r", "lo 世界", 5, meta={"lp": -1.5}))
            d.text(row("r", "!", 6, finish="stop", meta=[7]))
            got = [t async for t in s]
            assert got == ["Hel", "lo 世界", "!"]
            assert s.finish == P.Finish("stop") and s.n_ids == 6 and s.done
            assert s.meta_obj() == [7]
            # The unclaimed rid "other" waited in the buffer.
            assert w.buffered_rids == 1
            o = w.stream("other")
            d.text(row("other", "y", 2, finish="length"))
            assert await o.text() == "xy"
            d.close()

    arun(main(), loop)


@pytest.mark.parametrize("loop", LOOPS)
def test_rows_before_the_stream_opens_are_kept(waddr: str, loop: str) -> None:
    async def main() -> None:
        async with WorkerClient(waddr) as w:
            d = FakeDetokd(waddr)
            d.text(row("early", "a", 1), row("early", "b", 2, finish="stop"))
            await until(lambda: w.buffered_rids == 1)
            assert await w.stream("early").text() == "ab"
            assert w.buffered_rids == 0
            d.close()

    arun(main(), loop)


def test_error_row_raises(waddr: str) -> None:
    async def main() -> None:
        async with WorkerClient(waddr) as w:
            d = FakeDetokd(waddr)
            s = w.stream("bad")
            d.text(row("bad", "partial", 3), row("bad", "", 3, error=P.SEQUENCE_GAP))
            got = []
            with pytest.raises(DetokdError) as ei:
                async for t in s:
                    got.append(t)
            assert got == ["partial"]
            assert ei.value.rid == "bad" and ei.value.error == "sequence_gap"
            assert "bad" in str(ei.value) and "sequence_gap" in str(ei.value)
            assert s.error == "sequence_gap" and s.done
            with pytest.raises(StopAsyncIteration):
                await s.__anext__()
            d.close()

    arun(main())


def test_error_rows_of_other_workers_rids_are_ignored(waddr: str) -> None:
    async def main() -> None:
        async with WorkerClient(waddr) as w:
            d = FakeDetokd(waddr)
            s = w.stream("mine")
            # detokd broadcasts unknown-rid errors to every worker: not ours, not buffered.
            d.text(*[row(f"theirs{i}", error=P.UNKNOWN_RID) for i in range(5)])
            d.text(row("buffered", "t", 1), row("buffered", error=P.EVICTED))
            d.text(row("mine", "ok", 1, finish="stop"))
            assert await s.text() == "ok"
            assert w.ignored_errors == 5 and w.buffered_rids == 1
            with pytest.raises(DetokdError, match="evicted"):
                await w.stream("buffered").text()
            d.close()

    arun(main())


def test_buffering_is_bounded(waddr: str) -> None:
    async def main() -> None:
        async with WorkerClient(waddr, max_buffered=3) as w:
            d = FakeDetokd(waddr)
            for i in range(5):
                d.text(row(f"u{i}", f"t{i}", 1))
            d.text(row("u4", "!", 2, finish="stop"))
            await until(lambda: w.dropped_rids == 2)
            await asyncio.sleep(0.05)
            assert w.buffered_rids == 3 and w.dropped_rids == 2
            assert await w.stream("u4").text() == "t4!"  # the newest survive
            # Many unread rids never grow the buffer past its bound.
            d.text(*[row(f"v{i}", "x", 1) for i in range(1000)])
            await until(lambda: w.dropped_rids == 2 + 1000 - 1)
            assert w.buffered_rids == 3
            d.close()

    arun(main())


def test_closed_stream_drops_late_rows_until_finish(waddr: str) -> None:
    async def main() -> None:
        async with WorkerClient(waddr) as w:
            d = FakeDetokd(waddr)
            async with w.stream("gone") as s:
                d.text(row("gone", "a", 1))
                assert await s.__anext__() == "a"
            # The HTTP client went away; the engine still sends a few rows.
            d.text(row("gone", "b", 2), row("gone", "c", 3, finish="abort"))
            await until(lambda: w.dropped_rows == 2)
            assert w.buffered_rids == 0
            # After its finish the rid may be reused: buffered again like any new rid.
            d.text(row("gone", "new", 1, finish="stop"))
            await until(lambda: w.buffered_rids == 1)
            assert await w.stream("gone").text() == "new"
            d.close()

    arun(main())


def test_abandoned_stream_is_released(waddr: str) -> None:
    async def main() -> None:
        async with WorkerClient(waddr) as w:
            d = FakeDetokd(waddr)
            s = w.stream("lost")
            del s
            gc.collect()
            d.text(row("lost", "x", 1))
            await until(lambda: w.dropped_rows == 1)
            assert w.buffered_rids == 0
            w.stream("lost").close()  # reopening is allowed; it was released
            d.close()

    arun(main())


def test_double_stream_is_an_error(waddr: str) -> None:
    async def main() -> None:
        async with WorkerClient(waddr) as w:
            s = w.stream("dup")
            with pytest.raises(ValueError):
                w.stream("dup")
            s.close()
            w.stream("dup").close()

    arun(main())


def test_close_fails_open_streams(waddr: str) -> None:
    async def main() -> None:
        w = WorkerClient(waddr)
        s = w.stream("pending")
        waiter = asyncio.ensure_future(s.text())
        await asyncio.sleep(0.01)
        await w.aclose()
        with pytest.raises(WorkerClosed):
            await waiter
        with pytest.raises(RuntimeError):
            w.stream("after")
        w.close()  # idempotent

    arun(main())


def test_many_interleaved_requests(waddr: str) -> None:
    async def main() -> None:
        rng = random.Random(7)
        texts = {f"r{i}": "".join(rng.choice("ab世🙂 ") for _ in range(rng.randint(0, 40))) for i in range(200)}
        async with WorkerClient(waddr) as w:
            streams = {rid: w.stream(rid) for rid in texts}
            d = FakeDetokd(waddr)
            left = {rid: list(t) for rid, t in texts.items()}
            n = dict.fromkeys(texts, 0)
            while left:
                batch = []
                for rid in list(left):
                    k = rng.randint(0, 3)
                    chunk, left[rid] = "".join(left[rid][:k]), left[rid][k:]
                    n[rid] += 1
                    fin = not left[rid]
                    batch.append(row(rid, chunk, n[rid], finish="stop" if fin else None))
                    if fin:
                        del left[rid]
                d.text(*batch)
            got = await asyncio.gather(*(s.text() for s in streams.values()))
            assert dict(zip(streams, got, strict=True)) == texts
            d.close()

    arun(main())


def test_bad_frames_do_not_stop_the_receiver(waddr: str) -> None:
    async def main() -> None:
        async with WorkerClient(waddr) as w:
            d = FakeDetokd(waddr)
            s = w.stream("r")
            d.raw(b"\xff not msgpack")
            d.raw(msgspec.msgpack.encode({"type": "tokens", "rows": []}))  # an inbound message
            d.text(row("r", "fine", 1, finish="stop"))
            assert await s.text() == "fine"
            assert w.bad_frames == 2
            d.close()

    arun(main())


def test_embedding(waddr: str) -> None:
    async def main() -> None:
        async with WorkerClient(waddr) as w:
            d = FakeDetokd(waddr)
            fut = asyncio.ensure_future(w.embedding("e"))
            d.raw(P.encode(P.Embeddings([P.EmbeddingRow("e", 0, msgspec.Raw(msgspec.msgpack.encode([0.25])))])))
            r = await fut
            assert msgspec.msgpack.decode(r.data) == [0.25]
            d.close()

    arun(main())


def test_raw_rows(waddr: str) -> None:
    async def main() -> None:
        w = WorkerClient(waddr)
        d = FakeDetokd(waddr)
        d.text(row("a", "1", 1), row("b", "2", 1))
        got = []
        async for r in w.rows():
            got.append((r.rid, r.text))
            if len(got) == 2:
                break
        assert got == [("a", "1"), ("b", "2")]
        await w.aclose()
        d.close()

    arun(main())


def test_worker_registers_with_every_shard(tmp_path: Path) -> None:
    shards = FakeShards(2)  # inproc: the worker must share the fake shards' context
    addr = f"ipc://{tmp_path}/w3"
    w = WorkerClient(addr, shards=shards.addresses, worker=3, context=shards.ctx)
    for i in range(2):
        assert shards.recv(i) == P.Register(3, addr)
    w.register()  # again, e.g. after a detokd restart
    for i in range(2):
        assert shards.recv(i) == P.Register(3, addr)
    w.close()
    # A wildcard bind registers the address detokd can reach.
    w = WorkerClient("tcp://127.0.0.1:*", shards=shards.addresses, worker=4,
                     advertise="tcp://worker-host:6000", context=shards.ctx)
    for i in range(2):
        assert shards.recv(i) == P.Register(4, "tcp://worker-host:6000")
    w.close()
    shards.close()


def test_bind_failure_raises_and_cleans_up(tmp_path: Path) -> None:
    addr = f"ipc://{tmp_path}/taken"
    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    s.bind("tcp://127.0.0.1:*")
    taken = s.getsockopt_string(zmq.LAST_ENDPOINT)
    with pytest.raises(zmq.ZMQError):
        WorkerClient(taken)
    WorkerClient(addr).close()
    s.close(0)
    ctx.term()


def test_worker_without_id_does_not_register(tmp_path: Path) -> None:
    shards = FakeShards(1)
    w = WorkerClient(f"ipc://{tmp_path}/w", shards=shards.addresses, context=shards.ctx)
    assert not shards.socks[0].poll(100)
    w.close()
    shards.close()


# --------------------------------------------------------------------------- end to end

CORPUS = [
    "Hello, world! This is a test of streaming detokenization.",
    "日本語のテキストを正しく表示できますか？ 中文也是。",
    "한국어 문장과 русский текст, العربية و עברית.",
    "Emoji: 🙂🚀👩‍💻🇫🇷 and combining marks: é ñ ü.",
    "def f(x):\n    return x ** 2  # code with   spaces\n\t\ttabs",
    "   leading spaces, trailing spaces   ",
    "ÀÉÎÕÜ ßæøå ¿¡ «» — … “quotes” ‘single’",
]


@pytest.fixture(scope="module")
def deepseek():
    from transformers import AutoTokenizer

    from detokd import zoo

    return AutoTokenizer.from_pretrained(str(zoo.build("deepseek")))


def oracle(tok, tail: list[int], out: list[int], skip: bool) -> str:
    """PROTOCOL.md's text: decode(tail + out)[len(decode(tail)):]."""
    full = tok.decode(tail + out, skip_special_tokens=skip)
    return full[len(tok.decode(tail, skip_special_tokens=skip)):]


def _serve(tmp_path: Path, *args: str) -> subprocess.Popen:
    # stderr to a file, not a pipe nobody reads while the test runs (it could fill up).
    log = open(tmp_path / "detokd.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "detokd", "serve", *args], stdout=subprocess.DEVNULL, stderr=log)
    proc.log_path = tmp_path / "detokd.log"  # type: ignore[attr-defined]
    log.close()
    return proc


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 15) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return proc.returncode, proc.log_path.read_text()  # type: ignore[attr-defined]


def test_end_to_end_through_detokd_serve(tmp_path: Path, deepseek) -> None:
    """Many requests, three workers (one added by `register`), random steps: every
    request's text equals the reference decode of the ids sent."""
    tok = deepseek
    inp = f"ipc://{tmp_path}/in"
    workers = [f"ipc://{tmp_path}/w{i}" for i in range(3)]
    # Worker 2 comes by `register`, which detokd takes only when its config allows it.
    (tmp_path / "register.toml").write_text(f'register_enabled = true\nregister_allow = ["ipc://{tmp_path}/*"]\n')
    proc = _serve(tmp_path, "--config", str(tmp_path / "register.toml"), "--input", inp, "--worker", workers[0], "--worker", workers[1])
    rng = random.Random(1234)
    eos = tok.eos_token_id
    specials = [eos, tok.convert_tokens_to_ids("<｜fim▁hole｜>")]
    reqs = []
    for i in range(150):
        text = " ".join(rng.sample(CORPUS, rng.randint(1, 3)))
        ids = tok.encode(text, add_special_tokens=False)
        if rng.random() < 0.2:  # a special token inside the output
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        prompt = tok.encode(rng.choice(CORPUS), add_special_tokens=False)
        tail = prompt[-rng.randint(0, 8):] if rng.random() < 0.8 else []
        stop_token = rng.random() < 0.5
        finish = P.Finish("stop", eos) if stop_token else P.Finish("length")
        if stop_token:
            ids.append(eos)
        skip = rng.random() < 0.7
        out = ids[:-1] if stop_token else ids  # a matched stop token is not rendered
        reqs.append(dict(rid=f"e2e-{i}", ids=ids, tail=tail, finish=finish, skip=skip,
                         worker=i % 3, want=oracle(tok, tail, out, skip)))

    async def main() -> dict[str, str]:
        sched = SchedulerClient(inp)
        sched.register(2, workers[2])  # same socket as the rows: detokd knows worker 2 in time
        wcs = [WorkerClient(a) for a in workers]
        streams = {r["rid"]: wcs[r["worker"]].stream(r["rid"]) for r in reqs}
        readers = {rid: asyncio.ensure_future(s.text()) for rid, s in streams.items()}
        pos = {r["rid"]: 0 for r in reqs}
        live = list(reqs)
        while live:
            for r in list(live):
                k = rng.randint(0, 5)
                rid, ids = r["rid"], r["ids"]
                new = ids[pos[rid]:pos[rid] + k]
                done = pos[rid] + len(new) >= len(ids)
                fin = r["finish"] if done else None
                if pos[rid] == 0 and sched.seq_of(rid) is None:
                    sched.begin(rid, new, worker=r["worker"], prompt_tail=r["tail"],
                                skip_special_tokens=r["skip"], finish=fin)
                else:
                    sched.add(rid, new, finish=fin)
                pos[rid] += len(new)
                if done:
                    live.remove(r)
            sched.flush()
            await asyncio.sleep(0.002)
        got = dict(zip(readers, await asyncio.gather(*readers.values()), strict=True))
        for rid, s in streams.items():
            r = next(q for q in reqs if q["rid"] == rid)
            assert s.finish == r["finish"] and s.n_ids == len(r["ids"]), rid
        sched.close()
        for w in wcs:
            await w.aclose()
        return got

    try:
        got = arun(main(), "uvloop", timeout=40)
    finally:
        rc, err = _stop(proc)
    for r in reqs:
        assert got[r["rid"]] == r["want"], (r["rid"], r["ids"], r["tail"], r["skip"])
    assert rc == 0, err[-3000:]


def test_end_to_end_sharded(tmp_path: Path, deepseek) -> None:
    """`serve --shards 2`: rids spread over derived inputs, text is still exact."""
    from detokd.launch import derive_address

    tok = deepseek
    base = f"ipc://{tmp_path}/in"
    waddr = f"ipc://{tmp_path}/w0"
    proc = _serve(tmp_path, "--input", base, "--worker", waddr, "--shards", "2")
    inputs = [derive_address(base, i) for i in range(2)]
    reqs = {f"s{i}": tok.encode(CORPUS[i % len(CORPUS)], add_special_tokens=False) for i in range(40)}
    assert {shard_for(rid, 2) for rid in reqs} == {0, 1}

    async def main() -> dict[str, str]:
        sched = SchedulerClient(inputs)
        async with WorkerClient(waddr) as w:
            streams = {rid: asyncio.ensure_future(w.stream(rid).text()) for rid in reqs}
            for rid, ids in reqs.items():
                sched.begin(rid, ids[:3])
            sched.flush()
            for rid, ids in reqs.items():
                sched.add(rid, ids[3:], finish=P.Finish("length"))
            sched.flush()
            got = dict(zip(streams, await asyncio.gather(*streams.values()), strict=True))
        sched.close()
        return got

    try:
        got = arun(main(), timeout=40)
    finally:
        rc, err = _stop(proc)
    for rid, ids in reqs.items():
        assert got[rid] == tok.decode(ids), rid
    assert rc == 0, err[-3000:]


class _Lines:
    """A subprocess's stdout lines, read on a thread, waited for with a deadline."""

    def __init__(self, stream) -> None:
        import queue
        import threading

        self.q: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.q.put(line)

    def wait_for(self, prefix: str, timeout: float = 30.0) -> str:
        import queue

        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no line starting {prefix!r}; got {self.seen}"
            try:
                line = self.q.get(timeout=left)
            except queue.Empty:
                continue
            self.seen.append(line)
            if line.startswith(prefix):
                return line.strip()


def _sse(port: int, body: dict) -> tuple[list[str], list[dict]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    deltas, events = [], []
    while True:
        line = resp.readline()
        assert line, "stream ended without [DONE]"
        line = line.decode().rstrip("\n")
        if not line:
            continue
        assert line.startswith("data: "), line
        if line == "data: [DONE]":
            break
        ev = json.loads(line[len("data: "):])
        events.append(ev)
        deltas.append(ev["choices"][0]["text"])
    conn.close()
    return deltas, events


def test_sse_example(tmp_path: Path, deepseek) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("sse_engine", REPO / "examples" / "sse_engine.py")
    example = importlib.util.module_from_spec(spec)
    sys.modules["sse_engine"] = example  # its dataclasses look their module up
    try:
        spec.loader.exec_module(example)
    finally:
        del sys.modules["sse_engine"]
    tok = deepseek

    with open(tmp_path / "example.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "examples" / "sse_engine.py"), "--port", "0", "--step-ms", "2"],
            stdout=subprocess.PIPE, stderr=log, text=True,
        )
    lines = _Lines(proc.stdout)
    detokd_pid = None
    try:
        detokd_pid = int(lines.wait_for("detokd pid").split()[-1])
        url = lines.wait_for("serving on http://127.0.0.1:")
        port = int(url.split(":")[2].split("/")[0])
        for prompt in ["hi", "héllo 世界 🙂, naïve?"]:
            ids = tok.encode(example.reply_for(prompt), add_special_tokens=False)
            tail = tok.encode(prompt, add_special_tokens=False)[-example.PROMPT_TAIL:]
            want = tok.decode(ids)
            assert oracle(tok, tail, ids, True) == want
            deltas, events = _sse(port, {"prompt": prompt, "stream": True})
            assert "".join(deltas) == want
            assert len([d for d in deltas if d]) > 3  # it streamed, in pieces
            assert events[-1]["choices"][0]["finish_reason"] == "stop"
        # Not streamed, cut by max_tokens.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "x", "max_tokens": 5}))
        resp = conn.getresponse()
        out = json.loads(resp.read())
        ids = tok.encode(example.reply_for("x"), add_special_tokens=False)[:5]
        assert out["choices"][0] == {"text": tok.decode(ids), "index": 0, "logprobs": None, "finish_reason": "length"}
        conn.close()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            if detokd_pid is not None and alive(detokd_pid):
                os.kill(detokd_pid, signal.SIGKILL)
    err = (tmp_path / "example.log").read_text()
    assert rc == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    deadline = time.monotonic() + 5
    while alive(detokd_pid):
        assert time.monotonic() < deadline, "detokd outlived the example"
        time.sleep(0.02)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_sse_example_killed_takes_detokd_along(tmp_path: Path) -> None:
    with open(tmp_path / "example.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "examples" / "sse_engine.py"), "--port", "0"],
            stdout=subprocess.PIPE, stderr=log, text=True,
        )
    lines = _Lines(proc.stdout)
    try:
        detokd_pid = int(lines.wait_for("detokd pid").split()[-1])
        proc.kill()  # no chance to clean up
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while alive(detokd_pid):
            assert time.monotonic() < deadline, "detokd outlived a SIGKILLed example"
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
