"""detokd.logs: logging can neither block the loop nor be forged, between real processes.

A real `detokd serve` gets a stderr pipe nobody reads (shrunk to one page, so a few
lines fill it) and must keep serving; peer-controlled strings holding newlines must
come out as one escaped line; a scraper resetting its connections must cost a
bounded number of stderr bytes.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import random
import re
import socket
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from utils import Engine, Req, Sink, http_get, make_ids, metrics_port, wait_until

F_SETPIPE_SZ = 1031  # Linux fcntl: set a pipe's capacity
PAGE = 4096
LINE_START = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d [A-Z]+ (\[shard \d+\] )?\S+: ")  # ISO 8601, zoned


def _unread(fd: int) -> int:
    """Bytes written into a pipe and not read yet (FIONREAD on its read end)."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(port: int) -> int:
    try:
        return http_get(port, "/health", timeout=2)[0]
    except OSError:  # not listening yet
        return 0


def test_detokd_keeps_serving_rows_while_nobody_reads_its_stderr(tmp_path: Path, zctx) -> None:  # noqa: F811
    """stderr is a one-page pipe the test never reads. A flood of frames that each
    log a warning (four message templates, long peer strings) fills it: the pipe is
    seen full. stderr is written by a thread of its own, never the loop: requests sent
    after it are served exactly and /health stays 200."""
    rng = random.Random(5)
    first, later = Req("first", make_ids(rng, 50)), Req("later", make_ids(rng, 50))
    expected = first.expected(), later.expected()
    r, w = os.pipe()
    fcntl.fcntl(w, F_SETPIPE_SZ, PAGE)
    inp, worker = f"ipc://{tmp_path}/in.sock", f"ipc://{tmp_path}/w0.sock"
    port = _free_port()
    sink = Sink(zctx, worker)
    proc = subprocess.Popen(
        [sys.executable, "-m", "detokd", "serve", "--input", inp, "--worker", worker,
         "--tokenizer", "deepseek", "--log-level", "info", "--metrics-port", str(port)],
        stdout=subprocess.DEVNULL, stderr=w,
    )
    os.close(w)
    try:
        wait_until(lambda: _health(port) == 200 or proc.poll() is not None, 90, "/health 200")
        assert proc.poll() is None
        eng = Engine(zctx, inp)
        eng.rows([first.row(50)])
        sink.wait(lambda: sink.ended("first"), 20, "the first request's text")
        long = "x" * 400
        for k in range(40):
            eng.send({"type": "control", "op": f"{long}{k}"})  # unknown control op
            eng.send({"type": f"{long}{k}"})  # bad frame: unknown type
            eng.rows([{"rid": f"{long}{k}", "ids": [1], "start": {"worker": 9}}])  # no such worker
            eng.send({"type": "register", "worker": 3, "address": f"bogus://{long}{k}"})  # refused
        # The one-page pipe holds no further line: a write to it now blocks.
        wait_until(lambda: _unread(r) > PAGE - 400, 20, "stderr's pipe to fill")
        eng.rows([later.row(25, finish=False)])
        eng.rows([later.row(25)])
        sink.wait(lambda: sink.ended("later"), 20, "a request sent after stderr filled")
        assert (sink.text("first"), sink.text("later")) == expected
        assert [_health(port) for _ in range(3)] == [200, 200, 200]
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(10)
        os.close(r)


WRITER = r"""
import logging, os, sys
from detokd import logs
fd = int(sys.argv[1])
logs.setup("info", stream=os.fdopen(fd, "w"), queue_size=5)
log = logging.getLogger("detokd.test")
for i in range(100):
    log.warning("record %d " % i + "y" * 1000)  # a template each: past the rate limit
print(logs.dropped(), flush=True)
sys.stdin.readline()  # the parent drains the pipe, then lets us exit (which writes the queue)
"""


def test_a_full_queue_drops_records_and_counts_every_one(tmp_path: Path) -> None:
    """A process logs 100 one-kilobyte records into a one-page pipe nobody reads yet,
    through a queue of 5: logging returns at once, and once the pipe is read every
    record is accounted for, written or counted in logs.dropped()."""
    r, w = os.pipe()
    fcntl.fcntl(w, F_SETPIPE_SZ, PAGE)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(w)], pass_fds=(w,), env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    os.close(w)
    try:
        dropped = int(proc.stdout.readline())  # printed only once all 100 calls returned
        assert 100 - 5 - 5 <= dropped < 100  # at most 4 lines fit the page, 1 in hand, 5 queued
        proc.stdin.write("\n")
        proc.stdin.flush()
        with os.fdopen(r, "rb") as pipe:
            written = pipe.read().decode().splitlines()
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(written) + dropped == 100
    numbers = [int(re.search(r"record (\d+) ", line).group(1)) for line in written]
    assert numbers == sorted(numbers)  # what was written is in order, nothing twice


FORGED = "\nCRITICAL fake"


def test_peer_strings_with_newlines_come_out_as_one_escaped_line(detokd, zctx) -> None:  # noqa: F811
    """A control op, a rid, a message type and a register address, each holding
    "\\nCRITICAL fake ..." and an escape character: each is logged on exactly one
    line, which is a real record with the newline written as \\n; no line of the
    log starts with the forged text and no raw escape character is written."""
    d = detokd()
    Sink(zctx, d.workers[0])
    d.wait_ready()
    eng = Engine(zctx, d.input)
    eng.send({"type": "control", "op": f"op{FORGED} control\x1b[2J"})
    eng.rows([{"rid": f"rid{FORGED} rid\x1b[2J", "ids": [1], "start": {"worker": 7}}])
    eng.send({"type": f"t{FORGED} type\x1b[2J"})
    eng.send({"type": "register", "worker": 1, "address": f"ipc://{d.input[6:]}.w1{FORGED} register\x1b[2J"})
    kinds = ("control", "rid", "type", "register")
    wait_until(lambda: all(f"CRITICAL fake {k}" in d.log() for k in kinds), 20, "the four records")
    assert d.stop() == 0
    out = d.log()
    lines = out.splitlines()
    for k in kinds:
        hits = [line for line in lines if f"CRITICAL fake {k}" in line]
        assert len(hits) == 1, (k, hits)
        assert LINE_START.match(hits[0]) and "\\nCRITICAL fake" in hits[0], hits[0]
    assert not any(line.startswith("CRITICAL") for line in lines)
    assert "\x1b" not in out


def test_a_traceback_keeps_its_lines_and_an_exception_message_cannot_forge_one() -> None:
    """The process's own traceback stays readable, one frame a line; an exception
    message holding a newline only yields an indented continuation line."""
    from detokd import logs

    fmt = logs.EscapingFormatter(logs.FORMAT)
    try:
        raise KeyError(f"rid{FORGED}")
    except KeyError:
        record = logging.LogRecord("detokd.server", logging.ERROR, __file__, 1, "internal error on %r", ("a\nb",), sys.exc_info())
    text = fmt.format(record)
    lines = text.split("\n")
    assert lines[0].endswith("internal error on 'a\\nb'")
    assert lines[1] == "  Traceback (most recent call last):"
    assert any(line.strip().startswith('raise KeyError(f"rid{FORGED}")') for line in lines)
    assert all(line.startswith("  ") for line in lines[1:])  # none can pass for a record


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"^Threads:\s+(\d+)", f.read(), re.M).group(1))


def test_300_reset_scrapes_write_a_bounded_number_of_stderr_bytes(detokd) -> None:
    """300 clients send GET /metrics and reset the connection at once (SO_LINGER 0).
    Their request errors go through the rate-limited logger, not a traceback each to
    stderr (~1.5 KB): a few short lines in all."""
    d = detokd(args=["--metrics-port", "0"])
    d.wait_ready()
    port = metrics_port(d)
    assert http_get(port, "/metrics")[0] == 200
    idle = wait_until(lambda: (lambda n: n if n == _threads(d.proc.pid) else 0)(_threads(d.proc.pid)), 10, "a thread count")
    size0 = d.log_path.stat().st_size
    t0 = time.monotonic()
    for _ in range(300):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # RST, whatever the server is doing with it
    # Every request thread has ended: each error it met was logged (or suppressed) by then.
    wait_until(lambda: _threads(d.proc.pid) <= idle, 30, "the request threads to end")
    spells = int((time.monotonic() - t0) // 10) + 2  # 10 s rate-limit windows the resets spanned
    assert http_get(port, "/health")[0] == 200
    assert d.stop() == 0
    log = d.log_path.read_bytes()
    # Up to the loop's last words: after them, exit-time noise of native libraries.
    grown = log[size0 : log.index(b"INFO detokd.server: stopping:")]
    lines = grown.decode(errors="replace").splitlines()
    resets = [line for line in lines if "detokd.http: http client 127.0.0.1:" in line]
    print(f"300 resets: {len(grown)} bytes, {len(lines)} lines on stderr over {spells - 1} rate windows")
    assert b"Traceback" not in grown
    # At most 10 lines per template per window, each short.
    assert len(lines) <= 10 * spells and len(grown) <= 200 * 10 * spells, grown
    assert resets, grown  # the resets did make request errors (else this test tests nothing)


def test_a_suppressed_spell_is_said_even_if_its_template_never_logs_again() -> None:
    # In-process, on a clock of the test's: the limiter itself (the process-level test
    # is test_peers.py::test_every_register_change_and_refusal_is_counted_...).
    from detokd.logs import RateLimitFilter

    now = [100.0]
    limiter = RateLimitFilter(burst=10, period=10.0, clock=lambda: now[0])
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    handler.addFilter(limiter)
    logger = logging.getLogger("detokd.test-suppressed")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        for i in range(16):
            logger.info("worker %d at %r", 1, f"addr-{i}")
        assert len(seen) == 10
        limiter.report()  # its period is not over: nothing yet
        assert len(seen) == 10
        now[0] += 10.0
        limiter.report()
        assert [(r.levelno, r.getMessage()) for r in seen[10:]] == [(logging.INFO, "6 similar messages suppressed in 10 s: 'worker %d at %r'")]
        limiter.report()  # said once
        logger.warning("register of %r refused", "x")
        for _ in range(12):
            logger.warning("register of %r refused", "x")
        limiter.report(force=True)  # at shutdown, whatever the period
        assert seen[-1].getMessage() == "3 similar messages suppressed in 0 s: 'register of %r refused'" and seen[-1].levelno == logging.WARNING
    finally:
        logger.removeHandler(handler)


ZONED = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d$")


def test_json_logs_under_shards_are_one_object_a_line_with_shard_and_request_fields(detokd, zctx) -> None:
    """--log-format json --shards 2: every line the supervisor and the shards write
    parses as one JSON object with a zoned time, level, logger, message and pid; a
    shard's lines name their shard; a line about one request carries its rid, worker
    and error word as fields (the rid holding a forged record stays inside its string);
    each process's last line says why it stopped."""
    from detokd.launch import derive_address

    d = detokd(args=["--shards", "2", "--log-format", "json"])
    d.wait_ready()
    eng = Engine(zctx, derive_address(d.input, 1))
    eng.rows([{"rid": f"rid{FORGED}", "ids": [1], "start": {"worker": 7}}])  # worker 7 has no address: bad_start
    wait_until(lambda: "bad_start" in d.log(), 20, "the bad start logged")
    assert d.stop() == 0
    records = [json.loads(line) for line in d.log().splitlines()]  # a line that is not JSON fails here
    for rec in records:
        assert {"time", "level", "logger", "message", "pid"} <= set(rec), rec
        assert ZONED.match(rec["time"]), rec["time"]
    by_pid: dict[int, list[dict]] = {}
    for rec in records:
        by_pid.setdefault(rec["pid"], []).append(rec)
    supervisor = [p for p, recs in by_pid.items() if all("shard" not in r for r in recs)]
    assert supervisor == [d.pid]
    assert sorted({recs[0]["shard"] for p, recs in by_pid.items() if p != d.pid}) == [0, 1]
    assert all(len({r.get("shard") for r in recs}) == 1 for recs in by_pid.values())  # a process names one shard
    for pid, recs in by_pid.items():
        assert recs[-1]["message"].startswith("stopped: got SIGTERM; exit 0"), (pid, recs[-1])
    [bad] = [r for r in records if "rid" in r]
    assert (bad["rid"], bad["worker"], bad["error"], bad["shard"]) == (f"rid{FORGED}", 7, "bad_start", 1)


def test_text_logs_name_the_shard_and_end_saying_why(detokd) -> None:
    d = detokd(args=["--shards", "2"])
    d.wait_ready()
    assert d.stop() == 0
    lines = d.log().splitlines()
    assert all(LINE_START.match(line) for line in lines), lines
    assert any(" [shard 1] detokd." in line for line in lines)
    assert lines[-1].endswith("stopped: got SIGTERM; exit 0")


def test_a_config_error_is_the_last_json_line(tmp_path: Path) -> None:
    """An error found once the logs are set up (a port in use) is the last line, in
    JSON too; the exit code is 2."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "detokd", "serve", "--log-format", "json", "--metrics-port", str(port),
             "--input", f"ipc://{tmp_path}/in.sock", "--worker", f"ipc://{tmp_path}/w0.sock"],
            capture_output=True, text=True, timeout=60,
        )
    assert r.returncode == 2, r.stderr
    last = json.loads(r.stderr.splitlines()[-1])
    assert last["level"] == "CRITICAL" and last["message"].startswith("detokd: error: cannot serve metrics"), last


def test_every_module_logs_through_logs_get_and_its_logger_is_rate_limited_without_setup() -> None:
    """One factory names and limits every logger: no module writes a logger name by hand
    (one deliberate exception: detokd.auth, the security events' name), and a logger
    from logs.get drops a flood of one template even where another program owns the
    logging (no logs.setup: here, a plain handler of the test's)."""
    from detokd import logs
    from detokd.logs import RateLimitFilter

    package = Path(logs.__file__).parent
    named = sorted(
        f"{p.relative_to(package)}: {line.strip()}"
        for p in package.rglob("*.py")
        for line in p.read_text().splitlines()
        if re.search(r"getLogger\(\s*['\"]detokd|logs\.get\(\s*['\"](?!detokd\.auth['\"])", line)
    )
    assert not named, named
    logger = logs.get("detokd.test-get")
    assert logs.get("detokd.test-get") is logger
    assert sum(isinstance(f, RateLimitFilter) for f in logger.filters) == 1  # attached once
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        for i in range(50):
            logger.warning("unknown control op %r", f"op-{i}")
    finally:
        logger.removeHandler(handler)
    assert len(seen) == 10, [r.getMessage() for r in seen]
