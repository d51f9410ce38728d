"""detokd's own CPU per token, with a harness too cheap to matter.

scripts/bench.py measures the whole pipeline, where the scheduler and the worker
share this machine's cores with detokd. This script encodes every frame before it
starts, sends them as fast as detokd takes them (ZMQ's high-water mark is the only
flow control), and its worker only counts messages; it reads detokd's CPU time from
/proc. Linux only.

    python scripts/cpu_per_token.py --batch 256 --steps 2000
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time

import msgspec
import zmq

from detokd.tokenizer import load

TEXT = "Hello world, 你好 🤖 this is some text. Привет мир. def f(x): return x*2\n" * 300


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", "-B", type=int, default=256, help="rows per step (default 256)")
    ap.add_argument("--steps", type=int, default=2000, help="steps, one new id per row each (default 2000)")
    ap.add_argument("--tokenizer", default="deepseek")
    args = ap.parse_args()
    B, steps = args.batch, args.steps
    ids = load(args.tokenizer).backend.encode(TEXT).ids
    enc = msgspec.msgpack.encode
    frames = [enc({"type": "tokens", "rows": [{"rid": f"r{b}", "start": {"prompt_tail": ids[:8]}} for b in range(B)]})]
    for k in range(steps):
        frames.append(enc({"type": "tokens", "rows": [{"rid": f"r{b}", "ids": [ids[(k + 7 * b) % len(ids)]], "seq": k} for b in range(B)]}))
    folder = tempfile.mkdtemp(prefix="detokd-cpt-")
    inp, wrk = f"ipc://{folder}/in", f"ipc://{folder}/w"
    ctx = zmq.Context()
    worker = ctx.socket(zmq.PULL)
    worker.bind(wrk)
    proc = subprocess.Popen([sys.executable, "-m", "detokd", "serve", "--input", inp, "--worker", wrk, "--tokenizer", args.tokenizer, "--log-level", "warning"])
    try:
        push = ctx.socket(zmq.PUSH)
        push.connect(inp)
        push.send(enc({"type": "tokens", "rows": [{"rid": "probe"}]}))  # answered once detokd serves
        worker.recv()
        c0, t0 = cpu_seconds(proc.pid), time.perf_counter()
        sender = threading.Thread(target=lambda: [push.send(f) for f in frames])
        sender.start()
        for _ in frames:
            worker.recv()
        wall, cpu = time.perf_counter() - t0, cpu_seconds(proc.pid) - c0
        sender.join()
        n = B * steps
        print(f"B={B} {args.tokenizer}: {n / wall / 1e3:,.0f}k tokens/s wall; detokd {cpu / n * 1e6:.2f} CPU-µs per token "
              f"({n / cpu / 1e3:,.0f}k tokens/s per core)")
    finally:
        proc.terminate()
        proc.wait(10)
        ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
