"""One fuzz run, in steps: start detokd and its peers, send the frames, drain, judge."""

from __future__ import annotations

import argparse
import collections
import os
import platform
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq

from detokd.client import SchedulerClient
from detokd.process import ipc_config
from detokd.tokenizer import load
from detokd.wire.native import Finish

from ..children import detokd_process
from ..engine import Engine
from ..frames import CORPUS, Hostile, OverCaps
from ..metrics import metrics_port, scrape
from ..proc import Memory, memory
from .traffic import Honest, Sessions, build_kinds, send_oversized
from .workers import Worker

enc = msgspec.msgpack.encode
SEND_MS = 30_000  # a send detokd does not take in this long: detokd is stuck, the run fails
WAIT_S = 120  # for fences and the last honest rows
# Every row over a cap but over_rows (a bad frame) is one too_large error.
CAPPED_KINDS = ("huge_rid", "over_row_ids", "over_frame_ids", "over_prompt_tail", "many_stops", "long_stops", "huge_meta")


@dataclass
class Counts:
    """What was sent, as detokd must count it."""

    read: int = 0  # frames detokd reads
    bad: int = 0  # the bad ones among them
    fences: int = 0
    kinds: collections.Counter = field(default_factory=collections.Counter)


@dataclass(frozen=True)
class RssSample:
    frames: int  # sent so far
    rss_kb: int


@dataclass
class RssLog:
    """detokd's memory after the warm-up and at the end (each after a fence), and a
    trend sampled on the way (no fence: not the verdict)."""

    warm: Memory | None = None
    warm_at_frame: int | None = None
    end: Memory | None = None
    samples: list[RssSample] = field(default_factory=list)


class Fuzz:
    """A detokd, its workers and its peers for one run; the steps of the run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.t_start = time.monotonic()
        self.folder = tempfile.mkdtemp(prefix="detokd-fuzz-")
        self.cfg = ipc_config(self.folder, workers=args.workers, metrics_port=0, log_level="info")
        self.vocab = load(self.cfg.tokenizer)
        self.pieces = [tuple(self.vocab.backend.encode(t, add_special_tokens=False).ids) for t in CORPUS]
        self.ctx = zmq.Context()
        self.workers = [Worker(self.ctx, i, a) for i, a in enumerate(self.cfg.workers)]
        self.d = detokd_process(self.cfg, Path(self.folder))
        self.counts = Counts()
        self.rss = RssLog()
        self.honest: Honest | None = None
        self.sessions: Sessions | None = None
        self.metrics: dict = {}
        self.exit_code: int | None = None  # on our SIGTERM
        self.died = False  # exited before we stopped it
        self.problems: list[str] = []

    def start(self) -> None:
        """detokd ready, the peers connected, every kind of frame ready to be made."""
        self.d.start()
        self.port = metrics_port(self.d)
        self.client = SchedulerClient(self.cfg.input, context=self.ctx, send_timeout=SEND_MS / 1000)
        self.peer = Engine(self.ctx, self.cfg.input, SEND_MS)
        self.honest = Honest(self.rng, self.client, self.pieces, self.vocab.size, self.args.workers)
        self.over = OverCaps(self.rng, self.cfg, quiet_id=min(self.vocab.special))
        self.sessions = Sessions(self.rng, self.pieces, self.vocab.size, self.args.workers)
        self.gens, self.weights = build_kinds(Hostile(self.rng, self.vocab.size), self.over, self.sessions)

    def traffic(self) -> None:
        """--frames frames; the warm-up starts with every kind once."""
        args, pid = self.args, self.d.pid
        names = list(self.weights)
        wlist = [self.weights[n] for n in names]
        first = names[:]
        self.rng.shuffle(first)
        warm = max(len(names), int(args.frames * args.warmup))
        sample_every = max(1, args.frames // 20)
        for i in range(args.frames):
            if i == warm:
                self.fence()
                self.rss.warm, self.rss.warm_at_frame = memory(pid), i
            name = first[i] if i < len(first) else self.rng.choices(names, wlist)[0]
            self.counts.kinds[self.send(name)] += 1
            if i % sample_every == sample_every - 1:
                self.rss.samples.append(RssSample(i + 1, memory(pid).rss_kb))
            if i % 1000 == 999:
                self.still_going(i + 1)

    def send(self, name: str) -> str:
        """One frame of kind `name`; the kind it was (the honest scheduler may flush)."""
        if name == "honest":
            self.counts.read += 1
            return self.honest.step()
        if name == "oversized":
            send_oversized(self.ctx, self.cfg.input, self.over.oversized()[0], SEND_MS)
            return name
        frame, is_bad = self.gens[name]()
        self.peer.send(frame)
        self.counts.read += 1
        self.counts.bad += is_bad
        return name

    def still_going(self, sent: int) -> None:
        if self.d.returncode is not None:
            raise RuntimeError(f"detokd died (exit {self.d.returncode}) after {sent} frames")
        if time.monotonic() > self.t_start + self.args.deadline:
            raise RuntimeError(f"deadline of {self.args.deadline} s passed after {sent} frames")

    def fence(self) -> None:
        """A row on each input socket, answered: every frame sent before it is handled."""
        rids = []
        for via in ("peer", "client"):
            self.counts.fences += 1
            rid = f"fence-{self.counts.fences}"
            rids.append(rid)
            if via == "peer":
                self.peer.send(enc({"type": "tokens", "rows": [{"rid": rid, "ids": [100], "start": {}, "finish": {"reason": "length"}}]}))
            else:
                self.client.begin(rid, [100], finish=Finish("length"))
                self.client.flush()
            self.counts.read += 1
        w = self.workers[0]
        w.wait(lambda: all(r in w.fences for r in rids), WAIT_S, f"fences {rids}")

    def finish(self) -> None:
        """The rest of the honest requests, every one answered; the last RSS and
        /metrics; detokd stopped by SIGTERM."""
        self.honest.finish_all()
        self.counts.read += 1
        self.counts.kinds["honest_last"] += 1
        for r in self.honest.all:
            w = self.workers[r.worker]
            w.wait(lambda r=r, w=w: w.ended(r.rid), WAIT_S, f"honest request {r.rid} to end")
        self.fence()
        self.rss.end = memory(self.d.pid)
        self.metrics = scrape(self.port)
        self.client.close(0)
        self.peer.close()
        self.died = self.d.returncode is not None
        self.exit_code = self.d.stop()

    def close(self) -> None:
        if self.d.returncode is None:
            self.d.kill()
        for w in self.workers:
            w.close()
        self.ctx.destroy(linger=0)


def run(args: argparse.Namespace, command: str) -> dict:
    fz = Fuzz(args)
    try:
        fz.start()
        fz.traffic()
        fz.finish()
    except (RuntimeError, TimeoutError, zmq.Again, zmq.ZMQError) as exc:
        fz.problems.append(f"run stopped: {exc!r}")
        fz.died = fz.d.returncode is not None
    finally:
        fz.close()
    wall = time.monotonic() - fz.t_start
    log_lines = fz.d.log().splitlines()
    checked, exact = check_honest(fz)
    check_counts(fz)
    check_exit(fz, log_lines)
    growth = check_rss(fz)
    return result(fz, command, wall, log_lines, checked, exact, growth)


# --------------------------------------------------------------------------- the verdict


def check_honest(fz: Fuzz) -> tuple[int, int]:
    """(honest requests, exact ones): each answered on its own worker only, its text
    the oracle's, its last row's n_ids its length."""
    checked = exact = 0
    for r in fz.honest.all if fz.honest else ():
        w = fz.workers[r.worker]
        rows = w.honest.get(r.rid, [])
        checked += 1
        text = "".join(x["text"] for x in rows if x["error"] is None)
        errors = [x["error"] for x in rows if x["error"] is not None]
        want = fz.vocab.reference(r.tail, r.ids, r.skip)
        others = [o.index for o in fz.workers if o is not w and r.rid in o.honest]
        if errors or text != want or not rows or rows[-1]["n_ids"] != len(r.ids) or others:
            if len(fz.problems) < 20:
                fz.problems.append(f"honest {r.rid}: errors {errors}, exact {text == want}, rows on workers {others} too")
        else:
            exact += 1
    for w in fz.workers:
        fz.problems += w.problems[:10]
    hostile_text = sum(w.hostile_text for w in fz.workers)
    if hostile_text:
        fz.problems.append(f"{hostile_text} hostile rows got text")
    return checked, exact


def check_counts(fz: Fuzz) -> None:
    """detokd counted every frame it read, the bad ones, the over-cap rows and the
    refused registers exactly as they were sent."""
    m, kinds = fz.metrics, fz.counts.kinds
    if not m:
        return
    if m.get("detokd_frames_total") != fz.counts.read:
        fz.problems.append(f"detokd_frames_total {m.get('detokd_frames_total')} != {fz.counts.read} frames read")
    if m.get("detokd_bad_frames_total") != fz.counts.bad:
        fz.problems.append(f"detokd_bad_frames_total {m.get('detokd_bad_frames_total')} != {fz.counts.bad} bad frames sent")
    errors = m.get("detokd_errors_total", {})
    capped = sum(kinds[k] for k in CAPPED_KINDS)
    if errors.get("too_large", 0) != capped:
        fz.problems.append(f"too_large errors {errors.get('too_large', 0)} != {capped} over-cap rows sent")
    if errors.get("register_refused", 0) != kinds["odd_register"]:
        fz.problems.append(f"register_refused {errors.get('register_refused', 0)} != {kinds['odd_register']} registers sent")
    if errors.get("internal"):
        fz.problems.append("internal errors")


def check_exit(fz: Fuzz, log_lines: list[str]) -> None:
    if fz.died:
        fz.problems.append(f"detokd died: exit {fz.d.returncode}\n" + "\n".join(log_lines[-30:]))
    elif fz.exit_code not in (0, None):
        fz.problems.append(f"detokd exited {fz.exit_code} on SIGTERM")


def check_rss(fz: Fuzz) -> float | None:
    """End RSS over post-warm-up RSS, minus 1; a problem past --rss-tolerance."""
    if fz.rss.warm is None or fz.rss.end is None:
        if not fz.problems:
            fz.problems.append("RSS not sampled")
        return None
    growth = fz.rss.end.rss_kb / fz.rss.warm.rss_kb - 1
    if growth > fz.args.rss_tolerance:
        fz.problems.append(f"RSS grew {growth:.1%} after the warm-up (> {fz.args.rss_tolerance:.0%})")
    return growth


def result(fz: Fuzz, command: str, wall: float, log_lines: list[str], checked: int, exact: int, growth: float | None) -> dict:
    args, rss, last = fz.args, fz.rss, fz.rss.end or fz.rss.warm
    return {
        "command": command,
        "frames": args.frames,
        "seed": args.seed,
        "workers": args.workers,
        "caps": {k: v for k, v in msgspec.structs.asdict(fz.cfg).items() if k.startswith("max_")},
        "wall_s": round(wall, 1),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "frames_by_kind": dict(sorted(fz.counts.kinds.items(), key=lambda kv: -kv[1])),
        "frames_read_by_detokd": fz.counts.read,
        "bad_frames_sent": fz.counts.bad,
        "sessions_ended": dict(fz.sessions.ends) if fz.sessions else {},
        "rss_kb": {
            "after_warmup": rss.warm.rss_kb if rss.warm else None,
            "warmup_frames": rss.warm_at_frame,
            "end": rss.end.rss_kb if rss.end else None,
            "peak_hwm": last.hwm_kb if last else None,
            "growth": None if growth is None else round(growth, 4),
            "tolerance": args.rss_tolerance,
            "samples": [[s.frames, s.rss_kb] for s in rss.samples],
        },
        "metrics": {k: v for k, v in fz.metrics.items() if k.startswith("detokd_") and not k.startswith(("detokd_step", "detokd_loop"))},
        "worker_errors": {str(w.index): dict(w.errors) for w in fz.workers},
        "honest": {
            "requests": checked,
            "exact": exact,
            "ids": sum(len(r.ids) for r in fz.honest.all) if fz.honest else 0,
            "flushes": fz.honest.flushes if fz.honest else 0,
        },
        "log_lines": len(log_lines),
        "problems": fz.problems,
        "ok": not fz.problems,
    }
