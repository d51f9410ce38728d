"""Soak test: millions of tokens with churn through a real detokd; is memory flat?

    engine (this process) --tokens/abort--> `python -m detokd serve` --text--> worker (this process)

* The engine keeps `--concurrency` requests going at once; each step it sends one
  `tokens` frame with a row of 1..`--max-delta` new ids for every one of them. Output
  lengths are random (log-uniform between 1 and `--max-len`); ids are runs of real
  multilingual text (the DeepSeek tokenizer's own encodings) with random ids of the
  whole vocabulary sprinkled in; half the requests carry a prompt tail.
* Churn: most requests finish (a finish row); `--abort` of them are aborted midway
  (an `abort` message); `--abandon` of them are simply never sent again, neither
  finished nor aborted, as when an engine loses track of a request. Their states pile
  up until detokd's table is full (`--max-states`) and eviction takes the oldest:
  each evicted request's worker gets an "evicted" row.
* The worker (a thread of this process) counts every row, checks that each finished
  request's last row has n_ids equal to its length and that only abandoned requests
  get errors, and keeps the whole text of every `--check-every`-th request, which is
  compared at the end with the oracle: transformers' decode of prompt tail + output.
* A sampler thread records, every `--interval` seconds, detokd's RSS (/proc) and
  what its /metrics says: live requests, tokens, evictions, errors.
* At the end: JSON with every sample and the summary, a PNG plot (RSS and live
  requests over time, matplotlib), both in `--out` (docs/soak/), and the verdict:
  RSS is flat when it grew by less than `--flat-threshold` over the last quarter
  of the run.

    python -m detokbench soak --quick     # ~1.4M tokens over 10k requests, seconds
    python -m detokbench soak             # ~135M tokens over 1M requests, minutes (docs/reliability.md)
    python -m detokbench soak --requests 110000   # the issue's minimum: >10M tokens, >100k requests

Exit status: 0 when RSS ended flat and every checked text was exact, 1 otherwise.
"""

from __future__ import annotations

import argparse
import array
import json
import math
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import msgspec
import zmq

from detokd.client import SchedulerClient
from detokd.config import Config
from detokd.process import DetokdProcess, NotReady
from detokd.wire.native import Finish, Text

from . import ROOT
from .bench.harness import detokd_process
from .commands import command_line
from .proc import memory, tick_cpu_s

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Streaming text must arrive exactly once. ",
    "数据库连接失败，请稍后重试。深度学习模型的推理速度取决于批量大小和序列长度。",
    "こんにちは世界！カタカナとひらがな、そして漢字が混ざった文章です。",
    "Ünïcödé façade naïve café — “quotes” ‘and’ … résumé coöperate. ",
    "🙂🚀👩‍👩‍👧‍👦 emoji sequences 🇫🇷🇯🇵 and 👍🏽 skin tones. ",
    "def f(x):\n    return x ** 2  # code\n\tindent\n\nclass A:\n    pass\n",
    "Привет, мир! Γειά σου Κόσμε. مرحبا بالعالم. שלום עולם. नमस्ते दुनिया. ",
    "  leading spaces and\r\nCRLF\n\n| a | b |\n|---|---|\n| 1 | 2 |\n",
)

FINISH, ABORT, ABANDON = 0, 1, 2


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Pool:
    """A long run of ids every request takes its output (and prompt tail) from."""

    def __init__(self, hf, size: int, rng: random.Random) -> None:
        pieces = [hf.encode(t, add_special_tokens=False) for t in CORPUS]
        vocab = len(hf)
        ids: list[int] = []
        while len(ids) < size:
            if rng.random() < 0.1:
                ids += [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
            else:
                p = rng.choice(pieces)
                a = rng.randrange(len(p))
                ids += p[a : a + rng.randint(1, 24)]
        self.ids = ids[:size]


class EReq:
    __slots__ = ("rid", "ids", "tail", "worker", "fate", "stop_at", "pos", "check")

    def __init__(self, rid, ids, tail, worker, fate, stop_at, check) -> None:
        self.rid, self.ids, self.tail, self.worker = rid, ids, tail, worker
        self.fate, self.stop_at, self.pos, self.check = fate, stop_at, 0, check


class Worker(threading.Thread):
    """PULLs every worker address and checks each request's ending row as it comes:
    per request number (rid "s<n>") one byte of state, so a million requests cost a
    megabyte here; keeps the whole text of the checked rids only."""

    NONE, FINISHED, WRONG_END, EVICTED, OTHER_ERROR = range(5)

    def __init__(self, ctx: zmq.Context, addresses: list[str], lengths, fates) -> None:
        super().__init__(daemon=True)
        self.socks = []
        for a in addresses:
            s = ctx.socket(zmq.PULL)
            s.setsockopt(zmq.RCVHWM, 100_000)
            s.bind(a)
            self.socks.append(s)
        self.lengths, self.fates = lengths, fates
        self.ended = bytearray(len(lengths))
        self.lock = threading.Lock()
        self.rows = 0
        self.messages = 0
        self.duplicate_endings = 0
        self.texts: dict[str, list[str]] = {}  # checked rids only
        self.errors: dict[str, int] = {}
        self.halt = False

    def watch(self, rid: str) -> None:
        with self.lock:
            self.texts[rid] = []

    def run(self) -> None:
        poller = zmq.Poller()
        for s in self.socks:
            poller.register(s, zmq.POLLIN)
        decode = msgspec.msgpack.Decoder(Text).decode
        ended, lengths = self.ended, self.lengths
        while not self.halt:
            for s, _ in poller.poll(100):
                while True:
                    try:
                        frame = s.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    rows = decode(frame).rows
                    with self.lock:
                        self.messages += 1
                        self.rows += len(rows)
                        texts = self.texts
                        for r in rows:
                            err = r.error
                            if err is None and r.finish is None:
                                t = texts.get(r.rid)
                                if t is not None:
                                    t.append(r.text)
                                continue
                            i = int(r.rid[1:])
                            if ended[i]:
                                self.duplicate_endings += 1
                            if err is not None:
                                self.errors[err] = self.errors.get(err, 0) + 1
                                ended[i] = self.EVICTED if err == "evicted" else self.OTHER_ERROR
                            else:
                                ended[i] = self.FINISHED if r.n_ids == lengths[i] else self.WRONG_END
                                t = texts.get(r.rid)
                                if t is not None:
                                    t.append(r.text)

    def close(self) -> None:
        self.halt = True
        self.join(5)
        for s in self.socks:
            s.close(linger=0)


def scrape(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        body = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            key = s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))
            out[key] = s.value
    return out


class Sampler(threading.Thread):
    def __init__(self, pid: int, port: int, interval: float, t0: float) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.port, self.interval, self.t0 = port, interval, t0
        self.samples: list[dict] = []
        self.halt = threading.Event()

    def sample(self) -> None:
        try:
            rss = memory(self.pid).rss_kb * 1024
            cpu = tick_cpu_s(self.pid)
            m = scrape(self.port)
        except Exception as exc:  # the process went away: the run will say so
            log(f"sampler: {exc}")
            return
        self.samples.append({
            "t": round(time.monotonic() - self.t0, 3),
            "rss_mb": round(rss / 2**20, 2),
            "cpu_s": round(cpu, 2),
            "live": m.get("detokd_live_requests", 0),
            "tokens": m.get("detokd_tokens_total", 0),
            "started": m.get("detokd_requests_started_total", 0),
            "evictions": m.get("detokd_evictions_total", 0),
        })

    def run(self) -> None:
        while not self.halt.wait(self.interval):
            self.sample()


def start_detokd(tmp: Path, args) -> tuple[DetokdProcess, int]:
    """detokd on ipc:// addresses in `tmp`, ready (READY=1), and its metrics port (it
    was told port 0, so it picked a free one and logged which)."""
    cfg = msgspec.structs.replace(
        Config(), input=f"ipc://{tmp}/in.sock", workers=[f"ipc://{tmp}/w{i}.sock" for i in range(args.workers)],
        max_states=args.max_states, metrics_port=0, log_level="info",
    )
    d = detokd_process(cfg, tmp)
    try:
        d.start(120)
    except NotReady as e:
        sys.exit(f"detokd did not start:\n{str(e)[-3000:]}")
    m = re.search(r"health and metrics on port (\d+)", d.log())  # logged before READY=1
    if m is None:
        d.kill()
        sys.exit(f"detokd logged no metrics port:\n{d.log()[-3000:]}")
    return d, int(m.group(1))


def flatness(samples: list[dict], threshold: float) -> dict:
    """RSS growth over the last quarter of the run: the mean of the last 10% of the
    samples against the mean of the samples around the 75% mark (70-80%)."""
    if len(samples) < 10:
        return {"flat": None, "reason": "too few samples"}
    t_end = samples[-1]["t"]

    def mean_rss(a: float, b: float) -> float:
        xs = [s["rss_mb"] for s in samples if a * t_end <= s["t"] <= b * t_end]
        return sum(xs) / len(xs)

    q3, end = mean_rss(0.70, 0.80), mean_rss(0.90, 1.0)
    growth = (end - q3) / q3
    return {
        "rss_start_mb": samples[0]["rss_mb"],
        "rss_q3_mb": round(q3, 2),
        "rss_end_mb": round(end, 2),
        "rss_peak_mb": max(s["rss_mb"] for s in samples),
        "last_quarter_growth": round(growth, 5),
        "threshold": threshold,
        "flat": growth < threshold,
    }


def plot(samples: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] for s in samples]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ax1.plot(t, [s["rss_mb"] for s in samples], color="tab:blue")
    ax1.set_ylabel("detokd RSS (MB)")
    f = summary["flatness"]
    ax1.set_title(
        f"{summary['tokens'] / 1e6:.1f}M tokens, {summary['requests']:,} requests, max_states {summary['max_states']:,}: "
        f"RSS {'flat' if f.get('flat') else 'NOT flat'} (last quarter {f.get('last_quarter_growth', 0):+.2%})",
        fontsize=10,
    )
    rss = [s["rss_mb"] for s in samples]
    mid = (max(rss) + min(rss)) / 2
    half = max(10.0, (max(rss) - min(rss)) * 0.6)  # at least a 20 MB window: noise stays small
    ax1.set_ylim(mid - half, mid + half)
    ax1.axvspan(0.75 * t[-1], t[-1], color="0.9")
    ax2.plot(t, [s["live"] for s in samples], color="tab:orange", label="live requests (/metrics)")
    ax2.axhline(summary["max_states"], color="tab:red", ls="--", lw=1, label="max_states")
    ax2.set_ylabel("live requests")
    ax2.set_xlabel("seconds")
    ax3 = ax2.twinx()
    ax3.plot(t, [s["tokens"] / 1e6 for s in samples], color="tab:green", label="tokens (M)")
    ax3.set_ylabel("tokens decoded (M)")
    h1, l1 = ax2.get_legend_handles_labels()
    h2, l2 = ax3.get_legend_handles_labels()
    ax2.legend(h1 + h2, l1 + l2, loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args, command: str) -> int:
    from detokd.tokenizer import load

    rng = random.Random(args.seed)
    vocab = load("deepseek")
    pool = Pool(vocab.hf, 2_000_000, rng)
    n_pool = len(pool.ids)
    tmp = Path(tempfile.mkdtemp(prefix="detokd-soak-"))
    ctx = zmq.Context()
    lengths = array.array("i", bytes(4 * args.requests))  # per request number
    fate_of = bytearray(args.requests)
    # The worker binds its addresses first: detokd connects to them.
    worker = Worker(ctx, [f"ipc://{tmp}/w{i}.sock" for i in range(args.workers)], lengths, fate_of)
    worker.start()
    detokd, port = start_detokd(tmp, args)
    proc = detokd.proc
    engine = SchedulerClient(detokd.input, context=ctx, sndhwm=1000, send_timeout=30)
    length = Finish("length")
    t0 = time.monotonic()
    sampler = Sampler(proc.pid, port, args.interval, t0)
    sampler.sample()
    sampler.start()
    log(f"detokd pid {proc.pid}, metrics on port {port}; {args.requests:,} requests, about {args.tokens:,} tokens")

    log_max = math.log(args.max_len)
    active: list[EReq] = []
    checked: dict[str, tuple[list[int], list[int]]] = {}
    made = sent_tokens = steps = 0
    fates = [0, 0, 0]
    last_log = time.monotonic()
    try:
        while made < args.requests or active:
            while len(active) < args.concurrency and made < args.requests:
                # Lengths log-uniform in [1, max_len] (times --len-scale).
                n = max(1, int(math.exp(rng.random() * log_max) * args.len_scale))
                off = rng.randrange(8, n_pool - n)
                ids = pool.ids[off : off + n]
                tail = pool.ids[off - 8 : off] if rng.random() < 0.5 else []
                u = rng.random()
                fate = ABORT if u < args.abort else ABANDON if u < args.abort + args.abandon else FINISH
                stop_at = rng.randrange(n) + 1 if fate != FINISH else n
                rid = f"s{made}"
                check = made % args.check_every == 0 and fate == FINISH
                if check:
                    checked[rid] = (tail, ids)
                    worker.watch(rid)
                lengths[made] = n
                fate_of[made] = fate
                fates[fate] += 1
                active.append(EReq(rid, ids, tail, made % args.workers, fate, stop_at, check))
                made += 1
            aborts = []
            still = []
            for r in active:
                k = rng.randint(1, args.max_delta)
                end = min(r.pos + k, r.stop_at)
                chunk = r.ids[r.pos : end]
                first = r.pos == 0
                r.pos = end
                sent_tokens += len(chunk)
                fin = None
                if r.pos < r.stop_at:
                    still.append(r)
                elif r.fate == FINISH:
                    fin = length
                elif r.fate == ABORT:
                    aborts.append(r.rid)
                if first:
                    engine.begin(r.rid, chunk, worker=r.worker, prompt_tail=r.tail, finish=fin)
                else:
                    engine.add(r.rid, chunk, finish=fin)
                if r.pos >= r.stop_at and r.fate == ABANDON:
                    engine.forget(r.rid)  # never sent again, so no longer tracked here
            active = still
            engine.flush()  # one `tokens` message; then the aborts, after their last rows
            if aborts:
                engine.abort(aborts)
            steps += 1
            if proc.poll() is not None:
                raise RuntimeError(f"detokd exited {proc.returncode}")
            if time.monotonic() - last_log > 15:
                last_log = time.monotonic()
                s = sampler.samples[-1] if sampler.samples else {}
                log(f"{made:,} requests, {sent_tokens / 1e6:.1f}M tokens sent; detokd RSS {s.get('rss_mb')} MB, live {s.get('live'):.0f}")
        send_done = time.monotonic() - t0
        # Drain: detokd has decoded everything sent, and the worker has every finished
        # request's last row.
        deadline = time.monotonic() + 120
        want = fates[FINISH]
        while True:
            with worker.lock:
                got = sum(1 for i in range(made) if fate_of[i] == FINISH and worker.ended[i])
            m = scrape(port)
            if got >= want and m.get("detokd_tokens_total", 0) >= sent_tokens:
                break
            if time.monotonic() > deadline:
                log(f"drain timed out: {got}/{want} finished requests ended, detokd tokens {m.get('detokd_tokens_total')}")
                break
            time.sleep(0.2)
        sampler.halt.set()
        sampler.join(10)
        sampler.sample()
        elapsed = time.monotonic() - t0
        final = scrape(port)
    finally:
        try:
            rc = detokd.stop(30)
        except subprocess.TimeoutExpired:
            rc = "killed"
        worker.close()
        engine.close(linger=0)
        ctx.destroy(linger=0)

    # --- verdicts
    W = Worker
    ends = {(f, e): 0 for f in (FINISH, ABORT, ABANDON) for e in range(5)}
    for i in range(made):
        ends[(fate_of[i], worker.ended[i])] += 1
    bad_finished = sum(ends[(FINISH, e)] for e in range(5) if e != W.FINISHED)
    evicted_live = ends[(FINISH, W.EVICTED)] + ends[(ABORT, W.EVICTED)]  # evicted while the engine still sent rows
    aborted_with_ending = sum(ends[(ABORT, e)] for e in (W.FINISHED, W.WRONG_END, W.OTHER_ERROR))
    abandoned_evicted = ends[(ABANDON, W.EVICTED)]
    texts = {rid: "".join(parts) for rid, parts in worker.texts.items()}
    wrong = []
    for rid, (tail, ids) in checked.items():
        if texts.get(rid) != vocab.reference(tail, ids):
            wrong.append(rid)
    evicted_rows = worker.errors.get("evicted", 0)
    summary = {
        "command": command,
        "tokens": int(final.get("detokd_tokens_total", 0)),
        "tokens_sent": sent_tokens,
        "requests": made,
        "fates": {"finished": fates[FINISH], "aborted": fates[ABORT], "abandoned": fates[ABANDON]},
        "steps": steps,
        "concurrency": args.concurrency,
        "max_states": args.max_states,
        "seconds": round(elapsed, 1),
        "send_seconds": round(send_done, 1),
        "tokens_per_second": round(sent_tokens / send_done),
        "detokd_cpu_seconds": sampler.samples[-1]["cpu_s"] if sampler.samples else None,
        "detokd_exit": rc,
        "metrics": {k: v for k, v in final.items() if not k.startswith("detokd_step_seconds_bucket")},
        "worker": {"messages": worker.messages, "rows": worker.rows, "errors": worker.errors},
        "evicted_rows": evicted_rows,
        "abandoned_requests_evicted": abandoned_evicted,
        "abandoned_requests_still_live": ends[(ABANDON, W.NONE)],
        "requests_evicted_while_going": evicted_live,
        "duplicate_endings": worker.duplicate_endings,
        "finished_requests_wrong_ending": bad_finished,
        "aborted_requests_with_an_ending_row": aborted_with_ending,
        "checked_texts": len(checked),
        "checked_texts_wrong": len(wrong),
        "flatness": flatness(sampler.samples, args.flat_threshold),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "soak-quick" if args.quick else "soak"
    (out / f"{stem}.json").write_text(json.dumps({"summary": summary, "samples": sampler.samples}, indent=1))
    plot(sampler.samples, summary, out / f"{stem}.png")
    f = summary["flatness"]
    log(f"{summary['tokens']:,} tokens decoded over {made:,} requests in {elapsed:.0f}s "
        f"({summary['tokens_per_second']:,} tokens/s sent); detokd exit {rc}")
    log(f"fates {summary['fates']}; evictions {final.get('detokd_evictions_total', 0):.0f}; worker errors {worker.errors}")
    log(f"RSS start {f.get('rss_start_mb')} MB, at 75% {f.get('rss_q3_mb')} MB, end {f.get('rss_end_mb')} MB, "
        f"peak {f.get('rss_peak_mb')} MB: last-quarter growth {f.get('last_quarter_growth', 0):+.2%} -> "
        f"{'FLAT' if f.get('flat') else 'NOT FLAT'} (threshold {args.flat_threshold:.0%})")
    log(f"checked texts: {len(checked) - len(wrong)}/{len(checked)} exact; finished requests with a wrong ending: {bad_finished}")
    log(f"wrote {out / (stem + '.json')} and {out / (stem + '.png')}")
    if wrong:
        log(f"first wrong texts: {wrong[:5]}")
    log(f"abandoned requests: {abandoned_evicted:,} evicted, {ends[(ABANDON, W.NONE)]:,} still live at the end; "
        f"requests evicted while going: {evicted_live}; aborted requests with an ending row: {aborted_with_ending}")
    ok = (f.get("flat") and not wrong and bad_finished == 0 and aborted_with_ending == 0 and evicted_live == 0
          and worker.duplicate_endings == 0 and rc == 0)
    if proc.returncode not in (0, None):
        log(detokd.log()[-3000:])
    return 0 if ok else 1


def parse_args(argv=None):
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
