"""What the loop counts: plain integers the loop bumps and the metrics endpoint reads.

A record, not a registry: the core, delivery and the dialects write it without locks
or calls (a step pays an attribute increment), and detokd.metrics turns it into
Prometheus text on its own thread when scraped. Nothing here imports a metrics library.
"""

from __future__ import annotations

import bisect
import time
from typing import Callable, NamedTuple

# Step latency buckets in seconds: a healthy step is tens of microseconds.
BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class WorkerFigures(NamedTuple):
    sent: int  # messages queued
    dropped: int  # messages lost to a full queue
    disconnects: int  # connections that broke, failing the requests with rows in flight
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
        self.gc_collections = 0  # collections of the young generations (detokd.gc_policy)
        self.gc_seconds = 0.0  # the loop's time paused in them
        self.clamped_ids = 0  # out-of-vocabulary ids a dialect mapped to 0 (SGLang's rule)
        self.errors: dict[str, int] = {}
        # Called by /metrics before it reads the gauges below (live, workers, memory,
        # feedback_backlog_bytes): the loop's server sets it; None leaves them as they are.
        self.sample: Callable[[], None] | None = None
        self.live = 0
        self.workers: dict[int, WorkerFigures] = {}
        # Worker -> requests whose ending row was in flight on a connection to it that
        # broke: read or not, ZMQ cannot tell (delivery's `_broken`); never failed.
        self.unconfirmed: dict[int, int] = {}
        # The bounded memories, entries and bytes: name -> (entries, bytes).
        self.memory: dict[str, tuple[int, int]] = {}
        self.step_counts = [0] * (len(BUCKETS) + 1)
        self.step_sum = 0.0
        self.last_turn = time.monotonic()
        self.ready = False  # set once the tokenizer is loaded and every socket bound
        self.stopping = False  # set once a stop signal unbound the input (/readyz fails)
        self.dialect = ""  # the wire dialect's name, for detokd_build_info
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
