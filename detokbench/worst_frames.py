"""What one worst-case inbound frame at detokd's DEFAULT caps costs a real `detokd serve`.

/health must tell a stuck loop from a busy one and SIGTERM must end detokd within
shutdown_grace_s, so the caps bound the longest frame: this measures it. Each scenario
(below, one function each: mass_start, longest_token, malformed, stop_holdback,
stop_distinct, abort_*, embeddings_mass, register_huge, control_huge, window_byte_run)
builds one `tokens`/... frame just under max_frame_bytes with detokd.wire.native's
Structs and sends it to a fresh detokd (default caps, deepseek, one worker) after a
warm-up checked against Vocab.reference. Per scenario: seconds until its answer and
until a probe request's (text checked); /health polled every 50 ms (worst latency,
non-200 answers); VmHWM/VmRSS before and after; on another fresh detokd, SIGTERM ~100 ms
after the same frame: seconds to exit and the status. Scenarios and figures:
docs/reliability.md, "Worst frames".

    python -m detokbench worst-frames                  # ~150 s, docs/bench/worst.json
    python -m detokbench worst-frames --quick --json /tmp/worst.json  # 128 KiB frames: a smoke run
    python -m detokbench worst-frames --only malformed,mass_start

Exit status 0 when every scenario completed with its probe exact.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import platform
import random
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq

from detokd.config import Config
from detokd.tokenizer import Vocab, load
from detokd.wire.native import NIL, Abort, Control, EmbeddingRow, Embeddings, Finish, Register, Row, Start, Tokens, encode

from . import ROOT
from .commands import command_line, parser, write_json
from .metrics import get
from .proc import memory
from .rig import Rig
from .sink import Sink

# --------------------------------------------------------------------------- the scale, each scenario's frame


CAPS = Config()  # the defaults every scenario runs at


@dataclass(frozen=True)
class Scale:
    frame_bytes: int  # each frame is built just under this
    rows: int
    row_ids: int
    evict_states: int  # max_states of mass_start_evict
    distinct_starts: int  # 0: no stop_distinct; -1: a full frame of them


FULL = Scale(CAPS.max_frame_bytes - 4096, CAPS.max_rows, CAPS.max_row_ids, 1024, -1)  # -1: a full frame
QUICK = Scale(128 * 1024, 512, 1024, 64, -1)


@dataclass
class Frame:
    data: bytes
    rows: int
    ids: int
    note: str
    per_start_bytes: int = 0  # stop_distinct: what one more start adds to a frame
    token: int | None = None  # the one id the rows repeat, where they do


def tokens(rows: list[Row]) -> bytes:
    return encode(Tokens(rows))


def fit(budget: int, fixed: int, per_row: int, cap: int) -> int:
    """Rows of `per_row` bytes that fit beside `fixed` bytes (envelope, first row)."""
    return max(1, min(cap, (budget - fixed - 8) // per_row))


def padded_rid(prefix: str, i: int, width: int) -> str:
    head = f"{prefix}{i:06d}-"
    return head + "x" * (width - len(head))


def mass_start(scale: Scale, vocab: Vocab) -> Frame:
    """max_rows new requests, one id each; rids as long as the frame allows."""
    token = vocab.backend.encode("Hello", add_special_tokens=False).ids[0]
    per_row = (scale.frame_bytes - 16) // scale.rows

    def size(width: int) -> int:
        return len(encode(Row(padded_rid("m-", 0, width), [token], start=Start())))

    width = min(CAPS.max_rid_len, per_row - (size(300) - 300))
    while size(width) > per_row:  # a shorter rid may take a shorter header: settle it
        width -= 1
    rows = [Row(padded_rid("m-", i, width), [token], start=Start()) for i in range(scale.rows)]
    return Frame(tokens(rows), len(rows), len(rows), f"{len(rows)} starts, rids of {width} chars, id {token}")


def longest_token(scale: Scale, vocab: Vocab) -> Frame:
    """Rows of row_ids copies of the longest-text id, one new request each."""
    tid = longest_id(vocab)
    ids = [tid] * scale.row_ids
    n = fit(scale.frame_bytes, 16, len(encode(Row("L-000000", ids, start=Start()))), scale.rows)
    rows = [Row(f"L-{i:06d}", ids, start=Start()) for i in range(n)]
    out = len(vocab.decode([tid], True).encode())
    return Frame(tokens(rows), n, n * len(ids), f"{n} rows x {len(ids)} x id {tid} ({out} bytes of text each)", token=tid)


@functools.cache
def longest_id(vocab: Vocab) -> int:
    """The id whose decode is longest in UTF-8 bytes; the lowest id among equals."""
    return max(range(vocab.size), key=lambda i: (len(vocab.decode([i], True).encode()), -i))


def malformed(scale: Scale, vocab: Vocab) -> Frame:
    """max_rows rows whose ids end in a string: msgspec reads every id of every row
    before it fails, once for the frame and once per row in the salvage."""
    k = (scale.frame_bytes - 16) // scale.rows - len(msgspec.msgpack.encode({"rid": "bad-000000", "ids": ["x"]})) - 3
    msg = {"type": "tokens", "rows": [{"rid": f"bad-{i:06d}", "ids": [1] * k + ["x"]} for i in range(scale.rows)]}
    return Frame(msgspec.msgpack.encode(msg), scale.rows, scale.rows * k, f"{scale.rows} rows of {k} ids and a string")


def holdback_stops() -> list[str]:
    """max_stop_strings strings of max_stop_chars characters in all, each spaces and a
    mark (at the defaults 15 and one), so a text of spaces always holds its last
    spaces back."""
    n = CAPS.max_stop_strings
    each = CAPS.max_stop_chars // n
    return [" " * (each - 1) + chr(0x4E00 + i) for i in range(n)]


def stop_holdback(scale: Scale, vocab: Vocab) -> Frame:
    """One request: its start carries holdback_stops(), every row the longest-text id."""
    tid = longest_id(vocab)
    ids = [tid] * scale.row_ids
    first = Row("S-0", ids, start=Start(stop=holdback_stops()))
    fixed = 16 + len(encode(first))
    n = 1 + fit(scale.frame_bytes, fixed, len(encode(Row("S-0", ids, seq=2**32))), scale.rows - 1)
    rows = [first] + [Row("S-0", ids, seq=k * len(ids)) for k in range(1, n)]
    return Frame(tokens(rows), n, n * len(ids), f"1 start, 256 stops / 65536 chars, {n} rows x {len(ids)} x id {tid}")


def distinct_stops(rng: random.Random) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    each = CAPS.max_stop_chars // CAPS.max_stop_strings
    return ["".join(rng.choices(letters, k=each)) for _ in range(CAPS.max_stop_strings)]


def stop_distinct(scale: Scale, vocab: Vocab) -> Frame:
    """New requests, each with its own stop list: its own automaton. As many as fill
    the frame, or distinct_starts of them (then a full frame is extrapolated)."""
    rng = random.Random(13)
    token = vocab.backend.encode("Hello", add_special_tokens=False).ids[0]
    first = Row("D-000000", [token], start=Start(stop=distinct_stops(rng)))
    per_start = len(encode(first))
    full = fit(scale.frame_bytes, 16, per_start, scale.rows)
    n = full if scale.distinct_starts < 0 else min(full, scale.distinct_starts)
    rows = [first] + [Row(f"D-{i:06d}", [token], start=Start(stop=distinct_stops(rng))) for i in range(1, n)]
    partial = n < full
    note = f"{n} starts of a distinct max stop list each" + (" (partial frame)" if partial else "")
    return Frame(tokens(rows), n, n, note, per_start if partial else 0)


def abort_rids(scale: Scale) -> list[str]:
    width = min(CAPS.max_rid_len, (scale.frame_bytes - 32) // scale.rows - 16)  # the setup's starts fit too
    return [padded_rid("A-", i, width) for i in range(scale.rows)]


def abort_setup(scale: Scale, vocab: Vocab) -> bytes:
    """abort_mass's rids started, so the abort frees live requests."""
    return tokens([Row(rid, [], start=Start()) for rid in abort_rids(scale)])


def abort_mass(scale: Scale, vocab: Vocab) -> Frame:
    rids = abort_rids(scale)
    return Frame(encode(Abort(rids)), len(rids), 0, f"{len(rids)} rids of {len(rids[0])} chars, each live")


def abort_over(scale: Scale, vocab: Vocab) -> Frame:
    n = scale.frame_bytes - 32  # an empty str is one byte: 0xa0
    data = msgspec.msgpack.encode({"type": "abort", "rids": []})[:-1] + b"\xdd" + n.to_bytes(4, "big") + b"\xa0" * n
    return Frame(data, n, 0, f"{n} empty rids (max_rows is {CAPS.max_rows})")


def embeddings_mass(scale: Scale, vocab: Vocab) -> Frame:
    per_row = (scale.frame_bytes - 32) // scale.rows
    width = min(CAPS.max_rid_len, per_row - len(encode(EmbeddingRow("", 0, msgspec.Raw(b"\x91\x01")))) - 3)
    rows = [EmbeddingRow(padded_rid("E-", i, width), 0, msgspec.Raw(b"\x91\x01")) for i in range(scale.rows)]
    return Frame(encode(Embeddings(rows)), len(rows), 0, f"{len(rows)} rows, rids of {width} chars")


def register_huge(scale: Scale, vocab: Vocab) -> Frame:
    address = "ipc://" + "r" * (scale.frame_bytes - 64)
    return Frame(encode(Register(0, address)), 1, 0, f"an address of {len(address)} chars")


def control_huge(scale: Scale, vocab: Vocab) -> Frame:
    op = "x" * (scale.frame_bytes - 64)
    return Frame(encode(Control(op)), 1, 0, f"an op of {len(op)} chars")


def window_byte_run(scale: Scale, vocab: Vocab) -> Frame:
    """max_rows rows at every scale (1.5 MB: its cost is in the rows, not the bytes, so
    --quick catches a codec quadratic in the run), the last one a word that ends the run
    and the request, so its final decode is measured too."""
    token = {t: i for i, t in enumerate(vocab.tokens) if t}
    run = [token[f"<0x{b:02X}>"] for b in "中".encode()] * ((CAPS.max_rows - 1) // 3)
    word = vocab.backend.encode(" end", add_special_tokens=False).ids[-1:]
    rows = [Row("B-0", [i], seq=k, start=Start() if k == 0 else None) for k, i in enumerate(run)]
    rows.append(Row("B-0", word, seq=len(run), finish=Finish("length")))
    return Frame(tokens(rows), len(rows), len(rows), f"{len(run)} one-id rows of one open byte run, then a word")


@dataclass(frozen=True)
class Scenario:
    name: str
    build: object  # (Scale, Vocab) -> Frame
    settings: dict = field(default_factory=dict)  # config keys beyond the defaults
    setup: object = None  # (Scale, Vocab) -> bytes: a frame sent (and answered) before the measured one


def scenarios(scale: Scale) -> list[Scenario]:
    return [
        Scenario("mass_start", mass_start),
        Scenario("mass_start_evict", mass_start, {"max_states": scale.evict_states}),
        Scenario("longest_token", longest_token),
        Scenario("malformed", malformed),
        Scenario("stop_holdback", stop_holdback),
    ] + ([Scenario("stop_distinct", stop_distinct)] if scale.distinct_starts else []) + [
        Scenario("abort_mass", abort_mass, setup=abort_setup),
        Scenario("abort_over", abort_over),
        Scenario("embeddings_mass", embeddings_mass),
        Scenario("register_huge", register_huge),
        Scenario("control_huge", control_huge),
        Scenario("window_byte_run", window_byte_run, {"codec": "window", "tokenizer": "mistral_v3"}),
    ]


# --------------------------------------------------------------------------- one fresh detokd's peers, the warm-up


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


class Target(Rig):
    """One fresh `detokd serve` (spawned at once) with its worker and an engine."""

    def __init__(self, root: str, name: str, settings: dict) -> None:
        super().__init__(f"{name[:12]}-", lambda ctx, addresses: [Worker(ctx, addresses[0])], root=root,
                         **{"tokenizer": "deepseek", **settings})
        self.settings = settings
        self.sink, self.proc = self.sinks[0], self.spawn().detokd
        self.send = self.engine(SEND_MS).raw

    def close(self) -> None:
        self.stop(EXIT_WAIT_S)
        super().close()


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


# --------------------------------------------------------------------------- what one frame costs


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


# --------------------------------------------------------------------------- every scenario, the table, the JSON


def run_scenario(sc: Scenario, pair: tuple[Target, Target], vocab: Vocab, scale: Scale) -> dict:
    measured, stopped = pair
    out: dict = {"name": sc.name, "settings": sc.settings, "completed": False}
    try:
        frame = sc.build(scale, vocab)
        out["frame"] = {"bytes": len(frame.data), "rows": frame.rows, "ids": frame.ids, "token": frame.token, "note": frame.note}
        if len(frame.data) > CAPS.max_frame_bytes:  # ZMQ would drop it unread
            raise ValueError(f"frame of {len(frame.data)} bytes is over max_frame_bytes")
        for t in pair:
            t.ready()
            warm_up(t, vocab)
            if sc.setup is not None:
                before = len(t.sink.since(0))
                t.send(sc.setup(scale, vocab))
                t.sink.wait(lambda t=t: len(t.sink.since(0)) > before, ANSWER_WAIT_S, "the setup frame's answer")
        out.update(handle(measured, frame, vocab, sc.name))
        measured.close()
        out["exit_after_normal_stop"] = measured.proc.returncode
        out["sigterm"] = sigterm(stopped, frame)
        if frame.per_start_bytes:
            out["extrapolated"] = extrapolate(frame, out, scale)
        out["completed"] = out["probe"]["exact"]
    except Exception as exc:  # a failed scenario is a figure too; the others still run
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for t in pair:
            t.close()
    return out


def mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def table(results: list[dict]) -> str:
    head = (
        f"{'scenario':<17} {'frame MB':>8} {'rows':>6} {'answer s':>8} {'probe s':>8} {'out MB':>8} "
        f"{'health worst s':>14} {'non-200':>7} {'HWM MB before>after':>20} {'SIGTERM exit s (rc)':>20}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        if "health" not in r:
            lines.append(f"{r['name']:<17} FAILED: {r.get('error')}")
            continue
        m, s = r["memory"], r.get("sigterm", {})
        lines.append(
            f"{r['name']:<17} {mb(r['frame']['bytes']):>8} {r['frame']['rows']:>6} {r['answer_s'] or 0:>8.2f} "
            f"{r['probe_s']:>8.2f} {mb(r['answer']['bytes']):>8} {r['health']['worst_latency_s']:>14.3f} "
            f"{r['health']['non_200']:>7} {m['before']['hwm_mb']:>9.0f} > {m['after']['hwm_mb']:<8.0f} "
            f"{s.get('exit_s', float('nan')):>14.2f} ({s.get('returncode')})"
        )
        if "extrapolated" in r:
            e = r["extrapolated"]
            lines.append(
                f"{'':<17} a full frame ({e['starts_in_a_full_frame']} starts): ~{e['full_frame_s']} s, "
                f"~{e['full_frame_rss_mb']} MB more RSS"
            )
    return "\n".join(lines)


def meta(args: argparse.Namespace, command: str) -> dict:
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    caps = {k: getattr(CAPS, k) for k in msgspec.structs.asdict(CAPS) if k.startswith("max_")}
    caps.update(shutdown_grace_s=CAPS.shutdown_grace_s, health_timeout=CAPS.health_timeout, linger_ms=CAPS.linger_ms)
    return {
        "command": command,
        "quick": args.quick,
        "commit": commit,
        "caps": caps,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }


def main(argv: list[str]) -> int:
    ap = parser("worst-frames", __doc__)
    ap.add_argument("--json", default=str(ROOT / "docs" / "bench" / "worst.json"), help="where to write the results")
    ap.add_argument("--quick", action="store_true", help="small frames: a smoke run of a few seconds")
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    ap.add_argument("--distinct-starts", type=int, help="starts in stop_distinct's frame")
    args = ap.parse_args(argv)
    scale = QUICK if args.quick else FULL
    if args.distinct_starts is not None:
        scale = dataclasses.replace(scale, distinct_starts=args.distinct_starts)
    chosen = [s for s in scenarios(scale) if not args.only or s.name in args.only.split(",")]
    started = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="worst-") as root:
        # Every detokd is started up front (a start takes seconds of CPU, mostly loading
        # the tokenizer); each waits idle until its scenario, so none is starting while
        # another is measured.
        pairs = [(Target(root, sc.name, sc.settings), Target(root, sc.name, sc.settings)) for sc in chosen]
        vocabs = {name: load(name) for name in {sc.settings.get("tokenizer", "deepseek") for sc in chosen}}
        for sc, pair in zip(chosen, pairs):
            print(f"{sc.name} ...", flush=True)
            results.append(run_scenario(sc, pair, vocabs[sc.settings.get("tokenizer", "deepseek")], scale))
    report = {**meta(args, command_line("worst-frames", argv)), "wall_s": round(time.monotonic() - started, 1), "scenarios": results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    write_json(args.json, report)
    print(table(results))
    print(f"written to {args.json}")
    return 0 if all(r["completed"] for r in results) else 1
