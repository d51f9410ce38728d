"""What the fuzzer's peers send: the honest scheduler's waves of requests, hostile
sessions that end badly, frames too big to be read, and every kind's weight."""

from __future__ import annotations

import collections
import random
from dataclasses import dataclass

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from detokd.client import SchedulerClient
from detokd.wire.native import Finish

from ..frames import Hostile, OverCaps, mixed_ids

enc = msgspec.msgpack.encode

# Frames per kind, relative. Hostile's own generators keep their weights (53 in all).
OTHER_WEIGHTS = {
    "honest": 25, "session": 8, "huge_rid": 3, "many_stops": 2, "long_stops": 2,
    "over_prompt_tail": 1, "over_row_ids": 1, "over_frame_ids": 0.5, "huge_meta": 0.5, "over_rows": 0.1, "oversized": 0.1,
}



# --------------------------------------------------------------------------- honest traffic


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
