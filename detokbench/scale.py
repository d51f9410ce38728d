"""detokd's own throughput by shard count, on a harness too cheap to matter
(docs/performance.md, "Scale-out: shards"): unlike `bench`, whose Python scheduler and
worker take most of a second core, it measures detokd as a load generator measures a server.

A round's frames are built before timing by the real SchedulerClient and handed to ZMQ at
once, so detokd never waits; the answers are checked against the oracle after the round.
Configurations alternate round by round (ABBA...) so the VM's drift hits them alike; beside
each round, N copies of a plain Python loop against one measure the machine's ceiling.

    python -m detokbench scale                        # 1 and 2 shards, deepseek, B=1024
    python -m detokbench scale --shards 1 --batch 256 # detokd's CPU per token at B=256
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import zmq

from detokd.client import SchedulerClient, shard_for
from detokd.config import Config
from detokd.launch import derive_address
from detokd.process import NotReady
from detokd.wire.native import Finish, Text
from detokrig.children import detokd_process
from detokrig.corpus import TAIL
from detokrig.engine import push
from detokrig.proc import cpu_s, descendants
from detokrig.sink import pull

from .bench.report import md_head
from .bench.workload import Corpus
from .commands import header, parser, write_json

MARK = "\x01end-"  # marker rids: no text of the corpus contains \x01


def markers(client: SchedulerClient, n: int, prefix: str = MARK) -> list[bytes]:
    """Begin and finish at once a marker rid on each of the `n` shards, the first of `prefix`i.0,
    `prefix`i.1, ... that falls on shard i: the row that shard answers last."""
    marks = [next(m for j in range(10_000) if shard_for(m := f"{prefix}{i}.{j}", n) == i) for i in range(n)]
    for m in marks:
        client.begin(m, finish=Finish("length"))
    return [m.encode() for m in marks]


def spin(n: int = 400_000) -> float:
    """Plain single-core Python work (dict and int churn); its own wall time."""
    t0 = time.perf_counter()
    d: dict[int, int] = {}
    s = 0
    for i in range(n):
        s += i * i
        d[i & 4095] = s
    return time.perf_counter() - t0


def ceiling(pool, k: int) -> float:
    """What this machine gives k processes over one at this moment:
    k x wall(one spin) / wall(k spins side by side)."""
    one = pool.apply(spin)
    t0 = time.perf_counter()
    pool.map(spin, [400_000] * k, chunksize=1)
    return k * one / (time.perf_counter() - t0)


class Streams:
    """B streams over the corpus' ids, each from its own offset, and their oracle texts."""

    def __init__(self, tokenizer: str, batch: int, steps: int, per_row: int) -> None:
        corp = Corpus(tokenizer)
        offsets = [b * len(corp.base) // batch for b in range(batch)]
        self.rids = [f"s{b}" for b in range(batch)]
        self.tails = [corp.ids(o, 0, TAIL) for o in offsets]
        self.outs = [corp.ids(o, TAIL, steps * per_row) for o in offsets]
        self.want = {rid: corp.vocab.reference(t, o) for rid, t, o in zip(self.rids, self.tails, self.outs, strict=True)}

    def frames(self, addresses: list[str], steps: int, per_row: int) -> tuple[list[list[bytes]], list[bytes]]:
        """Each shard's frames of one round, and the marker each shard answers last."""
        n = len(addresses)
        client = SchedulerClient(addresses)
        out: list[list[bytes]] = [[] for _ in range(n)]
        for k in range(steps):
            for rid, tail, ids in zip(self.rids, self.tails, self.outs, strict=True):
                chunk = ids[k * per_row:(k + 1) * per_row]
                fin = Finish("length") if k == steps - 1 else None
                if k == 0:
                    client.begin(rid, chunk, prompt_tail=tail, finish=fin)
                else:
                    client.add(rid, chunk, finish=fin)
            if k == steps - 1:
                marks = markers(client, n)
            for shard, frame in client.take():
                out[shard].append(frame)
        client.close(linger=0)
        return out, marks


class Target:
    """One `detokd serve [--shards N]` and the sockets of this harness to it."""

    def __init__(self, ctx: zmq.Context, folder: str, shards: int, tokenizer: str) -> None:
        self.shards = shards
        base, wrk = f"ipc://{folder}/in-{shards}", f"ipc://{folder}/w-{shards}"
        self.addresses = [base] if shards == 1 else [derive_address(base, i) for i in range(shards)]
        self.worker = pull(ctx, wrk, hwm=0)
        cfg = msgspec.structs.replace(Config(), input=base, workers=[wrk], tokenizer=tokenizer, log_level="warning")
        self.detokd = detokd_process(cfg, Path(folder), ["--shards", str(shards)] if shards > 1 else [])
        self.detokd.spawn()
        self.pushes = [push(ctx, a, hwm=0) for a in self.addresses]
        self.pids: list[int] = []

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Every shard said READY=1, then answers a probe (its worker socket is up)."""
        try:
            self.detokd.wait_ready(timeout)
        except NotReady as e:
            raise SystemExit(f"detokd with {self.shards} shard(s): {e}") from None
        client = SchedulerClient(self.addresses)
        markers(client, len(self.addresses), "\x01probe-")
        for shard, frame in client.take():
            self.pushes[shard].send(frame)
        client.close(linger=0)
        deadline = time.monotonic() + timeout
        for _ in self.pushes:
            if not self.worker.poll(max(0, deadline - time.monotonic()) * 1000):
                raise SystemExit(f"detokd with {self.shards} shard(s) did not answer in {timeout:.0f} s")
            self.worker.recv()
        self.pids = descendants(self.detokd.pid)

    def round(self, frames: list[list[bytes]], marks: list[bytes]) -> tuple[float, float, list[bytes]]:
        """Send one round, keep every answer; (wall s, detokd CPU s, frames received).
        The send queues are unbounded: the round goes to ZMQ up front (a few ms)."""
        got: list[bytes] = []
        todo = set(marks)
        c0, t0 = cpu_s(self.pids), time.perf_counter()
        for k in range(max(len(f) for f in frames)):
            for sock, f in zip(self.pushes, frames, strict=True):
                if k < len(f):
                    sock.send(f[k], copy=False)
        while todo:
            if not self.worker.poll(60_000):
                raise SystemExit(f"detokd with {self.shards} shard(s) stopped answering mid-round")
            got.append(frame := self.worker.recv())
            todo -= {m for m in todo if m in frame[-256:]}  # a marker's row is the last of its frame
        return time.perf_counter() - t0, cpu_s(self.pids) - c0, got

    def stop(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):  # stop() killed it
            self.detokd.stop(15)


def check(streams: Streams, got: list[bytes]) -> int:
    """Streams whose text differs from the oracle (error rows count as differences)."""
    dec = msgspec.msgpack.Decoder(Text)
    texts: dict[str, list[str]] = {}
    bad = set()
    for frame in got:
        for r in dec.decode(frame).rows:
            if r.error is not None:
                bad.add(r.rid)
            texts.setdefault(r.rid, []).append(r.text)
    return len(bad) + sum("".join(texts.get(rid, ())) != want for rid, want in streams.want.items() if rid not in bad)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = parser("scale", __doc__)
    ap.add_argument("--shards", default="1,2", help="shard counts to compare, comma-separated (default 1,2)")
    ap.add_argument("--batch", "-B", type=int, default=1024, help="streams, one row each per step (default 1024)")
    ap.add_argument("--steps", type=int, default=400, help="steps per round (default 400)")
    ap.add_argument("--ids-per-row", type=int, default=1, help="new ids per row (default 1)")
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds per configuration (default 10)")
    ap.add_argument("--tokenizer", default="deepseek")
    ap.add_argument("--json", metavar="FILE", help="write every round's figures here")
    return ap.parse_args(argv)


def measure(args: argparse.Namespace, counts: list[int]) -> tuple[dict[int, list[dict]], list[float]]:
    """Every configuration's rounds, alternating (ABBA...), each checked; and the
    machine's ceiling measured before each round."""
    B, S, n = args.batch, args.steps, args.ids_per_row
    streams = Streams(args.tokenizer, B, S, n)
    ctx = zmq.Context()
    folder = tempfile.mkdtemp(prefix="detokd-scale-")
    configs = [Target(ctx, folder, c, args.tokenizer) for c in counts]
    me = [os.getpid()]
    runs: dict[int, list[dict]] = {c: [] for c in counts}
    ceilings: list[float] = []
    top = max(counts)
    pool = multiprocessing.get_context("spawn").Pool(top) if top > 1 else None
    try:
        for cfg in configs:
            cfg.wait_ready()
        plans = {cfg.shards: streams.frames(cfg.addresses, S, n) for cfg in configs}
        for cfg in configs:  # warm-up round, not counted
            cfg.round(*plans[cfg.shards])
        tokens = B * S * n
        for r in range(args.rounds):
            if pool is not None:
                ceilings.append(ceiling(pool, top))
            for cfg in configs if r % 2 == 0 else configs[::-1]:
                h0 = cpu_s(me)
                wall, cpu, got = cfg.round(*plans[cfg.shards])
                harness = cpu_s(me) - h0
                wrong = check(streams, got)
                runs[cfg.shards].append({
                    "tokens_per_s": tokens / wall, "detokd_cpu_us_per_token": cpu / tokens * 1e6,
                    "harness_cpu_us_per_token": harness / tokens * 1e6, "wrong_streams": wrong,
                })
                print(f"round {r} shards={cfg.shards}: {tokens / wall / 1e3:,.0f}k tokens/s, detokd "
                      f"{cpu / tokens * 1e6:.2f} CPU-µs/token, harness {harness / tokens * 1e6:.3f}, "
                      f"{wrong} wrong streams", file=sys.stderr)
    finally:
        if pool is not None:
            pool.terminate()
        for cfg in configs:
            cfg.stop()
        ctx.destroy(linger=0)
    return runs, ceilings


def summarize(args: argparse.Namespace, counts: list[int], runs: dict[int, list[dict]], ceilings: list[float]) -> dict:
    """Print the table and the ratios (each configuration against the first, and the
    gain against the machine's ceiling); the ratios."""
    med = statistics.median

    def spread(xs: list[float]) -> dict:
        return {"median": med(xs), "min": min(xs), "max": max(xs)}

    print(f"\n{args.tokenizer}, B={args.batch}, {args.ids_per_row} id(s)/row, {args.steps} steps x {args.rounds} rounds, "
          f"{os.cpu_count()} CPUs\n")
    print(*md_head("shards", "tokens/s (median)", "min – max", "detokd CPU-µs/token", "harness CPU-µs/token", "wrong streams"),
          sep="\n")
    for c in counts:
        rs = runs[c]
        tps = [x["tokens_per_s"] for x in rs]
        print(f"| {c} | {med(tps) / 1e3:,.0f}k | {min(tps) / 1e3:,.0f}k – {max(tps) / 1e3:,.0f}k | "
              f"{med(x['detokd_cpu_us_per_token'] for x in rs):.2f} | "
              f"{med(x['harness_cpu_us_per_token'] for x in rs):.3f} | {sum(x['wrong_streams'] for x in rs)} |")
    base, top = counts[0], max(counts)
    ratios = {}
    for c in counts[1:]:
        per_round = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs[c], runs[base], strict=True)]
        ratios[c] = spread(per_round)
        print(f"\n{c} shards / {base}: {med(per_round):.2f}x (median of {len(per_round)} paired rounds; "
              f"{min(per_round):.2f}–{max(per_round):.2f})")
    if ceilings and top != base:
        print(f"machine ceiling, {top} plain Python processes / one: {med(ceilings):.2f}x "
              f"(median of {len(ceilings)}; {min(ceilings):.2f}–{max(ceilings):.2f})")
        eff = [a["tokens_per_s"] / b["tokens_per_s"] / c for a, b, c in zip(runs[top], runs[base], ceilings, strict=True)]
        ratios["of_ceiling"] = spread(eff)
        print(f"{top} shards' gain as a share of the ceiling measured beside it: {med(eff):.0%} (median)")
    return ratios


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    counts = [int(x) for x in args.shards.split(",")]
    runs, ceilings = measure(args, counts)
    ratios = summarize(args, counts, runs, ceilings)
    if args.json:
        write_json(args.json, {**header("scale", argv), "args": vars(args), "runs": runs, "ratios": ratios,
                               "ceilings": ceilings})
    return 1 if any(x["wrong_streams"] for rs in runs.values() for x in rs) else 0
