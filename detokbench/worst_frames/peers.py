"""The peers of one fresh detokd: its worker (a Sink that counts a gigabyte answer
without decoding its text) and its engine; the warm-up every scenario starts with."""

from __future__ import annotations

import collections
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from detokd.process import ipc_config
from detokd.tokenizer import Vocab
from detokd.wire.native import NIL, Finish, Row, Start

from ..children import detokd_process
from ..engine import Engine
from ..metrics import metrics_port
from ..sink import Sink
from .scenarios import tokens

SEND_MS = 60_000  # detokd takes no input for a minute: give up
EXIT_WAIT_S = 120  # after SIGTERM; beyond, detokd is killed and the run says so
WARM_TEXTS = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Ünïcödé, 日本語のテキスト, emoji 🎉🚀 and Ελληνικά.",
    "def f(x):\n    return [i * i for i in range(x)]  # code",
)


class OutRowLite(msgspec.Struct):
    """An output row with its text left as raw MessagePack: a 1.7 GB answer is counted,
    never decoded (this process's GIL is the /health poller's too)."""

    rid: str
    text: msgspec.Raw = msgspec.Raw(b"\xa0")  # "": an embeddings row has none
    finish: msgspec.Raw = NIL
    n_ids: int = 0
    meta: msgspec.Raw = NIL
    error: str | None = None


class TextLite(msgspec.Struct):
    type: str
    rows: list[OutRowLite] = []


_text_lite = msgspec.msgpack.Decoder(TextLite)


def str_bytes(raw: msgspec.Raw) -> int:
    """UTF-8 bytes of a MessagePack str, from its header."""
    b = memoryview(raw)
    h = b[0]
    return len(b) - (1 if h < 0xD9 else {0xD9: 2, 0xDA: 3, 0xDB: 5}[h])


@dataclass
class Message:
    at: float  # time.monotonic() when it arrived
    nbytes: int
    rows: int
    text_bytes: int
    errors: collections.Counter
    probe: bool


class Worker(Sink):
    """Logs every message (a Message); rows of warm-up and probe rids are kept, decoded."""

    KEEP = ("warm-", "probe-")

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.log: list[Message] = []
        self.kept: dict[str, list[tuple[str, object, str | None]]] = collections.defaultdict(list)
        super().__init__(ctx, [address], zero_copy=True)

    def read(self, buf: memoryview) -> tuple[Message, list]:
        at = time.monotonic()
        msg = _text_lite.decode(buf)
        m = Message(at, len(buf), len(msg.rows), 0, collections.Counter(), False)
        kept = []
        for row in msg.rows:
            m.text_bytes += str_bytes(row.text)
            if row.error is not None:
                m.errors[row.error] += 1
            if row.rid.startswith(self.KEEP):
                m.probe |= row.rid.startswith("probe-")
                text = msgspec.msgpack.decode(row.text, type=str)
                kept.append((row.rid, (text, msgspec.msgpack.decode(row.finish), row.error)))
        return m, kept

    def keep(self, got: tuple[Message, list]) -> None:
        m, kept = got
        for rid, row in kept:
            self.kept[rid].append(row)
        self.log.append(m)

    def ended(self, rid: str) -> bool:
        with self.cond:
            rows = self.kept.get(rid)
            return bool(rows) and (rows[-1][1] is not None or rows[-1][2] is not None)

    def text(self, rid: str) -> str:
        with self.cond:
            return "".join(t for t, _, error in self.kept.get(rid, ()) if error is None)

    def since(self, t0: float) -> list[Message]:
        with self.cond:
            return [m for m in self.log if m.at >= t0]


class Target:
    """One fresh `detokd serve` with its worker and an engine."""

    def __init__(self, ctx: zmq.Context, root: str, name: str, settings: dict) -> None:
        self.folder = tempfile.mkdtemp(prefix=f"{name[:12]}-", dir=root)
        self.settings = settings
        cfg = ipc_config(self.folder, **{"tokenizer": "deepseek", "metrics_port": 0, "log_level": "info", **settings})
        self.sink = Worker(ctx, cfg.workers[0])
        self.proc = detokd_process(cfg, Path(self.folder)).spawn()
        self.engine = Engine(ctx, cfg.input, SEND_MS)
        self.port: int | None = None

    def ready(self) -> Target:
        self.proc.wait_ready()
        self.port = metrics_port(self.proc)
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, frame: bytes) -> None:
        self.engine.send(frame)

    def close(self) -> None:
        if self.proc.returncode is None:
            try:
                self.proc.stop(EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        self.proc.kill()
        self.engine.close()
        self.sink.close()


def request_rows(rid: str, ids: list[int], steps: int) -> list[Row]:
    """One request's ids in `steps` rows: a start on the first, a finish on the last."""
    cuts = [len(ids) * k // steps for k in range(steps + 1)]
    return [
        Row(rid, ids[a:b], seq=a, start=Start() if k == 0 else None, finish=Finish("length") if k == steps - 1 else None)
        for k, (a, b) in enumerate(zip(cuts, cuts[1:]))
    ]


def warm_up(t: Target, vocab: Vocab) -> None:
    """A few honest requests in three steps; their text must be the oracle's."""
    reqs = {f"warm-{k}": vocab.backend.encode(s, add_special_tokens=False).ids for k, s in enumerate(WARM_TEXTS)}
    plans = [request_rows(rid, ids, 3) for rid, ids in reqs.items()]
    for step in range(3):
        t.send(tokens([plan[step] for plan in plans]))
    t.sink.wait(lambda: all(t.sink.ended(rid) for rid in reqs), 60, "warm-up answers")
    wrong = [rid for rid, ids in reqs.items() if t.sink.text(rid) != vocab.reference([], ids)]
    if wrong:
        raise AssertionError(f"warm-up text differs from the oracle for {wrong}")
