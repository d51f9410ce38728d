"""Fuzz run: N frames of honest and hostile traffic through a real detokd; does it
survive, stay exact, and keep its memory? docs/reliability.md, "Fuzz run", says what
is sent and how it is checked.

    python -m detokbench fuzz                   # 100,000 frames
    python -m detokbench fuzz --frames 3000 --json /tmp/f.json

Exit status 0 when detokd lived (and exited 0 on SIGTERM), every honest stream was
exact, hostile rows never got text, detokd counted exactly the frames, bad frames,
too_large rows and refused registers it was sent, and the end RSS is within
--rss-tolerance of the post-warm-up RSS; 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import random
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from detokd.client import SchedulerClient
from detokd.tokenizer import load
from detokd.wire.native import Finish
from detokrig.frames import CORPUS, Hostile, OverCaps, mixed_ids
from detokrig.proc import Memory
from detokrig.rig import Rig
from detokrig.sink import Recorder

from .commands import header, parser, verdict

enc = msgspec.msgpack.encode
SEND_MS = 30_000  # a send detokd does not take in this long: detokd is stuck, the run fails
WAIT_S = 120  # for fences and the last honest rows
# Frames per kind, relative. Hostile's own generators keep their weights (53 in all).
OTHER_WEIGHTS = {
    "honest": 25, "session": 8, "huge_rid": 3, "many_stops": 2, "long_stops": 2, "over_prompt_tail": 1,
    "over_row_ids": 1, "over_frame_ids": 0.5, "huge_meta": 0.5, "over_rows": 0.1, "oversized": 0.1,
}
# Every row over a cap but over_rows (a bad frame) is one too_large error.
CAPPED_KINDS = ("huge_rid", "over_row_ids", "over_frame_ids", "over_prompt_tail", "many_stops", "long_stops",
                "huge_meta")


@dataclass
class HonestReq:
    rid: str
    ids: list[int]
    tail: list[int]
    skip: bool  # skip_special_tokens
    worker: int
    pos: int = 0  # ids sent so far


class Honest:
    """The honest scheduler: waves of concurrent requests through SchedulerClient,
    one `tokens` frame per step; between waves, sometimes a `flush`."""

    def __init__(self, rng: random.Random, client: SchedulerClient | None, pieces, size: int, workers: int) -> None:
        self.rng, self.client, self.pieces, self.size, self.workers = rng, client, pieces, size, workers
        self.live: list[HonestReq] = []
        self.all: list[HonestReq] = []
        self.flushes = 0

    def _wave(self) -> None:
        rng = self.rng
        for _ in range(rng.randint(1, 8)):
            ids = mixed_ids(rng, rng.randint(10, 300), self.pieces, self.size)
            tail = mixed_ids(rng, rng.randint(1, 8), self.pieces, self.size) if rng.random() < 0.5 else []
            skip, worker = rng.random() < 0.8, rng.randrange(self.workers)
            self.live.append(HonestReq(f"h-{len(self.all)}", ids, tail, skip, worker))
            self.all.append(self.live[-1])

    def step(self) -> str:
        """Send one frame; its kind ("honest" or "flush")."""
        if not self.live:
            if self.all and self.rng.random() < 0.3:
                self.client.control("flush")  # nothing of ours is live: drops only hostile states
                self.flushes += 1
                self._wave()
                return "flush"
            self._wave()
        for r in self.rng.sample(self.live, self.rng.randint(1, len(self.live))):
            self._add(r, self.rng.randint(1, 8))
        self.client.flush()
        self.live = [r for r in self.live if r.pos < len(r.ids)]
        return "honest"

    def _add(self, r: HonestReq, k: int) -> None:
        chunk, first = r.ids[r.pos : r.pos + k], r.pos == 0
        r.pos += len(chunk)
        finish = Finish("length") if r.pos >= len(r.ids) else None
        if first:
            self.client.begin(r.rid, chunk, worker=r.worker, prompt_tail=r.tail, skip_special_tokens=r.skip,
                              finish=finish)
        else:
            self.client.add(r.rid, chunk, finish=finish)

    def finish_all(self) -> None:
        """The rest of every live request, in one last frame."""
        for r in self.live:
            self._add(r, len(r.ids))
        self.live = []
        self.client.flush()


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
        seq, u = self.live[rid][0], rng.random()
        if u < 0.55:
            self.live[rid][0] += len(ids)
            return enc({"type": "tokens", "rows": [{"rid": rid, "ids": ids, "seq": seq}]})
        del self.live[rid]
        if u < 0.7:
            self.ends["seq_gap"] += 1
            seq += rng.choice([-1, 1, 7, 2**40])
            return enc({"type": "tokens", "rows": [{"rid": rid, "ids": ids, "seq": seq}]})
        if u < 0.85:
            self.ends["abort"] += 1
            return enc({"type": "abort", "rids": [rid, f"x-nobody-{rng.randrange(10**9)}", "h-never"]})
        self.ends["finish"] += 1
        return enc({"type": "tokens", "rows": [{"rid": rid, "ids": ids, "seq": seq, "finish": {"reason": "stop"}}]})


def send_oversized(ctx: zmq.Context, address: str, frame: bytes, send_ms: int) -> None:
    """A frame over max_frame_bytes, from a PUSH socket of its own: wait until ZMQ
    drops the connection (detokd never reads the frame). The monitor is set before the
    socket connects, so no event is missed."""
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDTIMEO, send_ms)
    mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    mon.setsockopt(zmq.RCVTIMEO, send_ms)
    try:
        s.connect(address)
        s.send(frame, copy=False)
        try:
            while recv_monitor_message(mon)["event"] != zmq.EVENT_DISCONNECTED:
                pass
        except zmq.Again:
            raise RuntimeError(f"an oversized frame's sender was not cut off within {send_ms} ms") from None
    finally:
        s.disable_monitor()
        mon.close(0)
        s.close(0)


class Worker(Recorder):
    """Keeps the rows of honest ("h-") requests and the fences; of the others only
    counts (errors by kind, hostile rows that got text), so its memory stays small."""

    def __init__(self, ctx: zmq.Context, index: int, address: str) -> None:
        self.index = index
        self.fences: set[str] = set()
        self.error_kinds: collections.Counter = collections.Counter()
        self.problems: list[str] = []
        self.hostile_text = 0  # rows of "x-" rids that carried text: never allowed
        super().__init__(ctx, [address])

    def keep(self, msg: dict) -> None:
        if msg.get("type") != "text":
            self.problems.append(f"worker {self.index}: a {msg.get('type')!r} message")
            return
        for row in msg["rows"]:
            rid = row["rid"]
            if row["error"] is not None:
                self.error_kinds[row["error"]] += 1
            if rid.startswith("fence-"):
                self.fences.add(rid)
            elif rid.startswith("x-") and row["text"]:
                self.hostile_text += 1
        super().keep({"type": "text", "rows": [r for r in msg["rows"] if r["rid"].startswith("h-")]})


class Fuzz:
    """A detokd, its workers and its peers for one run; the steps of the run and what
    was sent, as detokd must count it."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.t_start = time.monotonic()
        self.rig = Rig("detokd-fuzz-", lambda ctx, addrs: [Worker(ctx, i, a) for i, a in enumerate(addrs)],
                       workers=args.workers)
        self.cfg, self.workers, self.d = self.rig.cfg, self.rig.sinks, self.rig.detokd
        self.vocab = load(self.cfg.tokenizer)
        self.pieces = [tuple(self.vocab.backend.encode(t, add_special_tokens=False).ids) for t in CORPUS]
        self.read = self.bad = self.fences = 0  # frames detokd reads, the bad ones among them, fences sent
        self.kinds: collections.Counter = collections.Counter()
        self.warm: Memory | None = None  # RSS after the warm-up and at the end, each after a fence
        self.warm_at: int | None = None
        self.end: Memory | None = None
        self.samples: list[list[int]] = []  # [frames sent, RSS kB] on the way (no fence: not the verdict)
        self.honest = Honest(self.rng, None, self.pieces, self.vocab.size, args.workers)  # its client once detokd is up
        self.over = OverCaps(self.rng, self.cfg, quiet_id=min(self.vocab.special))
        self.sessions = Sessions(self.rng, self.pieces, self.vocab.size, args.workers)
        hostile = Hostile(self.rng, self.vocab.size)
        self.gens = {g.__name__: g for _, g in hostile.gens}
        self.gens |= {n: getattr(self.over, n) for n in OTHER_WEIGHTS if hasattr(self.over, n)}
        self.gens["session"] = lambda: (self.sessions.next(), False)
        self.weights = {g.__name__: w for w, g in hostile.gens} | OTHER_WEIGHTS
        self.metrics: dict = {}
        self.exit_code: int | str | None = None  # on our SIGTERM
        self.problems: list[str] = []

    def start(self) -> None:
        """detokd ready, the peers connected."""
        self.rig.start()
        self.client = self.honest.client = self.rig.client(send_timeout=SEND_MS / 1000)
        self.peer = self.rig.engine(SEND_MS)

    def traffic(self) -> None:
        """--frames frames; the warm-up starts with every kind once."""
        args, names = self.args, list(self.weights)
        wlist = [self.weights[n] for n in names]
        first = names[:]
        self.rng.shuffle(first)
        warm = max(len(names), int(args.frames * args.warmup))
        sample_every = max(1, args.frames // 20)
        for i in range(args.frames):
            if i == warm:
                self.fence()
                self.warm, self.warm_at = self.rig.memory(), i
            name = first[i] if i < len(first) else self.rng.choices(names, wlist)[0]
            self.kinds[self.send(name)] += 1
            if i % sample_every == sample_every - 1:
                self.samples.append([i + 1, self.rig.memory().rss_kb])
            if i % 1000 == 999:
                if self.d.returncode is not None:
                    raise RuntimeError(f"detokd died (exit {self.d.returncode}) after {i + 1} frames")
                if time.monotonic() > self.t_start + args.deadline:
                    raise RuntimeError(f"deadline of {args.deadline} s passed after {i + 1} frames")

    def send(self, name: str) -> str:
        """One frame of kind `name`; the kind it was (the honest scheduler may flush)."""
        if name == "honest":
            self.read += 1
            return self.honest.step()
        if name == "oversized":
            send_oversized(self.rig.ctx, self.cfg.input, self.over.oversized()[0], SEND_MS)
            return name
        frame, is_bad = self.gens[name]()
        self.peer.multipart(frame) if isinstance(frame, list) else self.peer.raw(frame)
        self.read += 1
        self.bad += is_bad
        return name

    def fence(self) -> None:
        """A row on each input socket, answered: every frame sent before it is handled."""
        rids = [f"fence-{self.fences + 1}", f"fence-{self.fences + 2}"]
        self.fences += 2
        self.read += 2
        self.peer.rows([{"rid": rids[0], "ids": [100], "start": {}, "finish": {"reason": "length"}}])
        self.client.begin(rids[1], [100], finish=Finish("length"))
        self.client.flush()
        w = self.workers[0]
        w.wait(lambda: all(r in w.fences for r in rids), WAIT_S, f"fences {rids}")

    def finish(self) -> None:
        """The rest of the honest requests, every one answered; the last RSS and
        /metrics; detokd stopped by SIGTERM."""
        self.honest.finish_all()
        self.read += 1
        self.kinds["honest_last"] += 1
        for r in self.honest.all:
            w = self.workers[r.worker]
            w.wait(lambda r=r, w=w: w.ended(r.rid) or w.errors(r.rid), WAIT_S, f"honest request {r.rid} to end")
        self.fence()
        self.end = self.rig.memory()
        self.metrics = self.rig.metrics()
        self.client.close(0)
        self.peer.close()
        self.exit_code = self.rig.stop(20)

    def check_honest(self) -> tuple[int, int]:
        """(honest requests, exact ones): each answered on its own worker only, its text
        the oracle's, its last row's n_ids its length."""
        exact = 0
        for r in self.honest.all:
            w = self.workers[r.worker]
            rows, text, errors = w.rows(r.rid), w.text(r.rid), w.errors(r.rid)
            want = self.vocab.reference(r.tail, r.ids, r.skip)
            others = [o.index for o in self.workers if o is not w and o.rows(r.rid)]
            if errors or text != want or not rows or rows[-1]["n_ids"] != len(r.ids) or others:
                if len(self.problems) < 20:
                    self.problems.append(f"honest {r.rid}: errors {errors}, exact {text == want}, "
                                         f"rows on workers {others} too")
            else:
                exact += 1
        for w in self.workers:
            self.problems += w.problems[:10]
        hostile_text = sum(w.hostile_text for w in self.workers)
        if hostile_text:
            self.problems.append(f"{hostile_text} hostile rows got text")
        return len(self.honest.all), exact

    def check_counts(self) -> None:
        """detokd counted every frame it read, the bad ones, the over-cap rows and the
        refused registers exactly as they were sent."""
        m, errors = self.metrics, self.metrics.get("detokd_errors_total", {})
        if not m:
            return
        capped = sum(self.kinds[k] for k in CAPPED_KINDS)
        for what, got, want, sent in (
            ("detokd_frames_total", m.get("detokd_frames_total"), self.read, "frames read"),
            ("detokd_bad_frames_total", m.get("detokd_bad_frames_total"), self.bad, "bad frames sent"),
            ("too_large errors", errors.get("too_large", 0), capped, "over-cap rows sent"),
            ("register_refused", errors.get("register_refused", 0), self.kinds["odd_register"], "registers sent"),
        ):
            if got != want:
                self.problems.append(f"{what} {got} != {want} {sent}")
        if errors.get("internal"):
            self.problems.append("internal errors")

    def check_rss(self) -> float | None:
        """End RSS over post-warm-up RSS, minus 1; a problem past --rss-tolerance."""
        if self.warm is None or self.end is None:
            if not self.problems:
                self.problems.append("RSS not sampled")
            return None
        growth = self.end.rss_kb / self.warm.rss_kb - 1
        if growth > self.args.rss_tolerance:
            self.problems.append(f"RSS grew {growth:.1%} after the warm-up (> {self.args.rss_tolerance:.0%})")
        return growth


def run(args: argparse.Namespace, head: dict) -> dict:
    fz = Fuzz(args)
    try:
        fz.start()
        fz.traffic()
        fz.finish()
    except (RuntimeError, TimeoutError, zmq.ZMQError) as exc:
        fz.problems.append(f"run stopped: {exc!r}")
        fz.rig.died = fz.d.returncode is not None
    finally:
        fz.rig.close()
    wall = time.monotonic() - fz.t_start
    checked, exact = fz.check_honest()
    fz.check_counts()
    if problem := fz.rig.exit_problem(fz.exit_code):
        fz.problems.append(problem)
    growth = fz.check_rss()
    last = fz.end or fz.warm
    return {
        **head,
        "frames": args.frames,
        "seed": args.seed,
        "workers": args.workers,
        "caps": {k: v for k, v in msgspec.structs.asdict(fz.cfg).items() if k.startswith("max_")},
        "wall_s": round(wall, 1),
        "frames_by_kind": dict(sorted(fz.kinds.items(), key=lambda kv: -kv[1])),
        "frames_read_by_detokd": fz.read,
        "bad_frames_sent": fz.bad,
        "sessions_ended": dict(fz.sessions.ends),
        "rss_kb": {
            "after_warmup": fz.warm.rss_kb if fz.warm else None,
            "warmup_frames": fz.warm_at,
            "end": fz.end.rss_kb if fz.end else None,
            "peak_hwm": last.hwm_kb if last else None,
            "growth": None if growth is None else round(growth, 4),
            "tolerance": args.rss_tolerance,
            "samples": fz.samples,
        },
        "metrics": {k: v for k, v in fz.metrics.items()
                    if k.startswith("detokd_") and not k.startswith(("detokd_step", "detokd_loop"))},
        "worker_errors": {str(w.index): dict(w.error_kinds) for w in fz.workers},
        "honest": {
            "requests": checked,
            "exact": exact,
            "ids": sum(len(r.ids) for r in fz.honest.all),
            "flushes": fz.honest.flushes,
        },
        "log_lines": len(fz.d.log().splitlines()),
        "problems": fz.problems,
        "ok": not fz.problems,
    }


def summary(res: dict) -> str:
    r, m, h = res["rss_kb"], res["metrics"], res["honest"]
    return "\n".join([
        f"{res['frames']} frames in {res['wall_s']} s (seed {res['seed']}): "
        f"{res['frames_read_by_detokd']} read by detokd, "
        f"{res['bad_frames_sent']} bad; by kind: {res['frames_by_kind']}",
        f"honest: {h['exact']}/{h['requests']} requests exact ({h['ids']} ids, {h['flushes']} flushes)",
        f"RSS kB: after warm-up {r['after_warmup']}, end {r['end']}, peak {r['peak_hwm']}, growth {r['growth']}",
        f"detokd: frames {m.get('detokd_frames_total')}, bad frames {m.get('detokd_bad_frames_total')}, "
        f"errors {m.get('detokd_errors_total')}, memory entries {m.get('detokd_memory_entries')}, "
        f"bytes {m.get('detokd_memory_bytes')}, "
        f"log lines {res['log_lines']}",
    ])


def main(argv: list[str]) -> int:
    ap = parser("fuzz", __doc__)
    ap.add_argument("--frames", type=int, default=100_000, help="frames to send (default 100,000)")
    ap.add_argument("--seed", type=int, default=20250101)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--warmup", type=float, default=0.05, help="share of the frames before the first RSS sample")
    ap.add_argument("--rss-tolerance", type=float, default=0.10, help="end RSS may be this much above post-warm-up")
    ap.add_argument("--deadline", type=float, default=1800, help="seconds: the run fails if not finished by then")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    res = run(args, header("fuzz", argv))
    print(summary(res))
    return verdict(res["problems"], args.json, res)
