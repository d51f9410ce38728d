"""detokd's benchmark, fuzz, soak and worst-frame tools: `python -m detokbench CMD [args]`.

Not part of the wheel: it runs from a checkout and measures that checkout's detokd.
`python -m detokbench --help` lists the commands (commands.py), one module each
(bench/ is a package). What they share, the tests too:

    rig        one real detokd with its sinks, metrics port and an RSS/metrics sampler
    children   this checkout's detokd and other child processes, stopped at exit
    engine     the scheduler side: raw PUSH sockets
    sink       the worker side: PULL sockets read by a thread (Recorder keeps every row)
    metrics    /metrics, /health, and their port;  waits: a condition against a deadline
    proc       CPU time and memory from /proc;  corpus: the text the benchmarks decode
    frames     frames peers send detokd: honest ids, hostile frames, frames over caps
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout this package lies in
