"""Figures of the runs: statistics, the markdown tables, results.json's ratios, the plots."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Optional

from ..commands import pyplot

IMPLS = ("detokd", "sglang", "decodestream", "naive", "floor")
BASELINES = ("sglang", "decodestream", "naive", "floor")
TOKENIZERS = ("deepseek", "mistral_v3", "qwen2")


def log(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def fmt_rate(x: Optional[float]) -> str:
    if x is None:
        return "–"
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


def pct(values: list[float], q: float) -> Optional[float]:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return None
    v = sorted(values)
    k = max(0, min(len(v) - 1, math.ceil(q / 100 * len(v)) - 1))
    return v[k]


def md_head(*cols: str) -> list[str]:
    """A markdown table's header and separator lines."""
    return ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]


def lat_stats(ns: list[int]) -> Optional[dict]:
    if not ns:
        return None
    ms = [x / 1e6 for x in ns]
    return {"n": len(ms), "p50_ms": pct(ms, 50), "p99_ms": pct(ms, 99), "max_ms": max(ms), "mean_ms": sum(ms) / len(ms)}


def median(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def _index(runs: list[dict]) -> dict:
    return {(r["impl"], r["tokenizer"], r["batch"], r["ids_per_row"]): r for r in runs}


def _ratio(a: Optional[dict], b: Optional[dict], key: str) -> Optional[float]:
    """a[key] / b[key], when both runs exist and measured it."""
    return a[key] / b[key] if a and b and a[key] and b[key] else None


def ratios(runs: list[dict]) -> list[dict]:
    idx = _index(runs)
    out = []
    for (impl, tok, B, n), r in sorted(idx.items(), key=lambda kv: (kv[0][1], kv[0][3], kv[0][2])):
        if impl != "detokd":
            continue
        vs = {b: {"tok_per_s": _ratio(r, o, "tok_per_s"),
                  "cpu_per_token": _ratio(o, r, "cpu_s_per_mtok")}  # > 1: detokd spends less CPU per token
              for b in BASELINES if (o := idx.get((b, tok, B, n)))}
        out.append({"tokenizer": tok, "batch": B, "ids_per_row": n, "vs": vs})
    return out


_LATENCIES = ("idle p50", "idle p99", "idle max", "loaded p50", "loaded p99", "loaded max")


def _f(x, spec=".2f", none="–"):
    return none if x is None else format(x, spec)


def _row(*cells: object) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def _latencies(r: dict) -> list[str]:
    """Idle and loaded p50, p99, max of a run, in ms."""
    return [_f((r.get(phase) or {}).get(k), ".3f")
            for phase in ("lat_idle", "lat_loaded") for k in ("p50_ms", "p99_ms", "max_ms")]


def targets(res: dict) -> list[tuple[str, str, Optional[bool]]]:
    idx = _index(res["runs"])
    d = idx.get(("detokd", "deepseek", 256, 1))
    tps = d["tok_per_s"] if d else None
    out = [("≥ 1,000,000 tok/s through detokd, B=256, 1 id/row, deepseek", f"{fmt_rate(tps)} tok/s",
            None if tps is None else tps >= 1e6)]
    for b, want in (("sglang", 5), ("decodestream", 2)):
        x = _ratio(d, idx.get((b, "deepseek", 256, 1)), "tok_per_s")
        out.append((f"≥ {want}× the {b} baseline (same configuration)", f"{_f(x)}×", None if x is None else x >= want))
    d1024 = idx.get(("detokd", "deepseek", 1024, 1))
    p99 = (d1024.get("lat_idle") or {}).get("p99_ms") if d1024 else None
    out.append(("p99 step latency ≤ 1 ms at B=1024 (deepseek, 1 id/row, one step in flight)", f"{_f(p99, '.3f')} ms",
                None if p99 is None else p99 <= 1.0))
    fl = next((f for f in res.get("flatness", []) if f["impl"] == "detokd" and f["tokenizer"] == "deepseek"), None)
    ff = fl["flatness"] if fl else {}
    x = ff.get("late_ratio")
    txt = "–" if x is None else (
        f"{_f(x)}× ({_f(ff['late_long_us_per_tok'], '.3f')} µs/token at length ≈{ff['late_len']:.0f}, "
        f"{_f(ff['late_short_us_per_tok'], '.3f')} µs at ≈{ff['short_len']:.0f}, measured side by side)")
    out.append((f"per-token CPU at length {fl['steps'] if fl else 32768:,} within 1.1× of length ≈128", txt,
                None if x is None else x <= 1.1))
    c = _ratio(d, idx.get(("floor", "deepseek", 256, 1)), "cpu_s_per_mtok")
    out.append(("within 2× of the floor: detokd's CPU per token ÷ the floor's (B=256, 1 id/row, deepseek)", f"{_f(c)}×",
                None if c is None else c <= 2))
    return out


def report(res: dict, full: bool = True) -> str:
    """Markdown tables of a results dict; full=False leaves out the per-implementation
    latency table (docs/performance.md embeds that shorter form)."""
    runs = res["runs"]
    quiet = res.get("options", {}).get("quiet_cores", 0.2)

    def mark(r) -> str:
        return " †" if (r.get("other_cores") or 0) > quiet else ""

    impls = [i for i in IMPLS if any(r["impl"] == i for r in runs)]
    shards = max((r.get("shards", 1) for r in runs if r["impl"] == "detokd"), default=1)
    keys = sorted({(r["tokenizer"], r["ids_per_row"], r["batch"]) for r in runs},
                  key=lambda k: (TOKENIZERS.index(k[0]) if k[0] in TOKENIZERS else 99, k[0], k[1], k[2]))
    cells = {(r["impl"], r["tokenizer"], r["ids_per_row"], r["batch"]): r for r in runs}  # in the tables' order
    L = _header(res, quiet, sum(1 for r in runs if mark(r)))
    L.append("### Throughput, tokens/s through the whole pipeline\n")
    ratio_cols = [b for b in BASELINES if b in impls] if "detokd" in impls else []
    names = [i if i != "detokd" or shards == 1 else f"detokd --shards {shards}" for i in impls]
    L += md_head("tokenizer", "B", "ids/row", *names, *(f"detokd ÷ {b}" for b in ratio_cols))
    for tok, n, B in keys:
        rates = []
        for i in impls:
            r = cells.get((i, tok, n, B))
            steps = f" ({r.get('steps_run', r['steps'])} steps)" if r and r.get("truncated") else ""
            rates.append(fmt_rate(r["tok_per_s"]) + steps + mark(r) if r else "–")
        d = cells.get(("detokd", tok, n, B))
        vs = (_ratio(d, cells.get((b, tok, n, B)), "tok_per_s") for b in ratio_cols)
        L.append(_row(tok, B, n, *rates, *(f"{_f(x, '.1f')}×" for x in vs)))
    L.append("")
    if "detokd" in impls:
        L.append("### detokd: latency (ms) and cost\n")
        L.append("Idle = one step in flight; loaded = the throughput phase (window "
                 f"{res.get('options', {}).get('window', 2)}); first = step 0, which starts every stream.\n")
        L += md_head("tokenizer", "B", "ids/row", "tok/s", *_LATENCIES, "first", "cpu-s/Mtok", "cores used",
                     "peak RSS MB", "other cores")
        for tok, n, B in keys:
            if r := cells.get(("detokd", tok, n, B)):
                L.append(_row(tok, B, n, fmt_rate(r["tok_per_s"]), *_latencies(r), _f(r.get("first_step_ms")),
                              _f(r.get("cpu_s_per_mtok")), _f(r.get("cpu_util")), _f(r.get("peak_rss_mb"), ".0f"),
                              _f(r.get("other_cores")) + mark(r)))
        L.append("")
    if full:
        L.append("### Step latency (ms): idle = one step in flight, loaded = the throughput phase\n")
        L += md_head("impl", "tokenizer", "B", "ids/row", *_LATENCIES, "first step")
        L += [_row(i, tok, B, n, *_latencies(r), _f(r.get("first_step_ms")))
              for tok, n, B in keys for i in impls if (r := cells.get((i, tok, n, B)))]
        L.append("")
    L.append("### Step latency p99 (ms), idle, every implementation\n")
    L += md_head("tokenizer", "B", "ids/row", *impls)
    for tok, n, B in keys:
        rs = [cells.get((i, tok, n, B)) or {} for i in impls]
        L.append(_row(tok, B, n, *(_f((r.get("lat_idle") or {}).get("p99_ms"), ".3f") for r in rs)))
    L.append("")
    L.append("### Cost: CPU seconds per million tokens and peak RSS of the implementation's process\n")
    L += md_head("tokenizer", "B", "ids/row", *(f"{i} cpu-s/Mtok" for i in impls), *(f"{i} MB" for i in impls))
    for tok, n, B in keys:
        rs = [cells.get((i, tok, n, B)) or {} for i in impls]
        L.append(_row(tok, B, n, *(_f(r.get("cpu_s_per_mtok")) for r in rs),
                      *(_f(r.get("peak_rss_mb"), ".0f") for r in rs)))
    L.append("")
    big = [r for r in runs if r["batch"] >= 64]
    cost = {k: _f(median([r.get(f"{k}_cpu_s_per_mtok") for r in big])) for k in ("scheduler", "worker")}
    L.append(f"Harness cost per million tokens (same for every implementation): scheduler {cost['scheduler']} cpu-s, "
             f"worker {cost['worker']} cpu-s (medians over B ≥ 64).")
    L.append("")
    return "\n".join(L + _flatness_table(res) + _checks(res)) + "\n"


def _header(res: dict, quiet: float, disturbed: int) -> list[str]:
    """How the run was made, and the targets' table."""
    runs, m = res["runs"], res.get("machine", {})
    at = f" at {res['commit']}" if res.get("commit") else ""
    L = [f"Command: `{res['command']}`{at}  ",
         f"Machine: {m.get('cpus')} CPUs ({m.get('cpu', '?')}), {m.get('mem_gb', '?')} GB; "
         f"{res.get('date', '')}; wall time {res.get('wall_seconds', 0):.0f} s  ",
         "Versions: " + ", ".join(f"{k} {v}" for k, v in res.get("versions", {}).items()) + "  ",
         f"Configurations during which other processes of the machine kept more than {quiet} cores busy "
         f"(marked †, after {res.get('options', {}).get('retries', 0)} retry): {disturbed} of {len(runs)}; "
         f"{res.get('quiet_wait_seconds', 0):.0f} s were spent waiting for a quiet machine.", ""]
    if any(r["impl"] == "detokd" for r in runs):
        L += ["### Targets\n", *md_head("target", "measured", "met")]
        L += [_row(name, val, "–" if ok is None else ("yes" if ok else "**no**")) for name, val, ok in targets(res)]
        L.append("")
    return L


def _flatness_table(res: dict) -> list[str]:
    if not res.get("flatness"):
        return []
    L = ["### Flatness: CPU µs per token of long outputs against short ones, measured side by side\n",
         "Medians of the probes in the first and the last eighth of the long run: a step of the long "
         "streams and a step of the short control streams, each alone in the pipeline, back to back "
         "(alternating which goes first).\n"]
    L += md_head("impl", "tokenizer", "B", "length", "probes", "tok/s", "start: long / control µs", "start ratio",
                 "end: long (≈length) / control µs", "**end ratio**", "other cores")
    for r in res["flatness"]:
        fl = r["flatness"]
        L.append(_row(r["impl"], r["tokenizer"], r["batch"], r.get("steps_run", r["steps"]), r.get("probes"),
                      fmt_rate(r["tok_per_s"]), _probes(fl, "early", (fl.get("segments") or [{}])[0].get("short_pos")),
                      f"{_f(fl.get('early_ratio'))}×", _probes(fl, "late", fl.get("short_len")),
                      f"**{_f(fl.get('late_ratio'))}×**", _f(r.get("other_cores"))))
    return L + [""]


def _probes(fl: dict, when: str, short_pos: Optional[float]) -> str:
    """The long and the control streams' µs per token `when` (early, late), at their lengths."""
    return (f"{_f(fl.get(f'{when}_long_us_per_tok'), '.3f')} / {_f(fl.get(f'{when}_short_us_per_tok'), '.3f')} "
            f"(≈{_f(fl.get(f'{when}_len'), '.0f')} / ≈{_f(short_pos, '.0f')})")


def _checks(res: dict) -> list[str]:
    """The text check's verdict, or a table of the runs that failed it; then the failures."""
    every = res["runs"] + res.get("flatness", [])
    bad = [r for r in every if r["check"]["mismatches"] or r["check"]["errors"]]
    L = ["### Text check\n"]
    if not bad:
        checked = sum(r["check"]["streams"] for r in every)
        L.append(f"Every checked stream ({checked} in all) matched the reference decode; no error rows.")
    else:
        L += md_head("impl", "tokenizer", "B", "ids/row", "streams checked", "mismatches", "error rows", "example")
        for r in bad:
            c = r["check"]
            ex = c["examples"][0] if c["examples"] else (c["error_examples"][0] if c["error_examples"] else "")
            L.append(_row(r["impl"], r["tokenizer"], r["batch"], r["ids_per_row"], c["streams"], c["mismatches"],
                          c["errors"], f"`{json.dumps(ex, ensure_ascii=False)[:160]}`"))
    if res.get("failures"):
        L += ["", "### Failures\n", *(f"- {json.dumps(f, ensure_ascii=False)[:400]}" for f in res["failures"])]
    return L


_COLORS = {"detokd": "#d62728", "sglang": "#1f77b4", "decodestream": "#2ca02c", "naive": "#9467bd", "floor": "#7f7f7f"}


def plot(res: dict, out_dir: Path) -> list[Path]:
    plt = pyplot()
    if plt is None:
        log("matplotlib is not installed: no plots (pip install 'detokd[bench]')")
        return []
    from matplotlib.ticker import FuncFormatter, NullFormatter

    runs = res["runs"]
    if not runs:
        return []
    toks = [t for t in TOKENIZERS if any(r["tokenizer"] == t for r in runs)]
    toks += sorted({r["tokenizer"] for r in runs} - set(toks))
    impls = [i for i in IMPLS if any(r["impl"] == i for r in runs)]
    nids = sorted({r["ids_per_row"] for r in runs})
    styles = {n: s for n, s in zip(nids, ("-", "--", ":", "-."), strict=False)}
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    figures = {"throughput": (lambda r: r["tok_per_s"], "tokens/s through the pipeline", 1e6),
               "latency": (lambda r: (r.get("lat_idle") or {}).get("p99_ms"), "p99 step latency, ms (idle)", 1.0)}
    fig, axes = plt.subplots(2, len(toks), figsize=(5.2 * len(toks), 8.5), squeeze=False)
    for col, tok in enumerate(toks):
        for ax, (value, title, line) in zip((axes[0][col], axes[1][col]), figures.values(), strict=True):
            for i, n in ((i, n) for i in impls for n in nids):
                pts = sorted((r["batch"], r) for r in runs
                             if r["impl"] == i and r["tokenizer"] == tok and r["ids_per_row"] == n)
                if pts:
                    ax.plot([b for b, _ in pts], [value(r) or float("nan") for _, r in pts], styles[n], marker="o",
                            color=_COLORS.get(i), label=f"{i}, {n} id/row")
            ax.set(xscale="log", yscale="log", title=f"{tok}: {title}", xlabel="concurrent streams B")
            if line == 1.0:
                ax.yaxis.set_major_formatter(plain)
                ax.yaxis.set_minor_formatter(NullFormatter())
            ax.axhline(line, color="k", lw=0.6, ls=":")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    cpus = res.get("machine", {}).get("cpus", "?")
    fig.suptitle(f"detokd benchmark ({cpus} cores shared by scheduler, detokenizer, worker)", fontsize=10)
    paths = [_save(plt, fig, out_dir / "throughput.png")]
    if res.get("flatness"):
        fig, ax = plt.subplots(figsize=(10, 4.8))
        for r in res["flatness"]:
            if c := r["flatness"].get("segments") or []:
                col, xs = _COLORS.get(r["impl"]), [x["long_pos"] for x in c]
                ax.plot(xs, [x["long_us_per_tok"] for x in c], "-o", color=col, label=f"{r['impl']}: long streams")
                ax.plot(xs, [x["short_us_per_tok"] for x in c], ":", color=col,
                        label=f"{r['impl']}: control (length ≤ {r.get('short_len')})")
        ax.set(yscale="log", xlabel="output length of the long streams (tokens)",
               ylabel="CPU µs per token (median of probes)",
               title="Per-token cost along long outputs, with a short-stream control measured alongside")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "2345" else ""))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        paths.append(_save(plt, fig, out_dir / "flatness.png"))
    return paths


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
