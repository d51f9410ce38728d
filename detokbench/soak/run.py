"""One soak run, in steps: start, churn until every request was sent, drain, judge."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from detokd.client import SchedulerClient
from detokd.config import Config
from detokd.process import DetokdProcess, NotReady
from detokd.tokenizer import load

from ..children import detokd_process
from ..metrics import metrics_port, scrape
from ..waits import wait_until
from .churn import Churn, Fate
from .plot import plot
from .sampler import Sampler, flatness, log
from .worker import Ending, Worker

DRAIN_S = 120  # after the last frame, for detokd to decode it all and the worker to get it
LOG_EVERY_S = 15


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
        return d, metrics_port(d)
    except NotReady as e:
        sys.exit(f"detokd did not start:\n{str(e)[-3000:]}")
    except TimeoutError:
        d.kill()
        sys.exit(f"detokd logged no metrics port:\n{d.log()[-3000:]}")


@dataclass
class Verdict:
    """How the requests ended, against how they were meant to."""

    bad_finished: int  # finished requests without a right finish row
    evicted_live: int  # evicted while the engine still sent rows
    aborted_with_ending: int  # aborted requests that got a finish row or an error
    abandoned_evicted: int
    abandoned_live: int  # abandoned requests still in detokd's table at the end
    wrong_texts: list[str]

    def ok(self, worker: Worker, flat: dict, rc) -> bool:
        return bool(flat.get("flat") and not self.wrong_texts and self.bad_finished == 0 and self.aborted_with_ending == 0
                    and self.evicted_live == 0 and worker.duplicate_endings == 0 and rc == 0)


class Soak:
    """The engine, the worker, detokd and the sampler of one run."""

    def __init__(self, args) -> None:
        self.args = args
        self.vocab = load("deepseek")
        self.tmp = Path(tempfile.mkdtemp(prefix="detokd-soak-"))
        self.ctx = zmq.Context()
        self.churn = Churn(args, self.vocab.hf, client=None)  # the client comes once detokd is up
        # The worker binds its addresses first: detokd connects to them.
        self.worker = Worker(self.ctx, [f"ipc://{self.tmp}/w{i}.sock" for i in range(args.workers)], self.churn.lengths, self.churn.fates)
        self.detokd, self.port = start_detokd(self.tmp, args)
        self.churn.client = SchedulerClient(self.detokd.input, context=self.ctx, sndhwm=1000, send_timeout=30)
        self.t0 = time.monotonic()
        self.sampler = Sampler(self.detokd.pid, self.port, args.interval, self.t0)
        self.sampler.sample()
        self.sampler.start()
        log(f"detokd pid {self.detokd.pid}, metrics on port {self.port}; {args.requests:,} requests, about {args.tokens:,} tokens")

    def send_all(self) -> float:
        """Churn until every request was made and sent; the seconds it took."""
        churn, last_log = self.churn, time.monotonic()
        while churn.going:
            for rid in churn.refill():
                self.worker.watch(rid)
            churn.step()
            if self.detokd.proc.poll() is not None:
                raise RuntimeError(f"detokd exited {self.detokd.proc.returncode}")
            if time.monotonic() - last_log > LOG_EVERY_S:
                last_log = time.monotonic()
                s = self.sampler.samples[-1] if self.sampler.samples else {}
                log(f"{churn.made:,} requests, {churn.sent_tokens / 1e6:.1f}M tokens sent; detokd RSS {s.get('rss_mb')} MB, live {s.get('live'):.0f}")
        return time.monotonic() - self.t0

    def drain(self) -> dict:
        """Until detokd has decoded everything sent and the worker has every finished
        request's last row (or DRAIN_S passed); the last /metrics."""
        churn, worker = self.churn, self.worker
        want = churn.fate_counts[Fate.FINISH]

        def drained() -> bool:
            with worker.cond:
                got = sum(1 for i in range(churn.made) if churn.fates[i] == Fate.FINISH and worker.ended[i])
            return got >= want and scrape(self.port).get("detokd_tokens_total", 0) >= churn.sent_tokens

        try:
            wait_until(drained, DRAIN_S, "drain", interval=0.2)
        except TimeoutError:
            got = worker.endings(churn.made)
            log(f"drain timed out: {sum(n for (f, e), n in got.items() if f == Fate.FINISH and e != Ending.NONE)}/{want} "
                f"finished requests ended, detokd tokens {scrape(self.port).get('detokd_tokens_total')}")
        self.sampler.halt.set()
        self.sampler.join(10)
        self.sampler.sample()
        return scrape(self.port)

    def stop(self):
        """detokd's exit status ("killed" past 30 s); every socket closed."""
        try:
            rc = self.detokd.stop(30)
        except subprocess.TimeoutExpired:
            rc = "killed"
        self.worker.close()
        if self.churn.client is not None:
            self.churn.client.close(linger=0)
        self.ctx.destroy(linger=0)
        return rc

    def verdict(self) -> Verdict:
        ends = self.worker.endings(self.churn.made)
        texts = {rid: "".join(parts) for rid, parts in self.worker.texts.items()}
        return Verdict(
            bad_finished=sum(n for (f, e), n in ends.items() if f == Fate.FINISH and e != Ending.FINISHED),
            evicted_live=ends[(Fate.FINISH, Ending.EVICTED)] + ends[(Fate.ABORT, Ending.EVICTED)],
            aborted_with_ending=sum(ends[(Fate.ABORT, e)] for e in (Ending.FINISHED, Ending.WRONG_END, Ending.OTHER_ERROR)),
            abandoned_evicted=ends[(Fate.ABANDON, Ending.EVICTED)],
            abandoned_live=ends[(Fate.ABANDON, Ending.NONE)],
            wrong_texts=[rid for rid, (tail, ids) in self.churn.checked.items() if texts.get(rid) != self.vocab.reference(tail, ids)],
        )


def summary(s: Soak, v: Verdict, final: dict, rc, command: str, elapsed: float, send_s: float) -> dict:
    churn, worker, samples = s.churn, s.worker, s.sampler.samples
    return {
        "command": command,
        "tokens": int(final.get("detokd_tokens_total", 0)),
        "tokens_sent": churn.sent_tokens,
        "requests": churn.made,
        "fates": {"finished": churn.fate_counts[Fate.FINISH], "aborted": churn.fate_counts[Fate.ABORT],
                  "abandoned": churn.fate_counts[Fate.ABANDON]},
        "steps": churn.steps,
        "concurrency": s.args.concurrency,
        "max_states": s.args.max_states,
        "seconds": round(elapsed, 1),
        "send_seconds": round(send_s, 1),
        "tokens_per_second": round(churn.sent_tokens / send_s),
        "detokd_cpu_seconds": samples[-1]["cpu_s"] if samples else None,
        "detokd_exit": rc,
        "metrics": final,
        "worker": {"messages": worker.messages, "rows": worker.rows, "errors": worker.errors},
        "evicted_rows": worker.errors.get("evicted", 0),
        "abandoned_requests_evicted": v.abandoned_evicted,
        "abandoned_requests_still_live": v.abandoned_live,
        "requests_evicted_while_going": v.evicted_live,
        "duplicate_endings": worker.duplicate_endings,
        "finished_requests_wrong_ending": v.bad_finished,
        "aborted_requests_with_an_ending_row": v.aborted_with_ending,
        "checked_texts": len(churn.checked),
        "checked_texts_wrong": len(v.wrong_texts),
        "flatness": flatness(samples, s.args.flat_threshold),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
    }


def report(sm: dict, v: Verdict, args, written: str) -> None:
    f = sm["flatness"]
    log(f"{sm['tokens']:,} tokens decoded over {sm['requests']:,} requests in {sm['seconds']:.0f}s "
        f"({sm['tokens_per_second']:,} tokens/s sent); detokd exit {sm['detokd_exit']}")
    log(f"fates {sm['fates']}; evictions {sm['metrics'].get('detokd_evictions_total', 0):.0f}; worker errors {sm['worker']['errors']}")
    log(f"RSS start {f.get('rss_start_mb')} MB, at 75% {f.get('rss_q3_mb')} MB, end {f.get('rss_end_mb')} MB, "
        f"peak {f.get('rss_peak_mb')} MB: last-quarter growth {f.get('last_quarter_growth', 0):+.2%} -> "
        f"{'FLAT' if f.get('flat') else 'NOT FLAT'} (threshold {args.flat_threshold:.0%})")
    log(f"checked texts: {sm['checked_texts'] - len(v.wrong_texts)}/{sm['checked_texts']} exact; "
        f"finished requests with a wrong ending: {v.bad_finished}")
    log(f"wrote {written}")
    if v.wrong_texts:
        log(f"first wrong texts: {v.wrong_texts[:5]}")
    log(f"abandoned requests: {v.abandoned_evicted:,} evicted, {v.abandoned_live:,} still live at the end; "
        f"requests evicted while going: {v.evicted_live}; aborted requests with an ending row: {v.aborted_with_ending}")


def run(args, command: str) -> int:
    s = Soak(args)
    try:
        send_s = s.send_all()
        final = s.drain()
        elapsed = time.monotonic() - s.t0
    finally:
        rc = s.stop()
    v = s.verdict()
    sm = summary(s, v, final, rc, command, elapsed, send_s)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "soak-quick" if args.quick else "soak"
    (out / f"{stem}.json").write_text(json.dumps({"summary": sm, "samples": s.sampler.samples}, indent=1))
    plot(s.sampler.samples, sm, out / f"{stem}.png")
    report(sm, v, args, f"{out / (stem + '.json')} and {out / (stem + '.png')}")
    if s.detokd.proc.returncode not in (0, None):
        log(s.detokd.log()[-3000:])
    return 0 if v.ok(s.worker, sm["flatness"], rc) else 1
