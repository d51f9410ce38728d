"""What one worst-case inbound frame at detokd's DEFAULT caps costs a real `detokd serve`.

/health must tell a stuck loop from a busy one and SIGTERM must end detokd within
shutdown_grace_s, so the caps bound the longest frame: this measures it, one scenario
(a function below) at a time, each on fresh detokds. What is measured, and the
figures: docs/reliability.md, "Worst frames".

    python -m detokbench worst-frames                  # ~150 s, docs/bench/worst.json
    python -m detokbench worst-frames --quick --json /tmp/worst.json  # 128 KiB frames: a smoke run
    python -m detokbench worst-frames --only malformed,mass_start

Exit status 0 when every scenario completed with its probe exact, /health answered 200
throughout, and SIGTERM ended detokd with status 0 within shutdown_grace_s.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import random
import tempfile
import threading
import time
from dataclasses import dataclass, field

import msgspec
import zmq

from detokd.config import Config
from detokd.tokenizer import Vocab, load
from detokd.wire import native
from detokd.wire.native import NIL, Abort, Control, EmbeddingRow, Embeddings, Finish, Register, Row, Start, Tokens
from detokrig import ROOT
from detokrig.metrics import get
from detokrig.rig import Rig
from detokrig.sink import Recorder

from .commands import header, parser, verdict, write_json

encode = native.encode
CAPS = Config()  # the defaults every scenario runs at


@dataclass(frozen=True)
class Scale:
    frame_bytes: int  # each frame is built just under this
    rows: int
    row_ids: int
    evict_states: int  # max_states of mass_start_evict


FULL = Scale(CAPS.max_frame_bytes - 4096, CAPS.max_rows, CAPS.max_row_ids, 1024)
QUICK = Scale(128 * 1024, 512, 1024, 64)


@dataclass
class Frame:
    data: bytes
    rows: int
    ids: int
    note: str
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
    note = f"{n} rows x {len(ids)} x id {tid} ({out} bytes of text each)"
    return Frame(tokens(rows), n, n * len(ids), note, token=tid)


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


def stop_holdback(scale: Scale, vocab: Vocab) -> Frame:
    """One request, every row the longest-text id; its start carries max_stop_strings
    stops of max_stop_chars characters in all, each spaces and a mark (at the defaults
    15 and one), so a text of spaces always holds its last spaces back."""
    tid = longest_id(vocab)
    ids = [tid] * scale.row_ids
    each = CAPS.max_stop_chars // CAPS.max_stop_strings
    stops = [" " * (each - 1) + chr(0x4E00 + i) for i in range(CAPS.max_stop_strings)]
    first = Row("S-0", ids, start=Start(stop=stops))
    fixed = 16 + len(encode(first))
    n = 1 + fit(scale.frame_bytes, fixed, len(encode(Row("S-0", ids, seq=2**32))), scale.rows - 1)
    rows = [first] + [Row("S-0", ids, seq=k * len(ids)) for k in range(1, n)]
    return Frame(tokens(rows), n, n * len(ids), f"1 start, 256 stops / 65536 chars, {n} rows x {len(ids)} x id {tid}")


def distinct_stops(rng: random.Random) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    each = CAPS.max_stop_chars // CAPS.max_stop_strings
    return ["".join(rng.choices(letters, k=each)) for _ in range(CAPS.max_stop_strings)]


def stop_distinct(scale: Scale, vocab: Vocab) -> Frame:
    """New requests, each with its own stop list (its own automaton), as many as fill the frame."""
    rng = random.Random(13)
    token = vocab.backend.encode("Hello", add_special_tokens=False).ids[0]
    first = Row("D-000000", [token], start=Start(stop=distinct_stops(rng)))
    n = fit(scale.frame_bytes, 16, len(encode(first)), scale.rows)
    rows = [first] + [Row(f"D-{i:06d}", [token], start=Start(stop=distinct_stops(rng))) for i in range(1, n)]
    return Frame(tokens(rows), n, n, f"{n} starts of a distinct max stop list each")


def abort_rids(scale: Scale) -> list[str]:
    width = min(CAPS.max_rid_len, (scale.frame_bytes - 32) // scale.rows - 16)  # the setup's starts fit too
    return [padded_rid("A-", i, width) for i in range(scale.rows)]


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
        Scenario("stop_distinct", stop_distinct),
        Scenario("abort_mass", abort_mass,  # its rids started first, so the abort frees live requests
                 setup=lambda s, _: tokens([Row(r, [], start=Start()) for r in abort_rids(s)])),
        Scenario("abort_over", abort_over),
        Scenario("embeddings_mass", embeddings_mass),
        Scenario("register_huge", register_huge),
        Scenario("control_huge", control_huge),
        Scenario("window_byte_run", window_byte_run, {"codec": "window", "tokenizer": "mistral_v3"}),
    ]


SEND_MS = 60_000  # detokd takes no input for a minute: give up
EXIT_WAIT_S = 120  # after SIGTERM; beyond, detokd is killed and the run says so
ANSWER_WAIT_S = 1800  # the slowest frame's probe; beyond, the scenario failed
ANSWER_AFTER_EXIT_S = 5  # for the last of the answer to come in once detokd exited
HEALTH_EVERY_S = 0.05
HEALTH_TIMEOUT_S = 10.0
SIGTERM_AFTER_S = 0.1
WARM_TEXTS = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Ünïcödé, 日本語のテキスト, emoji 🎉🚀 and Ελληνικά.",
    "def f(x):\n    return [i * i for i in range(x)]  # code",
)
PROBE_TEXT = "The probe after the frame: naïve café, 中文, 🎉 — done."


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
    return len(b) - (1 if b[0] < 0xD9 else {0xD9: 2, 0xDA: 3, 0xDB: 5}[b[0]])


@dataclass
class Message:
    at: float  # time.monotonic() when it arrived
    nbytes: int
    rows: int
    text_bytes: int
    errors: collections.Counter
    probe: bool


class Worker(Recorder):
    """Logs every message (a Message); rows of warm-up and probe rids are kept, decoded."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.log: list[Message] = []
        super().__init__(ctx, [address], zero_copy=True)

    def read(self, buf: memoryview) -> tuple[Message, list]:
        msg = _text_lite.decode(buf)
        m = Message(time.monotonic(), len(buf), len(msg.rows), 0, collections.Counter(), False)
        kept = []
        for row in msg.rows:
            m.text_bytes += str_bytes(row.text)
            if row.error is not None:
                m.errors[row.error] += 1
            if row.rid.startswith(("warm-", "probe-")):
                m.probe |= row.rid.startswith("probe-")
                text, finish = msgspec.msgpack.decode(row.text, type=str), msgspec.msgpack.decode(row.finish)
                kept.append({"rid": row.rid, "text": text, "finish": finish, "error": row.error})
        return m, kept

    def keep(self, got: tuple[Message, list]) -> None:
        self.log.append(got[0])
        super().keep({"type": "text", "rows": got[1]})

    def since(self, t0: float) -> list[Message]:
        with self.cond:
            return [m for m in self.log if m.at >= t0]


class Target(Rig):
    """One fresh `detokd serve` (spawned at once) with its worker and an engine."""

    def __init__(self, root: str, name: str, settings: dict) -> None:
        super().__init__(f"{name[:12]}-", lambda ctx, addresses: [Worker(ctx, addresses[0])], root=root,
                         **{"tokenizer": "deepseek", **settings})
        self.sink = self.sinks[0]
        self.send = self.spawn().engine(SEND_MS).raw

    def close(self) -> None:
        self.stop(EXIT_WAIT_S)
        super().close()


def warm_up(t: Target, vocab: Vocab) -> None:
    """A few honest requests in three steps; their text must be the oracle's."""
    reqs = {f"warm-{k}": vocab.backend.encode(s, add_special_tokens=False).ids for k, s in enumerate(WARM_TEXTS)}
    for step in range(3):
        cuts = {rid: (len(ids) * step // 3, len(ids) * (step + 1) // 3) for rid, ids in reqs.items()}
        t.send(tokens([Row(rid, reqs[rid][a:b], seq=a, start=Start() if step == 0 else None,
                           finish=Finish("length") if step == 2 else None) for rid, (a, b) in cuts.items()]))
    t.sink.wait(lambda: all(t.sink.ended(rid) for rid in reqs), 60, "warm-up answers")
    wrong = [rid for rid, ids in reqs.items() if t.sink.text(rid) != vocab.reference([], ids)]
    if wrong:
        raise AssertionError(f"warm-up text differs from the oracle for {wrong}")


class HealthPoller(threading.Thread):
    """GET /health every 50 ms until stopped: each answer's latency and status."""

    def __init__(self, port: int, t0: float) -> None:
        super().__init__(daemon=True)
        self.port, self.t0, self.done = port, t0, threading.Event()
        self.latencies: list[float] = []
        self.bad: list[dict] = []  # non-200 answers and failures (status None)

    def run(self) -> None:
        while True:
            start = time.monotonic()
            try:
                status, body = get(self.port, "/health", HEALTH_TIMEOUT_S)
            except OSError as e:  # a timeout, a refused connection
                status, body = None, f"{type(e).__name__}: {e}"
            self.latencies.append(time.monotonic() - start)
            if status != 200:
                self.bad.append({"at_s": round(start - self.t0, 3), "status": status, "body": body.strip(),
                                 "latency_s": round(self.latencies[-1], 3)})
            if self.done.wait(max(0.0, start + HEALTH_EVERY_S - time.monotonic())):
                return

    def stop(self) -> dict:
        self.done.set()
        self.join(HEALTH_TIMEOUT_S + 5)
        bad = self.bad
        return {
            "polls": len(self.latencies),
            "worst_latency_s": round(max(self.latencies, default=0.0), 3),
            "non_200": len(bad),
            "statuses": dict(collections.Counter(str(b["status"]) for b in bad)),
            "first_non_200_at_s": bad[0]["at_s"] if bad else None,
            "last_non_200_at_s": bad[-1]["at_s"] if bad else None,
            "samples": bad[:3] + bad[-2:] if len(bad) > 5 else bad,
        }


def handle(t: Target, frame: Frame, vocab: Vocab, name: str) -> dict:
    """The frame, then a probe: time to both answers, /health meanwhile, memory."""
    rid, ids = f"probe-{name}", vocab.backend.encode(PROBE_TEXT, add_special_tokens=False).ids
    before = t.memory_mb()
    t0 = time.monotonic()
    poller = HealthPoller(t.port, t0)
    poller.start()
    t.send(frame.data)
    sent_s = time.monotonic() - t0
    t.send(tokens([Row(rid, ids, start=Start(), finish=Finish("length"))]))
    try:
        t.sink.wait(lambda: t.sink.ended(rid), ANSWER_WAIT_S, "answer to the probe")
    finally:
        health = poller.stop()
    after = t.memory_mb()
    msgs = t.sink.since(t0)
    answer = [m for m in msgs if not m.probe]
    text = t.sink.text(rid)
    return {
        "send_s": round(sent_s, 3),
        "answer_s": round(answer[-1].at - t0, 3) if answer else None,
        "probe_s": round(next(m.at for m in msgs if m.probe) - t0, 3),
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
    """SIGTERM ~100 ms after the frame was sent; seconds until detokd exited."""
    t0 = time.monotonic()
    t.send(frame.data)
    time.sleep(max(0.0, t0 + SIGTERM_AFTER_S - time.monotonic()))
    signalled = time.monotonic()
    code = t.stop(EXIT_WAIT_S)
    exit_s = time.monotonic() - signalled
    with contextlib.suppress(TimeoutError):  # what detokd queued before it exited may still be on its way in
        t.sink.wait(lambda: t.sink.since(t0), ANSWER_AFTER_EXIT_S, "answer")
    return {
        "signal_after_send_s": round(signalled - t0, 3),
        "exit_s": round(exit_s, 3),
        "returncode": None if code == "killed" else code,  # 0: clean; 3: shutdown_grace_s ran out
        "grace_s": t.cfg.shutdown_grace_s,
        "grace_ran_out": "not stopped within shutdown_grace_s" in t.detokd.log(),
        "answer_delivered": bool(t.sink.since(t0)),  # the frame's answer reached the worker
    }


def run_scenario(sc: Scenario, pair: tuple[Target, Target], vocab: Vocab, scale: Scale) -> dict:
    """On one detokd the frame measured; on the other, SIGTERM after the same frame."""
    measured, stopped = pair
    out: dict = {"name": sc.name, "settings": sc.settings, "completed": False}
    try:
        frame = sc.build(scale, vocab)
        out["frame"] = {"bytes": len(frame.data), "rows": frame.rows, "ids": frame.ids, "token": frame.token,
                        "note": frame.note}
        if len(frame.data) > CAPS.max_frame_bytes:  # ZMQ would drop it unread
            raise ValueError(f"frame of {len(frame.data)} bytes is over max_frame_bytes")
        for t in pair:
            t.ready()
            warm_up(t, vocab)
            if sc.setup is not None:
                before = len(t.sink.since(0))
                t.send(sc.setup(scale, vocab))
                t.sink.wait(lambda t=t, n=before: len(t.sink.since(0)) > n, ANSWER_WAIT_S, "the setup frame's answer")
        out.update(handle(measured, frame, vocab, sc.name))
        measured.close()
        out["exit_after_normal_stop"] = measured.detokd.returncode
        out["sigterm"] = sigterm(stopped, frame)
        out["completed"] = out["probe"]["exact"]
    except Exception as exc:  # a failed scenario is a figure too; the others still run
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for t in pair:
            t.close()
    return out


def table(results: list[dict]) -> str:
    def mb(n: float) -> str:
        return f"{n / 2**20:.1f}"

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
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = parser("worst-frames", __doc__)
    ap.add_argument("--json", default=str(ROOT / "docs" / "bench" / "worst.json"), help="where to write the results")
    ap.add_argument("--quick", action="store_true", help="small frames: a smoke run of a few seconds")
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    args = ap.parse_args(argv)
    scale = QUICK if args.quick else FULL
    chosen = [s for s in scenarios(scale) if not args.only or s.name in args.only.split(",")]
    started = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="worst-") as root:
        # Every detokd is started up front (a start takes seconds of CPU, mostly loading
        # the tokenizer); each waits idle until its scenario, so none is starting while
        # another is measured.
        pairs = [(Target(root, sc.name, sc.settings), Target(root, sc.name, sc.settings)) for sc in chosen]
        vocabs = {name: load(name) for name in {sc.settings.get("tokenizer", "deepseek") for sc in chosen}}
        for sc, pair in zip(chosen, pairs, strict=True):
            print(f"{sc.name} ...", flush=True)
            results.append(run_scenario(sc, pair, vocabs[sc.settings.get("tokenizer", "deepseek")], scale))
    caps = {k: v for k, v in msgspec.structs.asdict(CAPS).items() if k.startswith("max_")}
    caps.update(shutdown_grace_s=CAPS.shutdown_grace_s, health_timeout=CAPS.health_timeout, linger_ms=CAPS.linger_ms)
    wall_s = round(time.monotonic() - started, 1)
    write_json(args.json, {**header("worst-frames", argv), "quick": args.quick, "caps": caps, "wall_s": wall_s,
                           "scenarios": results})
    print(table(results))
    print(f"written to {args.json}")
    return verdict([p for r in results for p in problems(r)])


def problems(r: dict) -> list[str]:
    """What a scenario's figures say went wrong: the guarantees docs/reliability.md gives."""
    if not r["completed"]:
        return [f"{r['name']}: {r.get('error') or 'the probe after the frame was not exact'}"]
    health, term = r["health"], r["sigterm"]
    out = [f"{r['name']}: /health answered {health['statuses']}"] if health["non_200"] else []
    if term["returncode"] != 0 or term["grace_ran_out"]:
        out.append(f"{r['name']}: SIGTERM ended detokd with {term['returncode']} after {term['exit_s']} s "
                   f"(shutdown_grace_s {term['grace_s']})")
    return out
