"""Soak test: millions of tokens with churn through a real detokd; is memory flat?
docs/reliability.md, "Soak", says what is sent and how it is checked. RSS is flat when
it grew by less than --flat-threshold over the last quarter of the run.

    python -m detokbench soak --quick     # ~1.4M tokens over 10k requests, seconds
    python -m detokbench soak             # ~135M tokens over 1M requests, minutes

Exit status: 0 when RSS ended flat, every checked text was exact and every request
ended as it was meant to, 1 otherwise.
"""

from __future__ import annotations

import array
import collections
import math
import random
import time
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import msgspec
import zmq

from detokd.client import SchedulerClient
from detokd.tokenizer import load
from detokd.wire.native import Finish, Text
from detokrig import ROOT
from detokrig.frames import mixed_ids
from detokrig.rig import Rig, Sampler
from detokrig.sink import Sink
from detokrig.waits import wait_until

from .commands import header, parser, pyplot, verdict, write_json

# --------------------------------------------------------------------------- the engine: requests and their fates


# Longer than frames.CORPUS: the soak's figures were measured on these.
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
POOL = 2_000_000  # ids every request takes its output (and prompt tail) from


class Fate(IntEnum):
    FINISH = 0  # a finish row
    ABORT = 1  # an abort message midway
    ABANDON = 2  # never sent again, neither finished nor aborted: only eviction frees it


@dataclass(slots=True)
class EReq:
    rid: str
    ids: list[int]
    tail: list[int]
    worker: int
    fate: Fate
    stop_at: int  # ids sent before it finishes, is aborted or abandoned
    pos: int = 0


class Churn:
    """Keeps `concurrency` requests going; `lengths` and `fates` are by request number
    (rid "s<n>"), for the worker to check endings against."""

    def __init__(self, args, hf, client: SchedulerClient | None) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        pieces = [hf.encode(t, add_special_tokens=False) for t in CORPUS]
        self.pool = mixed_ids(self.rng, POOL, pieces, len(hf), random_share=0.1, max_run=24)
        self.client = client  # may come later: the worker needs `lengths` before detokd starts
        self.lengths = array.array("i", bytes(4 * args.requests))
        self.fates = bytearray(args.requests)
        self.fate_counts = {f: 0 for f in Fate}
        self.active: list[EReq] = []
        self.checked: dict[str, tuple[list[int], list[int]]] = {}  # rid -> (tail, ids)
        self.made = self.sent_tokens = self.steps = 0
        self.log_max = math.log(args.max_len)

    @property
    def going(self) -> bool:
        return self.made < self.args.requests or bool(self.active)

    def refill(self) -> None:
        """New requests up to `concurrency`."""
        args, rng = self.args, self.rng
        while len(self.active) < args.concurrency and self.made < args.requests:
            # Lengths log-uniform in [1, max_len].
            n = max(1, int(math.exp(rng.random() * self.log_max)))
            off = rng.randrange(8, len(self.pool) - n)
            ids = self.pool[off : off + n]
            tail = self.pool[off - 8 : off] if rng.random() < 0.5 else []
            u = rng.random()
            fate = Fate.ABORT if u < args.abort else Fate.ABANDON if u < args.abort + args.abandon else Fate.FINISH
            stop_at = rng.randrange(n) + 1 if fate != Fate.FINISH else n
            rid = f"s{self.made}"
            if self.made % args.check_every == 0 and fate == Fate.FINISH:
                self.checked[rid] = (tail, ids)  # before its first row is sent: the worker keeps its text
            self.lengths[self.made] = n
            self.fates[self.made] = fate
            self.fate_counts[fate] += 1
            self.active.append(EReq(rid, ids, tail, self.made % args.workers, fate, stop_at))
            self.made += 1

    def step(self) -> None:
        """1..max_delta ids of every active request in one `tokens` frame, then the
        aborts (after their last rows)."""
        aborts, still = [], []
        for r in self.active:
            end = min(r.pos + self.rng.randint(1, self.args.max_delta), r.stop_at)
            chunk = r.ids[r.pos : end]
            first = r.pos == 0
            r.pos = end
            self.sent_tokens += len(chunk)
            fin = None
            if r.pos < r.stop_at:
                still.append(r)
            elif r.fate == Fate.FINISH:
                fin = Finish("length")
            elif r.fate == Fate.ABORT:
                aborts.append(r.rid)
            if first:
                self.client.begin(r.rid, chunk, worker=r.worker, prompt_tail=r.tail, finish=fin)
            else:
                self.client.add(r.rid, chunk, finish=fin)
            if r.pos >= r.stop_at and r.fate == Fate.ABANDON:
                self.client.forget(r.rid)  # never sent again, so no longer tracked here
        self.active = still
        self.client.flush()
        if aborts:
            self.client.abort(aborts)
        self.steps += 1


# --------------------------------------------------------------------------- the worker: endings, checked texts


class Ending(IntEnum):
    NONE = 0  # no ending row (yet)
    FINISHED = 1  # a finish row whose n_ids is the request's length
    WRONG_END = 2  # a finish row with another n_ids
    EVICTED = 3
    OTHER_ERROR = 4


class Worker(Sink):
    """PULLs every worker address and records each request's ending as it comes: one
    byte per request number (rid "s<n>"), so a million requests cost a megabyte here;
    keeps the whole text of the churn's checked rids only."""

    _decode = msgspec.msgpack.Decoder(Text).decode

    def __init__(self, ctx: zmq.Context, addresses: list[str], churn: Churn) -> None:
        self.lengths, self.fates, self.checked = churn.lengths, churn.fates, churn.checked
        self.ended = bytearray(len(self.lengths))
        self.rows = self.messages = self.duplicate_endings = 0
        self.texts: dict[str, list[str]] = {}  # checked rids only
        self.errors: dict[str, int] = {}
        super().__init__(ctx, addresses, rcvhwm=100_000)

    def read(self, frame: bytes) -> list:
        return self._decode(frame).rows

    def keep(self, rows: list) -> None:
        self.messages += 1
        self.rows += len(rows)
        for r in rows:
            if r.error is None and r.rid in self.checked:
                self.texts.setdefault(r.rid, []).append(r.text)
            if r.error is not None or r.finish is not None:
                self._end(r)

    def _end(self, r) -> None:
        i = int(r.rid[1:])
        if self.ended[i]:
            self.duplicate_endings += 1
        if r.error is not None:
            self.errors[r.error] = self.errors.get(r.error, 0) + 1
            self.ended[i] = Ending.EVICTED if r.error == "evicted" else Ending.OTHER_ERROR
        else:
            self.ended[i] = Ending.FINISHED if r.n_ids == self.lengths[i] else Ending.WRONG_END

    def endings(self, made: int) -> collections.Counter:
        """(fate, Ending) -> requests, over the first `made` requests."""
        with self.cond:
            return collections.Counter(zip(self.fates[:made], map(Ending, self.ended[:made]), strict=True))


# --------------------------------------------------------------------------- RSS flatness, the PNG


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def flatness(samples: list[dict], threshold: float) -> dict:
    """RSS growth over the last quarter of the run: the mean of the last 10% of the
    samples against the mean of the samples around the 75% mark (70-80%)."""
    if len(samples) < 10:
        return {"flat": None, "reason": "too few samples"}
    t_end = samples[-1]["t"]

    def mean_rss(a: float, b: float) -> float:
        """Over the samples of [a, b] of the run; the sampler thread shares the GIL with the
        engine, so a window may hold none: then the sample nearest its middle."""
        xs = [s["rss_mb"] for s in samples if a * t_end <= s["t"] <= b * t_end]
        xs = xs or [min(samples, key=lambda s: abs(s["t"] - (a + b) / 2 * t_end))["rss_mb"]]
        return sum(xs) / len(xs)

    q3, end = mean_rss(0.70, 0.80), mean_rss(0.90, 1.0)
    return {
        "rss_start_mb": samples[0]["rss_mb"],
        "rss_q3_mb": round(q3, 2),
        "rss_end_mb": round(end, 2),
        "rss_peak_mb": max(s["rss_mb"] for s in samples),
        "last_quarter_growth": round((end - q3) / q3, 5),
        "threshold": threshold,
        "flat": (end - q3) / q3 < threshold,
    }


def plot(samples: list[dict], summary: dict, path: Path) -> Path | None:
    """The PNG of RSS and live requests over the run; None without matplotlib."""
    plt = pyplot()
    if plt is None:
        log("matplotlib is not installed: no plot (pip install 'detokd[bench]')")
        return None

    t, rss = [s["t"] for s in samples], [s["rss_mb"] for s in samples]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ax1.plot(t, rss, color="tab:blue")
    ax1.set_ylabel("detokd RSS (MB)")
    f = summary["flatness"]
    ax1.set_title(
        f"{summary['tokens'] / 1e6:.1f}M tokens, {summary['requests']:,} requests, "
        f"max_states {summary['max_states']:,}: "
        f"RSS {'flat' if f.get('flat') else 'NOT flat'} (last quarter {f.get('last_quarter_growth', 0):+.2%})",
        fontsize=10,
    )
    mid, half = (max(rss) + min(rss)) / 2, max(10.0, (max(rss) - min(rss)) * 0.6)  # at least 20 MB: noise stays small
    ax1.set_ylim(mid - half, mid + half)
    ax1.axvspan(0.75 * t[-1], t[-1], color="0.9")
    ax2.plot(t, [s["live"] for s in samples], color="tab:orange", label="live requests (/metrics)")
    ax2.axhline(summary["max_states"], color="tab:red", ls="--", lw=1, label="max_states")
    ax2.set_ylabel("live requests")
    ax2.set_xlabel("seconds")
    ax3 = ax2.twinx()
    ax3.plot(t, [s["tokens"] / 1e6 for s in samples], color="tab:green", label="tokens (M)")
    ax3.set_ylabel("tokens decoded (M)")
    (h1, l1), (h2, l2) = ax2.get_legend_handles_labels(), ax3.get_legend_handles_labels()
    ax2.legend(h1 + h2, l1 + l2, loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


DRAIN_S = 120  # after the last frame, for detokd to decode it all and the worker to get it


class Soak:
    """The engine, the worker, detokd and the sampler of one run."""

    def __init__(self, args) -> None:
        self.args = args
        self.vocab = load("deepseek")
        self.churn = Churn(args, self.vocab.hf, client=None)  # the client comes once detokd is up
        self.rig = Rig("detokd-soak-", lambda ctx, addrs: [Worker(ctx, addrs, self.churn)],
                       workers=args.workers, max_states=args.max_states)
        self.worker = self.rig.sinks[0]
        self.rig.start()
        self.churn.client = self.rig.client(sndhwm=1000, send_timeout=30)
        self.t0 = time.monotonic()
        self.sampler = Sampler(self.rig, args.interval, self.t0, log)
        self.sampler.sample()
        self.sampler.start()
        log(f"detokd pid {self.rig.detokd.pid}, metrics on port {self.rig.port}; "
            f"{args.requests:,} requests, about {args.tokens:,} tokens")

    def send_all(self) -> float:
        """Churn until every request was made and sent; the seconds it took."""
        churn = self.churn
        while churn.going:
            churn.refill()
            churn.step()
            if self.rig.detokd.proc.poll() is not None:
                raise RuntimeError(f"detokd exited {self.rig.detokd.proc.returncode}")
        return time.monotonic() - self.t0

    def drain(self) -> dict:
        """Until detokd has decoded everything sent and the worker has every finished
        request's last row (or DRAIN_S passed); the last /metrics."""
        churn, worker = self.churn, self.worker
        want = churn.fate_counts[Fate.FINISH]

        def drained() -> bool:
            with worker.cond:
                got = sum(1 for i in range(churn.made) if churn.fates[i] == Fate.FINISH and worker.ended[i])
            return got >= want and self.rig.metrics().get("detokd_tokens_total", 0) >= churn.sent_tokens

        try:
            wait_until(drained, DRAIN_S, "drain", interval=0.2)
        except TimeoutError:
            got = sum(n for (f, e), n in worker.endings(churn.made).items() if f == Fate.FINISH and e != Ending.NONE)
            log(f"drain timed out: {got}/{want} "
                f"finished requests ended, detokd tokens {self.rig.metrics().get('detokd_tokens_total')}")
        self.sampler.finish()
        return self.rig.metrics()

    def summary(self, final: dict, rc, head: dict, elapsed: float, send_s: float) -> tuple[dict, list[str]]:
        """The run's figures, and the rids whose text was not the oracle's."""
        churn, worker, samples = self.churn, self.worker, self.sampler.samples
        ends = worker.endings(churn.made)
        texts = {rid: "".join(worker.texts.get(rid, ())) for rid in churn.checked}
        wrong = [rid for rid, (tail, ids) in churn.checked.items() if texts[rid] != self.vocab.reference(tail, ids)]
        return {
            **head,
            "tokens": int(final.get("detokd_tokens_total", 0)),
            "tokens_sent": churn.sent_tokens,
            "requests": churn.made,
            "fates": {"finished": churn.fate_counts[Fate.FINISH], "aborted": churn.fate_counts[Fate.ABORT],
                      "abandoned": churn.fate_counts[Fate.ABANDON]},
            "steps": churn.steps,
            "concurrency": self.args.concurrency,
            "max_states": self.args.max_states,
            "seconds": round(elapsed, 1),
            "send_seconds": round(send_s, 1),
            "tokens_per_second": round(churn.sent_tokens / send_s),
            "detokd_cpu_seconds": samples[-1]["cpu_s"] if samples else None,
            "detokd_exit": rc,
            "metrics": final,
            "worker": {"messages": worker.messages, "rows": worker.rows, "errors": worker.errors},
            "evicted_rows": worker.errors.get("evicted", 0),
            "abandoned_requests_evicted": ends[(Fate.ABANDON, Ending.EVICTED)],
            "abandoned_requests_still_live": ends[(Fate.ABANDON, Ending.NONE)],
            "requests_evicted_while_going": ends[(Fate.FINISH, Ending.EVICTED)] + ends[(Fate.ABORT, Ending.EVICTED)],
            "duplicate_endings": worker.duplicate_endings,
            "finished_requests_wrong_ending":
                sum(n for (f, e), n in ends.items() if f == Fate.FINISH and e != Ending.FINISHED),
            "aborted_requests_with_an_ending_row":
                sum(ends[(Fate.ABORT, e)] for e in (Ending.FINISHED, Ending.WRONG_END, Ending.OTHER_ERROR)),
            "checked_texts": len(churn.checked),
            "checked_texts_wrong": len(wrong),
            "flatness": flatness(samples, self.args.flat_threshold),
        }, wrong


# Each of these figures is a failed run when it is not 0.
MUST_BE_0 = ("finished_requests_wrong_ending", "aborted_requests_with_an_ending_row", "requests_evicted_while_going",
             "duplicate_endings", "checked_texts_wrong")


def report(sm: dict, wrong: list[str], threshold: float, written: str) -> list[str]:
    """The run in a few log lines; its problems."""
    f = sm["flatness"]
    log(f"{sm['tokens']:,} tokens decoded over {sm['requests']:,} requests in {sm['seconds']:.0f}s "
        f"({sm['tokens_per_second']:,} tokens/s sent); detokd exit {sm['detokd_exit']}")
    log(f"fates {sm['fates']}; evictions {sm['metrics'].get('detokd_evictions_total', 0):.0f}; "
        f"worker errors {sm['worker']['errors']}")
    log(f"RSS start {f.get('rss_start_mb')} MB, at 75% {f.get('rss_q3_mb')} MB, end {f.get('rss_end_mb')} MB, "
        f"peak {f.get('rss_peak_mb')} MB: last-quarter growth {f.get('last_quarter_growth', 0):+.2%} -> "
        f"{'FLAT' if f.get('flat') else 'NOT FLAT'} (threshold {threshold:.0%})")
    log(f"checked texts: {sm['checked_texts'] - len(wrong)}/{sm['checked_texts']} exact; "
        f"finished requests with a wrong ending: {sm['finished_requests_wrong_ending']}")
    log(f"wrote {written}")
    if wrong:
        log(f"first wrong texts: {wrong[:5]}")
    log(f"abandoned requests: {sm['abandoned_requests_evicted']:,} evicted, {sm['abandoned_requests_still_live']:,} "
        f"still live at the end; requests evicted while going: {sm['requests_evicted_while_going']}; "
        f"aborted requests with an ending row: {sm['aborted_requests_with_an_ending_row']}")
    problems = [f"{k}: {sm[k]}" for k in MUST_BE_0 if sm[k]]
    problems += [] if f.get("flat") else [f"RSS not flat: {f.get('reason') or f.get('last_quarter_growth')}"]
    return problems + ([] if sm["detokd_exit"] == 0 else [f"detokd exit {sm['detokd_exit']}"])


def run(args, head: dict) -> int:
    s = Soak(args)
    try:
        send_s = s.send_all()
        final = s.drain()
        elapsed = time.monotonic() - s.t0
    finally:
        rc = s.rig.stop(30)
        s.rig.close()
    sm, wrong = s.summary(final, rc, head, elapsed, send_s)
    out = Path(args.out)
    stem = "soak-quick" if args.quick else "soak"
    write_json(out / f"{stem}.json", {"summary": sm, "samples": s.sampler.samples})
    written = [out / f"{stem}.json", plot(s.sampler.samples, sm, out / f"{stem}.png")]
    problems = report(sm, wrong, args.flat_threshold, " and ".join(str(p) for p in written if p))
    if s.rig.detokd.returncode not in (0, None):
        log(s.rig.detokd.log()[-3000:])
    return verdict(problems)


def main(argv: list[str]) -> int:
    ap = parser("soak", __doc__)
    ap.add_argument("--quick", action="store_true", help="a short run (~1.4M tokens over 10k requests, seconds)")
    ap.add_argument("--requests", type=int, default=1_000_000, help="requests in all (default 1000000: ~135M tokens)")
    ap.add_argument("--max-len", type=int, default=1000, help="lengths log-uniform in [1, max-len] (default 1000)")
    ap.add_argument("--max-delta", type=int, default=16, help="ids per row: uniform in [1, max-delta] (default 16)")
    ap.add_argument("--concurrency", type=int, default=256, help="requests going at once (default 256)")
    ap.add_argument("--abort", type=float, default=0.08, help="fraction of requests aborted midway (default 0.08)")
    ap.add_argument("--abandon", type=float, default=0.05, help="fraction never finished nor aborted (default 0.05)")
    ap.add_argument("--max-states", type=int, default=2048, help="detokd's --max-states (default 2048)")
    ap.add_argument("--workers", type=int, default=2, help="worker addresses (default 2)")
    ap.add_argument("--check-every", type=int, default=50, help="check every n-th finished text (default 50)")
    ap.add_argument("--interval", type=float, default=0.02, help="seconds between RSS samples at first, doubled "
                    "whenever 200 are kept: 100-200 of them, evenly spaced, whatever the run's length (default 0.02)")
    ap.add_argument("--flat-threshold", type=float, default=0.02, help="last quarter's RSS growth still flat (0.02)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "docs" / "soak"), help="soak.json's and .png's folder (docs/soak)")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests = min(args.requests, 10_000)
        args.max_states = min(args.max_states, 512)
    # log-uniform in [1, M] has mean (M - 1) / ln M; roughly, before aborts cut some short
    args.tokens = int((args.max_len - 1) / math.log(args.max_len) * args.requests)
    return run(args, header("soak", argv))
