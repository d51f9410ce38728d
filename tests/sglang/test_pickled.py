"""detokd's pickle IPC (detokd.sglang.pickled: time stats, decode_ids, compact lists, received
arrays), proved against SGLang's own pickles and DetokenizerManager (0.5.23)."""

from __future__ import annotations

import pickle
from array import array

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from detokd.sglang import id_rows, schema
from messages import ROW_RUNS, arrays_of, assert_bounds, sglang_detokenizer, token_batch
from messages import tok as tok  # a fixture, re-exported: no F811 where a test takes it


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
