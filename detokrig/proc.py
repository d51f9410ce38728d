"""CPU time and memory of processes, from /proc (Linux), and the rest of the machine's load.

The benchmarks read per-thread run time in ns from /proc/<pid>/task/*/schedstat around
each measured phase (/proc/<pid>/stat and psutil's cpu_times round to clock ticks, 10 ms).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class Memory:
    """A process' resident size now and at its peak (VmHWM), in kB."""

    rss_kb: int
    hwm_kb: int


def memory(pid: int) -> Memory:
    """VmRSS and VmHWM of /proc/<pid>/status; OSError once the process is gone."""
    with open(f"/proc/{pid}/status") as f:
        kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "VmHWM")}
    return Memory(rss_kb=kb["VmRSS"], hwm_kb=kb["VmHWM"])


def tick_cpu_s(pid: int) -> float:
    """utime + stime of /proc/<pid>/stat (all threads), in seconds of clock-tick resolution."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_ticks(pid: int) -> dict[int, tuple[str, float]]:
    """Each live thread of `pid`: its name (/proc/<pid>/task/<tid>/comm) and utime + stime
    so far (its stat), in seconds of clock-tick resolution; {} once the process is gone."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    tick = os.sysconf("SC_CLK_TCK")
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def loadavg() -> float:
    """The machine's 1-minute load: other work on the cores makes the figures noisier."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def task_cpu_ns(pid: int) -> int:
    """CPU time of every thread of `pid` so far, in ns (0 once it is gone)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


def cpu_s(pids: list[int]) -> float:
    """CPU seconds of these processes, all their threads, from schedstat (a pid gone counts 0)."""
    return sum(task_cpu_ns(p) for p in pids) / 1e9


def descendants(pid: int) -> list[int]:
    """pid and its descendants (a `--shards` supervisor forks the shards)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            with contextlib.suppress(OSError), open(f"/proc/{p}/task/{tid}/children") as f:
                todo += [int(c) for c in f.read().split()]
    return out


def _proc_stat(*fields: int) -> Optional[int]:
    """The sum of these fields of /proc/stat's cpu line (0 user, 1 nice, 2 system, 3 idle,
    4 iowait, 5 irq, 6 softirq, 7 steal), in ns."""
    try:
        with open("/proc/stat") as f:
            parts = f.readline().split()[1:9]
    except OSError:
        return None
    return sum(int(parts[i]) for i in fields) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def machine_busy_ns() -> Optional[int]:
    """CPU time all processes of the machine ran, in ns."""
    return _proc_stat(0, 1, 2, 5, 6)


def steal_ns() -> Optional[int]:
    """CPU time the hypervisor gave to other guests while this one wanted to run."""
    return _proc_stat(7)


def other_load(seconds: float = 0.5) -> float:
    """Cores kept busy over `seconds` while the benchmark's own processes sit idle."""
    m0, t0 = machine_busy_ns(), time.monotonic_ns()
    time.sleep(seconds)
    m1, t1 = machine_busy_ns(), time.monotonic_ns()
    return 0.0 if m0 is None or m1 is None else (m1 - m0) / (t1 - t0)


class QuietWait:
    """Waits before a measurement until the rest of the machine is idle, within a
    budget over the whole run; `waited` is the time spent so far."""

    def __init__(self, budget: float = 120.0) -> None:
        self.budget = budget
        self.waited = 0.0

    def __call__(self, threshold: float, max_wait: float, say: Callable[[str], None]) -> float:
        """Wait at most `max_wait` s (and what is left of the budget) while other
        processes keep more than `threshold` cores busy; the load seen last."""
        if max_wait <= 0 or self.waited >= self.budget:
            return 0.0
        t0 = time.monotonic()
        deadline = t0 + min(max_wait, self.budget - self.waited)
        load = other_load(0.2)
        while load > threshold and time.monotonic() < deadline:
            say(f"waiting for a quiet machine: other processes keep {load:.2f} cores busy")
            load = other_load(1.0)
        self.waited += time.monotonic() - t0
        return load


class ProcTree:
    """CPU time and peak RSS of a process and its children (detokd --shards forks)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.pids = [pid]
        self.schedstat = os.path.exists(f"/proc/{pid}/task/{pid}/schedstat")

    def refresh(self) -> None:
        self.pids = descendants(self.pid)

    def cpu_ns(self) -> int:
        if self.schedstat:
            return sum(task_cpu_ns(p) for p in self.pids)
        return int(self.cpu_psutil() * 1e9)

    def cpu_psutil(self) -> float:
        """The tick-based figure, through psutil: a cross-check of schedstat's that shares
        no code with it."""
        import psutil

        total = 0.0
        for p in self.pids:
            with contextlib.suppress(Exception):
                t = psutil.Process(p).cpu_times()
                total += t.user + t.system
        return total

    def reset_peak(self) -> None:
        """Restart VmHWM from the current RSS (clear_refs 5), so a peak is per phase."""
        for p in self.pids:
            with contextlib.suppress(OSError), open(f"/proc/{p}/clear_refs", "w") as f:
                f.write("5")

    def peak_rss_mb(self) -> Optional[float]:
        try:
            return sum(memory(p).hwm_kb for p in self.pids) / 1024
        except OSError:
            return None
