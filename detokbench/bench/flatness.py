"""The flatness run: per-token cost at output length ~`steps` against ~`short_len`/2,
measured side by side so the machine's drift cancels."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from detokrig.proc import machine_busy_ns

from .harness import Impl
from .pipeline import STEP, Clocks, Pipeline, check_record, measured
from .report import median
from .workload import Workload

SEGMENTS = 8  # stretches of the long run the summary takes medians over


class Probe(NamedTuple):
    """One long-stream step and one short-stream step, each alone in the pipeline."""

    long_pos: int
    long_ns: int  # the implementation's CPU time for the long step
    short_pos: int
    short_ns: int
    other_ns: int  # CPU time the rest of the machine used meanwhile
    wall_ns: int


class Flatness:
    """B long streams, and B short ones (a control set that restarts every `short_len`
    steps, so its rows sit at output positions 1..short_len, mean ≈ short_len/2)."""

    def __init__(self, impl: Impl, wl_long: Workload, wl_short: Workload, *, steps: int, probe_every: int,
                 short_len: int, window: int) -> None:
        assert wl_short.batch == wl_long.batch and wl_short.n == wl_long.n
        self.impl = impl
        self.steps, self.probe_every, self.short_len, self.window = steps, probe_every, short_len, window
        self.n = wl_long.n
        self.L, self.S = wl_long.frames(impl.shards), wl_short.frames(impl.shards)
        self.p = Pipeline(impl, window, stall_s=60.0)
        self.probes: list[Probe] = []
        self.short_rounds: list[int] = []
        self.sp = 0  # the short set's next step in its round
        # Between two probes the control set moves on by `stride` steps, so that every
        # stretch of the long run samples it over a whole round (mean position short_len/2).
        self.stride = max(1, round(short_len * SEGMENTS * probe_every / max(1, steps)))

    def send(self, step: list, seq: int, window: int | None = None) -> None:
        self.p.window = window or self.window
        self.p.send(step, seq, STEP)

    def short_step(self) -> None:
        k, S = self.sp, self.S
        self.send(S["start"] if k == 0 else S["cyc"][k % len(S["cyc"])], k * self.n)
        self.short_done()

    def short_done(self) -> None:
        """The control set's step went; at the end of its round, its finishing step."""
        self.sp += 1
        if self.sp >= self.short_len:
            self.end_short_round()

    def end_short_round(self) -> None:
        self.send(self.S["finish"], self.sp * self.n)
        self.short_rounds.append(self.sp)
        self.sp = 0

    def probe(self, j: int, long_step: list) -> None:
        """The control set moved on by `stride`, the pipeline drained; then step j of the
        long streams and the control's next step, alone, back to back (in alternating
        order, so the order's own effect cancels), CPU time read around each."""
        for _ in range(self.stride - 1):
            self.short_step()
        if self.sp == 0:  # a start step is not measured
            self.short_step()
        self.p.drain()
        pos, cpu, h = self.sp, self.impl.tree.cpu_ns, self.impl.h
        short = self.S["cyc"][pos % len(self.S["cyc"])]
        long_first = len(self.probes) % 2 == 0
        first, second = ((long_step, j), (short, pos)) if long_first else ((short, pos), (long_step, j))
        m0, w0 = machine_busy_ns(), time.monotonic_ns()
        hc0 = h.self_tree.cpu_ns() + h.worker_tree.cpu_ns()
        c0 = cpu()
        self.send(first[0], first[1] * self.n, 1)
        self.p.drain()
        c1 = cpu()
        self.send(second[0], second[1] * self.n, 1)
        self.p.drain()
        c2 = cpu()
        hc1 = h.self_tree.cpu_ns() + h.worker_tree.cpu_ns()
        m1, w1 = machine_busy_ns(), time.monotonic_ns()
        lc, sc = (c1 - c0, c2 - c1) if long_first else (c2 - c1, c1 - c0)
        self.probes.append(Probe(j, lc, pos, sc, (m1 or 0) - (m0 or 0) - (c2 - c0) - (hc1 - hc0), w1 - w0))
        self.short_done()

    def run(self, max_seconds: float) -> int:
        """The long streams' steps, probed every `probe_every`; the steps run (the run
        stops early past max_seconds)."""
        L, n = self.L, self.n
        t0 = time.monotonic()
        j = 0
        while j < self.steps:
            lp = L["start"] if j == 0 else L["cyc"][j % len(L["cyc"])]
            if j and j % self.probe_every == 0:
                self.probe(j, lp)
            else:
                self.send(lp, j * n)
            j += 1
            if (j & 63) == 0 and time.monotonic() - t0 > max_seconds:
                break
        self.send(L["finish"], j * n)
        if self.sp:
            self.end_short_round()
        self.p.drain()
        return j


def run_flatness(impl: Impl, wl_long: Workload, wl_short: Workload, *, steps: int, probe_every: int,
                 short_len: int, window: int, max_seconds: float, check: str) -> dict:
    """One implementation's flatness run (Flatness): its figures, the probes' summary, the
    text check. The two steps of a probe are measured within a millisecond of each other, so
    the machine's own drift (a VM's speed moves by ±20% over seconds here) cancels in their ratio."""
    B = wl_long.batch
    watch_idx = sorted({0, B - 1, B // 2}) if check != "off" else []
    watch = [wl_long.rids[i] for i in watch_idx] + [wl_short.rids[i] for i in watch_idx]
    f = Flatness(impl, wl_long, wl_short, steps=steps, probe_every=probe_every, short_len=short_len, window=window)
    with measured(impl, B, "sample" if watch else "off", watch):
        c0, t_start = Clocks.read(impl), time.monotonic_ns()
        j = f.run(max_seconds)
    secs = (time.monotonic_ns() - t_start) / 1e9
    c1 = Clocks.read(impl)
    tokens = (j + sum(f.short_rounds)) * B * f.n
    impl_ns = c1.impl_ns - c0.impl_ns
    result: dict[str, Any] = dict(
        impl=impl.name, tokenizer=wl_long.corp.name, batch=B, ids_per_row=f.n, shards=impl.shards,
        steps=steps, steps_run=j, probes=len(f.probes), probe_every=probe_every, short_len=short_len,
        short_stride=f.stride, tokens=tokens, seconds=secs, tok_per_s=tokens / secs if secs > 0 else None,
        cpu_s_per_mtok=impl_ns / 1e9 / tokens * 1e6 if tokens else None,
        peak_rss_mb=impl.tree.peak_rss_mb(),
        other_cores=c1.other_cores(c0, secs),
        flatness=flatness_summary(f.probes, B * f.n, j), probe_data=[list(p) for p in f.probes],
    )
    dump = impl.h.dump()
    bad = sum(dump["texts"].get(wl.rids[i], "") != wl.reference(i, rounds)
              for i in watch_idx for wl, rounds in ((wl_long, [j]), (wl_short, f.short_rounds)))
    result["check"] = check_record("sample" if watch else "off", len(watch), bad, [], dump)
    return result


def flatness_summary(probes: list[Probe], tokens_per_step: int, length: int) -> dict:
    """Probe costs in SEGMENTS stretches of the long run: medians of the long and the
    short (control) steps' µs/token, and their ratio. The first stretch has both sets at
    similar lengths (ratio ≈ 1 unless the two sets differ); the last one compares
    output length ≈`length` with the control's ≈short_len/2."""
    if not probes:
        return {"segments": []}
    seg_len = max(1, length // SEGMENTS)
    out = []
    for k in range(SEGMENTS):
        ps = [p for p in probes if k * seg_len <= p.long_pos < (k + 1) * seg_len]
        if not ps:
            continue
        lu = median([p.long_ns / 1e3 / tokens_per_step for p in ps])
        su = median([p.short_ns / 1e3 / tokens_per_step for p in ps])
        out.append({
            "long_pos": median([p.long_pos for p in ps]), "short_pos": sum(p.short_pos for p in ps) / len(ps),
            "long_us_per_tok": lu, "short_us_per_tok": su, "ratio": lu / su if su else None,
            "probes": len(ps), "other_cores": sum(p.other_ns for p in ps) / max(1, sum(p.wall_ns for p in ps)),
        })
    first, last = out[0], out[-1]
    return {
        "segments": out,
        "early_len": first["long_pos"], "late_len": last["long_pos"], "short_len": last["short_pos"],
        "early_ratio": first["ratio"], "late_ratio": last["ratio"],
        "late_long_us_per_tok": last["long_us_per_tok"], "late_short_us_per_tok": last["short_us_per_tok"],
        "early_long_us_per_tok": first["long_us_per_tok"], "early_short_us_per_tok": first["short_us_per_tok"],
    }
