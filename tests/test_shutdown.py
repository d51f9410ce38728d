"""How detokd stops: within shutdown_grace_s whatever its loop is doing, the frames
queued at SIGTERM answered (decoded, or `shutdown` once the decoding share of the grace
is spent), new frames left with their senders, and signals that arrive while the log
is busy or the last words are written never kill it otherwise than said.

Real `detokd serve` processes (some through a wrapper that blocks the loop: conftest's
STALLABLE, or a patched log filter), real ZMQ sockets (docs/reliability.md).
"""
from __future__ import annotations

import contextlib
import functools
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import msgspec
import psutil
import pytest
import zmq
from utils import Engine, Req, Sink, http_get, make_ids, wait_until
from zmq.utils.monitor import recv_monitor_message

from detokd.process import DetokdProcess, ipc_config

enc = msgspec.msgpack.encode
PY = sys.executable


# --------------------------------------------------------------------------- 1. shutdown grace


def test_a_signal_ends_the_process_within_the_shutdown_grace_even_when_the_loop_is_stuck(detokd, zctx):
    d = detokd(workers=1, stallable=True, shutdown_grace_s=1.0)
    Sink(zctx, d.workers[0])
    d.wait_ready()
    d.stall(120)
    d.proc.send_signal(signal.SIGTERM)
    try:
        code = d.proc.wait(30)  # the stall lasts 120 s: only the grace timer ends it sooner
    except subprocess.TimeoutExpired:
        raise AssertionError("detokd still running 30 s after SIGTERM") from None
    assert code == 3
    assert "not stopped within shutdown_grace_s = 1.0 s" in d.log()


# --------------------------------------------------------------------------- 2. stopping: the queue, the log's locks


def _queue_behind_a_stall(d, zctx, stall: float, frames: list[dict]) -> None:
    """Stall the loop, queue `frames` in detokd's input while it is stalled, and return
    once all of them have left the sender (they are then detokd's: its I/O thread reads
    them into the socket's queue while the loop sleeps)."""
    d.stall(stall)
    _send_all(d, frames)


def _exit_code(d, within: float) -> int:
    try:
        return wait_until(lambda: d.proc.poll() is not None and (d.proc.returncode,), within, "detokd to exit")[0]
    except TimeoutError:
        d.kill()
        raise


def test_frames_queued_when_sigterm_comes_are_all_answered_exactly(detokd, zctx):
    """900 finishing requests wait in detokd's input while the loop is stalled; SIGTERM
    comes: every one is answered, not only the frame in hand."""
    d = detokd(workers=1, stallable=True)
    w = Sink(zctx, d.workers[0])
    d.wait_ready()
    rng = random.Random(18)
    reqs = [Req(f"q{i}", make_ids(rng, rng.randrange(1, 24))) for i in range(900)]
    expected = {r.rid: r.expected() for r in reqs}
    _queue_behind_a_stall(d, zctx, 2.0, [{"type": "tokens", "rows": [r.row(len(r.ids))]} for r in reqs])
    d.proc.send_signal(signal.SIGTERM)
    assert _exit_code(d, 30) == 0
    w.wait(lambda: all(w.ended(rid) for rid in expected), 20, "an answer for every queued request")
    assert {rid: w.text(rid) for rid in expected} == expected
    assert not any(w.errors(rid) for rid in expected)
    assert "stopping: 900 queued frame(s) answered (0 row(s) with shutdown)" in d.log()


def test_after_sigterm_new_frames_are_not_taken_they_wait_with_their_sender_for_the_next_detokd(detokd, zctx):
    """SIGTERM while frames are queued: detokd answers those, but takes no new frame. A
    scheduler's connection is closed by the unbind, so a frame it sends then stays in its
    own queue, and the next detokd bound at the address gets it, unanswered by this one."""
    d = detokd(workers=1, stallable=True)
    w = Sink(zctx, d.workers[0])
    d.wait_ready()
    late = zctx.socket(zmq.PUSH)
    late.setsockopt(zmq.LINGER, 0)
    mon = late.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    mon.setsockopt(zmq.RCVTIMEO, 20000)
    late.connect(d.input)
    assert recv_monitor_message(mon)["event"] == zmq.EVENT_CONNECTED
    rng = random.Random(20)
    reqs = [Req(f"q{i}", make_ids(rng, 12)) for i in range(300)]
    _queue_behind_a_stall(d, zctx, 2.0, [{"type": "tokens", "rows": [r.row(len(r.ids))]} for r in reqs])
    d.proc.send_signal(signal.SIGTERM)
    assert recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED  # the unbind, after the frame in hand
    frame = enc({"type": "tokens", "rows": [Req("late", make_ids(rng, 5)).row(5)]})
    late.send(frame)
    assert _exit_code(d, 30) == 0
    w.wait(lambda: all(w.ended(r.rid) for r in reqs), 20, "an answer for every queued request")
    assert not w.rows("late")
    nxt = zctx.socket(zmq.PULL)
    nxt.setsockopt(zmq.RCVTIMEO, 20000)
    nxt.bind(d.input)  # the next detokd's place
    assert nxt.recv() == frame
    late.disable_monitor()
    mon.close(0)
    nxt.close(0)


def test_rows_queued_past_the_decoding_share_of_the_grace_get_shutdown_errors_never_silence(detokd, zctx):
    """The stall (6 s) outlasts half of shutdown_grace_s (8 s): the 200 requests queued
    behind it are read and each answered with one `shutdown` row to its worker, meta
    echoed; the process still exits 0 within the grace."""
    d = detokd(workers=2, stallable=True)
    sinks = [Sink(zctx, a) for a in d.workers]
    d.wait_ready()
    rng = random.Random(19)
    reqs = [Req(f"late{i}", make_ids(rng, 8), worker=i % 2) for i in range(200)]
    _queue_behind_a_stall(d, zctx, 6.0, [{"type": "tokens", "rows": [r.row(8, meta={"n": i})]} for i, r in enumerate(reqs)])
    d.proc.send_signal(signal.SIGTERM)
    assert _exit_code(d, 30) == 0
    for i, r in enumerate(reqs):
        w = sinks[r.worker]
        rows = w.wait(lambda w=w, r=r: w.rows(r.rid), 20, f"the answer to {r.rid}")
        assert [(x["error"], x["text"], x["meta"]) for x in rows] == [("shutdown", "", {"n": i})]
        assert not sinks[1 - r.worker].rows(r.rid)
    assert "no time left to decode" in d.log()
    assert "stopping: 200 queued frame(s) answered (200 row(s) with shutdown)" in d.log()


def _storm(pid: int, seconds: float) -> int:
    """SIGTERM every ~0.1 ms for `seconds` (or until the process is gone): signals that
    arrive while a handler runs, each between two bytecodes of whatever ran."""
    sent, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            break
        sent += 1
        time.sleep(0.0001)
    return sent


def test_a_sigterm_storm_while_the_log_is_busy_ends_the_process_within_the_grace_with_status_3(detokd, zctx):
    """The loop logs all the time (rows whose rids are beyond max_rid_len, each a
    rate-limited warning: the filter's lock is taken per row) when a SIGTERM storm
    comes: the second signal ends the process at once, status 3."""
    d = detokd(workers=1, shutdown_grace_s=2.0)
    Sink(zctx, d.workers[0])
    d.wait_ready()
    frame = enc({"type": "tokens", "rows": [{"rid": "x" * 1100, "ids": [1]} for _ in range(500)]})
    done = threading.Event()

    def flood() -> None:  # until the end: the loop is logging when the signals come
        push = zctx.socket(zmq.PUSH)
        push.connect(d.input)
        while not done.is_set():
            try:
                push.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                done.wait(0.001)
        push.close(0)

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        wait_until(lambda: d.log().count("beyond the cap on rid") >= 10, 30, "the log to be busy")
        _storm(d.pid, 1.0)
        assert _exit_code(d, 2.0 + 5) == 3
    finally:
        done.set()
        flooder.join(5)
    assert "second signal 15 while stopping: exiting now" in d.log()


# The loop, logging on detokd.server's logger (a multipart frame), sits inside that
# logger's rate-limit filter's lock, as the loop of the incident was when the signals
# came. Nothing else is changed: the rest is `detokd serve`.
HOLDS_THE_LOG_LOCK = r"""
import os, sys, time
from detokd import cli, logs
plain = logs.RateLimitFilter.filter
def filter(self, record):
    if str(record.msg).startswith("multipart message"):
        with self.lock:
            os.write(2, b"test: the loop holds the filter's lock\n")
            time.sleep(120)
    return plain(self, record)
logs.RateLimitFilter.filter = filter
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("signals", [1, 2], ids=["one-sigterm", "two-sigterms-2ms-apart"])
def test_signals_while_the_loop_holds_the_log_filters_lock_end_the_process_within_the_grace(tmp_path, zctx, signals):
    """The loop holds the log filter's plain lock. A grace timer whose log call waited
    on it, or a signal handler that logged, would wait for ever, and SIGTERM and
    shutdown_grace_s would be ignored. The handler only sets a flag and the grace
    watch's last words have a bounded time and pass by the filter's lock: one SIGTERM ends the process when the
    grace is over, a second at once, both with status 3 and said."""
    cfg = ipc_config(tmp_path, shutdown_grace_s=2.0, log_level="info")
    d = DetokdProcess(cfg, folder=tmp_path, command=[PY, "-c", HOLDS_THE_LOG_LOCK])
    Sink(zctx, cfg.workers[0])
    try:
        d.start()
        eng = Engine(zctx, cfg.input)
        eng.multipart([b"a", b"b"])
        wait_until(lambda: "test: the loop holds the filter's lock" in d.log(), 20, "the loop inside the lock")
        for k in range(signals):
            if k:
                time.sleep(0.002)
            d.proc.send_signal(signal.SIGTERM)
        assert _exit_code(d, 2.0 + 5) == 3
        said = "second signal 15 while stopping: exiting now" if signals == 2 else "not stopped within shutdown_grace_s"
        assert said in d.log()
    finally:
        d.kill()


# The grace watch's last words take a while (a slow log sink), and the loop, not stuck,
# ends its run meanwhile: its last log line waits until the last words have begun, so a
# second signal has been heard however the signals were delivered. Nothing else is
# changed: the rest is `detokd serve`.
SLOW_LAST_WORDS = r"""
import logging, sys, threading, time
from detokd import cli
begun = threading.Event()
class Slow(logging.Filter):
    def filter(self, record):
        if str(record.msg).startswith("second signal"):
            begun.set()
            time.sleep(0.4)  # within the last words' bound: min(0.5, shutdown_grace_s / 4)
        elif str(record.msg).startswith("stopping:"):
            begun.wait(5)
        return True
logging.getLogger("detokd.server").addFilter(Slow())
sys.exit(cli.main(sys.argv[1:]))
"""


def test_signals_after_a_second_one_while_the_last_words_are_written_do_not_kill_the_process(tmp_path, zctx):
    """A second SIGTERM ends the process with status 3 once its last words are written.
    While they were, the loop finished its run and put the old handlers back, and the next
    signal of the storm killed the process by default (status -15, no last words)."""
    cfg = ipc_config(tmp_path, shutdown_grace_s=2.0, log_level="info")
    d = DetokdProcess(cfg, folder=tmp_path, command=[PY, "-c", SLOW_LAST_WORDS])
    Sink(zctx, cfg.workers[0])
    try:
        d.start()
        d.proc.send_signal(signal.SIGTERM)
        time.sleep(0.002)
        d.proc.send_signal(signal.SIGTERM)
        _storm(d.pid, 1.0)
        assert _exit_code(d, 2.0 + 5) == 3
        assert "second signal 15 while stopping: exiting now" in d.log()
    finally:
        d.kill()


# --------------------------------------------------------------------------- 3. a stop before ready, a hang-up ignored

# `detokd serve` whose start-up holds after the input is bound, before the tokenizer
# loads, until the file $DETOKD_TEST_GATE exists (a tokenizer that takes that long).
HELD = r"""
import os, sys, time
from detokd import cli, server
gate = os.environ["DETOKD_TEST_GATE"]
load = server.load
def held(spec):
    os.write(2, b"test: start-up held\n")
    while not os.path.exists(gate):
        time.sleep(0.01)
    return load(spec)
server.load = held
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_stop_while_starting_answers_the_rows_already_queued_and_says_so_last(tmp_path, zctx):
    """SIGTERM while start-up loads the tokenizer (/livez says "starting"), with the
    input already bound and 50 requests queued on it: once up, detokd answers every one
    of them as any stop does, exits 0 and says why last; it never says READY=1."""
    gate = tmp_path / "gate"
    # The drain's share of the grace counts from the signal, so start-up spends it first: a
    # grace that outlasts a start-up on a loaded machine, not the default's 4 s share.
    grace = 60.0
    cfg = ipc_config(tmp_path, metrics_port=0, shutdown_grace_s=grace)
    d = DetokdProcess(cfg, folder=tmp_path, command=[PY, "-c", HELD], env={"DETOKD_TEST_GATE": str(gate)})
    d.spawn()
    try:
        w = Sink(zctx, d.workers[0])
        port = int(wait_until(lambda: re.search(r"health and metrics on port (\d+)", d.log()), 30, "the port").group(1))
        wait_until(lambda: "test: start-up held" in d.log(), 30, "start-up to hold")
        assert http_get(port, "/livez") == (200, b"starting\n")
        rng = random.Random(4)
        reqs = [Req(f"q{i}", make_ids(rng, rng.randrange(1, 24))) for i in range(50)]
        _send_all(d, [{"type": "tokens", "rows": [r.row(len(r.ids))]} for r in reqs])
        d.proc.send_signal(signal.SIGTERM)
        gate.touch()
        assert _exit_code(d, grace) == 0
        w.wait(lambda: all(w.ended(r.rid) for r in reqs), 20, "an answer for every queued request")
        assert {r.rid: w.text(r.rid) for r in reqs} == {r.rid: r.expected() for r in reqs}
        assert "stopped: got SIGTERM; exit 0" in d.log().strip().splitlines()[-1]
        said = []
        d._notify.settimeout(0)
        with contextlib.suppress(BlockingIOError):
            while True:
                said.append(d._notify.recv(4096))
        assert b"STOPPING=1" in said and b"READY=1" not in said, said
    finally:
        d.kill()


@pytest.mark.parametrize("args", [[], ["--restart"]])
def test_a_hangup_ignored_when_detokd_started_stays_ignored(tmp_path, zctx, args):
    """`nohup detokd serve &`: SIGHUP was ignored when detokd started, and stays so (a
    terminal that closes must not stop it): after one, it still answers."""
    cfg = ipc_config(tmp_path)
    ignore = functools.partial(signal.signal, signal.SIGHUP, signal.SIG_IGN)
    with DetokdProcess(cfg, folder=tmp_path, args=args, popen={"preexec_fn": ignore}) as d:
        w = Sink(zctx, d.workers[0])
        for p in [d.pid, *(c.pid for c in psutil.Process(d.pid).children())]:
            os.kill(p, signal.SIGHUP)
        req = Req("after-hangup", make_ids(random.Random(5), 30))
        _send_all(d, [{"type": "tokens", "rows": [req.row(30)]}])
        w.wait(lambda: w.ended(req.rid), 20, "the answer")
        assert w.text(req.rid) == req.expected()
        assert d.proc.poll() is None and "SIGHUP" not in d.log()
        assert d.stop() == 0


def _send_all(d, frames: list[dict]) -> None:
    """Send `frames` to d's input and return once every one has left the sender."""
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, -1)
    push.connect(d.input)
    for msg in frames:
        push.send(enc(msg))
    push.close()
    ctx.term()  # returns once every frame was written to detokd's connection
