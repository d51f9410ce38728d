"""detokd.wire.native: docs/protocol.md v1 frames in and out.

Frames are built as plain dicts through msgspec.msgpack (what a peer in any language
sends), decoded by the dialect, and compared with the records they must become.
`NativeDialect.handle` is driven with a real Detokenizer, Outbox and Delivery.
"""

from __future__ import annotations

import msgspec
import pytest
import zmq
from conftest import fast_codec, vocab

from detokd.conductor import Conductor
from detokd.core.detokenizer import Detokenizer, Limits
from detokd.core.outbox import Outbox
from detokd.core.records import Unread
from detokd.core.stats import Stats
from detokd.delivery import Delivery
from detokd.gc_policy import GcPolicy
from detokd.wire import msgpack_scan, native

enc = msgspec.msgpack.encode
dec = msgspec.msgpack.decode
RAW = lambda obj: msgspec.Raw(enc(obj))  # noqa: E731


@pytest.mark.parametrize(
    "frame, want",
    [
        (
            {"type": "tokens", "rows": [{"rid": "a", "ids": [1, 2], "seq": 3, "start": {"worker": 1, "stop": ["x"]},
                                         "finish": {"reason": "stop", "matched": 2}, "meta": {"k": 1}}]},
            native.Tokens([native.Row("a", [1, 2], 3, native.Start(worker=1, stop=["x"]), native.Finish("stop", 2),
                                      RAW({"k": 1}))]),
        ),
        ({"type": "tokens", "rows": [{"rid": "b"}]}, native.Tokens([native.Row("b")])),
        (
            {"type": "embeddings", "rows": [{"rid": "e", "worker": 2, "data": [0.5], "meta": None}]},
            native.Embeddings([native.EmbeddingRow("e", 2, RAW([0.5]), native.NIL)]),
        ),
        ({"type": "abort", "rids": ["a", "b"]}, native.Abort(["a", "b"])),
        ({"type": "register", "worker": 3, "address": "tcp://h:1"}, native.Register(3, "tcp://h:1")),
        ({"type": "control", "op": "freeze_gc"}, native.Control("freeze_gc")),
    ],
    ids=["tokens", "tokens-defaults", "embeddings", "abort", "register", "control"],
)
def test_every_inbound_message_type_decodes_to_its_record(frame: dict, want: native.Inbound) -> None:
    got = native.decode_inbound(enc(frame))
    assert got == want
    assert native.decode_inbound(native.encode(got)) == want  # and what detokd's peers encode decodes back


def test_text_and_stopped_encode_to_protocol_maps() -> None:
    text = dec(native.encode_text([native.OutRow("r", "hé", native.Finish("length"), 4, RAW([1]), None)]))
    assert text == {"type": "text", "rows": [
        {"rid": "r", "text": "hé", "finish": {"reason": "length", "matched": None}, "n_ids": 4, "meta": [1], "error": None}]}
    stopped = dec(native.encode_stopped([native.StoppedRow("r", 1, "###", 7)]))
    assert stopped == {"type": "stopped", "rows": [{"rid": "r", "vid": 1, "matched": "###", "n_ids": 7}]}


def test_unknown_keys_are_ignored_at_every_level() -> None:
    frame = {"type": "tokens", "v": 2, "rows": [
        {"rid": "a", "ids": [5], "future": [1, 2], "start": {"worker": 1, "temperature": 0.7}}]}
    assert native.decode_inbound(enc(frame)) == native.Tokens([native.Row("a", [5], 0, native.Start(worker=1))])
    assert native.decode_inbound(enc({"type": "abort", "rids": ["x"], "why": "client left"})) == native.Abort(["x"])


def test_rows_and_starts_leave_keys_at_their_default_out_when_encoded() -> None:
    rows = [native.Row("a", [7], 0, native.Start(prompt_tail=[1])), native.Row("a", [8], 1), native.Row("b")]
    frame = native.encode(native.Tokens(rows))
    assert dec(frame) == {"type": "tokens", "rows": [
        {"rid": "a", "ids": [7], "start": {"prompt_tail": [1]}}, {"rid": "a", "ids": [8], "seq": 1}, {"rid": "b"}]}


def test_salvage_keeps_the_good_rows_of_a_frame_with_one_bad_row() -> None:
    frame = enc({"type": "tokens", "rows": [
        {"rid": "ok1", "ids": [1]}, {"rid": "bad", "ids": "not a list"}, {"ids": [3]}, {"rid": "ok2", "seq": 2}]})
    with pytest.raises(native.DecodeError):
        native.decode_inbound(frame)
    good, bad = native.salvage_rows(frame, Limits(rows=4))
    assert good == [native.Row("ok1", [1]), native.Row("ok2", [], 2)]
    assert bad == ["bad"]  # the row with no rid cannot be answered: it is only dropped
    assert native.salvage_rows(frame, Limits(rows=3)) is None  # more rows than max_rows: dropped whole, like a good frame


def test_salvage_reads_the_rid_of_a_bad_row_of_more_values_than_the_walker_takes() -> None:
    # msgspec reads a bad row's rid; the Python walker, which stops at MAX_VALUES, is only
    # for rows nested too deep for msgspec (and took 11 s over a 64 MiB frame of such rows).
    ids: list = [1] * msgpack_scan.MAX_VALUES + ["x"]
    within = Limits(rows=4, row_ids=len(ids), frame_ids=len(ids))  # over a cap, its ids would not be read
    good, bad = native.salvage_rows(enc({"type": "tokens", "rows": [{"rid": "big", "ids": ids}]}), within)
    assert (good, bad) == ([], ["big"])


@pytest.mark.parametrize("frame", [b"\xc1", enc([1, 2]), enc({"type": "abort", "rids": [1]}), enc({"type": "tokens"})])
def test_salvage_gives_up_on_a_frame_that_is_no_tokens_batch(frame: bytes) -> None:
    assert native.salvage_rows(frame, Limits()) is None


def test_rows_over_a_cap_are_read_with_their_lists_unread() -> None:
    # Two rows of 3 ids within the budget, a row over max_row_ids (its ids not even
    # ints), one past the frame's max_frame_ids, one without ids past it (read), and
    # starts over max_wire_prompt_tail and max_stop_strings.
    limits = Limits(row_ids=4, frame_ids=8, wire_prompt_tail=3, stop_strings=2)
    frame = enc({"type": "tokens", "rows": [
        {"rid": "a", "ids": [1, 2, 3]}, {"rid": "b", "ids": [4, 5, 6], "seq": 2},
        {"rid": "over", "ids": ["x"] * 5, "start": {"worker": 1, "stop": ["s"]}, "meta": 7},
        {"rid": "past", "ids": [7, 8]}, {"rid": "empty"},
        {"rid": "tail", "start": {"prompt_tail": [1, 2, 3, "x"]}}, {"rid": "stops", "start": {"stop": ["a", "b", 3]}}]})
    good, bad = native.salvage_rows(frame, limits)
    assert bad == [] and [r.rid for r in good] == ["a", "b", "over", "past", "empty", "tail", "stops"]
    assert good[:2] == [native.Row("a", [1, 2, 3]), native.Row("b", [4, 5, 6], 2)] and good[4] == native.Row("empty")
    lengths = {r.rid: (len(r.ids), r.start and len(r.start.prompt_tail), r.start and len(r.start.stop)) for r in good[2:]}
    assert lengths == {"over": (5, 0, 1), "past": (2, None, None), "empty": (0, None, None), "tail": (0, 4, 0), "stops": (0, 0, 3)}
    over, tail, stops = good[2], good[5], good[6]
    assert isinstance(over.ids, Unread) and over.start.worker == 1 and over.start.stop == ["s"] and over.meta == RAW(7)
    assert isinstance(good[3].ids, Unread) and isinstance(tail.start.prompt_tail, Unread) and isinstance(stops.start.stop, Unread)
    with pytest.raises(TypeError, match="never read"):
        max(over.ids)


def test_array_lens_read_every_form_of_array_header_and_no_array_as_0() -> None:
    rows: list = [[], [1], list(range(15)), list(range(16)), list(range(70_000)), "no ids", None]
    assert native.array_lens([RAW(r) for r in rows]) == [0, 1, 15, 16, 70_000, 0, 0]


@pytest.fixture
def dialect():
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind("inproc://native-w0")
    stats = Stats()
    outbox = Outbox([0])
    v = vocab("deepseek")
    core = Detokenizer(fast_codec("deepseek"), v.size, outbox, max_states=16, max_prompt_tail=8, stats=stats)
    delivery = Delivery(ctx, ["inproc://native-w0"], feedback=None, hwm=100, queue_bytes=1 << 20, linger_ms=0, stats=stats)
    d = native.NativeDialect(core, GcPolicy(stats), stats)
    d.conductor = Conductor(d, core, delivery, stats)  # the loop's way from handle to delivery
    yield d, pull
    delivery.close()
    pull.close(0)
    ctx.term()


def test_handle_serves_the_good_rows_of_a_bad_frame_and_fails_the_bad_rows_request(dialect) -> None:
    d, pull = dialect
    ids = vocab("deepseek").backend.encode("héllo wörld", add_special_tokens=False).ids
    started = d.handle(enc({"type": "tokens", "rows": [{"rid": "bad", "ids": [1], "start": {}}]}))  # starts "bad"
    assert started is not None and "bad" in d.core.table
    out = d.handle(enc({"type": "tokens", "rows": [
        {"rid": "good", "ids": ids, "start": {}, "finish": {"reason": "length"}}, {"rid": "bad", "ids": [1], "seq": "one"}]}))
    assert out is not None and d.stats.bad_frames == 1
    d.conductor.deliver(out)
    rows = {r["rid"]: r for r in dec(pull.recv())["rows"]}
    assert rows["good"]["text"] == vocab("deepseek").reference([], ids) and rows["good"]["finish"]
    assert rows["bad"]["error"] == native.BAD_ROW and "bad" not in d.core.table  # failed, freed


def test_a_bad_rows_rid_beyond_max_rid_len_gets_no_row_it_would_be_echoed_to_every_worker(dialect) -> None:
    d, pull = dialect
    long = "r" * (d.core.limits.rid_len + 1)
    d.conductor.frame(enc({"type": "tokens", "rows": [{"rid": long, "ids": "no"}, {"rid": "short", "ids": "no"}]}))
    assert [(r["rid"], r["error"]) for r in dec(pull.recv())["rows"]] == [("short", native.BAD_ROW)]
    assert d.stats.errors == {native.TOO_LARGE: 1, native.BAD_ROW: 1}


def test_handle_counts_a_frame_with_no_message_and_says_so(dialect) -> None:
    d, _ = dialect
    assert d.handle(b"\x93\x01\x02\x03") is None
    assert d.stats.bad_frames == 1
