"""The SGLang dialect in-process, over real sockets: what SGLang's own detokenizer never
faces because it blocks on a full send queue, and detokd does not."""

from __future__ import annotations

import time

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


def test_a_tokenizer_manager_that_stops_reading_gets_aborts_not_silence(tmp_path):
    """The TokenizerManager stops reading; detokd's queue to it fills and a batch is lost.
    The requests of that batch are failed: once the TokenizerManager reads again, the
    next row of each that reaches it is an abort naming worker_stalled, after a prefix
    of the right text; every request whose rows all arrived streams exactly the
    oracle's text. (A request whose finishing row was in a lost batch hears nothing
    more: docs/sglang.md, "A TokenizerManager that stops reading".)"""
    name = "deepseek"
    v = vocab(name)
    # Long enough that the kernel's socket buffers fill too (one step's answer is small).
    out = v.hf.encode("Streaming text to a reader that has stopped reading, for a while. " * 60, add_special_tokens=False)
    reqs = [Scripted(rid=f"r{k}", prompt_ids=[1, 2, 3], output_ids=out) for k in range(4)]
    with ipc_encoding("msgpack"):
        from sglang.srt.managers import io_struct

        frames = [io_struct.msgpack_encode(m) for m in build_stream(reqs, encoding="msgpack", tokenizer=v.hf)]
    address = f"ipc://{tmp_path}/tokenizer.sock"
    ctx = zmq.Context()
    reader = ctx.socket(zmq.PULL)
    reader.setsockopt(zmq.RCVHWM, 1)
    reader.bind(address)
    stats, outbox = Stats(), Outbox()
    # One message in ZMQ's queue, two batches' worth behind it in the backlog.
    delivery = Delivery(ctx, outbox, [address], feedback=None, hwm=1, queue_bytes=2 * max(map(len, frames)), linger_ms=0, stats=stats)
    core = Detokenizer(fast_codec(name), v.size, outbox, max_states=64, max_prompt_tail=8, stats=stats)
    dialect = SglangDialect(core, delivery, Collector(stats), stats, ipc=schema.MsgpackCodec(), vocab_size=v.size)
    got = []

    def step(frame: bytes) -> None:  # one turn of detokd's loop
        delivery.flush()
        dialect.handle(frame)
        delivery.deliver(dialect.encode_text, dialect.encode_stopped, core.stalled)

    def read(wait_ms: int) -> None:  # what reaches the reader, the backlog moving on meanwhile
        deadline = time.monotonic() + 10
        while True:
            delivery.flush()
            if reader.poll(wait_ms):
                got.append(io_struct.msgpack_decode(reader.recv()))
            elif not delivery.backlogged:
                return
            assert time.monotonic() < deadline, "the backlog never drained"

    try:
        sent = 0
        while not stats.errors.get("worker_stalled"):  # nobody reads: the queue fills
            assert sent < len(frames) - 2, "the queue never filled"
            step(frames[sent])
            sent += 1
        with ipc_encoding("msgpack"):
            read(200)  # what made it into the queue before it filled
            for frame in frames[sent:]:  # the reader is back
                step(frame)
                read(2)
            read(1000)
    finally:
        delivery.close()
        reader.close(0)
        ctx.term()
    acc = accumulate(got)
    assert set(acc) == {r.rid for r in reqs}
    want = v.reference([1, 2, 3], out)
    aborted = 0
    for rid, lives in acc.items():
        first = lives[0]
        if first.finished_reason["type"] == "abort":
            assert "worker_stalled" in first.finished_reason["message"]
            assert want.startswith(first.text)  # what arrived was right, up to the loss
            aborted += 1
        else:
            assert first.text == want and first.finished_reason["type"] == "length"
    assert aborted > 0


def test_requests_past_a_batchs_id_budget_are_aborted_in_that_batchs_answer(tmp_path):
    """Rows past max_frame_ids get too_large; in SGLang's answer that is an abort at the
    row's own position of the same batch, so no request is left without a word (the
    error row keeps its batch position, its meta). The requests within the budget stream
    exactly."""
    name = "deepseek"
    v = vocab(name)
    out = v.hf.encode("Four requests, of which the budget lets two through each step.", add_special_tokens=False)
    reqs = [Scripted(rid=f"r{k}", prompt_ids=[1, 2, 3], output_ids=out) for k in range(4)]
    with ipc_encoding("msgpack"):
        from sglang.srt.managers import io_struct

        frames = [io_struct.msgpack_encode(m) for m in build_stream(reqs, encoding="msgpack", tokenizer=v.hf)]
    address = f"ipc://{tmp_path}/tokenizer.sock"
    ctx = zmq.Context()
    reader = ctx.socket(zmq.PULL)
    reader.bind(address)
    stats, outbox = Stats(), Outbox()
    delivery = Delivery(ctx, outbox, [address], feedback=None, hwm=1000, linger_ms=0, stats=stats)
    core = Detokenizer(fast_codec(name), v.size, outbox, max_states=64, max_prompt_tail=8, stats=stats, limits=Limits(frame_ids=2))
    dialect = SglangDialect(core, delivery, Collector(stats), stats, ipc=schema.MsgpackCodec(), vocab_size=v.size)
    got = []
    try:
        with ipc_encoding("msgpack"):
            for frame in frames:  # one id per request and step: r0 and r1 are within the budget
                dialect.handle(frame)
                delivery.deliver(dialect.encode_text, dialect.encode_stopped, core.stalled)
                assert reader.poll(5000), "every batch is answered"
                got.append(io_struct.msgpack_decode(reader.recv()))
    finally:
        delivery.close()
        reader.close(0)
        ctx.term()
    first = got[0]
    assert [r["message"] if r else None for r in first.finished_reasons[2:]] == ["detokd: too_large"] * 2
    acc = accumulate(got)
    want = v.reference([1, 2, 3], out)
    for rid in ("r0", "r1"):
        assert acc[rid][0].text == want and acc[rid][0].finished_reason["type"] == "length"
    for rid in ("r2", "r3"):
        assert acc[rid][0].finished_reason["type"] == "abort" and acc[rid][0].text == ""
