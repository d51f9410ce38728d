"""detokd.launch: per-shard addresses and the shard supervisor.

The supervisor runs in its own process (it installs signal handlers and is
signalled), over tiny Python children that write their pid to a file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import alive
from detokd.launch import derive_address, run_shards

REPO = Path(__file__).resolve().parents[1]

SUPERVISOR = r"""
import logging, sys
from detokd.launch import run_shards
logging.basicConfig(level=logging.INFO)
d, n, child, max_restarts, stop_timeout = sys.argv[1:6]
rc = run_shards(
    lambda i: [d, str(i)], int(n), restart_delay=0.05, max_restarts=int(max_restarts),
    stop_timeout=float(stop_timeout), command=[sys.executable, "-c", child],
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


def test_run_shards_needs_a_shard() -> None:
    with pytest.raises(ValueError):
        run_shards(lambda i: [], 0)


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


def _supervise(tmp_path: Path, n: int, child: str, max_restarts: int = 5, stop_timeout: float = 5.0):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, str(tmp_path), str(n), child, str(max_restarts), str(stop_timeout)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


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


def test_supervisor_gives_up_on_a_crash_loop(tmp_path: Path) -> None:
    sup = _supervise(tmp_path, 2, CRASHER, max_restarts=2)
    try:
        out, _ = sup.communicate(timeout=15)
    finally:
        if sup.poll() is None:
            sup.kill()
    assert sup.returncode == 1, out
    assert "giving up" in out


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
