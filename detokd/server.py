"""The event loop: poll, take every ready frame, hand it to the dialect, deliver. One thread.

Modelled on SGLang's DetokenizerManager, with what it lacked: a frame that fails
to decode is counted and answered, never fatal; any exception while handling one
request fails that request alone; a signal stops the input taking new frames, the
frames already queued are answered (decoded while time allows, `shutdown` error
rows after), and queued sends get a bounded linger to leave, all within
shutdown_grace_s. The loop knows no wire format: the dialect decodes a frame, has the
core decide, and returns what the frame produced, encoded; the conductor
(detokd.conductor) hands that to delivery, which sends.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import NoReturn

import zmq

from . import http, logs, readiness, sockets
from .conductor import Conductor
from .config import Config, ConfigError, check
from .core.decoder import Codec, make_codec
from .core.detokenizer import Detokenizer
from .core.outbox import Outbox
from .core.records import SHUTDOWN
from .core.stats import Stats
from .delivery import EVENTS, POLLIN, Delivery, RegisterPolicy
from .gc_policy import GcPolicy
from .launch import stop_signals
from .metrics import MetricsServer
from .tokenizer import Vocab, load
from .wire.dialect import Dialect, DialectFactory

log = logs.get(__name__)

POLL_MS = 100  # the loop turns at least this often, so /health sees it alive when idle
MAX_FRAMES_PER_TURN = 256  # then send owed rows and refresh metrics before reading on
RSS_EVERY = 0.1  # seconds between two reads of the resident size, at most
PAGE = os.sysconf("SC_PAGE_SIZE")
EXIT_GRACE = 3  # the exit status when the shutdown grace ran out, or a second signal came
DRAIN_SHARE = 0.5  # of shutdown_grace_s for decoding queued frames; then error rows and the linger
LAST_WORDS_S = 0.5  # at most, of the grace, for the log lines before an os._exit
# Each asks for the same drained stop. SIGHUP too: detokd has no reload, and SIGHUP's
# default action (a terminal or session gone) would end it with nothing answered or
# logged; but not where it was ignored when the process started (launch.stop_signals).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def rss_bytes() -> int:
    """Resident size: one short read of /proc/self/statm (no psutil, no parsing of status)."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * PAGE


def exit_now(message: str, wait: float, level: int = logging.ERROR) -> NoReturn:
    """Log `message`, write out the log, and end the process with EXIT_GRACE, in `wait`
    s whatever the logging does: a handler another program installed may block on a
    full stderr, or on a lock the stuck loop holds. The words wait; the exit does not."""

    def last_words() -> None:
        # Past the rate limiter: its lock is the one a busy loop takes row after row,
        # and a waiter can starve on it.
        log.log(level, message, extra=logs.UNLIMITED)
        logs.close()
        logging.shutdown()

    words = threading.Thread(target=last_words, name="detokd-last-words", daemon=True)
    words.start()
    words.join(wait)
    os._exit(EXIT_GRACE)


class GraceWatch:
    """The shutdown grace, on a thread of its own. It learns of STOP_SIGNALS from
    the wakeup fd that the interpreter's C-level handler writes the signal's number to
    (signal.set_wakeup_fd), so it hears them while the loop is stuck, and the Python
    handler only sets a flag: nothing that runs in a signal handler takes a lock.

    The first signal: the process ends within `grace` s, whatever the loop does. A
    second one: it ends now. Both with EXIT_GRACE, logged."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.words = min(LAST_WORDS_S, grace / 4)
        self.reader, self.writer = socket.socketpair()
        self.writer.setblocking(False)  # the C handler must never wait on it
        self.old_fd = signal.set_wakeup_fd(self.writer.fileno(), warn_on_full_buffer=False)
        self.thread = threading.Thread(target=self._run, name="detokd-grace", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        deadline = None
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                exit_now(
                    f"not stopped within shutdown_grace_s = {self.grace} s: exiting now, unsent output is lost",
                    self.words,
                )
            self.reader.settimeout(left)
            try:
                data = self.reader.recv(64)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return  # close(): run() is over
            for signum in data:
                if signum not in STOP_SIGNALS:
                    continue  # another program's handler shares the fd
                if deadline is not None:
                    exit_now(f"second signal {signum} while stopping: exiting now", self.words, logging.WARNING)
                deadline = time.monotonic() + self.grace - self.words

    def close(self) -> None:
        signal.set_wakeup_fd(self.old_fd)
        self.writer.close()  # the reader sees the end
        # It returns at once, or it heard a signal still unread and ends the process:
        # within the grace, as promised, however slowly a loaded machine runs it.
        self.thread.join(self.grace)
        self.reader.close()


@dataclass(frozen=True)
class Prepared:
    """What start-up decides before anything binds an address: the config checked, the ipc
    folders and CURVE keys read, the tokenizer and its codec built and verified, the
    metrics port bound. A process that must know start-up will succeed before it says so
    (a supervisor about to fork its decoding process; detokd before its verdict to
    SGLang) prepares; its children only bind and serve. The metrics listener is held by
    the preparing process, so the port answers across a child's death."""

    cfg: Config
    vocab: Vocab
    codec: Codec
    curve: sockets.Curve | None
    metrics: socket.socket | None


def prepare(cfg: Config, vocab: Vocab | None = None, *, ipc_folders_fatal: bool = True) -> Prepared:
    """Everything of start-up that can fail, short of binding the input and connecting the
    workers (ConfigError, TokenizerError). `ipc_folders_fatal=False` says of an ipc path
    a stranger could take what it is, and serves: as SGLang's detokenizer, detokd serves
    where SGLang's own would."""
    check(cfg)
    curve = secure(cfg, ipc_folders_fatal)
    vocab = vocab or load(cfg.tokenizer)
    codec = build_codec(cfg, vocab)
    metrics = None
    if cfg.metrics_port is not None:
        try:
            metrics = http.listen(cfg.metrics_host, cfg.metrics_port)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {cfg.metrics_host}:{cfg.metrics_port}: {exc.strerror}") from exc
    return Prepared(cfg, vocab, codec, curve, metrics)


def secure(cfg: Config, ipc_folders_fatal: bool = True) -> sockets.Curve | None:
    """The private ipc folders, checked; CURVE's keys, if configured, read."""
    sockets.prepare_private([cfg.input, *cfg.workers, cfg.feedback])
    sockets.check_ipc_folders(
        [("input", cfg.input), *((f"worker {w}", a) for w, a in enumerate(cfg.workers)), ("feedback", cfg.feedback)],
        fatal=ipc_folders_fatal,
    )
    curve = sockets.Curve.from_config(cfg)
    if curve is not None:
        for name in cfg.curve_plaintext:  # config.check refused any other tcp socket without a key
            what = "every tcp worker added by register" if name == "register" else name.replace(".", " ")
            log.warning("CURVE is on but %s is connected in plaintext (curve_plaintext)", what)
    return curve


def build_codec(cfg: Config, vocab: Vocab) -> Codec:
    t0 = time.perf_counter()
    codec = make_codec(vocab, cfg.codec, cfg.release)
    log.info(
        "tokenizer %s: %d ids, %s codec (built and verified in %.2fs)",
        cfg.tokenizer, vocab.size, codec.name, time.perf_counter() - t0,
    )
    return codec


class Server:
    """detokd's loop over one input, its workers and one dialect.

    Start-up takes the stop signals first, so a stop that comes while it runs is a
    drained stop like any other, and then binds in an order a supervisor can read:
    health first (it says "starting" during the seconds a tokenizer takes), then the
    input (an address in use is a config error worth knowing before them), the
    tokenizer, delivery, and the core with its dialect. With `prepared` (server.prepare,
    run by a parent) only the binding is left. Whatever start-up opened is closed again
    if a later step fails."""

    def __init__(
        self, cfg: Config, dialect: DialectFactory, vocab: Vocab | None = None, prepared: Prepared | None = None
    ) -> None:
        check(cfg)
        self.cfg = cfg
        self.stats = Stats()
        self.metrics: MetricsServer | None = None
        self.ctx = zmq.Context()
        self.auth = None
        self.refusals = threading.Lock()
        self.stop_requested_at: float | None = None  # when the first STOP_SIGNAL came
        self.stop_signal: int = signal.SIGTERM  # which one it was
        self.watch: GraceWatch | None = None
        self.old_handlers: dict = {}
        try:
            self._take_signals()
            self._serve_health(prepared.metrics if prepared is not None else None)
            curve = prepared.curve if prepared is not None else secure(cfg)
            self._bind_input(curve)
            if prepared is not None:
                self.vocab, self.codec = prepared.vocab, prepared.codec
            else:
                self.vocab = vocab or load(cfg.tokenizer)
                self.codec = build_codec(cfg, self.vocab)
            self._open_delivery(curve)
        except BaseException:
            self.close()
            raise
        self.core = Detokenizer(
            self.codec, self.vocab.size, Outbox(self.delivery.workers),  # the workers delivery connected
            max_states=cfg.max_states, max_prompt_tail=cfg.max_prompt_tail, stats=self.stats, limits=cfg.limits(),
        )
        self.gc_policy = GcPolicy(self.stats)
        self.dialect: Dialect = dialect(self.core, self.delivery, self.gc_policy, self.stats, cfg)
        self.stats.dialect = self.dialect.name
        self.conductor = Conductor(self.dialect, self.core, self.delivery, self.stats)
        self.stats.sample = self._sample_gauges
        self.stopping_notified = False
        self.max_rss = cfg.max_rss_mb * 1024 * 1024 if cfg.max_rss_mb is not None else None
        self.rss_checked = 0.0

    # --- start-up, in order -----------------------------------------------------------

    def _take_signals(self) -> None:
        """The grace watch and the stop handlers, before anything is bound: a SIGTERM that
        comes while the tokenizer loads, with frames already queued on the input, stops
        the server once it is up, answering them (the default action would drop them all)."""
        self.watch = GraceWatch(self.cfg.shutdown_grace_s)  # first: every handled signal reaches it
        self.old_handlers = {sig: signal.signal(sig, self._on_signal) for sig in stop_signals()}

    def _give_signals_back(self) -> None:
        # The watch first: a second signal it already heard ends the process with
        # EXIT_GRACE while close() waits for it. With the old handlers back first,
        # the next signal of a storm took the default action (killed, status -15).
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        for sig, handler in self.old_handlers.items():
            if handler is not None:  # None: a handler not installed from Python
                signal.signal(sig, handler)
        self.old_handlers = {}

    def _serve_health(self, listener: socket.socket | None) -> None:
        cfg = self.cfg
        if cfg.metrics_port is None:
            return
        try:
            self.metrics = MetricsServer(
                self.stats, cfg.metrics_host, cfg.metrics_port, cfg.health_timeout, listener=listener
            )
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {cfg.metrics_host}:{cfg.metrics_port}: {exc.strerror}") from exc
        self.metrics.start()

    def _bind_input(self, curve: sockets.Curve | None) -> None:
        cfg = self.cfg
        self.input = self.ctx.socket(zmq.PULL)
        self.input.setsockopt(zmq.LINGER, 0)
        # A bigger message is never read: ZMQ drops the connection of its sender.
        self.input.setsockopt(zmq.MAXMSGSIZE, cfg.max_frame_bytes)
        if curve is not None:
            self.auth = sockets.start_authenticator(self.ctx, cfg.curve_clients, self._curve_refused, watch=self.input)
            curve.serve(self.input)
        elif sockets.is_loopback_tcp(cfg.input) is False:
            log.warning(
                "input %s is reachable from other hosts and unauthenticated: anyone who reaches it can "
                "send rows and register workers; set curve_secret_key (docs/security.md)", cfg.input,
            )
        sockets.claim_ipc(cfg.input)
        try:
            self.input.bind(cfg.input)
        except zmq.ZMQError as exc:
            raise ConfigError(f"cannot bind input {cfg.input}: {exc.strerror}") from exc
        self.endpoint = self.input.getsockopt_string(zmq.LAST_ENDPOINT)
        self.bound = self.endpoint + (" (CURVE)" if curve else "")

    def _open_delivery(self, curve: sockets.Curve | None) -> None:
        cfg = self.cfg
        try:
            self.delivery = Delivery(
                self.ctx, list(cfg.workers),
                feedback=cfg.feedback, hwm=cfg.send_hwm, queue_bytes=cfg.send_queue_bytes,
                linger_ms=cfg.linger_ms, stats=self.stats,
                policy=RegisterPolicy.of(cfg, curve is not None), curve=curve,
            )
        except (ValueError, zmq.ZMQError) as exc:
            raise ConfigError(str(exc)) from exc

    def _on_signal(self, signum: int, _frame) -> None:
        """A STOP_SIGNAL: the loop takes no new frames, answers the queued ones, exits.

        It runs between two bytecodes of whatever the loop was doing (inside a lock of
        the logging, say), so it sets a flag and nothing else, nothing that could wait.
        The grace and a second signal are GraceWatch's."""
        if self.stop_requested_at is None:
            self.stop_signal = signum
            self.stop_requested_at = time.monotonic()

    def run(self) -> int:
        """Serve until a STOP_SIGNAL, then answer what is queued and close."""
        drained = 0
        try:
            poller = self._start_serving()
            drained = self._loop(poller)
        finally:
            self._shut_down(drained)
        return 0

    def _start_serving(self) -> zmq.Poller:
        """From here the loop turns: say so (log, /health, systemd), and poll the input."""
        self.gc_policy.start()
        # The heartbeat starts now: until the first turn, /health measures from here, not
        # from Stats' creation before the seconds of start-up (it said "stuck" at once).
        self.stats.last_turn = time.monotonic()
        self.stats.ready = True
        log.info(
            "serving: input %s, %d worker(s), %s dialect", self.bound, len(self.delivery.workers), self.dialect.name
        )
        if self.stop_requested_at is None:  # stopped while starting: systemd hears STOPPING=1 only
            readiness.notify("READY=1")
        poller = zmq.Poller()
        poller.register(self.input, zmq.POLLIN)
        self.delivery.poller = poller  # a worker's backlog registers its socket's POLLOUT here
        return poller

    def _loop(self, poller: zmq.Poller) -> int:
        """Turns until stopped and drained; returns how many frames the drain answered."""
        stats, delivery = self.stats, self.delivery
        monotonic = time.monotonic
        drain_until = None  # once stopping: queued frames are decoded until then, answered `shutdown` after
        drained = 0
        while True:
            stats.last_turn = monotonic()
            if drain_until is None and self.stop_requested_at is not None:
                drain_until = self._stop_accepting(self.stop_requested_at)
            if not poller.poll(POLL_MS if drain_until is None else 0):
                if drain_until is not None:
                    return drained  # nothing queued
                self._between_batches()
                continue
            if delivery.backlogged:
                delivery.flush()
            taken, empty = self._take_frames(drain_until)
            drained += taken
            self._between_batches()
            if empty and drain_until is not None:
                return drained

    def _take_frames(self, drain_until: float | None) -> tuple[int, bool]:
        """Up to MAX_FRAMES_PER_TURN ready frames, each processed; returns how many were
        taken while draining, and whether the input ran empty."""
        recv, events, monotonic, stats = self.input.recv, self.input.getsockopt, time.monotonic, self.stats
        drained = 0
        for taken in range(MAX_FRAMES_PER_TURN):
            if drain_until is None and self.stop_requested_at is not None:
                # Stopped: the loop sets the drain's deadline before any frame is taken,
                # so a frame still queued when the signal came counts as queued.
                return drained, False
            # The poll found the first frame; after it, asking whether another is queued
            # costs a third of a receive that finds none (pyzmq raises Again), and most
            # turns of a scheduler's steps take one frame.
            if taken and not events(EVENTS) & POLLIN:  # type: ignore[operator]  # an int
                return drained, True
            try:
                # A Frame, not bytes: it says whether more parts follow, which asking the
                # socket (RCVMORE) would cost more than the receive itself.
                message = recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return drained, True
            if drain_until is not None:
                drained += 1
                if not self.core.closing and monotonic() >= drain_until:
                    self.core.closing = True
                    log.warning("shutdown: no time left to decode; the rows still queued get error shutdown")
            # The Frame goes before its bytes are decoded: a large one would be held twice.
            more, frame = message.more, message.bytes
            del message
            self.process(frame, more)
            # The heartbeat of /health: a busy loop is alive, only a stuck one is not.
            stats.last_turn = monotonic()
        return drained, False

    def _shut_down(self, drained: int) -> None:
        self.gc_policy.stop()
        self._notify_stopping()
        log.info(
            "stopping: %d queued frame(s) answered (%d row(s) with shutdown); sends get up to %d ms to leave",
            drained, self.stats.errors.get(SHUTDOWN, 0), self.cfg.linger_ms,
        )
        logs.report_suppressed(force=True)
        self.close()

    def _stop_accepting(self, requested_at: float) -> float:
        """The first signal (it came at `requested_at`): unbind the input, so that new
        frames stay with their senders (a PUSH queues them for the next detokd) while
        those queued here are answered. Returns when decoding them must end: a share of
        the grace after the signal."""
        self.stats.stopping = True  # /readyz fails first: no new traffic is sent here
        try:
            self.input.unbind(self.endpoint)
        except zmq.ZMQError as exc:  # it still reads only what is queued, then closes
            log.warning("cannot unbind input %s: %s", self.endpoint, exc.strerror)
        share = self.cfg.shutdown_grace_s * DRAIN_SHARE
        log.info(
            "%s: input %s takes no new frames; the queued ones get up to %.1f s to decode",
            signal.Signals(self.stop_signal).name, self.endpoint, share,
        )
        self._notify_stopping()  # now, not after the drain: systemd shows the unit deactivating
        return requested_at + share

    def _notify_stopping(self) -> None:
        if not self.stopping_notified:
            self.stopping_notified = True
            readiness.notify("STOPPING=1")

    def process(self, frame: bytes, more: bool) -> None:
        """One inbound message, start to finish: the conductor has the dialect handle its
        frame and delivery send what it produced. `more`: parts follow (it is dropped)."""
        t0 = time.perf_counter()
        stats = self.stats
        stats.frames += 1
        if more:
            self._drop_multipart()
            return
        if self.max_rss is not None:  # per frame, not per turn: a turn may be 256 frames of held text
            self._guard_rss(time.monotonic())
        if self.conductor.frame(frame):  # a step is a decoded frame's: the histogram counts those
            stats.step(time.perf_counter() - t0)

    def _drop_multipart(self) -> None:
        parts = 1
        while self.input.getsockopt(zmq.RCVMORE):
            self.input.recv()
            parts += 1
        self.stats.bad_frames += 1
        log.warning("multipart message of %d frames dropped: the protocol is one frame per message", parts)

    def _guard_rss(self, now: float) -> None:
        """max_rss_mb: above it new requests are refused ("overloaded"), and so is the
        held text of a live stream=false request that grows; streaming ones go on."""
        if now - self.rss_checked < RSS_EVERY:
            return
        self.rss_checked = now
        assert self.max_rss is not None, "the loop guards RSS only with max_rss_mb set"
        rss = rss_bytes()
        over = rss > self.max_rss
        if over != self.core.overloaded:
            self.core.overloaded = self.stats.overloaded = over
            self.stats.overload_transitions += 1
            if over:
                log.warning(
                    "RSS %.0f MB is above max_rss_mb = %d: new requests are refused (overloaded)",
                    rss / 2**20, self.cfg.max_rss_mb,
                )
            else:
                log.warning(
                    "RSS %.0f MB is below max_rss_mb = %d again: new requests are served",
                    rss / 2**20, self.cfg.max_rss_mb,
                )

    def _curve_refused(self) -> None:  # on the authenticator's two threads (ZAP, the handshake watch)
        with self.refusals:
            self.stats.curve_refused += 1

    def _between_batches(self) -> None:
        """What a turn ends with, after its frames (or the poll's timeout): each part
        bounded, none waits."""
        now = time.monotonic()
        logs.report_suppressed()  # security events are limited in rate, never lost without a count
        if self.max_rss is not None:
            self._guard_rss(now)
        self.gc_policy.tick(now)  # the young generations: every gc_policy.STARTS starts, or a second
        self.conductor.between_batches()
        self.delivery.read_room(now)

    def _sample_gauges(self) -> None:
        """The core's and delivery's sizes, for /metrics, which calls this on its own
        thread when scraped (counters are bumped as they happen), so a turn of the loop
        copies nothing: the copy costs ~2.4 µs, a fifth of a one-row frame. Each read is
        of an int or a len(), atomic under the GIL."""
        core = self.core
        self.stats.live = len(core.table)
        self.stats.memory = {
            "tombstones": (len(core.tombstones), core.tombstones.nbytes),
            "stop_automata": (len(core.automata.cache), core.automata.cache.nbytes),
            "stop_automata_alive": (core.automata.alive, core.automata.alive_bytes),
        }
        self.delivery.publish()

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if getattr(self, "input", None) is not None:
            self.input.close(linger=0)
        delivery = getattr(self, "delivery", None)  # absent when start-up failed before it
        if delivery is not None:
            delivery.close()
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
        self._give_signals_back()
