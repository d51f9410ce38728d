"""detokd's pickle IPC (detokd.sglang.pickled: time stats, decode_ids, compact lists, received
arrays), proved against SGLang's own pickles and DetokenizerManager (0.5.23)."""

from __future__ import annotations

import pickle
from array import array

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from messages import ROW_RUNS, Calls, arrays_of, assert_bounds, encode_str_output, sglang_detokenizer, token_batch
from messages import tok as tok  # a fixture, re-exported: no F811 where a test takes it

from detokd.sglang import id_rows, pickled, schema

received = pickled.loader()  # unpickles what a message holds (arrays, time stats) as detokd does


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
    got = pickle.loads(encode_str_output(codec, codec.decode(frame), expected.output_strs))
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
    sent = [scheduler_time_stats(False), scheduler_time_stats(False)]
    stats = received(pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL))
    ids = received(pickle.dumps(output_ids, protocol=pickle.HIGHEST_PROTOCOL))  # as received: Array
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
    rows = arrays_of(runs, value)
    ids = pickled.id_rows(received(pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL)))
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
    got = received(pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL))
    assert all(type(a) is pickled.Array for a in got)
    assert pickled.id_rows(got) == [a.tolist() for a in rows]
    for a, b in zip(rows, got, strict=True):
        assert pickled.dumps(b) == pickled.dumps(a) and b.array() == a and type(b.array()) is array


def hostile(marker) -> list:
    """Calls that would leave `marker` behind, each by another way in."""
    import os
    import subprocess

    import torch.storage

    return [
        Calls(os.mkdir, str(marker)),
        Calls(subprocess.call, ["mkdir", str(marker)]),
        Calls(eval, f"__import__('os').mkdir({str(marker)!r})"),
        # a tensor's storage: torch's own loader of these bytes runs any pickle in them
        Calls(torch.storage._load_from_bytes, pickle.dumps(Calls(os.mkdir, str(marker)))),
    ]


@pytest.mark.parametrize("way", range(4))
def test_a_frame_that_names_another_global_is_refused_before_anything_is_called(tok, tmp_path, way):
    """SGLang's own detokenizer would run each of these; detokd refuses the frame, alone
    or inside a batch SGLang's scheduler could send."""
    marker = tmp_path / "called"
    evil = hostile(marker)[way]
    batch = token_batch(tok, ["a", "b"], [None, None], step=1)
    batch.output_hidden_states = [evil, None]
    codec = schema.PickleCodec()
    for frame in (pickle.dumps(evil, protocol=pickle.HIGHEST_PROTOCOL), pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)):
        with pytest.raises(pickle.UnpicklingError):
            codec.decode(frame)
    assert not marker.exists()


def test_every_global_of_the_fullest_batch_sglang_sends_is_allowed(tok):
    """Every kind of field the scheduler fills (tensors, numpy-backed sampling masks,
    weight versions, wrapped customized info, time stats, arrays) reads back as sent."""
    sent = token_batch(tok, ["hello", "world"], [None, {"type": "length", "length": 2}], step=3)
    got = schema.PickleCodec().decode(pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL))
    assert got.rids == sent.rids and got.output_hidden_states == sent.output_hidden_states
    assert [t.tolist() if t is not None else None for t in got.routed_experts] == [
        t.tolist() if t is not None else None for t in sent.routed_experts
    ]
    mask, want = got.output_token_sampling_mask[0], sent.output_token_sampling_mask[0]
    if isinstance(want, list):  # 0.5.20: lists, beside output_token_sampling_logprobs
        assert mask == want and got.output_token_sampling_logprobs == sent.output_token_sampling_logprobs
    else:
        assert mask.token_ids.tolist() == want.token_ids.tolist()


def test_an_operator_may_allow_more_globals(tok):
    """DETOKD_SGLANG_PICKLE_ALLOW, for a payload detokd does not know: `module:name`."""
    from fractions import Fraction

    frame = pickle.dumps([Fraction(1, 3)], protocol=pickle.HIGHEST_PROTOCOL)
    with pytest.raises(pickled.Refused, match="DETOKD_SGLANG_PICKLE_ALLOW='fractions:Fraction'"):
        schema.PickleCodec().decode(frame)
    assert schema.PickleCodec(pickled.allowances(" fractions:Fraction, ")).decode(frame) == [Fraction(1, 3)]


@pytest.mark.parametrize("spec", ["fractions.Fraction", "fractions:", ":Fraction", "a:b:c"])
def test_an_allowance_not_of_the_form_module_name_is_a_clear_error(spec):
    with pytest.raises(ValueError, match="is not module:name"):
        pickled.allowances(spec)


def test_every_allowed_global_is_one_the_installed_packages_define():
    """The allow-list names SGLang's, numpy's and torch's internals by module and name: a
    typo, or a package that moved one, would refuse every frame that holds it."""
    import importlib
    import importlib.util

    wanted = pickled.SAFE | {(pickled.MESSAGES, kind) for kind in schema.MIRRORED if kind != "BatchStrOutput"}
    for module, name in sorted(wanted):
        if module.startswith("sglang.") and importlib.util.find_spec(module) is None:
            continue  # a module of a newer release (0.5.20 has no sampling_mask): no frame here names it
        assert callable(getattr(importlib.import_module(module), name)), (module, name)
