"""The SGLang dialect in-process, over real sockets: what SGLang's own detokenizer never
faces because it blocks on a full send queue, and detokd does not."""

from __future__ import annotations

import pickle
import time

import pytest
import zmq
from conftest import fast_codec, vocab
from messages import Calls
from replay import accumulate
from utils import crossings

from detokd.conductor import Conductor
from detokd.core.detokenizer import Detokenizer, Limits
from detokd.core.outbox import Outbox
from detokd.core.stats import Stats
from detokd.delivery import Delivery
from detokd.gc_policy import GcPolicy
from detokd.sglang import schema
from detokd.sglang.dialect import SglangDialect
from detokrig.sglang_replay import Scripted, build_stream, ipc_encoding

NAME = "deepseek"
PROMPT = [1, 2, 3]


class Rig:
    """Four requests streaming one text as SGLang's scheduler encodes them (msgpack), a
    TokenizerManager's PULL socket, and the dialect between them, run as detokd's loop
    runs it (`step`), with the sockets' options and the core's limits a test chooses."""

    def __init__(self, tmp_path, text: str, *, rcvhwm: int | None = None, limits: Limits = Limits(),
                 encoding: str = "msgpack", **delivery) -> None:
        self.v = vocab(NAME)
        self.out = self.v.hf.encode(text, add_special_tokens=False)
        self.reqs = [Scripted(rid=f"r{k}", prompt_ids=PROMPT, output_ids=self.out) for k in range(4)]
        self.encoding = encoding
        with ipc_encoding(encoding):
            from sglang.srt.managers import io_struct

            self.messages = build_stream(self.reqs, encoding=encoding, tokenizer=self.v.hf)
            self.frames = [self.encode(m) for m in self.messages]
        self.io = io_struct
        address = f"ipc://{tmp_path}/tokenizer.sock"
        self.ctx = zmq.Context()
        self.reader = self.ctx.socket(zmq.PULL)
        if rcvhwm is not None:
            self.reader.setsockopt(zmq.RCVHWM, rcvhwm)
        self.reader.bind(address)
        self.stats, outbox = Stats(), Outbox([0])
        self.delivery = Delivery(self.ctx, [address], feedback=None, linger_ms=0, stats=self.stats, **delivery)
        self.core = Detokenizer(
            fast_codec(NAME), self.v.size, outbox, max_states=64, max_prompt_tail=8, stats=self.stats, limits=limits
        )
        ipc = schema.MsgpackCodec() if encoding == "msgpack" else schema.PickleCodec()
        self.dialect = SglangDialect(self.core, self.delivery, GcPolicy(self.stats), self.stats, ipc=ipc, vocab_size=self.v.size)
        self.conductor = Conductor(self.dialect, self.core, self.delivery, self.stats)
        self.got: list = []

    def encode(self, message) -> bytes:
        """A message as SGLang's scheduler sends it in this rig's encoding."""
        if self.encoding == "pickle":
            return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        from sglang.srt.managers import io_struct

        return io_struct.msgpack_encode(message)

    def want(self) -> str:
        return self.v.reference(PROMPT, self.out)

    def step(self, frame: bytes) -> None:
        """One turn of detokd's loop."""
        self.delivery.flush()
        self.conductor.frame(frame)

    def read(self, wait_ms: int) -> None:
        """What reaches the reader, the backlog moving on meanwhile, until nothing does."""
        deadline = time.monotonic() + 10
        decode = pickle.loads if self.encoding == "pickle" else self.io.msgpack_decode
        with ipc_encoding(self.encoding):
            while True:
                self.delivery.flush()
                if self.reader.poll(wait_ms):
                    self.got.append(decode(self.reader.recv()))
                elif not self.delivery.backlogged:
                    return
                assert time.monotonic() < deadline, "the backlog never drained"

    def close(self) -> None:
        self.delivery.close()
        self.reader.close(0)
        self.ctx.term()


@pytest.fixture
def rig(tmp_path):
    made = []

    def make(text: str, **kw) -> Rig:
        made.append(Rig(tmp_path, text, **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


def test_a_tokenizer_manager_that_stops_reading_gets_aborts_not_silence(rig):
    """The TokenizerManager stops reading; detokd's queue to it fills and a batch is lost.
    The requests of that batch are failed: once the TokenizerManager reads again, the
    next row of each that reaches it is an abort naming worker_stalled, after a prefix
    of the right text; every request whose rows all arrived streams exactly the
    oracle's text. (A request whose finishing row was in a lost batch hears nothing
    more: docs/sglang.md, "A TokenizerManager that stops reading".)"""
    # Long enough that the kernel's socket buffers fill too (one step's answer is small).
    text = "Streaming text to a reader that has stopped reading, for a while. " * 60
    r = rig(text, rcvhwm=1, hwm=1, queue_bytes=0)
    # One message in ZMQ's queue, two batches' worth behind it (the frames decide how much).
    r.delivery.queue_bytes = 2 * max(map(len, r.frames))
    sent = 0
    while not r.stats.errors.get("worker_stalled"):  # nobody reads: the queue fills
        assert sent < len(r.frames) - 2, "the queue never filled"
        r.step(r.frames[sent])
        sent += 1
    r.read(200)  # what made it into the queue before it filled
    for frame in r.frames[sent:]:  # the reader is back
        r.step(frame)
        r.read(2)
    r.read(1000)
    acc = accumulate(r.got)
    assert set(acc) == {q.rid for q in r.reqs}
    aborted = 0
    for lives in acc.values():
        first = lives[0]
        if first.finished_reason["type"] == "abort":
            assert "worker_stalled" in first.finished_reason["message"]
            assert r.want().startswith(first.text)  # what arrived was right, up to the loss
            aborted += 1
        else:
            assert first.text == r.want() and first.finished_reason["type"] == "length"
    assert aborted > 0


def test_requests_past_a_batchs_id_budget_are_aborted_in_that_batchs_answer(rig):
    """Rows past max_frame_ids get too_large; in SGLang's answer that is an abort at the
    row's own position of the same batch, so no request is left without a word (the
    error row keeps its batch position, its meta). The requests within the budget stream
    exactly."""
    text = "Four requests, of which the budget lets two through each step."
    r = rig(text, hwm=1000, queue_bytes=1 << 20, limits=Limits(frame_ids=2))
    for frame in r.frames:  # one id per request and step: r0 and r1 are within the budget
        r.step(frame)
        r.read(50)
    assert len(r.got) == len(r.frames)  # every batch is answered
    assert [x["message"] if x else None for x in r.got[0].finished_reasons[2:]] == ["detokd: too_large"] * 2
    acc = accumulate(r.got)
    for rid in ("r0", "r1"):
        assert acc[rid][0].text == r.want() and acc[rid][0].finished_reason["type"] == "length"
    for rid in ("r2", "r3"):
        assert acc[rid][0].finished_reason["type"] == "abort" and acc[rid][0].text == ""


@pytest.mark.parametrize("encoding", ["pickle", "msgpack"])
def test_a_batch_that_does_not_read_as_the_schema_says_aborts_its_requests_never_a_success(rig, encoding):
    """A field of another type behind the same name (decode_ids no longer arrays): the
    start-up check compares SGLang's annotations; this is the guard behind it. Every
    request of that batch gets an abort naming bad_row and the cause in the batch's own
    answer, each is counted, and none of them ever finishes as a success without its
    text. In msgpack the batch fails to decode at all; its rids are still read."""
    r = rig("Hello there, a batch that cannot be read.", encoding=encoding, hwm=1000, queue_bytes=1 << 20)
    bad = r.messages[0]
    bad.decode_ids = [[str(i) for i in a] for a in bad.decode_ids]
    with ipc_encoding(encoding):
        r.step(r.encode(bad))
    for frame in r.frames[1:]:
        r.step(frame)
        r.read(2)
    r.read(500)
    assert len(r.got) == len(r.frames)  # every batch is answered
    messages = [x["message"] for x in r.got[0].finished_reasons]
    assert len(messages) == len(r.reqs) and all(m.startswith("detokd: bad_row (") for m in messages), messages
    assert r.stats.errors["bad_row"] >= len(r.reqs) and r.stats.bad_frames == 0
    for rid, lives in accumulate(r.got).items():
        assert all(life.finished_reason["type"] == "abort" for life in lives), rid


def test_a_pickle_that_would_call_a_function_is_a_bad_frame_and_every_request_goes_on(rig, tmp_path):
    """Pickle IPC: a frame on the detokenizer's socket that names a global no message
    holds (here os.mkdir, between two steps of a stream) calls nothing; it is counted
    as a bad frame, and every request streams exactly the oracle's text."""
    import os

    marker = tmp_path / "called"
    r = rig("Hello there, a stream with a hostile frame in it.", encoding="pickle", hwm=1000, queue_bytes=1 << 20)
    hostile = pickle.dumps(Calls(os.mkdir, str(marker)), protocol=pickle.HIGHEST_PROTOCOL)
    for k, frame in enumerate(r.frames):
        r.step(frame)
        if k == 1:
            r.step(hostile)
        r.read(2)
    r.read(500)
    assert not marker.exists() and r.stats.bad_frames == 1
    assert len(r.got) == len(r.frames)  # every batch answered, the hostile frame not
    acc = accumulate(r.got)
    assert set(acc) == {q.rid for q in r.reqs}
    for rid, lives in acc.items():
        assert [(life.text, life.finished_reason["type"]) for life in lives] == [(r.want(), "length")], rid


@pytest.mark.parametrize("encoding", ["msgpack", "pickle"])
def test_each_batch_goes_one_way_dialect_then_core_then_delivery_and_is_answered_exactly(rig, encoding):
    """Every frame of a stream, traced: the dialect decodes it and asks the core, which
    returns what the batch produced; the dialect returns it encoded, and delivery sends it.
    No call goes back into a part the frame's way has left (utils.crossings)."""
    r = rig("One way through: dialect, core, delivery. 一方通行 🙂 and back? No.", encoding=encoding,
            hwm=1000, queue_bytes=1 << 20)
    for frame in r.frames:
        calls, wrong = crossings(r.step, frame)
        assert wrong == []
        way = [c for c in calls if c.endswith(("SglangDialect.handle", "Delivery.deliver")) or ".core.detokenizer.Detokenizer." in c]
        assert way[0].endswith("SglangDialect.handle") and way[-1].endswith("Delivery.deliver"), way
        assert any(".core." in c for c in way[1:-1]), way  # the core decided, in between
        r.read(2)
    r.read(500)
    acc = accumulate(r.got)
    assert set(acc) == {q.rid for q in r.reqs}
    for rid, lives in acc.items():
        assert [(life.text, life.finished_reason["type"]) for life in lives] == [(r.want(), "length")], rid
