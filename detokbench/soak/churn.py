"""The soak's engine: requests of random lengths and fates, one `tokens` frame a step."""

from __future__ import annotations

import array
import math
import random
from dataclasses import dataclass
from enum import IntEnum

from detokd.client import SchedulerClient
from detokd.wire.native import Finish

from ..frames import mixed_ids

# The soak's own multilingual pieces (longer than frames.CORPUS): its figures were
# measured on these.
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
    """A request the engine is sending."""

    rid: str
    ids: list[int]
    tail: list[int]
    worker: int
    fate: Fate
    stop_at: int  # ids sent before it finishes, is aborted or abandoned
    check: bool
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

    def refill(self) -> list[str]:
        """New requests up to `concurrency`; the rids whose text is to be checked."""
        args, rng, watch = self.args, self.rng, []
        while len(self.active) < args.concurrency and self.made < args.requests:
            # Lengths log-uniform in [1, max_len] (times --len-scale).
            n = max(1, int(math.exp(rng.random() * self.log_max) * args.len_scale))
            off = rng.randrange(8, len(self.pool) - n)
            ids = self.pool[off : off + n]
            tail = self.pool[off - 8 : off] if rng.random() < 0.5 else []
            u = rng.random()
            fate = Fate.ABORT if u < args.abort else Fate.ABANDON if u < args.abort + args.abandon else Fate.FINISH
            stop_at = rng.randrange(n) + 1 if fate != Fate.FINISH else n
            rid = f"s{self.made}"
            check = self.made % args.check_every == 0 and fate == Fate.FINISH
            if check:
                self.checked[rid] = (tail, ids)
                watch.append(rid)
            self.lengths[self.made] = n
            self.fates[self.made] = fate
            self.fate_counts[fate] += 1
            self.active.append(EReq(rid, ids, tail, self.made % args.workers, fate, stop_at, check))
            self.made += 1
        return watch

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
