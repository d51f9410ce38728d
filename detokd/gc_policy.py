"""detokd's garbage-collection policy: freeze what start-up built, collect young in small pauses.

Everything start-up allocated (tokenizer tables: millions of objects) is permanent:
frozen, it stays out of every future collection, so no step pauses on it. Steps
create no cycles (reference counting frees all they allocate), so the collector's
automatic runs would only pause steps to traverse live state. It runs over the young
generations instead, between batches, once STARTS requests have started or a second
has passed. What a collection traverses is what was allocated since the last one and
is still alive, and that is almost all requests' states (a start leaves a handful of
tracked objects, a step's own allocations are freed before its end): so a pause stays
near 0.06 ms however fast requests start, where once a second it grew with them (0.25-0.6
ms at 2,000-2,500 starts a second; `python -m detokbench gc-pauses`, docs/performance.md).
The price is more collector time in all (~1.1 against ~0.3 ms a second there, 0.1% of the
loop): every request is now traversed once, where the clock missed those that started
and finished within its second. What it frees is counted (detokd_gc_collected), so a
cycle that starts leaking shows, and so are its pauses (detokd_gc_collections,
detokd_gc_seconds).

(The collector's own count of young objects cannot be the trigger: it falls by one for
every tracked object freed, of any age, so under continuous batching the finishes
cancel the starts and it stays near zero while the young generation grows.)
"""

from __future__ import annotations

import gc
import time

from . import logs
from .core.stats import Stats

log = logs.get(__name__)

INTERVAL = 1.0  # seconds between collections of the young generations, at the most
STARTS = 128  # requests started since the last collection that make one: ~500 young objects


class GcPolicy:
    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self.next = 0.0
        self.starts = 0  # stats.started at the last collection

    def start(self) -> None:
        gc.collect()
        gc.freeze()
        gc.disable()
        self.starts = self.stats.started
        self.next = time.monotonic() + INTERVAL

    def tick(self, now: float) -> None:
        stats = self.stats
        if now >= self.next or stats.started - self.starts >= STARTS:
            began = time.perf_counter()
            stats.gc_collected += gc.collect(1)
            stats.gc_seconds += time.perf_counter() - began
            stats.gc_collections += 1
            self.starts = stats.started
            self.next = now + INTERVAL

    @staticmethod
    def freeze() -> None:
        """What a peer's freeze request asks (SGLang's FreezeGCReq, control freeze_gc)."""
        gc.freeze()
        log.info("froze %d objects out of the collector's reach", gc.get_freeze_count())

    @staticmethod
    def stop() -> None:
        gc.enable()
