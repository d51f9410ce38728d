"""What one worst frame costs a detokd: the time to its answer and to a probe's after
it, /health meanwhile, memory before and after, and how long SIGTERM takes."""

from __future__ import annotations

import collections
import signal
import subprocess
import threading
import time

from detokd.tokenizer import Vocab
from detokd.wire.native import Finish, Row, Start

from ..metrics import get
from ..proc import memory
from .peers import EXIT_WAIT_S, Target
from .scenarios import Frame, Scale, fit, tokens

ANSWER_WAIT_S = 1800  # the slowest frame's probe; beyond, the scenario failed
ANSWER_AFTER_EXIT_S = 5  # for the last of the answer to come in once detokd exited
HEALTH_EVERY_S = 0.05
HEALTH_TIMEOUT_S = 10.0
SIGTERM_AFTER_S = 0.1
PROBE_TEXT = "The probe after the frame: naïve café, 中文, 🎉 — done."


def memory_mb(pid: int) -> dict:
    """VmHWM (the peak) and VmRSS of a process, in MB."""
    m = memory(pid)
    return {"hwm_mb": round(m.hwm_kb / 1024, 1), "rss_mb": round(m.rss_kb / 1024, 1)}


class HealthPoller(threading.Thread):
    """GET /health every 50 ms until stopped: each answer's latency and status."""

    def __init__(self, port: int, t0: float) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.t0 = t0
        self.done = threading.Event()
        self.polls = 0
        self.worst_s = 0.0
        self.bad: list[dict] = []  # non-200 answers and failures (status None)

    def run(self) -> None:
        while True:
            start = time.monotonic()
            status, body = self._get()
            latency = time.monotonic() - start
            self.polls += 1
            self.worst_s = max(self.worst_s, latency)
            if status != 200:
                self.bad.append({"at_s": round(start - self.t0, 3), "status": status, "body": body, "latency_s": round(latency, 3)})
            if self.done.wait(max(0.0, start + HEALTH_EVERY_S - time.monotonic())):
                return

    def _get(self) -> tuple[int | None, str]:
        try:
            status, body = get(self.port, "/health", HEALTH_TIMEOUT_S)
            return status, body.strip()
        except OSError as e:  # a timeout, a refused connection
            return None, f"{type(e).__name__}: {e}"

    def stop(self) -> dict:
        self.done.set()
        self.join(HEALTH_TIMEOUT_S + 5)
        statuses = collections.Counter(str(b["status"]) for b in self.bad)
        return {
            "polls": self.polls,
            "worst_latency_s": round(self.worst_s, 3),
            "non_200": len(self.bad),
            "statuses": dict(statuses),
            "first_non_200_at_s": self.bad[0]["at_s"] if self.bad else None,
            "last_non_200_at_s": self.bad[-1]["at_s"] if self.bad else None,
            "samples": self.bad[:3] + self.bad[-2:] if len(self.bad) > 5 else self.bad,
        }


def probe_for(vocab: Vocab, name: str) -> tuple[str, list[int], bytes]:
    rid = f"probe-{name}"
    ids = vocab.backend.encode(PROBE_TEXT, add_special_tokens=False).ids
    return rid, ids, tokens([Row(rid, ids, start=Start(), finish=Finish("length"))])


def handle(t: Target, frame: Frame, vocab: Vocab, name: str) -> dict:
    """(a), (b), (c): the frame, then a probe; time to both answers, /health, memory."""
    rid, ids, probe = probe_for(vocab, name)
    before = memory_mb(t.pid)
    t0 = time.monotonic()
    poller = HealthPoller(t.port, t0)
    poller.start()
    t.send(frame.data)
    sent_s = time.monotonic() - t0
    t.send(probe)
    try:
        t.sink.wait(lambda: t.sink.ended(rid), ANSWER_WAIT_S, "answer to the probe")
    finally:
        health = poller.stop()
    after = memory_mb(t.pid)
    msgs = t.sink.since(t0)
    answer = [m for m in msgs if not m.probe]
    probe_at = next(m.at for m in msgs if m.probe)
    text = t.sink.text(rid)
    return {
        "send_s": round(sent_s, 3),
        "answer_s": round(answer[-1].at - t0, 3) if answer else None,
        "probe_s": round(probe_at - t0, 3),
        "answer": {
            "messages": len(answer),
            "rows": sum(m.rows for m in answer),
            "bytes": sum(m.nbytes for m in answer),
            "text_bytes": sum(m.text_bytes for m in answer),
            "errors": dict(sum((m.errors for m in answer), collections.Counter())),
        },
        "probe": {"rid": rid, "ids": ids, "text": text, "exact": text == vocab.reference([], ids)},
        "health": health,
        "memory": {"before": before, "after": after},
    }


def sigterm(t: Target, frame: Frame) -> dict:
    """(d): SIGTERM ~100 ms after the frame was sent; seconds until detokd exited."""
    t0 = time.monotonic()
    t.send(frame.data)
    time.sleep(max(0.0, t0 + SIGTERM_AFTER_S - time.monotonic()))
    signalled = time.monotonic()
    t.proc.proc.send_signal(signal.SIGTERM)
    try:
        code = t.proc.proc.wait(EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        t.proc.kill()
        code = None
    exit_s = time.monotonic() - signalled
    try:  # what detokd queued before it exited may still be on its way in
        t.sink.wait(lambda: t.sink.since(t0), ANSWER_AFTER_EXIT_S, "answer")
    except TimeoutError:
        pass
    return {
        "signal_after_send_s": round(signalled - t0, 3),
        "exit_s": round(exit_s, 3),
        "returncode": code,  # 0: clean; 3: shutdown_grace_s ran out; None: killed after EXIT_WAIT_S
        "grace_s": t.proc.config.shutdown_grace_s,
        "grace_ran_out": "not stopped within shutdown_grace_s" in t.proc.log(),
        "answer_delivered": bool(t.sink.since(t0)),  # the frame's answer reached the worker
    }


def extrapolate(frame: Frame, res: dict, scale: Scale) -> dict:
    """stop_distinct: a full frame's figures from the per-start cost of this one."""
    starts = fit(scale.frame_bytes, 16, frame.per_start_bytes, scale.rows)
    per_s = res["answer_s"] / frame.rows
    per_mb = (res["memory"]["after"]["rss_mb"] - res["memory"]["before"]["rss_mb"]) / frame.rows
    return {
        "starts_in_a_full_frame": starts,
        "seconds_per_start": round(per_s, 4),
        "rss_mb_per_start": round(per_mb, 2),
        "full_frame_s": round(starts * per_s, 1),
        "full_frame_rss_mb": round(starts * per_mb),
    }
