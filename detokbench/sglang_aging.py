"""Does detokd in SGLang mode slow down as it ages?

A sidecar runs for days. This sends the same stream as sglang-bench (SGLang's own
messages, continuous batching) pass after pass through one detokd process started at the
beginning, and after each pass through a detokd process started for that pass alone, so
the two meet the same phase of the machine: a process that ages badly shows a ratio
(long-lived CPU per row / fresh) that grows from pass to pass, or an RSS that does. Every
pass's text is checked against the oracle. Run it in SGLang's environment
(`.venv-sglang-0.5.23/bin/python -m detokbench sglang-aging`).
"""

from __future__ import annotations

import statistics

from detokd import zoo
from detokd.sglang.process import run_sglang_detokenizer
from detokd.tokenizer import load
from detokrig.corpus import corpus
from detokrig.proc import memory
from detokrig.sglang_replay import SglangDetokenizerUnderTest

from .commands import command_line, parser, write_json
from .sglang_bench import TOKENIZER, Stream, environment, run_pass


def _ratio(ratio: float | None) -> str:
    return "not measured (passes too short)" if ratio is None else f"{ratio:.2f}"


def main(argv: list[str]) -> int:
    ap = parser("sglang-aging", __doc__)
    ap.add_argument("--passes", type=int, default=8, help="passes through each process (default 8)")
    ap.add_argument("--encoding", choices=["pickle", "msgpack"], default="pickle",
                    help="SGLang's IPC (default pickle)")
    ap.add_argument("--batch", type=int, default=1024, help="slots of continuous batching (default 1024)")
    ap.add_argument("--steps", type=int, default=800, help="steps per pass (default 800)")
    ap.add_argument("--lifetime", type=int, default=256, help="steps each request lives (default 256)")
    ap.add_argument("--window", type=int, default=8, help="steps in flight (default 8)")
    ap.add_argument("--json", metavar="PATH", help="write the environment, arguments and every pass here")
    args = ap.parse_args(argv)

    vocab = load(TOKENIZER)
    folder = zoo.build(TOKENIZER)
    stream = Stream(vocab, vocab.hf.encode(corpus(), add_special_tokens=False), args.batch, args.steps,
                    args.encoding, lifetime=args.lifetime)

    def started() -> SglangDetokenizerUnderTest:
        proc = SglangDetokenizerUnderTest(folder, encoding=args.encoding, target=run_sglang_detokenizer).start()
        proc.exchange(stream.warmup)
        return proc

    def one_pass(proc: SglangDetokenizerUnderTest) -> dict:
        p = run_pass(proc, stream, args.window)
        if p["off_oracle"]:
            raise AssertionError(f"{p['off_oracle']} requests off the oracle: {p['off_oracle_examples']}")
        return dict(cpu_us_per_row=p["cpu_us_per_row"], tokens_per_s=p["tokens_per_s"],
                    rss_mb=memory(proc.processes[0].pid).rss_kb / 1024)

    passes = []
    with started() as aged:
        for k in range(args.passes):
            old = one_pass(aged)
            with started() as fresh:
                new = one_pass(fresh)
            # None: a pass shorter than the CPU clock's tick (10 ms) measures no CPU
            ratio = old["cpu_us_per_row"] / new["cpu_us_per_row"] if new["cpu_us_per_row"] else None
            passes.append(dict(long_lived=old, fresh=new, ratio=ratio))
            print(f"pass {k}: CPU per row {old['cpu_us_per_row']:.2f} µs long-lived (RSS {old['rss_mb']:.0f} MB), "
                  f"{new['cpu_us_per_row']:.2f} fresh (RSS {new['rss_mb']:.0f} MB): ratio {_ratio(ratio)}",
                  flush=True)
    ratios = [p["ratio"] for p in passes if p["ratio"] is not None]
    print(f"ratio long-lived / fresh: median {_ratio(statistics.median(ratios) if ratios else None)}, "
          f"first {_ratio(passes[0]['ratio'])}, last {_ratio(passes[-1]['ratio'])}; "
          f"long-lived RSS {passes[0]['long_lived']['rss_mb']:.0f} → {passes[-1]['long_lived']['rss_mb']:.0f} MB")
    if args.json:
        write_json(args.json, dict(command=command_line("sglang-aging", argv), environment=environment(),
                                   args=vars(args), passes=passes))
    return 0
