"""Reliability of a real `detokd serve` process, seen from its peers.

Every test here runs the real server (conftest's `detokd` fixture: a subprocess on
ipc:// sockets in tmp_path), talks to it over real ZMQ sockets with frames encoded
independently of detokd.wire.native (plain dicts through msgspec.msgpack, or bytes
written by hand), and checks every text against the oracle: Vocab.reference, the real DeepSeek
tokenizer's own decode. No expected string is written down.

Nothing sleeps and hopes: every wait polls a condition against a deadline and
every socket has a timeout, so a broken server fails a test instead of hanging it.
The peers and helpers are tests/utils.py's, shared with tests/test_metrics.py.
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import types

import pytest
import zmq
from utils import (
    Engine,
    Req,
    Sink,
    WorkerProcess,
    close_all,
    deepseek,
    enc,
    expected_text,
    logged,
    make_ids,
    metric,
    metrics_port,
    pull,
    scrape,
    wait_until,
)

from detokd.client import SchedulerClient, shard_for
from detokd.launch import derive_address
from detokd.process import DetokdProcess, ipc_config
from detokd.wire.native import Finish
from detokrig.frames import Hostile


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One detokd (2 workers, /metrics) for the tests that only ask how it answers
    rows: each uses rids of its own and leaves no request live."""
    from conftest import Detokd

    ctx = zmq.Context()
    d = Detokd(tmp_path_factory.mktemp("shared"), workers=2, args=["--metrics-port", "0"])
    sinks = [Sink(ctx, a) for a in d.workers]
    try:
        d.wait_ready()
        yield types.SimpleNamespace(d=d, sinks=sinks, port=metrics_port(d), eng=Engine(ctx, d.input))
        assert d.proc.poll() is None, d.log()[-3000:]
        assert d.stop() == 0
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait(10)
        close_all(ctx)
        ctx.destroy(linger=0)


# --------------------------------------------------------------------------- hostile input

N_BAD = 10_000  # frames detokd cannot decode, at least, in the fuzz test (plus ~20% hostile valid ones)


def test_fuzz_hostile_frames_never_kill_or_corrupt(detokd, tmp_path, zctx):
    """10,000+ malformed frames interleaved with valid traffic from 12 concurrent requests
    on 2 workers: detokd survives, every valid text is exact, every bad frame is counted
    in detokd_bad_frames, and the log stays small (rate limited)."""
    rng = random.Random(20240611)
    d = detokd(workers=2, args=["--metrics-port", "0"])
    sinks = [Sink(zctx, a) for a in d.workers]
    d.wait_ready()
    port = metrics_port(d)
    eng = Engine(zctx, d.input)
    reqs = [Req(f"ok-{i}", make_ids(rng, rng.randint(150, 400)), worker=i % 2) for i in range(12)]
    hostile = Hostile(rng, deepseek().size)
    weights, counts = [w for w, _ in hostile.gens], collections.Counter()
    expected_bad = sent_bad = 0
    valid_frames = 0
    per_valid = int(1.3 * N_BAD) // (sum(len(r.ids) for r in reqs) // 8) + 1
    while expected_bad < N_BAD or not all(r.done for r in reqs):
        live = [r for r in reqs if not r.done]
        if live:
            batch = rng.sample(live, min(len(live), rng.randint(1, 4)))
            eng.rows([r.row(rng.randint(1, 6)) for r in batch])
            valid_frames += 1
        for _ in range(per_valid if expected_bad < N_BAD else 0):
            gen = rng.choices(hostile.gens, weights)[0][1]
            (frame, bad), kind = gen(), gen.__name__
            counts[kind] += 1
            try:
                eng.multipart(frame) if isinstance(frame, list) else eng.raw(frame)
            except TimeoutError:
                raise AssertionError(f"after a {kind} frame {frame[:200]!r}: {d.log()[-3000:]}") from None
            sent_bad += 1
            expected_bad += bad
        assert d.proc.poll() is None, f"detokd died:\n{d.log()[-5000:]}"

    for r in reqs:
        sinks[r.worker].wait(lambda r=r: sinks[r.worker].ended(r.rid), 60, f"{r.rid} to finish")
    assert d.proc.poll() is None, f"detokd died:\n{d.log()[-5000:]}"
    for r in reqs:
        s = sinks[r.worker]
        assert s.errors(r.rid) == [], (r.rid, s.errors(r.rid))
        assert s.text(r.rid) == r.expected(), r.rid
        assert [row["n_ids"] for row in s.rows(r.rid)][-1] == len(r.ids)
        other = sinks[1 - r.worker]
        assert other.rows(r.rid) == [], "a valid request's rows went to the wrong worker"

    # Every bad frame counted, exactly (all were read before the late request below is).
    late = Req("ok-late", make_ids(rng, 50), worker=1)
    eng.rows([late.row(50)])
    sinks[1].wait(lambda: sinks[1].ended("ok-late"), 30, "a request after the fuzz")
    assert sinks[1].text("ok-late") == late.expected()
    m = scrape(port)
    bad_frames = metric(m, "detokd_bad_frames_total")
    assert bad_frames == expected_bad, (bad_frames, expected_bad, counts)
    assert expected_bad >= 10_000
    assert metric(m, "detokd_errors_total", kind="bad_ids") >= counts["bad_ids"]
    assert metric(m, "detokd_errors_total", kind="bad_row") > 0
    assert metric(m, "detokd_errors_total", kind="bad_start") >= counts["bad_worker"]
    assert metric(m, "detokd_errors_total", kind="internal") == 0
    # Hostile rows are answered with error rows, never with text.
    for s in sinks:
        for rid, rows in list(s.by_rid.items()):
            if rid.startswith("x-"):
                assert all(r["error"] is not None and r["text"] == "" for r in rows), (rid, rows)

    assert d.stop() == 0
    log_lines = d.log().splitlines()
    print(f"{sent_bad} hostile frames ({expected_bad} bad), {valid_frames} valid frames, {len(log_lines)} log lines; "
          f"{dict(counts)}")
    assert len(log_lines) < 300, "\n".join(log_lines[-100:])
    assert len(log_lines) < expected_bad / 30
    for s in sinks:
        s.close()


# --------------------------------------------------------------------------- lost, repeated, unknown rows


def test_lost_and_repeated_rows_fail_the_request_with_sequence_gap(shared):
    """A seq that does not match detokd's count (a row lost, or one sent twice) fails
    that request with "sequence_gap" at once, to its own worker, and frees its state;
    later rows of it get the same error, never text rebuilt from a partial state."""
    rng = random.Random(1)
    sinks, eng, port = shared.sinks, shared.eng, shared.port
    m0 = scrape(port)
    lost, twice, bystander = (Req(rid, make_ids(rng, n), worker=w) for rid, w, n in (("lost", 0, 60), ("twice", 1, 60), ("bystander", 0, 10)))

    eng.rows([lost.row(10, finish=False), twice.row(10, finish=False), bystander.row(10)])
    eng.rows([{**lost.row(5), "seq": 15}])  # ids 10..14 never arrived
    first = twice.ids[:10]
    eng.rows([{"rid": "twice", "ids": first, "seq": 0, "start": {"worker": 1}}])  # the first row again
    for s, rid in ((sinks[0], "lost"), (sinks[1], "twice")):
        s.wait(lambda s=s, rid=rid: s.ended(rid), 10, f"{rid}'s error row")
        assert s.errors(rid) == ["sequence_gap"], s.rows(rid)
        assert len(s.rows(rid)) == 2 and s.rows(rid)[0]["error"] is None
    assert sinks[1].rows("lost") == [] and sinks[0].rows("twice") == []  # only the owner hears

    # Its state is gone: a row with the seq detokd had counted gets the error again, no text.
    eng.rows([{"rid": "lost", "ids": lost.ids[10:20], "seq": 10}])
    sinks[0].wait(lambda: len(sinks[0].rows("lost")) == 3, 10, "the answer to a row after the gap")
    assert sinks[0].rows("lost")[-1]["error"] == "sequence_gap" and sinks[0].rows("lost")[-1]["text"] == ""
    # live_requests is a gauge, published between batches: it may follow the answer.
    m = wait_until(lambda: (lambda m: metric(m, "detokd_live_requests") == 0 and m)(scrape(port)), 10, "no live request")
    assert metric(m, "detokd_errors_total", kind="sequence_gap") - metric(m0, "detokd_errors_total", kind="sequence_gap") == 3

    # A rid that ended in an error may start anew, and its new text is exact.
    again = Req("lost", make_ids(rng, 40), worker=0)
    eng.rows([again.row(13, finish=False)])
    eng.rows([again.row(40)])
    sinks[0].wait(lambda: sinks[0].rows("lost")[-1]["finish"] is not None, 10, "the restarted request")
    assert "".join(r["text"] for r in sinks[0].rows("lost")[3:]) == again.expected()
    sinks[0].wait(lambda: sinks[0].ended("bystander"), 10, "bystander")
    assert sinks[0].text("bystander") == bystander.expected()


def test_a_new_vid_restarts_the_request(shared):
    """A start with another vid for a live rid drops the old state: the text from
    then on is exactly the new run's, with nothing of the old one mixed in."""
    rng = random.Random(2)
    sink, eng = shared.sinks[0], shared.eng
    old = Req("r", make_ids(rng, 80), vid=0)
    for _ in range(5):
        eng.rows([old.row(7, finish=False)])
    sink.wait(lambda: len(sink.rows("r")) == 5, 10, "the first run's rows")
    new = Req("r", make_ids(rng, 70), vid=1)
    while not new.done:
        eng.rows([new.row(rng.randint(1, 9))])
    sink.wait(lambda: sink.ended("r"), 10, "the second run to finish")
    rows = sink.rows("r")
    assert all(r["error"] is None for r in rows)
    assert "".join(r["text"] for r in rows[5:]) == new.expected()
    assert rows[-1]["n_ids"] == len(new.ids)
    assert shared.sinks[1].rows("r") == []


def test_unknown_and_aborted_rids_get_unknown_rid_on_every_worker(shared):
    sinks, eng = shared.sinks, shared.eng
    r = Req("aborted", make_ids(random.Random(3), 30), worker=1)
    eng.rows([r.row(10, finish=False)])
    sinks[1].wait(lambda: len(sinks[1].rows("aborted")) == 1, 10, "the first row")
    eng.send({"type": "abort", "rids": ["aborted"]})
    eng.rows([r.row(10, finish=False), {"rid": "never-started", "ids": [1, 2, 3], "seq": 0}])
    for s in sinks:
        s.wait(lambda s=s: s.ended("aborted") and s.ended("never-started"), 10, "unknown_rid on every worker")
        assert s.errors("never-started") == ["unknown_rid"]
        assert s.rows("aborted")[-1]["error"] == "unknown_rid"


# --------------------------------------------------------------------------- capacity


def test_at_max_states_the_oldest_request_is_evicted_and_told_at_once(detokd, zctx):
    """--max-states 4: the 5th live request evicts the 1st, whose worker gets an
    "evicted" row in reply to the very frame that evicted it (no later row needed);
    its later rows get "evicted" again; every other text stays exact. Under churn the
    table stays at 4 states."""
    rng = random.Random(4)
    d = detokd(workers=2, args=["--max-states", "4", "--metrics-port", "0"])
    sinks = [Sink(zctx, a) for a in d.workers]
    d.wait_ready()
    port = metrics_port(d)
    eng = Engine(zctx, d.input)
    reqs = [Req(f"c{i}", make_ids(rng, 40), worker=i % 2) for i in range(5)]
    for r in reqs[:4]:
        eng.rows([r.row(8, finish=False)])
    sinks[0].wait(lambda: len(sinks[0].rows("c0")) == 1, 10, "c0's first row")
    assert sinks[0].errors("c0") == []
    eng.rows([reqs[4].row(8, finish=False)])  # nothing else is sent until c0 hears
    sinks[0].wait(lambda: sinks[0].ended("c0"), 10, "c0's eviction row")
    assert sinks[0].rows("c0")[-1]["error"] == "evicted" and sinks[0].rows("c0")[-1]["n_ids"] == 8
    assert sinks[1].rows("c0") == []
    m = wait_until(lambda: (lambda m: metric(m, "detokd_live_requests") == 4 and m)(scrape(port)), 10, "4 live requests")
    assert metric(m, "detokd_evictions_total") == 1

    eng.rows([reqs[0].row(8, finish=False)])  # the engine did not notice in time
    sinks[0].wait(lambda: len(sinks[0].rows("c0")) == 3, 10, "the answer to c0's next row")
    assert sinks[0].rows("c0")[-1]["error"] == "evicted"
    for r in reqs[1:]:
        while not r.done:
            eng.rows([r.row(rng.randint(1, 8))])
    for r in reqs[1:]:
        s = sinks[r.worker]
        s.wait(lambda s=s, r=r: s.ended(r.rid), 10, r.rid)
        assert s.errors(r.rid) == [] and s.text(r.rid) == r.expected()

    # Churn: 40 requests never finished; each beyond 4 evicts the oldest, told at once.
    churn = [Req(f"n{i}", make_ids(rng, 10), worker=i % 2) for i in range(40)]
    for r in churn:
        eng.rows([r.row(3, finish=False)])
    for r in churn[:-4]:
        s = sinks[r.worker]
        s.wait(lambda s=s, r=r: s.ended(r.rid), 10, f"{r.rid} evicted")
        assert s.errors(r.rid) == ["evicted"]
    for r in churn[-4:]:
        assert sinks[r.worker].errors(r.rid) == []
    m = wait_until(lambda: (lambda m: metric(m, "detokd_evictions_total") == 37 and metric(m, "detokd_live_requests") == 4 and m)(
        scrape(port)), 10, "37 evictions, and the live-requests gauge published after them")
    assert metric(m, "detokd_errors_total", kind="evicted") == 38  # 37 evictions + c0's late row
    assert d.stop() == 0


# --------------------------------------------------------------------------- restart


def test_after_a_restart_rows_of_forgotten_rids_get_unknown_rid_everywhere(detokd, zctx):
    """detokd restarted (crash or deploy) mid-request: the engine's next rows name rids
    the new process never saw; each worker gets "unknown_rid" for them, so no request
    waits forever, and new requests are served exactly."""
    rng = random.Random(5)
    first = detokd(workers=2)
    sinks = [Sink(zctx, a) for a in first.workers]
    first.wait_ready()
    eng = Engine(zctx, first.input)
    a, b = Req("a", make_ids(rng, 50), worker=0), Req("b", make_ids(rng, 50), worker=1)
    eng.rows([a.row(20, finish=False), b.row(20, finish=False)])
    sinks[0].wait(lambda: sinks[0].rows("a"), 10, "a's first row")
    sinks[1].wait(lambda: sinks[1].rows("b"), 10, "b's first row")
    assert first.stop() == 0

    second = detokd(workers=2)  # the same addresses
    second.wait_ready()
    eng.rows([a.row(10), b.row(10)])
    for s in sinks:
        s.wait(lambda s=s: s.ended("a") and s.ended("b"), 20, "unknown_rid for a and b")
        assert s.rows("a")[-1]["error"] == "unknown_rid" and s.rows("b")[-1]["error"] == "unknown_rid"
    c = Req("c", make_ids(rng, 50), worker=1)
    eng.rows([c.row(25)])
    eng.rows([c.row(25)])
    sinks[1].wait(lambda: sinks[1].ended("c"), 10, "a new request after the restart")
    assert sinks[1].text("c") == c.expected()
    assert second.stop() == 0


# --------------------------------------------------------------------------- stalled workers


def test_a_stalled_or_gone_worker_never_blocks_the_others(detokd, tmp_path, zctx):
    """Worker 1 is bound but never reads (its queue fills: ZMQ's 16 messages, a 64 KiB
    backlog, a 1-message receive queue, rows made large by their meta to fill the
    kernel's buffer too);
    worker 3 was never there at all. Their requests fail with "worker_stalled",
    counted in /metrics, while workers 0 and 2 get every text exactly, before and
    after the stall. Then both come back (bind their address) and receive again."""
    rng = random.Random(6)
    # 64 KiB: hundreds of the healthy workers' messages, far more than a reading worker
    # ever has queued (a burst while ZMQ's I/O thread waits for a core), cheap to fill
    # for a stuck one.
    d = detokd(workers=4, args=["--metrics-port", "0"], send_queue_bytes=64 * 1024, linger_ms=200)
    good = {0: Sink(zctx, d.workers[0]), 2: Sink(zctx, d.workers[2])}
    stuck = pull(zctx, d.workers[1], hwm=1, rcvbuf=4096)
    d.wait_ready()
    port = metrics_port(d)
    eng = Engine(zctx, d.input)
    blob = bytes(rng.randrange(256) for _ in range(8 * 1024))  # meta: copied into each text row
    healthy = [Req(f"h{i}", make_ids(rng, 2500), worker=(0, 2)[i % 2]) for i in range(6)]
    starved = [Req(f"s{i}", make_ids(rng, 10_000), worker=1) for i in range(3)]
    ghost = Req("g0", make_ids(rng, 10_000), worker=3)
    steps, stalled_at = 0, None
    while not all(r.done for r in healthy):
        rows = [r.row(rng.randint(1, 4)) for r in healthy if not r.done]
        if not starved[0].done and not ghost.done:
            rows += [r.row(2, finish=False, meta=blob) for r in starved] + [ghost.row(2, finish=False, meta=blob[:1024])]
        eng.rows(rows)
        steps += 1
        if stalled_at is None and steps % 25 == 0:
            m = scrape(port)
            if metric(m, "detokd_worker_dropped_total", worker="1") and metric(m, "detokd_worker_dropped_total", worker="3"):
                stalled_at = steps
    assert stalled_at is not None and stalled_at < steps - 100, (stalled_at, steps)
    for r in healthy:
        s = good[r.worker]
        s.wait(lambda s=s, r=r: s.ended(r.rid), 20, f"{r.rid}: a healthy worker's request to finish")
        assert s.errors(r.rid) == [] and s.text(r.rid) == r.expected(), r.rid

    # The gauges are published between batches: the live-requests one may follow the answers.
    m = wait_until(lambda: (lambda m: metric(m, "detokd_live_requests") == 0 and m)(scrape(port)), 10,
                   "the failed requests' states freed")
    assert metric(m, "detokd_worker_dropped_total", worker="1") > 0, (steps, m)
    assert metric(m, "detokd_worker_dropped_total", worker="3") > 0
    assert metric(m, "detokd_worker_dropped_total", worker="0") == metric(m, "detokd_worker_dropped_total", worker="2") == 0
    # Each failed request counts once, and each of its later rows once more (answered "worker_stalled").
    assert metric(m, "detokd_errors_total", kind="worker_stalled") >= len(starved) + 1
    assert metric(m, "detokd_worker_writable", worker="1") == 0
    for w, message in (("1", 3 * (len(blob) + 512)), ("3", 1024 + 512)):  # each backlog is full: one more would not fit
        assert 64 * 1024 - message < metric(m, "detokd_worker_backlog_bytes", worker=w) <= 64 * 1024, w
    assert metric(m, "detokd_worker_messages_total", worker="0") >= steps // 2

    # Both come back: worker 1 rebinds its address, worker 3 binds for the first time.
    stuck.close()
    back = {1: Sink(zctx, d.workers[1]), 3: Sink(zctx, d.workers[3])}
    for w in back:
        wait_until(lambda w=w: metric(scrape(port), "detokd_worker_writable", worker=str(w)) == 1, 20, f"worker {w} writable again", 0.1)
    # Each hears that its requests failed, with no further row from the engine...
    for w, reqs in ((1, starved), (3, [ghost])):
        for r in reqs:
            back[w].wait(lambda w=w, r=r: "worker_stalled" in back[w].errors(r.rid), 10, f"{r.rid}'s worker_stalled row")
    # ...and once more for each later row of them; new requests flow exactly.
    eng.rows([starved[0].row(2, finish=False), ghost.row(2, finish=False)])
    fresh = [Req(f"f{w}", make_ids(rng, 60), worker=w) for w in back]
    while not all(r.done for r in fresh):
        eng.rows([r.row(rng.randint(1, 5)) for r in fresh if not r.done])
    for r in fresh:
        s = back[r.worker]
        s.wait(lambda s=s, r=r: s.ended(r.rid), 20, f"{r.rid}: a request to a worker that came back")
        assert s.errors(r.rid) == [] and s.text(r.rid) == r.expected()
    back[1].wait(lambda: back[1].errors("s0").count("worker_stalled") == 2, 10, "s0's second worker_stalled row")
    back[3].wait(lambda: back[3].errors("g0").count("worker_stalled") == 2, 10, "g0's second worker_stalled row")
    t0 = time.monotonic()
    assert d.stop() == 0
    assert time.monotonic() - t0 < 10


# --------------------------------------------------------------------------- shutdown


class Load(threading.Thread):
    """An engine that never pauses: 16 concurrent requests at a time, each step one
    frame with a row for every live one, new requests replacing finished ones;
    stops when told or when detokd takes no more input."""

    def __init__(self, ctx: zmq.Context, address: str, workers: int, seed: int) -> None:
        super().__init__(daemon=True)
        self.ctx, self.address, self.workers = ctx, address, workers
        self.rng = random.Random(seed)
        self.planned: dict[str, list[int]] = {}
        self.frames = 0
        self.halt = threading.Event()

    def run(self) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 200)
        sock.connect(self.address)
        live: list[Req] = []
        n = 0
        try:
            while not self.halt.is_set():
                while len(live) < 16:
                    r = Req(f"L{n}", make_ids(self.rng, self.rng.randint(20, 300)), worker=n % self.workers)
                    self.planned[r.rid] = r.ids
                    live.append(r)
                    n += 1
                frame = enc({"type": "tokens", "rows": [r.row(self.rng.randint(1, 8)) for r in live]})
                live = [r for r in live if not r.done]
                try:
                    sock.send(frame)
                except zmq.Again:
                    continue  # detokd stopped reading (or is gone); the test decides when to stop
                self.frames += 1
        finally:
            sock.close(linger=0)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_signal_under_load_stops_cleanly_with_consistent_output(detokd, zctx, sig):
    """SIGTERM, SIGINT or SIGHUP while an engine pushes without pause: detokd stops reading,
    finishes the frame in hand, lets queued sends leave within linger_ms and exits 0
    in bounded time; every text a worker received is a prefix of its request's
    oracle text (no row cut, repeated or reordered)."""
    d = detokd(workers=2)
    sinks = [Sink(zctx, a) for a in d.workers]
    d.wait_ready()
    load = Load(zctx, d.input, 2, seed=int(sig))
    load.start()
    try:
        wait_until(lambda: sum(s.messages for s in sinks) >= 300, 30, "output under load")
        sent_before = load.frames
        t0 = time.monotonic()
        d.proc.send_signal(sig)
        try:
            rc = d.proc.wait(15)
        except Exception:
            raise AssertionError(f"no exit 15 s after {sig!r}:\n{d.log()[-3000:]}") from None
        took = time.monotonic() - t0
        assert load.frames > sent_before, "the engine was not pushing when the signal came"
    finally:
        load.halt.set()
        load.join(5)
    assert rc == 0, d.log()[-3000:]
    assert took < 2.0 + 5, took  # linger_ms (2 s by default) + room for a loaded machine
    assert "stopping" in d.log() and "Traceback" not in d.log()
    checked = 0
    for s in sinks:
        with s.cond:
            received = {rid: list(rows) for rid, rows in s.by_rid.items()}
        for rid, rows in received.items():
            ids = load.planned[rid]
            n_ids = [r["n_ids"] for r in rows]
            assert all(r["error"] is None for r in rows), rows
            assert n_ids == sorted(n_ids) and n_ids[-1] <= len(ids), (rid, n_ids)
            text = "".join(r["text"] for r in rows)
            full = expected_text(ids)
            assert full.startswith(text), (rid, text, full)
            if rows[-1]["finish"] is not None:
                assert text == full
            checked += 1
    assert checked > 16


# --------------------------------------------------------------------------- worker restarts

# docs/client.md's "A complete run" worker, its address an argument: it streams three
# requests to their finish, prints their texts as JSON and exits cleanly.
COMPLETE_RUN_WORKER = r"""
import asyncio, json, sys
from detokd.client import WorkerClient, run

async def main():
    async with WorkerClient(sys.argv[1]) as worker:
        async def one(rid):
            return rid, "".join([d async for d in worker.stream(rid)])
        print(json.dumps(dict(await asyncio.gather(*(one(f"req-{i}") for i in range(3))))), flush=True)

run(main())
"""


def test_a_worker_that_read_every_finish_and_exits_cleanly_is_told_nothing_failed(detokd, zctx):
    """docs/client.md's complete run: the worker reads the three finishing rows and
    exits. Its connection's end fails nothing (no worker_stalled, nothing owed), is
    counted as 3 unconfirmed endings, and the next worker on the address gets no row
    for those requests."""
    d = detokd(workers=1, args=["--metrics-port", "0"])
    worker = subprocess.Popen([sys.executable, "-c", COMPLETE_RUN_WORKER, d.workers[0]], stdout=subprocess.PIPE)
    d.wait_ready()
    port = metrics_port(d)
    tok = deepseek().backend
    replies = {f"req-{i}": tok.encode(t, add_special_tokens=False).ids
               for i, t in enumerate(["Hello, world!", "日本語のテキスト 🙂", "naïve café"])}
    sent = dict.fromkeys(replies, 0)
    sched = SchedulerClient(d.input, context=zctx)
    while sent:  # the docs' scheduler: two ids per request per step
        for rid in list(sent):
            ids, k = replies[rid], sent[rid]
            new, last = ids[k:k + 2], k + 2 >= len(ids)
            fin = Finish("length") if last else None
            sched.begin(rid, new, worker=0, finish=fin) if k == 0 else sched.add(rid, new, finish=fin)
            sent[rid] = k + len(new)
            if last:
                del sent[rid]
        sched.flush()
    out, _ = worker.communicate(timeout=60)
    assert worker.returncode == 0 and json.loads(out) == {rid: expected_text(ids) for rid, ids in replies.items()}
    m = wait_until(lambda: (lambda m: metric(m, "detokd_worker_disconnects_total", worker="0") == 1 and m)(scrape(port)),
                   20, "the worker's exit seen")
    assert metric(m, "detokd_errors_total", kind="worker_stalled") == 0
    assert metric(m, "detokd_worker_owed_rows", worker="0") == 0
    assert metric(m, "detokd_worker_unconfirmed_total", worker="0") == 3
    logged(d, "INFO detokd.delivery: worker 0 disconnected: 0 live request(s) with rows in flight failed (worker_stalled); "
              "3 ended request(s) whose last row it may not have read (unconfirmed)")
    # The next worker: once it is connected and nothing is owed, a row owed to it would
    # have been queued before the fence.
    nxt = Sink(zctx, d.workers[0])
    wait_until(lambda: (lambda m: metric(m, "detokd_worker_writable", worker="0") == 1
                        and metric(m, "detokd_worker_owed_rows", worker="0") == 0)(scrape(port)), 20, "the next worker connected", 0.1)
    fence, eng = Req("fence", make_ids(random.Random(31), 20)), Engine(zctx, d.input)
    eng.rows([fence.row(20)])
    nxt.wait(lambda: nxt.ended("fence"), 20, "the fence")
    assert nxt.text("fence") == fence.expected()
    assert {rid: nxt.rows(rid) for rid in replies} == dict.fromkeys(replies, [])
    sched.close(0)
    assert d.stop() == 0


class Churn:
    """An engine's steps: 8 requests at a time of 5-40 ids, rows of 1-6 ids, each
    finished one replaced; `meta` (bytes) rides on every row, to fill queues."""

    def __init__(self, eng: Engine, rng: random.Random, meta: bytes | None = None) -> None:
        self.eng, self.rng, self.meta = eng, rng, meta
        self.planned: dict[str, Req] = {}
        self.live: list[Req] = []
        self.rows = 0

    def step(self, new: bool = True) -> None:
        while new and len(self.live) < 8:
            r = Req(f"k{len(self.planned)}", make_ids(self.rng, self.rng.randint(5, 40)))
            self.planned[r.rid] = r
            self.live.append(r)
        extra = {"meta": self.meta} if self.meta is not None else {}
        self.eng.rows([r.row(self.rng.randint(1, 6), **extra) for r in self.live])
        self.rows += len(self.live)
        self.live = [r for r in self.live if not r.done]

    def drain(self) -> None:
        while self.live:
            self.step(new=False)


def _text(rows: list[dict]) -> str:
    return "".join(r["text"] for r in rows if r["error"] is None)


def check_after_restart(old: WorkerProcess, new: Sink, planned: dict[str, Req], port: int) -> dict[str, list[str]]:
    """What a worker's death may do to each request, from what the dead worker read
    and what the next one got: a request whose finish it read is told nothing more; one
    that goes on is failed (worker_stalled) before any finishing row reaches the next
    worker, or streams exactly to its finish; one whose ending row died unread is told
    nothing, and counted unconfirmed. Returns the rids of each case."""
    read = old.finished()
    cases: dict[str, list[str]] = {"read": [], "failed": [], "exact": [], "silent": []}
    for rid, req in planned.items():
        before, after = old.rows(rid), new.rows(rid)
        ending = next((i for i, r in enumerate(after) if r["finish"] is not None or r["error"] is not None), None)
        if rid in read:
            assert after == [] and _text(before) == req.expected(), (rid, after)
            cases["read"].append(rid)
        elif ending is None:  # its ending row died unread; nothing of it came after
            assert after == [], (rid, after)
            cases["silent"].append(rid)
        elif after[ending]["error"] is not None:
            assert after[ending]["error"] == "worker_stalled", (rid, after)
            cases["failed"].append(rid)
        else:  # the next worker got its finish: nothing after it, and no hole before it
            assert after[ending + 1:] == [] and _text(before) + _text(after) == req.expected(), (rid, before, after)
            cases["exact"].append(rid)
    m = scrape(port)
    assert len(cases["silent"]) <= metric(m, "detokd_worker_unconfirmed_total", worker="0"), cases["silent"]
    assert metric(m, "detokd_errors_total", kind="worker_stalled") >= len(cases["failed"])
    return cases


def _settle(d, eng: Engine, new: Sink, port: int) -> None:
    """Every answer queued for the next worker, in: owed rows sent, then a fence."""
    wait_until(lambda: (lambda m: metric(m, "detokd_worker_writable", worker="0") == 1
                        and metric(m, "detokd_worker_owed_rows", worker="0") == 0)(scrape(port)), 20, "nothing owed", 0.1)
    fence = Req("fence", make_ids(random.Random(0), 10))
    eng.rows([fence.row(10)])
    new.wait(lambda: new.ended("fence"), 20, "the fence")


def test_a_worker_killed_mid_stream_fails_its_live_requests_and_no_finished_one(detokd, zctx):
    """SIGKILL while requests stream to the worker: the requests it read to their finish
    are told nothing more; the live ones fail (worker_stalled) and nothing of them
    reaches the next worker as a success with a hole."""
    d = detokd(workers=1, args=["--metrics-port", "0"])
    old = WorkerProcess(d.workers[0])
    d.wait_ready()
    port = metrics_port(d)
    eng = Engine(zctx, d.input)
    churn = Churn(eng, random.Random(32))
    steps = 0
    while len(old.finished()) < 20:
        churn.step()
        steps += 1
        # A step is one message to the worker; it reads them as they come, a few behind.
        old.wait(lambda steps=steps: old.messages >= steps - 3, 20, "the worker to keep up")
    assert churn.rows < 3000  # every finish it read is within the rows detokd keeps as in flight
    old.kill()
    for _ in range(5):  # rows for a worker that is gone
        churn.step()
    wait_until(lambda: metric(scrape(port), "detokd_worker_disconnects_total", worker="0") == 1, 20, "the kill seen")
    for _ in range(5):  # requests that start now wait in detokd's backlog for the next worker
        churn.step()
    new = Sink(zctx, d.workers[0])
    churn.drain()
    _settle(d, eng, new, port)
    cases = check_after_restart(old, new, churn.planned, port)
    assert len(cases["read"]) >= 20 and cases["failed"] and cases["exact"], cases
    assert d.stop() == 0


def test_a_stalled_worker_killed_with_its_queue_full_fails_no_request_it_finished(detokd, zctx):
    """The worker reads 30 messages and stops; detokd's queue to it fills (ZMQ's, the
    socket buffers, then its backlog); then it is killed and another binds. Requests it
    read to their finish are told nothing more; the others fail before any later row,
    or stream exactly; an ending that died unread is counted unconfirmed."""
    d = detokd(workers=1, args=["--metrics-port", "0"])
    old = WorkerProcess(d.workers[0], read=30)
    d.wait_ready()
    port = metrics_port(d)
    eng = Engine(zctx, d.input)
    churn = Churn(eng, random.Random(33), meta=b"m" * 2048)  # ~16 KB a message: the socket buffers fill in a few dozen
    while not old.stalled:
        churn.step()
    while not metric(scrape(port), "detokd_worker_backlog_messages", worker="0"):
        assert churn.rows < 20_000, "no backlog"
        for _ in range(5):
            churn.step()
    old.kill()
    wait_until(lambda: metric(scrape(port), "detokd_worker_disconnects_total", worker="0") == 1, 20, "the kill seen")
    new = Sink(zctx, d.workers[0])
    churn.drain()
    _settle(d, eng, new, port)
    cases = check_after_restart(old, new, churn.planned, port)
    assert cases["read"] and cases["failed"] and cases["silent"], cases
    assert d.stop() == 0


# --------------------------------------------------------------------------- shard restarts


def _rids(shard: int, prefix: str, n: int) -> list[str]:
    """n rids of `shard` of two (shard_for), each named `prefix` and a number."""
    return [rid for rid in (f"{prefix}{i}" for i in range(100 * n)) if shard_for(rid, 2) == shard][:n]


def test_a_scheduler_watching_its_shards_is_told_every_request_a_shard_restart_may_have_lost(tmp_path, zctx):
    """`detokd serve --shards 2`; shard 0 stops reading (SIGSTOP), 20 whole requests
    wait in its input queue, then it is killed and the supervisor restarts it. What its
    queue held is gone, unanswered (no detokd saw it, no worker is told). A
    SchedulerClient with watch=True notices the broken connection: every request not
    answered is in its lost(), as is the one live across the restart, and nothing of
    shard 1, which answers everything exactly."""
    rng = random.Random(34)
    cfg = ipc_config(tmp_path, workers=1, log_level="info")
    d = DetokdProcess(cfg, folder=tmp_path, args=["--shards", "2"])
    sink = Sink(zctx, cfg.workers[0])
    try:
        d.start()
        addrs = [derive_address(cfg.input, i) for i in range(2)]
        sched = SchedulerClient(addrs, context=zctx, watch=True)
        planned: dict[str, list[int]] = {}

        def whole(rids: list[str]) -> None:
            for rid in rids:
                planned[rid] = make_ids(rng, 12)
                sched.begin(rid, planned[rid], worker=0, finish=Finish("length"))
                sched.flush()

        (live,) = _rids(0, "live", 1)
        sched.begin(live, make_ids(rng, 4), worker=0)
        whole(_rids(0, "a", 3) + _rids(1, "a", 3))
        sink.wait(lambda: all(sink.ended(rid) for rid in planned) and sink.rows(live), 20, "the answers before")
        shard0 = int(re.findall(r"shard 0 started \(pid (\d+)\)", d.log())[-1])
        os.kill(shard0, signal.SIGSTOP)  # killed, never continued
        queued, other = _rids(0, "q", 20), _rids(1, "o", 5)
        whole(queued + other)
        sink.wait(lambda: all(sink.ended(rid) for rid in other), 20, "shard 1's answers")
        os.kill(shard0, signal.SIGKILL)
        lost: set[str] = set()
        wait_until(lambda: lost.update(sched.lost()) or live in lost, 20, "the broken connection noticed")
        wait_until(lambda: d.log().count(f"serving: input {addrs[0]}") == 2, 60, "shard 0 restarted")
        whole(_rids(0, "b", 3) + _rids(1, "b", 3))
        sink.wait(lambda: all(sink.ended(rid) for rid in planned if rid[0] == "b"), 20, "the answers after")
        lost.update(sched.lost())
        sched.close(0)

        unanswered = {rid for rid in planned if not sink.ended(rid)}
        assert unanswered and unanswered <= lost, (unanswered, lost)  # lost, and never silently
        assert live in lost and all(shard_for(rid, 2) == 0 for rid in lost), lost
        for rid in set(planned) - unanswered:
            assert sink.errors(rid) == [] and sink.text(rid) == expected_text(planned[rid]), rid
        assert d.stop() == 0
    finally:
        d.kill()
