"""detokd's mirror of SGLang's detokenizer IPC, built from the installed release's classes
and proved against that release's own encoder, decoder and DetokenizerManager."""

from __future__ import annotations

import dataclasses
import pickle
import warnings
from array import array

import msgspec
import pytest
import torch
import zmq

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from sglang.srt.managers import io_struct

from messages import encode_str_output, sglang_detokenizer, sglang_wire, token_batch
from messages import tok as tok  # a fixture, re-exported: no F811 where a test takes it

from detokd.sglang import id_rows, schema

BATCHES = [
    (["Hello, wor", "Ünïcödé ✓ 日本", "def f(x):\n  return"], [None, None, None]),
    (
        ["Stop here. STOP and more", "ends with token", "to the length"],
        [{"type": "stop", "matched": "STOP"}, {"type": "stop", "matched": 13}, {"type": "length", "length": 3}],
    ),
    (["aborted"], [{"type": "abort", "message": "gone", "status_code": 400, "err_type": None}]),
    ([], []),
]


@pytest.mark.parametrize("texts,finished", BATCHES)
def test_a_forwarded_msgpack_batch_decodes_in_sglang_to_what_its_own_detokenizer_produces(tok, texts, finished):
    frame = sglang_wire(token_batch(tok, texts, finished, step=1))
    expected = sglang_detokenizer(tok).handle_batch_token_id_out(io_struct.msgpack_decode(frame))

    codec = schema.MsgpackCodec()
    mine = codec.decode(frame)
    assert isinstance(mine, schema.BatchTokenIDOutput)
    got = io_struct.msgpack_decode(encode_str_output(codec, mine, expected.output_strs))

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
    typed = msgspec.msgpack.Decoder(schema.BatchTokenIDOutput).decode(frame)  # the generic parse agrees
    assert [id_rows.array_of(e) for e in typed.decode_ids] == sent.decode_ids
    assert mine.finished_reasons == sent.finished_reasons
    for name in ("decoded_texts", "read_offsets", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
        assert getattr(mine, name) == getattr(sent, name), name
    assert not schema.has_beam_search(mine)


def test_decode_ids_that_are_no_arrays_fail_as_the_whole_schema_says(tok):
    """decode_ids are read apart from the rest; a frame where they do not read fails with
    the error of the whole schema (the abort's cause names the same place)."""
    sent = token_batch(tok, ["one", "two"], [None, None], step=1)
    typed = msgspec.msgpack.Decoder(schema.BatchTokenIDOutput)
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
    has_threshold = "gc_threshold" in io_struct.FreezeGCReq.__struct_fields__  # 0.5.23's
    sent = io_struct.FreezeGCReq(gc_threshold=[700, 10, 10]) if has_threshold else io_struct.FreezeGCReq()
    gc = codec.decode(sglang_wire(sent))
    assert isinstance(gc, schema.FreezeGCReq) and getattr(gc, "gc_threshold", None) == getattr(sent, "gc_threshold", None)
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
    got = pickle.loads(encode_str_output(codec, codec.decode(frame), expected.output_strs))
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


# ---------------------------------------------------------------- the schema build


def test_the_mirrors_have_the_installed_classes_fields_in_their_order():
    import sglang

    built = schema.build()
    assert built.version == sglang.__version__ and built.name == f"sglang-{sglang.__version__}"
    for name in schema.MIRRORED:
        assert built.structs[name].__struct_fields__ == getattr(io_struct, name).__struct_fields__, name
    # What the installed detokenizer copies is Raw, whatever the release added.
    fields = msgspec.structs.fields(built.structs["BatchStrOutput"])
    raw = {f.name for f in fields if f.type is msgspec.Raw}
    assert raw == set(built.copied) - set(schema.READS["BatchStrOutput"])
    assert "time_stats" in raw


def fields_of(cls) -> list[tuple[str, object]]:
    """A class's fields with their declared annotations, for a modified copy of it."""
    declared = schema.declared_annotations(cls)
    return [(f, declared[f]) for f in cls.__struct_fields__]


def with_field(cls, name: str, at: int):
    f = fields_of(cls)
    f.insert(at, (name, object))
    return dataclasses.make_dataclass(cls.__name__, f)


def test_a_field_sglang_adds_and_its_detokenizer_copies_passes_through_raw_in_its_place():
    fills = schema.installed_fills() | {"draft_ids": "copy"}
    built = schema.build({"BatchTokenIDOutput": with_field(io_struct.BatchTokenIDOutput, "draft_ids", 5),
                          "BatchStrOutput": with_field(io_struct.BatchStrOutput, "draft_ids", 4)}, fills)
    for name, at in (("BatchTokenIDOutput", 5), ("BatchStrOutput", 4)):
        field = msgspec.structs.fields(built.structs[name])[at]
        assert (field.name, field.type) == ("draft_ids", msgspec.Raw), name
    assert "draft_ids" in built.copied


def test_a_field_sglang_adds_to_a_message_the_detokenizer_forwards_needs_nothing():
    built = schema.build({"BatchEmbeddingOutput": with_field(io_struct.BatchEmbeddingOutput, "pooled_ids", 3)})
    assert "pooled_ids" in built.structs["BatchEmbeddingOutput"].__struct_fields__


def test_a_batch_str_output_field_the_detokenizer_leaves_to_its_default_is_a_mismatch():
    with pytest.raises(schema.SchemaMismatch, match=r"BatchStrOutput: field 'draft_texts' is new.*default"):
        schema.build({"BatchStrOutput": with_field(io_struct.BatchStrOutput, "draft_texts", 3)})


def test_the_build_names_a_field_the_detokenizer_removed_while_it_still_fills_it():
    f = [x for x in fields_of(io_struct.BatchStrOutput) if x[0] != "time_stats"]
    with pytest.raises(schema.SchemaMismatch, match=r"BatchStrOutput: .*'time_stats', which the class lacks"):
        schema.build({"BatchStrOutput": dataclasses.make_dataclass("BatchStrOutput", f)})


def test_the_build_names_a_field_detokd_reads_that_sglang_renamed():
    f = [("decode_token_ids" if n == "decode_ids" else n, t) for n, t in fields_of(io_struct.BatchTokenIDOutput)]
    with pytest.raises(schema.SchemaMismatch, match=r"BatchTokenIDOutput: field 'decode_ids', which detokd reads, is gone"):
        schema.build({"BatchTokenIDOutput": dataclasses.make_dataclass("BatchTokenIDOutput", f)})


def test_the_build_names_a_field_the_detokenizer_now_computes():
    fills = schema.installed_fills()
    fills["output_ids"] = "computed"
    with pytest.raises(schema.SchemaMismatch, match=r"BatchStrOutput: field 'output_ids' is new to detokd.*computes"):
        schema.build(fills=fills)


def test_gc_threshold_is_read_where_the_release_has_it():
    f = [x for x in fields_of(io_struct.FreezeGCReq) if x[0] != "gc_threshold"]
    built = schema.build({"FreezeGCReq": dataclasses.make_dataclass("FreezeGCReq", f)})
    assert built.gc_threshold is False
    assert schema.build().gc_threshold is ("gc_threshold" in io_struct.FreezeGCReq.__struct_fields__)


def test_the_build_names_a_field_whose_type_changed_while_its_name_stayed():
    """decode_ids no longer a list of arrays: every batch would fail in the dialect."""
    declared = schema.declared_annotations(io_struct.BatchTokenIDOutput)
    declared["decode_ids"] = "List[List[int]]"
    copy = dataclasses.make_dataclass("BatchTokenIDOutput", [(n, declared[n]) for n in io_struct.BatchTokenIDOutput.__struct_fields__])
    with pytest.raises(schema.SchemaMismatch, match=r"BatchTokenIDOutput.decode_ids: SGLang declares 'List\[List\[int\]\]'"):
        schema.build({"BatchTokenIDOutput": copy})


def test_the_build_names_a_wire_config_change():
    changed = msgspec.defstruct(
        "ConfigureLoggingReq",
        [(n, object) for n in io_struct.ConfigureLoggingReq.__struct_fields__],
        tag=True, kw_only=True, array_like=False,
    )
    with pytest.raises(schema.SchemaMismatch, match=r"ConfigureLoggingReq: wire config array_like"):
        schema.build({"ConfigureLoggingReq": changed})


def test_every_field_detokd_reads_is_declared_as_the_installed_release_declares_it():
    for name, reads in schema.READS.items():
        declared = schema.declared_annotations(getattr(io_struct, name))
        for field, (want, _) in reads.items():
            if field in declared or (name, field) not in schema.OPTIONAL:
                assert declared.get(field) == want, (name, field)
