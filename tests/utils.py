"""Helpers more than one test file uses. Import as `from utils import ...` (tests/ is
on the path: conftest.py lives there); fixtures live in conftest.py.

The peers of a real `detokd serve` are detokrig's, shared with the tools: `Engine`
sends frames built independently of detokd.wire.native (plain dicts through msgspec,
or raw bytes: some are meant to be malformed), `Sink` is a tokenizer worker recording
every row it receives (detokrig.sink.Recorder). `FakeShards` and `FakeDetokd` stand
where detokd would for the client's unit tests.
Nothing sleeps and hopes: every wait polls a condition against a deadline.
"""

from __future__ import annotations

import asyncio
import collections
import random
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Coroutine
from functools import lru_cache
from typing import Any, Callable

import msgspec
import msgspec.inspect
import zmq
from conftest import vocab

from detokd.client import SchedulerClient
from detokd.config import Config
from detokd.wire import native
from detokrig.engine import Engine  # noqa: F401  (the tests' engine)
from detokrig.frames import CORPUS, mixed_ids
from detokrig.metrics import metrics_port  # noqa: F401  (the tests' too)
from detokrig.sink import Recorder, pull  # noqa: F401  (pull: a worker that never reads)
from detokrig.waits import wait_on, wait_until  # noqa: F401  (wait_until: the tests' wait too)

enc = msgspec.msgpack.encode
dec = msgspec.msgpack.decode


# --------------------------------------------------------------------------- the oracle


def deepseek():
    """The real DeepSeek tokenizer (detokd's default), loaded once per run."""
    return vocab("deepseek")


def expected_text(ids: list[int], skip_special_tokens: bool = True) -> str:
    """docs/protocol.md's text of a request with no prompt tail, under the Start defaults:
    Vocab.reference, the tokenizer's own decode."""
    return deepseek().reference([], ids, skip_special_tokens)


@lru_cache(maxsize=None)
def corpus_ids() -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(deepseek().backend.encode(t, add_special_tokens=False).ids) for t in CORPUS)


def make_ids(rng: random.Random, n: int) -> list[int]:
    """n output ids of the DeepSeek tokenizer: runs of CORPUS with random ids sprinkled in."""
    return mixed_ids(rng, n, corpus_ids(), deepseek().size)


def config_ranges() -> dict[str, msgspec.inspect.IntType | msgspec.inspect.FloatType]:
    """Config's numeric keys and their Meta ranges, read from the Struct itself (so a new
    key is covered by every test that walks them)."""
    out = {}
    for f in msgspec.inspect.type_info(Config).fields:
        types = f.type.types if isinstance(f.type, msgspec.inspect.UnionType) else (f.type,)
        for t in types:
            if isinstance(t, (msgspec.inspect.IntType, msgspec.inspect.FloatType)):
                out[f.name] = t
    return out


# --------------------------------------------------------------------------- peers


OPEN: list[Sink] = []  # closed by `close_all` before their context is destroyed


class Sink(Recorder):
    """The tests' worker: a Recorder that `close_all` closes with its context."""

    def __init__(self, ctx: zmq.Context, addresses: str | list[str], **kw: Any) -> None:
        OPEN.append(self)
        super().__init__(ctx, addresses, **kw)

    def close(self) -> None:
        if self in OPEN:
            OPEN.remove(self)
        super().close()


def close_all(ctx: zmq.Context) -> None:
    """Close every open Sink on `ctx` (its socket must close before the context is destroyed)."""
    for s in [s for s in OPEN if s.ctx is ctx]:
        s.close()


class Req:
    """A request the test plays the engine for: its planned output ids, sent in deltas."""

    def __init__(self, rid: str, ids: list[int], worker: int = 0, vid: int = 0) -> None:
        self.rid, self.ids, self.worker, self.vid = rid, ids, worker, vid
        self.pos = 0

    @property
    def done(self) -> bool:
        return self.pos >= len(self.ids)

    def row(self, k: int, finish: bool = True, **extra: Any) -> dict:
        chunk = self.ids[self.pos : self.pos + k]
        row: dict[str, Any] = {"rid": self.rid, "ids": chunk, "seq": self.pos}
        if self.pos == 0:
            row["start"] = {"worker": self.worker, "vid": self.vid}
        self.pos += len(chunk)
        if finish and self.pos >= len(self.ids):
            row["finish"] = {"reason": "length"}
        row.update(extra)
        return row

    def expected(self) -> str:
        return expected_text(self.ids)


def logged(d, text: str, timeout: float = 20.0) -> None:
    """Wait for `text` in a running detokd's log: its writer thread writes a line a moment
    after the event (the loop never waits on stderr), so an answer may come first."""
    wait_until(lambda: text in d.log(), timeout, f"{text!r} in the log")


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def scrape(port: int) -> dict[tuple, float]:
    """/metrics as {(sample name, (label, value), ...): value}, through the Prometheus parser."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = http_get(port, "/metrics")
    assert status == 200, body
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, *sorted(s.labels.items()))] = s.value
    return out


def metric(m: dict, name: str, **labels: str) -> float:
    return m.get((name, *sorted(labels.items())), 0.0)


# --------------------------------------------------------------------------- one frame's way

# The parts a frame passes through, by module. The records they hand each other (rows,
# counters, the output of a frame) and the bounded map both core and delivery keep belong
# to none of them.
PARTS = {"detokd.wire": "dialect", "detokd.sglang": "dialect", "detokd.core": "core",
         "detokd.delivery": "delivery", "detokd.conductor": "loop", "detokd.server": "loop"}
SHARED = ("detokd.core.records", "detokd.core.stats", "detokd.core.bounded", "detokd.output")
# The one call from one part into another below the loop: the dialect asks the core. The
# core returns what the frame produced, the dialect returns it encoded, and the loop hands
# that to delivery, which only sends it.
ONE_WAY = {("dialect", "core")}


def part_of(module: str) -> str | None:
    if module.startswith(SHARED):
        return None
    return next((p for prefix, p in PARTS.items() if module == prefix or module.startswith(prefix + ".")), None)


def crossings(fn: Callable[..., Any], *args: Any) -> tuple[list[str], list[str]]:
    """`fn(*args)` traced: every detokd function it enters ("module.qualname"), in order;
    and every call from one part into another that is not the loop's and not ONE_WAY
    (a call back into code the frame's way had left: delivery into the core or the
    dialect, the core into the dialect, any part into the loop)."""
    calls: list[str] = []
    wrong: list[str] = []
    stack: list[str | None] = []  # the part of each detokd function still running

    def profile(frame, event: str, _arg: Any) -> None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("detokd."):
            return
        if event == "call":
            name = f"{module}.{frame.f_code.co_qualname}"
            calls.append(name)
            callee = part_of(module)
            caller = next((p for p in reversed(stack) if p is not None), None)
            if callee and caller and caller not in (callee, "loop") and (caller, callee) not in ONE_WAY:
                wrong.append(f"{caller} -> {callee}: {name}")
            stack.append(callee)
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return calls, wrong


# --------------------------------------------------------------------------- asyncio


def arun(coro: Coroutine[Any, Any, Any], loop: str = "asyncio", timeout: float = 10.0) -> Any:
    """Run a coroutine to its end on a new asyncio (or uvloop) loop, within `timeout` s."""

    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout)

    if loop == "uvloop":
        import uvloop

        return uvloop.run(bounded())
    return asyncio.run(bounded())


async def until(pred: Callable[[], bool], timeout: float = 3.0) -> None:
    """Await until `pred` holds, yielding to the loop; fail at the deadline."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


# --------------------------------------------------------------------------- detokd's place


class FakeShards:
    """PULL sockets standing in for detokd shards' input sockets."""

    def __init__(self, n: int, ctx: zmq.Context | None = None) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.addresses = [f"inproc://shard-{uuid.uuid4().hex}" for _ in range(n)]
        self.socks = []
        for a in self.addresses:
            s = self.ctx.socket(zmq.PULL)
            s.bind(a)
            self.socks.append(s)

    def client(self, **kw: Any) -> SchedulerClient:
        return SchedulerClient(self.addresses, context=self.ctx, **kw)

    def recv(self, shard: int, timeout: float = 2.0) -> native.Inbound:
        s = self.socks[shard]
        assert s.poll(int(timeout * 1000)), f"shard {shard} got nothing"
        return native.decode_inbound(s.recv())

    def drain(self) -> list[list[native.Inbound]]:
        out: list[list[native.Inbound]] = []
        for s in self.socks:
            msgs = []
            while s.poll(5):  # inproc: a sent message is already in the pipe
                msgs.append(native.decode_inbound(s.recv()))
            out.append(msgs)
        return out

    def close(self) -> None:
        for s in self.socks:
            s.close(0)


class FakeDetokd:
    """A PUSH socket standing in for detokd's connection to one worker."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.connect(address)

    def text(self, *rows: native.OutRow) -> None:
        self.sock.send(native.encode(native.Text(list(rows))))

    def raw(self, frame: bytes) -> None:
        self.sock.send(frame)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def out_row(
    rid: str, text: str = "", n: int = 0, *, finish: str | None = None, error: str | None = None, meta: Any = None
) -> native.OutRow:
    """An output row as detokd would send it."""
    return native.OutRow(
        rid, text, native.Finish(finish) if finish else None, n,
        msgspec.Raw(msgspec.msgpack.encode(meta)) if meta is not None else native.NIL, error,
    )


# --------------------------------------------------------------------------- worker processes

# A tokenizer worker in a process of its own, so that it can exit or be killed as a real
# one is: it binds `address`, reads `read` text messages (all of them: -1) and then stops
# reading, bound, until killed. Each message's rows leave on stdout as one JSON line,
# flushed before the next recv: a line on stdout is a message the worker read.
RECORDER = r"""
import json, sys, threading, msgspec, zmq
address, read = sys.argv[1], int(sys.argv[2])
s = zmq.Context().socket(zmq.PULL)
if read >= 0:  # a worker that will stall holds little: the queue fills in detokd
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 4096)
s.bind(address)
print(json.dumps({"bound": True}), flush=True)
n = 0
while n != read:
    rows = msgspec.msgpack.decode(s.recv())["rows"]
    n += 1
    keep = [{k: r[k] for k in ("rid", "text", "finish", "error", "n_ids")} for r in rows]
    sys.stdout.write(json.dumps({"rows": keep}) + "\n")
    sys.stdout.flush()
print(json.dumps({"stalled": n}), flush=True)
threading.Event().wait()
"""


class WorkerProcess:
    """RECORDER in a subprocess, and what it read, by rid (a reader thread parses its
    stdout). `kill()` is SIGKILL: whatever it had not read is gone with it."""

    def __init__(self, address: str, read: int = -1) -> None:
        import json
        import subprocess
        import sys

        self.cond = threading.Condition()
        self.by_rid: dict[str, list[dict]] = collections.defaultdict(list)
        self.messages = 0
        self.stalled = False
        self.bound = False
        self.proc = subprocess.Popen([sys.executable, "-c", RECORDER, address, str(read)], stdout=subprocess.PIPE)
        self._json = json
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        assert self.proc.stdout is not None
        wait_on(self.cond, lambda: self.bound, 30, f"a worker process bound at {address}")

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                msg = self._json.loads(line)
            except ValueError:
                continue  # a line cut by SIGKILL: that message was never wholly read
            with self.cond:
                self.bound = self.bound or "bound" in msg
                self.stalled = self.stalled or "stalled" in msg
                for row in msg.get("rows", ()):
                    self.by_rid[row["rid"]].append(row)
                self.messages += "rows" in msg
                self.cond.notify_all()

    def rows(self, rid: str) -> list[dict]:
        with self.cond:
            return list(self.by_rid.get(rid, ()))

    def finished(self) -> set[str]:
        """The rids whose finishing row this worker read."""
        with self.cond:
            return {rid for rid, rows in self.by_rid.items() if rows[-1]["finish"] is not None}

    def wait(self, pred: Callable[[], Any], timeout: float, what: str) -> Any:
        return wait_on(self.cond, pred, timeout, what)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.thread.join(10)
