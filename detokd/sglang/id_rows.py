"""decode_ids read: each row of a batch's ids as a list of ints, with the bounds of them all.

SGLang's scheduler sends every decode_ids row as array('q'): in msgpack an ext 1 (a
big-endian u32 n, n bytes of msgpack holding the typecode, the native int64 items), in
pickle an array reconstruction (detokd.sglang.pickled). A decode step's rows are mostly
of one length (a start's row is longer: its ids begin with the prompt context), so the
readers here take a step from its joined bytes in numpy views, run by run, with no
Python per row but tolist's; rows of many lengths (speculative decoding's) are sliced
apart, anything else is read row by row. Numpy finds the least and the greatest id of
the step on the way (IdRows.lo, .hi): a step whose ids all lie in the vocabulary spares
each row its own check.
"""

from __future__ import annotations

import functools
from array import array
from itertools import accumulate
from operator import attrgetter
from typing import Any

import msgspec
from msgspec import Raw
from msgspec.msgpack import Ext

try:  # SGLang's environment has it; elsewhere each row is read on its own
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]  # the fallback below reads each row on its own

_EXT_ARRAY = 1  # SGLang's msgpack ext code of an array.array


def array_of(ext: Ext) -> array:
    """An array.array from SGLang's ext 1: a big-endian u32 n, n bytes of msgpack (the
    typecode), the items' native bytes."""
    if ext.code != _EXT_ARRAY:
        raise msgspec.ValidationError(f"expected an array (ext {_EXT_ARRAY}), got ext {ext.code}")
    data = memoryview(ext.data)
    n = int.from_bytes(data[:4], "big")
    out = array(msgspec.msgpack.decode(data[4 : 4 + n]))
    out.frombytes(data[4 + n :])
    return out


# The head of an ext-1 payload holding array('q'), as SGLang's scheduler sends every
# decode_ids row: its items follow at once, so the common row skips the generic parse.
_INT64_HEAD = b"\x00\x00\x00\x02\xa1q"


class IdRows(list):
    """decode_ids already read: each row's ids as a list of ints, with the least and the
    greatest id of them all, which the readers find with numpy for all rows at once: a
    step whose ids all lie in the vocabulary spares each row its own check (min and max
    of a short list cost more than the row's text)."""

    __slots__ = ("lo", "hi")

    def __init__(self, rows: Any = ()) -> None:
        super().__init__(rows)
        self.lo, self.hi = 0, -1  # lo > hi: no ids at all

    def widen(self, lo: int, hi: int) -> None:
        """Take in ids from lo to hi."""
        if self.lo > self.hi:
            self.lo, self.hi = lo, hi
        else:
            self.lo, self.hi = min(self.lo, lo), max(self.hi, hi)


def in_vocabulary(rows: list[list[int]], vocab_size: int) -> bool:
    """Whether every id of `rows` is known to lie in [0, vocab_size) without a look at each."""
    return type(rows) is IdRows and rows.lo >= 0 and rows.hi < vocab_size


def id_rows_of(flat: Any, counts: list[int]) -> IdRows:
    """Rows of `counts` ids each, in order, from one numpy array of all their ids."""
    ids = flat.tolist()
    ends = accumulate(counts)
    rows = IdRows(ids[end - count : end] for end, count in zip(ends, counts, strict=True))
    if flat.size:
        rows.widen(int(flat.min()), int(flat.max()))
    return rows


_CODE, _DATA = attrgetter("code"), attrgetter("data")


def ids_of(exts: list[Ext]) -> list[list[int]]:
    """Each row's decode_ids as a list of ints: rows of array('q') of any lengths
    (speculative decoding's) from their joined bytes, with numpy; others one by one."""
    if np is not None and exts and list(map(_CODE, exts)).count(_EXT_ARRAY) == len(exts):
        datas = list(map(_DATA, exts))
        sizes = np.fromiter(map(len, datas), np.int64, count=len(datas))
        body = sizes - len(_INT64_HEAD)
        if body.min() >= 0 and not (body & 7).any():
            joined = np.frombuffer(b"".join(datas), np.uint8)
            heads = (np.cumsum(sizes) - sizes)[:, None] + np.arange(len(_INT64_HEAD))
            if (joined[heads] == np.frombuffer(_INT64_HEAD, np.uint8)).all():
                items = np.ones(len(joined), bool)
                items[heads] = False
                return id_rows_of(joined[items].view("=i8"), (body >> 3).tolist())
    head = _INT64_HEAD
    k = len(head)
    return [
        memoryview(e.data)[k:].cast("q").tolist() if e.code == _EXT_ARRAY and memoryview(e.data)[:k] == head
        else array_of(e).tolist()
        for e in exts
    ]


# Runs (rows of one length) a step may break into before the generic parse is cheaper:
# a run of one is read in Python, at several times the generic parse's cost per row,
# and rows of many lengths (speculative decoding's) would each be a run.
MAX_RUNS = 16
# Rows of a run's first view: a run is read in views of growing size, so a short run
# costs a short view and a long one a few.
FIRST_VIEW = 256


def _array_head(b: memoryview) -> tuple[int, int] | None:
    """A msgpack array's length and where its items begin, or None."""
    tag = b[0]
    if 0x90 <= tag <= 0x9F:  # fixarray
        return tag & 0x0F, 1
    if tag == 0xDC and len(b) >= 3:  # array 16
        return int.from_bytes(b[1:3], "big"), 3
    if tag == 0xDD and len(b) >= 5:  # array 32
        return int.from_bytes(b[1:5], "big"), 5
    return None


def _int64_ext(b: memoryview, at: int) -> tuple[int, int] | None:
    """The header length and the number of ids of the ext 1 holding array('q') at
    `at`, or None."""
    if len(b) < at + 4:
        return None
    if b[at] == 0xC7:  # ext 8: size, type
        size, hdr = b[at + 1], 3
    elif b[at] == 0xC8:  # ext 16
        size, hdr = int.from_bytes(b[at + 1 : at + 3], "big"), 4
    else:
        return None
    k, odd = divmod(size - len(_INT64_HEAD), 8)
    if odd or k < 0 or b[at + hdr - 1] != _EXT_ARRAY or b[at + hdr : at + hdr + len(_INT64_HEAD)] != _INT64_HEAD:
        return None
    return hdr, k


@functools.lru_cache(maxsize=64)
def _row_dtype(head: int, k: int) -> Any:
    """A row of k ids as numpy sees it: its header bytes as one value, then the ids."""
    return np.dtype([("head", f"V{head}"), ("ids", "=i8", (k,))])


def int64_rows(raw: Raw) -> IdRows | None:
    """decode_ids read from their raw msgpack, when every row is an ext 1 holding
    array('q'), as SGLang's scheduler sends them. Rows of one length lie at a fixed
    stride, so a run of them is read by numpy views, with no Python per row but tolist's:
    a decode step is one run, and each start among its rows (its ids begin with the
    prompt context) breaks it. None for any other list, or one of more than MAX_RUNS
    runs (the generic parse reads it)."""
    b = memoryview(raw)
    if np is None or not b:
        return None
    head = _array_head(b)
    if head is None:
        return None
    n, at = head
    out = IdRows()
    for _ in range(MAX_RUNS):
        if len(out) == n:
            break
        ext = _int64_ext(b, at)
        if ext is None:
            return None
        hdr, k = ext
        stride = hdr + len(_INT64_HEAD) + 8 * k
        if at + stride > len(b):
            return None
        key = at + hdr + len(_INT64_HEAD)
        if len(out) + 1 == n or b[at:key] != b[at + stride : key + stride]:  # a run of one: no view
            row = b[key : at + stride].cast("q").tolist()
            out.append(row)
            if row:
                out.widen(min(row), max(row))
            at += stride
        else:
            at = _run(b, at, key - at, k, n - len(out), out)
    return out if len(out) == n and at == len(b) else None


def _run(b: memoryview, at: int, head: int, k: int, most: int, out: IdRows) -> int:
    """Append to `out` the ids of the run of rows like the one at `at` (its `head` bytes
    checked, k ids), at most `most` rows, and widen its bounds; return where the run ends."""
    stride = head + 8 * k
    dtype = _row_dtype(head, k)
    first = None
    view = FIRST_VIEW
    while most:
        count = min(most, view, (len(b) - at) // stride)
        if not count:  # what is left is shorter than a row of the run
            break
        rows = np.frombuffer(b, dtype, count=count, offset=at)
        if first is None:
            first = rows["head"][0]
        same = rows["head"] == first
        other = int(same.argmin())
        run = count if same[other] else other
        ids = rows["ids"][:run]
        out += ids.tolist()
        if k and run:
            out.widen(int(ids.min()), int(ids.max()))
        at += run * stride
        most -= run
        if run < count or count < view:
            break
        view *= 4
    return at
