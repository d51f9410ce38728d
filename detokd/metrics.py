"""The /health and /metrics endpoint, over what the loop publishes.

The loop only bumps plain integers on `Stats` (detokd.core.stats); the HTTP thread
reads them when scraped. It never calls into the loop's state, so a saturated or
stuck loop cannot stop /health from answering (with 503 once the loop has not turned
for `health_timeout` seconds).
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from . import logs
from .core.stats import BUCKETS, Stats
from .http import Endpoint, Reply

log = logging.getLogger("detokd.metrics")


class _StatsCollector:
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
            ("gc_collections", s.gc_collections, "collections of the young generations, each a pause of the loop between batches"),
            ("gc_seconds", s.gc_seconds, "seconds the loop paused in those collections"),
            ("clamped_ids", s.clamped_ids, "out-of-vocabulary ids decoded as id 0, as SGLang's detokenizer does (sglang dialect)"),
            ("overload_transitions", s.overload_transitions, "times the RSS guard turned on or off"),
            ("feedback_dropped", s.feedback_dropped, "stopped rows lost to a full feedback queue"),
            ("register_changes", s.register_changes, "registers that added a worker or moved one"),
            ("curve_refused", s.curve_refused, "CURVE handshakes the input refused: a key not allowed, or no CURVE with detokd's key (each reconnect counts)"),
        ):
            yield CounterMetricFamily(f"detokd_{name}", doc, value=value)
        errors = CounterMetricFamily(
            "detokd_errors", "errors by kind: error rows sent (docs/protocol.md), and the refused or malformed "
            "registers and failures inside a frame that have no row", labels=["kind"],
        )
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
        disconnects = CounterMetricFamily(
            "detokd_worker_disconnects", "connections to the worker that broke (live requests with rows in flight failed)", labels=["worker"]
        )
        writable = GaugeMetricFamily("detokd_worker_writable", "1 while the worker's send queue has room", labels=["worker"])
        owed = GaugeMetricFamily("detokd_worker_owed_rows", "error rows waiting for the worker's queue to have room", labels=["worker"])
        backlog = GaugeMetricFamily("detokd_worker_backlog_messages", "messages waiting behind the worker's ZMQ queue", labels=["worker"])
        backlog_bytes = GaugeMetricFamily(
            "detokd_worker_backlog_bytes", "bytes waiting behind the worker's ZMQ queue (at most send_queue_bytes)", labels=["worker"]
        )
        for w, f in sorted(s.workers.items()):
            sent.add_metric([str(w)], f.sent)
            dropped.add_metric([str(w)], f.dropped)
            disconnects.add_metric([str(w)], f.disconnects)
            writable.add_metric([str(w)], 1 if f.writable else 0)
            owed.add_metric([str(w)], f.owed)
            backlog.add_metric([str(w)], f.backlog)
            backlog_bytes.add_metric([str(w)], f.backlog_bytes)
        yield from (sent, dropped, disconnects, writable, owed, backlog, backlog_bytes)
        unconfirmed = CounterMetricFamily(
            "detokd_worker_unconfirmed", "requests whose ending row (finish or error) was in flight on a connection to the "
            "worker that broke: the worker may not have read it; never failed afterwards", labels=["worker"],
        )
        for w, n in sorted(s.unconfirmed.items()):
            unconfirmed.add_metric([str(w)], n)
        yield unconfirmed
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
        registry.register(_StatsCollector(stats))

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
