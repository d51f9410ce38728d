"""The /health and /metrics endpoint, over what the loop publishes.

The loop only bumps plain integers on `Stats` (detokd.core.stats); the HTTP thread
reads them when scraped, and reads the gauges (sizes of the loop's tables and queues)
then too, through `Stats.sample`: ints and len()s, each atomic under the GIL. It never
changes the loop's state or waits on it, so a saturated or stuck loop cannot stop
/health from answering (with 503 once the loop has not turned for `health_timeout`
seconds).
"""

from __future__ import annotations

import socket
import time

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from . import logs
from .core.stats import BUCKETS, Stats
from .http import Endpoint, Reply

log = logs.get(__name__)


# Each family's help: exactly what it counts, word for word docs/deploy.md's "what it
# counts" column (backticks dropped; tests/test_metrics.py holds them equal).
HELP = {
    "frames": "inbound messages read from the input, of every type, bad ones included",
    "bad_frames": "inbound messages that did not decode, or broke a frame-wide rule (max_rows, multipart)",
    "rows": "rows of tokens messages",
    "tokens": "ids decoded",
    "requests_started": "requests started",
    "stops_detected": "stop strings detokd found itself",
    "aborts": "requests the engine aborted",
    "evictions": "requests evicted to stay within max_states",
    "gc_collected": "objects the periodic collection freed (cycles)",
    "gc_collections": "collections of the young generations, between batches: once 128 requests have started "
    "or a second has passed",
    "gc_seconds": "seconds the loop paused in the collections of detokd_gc_collections_total",
    "clamped_ids": "out-of-vocabulary ids decoded as id 0 (SGLang dialect, SGLang's rule)",
    "overload_transitions": "times the RSS guard turned on or off",
    "register_changes": "register messages that added a worker or moved one (each also logged)",
    "curve_refused": "CURVE handshakes the input refused: a client key not in curve_clients, or a client that does "
    "not speak CURVE with detokd's public key (ZMQ reconnects, so one client counts again at every attempt)",
    "errors": "error rows sent, by error word (docs/protocol.md); also register_refused, bad_register, "
    "and internal for a frame whose handling failed as a whole",
    "feedback_dropped": "stopped rows lost to a full feedback queue (the scheduler generates on until its own stop)",
    "feedback_backlog_bytes": "bytes waiting behind the feedback socket's ZMQ queue, at most send_queue_bytes",
    "live_requests": "request states held",
    "overloaded": "1 while RSS is above max_rss_mb (new requests refused)",
    "worker_messages": "text messages queued for each worker",
    "worker_dropped": "messages lost to a full worker queue (their requests failed)",
    "worker_disconnects": "connections to a worker that broke, or ended when register moved it; the live requests "
    "with rows in flight on it failed (worker_stalled), the ended ones are counted in detokd_worker_unconfirmed_total",
    "worker_writable": "1 while a message would go straight into the worker's ZMQ queue",
    "worker_owed_rows": "error rows waiting for a worker's queue to have room",
    "worker_backlog_messages": "messages waiting behind the worker's ZMQ queue",
    "worker_unconfirmed": "requests whose ending row (finish or error) was among the last messages on a connection "
    "to the worker that broke: the worker read it or lost it with the connection, ZMQ cannot tell; never failed "
    "afterwards (docs/reliability.md, \"Known limits\")",
    "worker_backlog_bytes": "bytes of the messages waiting behind the worker's ZMQ queue, at most send_queue_bytes",
    "memory_entries": "entries of each bounded memory: tombstones, stop_automata (the cache), "
    "stop_automata_alive (cached or held by live requests)",
    "memory_bytes": "estimated bytes of each bounded memory of detokd_memory_entries",
    "step_seconds": "seconds to handle one inbound message that decoded, from decode to send",
    "loop_idle_seconds": "time since the loop last turned",
    "log_records_dropped": "log records lost to a full queue to stderr (stderr not read)",
    "http_dropped": "connections to this port closed unanswered: full (64 were open), deadline (no whole request "
    "within 5 s)",
    "build_info": "always 1; the labels name the running versions and the wire dialect",
}


def _family(kind, name: str, **kw):
    return kind(f"detokd_{name}", HELP[name], **kw)


def build_labels(dialect: str) -> dict[str, str]:
    """detokd_build_info's labels: what is running, for dashboards and upgrade checks."""
    import platform

    import tokenizers

    from . import __version__

    return {
        "version": __version__,
        "python": platform.python_version(),
        "tokenizers": tokenizers.__version__,
        "dialect": dialect,
    }


def build_info(dialect: str) -> GaugeMetricFamily:
    labels = build_labels(dialect)
    info = _family(GaugeMetricFamily, "build_info", labels=list(labels))
    info.add_metric(list(labels.values()), 1)
    return info


class BuildInfo:
    """A collector of detokd_build_info alone (the supervisor's /metrics has it too)."""

    def __init__(self, dialect: str) -> None:
        self.dialect = dialect

    def collect(self):
        yield build_info(self.dialect)


class _StatsCollector:
    def __init__(self, stats: Stats) -> None:
        self.stats = stats

    def collect(self):
        s = self.stats
        if s.sample is not None:
            s.sample()
        yield build_info(s.dialect)
        for name, value in (
            ("frames", s.frames), ("bad_frames", s.bad_frames), ("rows", s.rows), ("tokens", s.tokens),
            ("requests_started", s.started), ("stops_detected", s.stops), ("aborts", s.aborts),
            ("evictions", s.evictions), ("gc_collected", s.gc_collected), ("gc_collections", s.gc_collections),
            ("gc_seconds", s.gc_seconds), ("clamped_ids", s.clamped_ids),
            ("overload_transitions", s.overload_transitions),
            ("feedback_dropped", s.feedback_dropped), ("register_changes", s.register_changes),
            ("curve_refused", s.curve_refused),
        ):
            yield _family(CounterMetricFamily, name, value=value)
        errors = _family(CounterMetricFamily, "errors", labels=["kind"])
        for kind, n in sorted(s.errors.items()):
            errors.add_metric([kind], n)
        yield errors
        yield _family(GaugeMetricFamily, "live_requests", value=s.live)
        yield _family(GaugeMetricFamily, "feedback_backlog_bytes", value=s.feedback_backlog_bytes)
        yield _family(GaugeMetricFamily, "overloaded", value=1 if s.overloaded else 0)
        yield from self._workers(s)
        entries = _family(GaugeMetricFamily, "memory_entries", labels=["memory"])
        size = _family(GaugeMetricFamily, "memory_bytes", labels=["memory"])
        for name, (n, nbytes) in sorted(s.memory.items()):
            entries.add_metric([name], n)
            size.add_metric([name], nbytes)
        yield entries
        yield size
        counts = list(s.step_counts)
        cumulative, buckets = 0, []
        for bound, n in zip(BUCKETS, counts, strict=False):  # counts ends with the +Inf bucket, added below
            cumulative += n
            buckets.append((repr(bound), cumulative))
        buckets.append(("+Inf", cumulative + counts[-1]))
        yield _family(HistogramMetricFamily, "step_seconds", buckets=buckets, sum_value=s.step_sum)
        yield _family(GaugeMetricFamily, "loop_idle_seconds", value=time.monotonic() - s.last_turn)
        yield _family(CounterMetricFamily, "log_records_dropped", value=logs.dropped())

    @staticmethod
    def _workers(s: Stats):
        fams = {
            name: _family(kind, name, labels=["worker"])
            for name, kind in (
                ("worker_messages", CounterMetricFamily), ("worker_dropped", CounterMetricFamily),
                ("worker_disconnects", CounterMetricFamily), ("worker_writable", GaugeMetricFamily),
                ("worker_owed_rows", GaugeMetricFamily), ("worker_backlog_messages", GaugeMetricFamily),
                ("worker_backlog_bytes", GaugeMetricFamily),
            )
        }
        for w, f in sorted(s.workers.items()):
            for name, value in (
                ("worker_messages", f.sent), ("worker_dropped", f.dropped), ("worker_disconnects", f.disconnects),
                ("worker_writable", 1 if f.writable else 0), ("worker_owed_rows", f.owed),
                ("worker_backlog_messages", f.backlog), ("worker_backlog_bytes", f.backlog_bytes),
            ):
                fams[name].add_metric([str(w)], value)
        yield from fams.values()
        unconfirmed = _family(CounterMetricFamily, "worker_unconfirmed", labels=["worker"])
        for w, n in sorted(s.unconfirmed.items()):
            unconfirmed.add_metric([str(w)], n)
        yield unconfirmed


class _DroppedCollector:
    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint

    def collect(self):
        dropped = _family(CounterMetricFamily, "http_dropped", labels=["reason"])
        for reason, n in sorted(self.endpoint.dropped.items()):
            dropped.add_metric([reason], n)
        yield dropped


class MetricsServer:
    """/health, /livez, /readyz and /metrics, on a thread of their own (detokd.http).

    /livez fails only while the loop is stuck: restarting a process that is loading its
    tokenizer or draining on a signal would only lose work. /readyz fails while
    starting, stopping or stuck: no new traffic then. /health is both at once
    (503 starting or stuck), as it always was.
    """

    def __init__(self, stats: Stats, host: str, port: int, health_timeout: float,
                 listener: socket.socket | None = None) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_StatsCollector(stats))
        ProcessCollector(registry=registry)

        def stuck() -> Reply | None:
            idle = time.monotonic() - stats.last_turn
            if stats.ready and idle > health_timeout:
                return 503, f"loop stuck for {idle:.1f}s\n".encode(), "text/plain"
            return None

        def health() -> Reply:
            if not stats.ready:
                return 503, b"starting\n", "text/plain"
            return stuck() or (200, b"ok\n", "text/plain")

        def livez() -> Reply:
            return stuck() or (200, b"ok\n" if stats.ready else b"starting\n", "text/plain")

        def readyz() -> Reply:
            if stats.stopping:
                return 503, b"stopping\n", "text/plain"
            return health()

        def metrics() -> Reply:
            return 200, generate_latest(registry), "text/plain; version=0.0.4"

        routes = {"/health": health, "/livez": livez, "/readyz": readyz, "/metrics": metrics}
        self.endpoint = Endpoint(host, port, routes, "detokd-metrics", listener=listener)
        self.port = self.endpoint.port
        registry.register(_DroppedCollector(self.endpoint))

    def start(self) -> None:
        self.endpoint.start()
        log.info("health and metrics on port %d", self.port)

    def close(self) -> None:
        self.endpoint.close()
