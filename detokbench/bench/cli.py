"""`python -m detokbench bench`: every implementation (detokd and the baselines) on the same
streams, one after the other, for each configuration; then the flatness run. results.json,
table.md, summary.md and the plots go to --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from detokrig import ROOT
from detokrig.proc import QuietWait

from ..commands import header
from .flatness import run_flatness
from .harness import Harness, Impl, Stall
from .report import IMPLS, TOKENIZERS, fmt_rate, log, plot, ratios, report
from .runs import run_config, start_impl
from .workload import Corpus, Workload


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m detokbench bench",
        description="End-to-end detokenizer benchmark: scheduler -> implementation -> worker processes over ipc:// ZMQ.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="a smoke run of a few seconds per implementation (deepseek, B 1 and 64, short streams, every stream checked); writes to a temp folder unless --out is given")
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma list of implementations: " + ", ".join(IMPLS))
    ap.add_argument("--tokenizers", default=",".join(TOKENIZERS), help="comma list of zoo names or tokenizer folders")
    ap.add_argument("--batch", "-B", default="1,64,256,1024", help="comma list of concurrent streams B")
    ap.add_argument("--ids-per-row", default="1,4", help="comma list: new ids per row per step (4 = speculative decoding)")
    ap.add_argument("--steps", type=int, default=1000, help="output length: steps of one round of the throughput phase (window --window)")
    ap.add_argument("--min-seconds", type=float, default=1.0, help="the throughput phase repeats rounds (new requests on the same rids) until this long")
    ap.add_argument("--latency-steps", type=int, default=300, help="steps of the idle-latency phase (one step in flight)")
    ap.add_argument("--window", type=int, default=2, help="steps in flight in the throughput phase")
    ap.add_argument("--max-seconds", type=float, default=2.0, help="cap on the throughput phase of one configuration (slow baselines run fewer steps)")
    ap.add_argument("--latency-max-seconds", type=float, default=1.0, help="cap on the idle-latency phase of one configuration")
    ap.add_argument("--long-steps", type=int, default=32768, help="flatness run: output length (0: no flatness run)")
    ap.add_argument("--long-batch", type=int, default=64, help="flatness run: streams")
    ap.add_argument("--probe-every", type=int, default=64, help="flatness run: steps between two probes (a long-stream step and a short-stream step measured alone, back to back)")
    ap.add_argument("--short-len", type=int, default=256, help="flatness run: output length of the short control streams (their mean position is half of it)")
    ap.add_argument("--long-impls", default="detokd,sglang,decodestream,floor", help="flatness run: implementations (naive is quadratic)")
    ap.add_argument("--long-tokenizers", default="deepseek", help="flatness run: tokenizers")
    ap.add_argument("--long-max-seconds", type=float, default=90.0, help="flatness run: cap per implementation")
    ap.add_argument("--check", choices=("off", "sample", "all"), default="sample", help="compare streamed text with the reference decode: off, a few streams per configuration, or all")
    ap.add_argument("--quiet-cores", type=float, default=0.2, help="a run during which other processes kept more cores than this busy is disturbed: it is retried, and the flatness run ignores such windows")
    ap.add_argument("--retries", type=int, default=1, help="extra attempts of a disturbed configuration (the least disturbed one is kept)")
    ap.add_argument("--quiet-wait", type=float, default=10.0, help="seconds to wait, before each configuration, for other processes to leave the cores idle")
    ap.add_argument("--shards", type=int, default=1, help="detokd only: `serve --shards N`, rows routed by crc32(rid) %% N to <input>.<i>")
    ap.add_argument("--max-states", type=int, default=0, help="detokd only: pass --max-states N (0: its default)")
    ap.add_argument("--detokd-cmd", default="", help="command that starts detokd's server, instead of `python -m detokd serve` of this checkout (e.g. \"env -C /other/tree python -m detokd serve\"; not PYTHONPATH alone: it runs in this checkout, which `-m` puts first)")
    ap.add_argument("--out", default=None, help="folder for results.json, table.md and the plots (default docs/bench, or a temp folder with --quick)")
    ap.add_argument("--no-plot", action="store_true", help="do not draw the plots")
    ap.add_argument("--quiet", "-q", action="store_true", help="no line per result on stderr")
    ap.add_argument("--report", metavar="RESULTS_JSON", help="only print the markdown tables of a results.json (and redraw its plots)")
    ap.add_argument("--summary", action="store_true", help="with --report: the shorter tables of docs/performance.md")
    args = ap.parse_args(argv)
    if args.quick:
        d = ap.parse_args([])
        for name, val in (("tokenizers", "deepseek"), ("batch", "1,64"), ("steps", 200), ("latency_steps", 50),
                          ("long_steps", 2048), ("probe_every", 16), ("check", "all"), ("max_seconds", 1.0), ("min_seconds", 0.2),
                          ("quiet_wait", 0.0), ("retries", 0)):
            if getattr(args, name) == getattr(d, name):
                setattr(args, name, val)
    return args


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


class Bench:
    """One run: what it measures (from the options), the harness, the implementations of
    the tokenizer at hand, the results (saved to results.json after every configuration)."""

    def __init__(self, args, argv: list[str]) -> None:
        self.args = args
        self.impls = _csv(args.impls)
        for i in self.impls:
            if i not in IMPLS:
                raise SystemExit(f"unknown implementation {i!r}; known: {', '.join(IMPLS)}")
        self.toks = _csv(args.tokenizers)
        self.batches = [int(x) for x in _csv(args.batch)]
        self.nids = [int(x) for x in _csv(args.ids_per_row)]  # ids per row
        self.long_impls = [i for i in _csv(args.long_impls) if i in self.impls] if args.long_steps else []
        self.long_toks = [t for t in _csv(args.long_tokenizers) if t in self.toks] if args.long_steps else []
        self.out_dir = Path(args.out) if args.out else (
            Path(tempfile.mkdtemp(prefix="detokd-bench-quick-")) if args.quick else ROOT / "docs" / "bench")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, Any] = {
            **header("bench", argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "options": {k: v for k, v in vars(args).items() if k != "report"},
            "runs": [], "flatness": [], "failures": [],
        }
        self.quiet = QuietWait()
        self.tmp = Path(tempfile.mkdtemp(prefix="detokd-bench-"))
        self.h = Harness(self.tmp)
        self.running: dict[str, Impl] = {}
        self.t_start = time.monotonic()

    def save(self) -> None:
        self.results["wall_seconds"] = time.monotonic() - self.t_start
        self.results["ratios"] = ratios(self.results["runs"])
        self.results["quiet_wait_seconds"] = self.quiet.waited
        (self.out_dir / "results.json").write_text(json.dumps(self.results, indent=1))

    def say(self, line: str) -> None:
        if not self.args.quiet:
            log(line)

    def fail(self, impl: Impl | None, error: Exception, where: str, /, **record) -> None:
        log(f"{where}: {error}" + (f"\n{impl.log_tail()}" if impl is not None else ""))
        self.results["failures"].append({**record, "error": str(error)})

    def start(self, name: str, tok: str, corp: Corpus) -> None:
        try:
            self.running[name] = start_impl(name, tok, self.h, self.args, corp)
        except Exception as e:
            self.fail(None, e, f"{name} ({tok}) failed to start", impl=name, tokenizer=tok)

    def tokenizer(self, tok: str) -> None:
        """Every configuration of one tokenizer through every implementation, then its
        flatness run."""
        corp = Corpus(tok)
        self.running = {}
        for name in self.impls:
            self.start(name, tok, corp)
        for cid, (n, B) in enumerate(((n, B) for n in self.nids for B in self.batches), 1):
            self.configuration(tok, corp, B, n, f"c{cid}")
            self.save()
        if tok in self.long_toks:
            self.flatness(tok, corp)
            self.save()
        for impl in self.running.values():
            impl.stop()

    def configuration(self, tok: str, corp: Corpus, B: int, n: int, tag: str) -> None:
        wl = Workload(corp, B, n, tag)
        for name in self.impls:
            impl = self.running.get(name)
            if impl is None:
                continue
            try:
                r = self.measure(impl, wl)
            except (Stall, RuntimeError) as e:
                self.fail(impl, e, f"{name} {tok} B={B} n={n}", impl=name, tokenizer=tok, batch=B, ids_per_row=n)
                impl.stop()
                self.running.pop(name, None)
                self.start(name, tok, corp)  # the next configuration gets a fresh one
                continue
            self.results["runs"].append(r)
            chk = r["check"]
            flag = "" if not (chk["mismatches"] or chk["errors"]) else f"  CHECK: {chk['mismatches']} mismatches, {chk['errors']} errors"
            il = r["lat_idle"] or r["lat_loaded"] or {}
            self.say(f"{name:<12} {tok} B={B} ids/row={n}  {fmt_rate(r['tok_per_s'])} tok/s  "
                     f"p99 {il.get('p99_ms', float('nan')):.2f} ms  {r['cpu_s_per_mtok'] or 0:.2f} cpu-s/Mtok{flag}")

    def measure(self, impl: Impl, wl: Workload) -> dict:
        """One configuration, retried while other processes disturbed it (the least
        disturbed attempt is kept)."""
        args, r = self.args, None
        for attempt in range(1 + max(0, args.retries)):
            self.quiet(args.quiet_cores, args.quiet_wait, self.say)
            ri = run_config(impl, wl, steps=args.steps, min_seconds=args.min_seconds,
                            max_seconds=args.max_seconds, lat_steps=args.latency_steps,
                            lat_max_seconds=args.latency_max_seconds, window=args.window,
                            check=args.check)
            ri["attempt"] = attempt + 1
            if r is None or (ri["other_cores"] or 0) < (r["other_cores"] or 0):
                r = ri
            if (ri["other_cores"] or 0) <= args.quiet_cores:
                break
        return r

    def flatness(self, tok: str, corp: Corpus) -> None:
        args = self.args
        wl = Workload(corp, args.long_batch, 1, "long")
        wl_short = Workload(corp, args.long_batch, 1, "short")
        for name in self.long_impls:
            impl = self.running.get(name)
            if impl is None:
                continue
            try:
                self.quiet(args.quiet_cores, args.quiet_wait, self.say)
                r = run_flatness(impl, wl, wl_short, steps=args.long_steps, probe_every=args.probe_every,
                                 short_len=args.short_len, window=args.window,
                                 max_seconds=args.long_max_seconds, check=args.check)
            except (Stall, RuntimeError) as e:
                self.fail(impl, e, f"{name} {tok} flatness", impl=name, tokenizer=tok, flatness=True)
                continue
            fl = r["flatness"]
            self.results["flatness"].append(r)
            self.say(f"{name:<12} {tok} flatness B={args.long_batch} length {args.long_steps}  "
                     f"{fmt_rate(r['tok_per_s'])} tok/s  µs/token at {fl.get('late_len', 0):.0f}: "
                     f"{fl.get('late_long_us_per_tok', 0):.3f}, control at {fl.get('short_len', 0):.0f}: "
                     f"{fl.get('late_short_us_per_tok', 0):.3f} ({fl.get('late_ratio') or 0:.2f}×)")

    def run(self) -> int:
        """Every tokenizer, then the report; an interrupt ends the run early, saving what ran."""
        try:
            for tok in self.toks:
                self.tokenizer(tok)
        except KeyboardInterrupt:
            log("interrupted: saving what ran")
        finally:
            for impl in list(self.running.values()):
                impl.stop()
            self.h.close()
            self.save()
            shutil.rmtree(self.tmp, ignore_errors=True)
        print(f"results: {self.out_dir / 'results.json'}  ({self.results['wall_seconds']:.0f} s, "
              f"{self.quiet.waited:.0f} s of it waiting for other processes)")
        write_report(self.results, self.out_dir, self.args.no_plot)
        return 1 if self.results["failures"] else 0


def write_report(results: dict, out_dir: Path, no_plot: bool, full: bool = True, tables: bool = True) -> None:
    """Print a run's markdown tables (`tables`: write table.md and summary.md too), draw its plots."""
    md = report(results, full=full)
    if tables:
        (out_dir / "table.md").write_text(md)
        (out_dir / "summary.md").write_text(report(results, full=False))
    print(md)
    if not no_plot:
        for p in plot(results, out_dir):
            print(f"plot: {p}")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.report:
        path = Path(args.report)
        write_report(json.loads(path.read_text()), path.parent, args.no_plot, full=not args.summary, tables=False)
        return 0

    def on_term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    return Bench(args, argv).run()
