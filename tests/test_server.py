"""detokd serve as a real process: the protocol end to end over real ZMQ sockets."""

from __future__ import annotations

import random
import time

import msgspec
import pytest
import zmq
from conftest import oracle, vocab
from utils import logged

enc = msgspec.msgpack.encode
dec = msgspec.msgpack.decode

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "你好，世界！流式输出必须完整。",
    "Emoji: 🤖👍🏽 👩‍👩‍👧‍👦 done.",
    "def f(x):\n    return x ** 2  # code\n",
    "Привет, мир — Ελληνικά — مرحبا — नमस्ते",
]


class Peers:
    """The scheduler's PUSH socket and the workers' PULL sockets around one detokd."""

    def __init__(self, d, timeout_ms: int = 20000) -> None:
        self.ctx = zmq.Context()
        self.workers = []
        for address in d.workers:
            s = self.ctx.socket(zmq.PULL)
            s.setsockopt(zmq.RCVTIMEO, timeout_ms)
            s.bind(address)
            self.workers.append(s)
        self.feedback = None
        if d.feedback:
            self.feedback = self.ctx.socket(zmq.PULL)
            self.feedback.setsockopt(zmq.RCVTIMEO, timeout_ms)
            self.feedback.bind(d.feedback)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(d.input)

    def send(self, msg: dict) -> None:
        self.push.send(enc(msg))

    def recv(self, w: int = 0) -> dict:
        return dec(self.workers[w].recv())

    def rows_until(self, w: int, done, limit: int = 100000) -> list[dict]:
        """Every row worker w receives until done(rows) holds."""
        rows: list[dict] = []
        while not done(rows):
            msg = self.recv(w)
            assert msg["type"] == "text"
            rows.extend(msg["rows"])
            assert len(rows) < limit
        return rows

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture
def peers():
    made = []

    def make(d, **kw) -> Peers:
        p = Peers(d, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def finished(rids):
    want = set(rids)
    return lambda rows: want <= {r["rid"] for r in rows if r["finish"] or r["error"]}


def test_many_concurrent_requests_over_two_workers_are_exact_and_ordered(detokd, peers):
    d = detokd(workers=2)
    p = peers(d)
    v = vocab("deepseek")
    rng = random.Random(7)
    tail = v.backend.encode("User: hi\nAssistant:", add_special_tokens=False).ids
    reqs = {}
    for i in range(40):
        ids = v.backend.encode(TEXTS[i % len(TEXTS)] * (1 + i % 3), add_special_tokens=False).ids
        reqs[f"r{i}"] = (i % 2, ids)
    pos = {rid: 0 for rid in reqs}
    batches_for = [0, 0]
    while any(pos[r] <= len(ids) for r, (_, ids) in reqs.items()):
        rows, seen = [], set()
        for rid, (w, ids) in reqs.items():
            k = pos[rid]
            if k > len(ids) or rng.random() < 0.3:
                continue
            n = rng.randrange(0, 4)
            row = {"rid": rid, "ids": ids[k : k + n], "seq": k, "meta": {"step": k}}
            if k == 0:
                row["start"] = {"worker": w, "prompt_tail": tail}
            if k + n >= len(ids):
                row["finish"] = {"reason": "length"}
                pos[rid] = len(ids) + 1
            else:
                pos[rid] = k + n
            rows.append(row)
            seen.add(w)
        if rows:
            p.send({"type": "tokens", "rows": rows})
            for w in seen:
                batches_for[w] += 1
    for w in (0, 1):
        mine = [r for r, (ww, _) in reqs.items() if ww == w]
        msgs = []
        while not finished(mine)([row for m in msgs for row in m["rows"]]):
            msgs.append(p.recv(w))
        assert len(msgs) == batches_for[w], "one text message per worker per inbound batch"
        rows = [row for m in msgs for row in m["rows"]]
        assert {r["rid"] for r in rows} == set(mine), "each worker gets exactly its rids"
        for rid in mine:
            got = [r for r in rows if r["rid"] == rid]
            steps = [r["meta"]["step"] for r in got]
            assert steps == sorted(steps), "rows arrive in order, meta untouched"
            assert "".join(r["text"] for r in got) == oracle(v, tail, reqs[rid][1], True)
            assert got[-1]["finish"] == {"reason": "length", "matched": None}
            assert got[-1]["n_ids"] == len(reqs[rid][1])
    assert d.stop() == 0


@pytest.mark.parametrize("name", ["deepseek", "mistral_v3", "qwen2", "minilm"])
def test_random_texts_and_splits_through_the_process_match_the_oracle(detokd, peers, name):
    d = detokd(tokenizer=name)
    p = peers(d)
    v = vocab(name)
    rng = random.Random(name)
    specials = sorted(v.special)
    reqs = {}
    for i in range(12):
        text = "".join(rng.choice(TEXTS) for _ in range(3))
        ids = v.backend.encode(text, add_special_tokens=False).ids
        for _ in range(3):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials + [rng.randrange(v.size)]))
        cut = rng.randrange(len(ids))
        reqs[f"q{i}"] = (ids[:cut][-8:], ids[cut:], bool(i % 2))
    rows = []
    for rid, (tail, out, skip) in reqs.items():
        k, first = 0, True
        while first or k < len(out):
            n = rng.randrange(0, 5)
            row = {"rid": rid, "ids": out[k : k + n], "seq": k}
            if first:
                row["start"] = {"prompt_tail": tail, "skip_special_tokens": skip}
                first = False
            k += n
            if k >= len(out):
                row["finish"] = {"reason": "length"}
            rows.append(row)
    # Interleave requests, keeping each one's rows in order.
    queues = {rid: [r for r in rows if r["rid"] == rid] for rid in reqs}
    while queues:
        batch = []
        for rid in list(queues):
            batch.append(queues[rid].pop(0))
            if not queues[rid]:
                del queues[rid]
        p.send({"type": "tokens", "rows": batch})
    got = p.rows_until(0, finished(reqs))
    for rid, (tail, out, skip) in reqs.items():
        text = "".join(r["text"] for r in got if r["rid"] == rid)
        assert text == oracle(v, tail, out, skip), rid


def test_embeddings_are_forwarded_unchanged_to_their_worker(detokd, peers):
    d = detokd(workers=2)
    p = peers(d)
    data = {"vec": [0.5, -1.25, 3.0], "nested": {"k": [1, 2, {"x": None}]}}
    p.send({"type": "embeddings", "rows": [{"rid": "e1", "worker": 1, "data": data, "meta": {"n": 1}}]})
    msg = p.recv(1)
    assert msg == {"type": "embeddings", "rows": [{"rid": "e1", "worker": 1, "data": data, "meta": {"n": 1}}]}


def test_abort_frees_state_and_a_later_row_gets_an_error(detokd, peers):
    d = detokd(workers=2)
    p = peers(d)
    p.send({"type": "tokens", "rows": [{"rid": "a", "ids": [100], "start": {"worker": 1}}]})
    assert p.recv(1)["rows"][0]["rid"] == "a"
    p.send({"type": "abort", "rids": ["a"]})
    p.send({"type": "tokens", "rows": [{"rid": "a", "ids": [101], "seq": 1}]})
    for w in (0, 1):  # nobody knows whose it is any more: every worker is told
        row = p.recv(w)["rows"][0]
        assert (row["rid"], row["error"]) == ("a", "unknown_rid")


def test_register_adds_a_worker_at_run_time(detokd, peers, tmp_path):
    d = detokd(workers=1, register_enabled=True, register_allow=[f"ipc://{tmp_path}/*"])
    p = peers(d)
    late = p.ctx.socket(zmq.PULL)
    late.setsockopt(zmq.RCVTIMEO, 20000)
    address = f"ipc://{tmp_path}/late.sock"
    late.bind(address)
    v = vocab("deepseek")
    ids = v.backend.encode(TEXTS[1], add_special_tokens=False).ids
    p.send({"type": "register", "worker": 1, "address": address})
    p.send({"type": "tokens", "rows": [{"rid": "x", "ids": ids, "start": {"worker": 1}, "finish": {"reason": "stop"}}]})
    row = dec(late.recv())["rows"][0]
    assert (row["rid"], row["text"]) == ("x", oracle(v, [], ids, True))


def test_malformed_frames_leave_the_process_serving_exactly(detokd, peers):
    d = detokd()
    p = peers(d)
    v = vocab("deepseek")
    ids = v.backend.encode(TEXTS[2], add_special_tokens=False).ids
    for junk in (b"", b"\xff\xfe", enc([1, 2]), enc({"type": "nope"}), enc({"type": "tokens", "rows": 5}), enc({"type": "tokens"})):
        p.push.send(junk)
    # A batch with one malformed row: the others in it are decoded, the bad one answered.
    p.send({"type": "tokens", "rows": [{"rid": "good", "ids": ids, "start": {}}, {"rid": "bad", "ids": ["x"]}]})
    p.send({"type": "tokens", "rows": [{"rid": "good", "ids": [], "seq": len(ids), "finish": {"reason": "length"}}]})
    rows = p.rows_until(0, finished(["good", "bad"]))
    assert "".join(r["text"] for r in rows if r["rid"] == "good") == oracle(v, [], ids, True)
    assert [r["error"] for r in rows if r["rid"] == "bad"] == ["bad_row"]
    assert d.proc.poll() is None
    logged(d, "bad frame")


def test_a_row_nested_deeper_than_the_decoder_goes_costs_that_row_alone(detokd, peers):
    """A meta nested 2,000 deep (2 KB, under max_meta_bytes) fails msgspec's decode of the
    whole frame and of each row with RecursionError: the row is found by walking the
    bytes, answered bad_row, and every other row of its batch is decoded."""
    d = detokd()
    p = peers(d)
    v = vocab("deepseek")
    ids = v.backend.encode(TEXTS[1], add_special_tokens=False).ids
    deep = msgspec.Raw(b"\x91" * 2000 + b"\xc0")
    rows = [{"rid": "before", "ids": ids, "start": {}, "finish": {"reason": "length"}},
            {"rid": "deep", "ids": ids[:2], "start": {}, "meta": deep},
            {"rid": "after", "ids": ids, "start": {}, "finish": {"reason": "length"}}]
    p.send({"type": "tokens", "rows": rows})
    got = p.rows_until(0, finished(["before", "deep", "after"]))
    for rid in ("before", "after"):
        assert "".join(r["text"] for r in got if r["rid"] == rid) == oracle(v, [], ids, True)
    assert [r["error"] for r in got if r["rid"] == "deep"] == ["bad_row"]
    assert d.proc.poll() is None
    logged(d, "1 bad row(s)")


def test_meta_passes_through_byte_for_byte(detokd, peers):
    d = detokd()
    p = peers(d)
    meta = {"logprobs": [[-0.25, 17]], "ts": 1.5, "s": "x" * 100, "b": b"\x00\x01", "n": None}
    p.send({"type": "tokens", "rows": [{"rid": "m", "ids": [100], "start": {}, "meta": meta}]})
    raw = p.workers[0].recv()
    assert enc(meta) in raw
    assert dec(raw)["rows"][0]["meta"] == meta


def test_a_stop_string_detokd_finds_reaches_the_worker_and_the_scheduler(detokd, peers):
    d = detokd(feedback=True)
    p = peers(d)
    v = vocab("deepseek")
    ids = v.backend.encode("Count: one, two, three. END of story, more text", add_special_tokens=False).ids
    p.send({"type": "tokens", "rows": [{"rid": "s", "ids": [], "start": {"stop": ["END"], "vid": 3}}]})
    for k, i in enumerate(ids):
        p.send({"type": "tokens", "rows": [{"rid": "s", "ids": [i], "seq": k}]})
    rows = p.rows_until(0, finished(["s"]))
    full = v.hf.decode(ids)
    assert "".join(r["text"] for r in rows) == full[: full.index("END")]
    assert rows[-1]["finish"] == {"reason": "stop", "matched": "END"}
    stopped = dec(p.feedback.recv())
    completing = next(n for n in range(1, len(ids) + 1) if "END" in v.hf.decode(ids[:n]))
    assert stopped == {"type": "stopped", "rows": [{"rid": "s", "vid": 3, "matched": "END", "n_ids": completing}]}
    # The engine's finishing row frees the state; nothing reaches the worker for rows
    # after the stop, and once freed, the rid is unknown.
    p.send({"type": "tokens", "rows": [{"rid": "s", "ids": [], "seq": len(ids), "finish": {"reason": "stop", "matched": "END"}}]})
    p.send({"type": "tokens", "rows": [{"rid": "s", "ids": [1], "seq": len(ids)}]})
    row = p.recv(0)["rows"][0]
    assert (row["rid"], row["error"]) == ("s", "unknown_rid")


def test_sigterm_exits_cleanly(detokd, peers):
    d = detokd()
    p = peers(d)
    p.send({"type": "tokens", "rows": [{"rid": "a", "ids": [100], "start": {}}]})
    p.recv(0)
    t0 = time.monotonic()
    assert d.stop() == 0
    assert time.monotonic() - t0 < 15
