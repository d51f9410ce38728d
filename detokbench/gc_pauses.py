"""The collector's pauses in detokd's loop under continuous batching: detokd's policy
(detokd.gc_policy) against the one it replaced (once a second alone).

In-process, as the server's loop runs it: B slots of staggered requests L steps long,
each step one `tokens` frame through NativeDialect.handle, its text delivered to a
worker socket here, the policy ticking after every frame. Every collection
(gc.callbacks) and every turn is timed. Each policy runs in a process of its own,
alternated over --rounds, since starting a policy freezes that process's heap.
docs/performance.md, "The collector's pauses".

    python -m detokbench gc-pauses --json docs/bench/gc-pauses.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import subprocess
import sys
import time

from detokrig.corpus import TAIL, corpus

from .bench.report import md_head, pct
from .commands import header, parser, write_json

POLICIES = ("detokd", "clock")  # the shipped policy; the one-a-second clock alone


def run_one(policy_name: str, batch: int, lifetime: int, steps: int) -> dict:
    """One policy in this process: the stream's frames built first, then timed."""
    import msgspec
    import zmq

    from detokd import gc_policy
    from detokd.conductor import Conductor
    from detokd.core.decoder import make_codec
    from detokd.core.detokenizer import Detokenizer
    from detokd.core.outbox import Outbox
    from detokd.core.stats import Stats
    from detokd.delivery import Delivery
    from detokd.tokenizer import load
    from detokd.wire import native

    if policy_name == "clock":
        gc_policy.STARTS = float("inf")
    vocab = load("deepseek")
    text = vocab.backend.encode(corpus(), add_special_tokens=False).ids
    rng = random.Random(1)
    frames = []
    age = [-(s * lifetime // batch) for s in range(batch)]  # a slot's request's step: its seq (one id a step)
    generation, at = [0] * batch, [0] * batch
    for _ in range(steps):
        rows = []
        for s in range(batch):
            a = age[s]
            age[s] += 1
            if a < 0:  # steps until the slot's first start
                continue
            pos = at[s] % (len(text) - TAIL)
            at[s] += 1
            start = native.Start(prompt_tail=text[pos : pos + TAIL]) if a == 0 else None
            finish = native.Finish("length") if 0 < a == lifetime - 1 else None
            rows.append(native.Row(f"r{s}-{generation[s]}", [text[pos + TAIL]], a, start, finish))
            if finish:
                age[s], at[s] = 0, rng.randrange(len(text))
                generation[s] += 1
        frames.append(native.encode(native.Tokens(rows)))

    text_of = msgspec.msgpack.Decoder(native.Text).decode
    ctx = zmq.Context()
    sink = ctx.socket(zmq.PULL)
    sink.bind("inproc://worker")
    stats, outbox = Stats(), Outbox([0])
    core = Detokenizer(make_codec(vocab, release="char"), vocab.size, outbox, max_states=4 * batch, max_prompt_tail=TAIL, stats=stats)
    delivery = Delivery(ctx, ["inproc://worker"], feedback=None, hwm=0, queue_bytes=1 << 30, linger_ms=0, stats=stats)
    policy = gc_policy.GcPolicy(stats)
    dialect = native.NativeDialect(core, policy, stats)
    conductor = Conductor(dialect, core, delivery, stats)

    pauses: list[float] = []
    began = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - began[0])

    turns = []
    policy.start()
    gc.callbacks.append(timed)
    t0 = time.perf_counter()
    delivered = 0
    for frame in frames:
        t = time.perf_counter()
        conductor.frame(frame)  # what Server.process does with a frame: handle, deliver
        policy.tick(time.monotonic())
        turns.append(time.perf_counter() - t)
        while sink.poll(0):
            delivered += len(text_of(sink.recv()).rows)  # after the turn: not timed
    seconds = time.perf_counter() - t0
    policy.tick(float("inf"))  # a pass shorter than a second still has a collection to show
    gc.callbacks.remove(timed)
    policy.stop()
    assert stats.errors == {}, stats.errors
    assert delivered == stats.rows, (delivered, stats.rows)  # every row's text reached the worker, none held
    steady = [t * 1e3 for t in turns[lifetime:]]  # ms, every slot running
    pauses_ms = [p * 1e3 for p in pauses]
    return {
        "policy": policy_name,
        "seconds": seconds,
        "starts": stats.started,
        "rows_delivered": delivered,
        "starts_per_s": stats.started / seconds,
        "collections": len(pauses),
        "pause_ms": {"p50": pct(pauses_ms, 50), "p99": pct(pauses_ms, 99), "max": max(pauses_ms)},
        "gc_ms_per_s": sum(pauses_ms) / seconds,
        "turn_ms": {"p50": pct(steady, 50), "p99": pct(steady, 99), "p99.9": pct(steady, 99.9), "max": max(steady)},
        "pauses_ms": pauses_ms,
    }


def main(argv: list[str]) -> int:
    ap = parser("gc-pauses", __doc__)
    ap.add_argument("--batch", type=int, default=1024, help="B: requests in every step (default 1024)")
    ap.add_argument("--lifetime", type=int, default=256, help="L: steps a request runs (default 256)")
    ap.add_argument("--steps", type=int, default=6000, help="steps a pass sends (default 6000: several seconds, several ticks of the clock)")
    ap.add_argument("--rounds", type=int, default=2, help="passes of each policy, alternated (default 2)")
    ap.add_argument("--json", metavar="PATH", help="write every figure and every pause here")
    ap.add_argument("--one", choices=POLICIES, help=argparse.SUPPRESS)  # a pass, in the child process
    args = ap.parse_args(argv)
    if args.lifetime * 2 > args.steps:
        ap.error("--steps must be at least twice --lifetime (a steady part to measure)")
    if args.one:
        print(json.dumps(run_one(args.one, args.batch, args.lifetime, args.steps)))
        return 0
    passes = []
    for r in range(args.rounds):
        for name in POLICIES if r % 2 == 0 else reversed(POLICIES):
            child = [sys.executable, "-m", "detokbench", "gc-pauses", "--one", name,
                     "--batch", str(args.batch), "--lifetime", str(args.lifetime), "--steps", str(args.steps)]
            p = json.loads(subprocess.run(child, check=True, capture_output=True, text=True).stdout)
            passes.append(p)
            print(f"{name:>6}: {p['collections']:4d} collections, {p['starts_per_s']:5.0f} starts/s, pause ms p50 "
                  f"{p['pause_ms']['p50']:.3f} max {p['pause_ms']['max']:.3f}, {p['gc_ms_per_s']:.2f} ms/s; turn ms "
                  + " ".join(f"{k} {v:.2f}" for k, v in p["turn_ms"].items()), flush=True)
    print("", *md_head("policy", "starts/s", "collections/s", "pause ms p50 / p99 / max", "GC ms per s",
                       "turn ms p50 / p99 / p99.9 / max"), sep="\n")
    for name in POLICIES:
        mine = [p for p in passes if p["policy"] == name]
        med = lambda f, mine=mine: statistics.median(f(p) for p in mine)  # noqa: E731
        figures = [
            f"{med(lambda p: p['starts_per_s']):,.0f}",
            f"{med(lambda p: p['collections'] / p['seconds']):.1f}",
            " / ".join(f"{med(lambda p, k=k: p['pause_ms'][k]):.3f}" for k in ("p50", "p99", "max")),
            f"{med(lambda p: p['gc_ms_per_s']):.2f}",
            " / ".join(f"{med(lambda p, k=k: p['turn_ms'][k]):.2f}" for k in ("p50", "p99", "p99.9", "max")),
        ]
        print(f"| {name} | " + " | ".join(figures) + " |")
    if args.json:
        write_json(args.json, {**header("gc-pauses", argv), "passes": passes})
    return 0
