"""detokd.launch: per-shard addresses and the shard supervisor.

The supervisor runs in its own process (it installs signal handlers and is
signalled), over tiny Python children that write their pid to a file, and once
over real `detokd serve` shards.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import alive

from detokd.launch import derive_address, supervise_shards

REPO = Path(__file__).resolve().parents[1]

SUPERVISOR = r"""
import logging, sys
from detokd.launch import supervise_shards
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
d, n, child, max_restarts, stop_timeout = sys.argv[1:6]
rc = supervise_shards(
    lambda i: [d, str(i)], int(n), restart_delay=0.05, max_delay=0.4, max_restarts=int(max_restarts),
    stop_timeout=float(stop_timeout), command=[sys.executable, "-c", child], status_port=0,
)
print("supervisor rc", rc, flush=True)
sys.exit(rc)
"""

# Writes its pid atomically once its SIGTERM handler is in place, then sleeps.
SLEEPER = r"""
import os, signal, sys, time
d, i = sys.argv[1], sys.argv[2]
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
signal.signal(signal.SIGINT, lambda *a: sys.exit(0))
tmp = os.path.join(d, "pid.%s.%d" % (i, os.getpid()))
open(tmp, "w").write(str(os.getpid()))
os.replace(tmp, os.path.join(d, "pid." + i))
while True:
    time.sleep(1)
"""

STUBBORN = SLEEPER.replace("sys.exit(0))", "None)")  # ignores SIGTERM and SIGINT

CRASHER = "import sys; sys.exit(3)"

# Shard 1 exits with 3 at once, every time; the others are SLEEPERs.
ONE_CRASHES = "import sys\nif sys.argv[2] == '1': sys.exit(3)\n" + SLEEPER


@pytest.mark.parametrize(
    "base, shard, want",
    [
        ("ipc:///tmp/detokd.in", 0, "ipc:///tmp/detokd.in.0"),
        ("ipc:///tmp/detokd.in", 3, "ipc:///tmp/detokd.in.3"),
        ("ipc://rel/sock", 1, "ipc://rel/sock.1"),
        ("tcp://127.0.0.1:5555", 0, "tcp://127.0.0.1:5555"),
        ("tcp://127.0.0.1:5555", 2, "tcp://127.0.0.1:5557"),
        ("tcp://*:6000", 7, "tcp://*:6007"),
        ("tcp://0.0.0.0:6000", 1, "tcp://0.0.0.0:6001"),
        ("tcp://[::1]:6000", 1, "tcp://[::1]:6001"),
        ("tcp://detokd-host.example:7000", 4, "tcp://detokd-host.example:7004"),
    ],
)
def test_derive_address(base: str, shard: int, want: str) -> None:
    assert derive_address(base, shard) == want


@pytest.mark.parametrize(
    "base",
    [
        "inproc://detokd",
        "ipc://",
        "tcp://127.0.0.1",  # no port
        "tcp://127.0.0.1:*",  # wildcard port: shards cannot be derived
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:65535",  # shard 1 would overflow
        "udp://127.0.0.1:5555",
        "/tmp/plain/path",
    ],
)
def test_derive_address_rejects(base: str) -> None:
    with pytest.raises(ValueError):
        derive_address(base, 1)


def test_derive_address_negative_shard() -> None:
    with pytest.raises(ValueError):
        derive_address("ipc:///tmp/x", -1)


def test_supervise_shards_needs_a_shard() -> None:
    with pytest.raises(ValueError):
        supervise_shards(lambda i: [], 0)


def _wait(pred, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _pid(d: Path, i: int) -> int | None:
    try:
        return int((d / f"pid.{i}").read_text())
    except (FileNotFoundError, ValueError):
        return None


ENV = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


class Supervised(subprocess.Popen):
    """A supervisor process whose output goes to a file, readable while it runs."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log_path = log
        self.log_file = open(log, "wb")
        super().__init__(args, env=ENV, stdout=self.log_file, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def communicate(self, timeout: float | None = None):  # (output, None), as with a pipe
        self.wait(timeout)
        self.log_file.close()
        return self.output(), None

    def status_port(self) -> int:
        m = _wait(lambda: re.search(r"supervisor health and status on port (\d+)", self.output()), 30, "the status port")
        return int(m.group(1))


def _supervise(tmp_path: Path, n: int, child: str, max_restarts: int = 5, stop_timeout: float = 5.0) -> Supervised:
    return Supervised(
        [sys.executable, "-c", SUPERVISOR, str(tmp_path), str(n), child, str(max_restarts), str(stop_timeout)],
        tmp_path / "supervisor.log",
    )


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _status(port: int) -> list[dict]:
    code, body = _get(port, "/status")
    assert code == 200, body
    return json.loads(body)["shards"]


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_supervisor_restarts_a_dead_shard_and_stops_cleanly(tmp_path: Path, stop_signal: int) -> None:
    sup = _supervise(tmp_path, 3, SLEEPER)
    try:
        pids = [_wait(lambda i=i: _pid(tmp_path, i), what=f"shard {i} pid") for i in range(3)]
        os.kill(pids[1], signal.SIGKILL)
        new = _wait(
            lambda: (p := _pid(tmp_path, 1)) not in (None, pids[1]) and p, what="restarted shard 1"
        )
        assert alive(new)
        assert _pid(tmp_path, 0) == pids[0] and _pid(tmp_path, 2) == pids[2]  # others untouched
        sup.send_signal(stop_signal)
        out, _ = sup.communicate(timeout=15)
    finally:
        if sup.poll() is None:
            sup.kill()
    assert sup.returncode == 0, out
    assert "shard 1" in out and "exited" in out  # the unexpected exit was logged
    for pid in (pids[0], new, pids[2]):
        assert not alive(pid)


def test_a_crash_looping_shard_backs_off_and_is_reported_while_the_healthy_ones_keep_running(tmp_path: Path) -> None:
    """Shard 1 exits at once, every time (max_restarts 2, delays 0.05 s doubling up to
    0.4 s). Shard 0
    keeps its one process throughout, shard 1's restart delays double and cap, and
    the supervisor's /health says 503 naming shard 1 (its /status says why)."""
    sup = _supervise(tmp_path, 2, ONE_CRASHES, max_restarts=2)
    try:
        port = sup.status_port()
        pid0 = _wait(lambda: _pid(tmp_path, 0), what="shard 0 pid")
        # Seven exits: past the crash-loop mark (3) and two at the capped delay.
        _wait(lambda: sup.output().count("shard 1 (pid") >= 7, 30, "seven exits of shard 1")
        code, body = _get(port, "/health")
        assert code == 503 and b"shard 1 crash-looping" in body and b"shard 0" not in body, body
        s0, s1 = _status(port)
        assert s0["state"] == "running" and s0["pid"] == pid0 and s0["restarts"] == 0 and not s0["crash_looping"]
        assert s1["crash_looping"] and s1["consecutive_failures"] >= 7 and s1["last_exit"] == 3
        assert alive(pid0) and _pid(tmp_path, 0) == pid0
        sup.send_signal(signal.SIGTERM)
        out, _ = sup.communicate(timeout=15)
    finally:
        if sup.poll() is None:
            sup.kill()
    delays = [float(d) for d in re.findall(r"shard 1 \(pid \d+\) exited with 3; restart in ([\d.]+) s", out)]
    assert delays[:7] == [0.05, 0.1, 0.2, 0.4, 0.4, 0.4, 0.4], out
    assert out.count("shard 1 is crash-looping") == 1, out  # said once, not at every exit
    assert "shard 0 (pid" not in out  # shard 0 never exited until the stop
    assert sup.returncode == 1, out  # a shard was crash-looping when stopped
    assert not alive(pid0)


def test_the_supervisor_health_is_200_while_every_shard_runs(tmp_path: Path) -> None:
    sup = _supervise(tmp_path, 2, SLEEPER)
    try:
        port = sup.status_port()
        pids = [_wait(lambda i=i: _pid(tmp_path, i), what=f"shard {i} pid") for i in range(2)]
        assert _get(port, "/health") == (200, b"ok\n")
        assert [(s["state"], s["pid"], s["crash_looping"]) for s in _status(port)] == [("running", p, False) for p in pids]
        assert _get(port, "/nothing")[0] == 404
        sup.send_signal(signal.SIGTERM)
        out, _ = sup.communicate(timeout=15)
    finally:
        if sup.poll() is None:
            sup.kill()
    assert sup.returncode == 0, out


def test_supervisor_kills_a_shard_that_ignores_sigterm(tmp_path: Path) -> None:
    sup = _supervise(tmp_path, 1, STUBBORN, stop_timeout=0.5)
    try:
        pid = _wait(lambda: _pid(tmp_path, 0), what="shard pid")
        sup.send_signal(signal.SIGTERM)
        out, _ = sup.communicate(timeout=15)
    finally:
        if sup.poll() is None:
            sup.kill()
    assert sup.returncode == 1, out
    assert "killing" in out
    assert not alive(pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_shards_die_with_a_killed_supervisor(tmp_path: Path) -> None:
    sup = _supervise(tmp_path, 2, SLEEPER)
    try:
        pids = [_wait(lambda i=i: _pid(tmp_path, i), what=f"shard {i} pid") for i in range(2)]
        sup.kill()  # SIGKILL: no chance to forward anything
        sup.communicate(timeout=15)
        _wait(lambda: not any(alive(p) for p in pids), what="orphaned shards to exit")
    finally:
        if sup.poll() is None:
            sup.kill()


def _held_port_pair() -> tuple[socket.socket, int]:
    """A listening socket on port P+1 and P, free: shard 0's input port and shard 1's, taken."""
    for _ in range(20):
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        base = holder.getsockname()[1] - 1
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", base))
            except OSError:
                holder.close()
                continue
        holder.listen()
        return holder, base
    raise AssertionError("no free pair of ports")


def test_real_shards_a_shard_that_cannot_bind_stops_the_supervisor_with_exit_2_naming_it(tmp_path: Path) -> None:
    """`detokd serve --shards 2` on tcp ports P and P+1, P+1 held by the test: shard 1
    exits 2 (cannot bind input: a config error only that shard sees). Every restart
    would fail alike, so, as uvicorn does with a start-up failure, the supervisor stops
    shard 0 and exits 2 with one line naming shard 1. Before, shard 1 was restarted for
    ever and the supervisor never exited."""
    holder, base = _held_port_pair()
    sup = Supervised(
        [sys.executable, "-m", "detokd", "serve", "--shards", "2", "--input", f"tcp://127.0.0.1:{base}",
         "--worker", f"ipc://{tmp_path}/w0.sock"],
        tmp_path / "sup.log",
    )
    try:
        out, _ = sup.communicate(timeout=60)
    finally:
        if sup.poll() is None:
            sup.kill()
        holder.close()
    assert sup.returncode == 2, out
    pid0 = int(re.search(r"shard 0 started \(pid (\d+)\)", out).group(1))
    fatal = [line for line in out.splitlines() if "exited with 2" in line]
    assert len(fatal) == 1 and "shard 1 (pid" in fatal[0] and "config cannot be used" in fatal[0], out
    assert f"cannot bind input tcp://127.0.0.1:{base + 1}" in out  # the shard's own line says why
    assert out.count("shard 1 started") == 1 and "restart in" not in out, out  # never restarted
    assert not alive(pid0)




@pytest.mark.parametrize(
    "args, needle",
    [
        (["--supervisor-port", "9"], "needs --shards"),
        (["--shards", "2", "--metrics-port", "9000", "--supervisor-port", "9001"], "a shard's metrics port"),
    ],
)
def test_a_supervisor_port_that_cannot_work_is_one_line_and_exit_2(tmp_path: Path, args: list[str], needle: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "detokd", "serve", "--input", f"ipc://{tmp_path}/in", *args],
        capture_output=True, text=True, env=ENV, timeout=60,
    )
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# A shard that is its own executable file (so one shard's spawn can fail for real: the
# test takes the file's execute bit away), records every SIGTERM it gets, and on the
# first lingers 0.5 s (a second SIGTERM in that time is recorded too) before exiting 0,
# which it records too.
LINGERER = r"""
import os, signal, sys, time
d, i = sys.argv[1], sys.argv[2]
terms = os.path.join(d, "terms.%d" % os.getpid())
stopping = []
def on_term(*a):
    with open(terms, "a") as f:
        f.write("TERM\n")
    stopping.append(time.monotonic())
signal.signal(signal.SIGTERM, on_term)
tmp = os.path.join(d, "pid.%s.%d" % (i, os.getpid()))
open(tmp, "w").write(str(os.getpid()))
os.replace(tmp, os.path.join(d, "pid." + i))
while not stopping or time.monotonic() < stopping[0] + 0.5:
    time.sleep(0.01)
open(os.path.join(d, "lingered.%d" % os.getpid()), "w").close()  # the whole linger, then a clean exit
sys.exit(0)
"""

EXEC_SUPERVISOR = r"""
import os, sys
from detokd import logs
from detokd.launch import supervise_shards
logs.setup("info")  # as `detokd serve --shards` does: its writer is one more thread
d = sys.argv[1]
rc = supervise_shards(
    lambda i: [os.path.join(d, "shard-%d" % i), d, str(i)], 2, restart_delay=0.05, max_delay=0.4,
    max_restarts=50, stop_timeout=5.0, command=[], status_port=0,
)
print("supervisor rc", rc, flush=True)
sys.exit(rc)
"""


def _lingerers(d: Path) -> None:
    """Two LINGERER shards as executable files of their own: shard-0, shard-1."""
    for i in range(2):
        exe = d / f"shard-{i}"
        exe.write_text(f"#!{sys.executable}\n{LINGERER}")
        exe.chmod(0o755)


def test_a_shard_that_cannot_be_spawned_backs_off_while_the_supervisor_and_its_siblings_live_on(tmp_path: Path) -> None:
    """Shard 1's executable loses its execute bit and shard 1 is killed: every restart
    fails in Popen (EACCES). Each failed spawn is one more backoff, never the
    supervisor's exit (which would leave the shards to PR_SET_PDEATHSIG, a SIGTERM per
    exiting supervisor thread); shard 0 keeps its process; shard 1 runs
    again once it can; on SIGTERM each shard gets one SIGTERM and ends its own way."""
    _lingerers(tmp_path)
    sup = Supervised([sys.executable, "-c", EXEC_SUPERVISOR, str(tmp_path)], tmp_path / "supervisor.log")
    try:
        port = sup.status_port()
        pid0, pid1 = (_wait(lambda i=i: _pid(tmp_path, i), what=f"shard {i} pid") for i in range(2))
        (tmp_path / "shard-1").chmod(0o644)
        os.kill(pid1, signal.SIGKILL)
        _wait(lambda: sup.output().count("shard 1 could not be started") >= 3, 30, "three failed spawns of shard 1")
        assert sup.poll() is None, sup.output()
        s0, s1 = _status(port)
        assert (s0["state"], s0["pid"]) == ("running", pid0) and alive(pid0)
        assert s1["state"] == "backoff" and s1["consecutive_failures"] >= 4  # the kill, then each failed spawn
        (tmp_path / "shard-1").chmod(0o755)
        new1 = _wait(lambda: (p := _pid(tmp_path, 1)) not in (None, pid1) and p, 30, "shard 1 running again")
        sup.send_signal(signal.SIGTERM)
        out, _ = sup.communicate(timeout=30)
    finally:
        if sup.poll() is None:
            sup.kill()
    delays = [float(x) for x in re.findall(r"shard 1 could not be started \(.*Permission denied.*\); restart in ([\d.]+) s", out)]
    assert delays[:3] == [0.1, 0.2, 0.4], out  # after the kill's 0.05: each failed spawn doubles the backoff
    assert "shard 0 (pid" not in out and "Traceback" not in out, out
    assert sup.returncode == 0, out
    for pid in (pid0, new1):
        assert (tmp_path / f"terms.{pid}").read_text() == "TERM\n", f"shard pid {pid} got more or less than one SIGTERM"
        assert not alive(pid)


# The supervisor of LINGERERs, whose argv for shard 1's restart raises: a failure of the
# supervisor itself, not of a spawn.
BROKEN_SUPERVISOR = EXEC_SUPERVISOR.replace(
    "lambda i: [os.path.join(d, \"shard-%d\" % i), d, str(i)]", "argv"
).replace("d = sys.argv[1]\n", """d = sys.argv[1]
calls = []
def argv(i):
    calls.append(i)
    if calls.count(1) > 1:
        raise RuntimeError("no argv for shard 1's restart")
    return [os.path.join(d, "shard-%d" % i), d, str(i)]
""")


def test_a_supervisor_that_fails_stops_each_shard_with_one_sigterm_and_its_linger(tmp_path: Path) -> None:
    """The supervisor's own loop raises (here: building shard 1's restart): it stops its
    shards as a signal would, one SIGTERM each and their whole linger, before it exits
    1. PR_SET_PDEATHSIG would send one per exiting thread: a second SIGTERM ~2 ms
    later, which a shard reads as "exit now, skip the linger"."""
    assert BROKEN_SUPERVISOR != EXEC_SUPERVISOR and "def argv" in BROKEN_SUPERVISOR
    _lingerers(tmp_path)
    sup = Supervised([sys.executable, "-c", BROKEN_SUPERVISOR, str(tmp_path)], tmp_path / "supervisor.log")
    try:
        sup.status_port()
        pid0, pid1 = (_wait(lambda i=i: _pid(tmp_path, i), what=f"shard {i} pid") for i in range(2))
        os.kill(pid1, signal.SIGKILL)
        out, _ = sup.communicate(timeout=30)
    finally:
        if sup.poll() is None:
            sup.kill()
    assert sup.returncode == 1 and "supervisor failed: stopping its shards" in out and "no argv for shard 1" in out, out
    assert (tmp_path / f"terms.{pid0}").read_text() == "TERM\n"
    assert (tmp_path / f"lingered.{pid0}").exists() and not alive(pid0)


# Shard 1 exits 2 (a config it cannot use) once shard 0 runs; shard 0 is a LINGERER.
ONE_BAD_CONFIG = r"""
import os, sys, time
if sys.argv[2] == "1":
    while not os.path.exists(os.path.join(sys.argv[1], "pid.0")):
        time.sleep(0.01)
    sys.exit(2)
""" + LINGERER


def test_a_shard_that_exits_2_stops_its_siblings_and_the_supervisor_exits_2(tmp_path: Path) -> None:
    """Exit 2 is a shard's word for a config it cannot use: fatal, not a crash to retry.
    Shard 1 is never restarted; shard 0 gets one SIGTERM and its whole linger; the
    supervisor says why in one line and exits 2, its status port closed."""
    sup = _supervise(tmp_path, 2, ONE_BAD_CONFIG)
    try:
        port = sup.status_port()
        out, _ = sup.communicate(timeout=30)
    finally:
        if sup.poll() is None:
            sup.kill()
    assert sup.returncode == 2 and "supervisor rc 2" in out, out
    pid0 = _pid(tmp_path, 0)
    fatal = [line for line in out.splitlines() if "exited with 2" in line]
    assert len(fatal) == 1 and re.search(r"shard 1 \(pid \d+\) exited with 2: its config cannot be used", fatal[0]), out
    assert out.count("shard 1 started") == 1 and "restart in" not in out, out
    assert (tmp_path / f"terms.{pid0}").read_text() == "TERM\n" and (tmp_path / f"lingered.{pid0}").exists()
    assert not alive(pid0)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
