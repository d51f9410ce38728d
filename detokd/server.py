"""The event loop: poll, take every ready frame, dispatch, send. One thread.

Modelled on SGLang's DetokenizerManager, with what it lacked: a frame that fails
to decode is counted and answered, never fatal; any exception while handling one
request fails that request alone; signals end the loop after the batch in hand,
and queued sends get a bounded linger to leave.
"""

from __future__ import annotations

import gc
import logging
import signal
import time

import zmq

from .wire import native as p
from .config import Config, ConfigError
from .core.decoder import make_codec
from .metrics import MetricsServer, RateLimitFilter, Stats
from .delivery import Router
from .core.detokenizer import Detokenizer
from .tokenizer import Vocab, load

log = logging.getLogger("detokd.server")

POLL_MS = 100  # the loop turns at least this often, so /health sees it alive when idle
MAX_FRAMES_PER_TURN = 256  # then refresh the heartbeat and metrics before reading on
GC_INTERVAL = 1.0  # seconds between collections of the young generations


class Server:
    def __init__(self, cfg: Config, vocab: Vocab | None = None) -> None:
        self.cfg = cfg
        # Bind first: an address in use is a config error worth knowing before the
        # seconds a tokenizer takes to load.
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.setsockopt(zmq.LINGER, 0)
        try:
            self.input.bind(cfg.input)
        except zmq.ZMQError as exc:
            self.ctx.destroy(linger=0)
            raise ConfigError(f"cannot bind input {cfg.input}: {exc.strerror}") from exc
        try:
            self.vocab = vocab or load(cfg.tokenizer)
        except Exception:
            self.ctx.destroy(linger=0)
            raise
        t0 = time.perf_counter()
        self.codec = make_codec(self.vocab, cfg.codec)
        log.info(
            "tokenizer %s: %d ids, %s codec (built and verified in %.2fs)",
            cfg.tokenizer, self.vocab.size, self.codec.name, time.perf_counter() - t0,
        )
        self.stats = Stats()
        self.feedback = None
        if cfg.feedback:
            self.feedback = self.ctx.socket(zmq.PUSH)
            self.feedback.setsockopt(zmq.SNDHWM, cfg.send_hwm)
            self.feedback.setsockopt(zmq.LINGER, cfg.linger_ms)
            self.feedback.connect(cfg.feedback)
        try:
            self.router = Router(self.ctx, list(cfg.workers), hwm=cfg.send_hwm, linger_ms=cfg.linger_ms, stats=self.stats)
        except ValueError as exc:
            self.ctx.destroy(linger=0)
            raise ConfigError(str(exc)) from exc
        self.service = Detokenizer(
            self.codec,
            self.vocab.size,
            self.router,
            max_states=cfg.max_states,
            max_prompt_tail=cfg.max_prompt_tail,
            stats=self.stats,
        )
        self.metrics = None
        if cfg.metrics_port is not None:
            try:
                self.metrics = MetricsServer(self.stats, cfg.metrics_host, cfg.metrics_port, cfg.health_timeout)
            except OSError as exc:
                self.close()
                raise ConfigError(f"cannot serve metrics on {cfg.metrics_host}:{cfg.metrics_port}: {exc.strerror}") from exc
        # What peers send chooses what these log (rids, ops, worker numbers): each
        # message template gets a bounded rate and a bounded length.
        for name in ("detokd.server", "detokd.core.detokenizer", "detokd.delivery"):
            logger = logging.getLogger(name)
            if not any(isinstance(f, RateLimitFilter) for f in logger.filters):
                logger.addFilter(RateLimitFilter())
        self.running = False

    def stop(self, *_args) -> None:
        self.running = False

    def run(self) -> int:
        if self.metrics is not None:
            self.metrics.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.stop)
        # Everything start-up allocated (tokenizer tables: millions of objects) is
        # permanent: keep it out of every future collection, so no step pauses on it.
        gc.collect()
        gc.freeze()
        # Steps create no cycles (reference counting frees all they allocate), so the
        # collector's automatic runs would only pause steps to traverse live state. It
        # runs once a second over the young generations instead, between batches; what
        # it frees is counted (detokd_gc_collected), so a cycle that starts leaking shows.
        gc.disable()
        self.next_gc = time.monotonic() + GC_INTERVAL
        self.running = True
        log.info("serving: input %s, %d worker(s)", self.cfg.input, len(self.router.workers))
        poller = zmq.Poller()
        poller.register(self.input, zmq.POLLIN)
        recv = self.input.recv
        stats = self.stats
        try:
            while self.running:
                stats.last_turn = time.monotonic()
                if not poller.poll(POLL_MS):
                    self._publish()
                    continue
                for _ in range(MAX_FRAMES_PER_TURN):
                    try:
                        frame = recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.process(frame)
                    if not self.running:
                        break
                self._publish()
        finally:
            gc.enable()
            log.info("stopping: sends get up to %d ms to leave", self.cfg.linger_ms)
            self.close()
        return 0

    def process(self, frame: bytes) -> None:
        """One inbound frame, start to finish: decode, handle, send."""
        t0 = time.perf_counter()
        stats = self.stats
        stats.frames += 1
        if self.input.getsockopt(zmq.RCVMORE):
            self._drop_multipart()
            return
        try:
            msg = p.decode_inbound(frame)
        except Exception as exc:  # DecodeError; RecursionError for nesting deeper than msgspec goes
            stats.bad_frames += 1
            log.warning("bad frame (%d bytes): %s", len(frame), exc)
            try:
                salvaged = p.salvage_rows(frame)
            except Exception:
                salvaged = None
            if salvaged is None:
                return
            rows, bad = salvaged
            self.service.bad_rows(bad)
            msg = p.Tokens(rows)
        try:
            if self.cfg.debug_ops and type(msg) is p.Control and msg.op.startswith("debug_stall:"):
                time.sleep(float(msg.op.split(":", 1)[1]))
            else:
                self.service.handle(msg)
        except Exception:  # a bug must cost one batch, never the process
            stats.error(p.INTERNAL)
            log.exception("internal error handling a %s message", type(msg).__name__)
        self._send()
        stats.step(time.perf_counter() - t0)

    def _send(self) -> None:
        router = self.router
        for worker, rows in router.flush():
            log.warning("worker %d's queue is full: %d rows lost, their requests failed", worker.index, len(rows))
            self.service.stalled(worker.index, rows)
            # Told once it has room again (the engine may send no more rows for them).
            router.owe(worker.index, [p.OutRow(r.rid, "", None, r.n_ids, p.NIL, r.error or p.WORKER_STALLED) for r in rows])
        stopped = self.service.stopped
        if stopped:
            self.service.stopped = []
            if self.feedback is not None:
                try:
                    self.feedback.send(p.encode(p.Stopped(stopped)), zmq.NOBLOCK)
                except zmq.Again:
                    self.stats.error("feedback_dropped")
                    log.warning("feedback queue full: %d stopped rows lost", len(stopped))

    def _drop_multipart(self) -> None:
        parts = 1
        while self.input.getsockopt(zmq.RCVMORE):
            self.input.recv()
            parts += 1
        self.stats.bad_frames += 1
        log.warning("multipart message of %d frames dropped: the protocol is one frame per message", parts)

    def _publish(self) -> None:
        now = time.monotonic()
        if now >= self.next_gc:
            self.stats.gc_collected += gc.collect(1)
            self.next_gc = now + GC_INTERVAL
        self.router.settle(self.service.table.__contains__)
        stats = self.stats
        stats.live = len(self.service.table)
        stats.workers = {w.index: (w.sent, w.dropped, self.router.has_room(w)) for w in self.router.workers.values()}

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self.input.close(linger=0)
        self.router.close()
        if self.feedback is not None:
            self.feedback.close(linger=self.cfg.linger_ms)
        self.ctx.term()
