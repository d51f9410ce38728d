"""detokd's peers as the tests and the tools play them: one rig, shared by tests/ and
detokbench. Not part of the wheel: it runs from a checkout and drives that checkout's detokd.

    rig        one real detokd with its sinks, metrics port and an RSS/metrics sampler
    children   this checkout's detokd and other child processes, stopped at exit
    engine     the scheduler side: raw PUSH sockets
    sink       the worker side: PULL sockets read by a thread (Recorder keeps every row)
    metrics    /metrics, /health, and their port;  waits: a condition against a deadline
    proc       CPU time and memory from /proc;  corpus: the text the benchmarks decode
    frames     frames peers send detokd: honest ids, hostile frames, frames over caps
    sglang_replay  a scripted scheduler stream through SGLang's detokenizer or detokd's
    sglang_standin  SGLang's scheduler minus the model: scripted replies through SGLang's Req
    sglang_frontend  SGLang's own HTTP server around the stand-in (serve_standin.py), model folders
    sglang_cases  the front-end cases: a mix of client requests, what each client saw, the oracle
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout this package lies in
