"""The SGLang dialect in-process, over real sockets: what SGLang's own detokenizer never
faces because it blocks on a full send queue, and detokd does not."""

from __future__ import annotations

import time

import pytest
import zmq

from conftest import fast_codec, vocab
from detokd.collector import Collector
from detokd.core.detokenizer import Detokenizer, Limits
from detokd.core.outbox import Outbox
from detokd.delivery import Delivery
from detokd.metrics import Stats
from detokd.sglang import schema
from detokd.sglang.replay import Scripted, accumulate, build_stream, ipc_encoding
from detokd.wire.sglang import SglangDialect

NAME = "deepseek"
PROMPT = [1, 2, 3]


class Rig:
    """Four requests streaming one text as SGLang's scheduler encodes them (msgpack), a
    TokenizerManager's PULL socket, and the dialect between them, run as detokd's loop
    runs it (`step`), with the sockets' options and the core's limits a test chooses."""

    def __init__(self, tmp_path, text: str, *, rcvhwm: int | None = None, limits: Limits = Limits(), **delivery) -> None:
        self.v = vocab(NAME)
        self.out = self.v.hf.encode(text, add_special_tokens=False)
        self.reqs = [Scripted(rid=f"r{k}", prompt_ids=PROMPT, output_ids=self.out) for k in range(4)]
        with ipc_encoding("msgpack"):
            from sglang.srt.managers import io_struct

            self.frames = [io_struct.msgpack_encode(m) for m in build_stream(self.reqs, encoding="msgpack", tokenizer=self.v.hf)]
        self.io = io_struct
        address = f"ipc://{tmp_path}/tokenizer.sock"
        self.ctx = zmq.Context()
        self.reader = self.ctx.socket(zmq.PULL)
        if rcvhwm is not None:
            self.reader.setsockopt(zmq.RCVHWM, rcvhwm)
        self.reader.bind(address)
        self.stats, outbox = Stats(), Outbox()
        self.delivery = Delivery(self.ctx, outbox, [address], feedback=None, linger_ms=0, stats=self.stats, **delivery)
        self.core = Detokenizer(
            fast_codec(NAME), self.v.size, outbox, max_states=64, max_prompt_tail=8, stats=self.stats, limits=limits
        )
        self.dialect = SglangDialect(
            self.core, self.delivery, Collector(self.stats), self.stats, ipc=schema.MsgpackCodec(), vocab_size=self.v.size
        )
        self.got: list = []

    def want(self) -> str:
        return self.v.reference(PROMPT, self.out)

    def step(self, frame: bytes) -> None:
        """One turn of detokd's loop."""
        self.delivery.flush()
        self.dialect.handle(frame)
        self.delivery.deliver(self.dialect.encode_text, self.dialect.encode_stopped, self.core.stalled)

    def read(self, wait_ms: int) -> None:
        """What reaches the reader, the backlog moving on meanwhile, until nothing does."""
        deadline = time.monotonic() + 10
        with ipc_encoding("msgpack"):
            while True:
                self.delivery.flush()
                if self.reader.poll(wait_ms):
                    self.got.append(self.io.msgpack_decode(self.reader.recv()))
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
    for rid, lives in acc.items():
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
