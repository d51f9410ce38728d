"""detokd's RSS and /metrics over the soak, and whether RSS ended flat."""

from __future__ import annotations

import threading
import time

from ..metrics import scrape
from ..proc import memory, tick_cpu_s


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Sampler(threading.Thread):
    """Every `interval` seconds: detokd's RSS and CPU time, and what /metrics says."""

    def __init__(self, pid: int, port: int, interval: float, t0: float) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.port, self.interval, self.t0 = port, interval, t0
        self.samples: list[dict] = []
        self.halt = threading.Event()

    def sample(self) -> None:
        try:
            rss = memory(self.pid).rss_kb * 1024
            cpu = tick_cpu_s(self.pid)
            m = scrape(self.port)
        except Exception as exc:  # the process went away: the run will say so
            log(f"sampler: {exc}")
            return
        self.samples.append({
            "t": round(time.monotonic() - self.t0, 3),
            "rss_mb": round(rss / 2**20, 2),
            "cpu_s": round(cpu, 2),
            "live": m.get("detokd_live_requests", 0),
            "tokens": m.get("detokd_tokens_total", 0),
            "started": m.get("detokd_requests_started_total", 0),
            "evictions": m.get("detokd_evictions_total", 0),
        })

    def run(self) -> None:
        while not self.halt.wait(self.interval):
            self.sample()


def flatness(samples: list[dict], threshold: float) -> dict:
    """RSS growth over the last quarter of the run: the mean of the last 10% of the
    samples against the mean of the samples around the 75% mark (70-80%)."""
    if len(samples) < 10:
        return {"flat": None, "reason": "too few samples"}
    t_end = samples[-1]["t"]

    def mean_rss(a: float, b: float) -> float:
        xs = [s["rss_mb"] for s in samples if a * t_end <= s["t"] <= b * t_end]
        return sum(xs) / len(xs)

    q3, end = mean_rss(0.70, 0.80), mean_rss(0.90, 1.0)
    growth = (end - q3) / q3
    return {
        "rss_start_mb": samples[0]["rss_mb"],
        "rss_q3_mb": round(q3, 2),
        "rss_end_mb": round(end, 2),
        "rss_peak_mb": max(s["rss_mb"] for s in samples),
        "last_quarter_growth": round(growth, 5),
        "threshold": threshold,
        "flat": growth < threshold,
    }
