"""What the loop publishes, and the /health and /metrics endpoint that reads it.

The loop only bumps plain integers on `Stats`; the HTTP thread reads them when
scraped. It never calls into the loop's state, so a saturated or stuck loop cannot
stop /health from answering (with 503 once the loop has not turned for
`health_timeout` seconds).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import NamedTuple

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from . import logs
from .http import Endpoint, Reply

log = logging.getLogger("detokd.metrics")

# Step latency buckets in seconds: a healthy step is tens of microseconds.
BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class WorkerFigures(NamedTuple):
    sent: int  # messages queued
    dropped: int  # messages lost to a full queue
    writable: bool  # the queue has room now
    owed: int  # error rows waiting for it to have room
    backlog: int  # messages waiting behind ZMQ's queue
    backlog_bytes: int


class Stats:
    def __init__(self) -> None:
        self.frames = 0
        self.bad_frames = 0
        self.rows = 0
        self.tokens = 0
        self.started = 0
        self.stops = 0
        self.aborts = 0
        self.evictions = 0
        self.gc_collected = 0  # objects the periodic collection freed: cycles someone made
        self.clamped_ids = 0  # out-of-vocabulary ids a dialect mapped to 0 (SGLang's rule)
        self.errors: dict[str, int] = {}
        self.live = 0
        self.workers: dict[int, WorkerFigures] = {}
        # The bounded memories, entries and bytes: name -> (entries, bytes).
        self.memory: dict[str, tuple[int, int]] = {}
        self.step_counts = [0] * (len(BUCKETS) + 1)
        self.step_sum = 0.0
        self.step_max = 0.0
        self.last_turn = time.monotonic()
        self.ready = False  # set once the tokenizer is loaded and every socket bound
        self.overloaded = False  # RSS above max_rss_mb: new requests refused
        self.overload_transitions = 0
        self.feedback_dropped = 0  # stopped rows lost to a full feedback queue
        self.feedback_backlog_bytes = 0
        # Security events (docs/security.md); refused registers are errors{kind="register_refused"}.
        self.register_changes = 0  # registers that added or moved a worker
        self.curve_refused = 0  # CURVE handshakes the input refused (the authenticator's threads bump it)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def step(self, seconds: float) -> None:
        self.step_counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.step_sum += seconds
        if seconds > self.step_max:
            self.step_max = seconds


class _Collector:
    def __init__(self, stats: Stats) -> None:
        self.stats = stats

    def collect(self):
        s = self.stats
        for name, value, doc in (
            ("frames", s.frames, "inbound frames"),
            ("bad_frames", s.bad_frames, "inbound frames that did not decode"),
            ("rows", s.rows, "inbound token rows"),
            ("tokens", s.tokens, "output token ids decoded"),
            ("requests_started", s.started, "requests started"),
            ("stops_detected", s.stops, "stop strings detokd detected itself"),
            ("aborts", s.aborts, "requests aborted by the engine"),
            ("evictions", s.evictions, "requests evicted to stay within max_states"),
            ("gc_collected", s.gc_collected, "unreachable objects the periodic collection freed (cycles)"),
            ("clamped_ids", s.clamped_ids, "out-of-vocabulary ids decoded as id 0, as SGLang's detokenizer does (sglang dialect)"),
            ("overload_transitions", s.overload_transitions, "times the RSS guard turned on or off"),
            ("feedback_dropped", s.feedback_dropped, "stopped rows lost to a full feedback queue"),
            ("register_changes", s.register_changes, "registers that added a worker or moved one"),
            ("curve_refused", s.curve_refused, "CURVE handshakes the input refused: a key not allowed, or no CURVE with detokd's key (each reconnect counts)"),
        ):
            yield CounterMetricFamily(f"detokd_{name}", doc, value=value)
        errors = CounterMetricFamily("detokd_errors", "error rows sent, by kind", labels=["kind"])
        for kind, n in sorted(s.errors.items()):
            errors.add_metric([kind], n)
        yield errors
        yield GaugeMetricFamily("detokd_live_requests", "request states held", value=s.live)
        yield GaugeMetricFamily(
            "detokd_feedback_backlog_bytes", "bytes waiting behind the feedback socket's ZMQ queue (at most send_queue_bytes)",
            value=s.feedback_backlog_bytes,
        )
        yield GaugeMetricFamily("detokd_overloaded", "1 while RSS is above max_rss_mb (new requests refused)", value=1 if s.overloaded else 0)
        sent = CounterMetricFamily("detokd_worker_messages", "text messages queued per worker", labels=["worker"])
        dropped = CounterMetricFamily("detokd_worker_dropped", "messages lost to a full worker queue", labels=["worker"])
        writable = GaugeMetricFamily("detokd_worker_writable", "1 while the worker's send queue has room", labels=["worker"])
        owed = GaugeMetricFamily("detokd_worker_owed_rows", "error rows waiting for the worker's queue to have room", labels=["worker"])
        backlog = GaugeMetricFamily("detokd_worker_backlog_messages", "messages waiting behind the worker's ZMQ queue", labels=["worker"])
        backlog_bytes = GaugeMetricFamily(
            "detokd_worker_backlog_bytes", "bytes waiting behind the worker's ZMQ queue (at most send_queue_bytes)", labels=["worker"]
        )
        for w, f in sorted(s.workers.items()):
            sent.add_metric([str(w)], f.sent)
            dropped.add_metric([str(w)], f.dropped)
            writable.add_metric([str(w)], 1 if f.writable else 0)
            owed.add_metric([str(w)], f.owed)
            backlog.add_metric([str(w)], f.backlog)
            backlog_bytes.add_metric([str(w)], f.backlog_bytes)
        yield from (sent, dropped, writable, owed, backlog, backlog_bytes)
        entries = GaugeMetricFamily("detokd_memory_entries", "entries held by each bounded memory", labels=["memory"])
        size = GaugeMetricFamily("detokd_memory_bytes", "estimated bytes held by each bounded memory", labels=["memory"])
        for name, (n, nbytes) in sorted(s.memory.items()):
            entries.add_metric([name], n)
            size.add_metric([name], nbytes)
        yield entries
        yield size
        counts = list(s.step_counts)
        cumulative, buckets = 0, []
        for bound, n in zip(BUCKETS, counts):
            cumulative += n
            buckets.append((repr(bound), cumulative))
        buckets.append(("+Inf", cumulative + counts[-1]))
        yield HistogramMetricFamily("detokd_step_seconds", "time to process one inbound batch", buckets=buckets, sum_value=s.step_sum)
        yield GaugeMetricFamily("detokd_loop_idle_seconds", "time since the loop last turned", value=time.monotonic() - s.last_turn)
        yield CounterMetricFamily("detokd_log_records_dropped", "log records lost to a full queue to stderr (stderr not read)", value=logs.dropped())


class _DroppedCollector:
    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint

    def collect(self):
        dropped = CounterMetricFamily(
            "detokd_http_dropped", "HTTP connections closed unanswered: full (every connection open), "
            "deadline (the request was not in within the deadline)", labels=["reason"],
        )
        for reason, n in sorted(self.endpoint.dropped.items()):
            dropped.add_metric([reason], n)
        yield dropped


class MetricsServer:
    """/health and /metrics, on a thread of their own (detokd.http)."""

    def __init__(self, stats: Stats, host: str, port: int, health_timeout: float) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(stats))

        def health() -> Reply:
            if not stats.ready:
                return 503, b"starting\n", "text/plain"
            idle = time.monotonic() - stats.last_turn
            if idle > health_timeout:
                return 503, f"loop stuck for {idle:.1f}s\n".encode(), "text/plain"
            return 200, b"ok\n", "text/plain"

        def metrics() -> Reply:
            return 200, generate_latest(registry), "text/plain; version=0.0.4"

        self.endpoint = Endpoint(host, port, {"/health": health, "/metrics": metrics}, "detokd-metrics")
        self.port = self.endpoint.port
        registry.register(_DroppedCollector(self.endpoint))

    def start(self) -> None:
        self.endpoint.start()
        log.info("health and metrics on port %d", self.port)

    def close(self) -> None:
        self.endpoint.close()
