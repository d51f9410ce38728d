"""`python -m detokbench fuzz`: the command line, the run, the printed summary."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..commands import command_line
from . import __doc__ as DOC
from .run import run


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m detokbench fuzz", description=DOC.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=100_000, help="frames to send (default 100,000)")
    ap.add_argument("--seed", type=int, default=20250101)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--warmup", type=float, default=0.05, help="share of the frames before the first RSS sample")
    ap.add_argument("--rss-tolerance", type=float, default=0.10, help="end RSS may be this much above the post-warm-up RSS")
    ap.add_argument("--deadline", type=float, default=1800, help="seconds: the run fails if it has not finished by then")
    ap.add_argument("--json", type=Path, help="write the results here")
    return ap.parse_args(argv)


def summary(res: dict) -> str:
    r, m, h = res["rss_kb"], res["metrics"], res["honest"]
    return "\n".join([
        f"{res['frames']} frames in {res['wall_s']} s (seed {res['seed']}): {res['frames_read_by_detokd']} read by detokd, "
        f"{res['bad_frames_sent']} bad; by kind: {res['frames_by_kind']}",
        f"honest: {h['exact']}/{h['requests']} requests exact ({h['ids']} ids, {h['flushes']} flushes)",
        f"RSS kB: after warm-up {r['after_warmup']}, end {r['end']}, peak {r['peak_hwm']}, growth {r['growth']}",
        f"detokd: frames {m.get('detokd_frames_total')}, bad frames {m.get('detokd_bad_frames_total')}, "
        f"errors {m.get('detokd_errors_total')}, memory entries {m.get('detokd_memory_entries')}, bytes {m.get('detokd_memory_bytes')}, "
        f"log lines {res['log_lines']}",
    ])


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    res = run(args, command_line("fuzz", argv))
    print(summary(res))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    for p in res["problems"]:
        print("FAIL:", p)
    print("OK" if res["ok"] else "FAILED")
    return 0 if res["ok"] else 1
