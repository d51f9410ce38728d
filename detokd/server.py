"""The event loop: poll, take every ready frame, hand it to the dialect, deliver. One thread.

Modelled on SGLang's DetokenizerManager, with what it lacked: a frame that fails
to decode is counted and answered, never fatal; any exception while handling one
request fails that request alone; signals end the loop after the frame in hand,
and queued sends get a bounded linger to leave. The loop knows no wire format:
the dialect decodes frames and encodes output, the core decides, delivery sends.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable

import zmq

from . import readiness
from .collector import Collector
from .config import Config, ConfigError
from .core.decoder import make_codec
from .core import stops
from .core.detokenizer import Detokenizer
from .core.outbox import Outbox
from .core.records import INTERNAL
from .delivery import Delivery
from .logs import RateLimitFilter
from .metrics import MetricsServer, Stats
from .tokenizer import Vocab, load
from .wire.native import NativeDialect

log = logging.getLogger("detokd.server")

POLL_MS = 100  # the loop turns at least this often, so /health sees it alive when idle
MAX_FRAMES_PER_TURN = 256  # then settle owed rows and refresh metrics before reading on

# A dialect is built over the parts it drives: (core, delivery, collector, stats, cfg).
DialectFactory = Callable[[Detokenizer, Delivery, Collector, Stats, Config], object]


def native(core: Detokenizer, delivery: Delivery, collector: Collector, stats: Stats, cfg: Config) -> NativeDialect:
    return NativeDialect(core, delivery, collector, stats, debug_ops=cfg.debug_ops)


class Server:
    def __init__(self, cfg: Config, vocab: Vocab | None = None, dialect: DialectFactory = native) -> None:
        self.cfg = cfg
        self.stats = Stats()
        self.metrics = None
        self.ctx = zmq.Context()
        self.delivery = None
        # Health first, so a supervisor sees "starting" during the seconds a tokenizer
        # takes; then the input, since an address in use is a config error worth knowing
        # before them.
        try:
            if cfg.metrics_port is not None:
                try:
                    self.metrics = MetricsServer(self.stats, cfg.metrics_host, cfg.metrics_port, cfg.health_timeout)
                except OSError as exc:
                    raise ConfigError(f"cannot serve metrics on {cfg.metrics_host}:{cfg.metrics_port}: {exc.strerror}") from exc
                self.metrics.start()
            self.input = self.ctx.socket(zmq.PULL)
            self.input.setsockopt(zmq.LINGER, 0)
            try:
                self.input.bind(cfg.input)
            except zmq.ZMQError as exc:
                raise ConfigError(f"cannot bind input {cfg.input}: {exc.strerror}") from exc
            self.vocab = vocab or load(cfg.tokenizer)
            t0 = time.perf_counter()
            self.codec = make_codec(self.vocab, cfg.codec)
            log.info(
                "tokenizer %s: %d ids, %s codec (built and verified in %.2fs)",
                cfg.tokenizer, self.vocab.size, self.codec.name, time.perf_counter() - t0,
            )
            self.outbox = Outbox()
            try:
                self.delivery = Delivery(
                    self.ctx, self.outbox, list(cfg.workers),
                    feedback=cfg.feedback, hwm=cfg.send_hwm, linger_ms=cfg.linger_ms, stats=self.stats,
                )
            except (ValueError, zmq.ZMQError) as exc:
                raise ConfigError(str(exc)) from exc
        except BaseException:
            self.close()
            raise
        self.core = Detokenizer(
            self.codec, self.vocab.size, self.outbox,
            max_states=cfg.max_states, max_prompt_tail=cfg.max_prompt_tail, stats=self.stats,
        )
        self.collector = Collector(self.stats)
        self.dialect = dialect(self.core, self.delivery, self.collector, self.stats, cfg)
        # What peers send chooses what these log (rids, ops, worker numbers): each
        # message template gets a bounded rate and a bounded length. logs.setup (the
        # CLI) limits every record at its handler; these hold where another program
        # owns the logging (SGLang's detokenizer process).
        for name in ("detokd.server", "detokd.core", "detokd.delivery", f"detokd.wire.{self.dialect.name}"):
            logger = logging.getLogger(name)
            if not any(isinstance(f, RateLimitFilter) for f in logger.filters):
                logger.addFilter(RateLimitFilter())
        self.running = False

    def stop(self, *_args) -> None:
        self.running = False

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.stop)
        self.collector.start()
        self.running = True
        stats = self.stats
        stats.ready = True
        log.info("serving: input %s, %d worker(s), %s dialect", self.cfg.input, len(self.delivery.workers), self.dialect.name)
        readiness.notify("READY=1")
        poller = zmq.Poller()
        poller.register(self.input, zmq.POLLIN)
        recv = self.input.recv
        monotonic = time.monotonic
        try:
            while self.running:
                stats.last_turn = monotonic()
                if not poller.poll(POLL_MS):
                    self._publish()
                    continue
                for _ in range(MAX_FRAMES_PER_TURN):
                    try:
                        frame = recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.process(frame)
                    # The heartbeat of /health: a busy loop is alive, only a stuck one is not.
                    stats.last_turn = monotonic()
                    if not self.running:
                        break
                self._publish()
        finally:
            self.collector.stop()
            readiness.notify("STOPPING=1")
            log.info("stopping: sends get up to %d ms to leave", self.cfg.linger_ms)
            self.close()
        return 0

    def process(self, frame: bytes) -> None:
        """One inbound frame, start to finish: decode, handle, deliver."""
        t0 = time.perf_counter()
        stats = self.stats
        stats.frames += 1
        if self.input.getsockopt(zmq.RCVMORE):
            self._drop_multipart()
            return
        dialect = self.dialect
        try:
            if not dialect.handle(frame):
                return  # not a message at all: counted as a bad frame, nothing to deliver
        except Exception:  # a bug must cost one batch, never the process
            stats.error(INTERNAL)
            log.exception("internal error handling a frame")
        self.delivery.deliver(dialect.encode_text, dialect.encode_stopped, self.core.stalled)
        stats.step(time.perf_counter() - t0)

    def _drop_multipart(self) -> None:
        parts = 1
        while self.input.getsockopt(zmq.RCVMORE):
            self.input.recv()
            parts += 1
        self.stats.bad_frames += 1
        log.warning("multipart message of %d frames dropped: the protocol is one frame per message", parts)

    def _publish(self) -> None:
        self.collector.tick(time.monotonic())
        self.delivery.settle(self.dialect.encode_text, self.core.table.__contains__)
        core = self.core
        self.stats.live = len(core.table)
        self.stats.memory = {
            "tombstones": (len(core.dead), core.dead.nbytes),
            "stop_automata": (len(stops.cache), stops.cache.nbytes),
        }
        self.delivery.publish()

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if getattr(self, "input", None) is not None:
            self.input.close(linger=0)
        if self.delivery is not None:
            self.delivery.close()
        self.ctx.term()
