"""One small supervisor for detokd's processes: shards, and a decoding process that may die.

One detokd process is one synchronous loop on one core; `serve --shards N` runs N of
them, each on its own input address (`derive_address`), as commands (`Commands`).
Schedulers pick a rid's shard with `detokd.client.shard_for`, so the shards share
nothing. `serve --restart` and SGLang mode run one decoding process as a fork of a
process that has decided everything before it (`Forks`): a child that dies is forked
again in milliseconds, with the tokenizer and its tables already in memory. This
module is generic: it knows children, not the server.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from . import logs, readiness
from .http import Endpoint, Reply

__all__ = [
    "derive_address", "Supervisor", "Backoff", "supervise_shards", "die_with_parent", "Shard", "StatusServer",
    "Commands", "Forks", "Forked", "EXIT_STARTUP", "GAVE_UP", "RESTARTS", "stop_signals",
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


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Use as Popen(preexec_fn=...): on Linux the child gets `sig` when its parent dies,
    even by SIGKILL, so no child is left orphaned. Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Child(Protocol):
    """A started child as the supervisor handles it: subprocess.Popen's interface."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class Children(Protocol):
    """How a supervisor starts child `index`: with `env` over its own environment (the
    READY relay's NOTIFY_SOCKET), a fork also running `in_child` first (what the
    supervisor holds that the child must not: its signal handlers, its sockets)."""

    @property
    def what(self) -> str:
        """"shard", "decoding process": the word log lines use for a child."""

    def start(self, index: int, restarts: int, env: Mapping[str, str], in_child: Callable[[], None]) -> Child: ...


@dataclasses.dataclass(frozen=True)
class Commands:
    """Children that are commands: `[*command, *argv_for(index)]`, each in a process
    group of its own (a terminal's Ctrl-C reaches them once, through the supervisor, not
    twice, which a server may read as "force quit"), each SIGTERMed when the supervisor
    dies."""

    argv_for: Callable[[int], list[str]]
    command: Sequence[str] = (sys.executable, "-m", "detokd")
    what: str = "shard"

    def start(self, index: int, restarts: int, env: Mapping[str, str], in_child: Callable[[], None]) -> Child:
        return subprocess.Popen(
            [*self.command, *self.argv_for(index)], process_group=0, preexec_fn=die_with_parent,
            env={**os.environ, **env} if env else None,
        )


@dataclasses.dataclass(frozen=True)
class Forks:
    """Children that are forks of this process running `serve(index, restarts)`, whose
    return value is the child's exit status. What the parent built before the fork
    (a tokenizer, its tables) the child shares page by page until it writes them: the
    collector is frozen first, and stays so in the child, so no collection of the
    child's writes to those pages. `death_signal` is what a child gets when the
    supervisor dies."""

    serve: Callable[[int, int], int]
    what: str = "decoding process"
    death_signal: int = signal.SIGTERM

    def start(self, index: int, restarts: int, env: Mapping[str, str], in_child: Callable[[], None]) -> Child:
        gc.collect()
        gc.freeze()
        return Forked(lambda: self._child(index, restarts, env, in_child))

    def _child(self, index: int, restarts: int, env: Mapping[str, str], in_child: Callable[[], None]) -> int:
        parent = os.getppid()
        die_with_parent(self.death_signal)
        if os.getppid() != parent:  # it died before the line above: nobody to serve for
            return 1
        os.setpgid(0, 0)  # as a command shard: a terminal's Ctrl-C reaches it through the supervisor
        _first_for_the_oom_killer()
        in_child()
        os.environ.update(env)
        # The collector stays frozen: a collection over what the parent built would write
        # to every page of it, copying the parent's heap page by page into the child.
        return self.serve(index, restarts)


# What a forked child adds to its oom_score_adj. The OOM killer weighs resident pages,
# which a fork shares with its parent: without it, the supervisor (or an engine's process
# beside it) could be the one picked, where the child is the one that is started again.
OOM_PREFERENCE = 500


def _first_for_the_oom_killer() -> None:
    try:
        with open("/proc/self/oom_score_adj", "r+") as f:
            adj = min(1000, int(f.read()) + OOM_PREFERENCE)  # raising it needs no privilege
            f.seek(0)
            f.write(str(adj))
    except (OSError, ValueError):
        pass  # not Linux, or /proc read-only: the kernel's own choice stands


class Forked:
    """`target()` in a fork of this process, with subprocess.Popen's interface. The
    child never returns into the caller's code: it ends with os._exit, with target's
    status (1 and the traceback on stderr if it raised)."""

    def __init__(self, target: Callable[[], int]) -> None:
        self.returncode: int | None = None
        pid = os.fork()
        if pid == 0:  # the child
            status = 1
            try:
                status = target()
            except BaseException:  # noqa: BLE001 - whatever it was, the child ends here
                traceback.print_exc()
            finally:
                logs.close()  # what is queued is written: os._exit skips atexit
                sys.stderr.flush()
                os._exit(status)
        self.pid = pid

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            time.sleep(_POLL)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # a reaped child's pid may be another process's by now
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class StatusPortError(OSError):
    """The supervisor's status port cannot be bound (nothing was started)."""


@dataclasses.dataclass
class Shard:
    """One child as the supervisor sees it; the status endpoint reads these."""

    index: int
    proc: Child | None = None
    started: float = 0.0  # monotonic time of the last spawn
    failures: int = 0  # consecutive exits or failed spawns, each before `restart_window` s of running
    restarts: int = 0  # since the supervisor started
    last_exit: int | None = None
    delay: float = 0.0  # the backoff before the pending restart
    restart_at: float | None = None  # monotonic time of the pending restart
    ready: bool = False  # its process said READY=1 (through the relay)

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


EXIT_STARTUP = 2  # a child's exit for a config it cannot use (detokd.cli.EXIT_CONFIG): fatal
GAVE_UP = 4  # run()'s return when a crash-looping child ends the restarts (Backoff.give_up)
_TICK = 1.0  # s the loop may sleep with no signal and no restart due


@dataclasses.dataclass(frozen=True)
class Backoff:
    """When a child that exited is started again, and when it counts as crash-looping.

    A crash-looping child is retried (at `max_delay`) and reported, unless `give_up`:
    then the supervisor stops and run() returns GAVE_UP, for a caller that has
    something else to run instead (SGLang's own detokenizer)."""

    restart_delay: float = 1.0  # s before the first restart, doubled per consecutive failure
    max_delay: float = 30.0  # s at most between two restarts
    max_restarts: int = 5  # consecutive failures beyond which a child is crash-looping
    restart_window: float = 60.0  # s of running after which a child is healthy again
    give_up: bool = False

    def delay(self, failures: int) -> float:
        return min(self.restart_delay * 2 ** (failures - 1), self.max_delay)


# A decoding process that dies is forked again at once (its requests' next rows find the
# new one within a second), then after 0.2, 0.4, ... s while it keeps dying young.
RESTARTS = Backoff(restart_delay=0.1, max_delay=30.0, max_restarts=5, restart_window=60.0)


def stop_signals() -> tuple[int, ...]:
    """The signals that stop detokd: SIGTERM, SIGINT, and SIGHUP unless it was ignored
    when the process started (`nohup detokd serve &`: a hang-up must not stop it then)."""
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
        return signal.SIGTERM, signal.SIGINT
    return signal.SIGTERM, signal.SIGINT, signal.SIGHUP


class Supervisor:
    """`n` children of `children`, kept running until SIGTERM/SIGINT/SIGHUP.

    A child that exits on its own, or cannot be started at all (the spawn fails:
    EMFILE, an executable gone), is logged and restarted after `Backoff.delay` s; a
    child that ran `restart_window` s counts as healthy again. A child with more than
    `max_restarts` consecutive failures is crash-looping: it is still retried (at
    `max_delay`) and reported, and no other child is ever touched for it; or, with
    `Backoff.give_up`, the supervisor stops every child and run() returns GAVE_UP.

    A child that exits with EXIT_STARTUP (2: a config it cannot use) is fatal, as a
    start-up failure is to uvicorn's and gunicorn's supervisors: every restart would
    fail alike. The other children are stopped and run() returns EXIT_STARTUP.

    With `status_port`, /health (200, or 503 naming the crash-looping shards),
    /status (JSON, one entry per shard) and /metrics (Prometheus: the shards, this
    process, and `collectors`) are served on `status_host`:`status_port`.

    Under systemd's notify protocol (NOTIFY_SOCKET set) the children tell the
    supervisor, not systemd: it says READY=1 once every child has (the unit's
    NotifyAccess=main holds), STOPPING=1 when it stops.

    The stop signals (`stop_signals`) are forwarded to the children, once each, which get
    `stop_timeout` s before SIGKILL; so is a SIGTERM if the supervisor itself fails.
    run() returns 0 when every child stopped in time on the forwarded signal and no
    child was crash-looping, else 1. Call it from the main thread (it installs signal
    handlers and the wakeup fd, restored on return).
    """

    def __init__(
        self,
        children: Children,
        n: int,
        *,
        backoff: Backoff | None = None,
        stop_timeout: float = 10.0,
        status_port: int | None = None,
        status_host: str = "127.0.0.1",
        collectors: Sequence[Collector] = (),
    ) -> None:
        if n < 1:
            raise ValueError(f"need at least one shard, got {n}")
        self.children = children
        self.what = children.what
        self.backoff = backoff or Backoff()
        self.stop_timeout = stop_timeout
        self.status_address = None if status_port is None else (status_host, status_port)
        self.collectors = collectors
        self.shards = [Shard(i) for i in range(n)]
        self.got: list[int] = []  # stop signals received, acted on by the loop, not the handler
        self.ending: tuple[int, str] | None = None  # (run's return, why) once a child's exit ends the supervisor
        self.relay: ReadyRelay | None = None
        self.wake: socket.socket | None = None
        self._in_child: Callable[[], None] = lambda: None  # what a fork drops first (_install sets it)

    # --- the signals: each handler only records, the loop acts ---------------------

    def on_stop(self, signum: int, _frame: object) -> None:
        """A stop (systemd, Kubernetes, `kill`, a terminal's Ctrl-C or hang-up): forwarded
        to every child. The children are in their own process groups, so they get a
        terminal's signals once, through here."""
        self.got.append(signum)

    def on_sigchld(self, _signum: int, _frame: object) -> None:
        """A child exited. Nothing to do here: the wakeup fd wakes the loop to reap it."""

    def _install(self) -> Callable[[], None]:
        """The handlers, the wakeup fd and the READY relay; returns what puts them back."""
        handlers: dict[int, Callable[[int, object], None]] = {sig: self.on_stop for sig in stop_signals()}
        handlers[signal.SIGCHLD] = self.on_sigchld
        old = {sig: signal.signal(sig, h) for sig, h in handlers.items()}
        signal.siginterrupt(signal.SIGCHLD, False)  # a child's exit interrupts no system call
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)  # the C handler must never wait on it
        old_fd = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
        self.wake = wake_r
        self.relay = ReadyRelay.open()

        def restore() -> None:
            signal.set_wakeup_fd(old_fd)
            for sig, h in old.items():
                signal.signal(sig, h)
            wake_r.close()
            wake_w.close()
            if self.relay is not None:
                self.relay.close()

        self._in_child = lambda: self._forget(old, [wake_r, wake_w])
        return restore

    def _forget(self, old: dict, sockets: list[socket.socket]) -> None:
        """In a forked child: none of the supervisor's handlers, wakeup fd or sockets."""
        signal.set_wakeup_fd(-1)
        for sig, h in old.items():
            signal.signal(sig, h)
        for sock in sockets:
            sock.close()
        if self.relay is not None:
            self.relay.sock.close()

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
                while not self.got and self.ending is None:
                    self.reap(time.monotonic())
                    self._sleep()
            except BaseException:
                # Stop the children as a signal would (one SIGTERM each, stop_timeout), not leave
                # them to PR_SET_PDEATHSIG: the kernel sends that once per exiting thread of
                # ours, and a shard reads a second SIGTERM as "exit now, skip the linger".
                log.exception("supervisor failed: stopping its %s", _many(self.what))
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
        s.ready = False
        env = {} if self.relay is None else {"NOTIFY_SOCKET": self.relay.address}
        try:
            s.proc = self.children.start(s.index, s.restarts, env, self._in_child)
        except (OSError, subprocess.SubprocessError) as exc:
            # EMFILE, EAGAIN, an executable gone: this child's problem, retried as a crash
            # would be. Raising would end the supervisor and, with it, the healthy children.
            self.failed(s, s.started, f"could not be started ({exc})")
            return
        log.info("%s %d started (pid %d)", self.what, s.index, s.proc.pid)

    def reap(self, now: float) -> None:
        """Each child's turn: note an exit, start a restart that is due."""
        for s in self.shards:
            p = s.proc
            if p is not None and p.poll() is None:
                if s.failures and now - s.started >= self.backoff.restart_window:
                    log.info("%s %d up for %.0f s: healthy again", self.what, s.index, now - s.started)
                    s.failures = 0
            elif p is not None:
                s.proc, s.last_exit = None, p.returncode
                if p.returncode == EXIT_STARTUP:
                    self.ending = EXIT_STARTUP, (
                        f"{self.what} {s.index} (pid {p.pid}) exited with {EXIT_STARTUP}: "
                        "its config cannot be used (its error is above)"
                    )
                    return
                self.failed(s, now, f"(pid {p.pid}) exited with {p.returncode}")
                if self.ending is not None:
                    return
            elif s.restart_at is not None and now >= s.restart_at:
                s.restarts += 1
                self.spawn(s)

    def failed(self, s: Shard, now: float, what: str) -> None:
        b = self.backoff
        s.failures = 1 if now - s.started >= b.restart_window else s.failures + 1
        if s.failures > b.max_restarts and b.give_up:
            self.ending = GAVE_UP, (
                f"{self.what} {s.index} {what}: {s.failures} failures in a row, none up {b.restart_window:.0f} s"
            )
            return
        s.delay = b.delay(s.failures)
        s.restart_at = now + s.delay
        log.warning("%s %d %s; restart in %g s", self.what, s.index, what, s.delay)
        if s.failures == b.max_restarts + 1:
            log.error(
                "%s %d is crash-looping (%d failures in a row, none up %.0f s); "
                "retrying every %g s at most, the others go on",
                self.what, s.index, s.failures, b.restart_window, b.max_delay,
            )

    def stop(self, sig: int) -> int:
        """Forward `sig` to every running child and reap them; 1 if any had to be killed or failed."""
        return _stop([s.proc for s in self.shards if s.proc is not None], sig, self.stop_timeout, self.got, self.what)

    def _finish(self) -> int:
        if self.relay is not None:
            self.relay.stopping()
        if self.ending is not None:
            code, why = self.ending
            log.error("%s: stopping the other %s; %s", why, _many(self.what),
                      "giving up" if code == GAVE_UP else f"exit {code}")
            self.stop(signal.SIGTERM)
            return code
        sig = self.got[0]
        log.info("got %s: stopping %d %s", signal.Signals(sig).name, len(self.shards), _many(self.what))
        looping = any(s.failures > self.backoff.max_restarts for s in self.shards)
        rc = self.stop(sig) or int(looping)
        log.info("stopped: got %s; exit %d", signal.Signals(sig).name, rc)
        return rc

    def _sleep(self) -> None:
        """Until a signal (a child's exit, a stop), a relayed READY, or the next restart is due."""
        assert self.wake is not None, "run() installs the wakeup fd first"
        due = [s.restart_at for s in self.shards if s.restart_at is not None]
        timeout = min([_TICK, *(t - time.monotonic() for t in due)])
        if timeout > 0:
            select.select([self.wake, *([self.relay.sock] if self.relay else [])], [], [], timeout)
        try:
            while self.wake.recv(64):
                pass
        except BlockingIOError:
            pass
        if self.relay is not None:
            self.relay.read(self.shards)

    def _status_server(self) -> StatusServer | None:
        if self.status_address is None:
            return None
        host, port = self.status_address
        try:
            return StatusServer(self.shards, self.backoff.max_restarts, host, port, self.collectors)
        except OSError as exc:
            raise StatusPortError(f"cannot serve supervisor status on {host}:{port}: {exc.strerror}") from exc


class ReadyRelay:
    """systemd's notify protocol through the supervisor: its children's NOTIFY_SOCKET is
    this datagram socket (Linux's abstract namespace: no file to leave behind), which
    takes a datagram only with its sender's credentials and only from a child's pid.
    READY=1 goes up to the supervisor's own NOTIFY_SOCKET once every child has said it;
    STOPPING=1 when the supervisor stops. Not opened without a NOTIFY_SOCKET above."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.sock, self.address = sock, address
        self.told = False

    @classmethod
    def open(cls) -> ReadyRelay | None:
        if not os.environ.get("NOTIFY_SOCKET") or not hasattr(socket, "SO_PASSCRED"):
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        name = f"detokd-relay-{os.getpid()}-{os.urandom(8).hex()}"
        sock.bind("\0" + name)
        sock.setblocking(False)
        return cls(sock, "@" + name)

    def read(self, shards: list[Shard]) -> None:
        by_pid = {s.proc.pid: s for s in shards if s.proc is not None}
        creds = socket.CMSG_SPACE(struct.calcsize("3i"))
        while True:
            try:
                data, ancillary, _, _ = self.sock.recvmsg(4096, creds)
            except (BlockingIOError, InterruptedError):
                break
            pid = next((struct.unpack("3i", d[:12])[0] for level, kind, d in ancillary
                        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS), None)
            s = by_pid.get(pid) if pid is not None else None
            if s is not None and b"READY=1" in data.split(b"\n"):
                s.ready = True
        if not self.told and all(s.ready for s in shards):
            self.told = True
            readiness.notify("READY=1")

    def stopping(self) -> None:
        readiness.notify("STOPPING=1")

    def close(self) -> None:
        self.sock.close()


def _many(what: str) -> str:
    """shard -> shards, decoding process -> decoding processes."""
    return what + ("es" if what.endswith("s") else "s")


def supervise_shards(
    argv_for_shard: Callable[[int], list[str]],
    n: int,
    *,
    restart_delay: float = 1.0,
    max_delay: float = 30.0,
    max_restarts: int = 5,
    restart_window: float = 60.0,
    command: Sequence[str] | None = None,
    **kwargs,
) -> int:
    """Supervisor(Commands(argv_for_shard, command), n, ...).run(), the backoff given as its four numbers."""
    backoff = Backoff(restart_delay, max_delay, max_restarts, restart_window)
    children = Commands(argv_for_shard) if command is None else Commands(argv_for_shard, command)
    return Supervisor(children, n, backoff=backoff, **kwargs).run()


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


def _stop(procs: list[Child], sig: int, timeout: float, got: list[int], what: str = "shard") -> int:
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
            log.error("%s pid %d did not stop within %.1f s: killing it", what, p.pid, timeout)
            p.kill()
            p.wait()
            status = 1
        elif p.returncode not in (0, -sig):
            log.warning("%s pid %d exited with %s on shutdown", what, p.pid, p.returncode)
            status = 1
    return status


def _send(p: Child, sig: int) -> None:
    try:
        p.send_signal(sig)  # reaped children are skipped: no signal to a reused pid
    except ProcessLookupError:
        pass
