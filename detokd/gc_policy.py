"""detokd's garbage-collection policy: freeze what start-up built, collect young on a clock.

Everything start-up allocated (tokenizer tables: millions of objects) is permanent:
frozen, it stays out of every future collection, so no step pauses on it. Steps
create no cycles (reference counting frees all they allocate), so the collector's
automatic runs would only pause steps to traverse live state: it runs once a second
over the young generations instead, between batches, and what it frees is counted
(detokd_gc_collected), so a cycle that starts leaking shows.
"""

from __future__ import annotations

import gc
import logging
import time

from .core.stats import Stats

log = logging.getLogger("detokd.gc_policy")

INTERVAL = 1.0  # seconds between collections of the young generations


class GcPolicy:
    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self.next = 0.0

    def start(self) -> None:
        gc.collect()
        gc.freeze()
        gc.disable()
        self.next = time.monotonic() + INTERVAL

    def tick(self, now: float) -> None:
        if now >= self.next:
            self.stats.gc_collected += gc.collect(1)
            self.next = now + INTERVAL

    @staticmethod
    def freeze() -> None:
        """What a peer's freeze request asks (SGLang's FreezeGCReq, control freeze_gc)."""
        gc.freeze()
        log.info("froze %d objects out of the collector's reach", gc.get_freeze_count())

    @staticmethod
    def stop() -> None:
        gc.enable()
