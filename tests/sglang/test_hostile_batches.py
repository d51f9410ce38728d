"""One batch from a scheduler costs its own requests and nothing else: detokd's SGLang
process, started as SGLang starts its detokenizer and fed by a scheduler's socket,
answers a batch it cannot read, or cannot answer, with an abort of each of its requests
naming the cause, and goes on: the batches around it are answered exactly, and the
process never exits (which would SIGQUIT SGLang's whole server). Every hostile value is
one SGLang's own classes carry and detokd's pickle allow-list admits."""

from __future__ import annotations

import os
import pickle
import sys
from array import array

import msgspec
import pytest
import torch
from conftest import vocab
from replay import accumulate
from runs import ids_of

from detokd import zoo
from detokd.sglang.process import run_sglang_detokenizer
from detokrig.sglang_replay import Scripted, SglangDetokenizerUnderTest, build_stream, ipc_encoding

NAME = "deepseek"
PROMPT_TEXT = "Say something:"
TEXT = "Hello, world! 世界你好 🤖 Привет. Done."


class RefusedState:
    """SGLang's SchedulerReqTimeStats pickled with a state its own __setstate__ refuses (a
    time with no clock difference to rebase it by): the sender's __getstate__, patched."""

    def __call__(self, n: int) -> list:
        from sglang.srt.observability.req_time_stats import SchedulerReqTimeStats

        return [object.__new__(SchedulerReqTimeStats) for _ in range(n)]

    @staticmethod
    def patch(monkeypatch) -> None:
        from sglang.srt.observability.req_time_stats import SchedulerReqTimeStats

        monkeypatch.setattr(SchedulerReqTimeStats, "__getstate__", lambda self: {"start_time": 1.0})


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


# (encoding, case): the field of one batch that is set to a hostile value, and the
# exception detokd names in the abort. The first three fail only when the answer is
# encoded (pickle: the value, its pickling, SGLang's own __setstate__); the stride-0
# tensor would expand to 1.2 GB; msgpack's ext 1 is no tensor; its 2,000-deep field
# sinks the typed decode and its fallback alike. A batch with fewer id rows than rids
# leaves no row unanswered (a row without ids would be a finish with no text).
CASES = {
    "pickle": {
        "str-as-tensor": ("routed_experts", lambda n: ["x"] * n, "AttributeError"),
        "nested-5000": ("output_hidden_states", lambda n: [nested(5000)] * n, "RecursionError"),
        "time-stats": ("time_stats", RefusedState(), "KeyError"),
        "expanded-tensor": ("routed_experts", lambda n: [torch.ones(1).expand(300_000_000)] * n, "max_frame_bytes"),
        "ids-short": ("decode_ids", lambda n: [torch.tensor([100, 101])] * (n - 1), "ValueError"),
    },
    "msgpack": {
        "array-as-tensor": ("routed_experts", lambda n: [array("q", [1])] * n, "ValidationError"),
        "nested-2000": ("output_hidden_states", lambda n: msgspec.Raw(b"\x91" * 2000 + b"\xc0"), "RecursionError"),
        "ids-short": ("decode_ids", lambda n: [array("q", [100, 101])] * (n - 1), "ValueError"),
    },
}


def scripted(rid: str) -> Scripted:
    return Scripted(rid=rid, prompt_ids=ids_of(NAME, PROMPT_TEXT), output_ids=ids_of(NAME, TEXT))


def want(s: Scripted) -> str:
    v = vocab(NAME)
    ctx = s.prompt_ids[-5:]  # SGLang's read_offset context (the scheduler's five prompt ids)
    return v.hf.decode(ctx + s.output_ids)[len(v.hf.decode(ctx)) :]


def frame(proc: SglangDetokenizerUnderTest, message) -> bytes:
    """A message as SGLang's scheduler puts it on the socket (deep values need a deeper stack)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20000)
    try:
        with ipc_encoding(proc.encoding):
            if proc.encoding == "pickle":
                return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            from sglang.srt.managers import io_struct

            return io_struct.msgpack_encode(message)
    finally:
        sys.setrecursionlimit(limit)


def rss(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) * 1024


@pytest.fixture(scope="module", params=list(CASES))
def proc(request):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with SglangDetokenizerUnderTest(zoo.build(NAME), encoding=request.param, target=run_sglang_detokenizer) as p:
        p.exchange([], timeout=900)  # imported and serving
        yield p


def test_a_batch_that_cannot_be_read_or_answered_aborts_its_own_requests_and_nothing_else(proc, monkeypatch):
    for case, (field, value, cause) in CASES[proc.encoding].items():
        good = scripted(f"good-{case}")
        steps = build_stream([good], encoding=proc.encoding, tokenizer=vocab(NAME).hf)
        hostile = _hostile_batch(proc, case, field, value)
        half = len(steps) // 2
        proc.send(steps[:half])
        with monkeypatch.context() as m:
            if isinstance(value, RefusedState):
                value.patch(m)
            proc._push.send(frame(proc, hostile))
        before = rss(proc.processes[0].pid, "VmRSS")
        got = accumulate(proc.exchange(steps[half:])[0])
        peak = rss(proc.processes[0].pid, "VmHWM")
        assert [(life.text, life.finished_reason["type"]) for life in got[good.rid]] == [(want(good), "length")], case
        for rid in hostile.rids:
            (life,) = got[rid]
            assert life.text == "" and life.finished_reason["type"] == "abort", (case, life)
            assert "detokd: bad_row" in life.finished_reason["message"] and cause in life.finished_reason["message"], case
        # Nothing the size of the expanded tensor (1.2 GB) was ever built.
        assert peak - before < 400 << 20, (case, before, peak)


def _hostile_batch(proc, case: str, field: str, value):
    """A batch of two starting requests, as the scheduler builds it, with `field` set to
    the hostile value (msgpack: a Raw value is written as its bytes)."""
    two = [Scripted(rid=f"bad-{case}-{k}", prompt_ids=[1, 2, 3], output_ids=[100, 101], chunks=[2]) for k in range(2)]
    (batch,) = build_stream(two, encoding=proc.encoding, tokenizer=vocab(NAME).hf)
    setattr(batch, field, value(len(batch.rids)))
    return batch


def test_a_batch_of_more_rows_than_max_rows_is_dropped_whole_and_the_process_goes_on(proc):
    """A batch beyond max_rows (65,536 by default) is refused before anything is
    sized by it: 3 M rids must not leave a position per rid behind."""
    many = [f"m{i}" for i in range(70_000)]
    hostile = _hostile_batch(proc, "many", "rids", lambda n: many[:n])
    for name in ("http_worker_ipcs", "finished_reasons", "decoded_texts", "decode_ids", "read_offsets", "output_ids",
                 "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "prompt_tokens",
                 "reasoning_tokens", "completion_tokens", "cached_tokens"):
        column = getattr(hostile, name)
        if isinstance(column, list) and column:
            setattr(hostile, name, [column[0]] * len(many))
    hostile.rids = many
    good = scripted("after-many")
    proc._push.send(frame(proc, hostile))
    got = accumulate(proc.exchange(build_stream([good], encoding=proc.encoding, tokenizer=vocab(NAME).hf))[0])
    assert not set(got) & set(many)
    assert [(life.text, life.finished_reason["type"]) for life in got[good.rid]] == [(want(good), "length")]
