"""The scheduler side of a measured run: steps out with a window of them in flight, and
the clocks read around a phase.

At most `window` steps are in flight (sent, not yet acked): step k goes once step
k-window is acked, so the pipeline runs as fast as it absorbs without a queue that would
turn latency into a measure of the queue's length.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

from detokrig.proc import machine_busy_ns, steal_ns

from .harness import Impl
from .worker import ACK_STEP
from .workload import step_values

START, STEP, FINISH = 0, 1, 2  # what a step does to every stream


class Pipeline:
    """Sends steps (lists of (shard, Template)) to one implementation and records, for
    each step by its number, its kind, send time, the worker's receive time of its last
    row and its latency. Steps are numbered in send order; the number rides in `meta`."""

    def __init__(self, impl: Impl, window: int, stall_s: float) -> None:
        self.h = impl.h
        self.socks = impl.socks
        self.single = impl.shards == 1
        self.window = window
        self.stall_s = stall_s
        self.kind: list[int] = []
        self.send_t: list[int] = []
        self.recv_t: list[int] = []
        self.lat: list[int] = []
        self.done = bytearray()
        self.next = 0  # lowest step not yet acked

    @property
    def sent(self) -> int:
        return len(self.send_t)

    def take_ack(self) -> None:
        a = self.h.recv_ack(self.stall_s)
        if a[0] != ACK_STEP:
            return
        _, s, t_recv, latency = a
        done = self.done
        if s >= len(done) or done[s]:
            return
        done[s] = 1
        self.lat[s] = latency
        self.recv_t[s] = t_recv
        nx = self.next
        while nx < len(done) and done[nx]:
            nx += 1
        self.next = nx

    def send(self, step: list, seq: int, kind: int) -> None:
        """Once fewer than `window` steps are in flight."""
        done = self.done
        while len(done) - self.next >= self.window:
            self.take_ack()
        t = time.monotonic_ns()
        sb, mb = step_values(seq, (len(self.send_t), t))
        self.send_t.append(t)
        self.recv_t.append(0)
        self.lat.append(0)
        done.append(0)
        self.kind.append(kind)
        if self.single:
            self.socks[0].send(step[0][1].fill(sb, mb))
        else:
            socks = self.socks
            for s, tmpl in step:
                socks[s].send(tmpl.fill(sb, mb))

    def drain(self) -> None:
        """Until every step sent is acked."""
        while self.next < len(self.done):
            self.take_ack()


@contextmanager
def measured(impl: Impl, batch: int, check: str, watch: list[str]) -> Iterator[None]:
    """A measured phase: the worker told what to expect, the peak RSS reset, the collector off."""
    impl.h.configure(batch, check, watch)
    impl.tree.refresh()
    impl.tree.reset_peak()
    gc_was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc_was:
            gc.enable()


@dataclass(frozen=True)
class Clocks:
    """CPU time of the implementation, this process, the worker and the machine, read
    at one moment; two of them bound a phase."""

    impl_ns: int
    impl_psutil_s: float
    scheduler_ns: int
    worker_ns: int
    machine_ns: Optional[int]
    steal_ns: Optional[int]

    @classmethod
    def read(cls, impl: Impl) -> Clocks:
        h = impl.h
        return cls(impl.tree.cpu_ns(), impl.tree.cpu_psutil(), h.self_tree.cpu_ns(), h.worker_tree.cpu_ns(),
                   machine_busy_ns(), steal_ns())

    def other_cores(self, before: Clocks, seconds: float) -> Optional[float]:
        """Cores kept busy by processes outside the benchmark (another test run, ...) since
        `before`: should be ~0 for the figures to mean anything. None without /proc/stat."""
        if self.machine_ns is None or before.machine_ns is None or seconds <= 0:
            return None
        own = sum(getattr(self, k) - getattr(before, k) for k in ("impl_ns", "scheduler_ns", "worker_ns"))
        return max(0, self.machine_ns - before.machine_ns - own) / 1e9 / seconds


def check_record(mode: str, streams: int, mismatches: int, examples: list, dump: dict) -> dict:
    """A run's text check: what it compared and found, and the worker's error counts."""
    return {"mode": mode, "streams": streams, "mismatches": mismatches, "examples": examples,
            "errors": dump["n_errors"], "error_examples": dump["errors"][:5], "bad_frames": dump["bad_frames"]}
