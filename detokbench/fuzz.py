"""Fuzz run: N frames of honest and hostile traffic through a real detokd; does it
survive, stay exact, and keep its memory?

    honest scheduler (SchedulerClient) --\\
    hostile peer (raw PUSH)  ------------+--> `detokd serve` --text--> 2 workers (threads here)
    oversized senders (one PUSH each) --/

* Honest traffic: waves of 1..8 concurrent requests, real multilingual text encoded
  by the default tokenizer with random ids sprinkled in (detokbench.frames mixed_ids),
  half with a prompt tail, on both workers; one `tokens` frame per step through
  detokd.client.SchedulerClient; between waves, now and then a `flush` control (sent
  by the honest scheduler itself, so it never cuts a live honest request). Every
  honest text is compared at the end with Vocab.reference (the oracle).
* Hostile traffic, from another PUSH socket: every generator of detokbench.frames
  Hostile (malformed MessagePack, wrong types, unknown message types, ids outside the
  vocabulary, seq off, registers (refused: register is off by default), aborts of
  random rids, multipart messages...) and OverCaps (a rid over max_rid_len, rows over
  max_row_ids, max_wire_prompt_tail, max_stop_strings, max_stop_chars, max_meta_bytes,
  a row past its frame's max_frame_ids, frames over max_rows), plus sessions of "s-" requests that run a few steps and then
  end in a seq gap, an abort or a finish. Frames over max_frame_bytes go from a
  short-lived PUSH socket each (ZMQ drops that connection) and wait for the disconnect.
* detokd's RSS (/proc/<pid>/status VmRSS) is read after the warm-up (the first
  --warmup of the frames, which include every kind at least once, so first-use
  buffers and caches are in place) and at the end, each after a fence (a row on each
  input socket, answered: every frame before it was handled); VmHWM is the peak.
  /metrics is scraped at the end.

    python -m detokbench fuzz                   # 100,000 frames
    python -m detokbench fuzz --frames 3000 --json /tmp/f.json

Exit status 0 when detokd lived (and exited 0 on SIGTERM), every honest stream was
exact, hostile rows never got text, detokd counted exactly the frames it read, the
bad ones among them, the over-cap rows (too_large) and the refused registers, and the end RSS is within --rss-tolerance of the post-warm-up
RSS; 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import re
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from detokd.client import SchedulerClient
from detokd.process import DetokdProcess, ipc_config
from detokd.tokenizer import load
from detokd.wire.native import Finish

from .commands import command_line
from .frames import CORPUS, Hostile, OverCaps, mixed_ids
from .proc import memory

enc = msgspec.msgpack.encode
dec = msgspec.msgpack.decode
SEND_MS = 30_000  # a send detokd does not take in this long: detokd is stuck, the run fails
WAIT_S = 120  # for fences and the last honest rows

# Frames per kind, relative. Hostile's own generators keep their weights (53 in all).
OTHER_WEIGHTS = {
    "honest": 25, "session": 8, "huge_rid": 3, "many_stops": 2, "long_stops": 2,
    "over_prompt_tail": 1, "over_row_ids": 1, "over_frame_ids": 0.5, "huge_meta": 0.5, "over_rows": 0.1, "oversized": 0.1,
}


# --------------------------------------------------------------------------- workers


class Sink(threading.Thread):
    """A tokenizer worker: binds `address`, drains every message detokd sends it and
    checks it as it goes. Keeps the rows of honest ("h-") requests; of the others
    only counts (errors by kind, hostile rows that got text), so its memory is small."""

    def __init__(self, ctx: zmq.Context, index: int, address: str) -> None:
        super().__init__(daemon=True)
        self.index = index
        self.cond = threading.Condition()
        self.honest: dict[str, list[dict]] = collections.defaultdict(list)
        self.fences: set[str] = set()
        self.errors: collections.Counter = collections.Counter()
        self.messages = 0
        self.rows = 0
        self.problems: list[str] = []
        self.hostile_text = 0  # rows of "x-" rids that carried text: never allowed
        self.stopping = False
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 100)
        self.sock.bind(address)

    def run(self) -> None:
        while not self.stopping:
            try:
                frame = self.sock.recv()
            except zmq.Again:
                continue
            msg = dec(frame)
            with self.cond:
                self.messages += 1
                if msg.get("type") != "text":
                    self.problems.append(f"worker {self.index}: a {msg.get('type')!r} message")
                    continue
                for row in msg["rows"]:
                    self.rows += 1
                    rid = row["rid"]
                    if row["error"] is not None:
                        self.errors[row["error"]] += 1
                    if rid.startswith("h-"):
                        self.honest[rid].append(row)
                    elif rid.startswith("fence-"):
                        self.fences.add(rid)
                    elif rid.startswith("x-") and row["text"]:
                        self.hostile_text += 1
                self.cond.notify_all()
        self.sock.close(linger=0)

    def wait(self, pred, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not pred():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"timed out after {timeout} s waiting for {what}")
                self.cond.wait(min(left, 0.2))


# --------------------------------------------------------------------------- honest traffic


class HonestReq:
    def __init__(self, rid: str, ids: list[int], tail: list[int], skip: bool, worker: int) -> None:
        self.rid, self.ids, self.tail, self.skip, self.worker = rid, ids, tail, skip, worker
        self.pos = 0


class Honest:
    """The honest scheduler: waves of concurrent requests through SchedulerClient,
    one `tokens` frame per step; between waves, sometimes a `flush`."""

    def __init__(self, rng: random.Random, client: SchedulerClient, pieces, size: int, workers: int) -> None:
        self.rng, self.client, self.pieces, self.size, self.workers = rng, client, pieces, size, workers
        self.live: list[HonestReq] = []
        self.all: list[HonestReq] = []
        self.flushes = 0

    def _wave(self) -> None:
        rng = self.rng
        for _ in range(rng.randint(1, 8)):
            rid = f"h-{len(self.all)}"
            ids = mixed_ids(rng, rng.randint(10, 300), self.pieces, self.size)
            tail = mixed_ids(rng, rng.randint(1, 8), self.pieces, self.size) if rng.random() < 0.5 else []
            r = HonestReq(rid, ids, tail, rng.random() < 0.8, rng.randrange(self.workers))
            self.live.append(r)
            self.all.append(r)

    def step(self) -> str:
        """Send one frame; its kind ("honest" or "flush")."""
        if not self.live:
            if self.all and self.rng.random() < 0.3:
                self.client.control("flush")  # nothing of ours is live: drops only hostile states
                self.flushes += 1
                self._wave()
                return "flush"
            self._wave()
        batch = self.rng.sample(self.live, self.rng.randint(1, len(self.live)))
        for r in batch:
            self._add(r, self.rng.randint(1, 8))
        self.client.flush()
        self.live = [r for r in self.live if r.pos < len(r.ids)]
        return "honest"

    def _add(self, r: HonestReq, k: int) -> None:
        chunk = r.ids[r.pos : r.pos + k]
        first = r.pos == 0
        r.pos += len(chunk)
        finish = Finish("length") if r.pos >= len(r.ids) else None
        if first:
            self.client.begin(r.rid, chunk, worker=r.worker, prompt_tail=r.tail, skip_special_tokens=r.skip, finish=finish)
        else:
            self.client.add(r.rid, chunk, finish=finish)

    def finish_all(self) -> None:
        """The rest of every live request, in one last frame."""
        for r in self.live:
            self._add(r, len(r.ids))
        self.live = []
        self.client.flush()


# --------------------------------------------------------------------------- hostile traffic


class Sessions:
    """Hostile peers' own requests ("s-"): valid rows for a few steps, then a seq gap
    (sequence_gap), an abort (with random rids beside it) or a finish."""

    def __init__(self, rng: random.Random, pieces, size: int, workers: int) -> None:
        self.rng, self.pieces, self.size, self.workers = rng, pieces, size, workers
        self.live: dict[str, list[int]] = {}  # rid -> [seq, worker]
        self.n = 0
        self.ends: collections.Counter = collections.Counter()

    def next(self) -> bytes:
        rng = self.rng
        ids = mixed_ids(rng, rng.randint(1, 8), self.pieces, self.size)
        if len(self.live) < 16 and (not self.live or rng.random() < 0.3):
            self.n += 1
            rid, w = f"s-{self.n}", rng.randrange(self.workers)
            self.live[rid] = [len(ids), w]
            start = {"worker": w, "prompt_tail": ids[:3]} if rng.random() < 0.3 else {"worker": w}
            return enc({"type": "tokens", "rows": [{"rid": rid, "ids": ids, "start": start}]})
        rid = rng.choice(list(self.live))
        seq = self.live[rid][0]
        u = rng.random()
        if u < 0.55:
            self.live[rid][0] += len(ids)
            return enc({"type": "tokens", "rows": [{"rid": rid, "ids": ids, "seq": seq}]})
        del self.live[rid]
        if u < 0.7:
            self.ends["seq_gap"] += 1
            return enc({"type": "tokens", "rows": [{"rid": rid, "ids": ids, "seq": seq + rng.choice([-1, 1, 7, 2**40])}]})
        if u < 0.85:
            self.ends["abort"] += 1
            return enc({"type": "abort", "rids": [rid, f"x-nobody-{rng.randrange(10**9)}", "h-never"]})
        self.ends["finish"] += 1
        return enc({"type": "tokens", "rows": [{"rid": rid, "ids": ids, "seq": seq, "finish": {"reason": "stop"}}]})


def send_oversized(ctx: zmq.Context, address: str, frame: bytes) -> None:
    """A frame over max_frame_bytes, from a PUSH socket of its own: wait until ZMQ
    drops the connection (detokd never reads the frame)."""
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDTIMEO, SEND_MS)
    mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    mon.setsockopt(zmq.RCVTIMEO, SEND_MS)
    try:
        s.connect(address)
        s.send(frame, copy=False)
        try:
            while recv_monitor_message(mon)["event"] != zmq.EVENT_DISCONNECTED:
                pass
        except zmq.Again:
            raise RuntimeError(f"an oversized frame's sender was not cut off within {SEND_MS} ms") from None
    finally:
        s.disable_monitor()
        mon.close(0)
        s.close(0)


# --------------------------------------------------------------------------- looking at detokd


def scrape(port: int) -> dict:
    """/metrics: counters and gauges by name, labelled ones as {label value: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        body = r.read().decode()
    out: dict = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            if s.labels:
                (label,) = s.labels.values() if len(s.labels) == 1 else (repr(sorted(s.labels.items())),)
                out.setdefault(s.name, {})[label] = s.value
            else:
                out[s.name] = s.value
    return out


# --------------------------------------------------------------------------- the run


def build_kinds(hostile: Hostile, over: OverCaps, sessions: Sessions) -> tuple[dict, dict]:
    """kind -> generator returning (frame(s), bad) and kind -> weight."""
    gens, weights = {}, {}
    for w, gen in hostile.gens:
        gens[gen.__name__] = gen
        weights[gen.__name__] = w
    for name, w in OTHER_WEIGHTS.items():
        weights[name] = w
        if hasattr(over, name):
            gens[name] = getattr(over, name)
    gens["session"] = lambda: (sessions.next(), False)
    return gens, weights


def run(args: argparse.Namespace, command: str) -> dict:
    rng = random.Random(args.seed)
    t_start = time.monotonic()
    deadline = t_start + args.deadline
    folder = tempfile.mkdtemp(prefix="detokd-fuzz-")
    cfg = ipc_config(folder, workers=args.workers, metrics_port=0, log_level="info")
    vocab = load(cfg.tokenizer)
    pieces = [tuple(vocab.backend.encode(t, add_special_tokens=False).ids) for t in CORPUS]
    ctx = zmq.Context()
    sinks = [Sink(ctx, i, a) for i, a in enumerate(cfg.workers)]
    for s in sinks:
        s.start()
    d = DetokdProcess(cfg, folder=folder)
    problems: list[str] = []
    kinds: collections.Counter = collections.Counter()
    read = bad = 0  # frames detokd reads, and the bad ones among them, as the fuzzer counts them
    fences = 0
    rss: dict = {}
    samples: list[tuple[int, int]] = []  # (frames sent, VmRSS kB)
    honest = sessions = None
    metrics: dict = {}
    exit_code = None  # on our SIGTERM
    died = False  # exited before we stopped it
    try:
        d.start()
        port = int(re.search(r"health and metrics on port (\d+)", d.log()).group(1))
        client = SchedulerClient(cfg.input, context=ctx, send_timeout=SEND_MS / 1000)
        peer = ctx.socket(zmq.PUSH)
        peer.setsockopt(zmq.LINGER, 0)
        peer.setsockopt(zmq.SNDTIMEO, SEND_MS)
        peer.connect(cfg.input)
        honest = Honest(rng, client, pieces, vocab.size, args.workers)
        hostile = Hostile(rng, vocab.size)
        over = OverCaps(rng, cfg, quiet_id=min(vocab.special))
        sessions = Sessions(rng, pieces, vocab.size, args.workers)
        gens, weights = build_kinds(hostile, over, sessions)
        names = list(weights)
        wlist = [weights[n] for n in names]
        first = names[:]  # the warm-up starts with every kind once
        rng.shuffle(first)

        def fence() -> None:
            """A row on each input socket, answered: every frame sent before it is handled."""
            nonlocal fences, read
            rids = []
            for sock in ("peer", "client"):
                fences += 1
                rid = f"fence-{fences}"
                rids.append(rid)
                if sock == "peer":
                    peer.send(enc({"type": "tokens", "rows": [{"rid": rid, "ids": [100], "start": {}, "finish": {"reason": "length"}}]}))
                else:
                    client.begin(rid, [100], finish=Finish("length"))
                    client.flush()
                read += 1
            sinks[0].wait(lambda: all(r in sinks[0].fences for r in rids), WAIT_S, f"fences {rids}")

        warm = max(len(names), int(args.frames * args.warmup))
        sample_every = max(1, args.frames // 20)
        for i in range(args.frames):
            if i == warm:
                fence()
                rss["warm"] = memory(d.pid)
                rss["warm_at_frame"] = i
            name = first[i] if i < len(first) else rng.choices(names, wlist)[0]
            if name == "honest":
                name = honest.step()
                read += 1
            elif name == "oversized":
                send_oversized(ctx, cfg.input, over.oversized()[0])
            else:
                frame, is_bad = gens[name]()
                if isinstance(frame, list):
                    peer.send_multipart(frame)
                else:
                    peer.send(frame)
                read += 1
                bad += is_bad
            kinds[name] += 1
            if i % sample_every == sample_every - 1:
                samples.append((i + 1, memory(d.pid).rss_kb))  # no fence: the trend, not the verdict
            if i % 1000 == 999:
                if d.returncode is not None:
                    raise RuntimeError(f"detokd died (exit {d.returncode}) after {i + 1} frames")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"deadline of {args.deadline} s passed after {i + 1} frames")
        honest.finish_all()
        read += 1
        kinds["honest_last"] += 1
        for r in honest.all:
            sinks[r.worker].wait(
                lambda r=r, s=sinks[r.worker]: s.honest.get(r.rid) and s.honest[r.rid][-1]["finish"] is not None
                or any(x["error"] for x in s.honest.get(r.rid, ())),
                WAIT_S, f"honest request {r.rid} to end",
            )
        fence()
        rss["end"] = memory(d.pid)
        metrics = scrape(port)
        client.close(0)
        peer.close(0)
        died = d.returncode is not None
        exit_code = d.stop()
    except (RuntimeError, zmq.Again, zmq.ZMQError) as exc:
        problems.append(f"run stopped: {exc!r}")
        died = d.returncode is not None
    finally:
        if d.returncode is None:
            d.kill()
        for s in sinks:
            s.stopping = True
        for s in sinks:
            s.join(5)
        ctx.destroy(linger=0)
    wall = time.monotonic() - t_start
    log_lines = d.log().splitlines()

    # --- checks
    checked = exact = 0
    for r in honest.all if honest else ():
        rows = sinks[r.worker].honest.get(r.rid, [])
        checked += 1
        text = "".join(x["text"] for x in rows if x["error"] is None)
        errors = [x["error"] for x in rows if x["error"] is not None]
        want = vocab.reference(r.tail, r.ids, r.skip)
        others = [s.index for s in sinks if s is not sinks[r.worker] and r.rid in s.honest]
        if errors or text != want or not rows or rows[-1]["n_ids"] != len(r.ids) or others:
            if len(problems) < 20:
                problems.append(f"honest {r.rid}: errors {errors}, exact {text == want}, rows on workers {others} too")
        else:
            exact += 1
    for s in sinks:
        problems += s.problems[:10]
    hostile_text = sum(s.hostile_text for s in sinks)
    if hostile_text:
        problems.append(f"{hostile_text} hostile rows got text")
    if metrics:
        if metrics.get("detokd_frames_total") != read:
            problems.append(f"detokd_frames_total {metrics.get('detokd_frames_total')} != {read} frames read")
        if metrics.get("detokd_bad_frames_total") != bad:
            problems.append(f"detokd_bad_frames_total {metrics.get('detokd_bad_frames_total')} != {bad} bad frames sent")
        errors = metrics.get("detokd_errors_total", {})
        # Every over-cap row (all but over_rows, a bad frame) is one too_large; every register one refusal.
        capped = sum(
            kinds[k] for k in ("huge_rid", "over_row_ids", "over_frame_ids", "over_prompt_tail", "many_stops", "long_stops", "huge_meta")
        )
        if errors.get("too_large", 0) != capped:
            problems.append(f"too_large errors {errors.get('too_large', 0)} != {capped} over-cap rows sent")
        if errors.get("register_refused", 0) != kinds["odd_register"]:
            problems.append(f"register_refused {errors.get('register_refused', 0)} != {kinds['odd_register']} registers sent")
        if errors.get("internal"):
            problems.append("internal errors")
    if died:
        problems.append(f"detokd died: exit {d.returncode}\n" + "\n".join(log_lines[-30:]))
    elif exit_code not in (0, None):
        problems.append(f"detokd exited {exit_code} on SIGTERM")
    growth = None
    if "warm" in rss and "end" in rss:
        growth = rss["end"].rss_kb / rss["warm"].rss_kb - 1
        if growth > args.rss_tolerance:
            problems.append(f"RSS grew {growth:.1%} after the warm-up (> {args.rss_tolerance:.0%})")
    elif not problems:
        problems.append("RSS not sampled")

    return {
        "command": command,
        "frames": args.frames,
        "seed": args.seed,
        "workers": args.workers,
        "caps": {k: v for k, v in msgspec.structs.asdict(cfg).items() if k.startswith("max_")},
        "wall_s": round(wall, 1),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "frames_by_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "frames_read_by_detokd": read,
        "bad_frames_sent": bad,
        "sessions_ended": dict(sessions.ends) if sessions else {},
        "rss_kb": {
            "after_warmup": rss["warm"].rss_kb if "warm" in rss else None,
            "warmup_frames": rss.get("warm_at_frame"),
            "end": rss["end"].rss_kb if "end" in rss else None,
            "peak_hwm": last.hwm_kb if (last := rss.get("end", rss.get("warm"))) else None,
            "growth": None if growth is None else round(growth, 4),
            "tolerance": args.rss_tolerance,
            "samples": samples,
        },
        "metrics": {k: v for k, v in metrics.items() if k.startswith("detokd_") and not k.startswith(("detokd_step", "detokd_loop"))},
        "worker_errors": {str(s.index): dict(s.errors) for s in sinks},
        "honest": {
            "requests": checked,
            "exact": exact,
            "ids": sum(len(r.ids) for r in honest.all) if honest else 0,
            "flushes": honest.flushes if honest else 0,
        },
        "log_lines": len(log_lines),
        "problems": problems,
        "ok": not problems,
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m detokbench fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=100_000, help="frames to send (default 100,000)")
    ap.add_argument("--seed", type=int, default=20250101)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--warmup", type=float, default=0.05, help="share of the frames before the first RSS sample")
    ap.add_argument("--rss-tolerance", type=float, default=0.10, help="end RSS may be this much above the post-warm-up RSS")
    ap.add_argument("--deadline", type=float, default=1800, help="seconds: the run fails if it has not finished by then")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    res = run(args, command_line("fuzz", argv))
    r = res["rss_kb"]
    print(f"{res['frames']} frames in {res['wall_s']} s (seed {res['seed']}): {res['frames_read_by_detokd']} read by detokd, "
          f"{res['bad_frames_sent']} bad; by kind: {res['frames_by_kind']}")
    print(f"honest: {res['honest']['exact']}/{res['honest']['requests']} requests exact ({res['honest']['ids']} ids, "
          f"{res['honest']['flushes']} flushes)")
    print(f"RSS kB: after warm-up {r['after_warmup']}, end {r['end']}, peak {r['peak_hwm']}, growth {r['growth']}")
    m = res["metrics"]
    print(f"detokd: frames {m.get('detokd_frames_total')}, bad frames {m.get('detokd_bad_frames_total')}, "
          f"errors {m.get('detokd_errors_total')}, memory entries {m.get('detokd_memory_entries')}, bytes {m.get('detokd_memory_bytes')}, "
          f"log lines {res['log_lines']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    for p in res["problems"]:
        print("FAIL:", p)
    print("OK" if res["ok"] else "FAILED")
    return 0 if res["ok"] else 1

