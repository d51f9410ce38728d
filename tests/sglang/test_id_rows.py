"""detokd's readers of decode_ids (detokd.sglang.id_rows), proved against the rows SGLang's
own msgpack encoder sends (0.5.23)."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from messages import ROW_RUNS, arrays_of, assert_bounds, sglang_wire, token_batch
from messages import tok as tok  # a fixture, re-exported: no F811 where a test takes it

from detokd.sglang import id_rows, schema


def decoded_ids(tok, rows: list[array]) -> tuple[list[list[int]], bool]:
    """What MsgpackCodec reads of a batch whose decode_ids are `rows`, and whether the
    raw reader (int64_rows) read them, not the generic parse."""
    sent = token_batch(tok, ["x"] * 2, [None] * 2, step=1)
    sent.decode_ids = rows
    mine = schema.MsgpackCodec().decode(sglang_wire(sent))
    ids = schema.MsgpackCodec.ids(mine)
    assert_bounds(ids)
    return ids, type(mine.decode_ids) is id_rows.IdRows


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
