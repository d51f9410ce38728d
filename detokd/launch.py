"""Scale-out: N detokd processes ("shards") under one small supervisor.

One detokd process is one synchronous loop on one core; `serve --shards N` runs N of
them, each on its own input address (`derive_address`). Schedulers pick a rid's
shard with `detokd.client.shard_for`, so the shards share nothing. This module is
generic: it knows child commands, not the server.
"""

from __future__ import annotations

import dataclasses
import json
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from . import logs
from .http import Endpoint, Reply

__all__ = [
    "derive_address", "Supervisor", "Backoff", "supervise_shards", "die_with_parent", "Shard", "StatusServer",
    "EXIT_STARTUP",
]

log = logs.get(__name__)

_POLL = 0.05  # s between looks at the stopping children: bounds how late a second signal is passed on


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


class StatusPortError(OSError):
    """The supervisor's status port cannot be bound (nothing was started)."""


@dataclasses.dataclass
class Shard:
    """One shard as the supervisor sees it; the status endpoint reads these."""

    index: int
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0  # monotonic time of the last spawn
    failures: int = 0  # consecutive exits or failed spawns, each before `restart_window` s of running
    restarts: int = 0  # since the supervisor started
    last_exit: int | None = None
    delay: float = 0.0  # the backoff before the pending restart
    restart_at: float | None = None  # monotonic time of the pending restart

    def status(self, now: float, max_failures: int) -> dict:
        running = self.proc is not None
        return {
            "shard": self.index,
            "state": "running" if running else "backoff",
            "pid": self.proc.pid if self.proc is not None else None,
            "crash_looping": self.failures > max_failures,
            "consecutive_failures": self.failures,
            "restarts": self.restarts,
            "last_exit": self.last_exit,
            "restart_in": None if self.restart_at is None else round(max(0.0, self.restart_at - now), 3),
        }


EXIT_STARTUP = 2  # a shard's exit for a config it cannot use (detokd.cli.EXIT_CONFIG): fatal
_TICK = 1.0  # s the loop may sleep with no signal and no restart due


@dataclasses.dataclass(frozen=True)
class Backoff:
    """When a shard that exited is started again, and when it counts as crash-looping."""

    restart_delay: float = 1.0  # s before the first restart, doubled per consecutive failure
    max_delay: float = 30.0  # s at most between two restarts
    max_restarts: int = 5  # consecutive failures beyond which a shard is crash-looping
    restart_window: float = 60.0  # s of running after which a shard is healthy again

    def delay(self, failures: int) -> float:
        return min(self.restart_delay * 2 ** (failures - 1), self.max_delay)


class Supervisor:
    """`n` children `[*command, *argv_for_shard(i)]`, kept running until SIGTERM/SIGINT/SIGHUP.

    A child that exits on its own, or cannot be started at all (the spawn fails:
    EMFILE, an executable gone), is logged and restarted after `Backoff.delay` s; a
    child that ran `restart_window` s counts as healthy again. A shard with more than
    `max_restarts` consecutive failures is crash-looping: it is still retried (at
    `max_delay`) and reported, and no other shard is ever touched for it.

    A child that exits with EXIT_STARTUP (2: a config it cannot use) is fatal, as a
    start-up failure is to uvicorn's and gunicorn's supervisors: every restart would
    fail alike. The other shards are stopped and run() returns EXIT_STARTUP.

    With `status_port`, /health (200, or 503 naming the crash-looping shards),
    /status (JSON, one entry per shard) and /metrics (Prometheus: the shards, this
    process, and `collectors`) are served on `status_host`:`status_port`.

    SIGTERM/SIGINT/SIGHUP are forwarded to the children, once each, which get
    `stop_timeout` s before SIGKILL; so is a SIGTERM if the supervisor itself fails.
    run() returns 0 when every child stopped in time on the forwarded signal and no
    shard was crash-looping, else 1. Call it from the main thread (it installs signal
    handlers and the wakeup fd, restored on return).
    """

    def __init__(
        self,
        argv_for_shard: Callable[[int], list[str]],
        n: int,
        *,
        backoff: Backoff | None = None,
        stop_timeout: float = 10.0,
        command: Sequence[str] | None = None,
        status_port: int | None = None,
        status_host: str = "127.0.0.1",
        collectors: Sequence[Collector] = (),
    ) -> None:
        if n < 1:
            raise ValueError(f"need at least one shard, got {n}")
        self.argv_for_shard = argv_for_shard
        self.backoff = backoff or Backoff()
        self.stop_timeout = stop_timeout
        self.command = list(command) if command is not None else [sys.executable, "-m", "detokd"]
        self.status_address = None if status_port is None else (status_host, status_port)
        self.collectors = collectors
        self.shards = [Shard(i) for i in range(n)]
        self.got: list[int] = []  # stop signals received, acted on by the loop, not the handler
        self.fatal: str | None = None  # why a shard's exit ends the supervisor

    # --- the signals: each handler only records, the loop acts ---------------------

    def on_sigterm(self, signum: int, _frame: object) -> None:
        """A stop (systemd, Kubernetes, `kill`): forwarded to every shard."""
        self.got.append(signum)

    def on_sigint(self, signum: int, _frame: object) -> None:
        """A terminal's Ctrl-C: the shards are in their own process groups, so they
        get it once, through here."""
        self.got.append(signum)

    def on_sighup(self, signum: int, _frame: object) -> None:
        """The terminal or session gone: a stop too, as a shard takes it (detokd.server)."""
        self.got.append(signum)

    def on_sigchld(self, _signum: int, _frame: object) -> None:
        """A shard exited. Nothing to do here: the wakeup fd wakes the loop to reap it."""

    def _install(self) -> Callable[[], None]:
        """The handlers and the wakeup fd; returns what puts the old ones back."""
        handlers = {
            signal.SIGTERM: self.on_sigterm, signal.SIGINT: self.on_sigint,
            signal.SIGHUP: self.on_sighup, signal.SIGCHLD: self.on_sigchld,
        }
        old = {sig: signal.signal(sig, h) for sig, h in handlers.items()}
        signal.siginterrupt(signal.SIGCHLD, False)  # a shard's exit interrupts no system call
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)  # the C handler must never wait on it
        old_fd = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
        self.wake = wake_r

        def restore() -> None:
            signal.set_wakeup_fd(old_fd)
            for sig, h in old.items():
                signal.signal(sig, h)
            wake_r.close()
            wake_w.close()

        return restore

    # --- the steps ----------------------------------------------------------------

    def run(self) -> int:
        status = self._status_server()  # first: a port in use starts nothing
        restore = self._install()
        try:
            if status is not None:
                status.start()
            try:
                for s in self.shards:
                    self.spawn(s)
                while not self.got and self.fatal is None:
                    self.reap(time.monotonic())
                    self._sleep()
            except BaseException:
                # Stop the shards as a signal would (one SIGTERM each, stop_timeout), not leave
                # them to PR_SET_PDEATHSIG: the kernel sends that once per exiting thread of
                # ours, and a shard reads a second SIGTERM as "exit now, skip the linger".
                log.exception("supervisor failed: stopping its shards")
                self.stop(signal.SIGTERM)
                raise
            return self._finish()
        finally:
            if status is not None:
                status.close()
            restore()

    def spawn(self, s: Shard) -> None:
        s.started = time.monotonic()
        s.restart_at = None
        try:
            # Own process group: a terminal's Ctrl-C reaches the children once, through us,
            # not twice (which a server may read as "force quit").
            s.proc = subprocess.Popen(
                [*self.command, *self.argv_for_shard(s.index)],
                process_group=0,
                preexec_fn=die_with_parent,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            # EMFILE, EAGAIN, an executable gone: this shard's problem, retried as a crash
            # would be. Raising would end the supervisor and, with it, the healthy shards.
            self.failed(s, s.started, f"could not be started ({exc})")
            return
        log.info("shard %d started (pid %d)", s.index, s.proc.pid)

    def reap(self, now: float) -> None:
        """Each shard's turn: note an exit, start a restart that is due."""
        for s in self.shards:
            p = s.proc
            if p is not None and p.poll() is None:
                if s.failures and now - s.started >= self.backoff.restart_window:
                    log.info("shard %d up for %.0f s: healthy again", s.index, now - s.started)
                    s.failures = 0
            elif p is not None:
                s.proc, s.last_exit = None, p.returncode
                if p.returncode == EXIT_STARTUP:
                    self.fatal = (
                        f"shard {s.index} (pid {p.pid}) exited with {EXIT_STARTUP}: "
                        "its config cannot be used (its error is above)"
                    )
                    return
                self.failed(s, now, f"(pid {p.pid}) exited with {p.returncode}")
            elif s.restart_at is not None and now >= s.restart_at:
                s.restarts += 1
                self.spawn(s)

    def failed(self, s: Shard, now: float, what: str) -> None:
        b = self.backoff
        s.failures = 1 if now - s.started >= b.restart_window else s.failures + 1
        s.delay = b.delay(s.failures)
        s.restart_at = now + s.delay
        log.warning("shard %d %s; restart in %g s", s.index, what, s.delay)
        if s.failures == b.max_restarts + 1:
            log.error(
                "shard %d is crash-looping (%d failures in a row, none up %.0f s); "
                "retrying every %g s at most, the other shards go on",
                s.index, s.failures, b.restart_window, b.max_delay,
            )

    def stop(self, sig: int) -> int:
        """Forward `sig` to every running shard and reap them; 1 if any had to be killed or failed."""
        return _stop([s.proc for s in self.shards if s.proc is not None], sig, self.stop_timeout, self.got)

    def _finish(self) -> int:
        if self.fatal is not None:
            log.error("%s: stopping the other shards; exit %d", self.fatal, EXIT_STARTUP)
            self.stop(signal.SIGTERM)
            return EXIT_STARTUP
        sig = self.got[0]
        log.info("got %s: stopping %d shards", signal.Signals(sig).name, len(self.shards))
        looping = any(s.failures > self.backoff.max_restarts for s in self.shards)
        rc = self.stop(sig) or int(looping)
        log.info("stopped: got %s; exit %d", signal.Signals(sig).name, rc)
        return rc

    def _sleep(self) -> None:
        """Until a signal (a shard's exit, a stop) or the next restart is due."""
        due = [s.restart_at for s in self.shards if s.restart_at is not None]
        timeout = min([_TICK, *(t - time.monotonic() for t in due)])
        if timeout > 0:
            select.select([self.wake], [], [], timeout)
        try:
            while self.wake.recv(64):
                pass
        except BlockingIOError:
            pass

    def _status_server(self) -> StatusServer | None:
        if self.status_address is None:
            return None
        host, port = self.status_address
        try:
            return StatusServer(self.shards, self.backoff.max_restarts, host, port, self.collectors)
        except OSError as exc:
            raise StatusPortError(f"cannot serve supervisor status on {host}:{port}: {exc.strerror}") from exc


def supervise_shards(
    argv_for_shard: Callable[[int], list[str]],
    n: int,
    *,
    restart_delay: float = 1.0,
    max_delay: float = 30.0,
    max_restarts: int = 5,
    restart_window: float = 60.0,
    **kwargs,
) -> int:
    """Supervisor(argv_for_shard, n, ...).run(), the backoff given as its four numbers."""
    backoff = Backoff(restart_delay, max_delay, max_restarts, restart_window)
    return Supervisor(argv_for_shard, n, backoff=backoff, **kwargs).run()


class StatusServer:
    """The supervisor's /health, /status and /metrics, on a thread of their own.

    /health is 503 while a shard is crash-looping: an alert or a readiness signal,
    not a liveness probe (restarting the supervisor restarts its healthy shards too).
    Each shard's own loop health is its /health on metrics_port + i.
    """

    def __init__(
        self, shards: list[Shard], max_failures: int, host: str, port: int, collectors: Sequence[Collector] = ()
    ) -> None:

        def states() -> list[dict]:
            now = time.monotonic()
            return [s.status(now, max_failures) for s in list(shards)]

        def health() -> Reply:
            bad = [st for st in states() if st["crash_looping"]]
            body = "".join(
                f"shard {st['shard']} crash-looping: {st['consecutive_failures']} exits in a row, "
                f"last exit {st['last_exit']}\n"
                for st in bad
            ) or "ok\n"
            return 503 if bad else 200, body.encode(), "text/plain"

        def status() -> Reply:
            body = {"shards": states(), "http_dropped": self.endpoint.dropped}
            return 200, json.dumps(body).encode() + b"\n", "application/json"

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_ShardCollector(states))
        ProcessCollector(registry=registry)
        for c in collectors:
            registry.register(c)

        def metrics() -> Reply:
            return 200, generate_latest(registry), "text/plain; version=0.0.4"

        routes = {"/health": health, "/status": status, "/metrics": metrics}
        self.endpoint = Endpoint(host, port, routes, "detokd-supervisor")
        self.port = self.endpoint.port

    def start(self) -> None:
        self.endpoint.start()
        log.info("supervisor health and status on port %d", self.port)

    def close(self) -> None:
        self.endpoint.close()


class _ShardCollector:
    """The supervisor's view of its shards; the help strings are docs/deploy.md's."""

    def __init__(self, states: Callable[[], list[dict]]) -> None:
        self.states = states

    def collect(self) -> Iterator[Metric]:
        states = self.states()
        up = GaugeMetricFamily(
            "detokd_supervisor_shards_up", "shards whose process is running",
            value=sum(st["state"] == "running" for st in states),
        )
        restarts = CounterMetricFamily(
            "detokd_supervisor_restarts",
            "times the supervisor started a shard again after it exited or failed to start",
            labels=["shard"],
        )
        looping = GaugeMetricFamily(
            "detokd_supervisor_crash_looping", "1 while the shard has failed more than max_restarts times in a row",
            labels=["shard"],
        )
        for st in states:
            restarts.add_metric([str(st["shard"])], st["restarts"])
            looping.add_metric([str(st["shard"])], 1 if st["crash_looping"] else 0)
        yield from (up, restarts, looping)


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
