"""The measured runs: one configuration, and the flatness run, through one implementation.

    scheduler (this process) --tokens--> implementation --text--> worker (worker.py)
         ^                                                          |
         +---------------------- ack of each whole step ------------+

Flow control: at most `window` steps are in flight (sent, not yet acked); step k
goes once step k-window is acked, so the pipeline runs as fast as it absorbs without
an unbounded queue that would turn latency into a measure of the queue length. A
second phase sends one step at a time: the per-step latency of an idle pipeline.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from typing import Any

from .harness import Impl
from ..proc import machine_busy_ns, steal_ns
from .report import fmt_rate, lat_stats, log, median
from .worker import ACK_STEP
from .workload import Workload, step_values


class Progress:
    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.i = total, 0
        self.tty = sys.stderr.isatty() and not quiet
        self.quiet = quiet
        self.last = 0.0
        self.t0 = time.monotonic()
        self.label = ""
        self.width = 0

    def begin(self, label: str) -> None:
        self.i += 1
        self.label = label
        self.last = 0.0

    def update(self, text: str, force: bool = False) -> None:
        if not self.tty:
            return
        t = time.monotonic()
        if not force and t - self.last < 0.2:
            return
        self.last = t
        line = f"[{self.i}/{self.total} {t - self.t0:5.0f}s] {self.label}  {text}"
        cols = 160
        try:
            cols = os.get_terminal_size(sys.stderr.fileno()).columns - 1
        except OSError:
            pass
        line = line[:cols]
        sys.stderr.write("\r" + line + " " * max(0, self.width - len(line)))
        sys.stderr.flush()
        self.width = len(line)

    def done(self, text: str) -> None:
        if self.tty:
            self.update(text, force=True)
        elif not self.quiet:
            log(f"[{self.i}/{self.total} {time.monotonic() - self.t0:5.0f}s] {self.label}  {text}")

    def close(self) -> None:
        if self.tty and self.width:
            sys.stderr.write("\r" + " " * self.width + "\r")
            sys.stderr.flush()


_START, _STEP, _FINISH = 0, 1, 2


def run_config(impl: Impl, wl: Workload, *, steps: int, min_seconds: float, max_seconds: float,
               lat_steps: int, lat_max_seconds: float, window: int, check: str,
               progress: Progress) -> dict:
    """One configuration through one implementation.

    Throughput phase: rounds of `steps` steps (every stream starts, runs `steps` steps,
    finishes), `window` steps in flight, until `min_seconds` have passed (at least one
    round; a round is cut short after `max_seconds`). Latency phase: one round of
    `lat_steps` steps, one step in flight. Each round ends with a step of finishing rows."""
    h = impl.h
    B, n = wl.batch, wl.n
    shards = impl.shards
    fr = wl.frames(shards)
    start_p, finish_p, cyc = fr["start"], fr["finish"], fr["cyc"]
    P = len(cyc)
    socks = impl.socks
    sock0 = socks[0]
    single = shards == 1
    if check == "sample":
        watch_idx = sorted({0, B - 1, B // 2, B // 3, (2 * B) // 3, B // 7})
    elif check == "all":
        watch_idx = list(range(B))
    else:
        watch_idx = []
    h.configure(B, check, [wl.rids[i] for i in watch_idx] if check == "sample" else [])

    enc = h.enc
    now = time.monotonic_ns
    kind: list[int] = []
    send_t: list[int] = []
    recv_t: list[int] = []
    lat: list[int] = []
    done = bytearray()
    impl.tree.refresh()
    impl.tree.reset_peak()
    state = {"next": 0}  # lowest step not yet acked
    stall_s = max(30.0, max_seconds * 4)

    def take_ack(timeout: float) -> None:
        a = h.recv_ack(timeout)
        if a[0] != ACK_STEP:
            return
        _, s, t_recv, l = a
        if s >= len(done) or done[s]:
            return
        done[s] = 1
        lat[s] = l
        recv_t[s] = t_recv
        nx = state["next"]
        while nx < len(done) and done[nx]:
            nx += 1
        state["next"] = nx

    def send(step: list, seq: int, k: int) -> None:
        while len(done) - state["next"] >= win[0]:
            take_ack(stall_s)
        t = now()
        sb, mb = step_values(seq, (len(send_t), t))
        send_t.append(t)
        recv_t.append(0)
        lat.append(0)
        done.append(0)
        kind.append(k)
        if single:
            sock0.send(step[0][1].fill(sb, mb))
        else:
            for s, tmpl in step:
                socks[s].send(tmpl.fill(sb, mb))

    win = [window]

    def one_round(nsteps: int, t_cap: float, label: str) -> int:
        """Returns the steps the round ran (it stops early past t_cap)."""
        g0 = len(send_t)
        j = 0
        while j < nsteps:
            send(start_p if j == 0 else cyc[j % P], j * n, _START if j == 0 else _STEP)
            j += 1
            if (j & 15) == 0:
                tm = time.monotonic()
                if tm > t_cap:
                    break
                if progress.tty and tm - progress.last > 0.2:
                    el = (now() - send_t[g0]) / 1e9
                    progress.update(f"{label} step {j}/{nsteps}  {fmt_rate(j * B * n / el if el > 0 else 0)} tok/s")
        send(finish_p, j * n, _FINISH)
        return j

    def drain() -> None:
        while state["next"] < len(done):
            take_ack(stall_s)

    gc_was = gc.isenabled()
    gc.disable()
    try:
        c0 = impl.tree.cpu_ns()
        p0 = impl.tree.cpu_psutil()
        s0 = h.self_tree.cpu_ns()
        w0 = h.worker_tree.cpu_ns()
        m0 = machine_busy_ns()
        st0 = steal_ns()
        t0 = time.monotonic()
        rounds: list[int] = []
        while True:
            rounds.append(one_round(steps, t0 + max_seconds, "throughput"))
            if time.monotonic() - t0 >= min_seconds or rounds[-1] < steps:
                break
        drain()
        g1 = len(send_t)
        c1 = impl.tree.cpu_ns()
        p1 = impl.tree.cpu_psutil()
        s1 = h.self_tree.cpu_ns()
        w1 = h.worker_tree.cpu_ns()
        m1 = machine_busy_ns()
        st1 = steal_ns()
        lat_rounds: list[int] = []
        if lat_steps:
            win[0] = 1
            lat_rounds.append(one_round(lat_steps, time.monotonic() + lat_max_seconds, "latency"))
            drain()
    finally:
        if gc_was:
            gc.enable()

    tokens = sum(rounds) * B * n
    secs = (recv_t[g1 - 1] - send_t[0]) / 1e9
    tput_lat = [lat[g] for g in range(g1) if kind[g] == _STEP]
    idle_lat = [lat[g] for g in range(g1, len(lat)) if kind[g] == _STEP]
    start_lat = [lat[g] / 1e6 for g in range(g1) if kind[g] == _START]
    finish_lat = [lat[g] / 1e6 for g in range(g1) if kind[g] == _FINISH]
    result: dict[str, Any] = dict(
        impl=impl.name, tokenizer=wl.corp.name, batch=B, ids_per_row=n, shards=shards,
        steps=steps, rounds=len(rounds), steps_run=sum(rounds), latency_steps=sum(lat_rounds),
        tokens=tokens, seconds=secs,
        tok_per_s=tokens / secs if secs > 0 else None,
        window=window,
        lat_loaded=lat_stats(tput_lat),
        lat_idle=lat_stats(idle_lat),
        first_step_ms=median(start_lat),  # step 0: every stream starts
        finish_step_ms=median(finish_lat),
        cpu_s_per_mtok=(c1 - c0) / 1e9 / tokens * 1e6 if tokens else None,
        cpu_s_per_mtok_psutil=(p1 - p0) / tokens * 1e6 if tokens else None,
        cpu_util=(c1 - c0) / 1e9 / secs if secs > 0 else None,
        scheduler_cpu_s_per_mtok=(s1 - s0) / 1e9 / tokens * 1e6 if tokens else None,
        worker_cpu_s_per_mtok=(w1 - w0) / 1e9 / tokens * 1e6 if tokens else None,
        peak_rss_mb=impl.tree.peak_rss_mb(),
        # Cores kept busy by processes outside the benchmark (another test run, ...)
        # during the throughput phase: should be ~0 for the figures to mean anything.
        other_cores=(max(0, (m1 - m0) - (c1 - c0) - (s1 - s0) - (w1 - w0)) / 1e9 / secs)
        if (m0 is not None and m1 is not None and secs > 0) else None,
        steal_cores=((st1 - st0) / 1e9 / secs) if (st0 is not None and st1 is not None and secs > 0) else None,
        truncated=rounds[-1] < steps,
    )
    # Check the text: each watched rid received every round's text, in order.
    dump = h.dump()
    bad = []
    for i in watch_idx:
        rid = wl.rids[i]
        got = dump["texts"].get(rid, "")
        ref = wl.reference(i, rounds + lat_rounds)
        if got != ref:
            j = next((x for x in range(min(len(got), len(ref))) if got[x] != ref[x]), min(len(got), len(ref)))
            bad.append({"rid": rid, "at": j, "got": got[max(0, j - 10):j + 10], "want": ref[max(0, j - 10):j + 10],
                        "len_got": len(got), "len_want": len(ref)})
    result["check"] = {
        "mode": check, "streams": len(watch_idx), "mismatches": len(bad), "examples": bad[:3],
        "errors": dump["n_errors"], "error_examples": dump["errors"][:5], "bad_frames": dump["bad_frames"],
    }
    return result


def run_flatness(impl: Impl, wl_long: Workload, wl_short: Workload, *, steps: int, probe_every: int,
                 short_len: int, window: int, max_seconds: float, check: str, progress: Progress,
                 segments: int = 8) -> dict:
    """Per-token cost at output length ~`steps` against ~`short_len`/2, drift-free.

    B long streams run `steps` steps (window `window`). Every `probe_every` steps the
    pipeline is drained and two steps go through it alone, back to back (in alternating
    order): one of the long streams and one of B short streams (a control set that
    restarts every `short_len` steps, so its rows sit at output positions 1..short_len,
    mean ≈ short_len/2). The
    implementation's CPU time is read around each of the two: both costs are measured
    within a millisecond of each other, so the machine's own drift (a VM's speed moves
    by ±20% over seconds here) cancels in their ratio."""
    h = impl.h
    B, n = wl_long.batch, wl_long.n
    assert wl_short.batch == B and wl_short.n == n
    shards = impl.shards
    L, S = wl_long.frames(shards), wl_short.frames(shards)
    socks, sock0, single = impl.socks, impl.socks[0], shards == 1
    watch_idx = sorted({0, B - 1, B // 2}) if check != "off" else []
    watch = [wl_long.rids[i] for i in watch_idx] + [wl_short.rids[i] for i in watch_idx]
    h.configure(B, "sample" if watch else "off", watch)
    now = time.monotonic_ns
    cpu = impl.tree.cpu_ns
    impl.tree.refresh()
    impl.tree.reset_peak()
    sent = [0]
    acked = [0]
    stall_s = 60.0

    def take_ack() -> None:
        a = h.recv_ack(stall_s)
        if a[0] == ACK_STEP:
            acked[0] += 1  # steps complete in order; only their count matters here

    def send(step: list, seq: int, win: int) -> None:
        while sent[0] - acked[0] >= win:
            take_ack()
        t = now()
        sb, mb = step_values(seq, (sent[0], t))
        sent[0] += 1
        if single:
            sock0.send(step[0][1].fill(sb, mb))
        else:
            for s, tmpl in step:
                socks[s].send(tmpl.fill(sb, mb))

    def drain() -> None:
        while acked[0] < sent[0]:
            take_ack()

    probes: list[list] = []  # [long position, long ns, short position, short ns, machine-other ns, wall ns]
    short_rounds: list[int] = []
    sp = [0]  # the short set's next step in its round
    # Between two probes the control set moves on by `stride` steps, so that every
    # stretch of the long run samples it over a whole round (mean position short_len/2).
    stride = max(1, round(short_len * segments * probe_every / max(1, steps)))

    def short_step(win: int) -> None:
        k = sp[0]
        send(S["start"] if k == 0 else S["cyc"][k % len(S["cyc"])], k * n, win)
        sp[0] = k + 1
        if sp[0] >= short_len:
            send(S["finish"], sp[0] * n, win)
            short_rounds.append(sp[0])
            sp[0] = 0
    gc_was = gc.isenabled()
    gc.disable()
    t0 = time.monotonic()
    c_start, t_start = cpu(), now()
    m_start = machine_busy_ns()
    h_start = h.self_tree.cpu_ns() + h.worker_tree.cpu_ns()
    try:
        j = 0
        while j < steps:
            lp = L["start"] if j == 0 else L["cyc"][j % len(L["cyc"])]
            if j and j % probe_every == 0:
                for _ in range(stride - 1):
                    short_step(window)
                if sp[0] == 0:  # a start step is not measured
                    short_step(window)
                drain()
                pos = sp[0]
                sp_step = S["cyc"][pos % len(S["cyc"])]
                long_first = len(probes) % 2 == 0  # alternate, so the order's own effect cancels
                m0, w0 = machine_busy_ns(), now()
                hc0 = h.self_tree.cpu_ns() + h.worker_tree.cpu_ns()
                c0 = cpu()
                if long_first:
                    send(lp, j * n, 1)
                else:
                    send(sp_step, pos * n, 1)
                drain()
                c1 = cpu()
                if long_first:
                    send(sp_step, pos * n, 1)
                else:
                    send(lp, j * n, 1)
                drain()
                c2 = cpu()
                hc1 = h.self_tree.cpu_ns() + h.worker_tree.cpu_ns()
                m1, w1 = machine_busy_ns(), now()
                lc, sc = (c1 - c0, c2 - c1) if long_first else (c2 - c1, c1 - c0)
                probes.append([j, lc, pos, sc, (m1 or 0) - (m0 or 0) - (c2 - c0) - (hc1 - hc0), w1 - w0])
                sp[0] = pos + 1
                if sp[0] >= short_len:
                    send(S["finish"], sp[0] * n, window)
                    short_rounds.append(sp[0])
                    sp[0] = 0
            else:
                send(lp, j * n, window)
            j += 1
            if (j & 63) == 0:
                tm = time.monotonic()
                if tm - t0 > max_seconds:
                    break
                if progress.tty and tm - progress.last > 0.2:
                    el = (now() - t_start) / 1e9
                    progress.update(f"flatness step {j}/{steps}  {fmt_rate(j * B * n / el if el > 0 else 0)} tok/s  {len(probes)} probes")
        send(L["finish"], j * n, window)
        if sp[0]:
            send(S["finish"], sp[0] * n, window)
            short_rounds.append(sp[0])
        drain()
    finally:
        if gc_was:
            gc.enable()
    secs = (now() - t_start) / 1e9
    tokens = (j + sum(short_rounds)) * B * n
    c_end = cpu()
    m_end = machine_busy_ns()
    h_end = h.self_tree.cpu_ns() + h.worker_tree.cpu_ns()
    summary = flatness_summary(probes, B * n, j, segments)
    result: dict[str, Any] = dict(
        impl=impl.name, tokenizer=wl_long.corp.name, batch=B, ids_per_row=n, shards=shards,
        steps=steps, steps_run=j, probes=len(probes), probe_every=probe_every, short_len=short_len, short_stride=stride,
        tokens=tokens, seconds=secs, tok_per_s=tokens / secs if secs > 0 else None,
        cpu_s_per_mtok=(c_end - c_start) / 1e9 / tokens * 1e6 if tokens else None,
        peak_rss_mb=impl.tree.peak_rss_mb(),
        other_cores=(max(0, (m_end - m_start) - (c_end - c_start) - (h_end - h_start)) / 1e9 / secs)
        if (m_start and m_end and secs) else None,
        flatness=summary, probe_data=probes,
    )
    dump = h.dump()
    bad = 0
    for i in watch_idx:
        if dump["texts"].get(wl_long.rids[i], "") != wl_long.reference(i, [j]):
            bad += 1
        if dump["texts"].get(wl_short.rids[i], "") != wl_short.reference(i, short_rounds):
            bad += 1
    result["check"] = {"mode": "sample" if watch else "off", "streams": len(watch), "mismatches": bad,
                       "examples": [], "errors": dump["n_errors"], "error_examples": dump["errors"][:5],
                       "bad_frames": dump["bad_frames"]}
    return result


def flatness_summary(probes: list, tokens_per_step: int, length: int, segments: int) -> dict:
    """Probe costs in `segments` stretches of the long run: medians of the long and the
    short (control) steps' µs/token, and their ratio. The first stretch has both sets at
    similar lengths (ratio ≈ 1 unless the two sets differ); the last one compares
    output length ≈`length` with the control's ≈short_len/2."""
    if not probes:
        return {"segments": []}
    seg_len = max(1, length // segments)
    out = []
    for k in range(segments):
        ps = [p for p in probes if k * seg_len <= p[0] < (k + 1) * seg_len]
        if not ps:
            continue
        lu = median([p[1] / 1e3 / tokens_per_step for p in ps])
        su = median([p[3] / 1e3 / tokens_per_step for p in ps])
        out.append({
            "long_pos": median([p[0] for p in ps]), "short_pos": sum(p[2] for p in ps) / len(ps),
            "long_us_per_tok": lu, "short_us_per_tok": su, "ratio": lu / su if su else None,
            "probes": len(ps), "other_cores": sum(p[4] for p in ps) / max(1, sum(p[5] for p in ps)),
        })
    first, last = out[0], out[-1]
    return {
        "segments": out,
        "early_len": first["long_pos"], "late_len": last["long_pos"], "short_len": last["short_pos"],
        "early_ratio": first["ratio"], "late_ratio": last["ratio"],
        "late_long_us_per_tok": last["long_us_per_tok"], "late_short_us_per_tok": last["short_us_per_tok"],
        "early_long_us_per_tok": first["long_us_per_tok"], "early_short_us_per_tok": first["short_us_per_tok"],
    }
