"""What the loop publishes, and the /health and /metrics endpoint that reads it.

The loop only bumps plain integers on `Stats`; the HTTP thread reads them when
scraped. It never calls into the loop's state, so a saturated or stuck loop cannot
stop /health from answering (with 503 once the loop has not turned for
`health_timeout` seconds).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

log = logging.getLogger("detokd.metrics")

# Step latency buckets in seconds: a healthy step is tens of microseconds.
BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


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
        self.errors: dict[str, int] = {}
        self.live = 0
        self.workers: dict[int, tuple[int, int, bool]] = {}  # index -> (sent, dropped, writable)
        self.step_counts = [0] * (len(BUCKETS) + 1)
        self.step_sum = 0.0
        self.step_max = 0.0
        self.last_turn = time.monotonic()
        self.ready = False  # set once the tokenizer is loaded and every socket bound
        self.overloaded = False  # RSS above max_rss_mb: new requests refused
        self.overload_transitions = 0

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
            ("overload_transitions", s.overload_transitions, "times the RSS guard turned on or off"),
        ):
            yield CounterMetricFamily(f"detokd_{name}", doc, value=value)
        errors = CounterMetricFamily("detokd_errors", "error rows sent, by kind", labels=["kind"])
        for kind, n in sorted(s.errors.items()):
            errors.add_metric([kind], n)
        yield errors
        yield GaugeMetricFamily("detokd_live_requests", "request states held", value=s.live)
        yield GaugeMetricFamily("detokd_overloaded", "1 while RSS is above max_rss_mb (new requests refused)", value=1 if s.overloaded else 0)
        sent = CounterMetricFamily("detokd_worker_messages", "text messages queued per worker", labels=["worker"])
        dropped = CounterMetricFamily("detokd_worker_dropped", "messages lost to a full worker queue", labels=["worker"])
        writable = GaugeMetricFamily("detokd_worker_writable", "1 while the worker's send queue has room", labels=["worker"])
        for w, (n_sent, n_dropped, ok) in sorted(s.workers.items()):
            sent.add_metric([str(w)], n_sent)
            dropped.add_metric([str(w)], n_dropped)
            writable.add_metric([str(w)], 1 if ok else 0)
        yield sent
        yield dropped
        yield writable
        counts = list(s.step_counts)
        cumulative, buckets = 0, []
        for bound, n in zip(BUCKETS, counts):
            cumulative += n
            buckets.append((repr(bound), cumulative))
        buckets.append(("+Inf", cumulative + counts[-1]))
        yield HistogramMetricFamily("detokd_step_seconds", "time to process one inbound batch", buckets=buckets, sum_value=s.step_sum)
        yield GaugeMetricFamily("detokd_loop_idle_seconds", "time since the loop last turned", value=time.monotonic() - s.last_turn)


class MetricsServer:
    """/health and /metrics on a thread of their own."""

    def __init__(self, stats: Stats, host: str, port: int, health_timeout: float) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(stats))
        timeout = health_timeout

        class Handler(BaseHTTPRequestHandler):
            timeout = 10  # a client that connects and never sends a request lets go of its thread

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?")[0] == "/health":
                    if not stats.ready:
                        self._reply(503, b"starting\n", "text/plain")
                        return
                    idle = time.monotonic() - stats.last_turn
                    ok = idle <= timeout
                    body = (b"ok\n" if ok else f"loop stuck for {idle:.1f}s\n".encode())
                    self._reply(200 if ok else 503, body, "text/plain")
                elif self.path.split("?")[0] == "/metrics":
                    self._reply(200, generate_latest(registry), "text/plain; version=0.0.4")
                else:
                    self._reply(404, b"not found\n", "text/plain")

            def _reply(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # scrapes are not worth a log line
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="detokd-metrics", daemon=True)

    def start(self) -> None:
        self.thread.start()
        log.info("health and metrics on port %d", self.port)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class RateLimitFilter(logging.Filter):
    """A logger filter: per message template, at most `burst` records per `period`
    seconds, and none longer than `max_len` characters. The first record let through
    after a suppressed spell says how many were dropped.

    Installed on the loop's loggers, whose messages quote what peers send (rids,
    control ops, worker numbers): a flood of hostile frames costs a few lines.
    """

    def __init__(self, burst: int = 10, period: float = 10.0, max_len: int = 300, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.burst = burst
        self.period = period
        self.max_len = max_len
        self.clock = clock
        self.windows: dict[str, list] = {}  # template -> [window start, let through, suppressed]

    def filter(self, record: logging.LogRecord) -> bool:
        key = record.msg if isinstance(record.msg, str) else type(record.msg).__name__
        now = self.clock()
        w = self.windows.get(key)
        if w is None:
            if len(self.windows) >= 1000:  # templates are few; never let this grow
                self.windows.clear()
            w = self.windows[key] = [now, 0, 0]
        suppressed = 0
        if now - w[0] >= self.period:
            suppressed = w[2]
            w[0], w[1], w[2] = now, 0, 0
        if w[1] >= self.burst:
            w[2] += 1
            return False
        w[1] += 1
        msg = record.getMessage()
        if len(msg) > self.max_len:
            msg = f"{msg[: self.max_len]}... ({len(msg)} characters)"
        if suppressed:
            msg = f"{msg} [{suppressed} similar messages suppressed]"
        record.msg, record.args = msg, None
        return True
