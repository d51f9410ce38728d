"""detokd's benchmark, fuzz, soak and worst-frame tools: `python -m detokbench CMD [args]`.

Not part of the wheel (pyproject packages only detokd*): it runs from a checkout, whose
root holds it, and measures that checkout's detokd. `python -m detokbench --help` lists
the commands (commands.py).

The tools, one concern per module:

    bench/            the end-to-end benchmark: detokd against the baselines
    baselines         the baseline detokenizers bench runs beside detokd, in-process
    baselines_server  one of them behind detokd's wire protocol (`detokbench baselines`)
    scale             detokd alone, 1 vs N shards
    soak              request churn through a real detokd for millions of tokens
    fuzz              honest and hostile frames through a real detokd
    worst_frames      the worst frame at the default caps, one scenario per message type
    sglang_bench      detokd against SGLang's own detokenizer process (SGLang's environment)
    sglang_replay     SGLang's scheduler stream, built by SGLang's code, through a
                      detokenizer process (also the SGLang tests' harness)

What they share (the tests use engine, sink, metrics, waits and frames too):

    rig        one real detokd with its sinks, context, metrics port, memory and an
               RSS and /metrics sampler (soak, fuzz, worst_frames)
    children   this checkout's detokd and the other child processes, stopped at exit
    engine     the scheduler side: raw PUSH sockets, frames as dicts or bytes
    sink       the tokenizer worker side: PULL sockets read by a thread; Recorder
               keeps every row (the tests' worker)
    metrics    detokd's /metrics (one shape), /health, and the port they are on
    waits      waiting for a condition against a deadline
    proc       CPU time, RSS and peak RSS of processes, from /proc; the machine's load
    corpus     the multilingual text the benchmarks decode
    frames     frames peers send detokd: honest ids, hostile frames, frames over caps
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout this package lies in
