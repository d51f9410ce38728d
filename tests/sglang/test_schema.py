"""detokd's mirror of SGLang's detokenizer IPC, proved against SGLang's own encoder,
decoder and DetokenizerManager (0.5.23)."""

from __future__ import annotations

import dataclasses
import pickle
import warnings
from array import array

import msgspec
import numpy as np
import pytest
import torch
import zmq
from hypothesis import example, given, settings
from hypothesis import strategies as st

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from sglang.srt.managers import io_struct
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager, LimitedCapacityDict
    from sglang.srt.sampling.sampling_mask import SamplingMaskChunk
    from sglang.srt.utils.weight_versions import WeightVersionSpan

from detokd.sglang import id_rows, schema
from conftest import vocab


def sglang_detokenizer(tokenizer) -> DetokenizerManager:
    """SGLang's real DetokenizerManager, without the sockets and server args of __init__."""
    m = object.__new__(DetokenizerManager)
    m.tokenizer = tokenizer
    m.vocab_size = len(tokenizer)
    m.decode_status = LimitedCapacityDict(capacity=1 << 10)
    m.disable_tokenizer_batch_decode = False
    m.is_tool_call_parser_gpt_oss = False
    m.tool_close_token_ids = frozenset()
    return m


def token_batch(tok, texts: list[str], finished: list, step: int) -> io_struct.BatchTokenIDOutput:
    """A BatchTokenIDOutput with every kind of field the scheduler fills filled."""
    n = len(texts)
    ids = [array("q", tok.encode(t, add_special_tokens=False)) for t in texts]
    return io_struct.BatchTokenIDOutput(
        rids=[f"r{i}" for i in range(n)],
        http_worker_ipcs=[None] * n,
        finished_reasons=finished,
        decoded_texts=[""] * n,
        decode_ids=ids,
        read_offsets=[0] * n,
        output_ids=[array("q", x) for x in ids],
        skip_special_tokens=[i % 2 == 0 for i in range(n)],
        spaces_between_special_tokens=[True] * n,
        no_stop_trim=[i == 1 for i in range(n)],
        prompt_tokens=[7 + i for i in range(n)],
        reasoning_tokens=[0] * n,
        completion_tokens=[len(x) for x in ids],
        cached_tokens=[i for i in range(n)],
        input_token_logprobs_val=[[-0.5, None]] * n,
        input_token_logprobs_idx=[[3, 4]] * n,
        output_token_logprobs_val=[[-0.25 * step]] * n,
        output_token_logprobs_idx=[[5]] * n,
        input_top_logprobs_val=[[[-0.1, -2.0]]] * n,
        input_top_logprobs_idx=[[[1, 2]]] * n,
        output_top_logprobs_val=[None] * n,
        output_top_logprobs_idx=[None] * n,
        input_token_ids_logprobs_val=None,
        input_token_ids_logprobs_idx=None,
        output_token_ids_logprobs_val=[[[-1.5]]] * n,
        output_token_ids_logprobs_idx=[[[9]]] * n,
        output_token_entropy_val=[0.125] * n,
        output_token_sampling_mask=[
            SamplingMaskChunk(
                lengths=np.array([2], dtype=np.int32),
                token_ids=np.array([3, 4], dtype=np.int32),
                logprobs=np.array([-0.5, -1.0], dtype=np.float32),
            )
        ] + [None] * (n - 1),
        output_hidden_states=[[[0.5, 1.5]]] + [None] * (n - 1),
        routed_experts=[torch.arange(12, dtype=torch.int32).reshape(2, 3, 2)] + [None] * (n - 1),
        indexer_topk=[None] * (n - 1) + [torch.tensor([[7, -1]], dtype=torch.int64)],
        placeholder_tokens_idx=[[0]] * n,
        placeholder_tokens_val=[[4]] * n,
        retraction_counts=[0] * n,
        weight_versions=[[WeightVersionSpan(version="v1", start=0, end=3)]] * n,
        token_steps=[[step]] * n,
        customized_info=io_struct.PickleWrapper(pickle.dumps({"k": [1, 2]})),
        cached_tokens_details=[{"device": 1, "source": "host"}] * n,
        dp_ranks=[0] * n,
        time_stats=io_struct.PickleWrapper(pickle.dumps([{"t": 1.25}] * n)),
        image_tokens=[0] * n,
        spec_correct_drafts_histogram=[[1, 0]] * n,
        input_top_logprobs_val_flat=[np.ones((1, 2), dtype=np.float32)] + [None] * (n - 1),
        input_top_logprobs_idx_flat=[np.zeros((1, 2), dtype=np.int32)] + [None] * (n - 1),
        input_top_logprobs_flat_null_prefix=[1] + [None] * (n - 1),
    )


BATCHES = [
    (["Hello, wor", "Ünïcödé ✓ 日本", "def f(x):\n  return"], [None, None, None]),
    (
        ["Stop here. STOP and more", "ends with token", "to the length"],
        [{"type": "stop", "matched": "STOP"}, {"type": "stop", "matched": 13}, {"type": "length", "length": 3}],
    ),
    (["aborted"], [{"type": "abort", "message": "gone", "status_code": 400, "err_type": None}]),
    ([], []),
]


@pytest.fixture(scope="module")
def tok():
    return vocab("qwen2").hf


def sglang_wire(obj) -> bytes:
    """The bytes SGLang's msgpack sock_send puts on the socket."""
    return io_struct.msgpack_encode(obj)


@pytest.mark.parametrize("texts,finished", BATCHES)
def test_a_forwarded_msgpack_batch_decodes_in_sglang_to_what_its_own_detokenizer_produces(tok, texts, finished):
    frame = sglang_wire(token_batch(tok, texts, finished, step=1))
    expected = sglang_detokenizer(tok).handle_batch_token_id_out(io_struct.msgpack_decode(frame))

    codec = schema.MsgpackCodec()
    mine = codec.decode(frame)
    assert isinstance(mine, schema.BatchTokenIDOutput)
    got = io_struct.msgpack_decode(codec.encode_str_output(mine, expected.output_strs))

    assert type(got) is io_struct.BatchStrOutput
    assert got.output_strs == expected.output_strs
    assert got.routed_experts == expected.routed_experts and got.indexer_topk == expected.indexer_topk
    assert got.finished_reasons == expected.finished_reasons
    # Every field, numpy arrays and nested structs included: SGLang's own encoding agrees.
    assert sglang_wire(got) == sglang_wire(expected)


def test_the_typed_fields_read_what_sglang_sent(tok):
    sent = token_batch(tok, ["one two", "three"], [None, {"type": "stop", "matched": 5}], step=2)
    frame = sglang_wire(sent)
    mine = schema.MsgpackCodec().decode(frame)
    assert mine.rids == sent.rids and mine.http_worker_ipcs == sent.http_worker_ipcs
    assert schema.MsgpackCodec.ids(mine) == [list(a) for a in sent.decode_ids]
    typed = msgspec.msgpack.Decoder(schema.Inbound).decode(frame)  # the generic parse agrees
    assert [id_rows.array_of(e) for e in typed.decode_ids] == sent.decode_ids
    assert mine.finished_reasons == sent.finished_reasons
    for name in ("decoded_texts", "read_offsets", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
        assert getattr(mine, name) == getattr(sent, name), name
    assert not schema.has_beam_search(mine)


def decoded_ids(tok, rows: list[array]) -> tuple[list[list[int]], bool]:
    """What MsgpackCodec reads of a batch whose decode_ids are `rows`, and whether the
    raw reader (int64_rows) read them, not the generic parse."""
    sent = token_batch(tok, ["x"] * 2, [None] * 2, step=1)
    sent.decode_ids = rows
    mine = schema.MsgpackCodec().decode(sglang_wire(sent))
    ids = schema.MsgpackCodec.ids(mine)
    assert_bounds(ids)
    return ids, type(mine.decode_ids) is id_rows.IdRows


def assert_bounds(ids: list[list[int]]) -> None:
    """Rows read as IdRows carry the least and greatest of their ids (lo > hi: none)."""
    if type(ids) is id_rows.IdRows:
        every = [i for row in ids for i in row]
        assert (ids.lo, ids.hi) == ((min(every), max(every)) if every else (0, -1))


@pytest.mark.parametrize("rows,k", [(1, 1), (15, 1), (16, 4), (1024, 1), (70000, 1), (3, 31), (3, 32), (2, 4000)])
def test_a_decode_step_reads_its_ids_in_one_view(tok, rows, k):
    """Every row as many ids (fixarray, array 16 and 32; ext 8 and 16)."""
    ids = [array("q", range(i * k, i * k + k)) for i in range(rows)]
    assert decoded_ids(tok, ids) == ([list(a) for a in ids], True)


def test_a_step_with_starts_among_its_rows_is_read_in_runs(tok):
    """A start's row holds its prompt context too: it breaks the run for itself alone."""
    ids = [array("q", [i]) for i in range(1024)]
    for at in (0, 5, 6, 511, 1023):
        ids[at] = array("q", range(at, at + 6))
    assert decoded_ids(tok, ids) == ([list(a) for a in ids], True)


# Runs of rows: (ids per row, rows, typecode); a decode step is one long run of one id,
# a start breaks it for a row, speculative decoding's rows differ row by row.
ROW_RUNS = st.lists(st.tuples(st.sampled_from([0, 1, 2, 3, 8, 31, 32, 600]),
                              st.one_of(st.integers(1, 40), st.sampled_from([255, 256, 257, 1100])),
                              st.sampled_from(["q", "q", "q", "l", "i"])), max_size=30)


def arrays_of(runs: list[tuple[int, int, str]], value: int) -> list[array]:
    """The rows of `runs`, their ids spread around `value` (within int64)."""
    ids = []
    for r, (length, repeat, typecode) in enumerate(runs):
        item = min(2**63 - 1, max(-(2**63) + 600, value + r * 7919 - 40000)) if typecode != "i" else value % 2**31
        ids += [array(typecode, [item - j for j in range(length)]) for _ in range(repeat)]
    return ids


@settings(deadline=None, max_examples=150)
@given(runs=ROW_RUNS, value=st.integers(-(2**63), 2**63 - 1))
@example(runs=[(1, id_rows.FIRST_VIEW, "q"), (0, 1, "q")], value=7)  # a full first view, then a shorter row
def test_any_decode_ids_read_as_sglang_sent_them(tok, runs, value):
    """Any runs of rows, empty rows, any int64, arrays of other typecodes: the raw reader
    or, past what it takes, the generic parse gives every row's ids."""
    ids = arrays_of(runs, value)
    assert decoded_ids(tok, ids)[0] == [list(a) for a in ids]


def test_rows_of_many_lengths_take_the_generic_parse(tok):
    ids = [array("q", range(1 + (i // 2) % 2)) for i in range(4 * id_rows.MAX_RUNS + 4)]  # runs of two
    assert decoded_ids(tok, ids) == ([list(a) for a in ids], False)


def test_decode_ids_that_are_no_arrays_fail_as_the_whole_schema_says(tok):
    """decode_ids are read apart from the rest; a frame where they do not read fails with
    the error of the whole schema (the abort's cause names the same place)."""
    sent = token_batch(tok, ["one", "two"], [None, None], step=1)
    typed = msgspec.msgpack.Decoder(schema.Inbound)
    for bad in ([[1], [2]], [array("q", [1]), 7]):
        sent.decode_ids = bad
        frame = sglang_wire(sent)
        with pytest.raises(msgspec.ValidationError) as whole:
            typed.decode(frame)
        with pytest.raises(msgspec.ValidationError) as mine:
            schema.MsgpackCodec().decode(frame)
        assert str(mine.value) == str(whole.value)


def test_a_msgpack_frame_travels_a_real_zmq_socket_unchanged(tok):
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        sent = token_batch(tok, ["over the wire"], [None], step=1)
        push.send(sglang_wire(sent))
        assert pull.poll(5000)
        mine = schema.MsgpackCodec().decode(pull.recv(copy=False).buffer)
        assert schema.MsgpackCodec.ids(mine) == [list(a) for a in sent.decode_ids]
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()


def test_the_other_inbound_messages_decode_by_their_tag():
    codec = schema.MsgpackCodec()
    gc = codec.decode(sglang_wire(io_struct.FreezeGCReq(gc_threshold=[700, 10, 10])))
    assert isinstance(gc, schema.FreezeGCReq) and gc.gc_threshold == [700, 10, 10]
    log = codec.decode(sglang_wire(io_struct.ConfigureLoggingReq(log_level="debug", log_requests=True)))
    assert isinstance(log, schema.ConfigureLoggingReq) and log.log_level == "debug"
    emb = io_struct.BatchEmbeddingOutput(
        rids=["e"], finished_reasons=[None], embeddings=[[0.5, 0.25]], prompt_tokens=[2],
        cached_tokens=[0], placeholder_tokens_idx=None, placeholder_tokens_val=None,
        pooled_hidden_states=[torch.ones(2)],
    )
    frame = sglang_wire(emb)
    assert isinstance(codec.decode(frame), schema.BatchEmbeddingOutput)
    assert schema.kind(codec.decode(frame)) == "BatchEmbeddingOutput"


@pytest.mark.parametrize("texts,finished", BATCHES)
def test_a_pickled_batch_rebuilt_by_detokd_unpickles_to_what_sglang_produces(tok, texts, finished):
    sent = token_batch(tok, texts, finished, step=3)
    # The pickle form carries the objects themselves, not PickleWrappers.
    sent.time_stats = [{"t": 2.5}] * len(texts)
    sent.customized_info = {"k": "v"}
    frame = pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL)  # send_pyobj's bytes
    expected = sglang_detokenizer(tok).handle_batch_token_id_out(pickle.loads(frame))

    codec = schema.PickleCodec()
    got = pickle.loads(codec.encode_str_output(codec.decode(frame), expected.output_strs))
    assert type(got) is io_struct.BatchStrOutput
    assert got.time_stats == expected.time_stats and got.routed_experts == expected.routed_experts
    # Compare every field through a common encoding (PickleWrap the opaque ones).
    for o in (got, expected):
        o.time_stats = io_struct.PickleWrapper(pickle.dumps(o.time_stats))
        o.customized_info = io_struct.PickleWrapper(pickle.dumps(o.customized_info))
    assert sglang_wire(got) == sglang_wire(expected)


def test_codec_follows_sglangs_pickle_switch(monkeypatch):
    monkeypatch.setenv("SGLANG_USE_PICKLE_IPC", "0")
    assert schema.codec().name == "msgpack"
    monkeypatch.setenv("SGLANG_USE_PICKLE_IPC", "1")
    assert schema.codec().name == "pickle"


# ---------------------------------------------------------------- the schema check


def test_check_passes_on_the_installed_sglang():
    assert schema.SCHEMA == "sglang-0.5.23"
    schema.check()


def fields_of(cls) -> list[tuple[str, object]]:
    return [(f, object) for f in cls.__struct_fields__]


def test_check_names_a_field_sglang_added():
    f = fields_of(io_struct.BatchTokenIDOutput)
    f.insert(5, ("draft_ids", object))
    copy = dataclasses.make_dataclass("BatchTokenIDOutput", f)
    with pytest.raises(schema.SchemaMismatch, match=r"BatchTokenIDOutput: field 'draft_ids'.*new"):
        schema.check({"BatchTokenIDOutput": copy})


def test_check_names_a_field_sglang_removed():
    f = [x for x in fields_of(io_struct.BatchStrOutput) if x[0] != "time_stats"]
    with pytest.raises(schema.SchemaMismatch, match=r"BatchStrOutput: field 'time_stats'.*gone"):
        schema.check({"BatchStrOutput": dataclasses.make_dataclass("BatchStrOutput", f)})


def test_check_names_a_field_sglang_renamed():
    f = [("decode_token_ids" if n == "decode_ids" else n, t) for n, t in fields_of(io_struct.BatchTokenIDOutput)]
    with pytest.raises(schema.SchemaMismatch, match=r"BatchTokenIDOutput: field 'decode_token_ids'"):
        schema.check({"BatchTokenIDOutput": dataclasses.make_dataclass("BatchTokenIDOutput", f)})


def test_check_names_a_field_sglang_appended_to_a_request():
    f = fields_of(io_struct.FreezeGCReq) + [("generation", object)]
    with pytest.raises(schema.SchemaMismatch, match=r"FreezeGCReq: field 'generation'.*new"):
        schema.check({"FreezeGCReq": dataclasses.make_dataclass("FreezeGCReq", f)})


def test_check_names_a_field_the_detokenizer_now_fills_differently():
    fills = schema.installed_fills()
    fills["output_ids"] = "computed"
    with pytest.raises(schema.SchemaMismatch, match=r"BatchStrOutput: field 'output_ids'"):
        schema.check(fills=fills)


def test_every_field_a_mirror_types_has_sglangs_annotation_recorded():
    for ours in schema.MIRRORED:
        assert set(schema.ANNOTATIONS[ours.__name__]) == set(schema.typed_fields(ours)), ours.__name__


def test_check_names_a_field_whose_type_changed_while_its_name_stayed():
    """decode_ids no longer a list of arrays: every batch would fail in the dialect."""
    declared = schema.annotations(io_struct.BatchTokenIDOutput)
    declared["decode_ids"] = "List[List[int]]"
    copy = dataclasses.make_dataclass("BatchTokenIDOutput", [(n, declared[n]) for n in io_struct.BatchTokenIDOutput.__struct_fields__])
    with pytest.raises(schema.SchemaMismatch, match=r"BatchTokenIDOutput.decode_ids: SGLang declares 'List\[List\[int\]\]'"):
        schema.check({"BatchTokenIDOutput": copy})


def test_check_names_a_wire_config_change():
    changed = msgspec.defstruct(
        "ConfigureLoggingReq",
        [(n, object) for n in io_struct.ConfigureLoggingReq.__struct_fields__],
        tag=True, kw_only=True, array_like=False,
    )
    with pytest.raises(schema.SchemaMismatch, match=r"ConfigureLoggingReq: wire config array_like"):
        schema.check({"ConfigureLoggingReq": changed})


# ---------------------------------------------------------------- the fast readers


@pytest.mark.parametrize("rows", [
    [array("q", [5])] * 3,  # a decode step
    [array("q", [1, 2, 3, 4]), array("q", [5, 6, 7, 8])],  # a speculative step
    [array("q", [1]), array("q", [2, 3]), array("q", [])],  # starts and finishes among them
    [array("q", []), array("q", [])],
    [array("i", [1, 2]), array("i", [3, 4])],  # another item type: the generic parse
    [array("q", [-1, 2**40])],
    [],
])
def test_decode_ids_read_as_sglang_sent_them(tok, rows):
    sent = token_batch(tok, ["x"] * len(rows), [None] * len(rows), step=1)
    sent.decode_ids = rows
    mine = schema.MsgpackCodec().decode(sglang_wire(sent))
    assert schema.MsgpackCodec.ids(mine) == [list(a) for a in rows]


def scheduler_time_stats(timed: bool):
    """A SchedulerReqTimeStats as the scheduler holds it: untouched (what it sends unless
    metrics are on: an empty state), or with timing data (times to rebase)."""
    from sglang.srt.observability.req_time_stats import SchedulerReqTimeStats

    ts = SchedulerReqTimeStats()
    if timed:
        ts.has_timing_data = True
        ts.wait_queue_entry_time, ts.forward_entry_time, ts.prefill_finished_time = 10.5, 11.25, 12.0
        ts.queue_duration_s = 0.75
    return ts


@pytest.mark.parametrize("timed", [[False, False], [True, False], [True, True]])
def test_pickled_time_stats_reach_the_tokenizer_manager_as_sglangs_detokenizer_sends_them(tok, timed):
    """detokd unpickles each row's SchedulerReqTimeStats without SGLang's __setstate__ and
    pickles it without its __getstate__ where that round trip keeps the state; the
    TokenizerManager's objects are those SGLang's own detokenizer would have sent."""
    sent = token_batch(tok, ["a", "b"], [None, None], step=1)
    sent.time_stats = [scheduler_time_stats(t) for t in timed]
    sent.customized_info = None
    frame = pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL)
    expected = pickle.loads(pickle.dumps(sglang_detokenizer(tok).handle_batch_token_id_out(pickle.loads(frame)),
                                         protocol=pickle.HIGHEST_PROTOCOL))
    codec = schema.PickleCodec()
    got = pickle.loads(codec.encode_str_output(codec.decode(frame), expected.output_strs))
    assert [type(o) for o in got.time_stats] == [type(o) for o in expected.time_stats]
    assert [vars(o) for o in got.time_stats] == [vars(o) for o in expected.time_stats]
    # output_ids: arrays of the same type and items (detokd pickles them compactly)
    assert [(type(a), a.typecode, a) for a in got.output_ids] == [(type(a), a.typecode, a) for a in expected.output_ids]


@pytest.mark.parametrize("output_ids", [
    [array("q", [1, 2]), array("q", []), array("q", [-3])],
    [array("i", [1]), array("q", [2])],  # not all int64: pickled as they are
    None,
])
def test_compact_lists_unpickle_to_what_they_hold(output_ids):
    from detokd.sglang import pickled

    sent = [scheduler_time_stats(False), scheduler_time_stats(False)]
    stats = pickled.loads(pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL))
    ids = pickled.loads(pickle.dumps(output_ids, protocol=pickle.HIGHEST_PROTOCOL))  # as received: Array
    for name, value, want in (("time_stats", stats, sent), ("output_ids", ids, output_ids)):
        got = pickle.loads(pickled.dumps(pickled.compact(name, value)))
        assert type(got) is type(want) and (got is None or [type(x) for x in got] == [type(x) for x in want])
        if name == "time_stats":
            assert [vars(x) for x in got] == [{} for _ in want]
        else:
            assert got == want and (got is None or [x.typecode for x in got] == [x.typecode for x in want])


@settings(deadline=None, max_examples=150)
@given(runs=ROW_RUNS, value=st.integers(-(2**63), 2**63 - 1))
@example(runs=[(1, 500, "q"), (6, 1, "q"), (1, 200, "q"), (0, 1, "q"), (6, 2, "q"), (1, 9, "q")], value=3)
def test_pickled_decode_ids_read_as_sglang_sent_them(runs, value):
    """In runs of rows of one length (a few starts among a step's rows), or row by row."""
    from detokd.sglang import pickled

    rows = arrays_of(runs, value)
    ids = pickled.id_rows(pickled.loads(pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL)))
    assert ids == [a.tolist() for a in rows]
    assert_bounds(ids)
    assert (type(ids) is id_rows.IdRows) == (bool(rows) and all(a.typecode == "q" for a in rows))


@pytest.mark.parametrize("rows", [
    [array("q", [1]), array("q", [-2]), array("q", [3])],
    [array("q", [1, 2]), array("q", [3, 4])],
    [array("q", [1, 2]), array("q", []), array("q", [-3])],
    [array("q"), array("q")],
    [array("i", [1]), array("q", [2])],
    [],
])
def test_received_arrays_read_and_pickle_back_as_the_arrays_they_stand_for(rows):
    """Arrays unpickle as pickled.Array (no array built); decode_ids read from them are the
    arrays' items, and each pickles back to the bytes the array itself pickles to."""
    from detokd.sglang import pickled

    got = pickled.loads(pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL))
    assert all(type(a) is pickled.Array for a in got)
    assert pickled.id_rows(got) == [a.tolist() for a in rows]
    for a, b in zip(rows, got):
        assert pickled.dumps(b) == pickled.dumps(a) and b.array() == a and type(b.array()) is array
