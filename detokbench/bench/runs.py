"""An implementation started and warmed up; then one configuration through it: a
throughput phase, then an idle latency phase, then the check of the text the worker kept."""

from __future__ import annotations

import sys
import time
from typing import Any

from .harness import Harness, Impl, Stall
from .pipeline import FINISH, START, STEP, Clocks, Pipeline, check_record, measured
from .report import lat_stats, median
from .workload import Workload


def watched(check: str, batch: int) -> list[int]:
    """The streams whose text is checked: a spread sample, all, or none."""
    if check == "sample":
        return sorted({0, batch - 1, batch // 2, batch // 3, (2 * batch) // 3, batch // 7})
    return list(range(batch)) if check == "all" else []


def one_round(p: Pipeline, wl: Workload, frames: dict, nsteps: int, t_cap: float) -> int:
    """Every stream starts, runs `nsteps` steps and finishes; the steps run (a round
    stops early past t_cap)."""
    start, finish, cyc = frames["start"], frames["finish"], frames["cyc"]
    period, n = len(cyc), wl.n
    j = 0
    while j < nsteps:
        p.send(start if j == 0 else cyc[j % period], j * n, START if j == 0 else STEP)
        j += 1
        if (j & 15) == 0 and time.monotonic() > t_cap:
            break
    p.send(finish, j * n, FINISH)
    return j


def run_config(impl: Impl, wl: Workload, *, steps: int, min_seconds: float, max_seconds: float,
               lat_steps: int, lat_max_seconds: float, window: int, check: str) -> dict:
    """One configuration through one implementation.

    Throughput phase: rounds of `steps` steps (every stream starts, runs `steps` steps,
    finishes), `window` steps in flight, until `min_seconds` have passed (at least one
    round; a round is cut short after `max_seconds`). Latency phase: one round of
    `lat_steps` steps, one step in flight. Each round ends with a step of finishing rows."""
    frames = wl.frames(impl.shards)
    watch_idx = watched(check, wl.batch)
    p = Pipeline(impl, window, stall_s=max(30.0, max_seconds * 4))
    with measured(impl, wl.batch, check, [wl.rids[i] for i in watch_idx] if check == "sample" else []):
        before = Clocks.read(impl)
        t0 = time.monotonic()
        rounds: list[int] = []
        while True:
            rounds.append(one_round(p, wl, frames, steps, t0 + max_seconds))
            if time.monotonic() - t0 >= min_seconds or rounds[-1] < steps:
                break
        p.drain()
        g1 = p.sent
        after = Clocks.read(impl)
        lat_rounds: list[int] = []
        if lat_steps:
            p.window = 1
            lat_rounds.append(one_round(p, wl, frames, lat_steps, time.monotonic() + lat_max_seconds))
            p.drain()
    result = figures(impl, wl, p, g1, before, after, rounds, lat_rounds, steps, window)
    result["check"] = check_text(impl, wl, watch_idx, rounds + lat_rounds, check)
    return result


def figures(impl: Impl, wl: Workload, p: Pipeline, g1: int, c0: Clocks, c1: Clocks,
            rounds: list[int], lat_rounds: list[int], steps: int, window: int) -> dict[str, Any]:
    """The figures of a configuration: steps below g1 are the throughput phase's."""
    B, n = wl.batch, wl.n
    tokens = sum(rounds) * B * n
    secs = (p.recv_t[g1 - 1] - p.send_t[0]) / 1e9
    lat, kind = p.lat, p.kind
    impl_ns, mtok = c1.impl_ns - c0.impl_ns, tokens / 1e6
    return dict(
        impl=impl.name, tokenizer=wl.corp.name, batch=B, ids_per_row=n, shards=impl.shards,
        steps=steps, rounds=len(rounds), steps_run=sum(rounds), latency_steps=sum(lat_rounds),
        tokens=tokens, seconds=secs,
        tok_per_s=tokens / secs if secs > 0 else None,
        window=window,
        lat_loaded=lat_stats([lat[g] for g in range(g1) if kind[g] == STEP]),
        lat_idle=lat_stats([lat[g] for g in range(g1, len(lat)) if kind[g] == STEP]),
        first_step_ms=median([lat[g] / 1e6 for g in range(g1) if kind[g] == START]),  # step 0: every stream starts
        finish_step_ms=median([lat[g] / 1e6 for g in range(g1) if kind[g] == FINISH]),
        cpu_s_per_mtok=impl_ns / 1e9 / mtok if tokens else None,
        cpu_s_per_mtok_psutil=(c1.impl_psutil_s - c0.impl_psutil_s) / mtok if tokens else None,
        cpu_util=impl_ns / 1e9 / secs if secs > 0 else None,
        scheduler_cpu_s_per_mtok=(c1.scheduler_ns - c0.scheduler_ns) / 1e9 / mtok if tokens else None,
        worker_cpu_s_per_mtok=(c1.worker_ns - c0.worker_ns) / 1e9 / mtok if tokens else None,
        peak_rss_mb=impl.tree.peak_rss_mb(),
        other_cores=c1.other_cores(c0, secs),
        steal_cores=((c1.steal_ns - c0.steal_ns) / 1e9 / secs) if (c0.steal_ns is not None and c1.steal_ns is not None and secs > 0) else None,
        truncated=rounds[-1] < steps,
    )


def check_text(impl: Impl, wl: Workload, watch_idx: list[int], rounds: list[int], check: str) -> dict:
    """Each watched rid received every round's text, in order, and no error row came."""
    dump = impl.h.dump()
    bad = []
    for i in watch_idx:
        rid = wl.rids[i]
        got = dump["texts"].get(rid, "")
        ref = wl.reference(i, rounds)
        if got != ref:
            j = next((x for x in range(min(len(got), len(ref))) if got[x] != ref[x]), min(len(got), len(ref)))
            bad.append({"rid": rid, "at": j, "got": got[max(0, j - 10):j + 10], "want": ref[max(0, j - 10):j + 10],
                        "len_got": len(got), "len_want": len(ref)})
    return check_record(check, len(watch_idx), len(bad), bad[:3], dump)


def start_impl(name: str, tokenizer: str, h: Harness, args, corp) -> Impl:
    """Launch and wait until it has answered a small warm-up round (64 streams, 8 steps)."""
    impl = Impl(name, tokenizer, h, args)
    wl = Workload(corp, 64, 1, f"warm{name}")
    try:
        if impl.detokd is not None:  # until every shard said READY=1; a baseline is ready once it answers
            impl.detokd.wait_ready(180)
        fr = wl.frames(impl.shards)
        h.configure(64, "off", [])
        p = Pipeline(impl, window=9, stall_s=2.0)
        # Frames sent before a baseline binds wait in the socket: send, then wait.
        one_round(p, wl, fr, 8, float("inf"))
        deadline = time.monotonic() + 180
        while p.next < p.sent:
            if impl.proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({impl.proc.returncode}):\n{impl.log_tail()}")
            try:
                p.drain()
            except Stall:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not answer within 180 s:\n{impl.log_tail()}") from None
        dump = h.dump()
        if dump["n_errors"]:
            sys.stderr.write(f"warning: {name} answered the warm-up with error rows: {dump['errors'][:3]}\n")
    except BaseException:
        impl.stop()
        raise
    impl.tree.refresh()
    return impl
