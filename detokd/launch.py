"""Scale-out: N detokd processes ("shards") under one small supervisor.

One detokd process is one synchronous loop on one core; `serve --shards N` runs N of
them, each on its own input address (`derive_address`). Schedulers pick a rid's
shard with `detokd.client.shard_for`, so the shards share nothing. This module is
generic: it knows child commands, not the server.
"""

from __future__ import annotations

import collections
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

__all__ = ["derive_address", "run_shards", "die_with_parent"]

log = logging.getLogger("detokd.launch")

_POLL = 0.05  # s between looks at the children: bounds how late a signal or exit is seen


def derive_address(address: str, shard: int) -> str:
    """The address of shard `shard` derived from a base address.

    ipc://path -> ipc://path.<shard>; tcp://host:port -> tcp://host:<port+shard>.
    Other transports (inproc cannot cross processes) raise ValueError.
    """
    if shard < 0:
        raise ValueError(f"shard must be >= 0, got {shard}")
    if address.startswith("ipc://"):
        if len(address) == len("ipc://"):
            raise ValueError(f"ipc address without a path: {address!r}")
        return f"{address}.{shard}"
    if address.startswith("tcp://"):
        host, sep, port = address[len("tcp://"):].rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"tcp address needs an explicit host:port: {address!r}")
        p = int(port) + shard
        if int(port) == 0 or p > 65535:
            raise ValueError(f"cannot derive shard {shard} port from {address!r}")
        return f"tcp://{host}:{p}"
    raise ValueError(
        f"cannot derive per-shard addresses from {address!r}: use ipc:// or tcp://host:port"
    )


def die_with_parent() -> None:
    """Use as Popen(preexec_fn=...): on Linux the child gets SIGTERM when its parent
    dies, even by SIGKILL, so no shard is left orphaned. Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_shards(
    argv_for_shard: Callable[[int], list[str]],
    n: int,
    *,
    restart_delay: float = 1.0,
    max_restarts: int = 5,
    restart_window: float = 60.0,
    stop_timeout: float = 10.0,
    command: Sequence[str] | None = None,
) -> int:
    """Run `n` children `[*command, *argv_for_shard(i)]` until SIGTERM/SIGINT.

    A child that exits on its own is logged and restarted after `restart_delay`
    s; a shard restarted more than `max_restarts` times within `restart_window` s
    is crash-looping, so everything is stopped and 1 returned. SIGTERM/SIGINT are
    forwarded to the children, which get `stop_timeout` s before SIGKILL. Returns
    0 when every child stopped in time on the forwarded signal.
    Call from the main thread (it installs signal handlers, restored on return).
    """
    if n < 1:
        raise ValueError(f"need at least one shard, got {n}")
    cmd = list(command) if command is not None else [sys.executable, "-m", "detokd"]

    def spawn(i: int) -> subprocess.Popen[bytes]:
        # Own process group: a terminal's Ctrl-C reaches the children once, through us,
        # not twice (which a server may read as "force quit").
        p = subprocess.Popen(
            [*cmd, *argv_for_shard(i)],
            process_group=0,
            preexec_fn=die_with_parent,
        )
        log.info("shard %d started (pid %d)", i, p.pid)
        return p

    got: list[int] = []  # signals received, handled by the loop rather than the handler

    def on_signal(signum: int, _frame: object) -> None:
        got.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    procs: list[subprocess.Popen[bytes] | None] = [None] * n
    restart_at: dict[int, float] = {}
    restarts: list[collections.deque[float]] = [collections.deque() for _ in range(n)]
    status = 0
    try:
        for i in range(n):
            procs[i] = spawn(i)
        while not got:
            now = time.monotonic()
            for i, p in enumerate(procs):
                if p is not None and p.poll() is not None:
                    log.warning("shard %d (pid %d) exited with %s", i, p.pid, p.returncode)
                    procs[i] = None
                    recent = restarts[i]
                    while recent and now - recent[0] > restart_window:
                        recent.popleft()
                    if len(recent) >= max_restarts:
                        log.error(
                            "shard %d restarted %d times within %.0f s: giving up",
                            i, len(recent), restart_window,
                        )
                        status = 1
                        break
                    recent.append(now)
                    restart_at[i] = now + restart_delay
            if status:
                break
            for i, t in list(restart_at.items()):
                if now >= t:
                    del restart_at[i]
                    procs[i] = spawn(i)
            time.sleep(_POLL)
        sig = got[0] if got else signal.SIGTERM
        if got:
            log.info("got %s: stopping %d shards", signal.Signals(sig).name, n)
        return _stop([p for p in procs if p is not None], sig, stop_timeout, got) or status
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _stop(
    procs: list[subprocess.Popen[bytes]], sig: int, timeout: float, got: list[int]
) -> int:
    """Signal the children and reap them; 1 if any had to be killed or failed."""
    for p in procs:
        _send(p, sig)
    forwarded = len(got)
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        while forwarded < len(got):  # a second Ctrl-C: pass it on too
            for p in procs:
                _send(p, got[forwarded])
            forwarded += 1
        time.sleep(_POLL)
    status = 0
    for p in procs:
        if p.poll() is None:
            log.error("shard pid %d did not stop within %.1f s: killing it", p.pid, timeout)
            p.kill()
            p.wait()
            status = 1
        elif p.returncode not in (0, -sig):
            log.warning("shard pid %d exited with %s on shutdown", p.pid, p.returncode)
            status = 1
    return status


def _send(p: subprocess.Popen[bytes], sig: int) -> None:
    try:
        p.send_signal(sig)  # reaped children are skipped: no signal to a reused pid
    except ProcessLookupError:
        pass
