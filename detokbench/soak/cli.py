"""`python -m detokbench soak`: the command line."""

from __future__ import annotations

import argparse
import math

from .. import ROOT
from ..commands import command_line
from .run import run


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m detokbench soak",
        description="Soak a real detokd: millions of tokens, request churn (random lengths, aborts, "
        "abandoned requests that only eviction frees), RSS and live requests sampled over time; "
        "writes JSON and a PNG to docs/soak/ and says whether RSS ended flat.",
        epilog="Exit status 0: RSS flat, every checked text exact, every finished request ended right.",
    )
    ap.add_argument("--quick", action="store_true", help="a short run (~1.4M tokens over 10k requests, seconds)")
    ap.add_argument("--requests", type=int, default=1_000_000, help="requests in all (default 1000000: ~135M tokens)")
    ap.add_argument("--max-len", type=int, default=1000, help="output lengths are log-uniform in [1, max-len] (default 1000)")
    ap.add_argument("--len-scale", type=float, default=1.0, help="multiply every length by this")
    ap.add_argument("--max-delta", type=int, default=16, help="ids per row: uniform in [1, max-delta] (default 16)")
    ap.add_argument("--concurrency", type=int, default=256, help="requests going at once (default 256)")
    ap.add_argument("--abort", type=float, default=0.08, help="fraction of requests aborted midway (default 0.08)")
    ap.add_argument("--abandon", type=float, default=0.05, help="fraction never finished nor aborted (default 0.05)")
    ap.add_argument("--max-states", type=int, default=2048, help="detokd's --max-states (default 2048)")
    ap.add_argument("--workers", type=int, default=2, help="worker addresses (default 2)")
    ap.add_argument("--check-every", type=int, default=50, help="check the text of every n-th request, when it finishes (default 50)")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between RSS samples (default 1)")
    ap.add_argument("--flat-threshold", type=float, default=0.02, help="RSS growth over the last quarter that still counts as flat (default 0.02)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "docs" / "soak"), help="folder for soak.json and soak.png (default docs/soak)")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests = min(args.requests, 10_000)
        args.interval = min(args.interval, 0.1)
        args.max_states = min(args.max_states, 512)
    # log-uniform in [1, M] has mean (M - 1) / ln M
    mean = (args.max_len - 1) / math.log(args.max_len) * args.len_scale
    args.tokens = int(mean * args.requests)  # roughly, before aborts cut some short
    return args


def main(argv: list[str]) -> int:
    return run(parse_args(argv), command_line("soak", argv))
