"""detokd.client.worker: WorkerClient and RequestStream.

A real PUSH socket stands where detokd would (utils.FakeDetokd) and sends `text`
messages; these test the client, not the server. What the client keeps for rids
with no open stream is detokd.client.buffer's policy (tests/test_client_buffer.py);
here it is seen through streams.
"""

from __future__ import annotations

import asyncio
import gc
import random
from pathlib import Path

import msgspec
import pytest
import zmq
from utils import FakeDetokd, FakeShards, arun, out_row, until

from detokd.client import DetokdError, WorkerClient, WorkerClosed
from detokd.wire import native

LOOPS = ["asyncio", "uvloop"]


@pytest.fixture
def waddr(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/w0"


@pytest.mark.parametrize("loop", LOOPS)
def test_stream_yields_deltas_and_ends_at_finish(waddr: str, loop: str) -> None:
    async def main() -> None:
        async with WorkerClient(waddr) as w:
            d = FakeDetokd(waddr)
            s = w.stream("r")
            d.text(out_row("r", "Hel", 2), out_row("other", "x", 1))
            d.text(out_row("r", "", 3))  # nothing ready yet: not yielded
            d.text(out_row("r", "lo 世界", 5, meta={"lp": -1.5}))
            d.text(out_row("r", "!", 6, finish="stop", meta=[7]))
            got = [t async for t in s]
            assert got == ["Hel", "lo 世界", "!"]
            assert s.finish == native.Finish("stop") and s.n_ids == 6 and s.done
            assert s.meta_obj() == [7]
            # The unclaimed rid "other" waited in the buffer.
            assert w.buffered_rids == 1
            o = w.stream("other")
            d.text(out_row("other", "y", 2, finish="length"))
            assert await o.text() == "xy"
            d.close()

    arun(main(), loop)


@pytest.mark.parametrize("loop", LOOPS)
def test_rows_before_the_stream_opens_are_kept(waddr: str, loop: str) -> None:
    async def main() -> None:
        async with WorkerClient(waddr) as w:
            d = FakeDetokd(waddr)
            d.text(out_row("early", "a", 1), out_row("early", "b", 2, finish="stop"))
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
            d.text(out_row("bad", "partial", 3), out_row("bad", "", 3, error=native.SEQUENCE_GAP))
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


@pytest.mark.parametrize("together", [True, False], ids=["same-frame", "later-frame"])
def test_rows_that_follow_an_error_row_are_dropped_not_kept_for_the_rids_next_stream(waddr: str, together: bool) -> None:
    """detokd sends a worker_stalled row ahead of rows of the request it still had queued
    (docs/client.md, "Queues and loss"): read in the error row's frame or after the
    stream ended, they are the failed request's, and a new stream of the rid gets none."""

    async def main(d: FakeDetokd) -> None:
        async with WorkerClient(waddr) as w:
            s = w.stream("r")
            late = [out_row("r", "b", 2), out_row("r", "c", 3)]
            d.text(out_row("r", "a", 1), out_row("r", "", 1, error=native.WORKER_STALLED), *(late if together else []))
            with pytest.raises(DetokdError):
                await s.text()
            if not together:
                d.text(*late)
            d.text(out_row("fence", "", 0, finish="stop"))  # read once every row before it is
            await w.stream("fence").text()
            buffered = w.buffered_rids
            again = w.stream("r")
            d.text(out_row("r", "new", 1, finish="length"))
            assert await again.text() == "new" and again.n_ids == 1
            assert buffered == 0 and w.stale_rows == 2

    d = FakeDetokd(waddr)
    try:
        arun(main(d))
    finally:
        d.close()


def test_error_rows_of_other_workers_rids_are_ignored(waddr: str) -> None:
    async def main() -> None:
        async with WorkerClient(waddr) as w:
            d = FakeDetokd(waddr)
            s = w.stream("mine")
            # detokd broadcasts unknown-rid errors to every worker: not ours, not buffered.
            d.text(*[out_row(f"theirs{i}", error=native.UNKNOWN_RID) for i in range(5)])
            d.text(out_row("buffered", "t", 1), out_row("buffered", error=native.EVICTED))
            d.text(out_row("mine", "ok", 1, finish="stop"))
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
                d.text(out_row(f"u{i}", f"t{i}", 1))
            d.text(out_row("u4", "!", 2, finish="stop"))
            await until(lambda: w.dropped_rids == 2)
            # u4's finishing row came last: once its stream ends, every row has been read.
            assert await w.stream("u4").text() == "t4!"  # the newest survive
            assert w.dropped_rids == 2 and w.buffered_rids == 2  # u0, u1 dropped; u2, u3 held
            # Many unread rids never grow the buffer past its bound.
            d.text(*[out_row(f"v{i}", "x", 1) for i in range(1000)])
            await until(lambda: w.dropped_rids == 2 + 1000 - 1)
            assert w.buffered_rids == 3
            d.close()

    arun(main())


def test_closed_stream_drops_late_rows_until_finish(waddr: str) -> None:
    async def main() -> None:
        async with WorkerClient(waddr) as w:
            d = FakeDetokd(waddr)
            async with w.stream("gone") as s:
                d.text(out_row("gone", "a", 1))
                assert await s.__anext__() == "a"
            # The HTTP client went away; the engine still sends a few rows.
            d.text(out_row("gone", "b", 2), out_row("gone", "c", 3, finish="abort"))
            await until(lambda: w.dropped_rows == 2)
            assert w.buffered_rids == 0
            # After its finish the rid may be reused: buffered again like any new rid.
            d.text(out_row("gone", "new", 1, finish="stop"))
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
            d.text(out_row("lost", "x", 1))
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
        await asyncio.sleep(0)  # one turn of the loop: the waiter is now waiting on the stream
        assert not waiter.done()
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
                    batch.append(out_row(rid, chunk, n[rid], finish="stop" if fin else None))
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
            d.text(out_row("r", "fine", 1, finish="stop"))
            assert await s.text() == "fine"
            assert w.bad_frames == 2
            d.close()

    arun(main())


def test_embedding(waddr: str) -> None:
    async def main() -> None:
        async with WorkerClient(waddr) as w:
            d = FakeDetokd(waddr)
            fut = asyncio.ensure_future(w.embedding("e"))
            data = msgspec.Raw(msgspec.msgpack.encode([0.25]))
            d.raw(native.encode(native.Embeddings([native.EmbeddingRow("e", 0, data)])))
            r = await fut
            assert msgspec.msgpack.decode(r.data) == [0.25]
            d.close()

    arun(main())


def test_raw_rows(waddr: str) -> None:
    async def main() -> None:
        w = WorkerClient(waddr)
        d = FakeDetokd(waddr)
        d.text(out_row("a", "1", 1), out_row("b", "2", 1))
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
        assert shards.recv(i) == native.Register(3, addr)
    w.register()  # again, e.g. after a detokd restart
    for i in range(2):
        assert shards.recv(i) == native.Register(3, addr)
    w.close()
    # A wildcard bind registers the address detokd can reach.
    w = WorkerClient("tcp://127.0.0.1:*", shards=shards.addresses, worker=4,
                     advertise="tcp://worker-host:6000", context=shards.ctx)
    for i in range(2):
        assert shards.recv(i) == native.Register(4, "tcp://worker-host:6000")
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
