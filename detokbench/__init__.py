"""detokd's benchmark, fuzz, soak and worst-frame tools: `python -m detokbench CMD [args]`.

Not part of the wheel (pyproject packages only detokd*): it runs from a checkout, whose
root holds it, and measures that checkout's detokd.

    commands       the subcommands and the dispatch of `python -m detokbench`
    bench/         the end-to-end benchmark against the baselines (its own package)
    baselines      the baseline detokenizers bench runs beside detokd
    scale          detokd alone, 1 vs N shards
    soak           request churn through a real detokd for millions of tokens
    fuzz           honest and hostile frames through a real detokd
    worst_frames   the worst frame at the default caps, one scenario per message type
    sglang_bench   detokd against SGLang's own detokenizer process (SGLang's environment)
    sglang_replay  SGLang's scheduler stream, built by SGLang's code, through a detokenizer
                   process (also the SGLang tests' harness)

Shared by them:

    frames         frames peers send detokd: honest ids, hostile frames, frames over caps
                   (the tests use them too)
    proc           CPU time, RSS and peak RSS of processes, from /proc; the machine's load
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout this package lies in
