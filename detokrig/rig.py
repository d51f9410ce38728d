"""One real detokd and its peers, as soak, fuzz and worst-frames run it.

A Rig is a `detokd serve` of this checkout on ipc:// addresses in a temporary folder
(children: stopped at exit), the workers' sinks bound first (detokd connects to them),
a ZMQ context for the peers, the metrics port once it is ready, and its memory; a
`Sampler` records its RSS, CPU time and /metrics over a run.
"""

from __future__ import annotations

import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import zmq

from detokd.client import SchedulerClient
from detokd.process import ipc_config

from .children import detokd_process
from .engine import Engine
from .metrics import Metrics, metrics_port, scrape
from .proc import Memory, memory, tick_cpu_s


class Rig:
    """`settings` are config keys (`workers=2`: that many worker addresses); the
    metrics port is a free one and the log says `info`, unless given. `sinks` makes
    the workers' sinks from the context and the worker addresses."""

    def __init__(self, prefix: str, sinks: Callable[[zmq.Context, list[str]], list], *,
                 root: str | None = None, **settings: Any) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
        self.cfg = ipc_config(self.folder, **{"metrics_port": 0, "log_level": "info", **settings})
        self.ctx = zmq.Context()
        self.sinks = sinks(self.ctx, self.cfg.workers)
        self.detokd = detokd_process(self.cfg, self.folder)
        self.port: int | None = None
        self.died = False  # detokd exited before `stop`
        self._peers: list = []

    def spawn(self) -> Rig:
        self.detokd.spawn()
        return self

    def ready(self, timeout: float = 120.0) -> Rig:
        """Until detokd said READY=1 (NotReady if it did not), and its metrics port."""
        self.detokd.wait_ready(timeout)
        self.port = metrics_port(self.detokd)
        return self

    def start(self, timeout: float = 120.0) -> Rig:
        return self.spawn().ready(timeout)

    def engine(self, send_ms: int) -> Engine:
        e = Engine(self.ctx, self.cfg.input, send_ms)
        self._peers.append(e)
        return e

    def client(self, **kw: Any) -> SchedulerClient:
        c = SchedulerClient(self.cfg.input, context=self.ctx, **kw)
        self._peers.append(c)
        return c

    def metrics(self) -> Metrics:
        return scrape(self.port)

    def memory(self) -> Memory:
        return memory(self.detokd.pid)

    def memory_mb(self) -> dict[str, float]:
        """VmHWM (the peak) and VmRSS, in MB."""
        m = self.memory()
        return {"hwm_mb": round(m.hwm_kb / 1024, 1), "rss_mb": round(m.rss_kb / 1024, 1)}

    def exit_problem(self, code: int | str | None) -> str | None:
        """What is wrong with how detokd ended, `code` being its status on our SIGTERM."""
        if self.died:
            return f"detokd died: exit {self.detokd.returncode}\n" + "\n".join(self.detokd.log().splitlines()[-30:])
        return None if code in (0, None) else f"detokd exited {code} on SIGTERM"

    def stop(self, timeout: float = 30.0) -> int | str:
        """SIGTERM; detokd's exit status, "killed" when it did not exit within
        `timeout`; `died` says whether it had exited before."""
        self.died = self.detokd.returncode is not None
        try:
            return self.detokd.stop(timeout)
        except subprocess.TimeoutExpired:
            return "killed"

    def close(self) -> None:
        """detokd killed if still running, every peer and sink closed, the context gone."""
        if self.detokd.returncode is None:
            self.detokd.kill()
        for p in self._peers:
            p.close(linger=0) if isinstance(p, SchedulerClient) else p.close()
        for s in self.sinks:
            s.close()
        self.ctx.destroy(linger=0)


class Sampler(threading.Thread):
    """Every `interval` seconds: detokd's RSS and CPU time, and what /metrics says
    (live requests, tokens, starts, evictions); `say` hears why a sample failed. At
    `most` samples every other one is dropped and the interval doubled, so a run of any
    length keeps `most` / 2 to `most` of them, evenly spaced."""

    def __init__(self, rig: Rig, interval: float, t0: float, say: Callable[[str], None] = print,
                 most: int = 200) -> None:
        super().__init__(daemon=True)
        self.rig, self.interval, self.t0, self.say, self.most = rig, interval, t0, say, most
        self.samples: list[dict] = []
        self.halt = threading.Event()

    def sample(self) -> None:
        try:
            rss, cpu, m = self.rig.memory().rss_kb * 1024, tick_cpu_s(self.rig.detokd.pid), self.rig.metrics()
        except Exception as exc:  # the process went away: the run will say so
            self.say(f"sampler: {exc}")
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
        if len(self.samples) >= self.most:
            del self.samples[1::2]  # the first stays: it is the run's start
            self.interval *= 2

    def run(self) -> None:
        while not self.halt.wait(self.interval):
            self.sample()

    def finish(self) -> None:
        """Stop sampling, with one last sample."""
        self.halt.set()
        self.join(10)
        self.sample()

