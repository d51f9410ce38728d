"""/health and /metrics of a real `detokd serve` process, over real HTTP.

detokd is told metrics_port 0 and serves on a free port of 127.0.0.1, which it
logs. /metrics is read with the Prometheus client's own text parser, and every
counter is checked against traffic whose counts the test knows exactly.
"""

from __future__ import annotations

import http.client
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import msgspec
from prometheus_client.parser import text_string_to_metric_families
from utils import Engine, Req, Sink, deepseek, http_get, make_ids, metric, metrics_port, scrape, wait_until

from detokd.process import DetokdProcess, ipc_config
from detokd.server import Server
from detokd.wire.native import NativeDialect


def test_health_is_200_while_the_loop_turns_and_503_while_it_is_stuck(detokd, tmp_path, zctx):
    """health_timeout 0.5 s: an idle loop still turns (it polls with a timeout), as its
    own figures show (a young collection a second between batches, no frame read), and
    /health says 200; blocked for 4 s (conftest's STALLABLE), /health says 503 and
    /metrics still answers; once the loop turns again, 200, and the frames that waited
    are served exactly. Each verdict rests on the loop's own state: a host too busy to
    run detokd for 0.5 s can delay a 200, never fail the test (it did: the first
    /health right after READY, under two busy processes)."""
    waiting = Req("waiting", make_ids(random.Random(1), 40))  # (loads the oracle now, not in the stall)
    d = detokd(args=["--metrics-port", "0"], stallable=True, health_timeout=0.5)
    sink = Sink(zctx, d.workers[0])
    d.wait_ready()
    port = metrics_port(d)
    eng = Engine(zctx, d.input)
    # Clients that connect and never send a request hold a thread each, not the endpoint.
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(20)]
    wait_until(lambda: http_get(port, "/health") == (200, b"ok\n"), 10, "/health 200 as the loop turns")
    m0 = scrape(port)
    grown = lambda m: metric(m, "detokd_gc_collections_total") >= metric(m0, "detokd_gc_collections_total") + 2  # noqa: E731
    m1 = wait_until(lambda: (lambda m: grown(m) and m)(scrape(port)), 10, "the idle loop's collections")
    assert metric(m1, "detokd_frames_total") == 0  # it turned by itself: no frame woke it
    wait_until(lambda: http_get(port, "/health")[0] == 200, 10, "/health 200 while idle")
    assert http_get(port, "/nothing")[0] == 404

    d.stall(4)
    status, body = wait_until(lambda: (lambda r: r[0] == 503 and r)(http_get(port, "/health")), 3.5, "/health 503")
    assert b"stuck" in body
    eng.rows([waiting.row(40)])
    m = scrape(port)  # the loop is stuck; /metrics answers all the same
    assert metric(m, "detokd_loop_idle_seconds") > 0.5
    wait_until(lambda: http_get(port, "/health")[0] == 200, 10, "/health 200 after the stall")
    sink.wait(lambda: sink.ended("waiting"), 10, "the frame that waited behind the stall")
    assert sink.text("waiting") == waiting.expected()
    for c in idle:
        c.close()
    assert d.stop() == 0


# A `detokd serve` whose READY=1 asks its own /health at once, before the loop's first
# turn: the moment a supervisor that just heard READY may ask, at its worst. argv: the
# metrics port, then detokd's arguments.
PROBE_AT_READY = r"""
import sys, urllib.error, urllib.request
from detokd import cli, readiness

notify = readiness.notify

def probing(state):
    sent = notify(state)
    if state == "READY=1":
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=10) as r:
                answer = (r.status, r.read())
        except urllib.error.HTTPError as e:
            answer = (e.code, e.read())
        print("health at READY:", answer, flush=True)
    return sent

readiness.notify = probing
sys.exit(cli.main(sys.argv[2:]))
"""


def test_health_is_200_the_moment_detokd_says_ready(tmp_path):
    """READY=1 and the first /health after it: the loop has not turned yet, and the
    seconds start-up took (the tokenizer) are no stall: the heartbeat starts with the
    loop. One dated from before start-up would say "loop stuck for 1.8s" (6-8 s under
    load) to a supervisor that asks before the first turn."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = ipc_config(tmp_path, metrics_port=port, health_timeout=1.0, log_level="info")
    d = DetokdProcess(cfg, folder=tmp_path, command=[sys.executable, "-c", PROBE_AT_READY, str(port)]).spawn()
    try:
        d.wait_ready()
        wait_until(lambda: "health at READY:" in d.log(), 20, "the probe's answer")
        assert "health at READY: (200, b'ok\\n')" in d.log(), d.log()[-2000:]
        assert d.stop() == 0
    finally:
        d.kill()


FLOOD = r"""
import sys, threading, random, msgspec, zmq
inp, workers = sys.argv[1], sys.argv[2:]
ctx = zmq.Context()
def drain(addr):
    s = ctx.socket(zmq.PULL)
    s.bind(addr)
    while True:
        s.recv(copy=False)
for w in workers:
    threading.Thread(target=drain, args=(w,), daemon=True).start()
rng = random.Random(1)
# Whole requests in one row each (start and finish): a frame can be sent again and
# again, since a finished rid may start anew. 64 rows of 20-200 ids per frame.
frames = [msgspec.msgpack.encode({"type": "tokens", "rows": [
    {"rid": f"flood-{f}-{i}", "ids": [rng.randrange(1000, 100000) for _ in range(rng.randint(20, 200))],
     "start": {"worker": i % len(workers)}, "finish": {"reason": "length"}} for i in range(64)]})
    for f in range(8)]
push = ctx.socket(zmq.PUSH)
push.connect(inp)
n = 0
while True:
    push.send(frames[n % 8])
    n += 1
"""


def _health_ms(port: int) -> float:
    t0 = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        c.request("GET", "/health")
        r = c.getresponse()
        r.read()
        assert r.status == 200, r.status
    finally:
        c.close()
    return (time.perf_counter() - t0) * 1000


def test_health_answers_within_100ms_while_the_loop_is_saturated(detokd, tmp_path):
    """A separate process floods detokd with valid traffic (and drains its workers)
    so the loop never waits for input; /health still answers 200, median round trip
    of 7 under 100 ms. The flood is checked to have kept the loop busy."""
    d = detokd(workers=2, args=["--metrics-port", "0"])
    d.wait_ready()
    port = metrics_port(d)
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, d.input, *d.workers], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: metric(scrape(port), "detokd_frames_total") > 200, 30, "the flood to arrive", 0.1)
        m0, w0 = scrape(port), time.monotonic()
        times = []
        for _ in range(7):
            times.append(_health_ms(port))
            time.sleep(0.1)
        m1, w1 = scrape(port), time.monotonic()
        assert flood.poll() is None
    finally:
        flood.kill()
        flood.wait(10)
    busy = (metric(m1, "detokd_step_seconds_sum") - metric(m0, "detokd_step_seconds_sum")) / (w1 - w0)
    frames = metric(m1, "detokd_frames_total") - metric(m0, "detokd_frames_total")
    print(f"/health under flood: {sorted(round(t, 1) for t in times)} ms; loop busy {busy:.0%}, {frames:.0f} frames")
    assert busy > 0.5 and frames > 50, (busy, frames)  # saturated: it was busy most of the window
    assert statistics.median(times) < 100, times
    assert d.stop() == 0


def test_metrics_is_prometheus_text_with_every_counter_exact(detokd, zctx):
    """Known traffic (finished, live, evicted, lost-row and unknown requests, bad
    frames, over two workers), then /metrics parsed by prometheus_client: rows,
    tokens, live requests, evictions, errors by kind, bad frames, per-worker
    counters and the step latency histogram hold exactly what was sent."""
    rng = random.Random(7)
    d = detokd(workers=2, args=["--max-states", "8", "--metrics-port", "0"])
    sinks = [Sink(zctx, a) for a in d.workers]
    d.wait_ready()
    port = metrics_port(d)
    eng = Engine(zctx, d.input)
    rows = tokens = frames = 0
    per_worker = [0, 0]

    def send(batch: list[dict], decoded: int) -> None:
        nonlocal rows, tokens, frames
        eng.rows(batch)
        rows += len(batch)
        tokens += decoded
        frames += 1

    done = [Req(f"done{i}", make_ids(rng, 50), worker=i % 2) for i in range(6)]
    while not all(r.done for r in done):
        going = [r for r in done if not r.done]
        for w in {r.worker for r in going}:  # one message per worker per frame
            per_worker[w] += 1
        batch = [r.row(rng.randint(1, 9)) for r in going]
        send(batch, sum(len(r["ids"]) for r in batch))
    live = [Req(f"live{i}", make_ids(rng, 50), worker=1) for i in range(10)]
    for r in live:  # 8 fit: live8 and live9 evict live0 and live1 (worker 1 hears in the same message)
        send([r.row(5, finish=False)], 5)
        per_worker[1] += 1
    send([{"rid": "live9", "ids": [1, 2], "seq": 99}], 0)  # a lost row: sequence_gap, to worker 1
    per_worker[1] += 1
    send([{"rid": "nobody", "ids": [1, 2, 3], "seq": 0}], 0)  # unknown_rid, to both workers
    per_worker[0] += 1
    per_worker[1] += 1
    for frame in (b"", b"\xc1", b"\x93\x01\x02\x03"):
        eng.raw(frame)
        frames += 1
    for s in sinks:
        s.wait(lambda s=s: s.ended("nobody"), 10, "the last row's answer")
    for r in done:
        assert sinks[r.worker].text(r.rid) == r.expected()

    status, body = http_get(port, "/metrics")
    assert status == 200
    # Gauges are read when scraped; writable is each queue as the loop last read it (every
    # 50 ms): 1 once a read found both queues read (one may have been at its mark when the
    # last answer left).
    settled = lambda m: metric(m, "detokd_frames_total") == frames and all(  # noqa: E731
        metric(m, "detokd_worker_writable", worker=str(w)) == 1 for w in (0, 1))
    m = wait_until(lambda: (lambda m: settled(m) and m)(scrape(port)), 10, "every frame counted, the queues read")
    assert metric(m, "detokd_rows_total") == rows
    assert metric(m, "detokd_tokens_total") == tokens
    assert metric(m, "detokd_requests_started_total") == 16
    assert metric(m, "detokd_live_requests") == 7  # 10 live, 2 evicted, 1 failed on its lost row
    assert metric(m, "detokd_evictions_total") == 2
    assert metric(m, "detokd_errors_total", kind="evicted") == 2
    assert metric(m, "detokd_errors_total", kind="sequence_gap") == 1
    assert metric(m, "detokd_errors_total", kind="unknown_rid") == 1
    assert metric(m, "detokd_bad_frames_total") == 3
    for w in (0, 1):
        assert metric(m, "detokd_worker_messages_total", worker=str(w)) == sinks[w].messages == per_worker[w]
        assert metric(m, "detokd_worker_dropped_total", worker=str(w)) == 0
    # The step histogram: one observation per frame that was decoded, cumulative buckets.
    count = metric(m, "detokd_step_seconds_count")
    assert count == frames - 3
    buckets = sorted((float(k[1][1]), v) for k, v in m.items() if k[0] == "detokd_step_seconds_bucket")
    assert buckets[-1] == (float("inf"), count)
    assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:], strict=False))
    assert 0 < metric(m, "detokd_step_seconds_sum") < count  # seconds: well under a second a step
    assert d.stop() == 0


def test_the_gauges_are_read_when_scraped_not_copied_by_each_turn(tmp_path):
    """The loop copies no gauge between batches: a scrape reads the core's and delivery's
    sizes itself, so it sees frames no turn has ended after."""
    server = Server(ipc_config(tmp_path, metrics_port=0), NativeDialect.make, vocab=deepseek())
    try:
        server.process(msgspec.msgpack.encode({"type": "tokens", "rows": [
            {"rid": f"r{i}", "ids": [100], "start": {}} for i in range(3)]}), False)  # no _between_batches
        m = scrape(server.metrics.port)
        assert metric(m, "detokd_live_requests") == 3
        assert metric(m, "detokd_worker_messages_total", worker="0") == 1
        assert metric(m, "detokd_memory_entries", memory="tombstones") == 0
    finally:
        server.close()


def test_every_metric_family_is_documented_in_deploy_md(detokd, zctx):
    d = detokd(workers=1, args=["--metrics-port", "0"])
    d.wait_ready()
    families = {f.name for f in text_string_to_metric_families(http_get(metrics_port(d), "/metrics")[1].decode())}
    doc = (Path(__file__).parent.parent / "docs" / "deploy.md").read_text()
    documented = set(re.findall(r"^\| `(detokd_[a-z_]+)` \|", doc, re.M))
    # prometheus_client names a counter without its _total; docs give the scraped name.
    assert {n + "_total" if n + "_total" in documented else n for n in families if n.startswith("detokd_")} == documented
