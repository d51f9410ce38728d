"""SGLang's pickle IPC without its per-row time stats round trip, or arrays built per row.

In pickle mode every BatchTokenIDOutput carries one SchedulerReqTimeStats per row
(time_stats), which the detokenizer only copies into BatchStrOutput. SGLang's own
detokenizer pays a Python __setstate__ per row to unpickle them (it rebases their times
to its clock) and a Python __getstate__ per row to pickle them again (it rebases them to
the TokenizerManager's): about half of unpickling and pickling a batch.

`loader`'s unpickler reads them as TimeStats instead: the state as it arrived, set by
pickle's C default, no Python. Pickled, a TimeStats becomes SGLang's class again with the
state SGLang's round trip would send: the same state when that round trip leaves it as it
is (checked once against the installed class: true of the empty state the scheduler
sends unless metrics or timing are on), else computed by that very round trip. The
TokenizerManager unpickles the same objects either way (object.__new__ of SGLang's
class, then its __setstate__ with that state).

Each row's arrays (decode_ids, output_ids: array('q') each) unpickle as `Array`, the
arguments of their pickled reconstruction (one C call, no array built): decode_ids are
read from their bytes in one buffer (`id_rows`), and an Array pickles back as the very
array it stands for, wherever it goes.

Two per-row lists of BatchStrOutput then pickle in a compact form that unpickles to
equal lists (`compact`): pickle writes and reads one object per row with a reduce
call each, which made them half of what is left of pickling a batch.
- time_stats, when every row's is the empty state: `list(map(object.__new__,
  repeat(SchedulerReqTimeStats, n)))`, objects whose __dict__ is as empty as after
  SGLang's __setstate__({}) (checked once against the installed class).
- output_ids (one array('q') per row, received as Array): `list(map(array, repeat("q"),
  [bytes, ...]))`; the TokenizerManager shares the host, so the native item bytes are its own.
Each is a list subclass, so everything else reads them as the lists they are (the
split of a batch per HTTP worker builds plain lists from them). Both forms call only
builtins and itertools.repeat, which SGLang's recv_pyobj (an unrestricted pickle.loads)
resolves; a TokenizerManager behind an allow-list unpickler would need them allowed.

A frame is unpickled naming only the globals SGLang's scheduler puts in a message to the
detokenizer (`SAFE`, and the message classes themselves): SGLang's own detokenizer
unpickles whatever reaches its socket, so a frame there can call any function. Here a
frame naming another global is refused before anything is called (`Refused`: a bad
frame), and a tensor's storage, which torch pickles as bytes for an unrestricted
`torch.load`, is loaded with torch's own allow-list (`weights_only`). An operator can
allow more (DETOKD_SGLANG_PICKLE_ALLOW, `allowances`).
"""

from __future__ import annotations

import io
import pickle
from array import _array_reconstructor, array  # type: ignore[attr-defined]  # what CPython's arrays pickle by
from collections.abc import Callable, Iterable
from itertools import repeat
from operator import attrgetter
from typing import Any, SupportsIndex

import msgspec
import numpy as np
from sglang.srt.observability.req_time_stats import SchedulerReqTimeStats

from .id_rows import IdRows, id_rows_of

_GLOBAL = (SchedulerReqTimeStats.__module__, SchedulerReqTimeStats.__qualname__)
_ARRAY = (_array_reconstructor.__module__, _array_reconstructor.__name__)
_NEW = object.__new__
_ARGS = (SchedulerReqTimeStats,)  # one tuple: pickle writes it once a message, then refers to it


def _round_trip(state: dict) -> Any:
    """What SGLang's detokenizer sends for a received state: __setstate__, __getstate__."""
    obj = _NEW(SchedulerReqTimeStats)
    obj.__setstate__(dict(state))  # it edits the dict it is given
    return obj.__getstate__()


def _set_empty() -> dict:
    obj = _NEW(SchedulerReqTimeStats)
    obj.__setstate__({})
    return vars(obj)


_EMPTY_KEPT = _round_trip({}) == {}
_EMPTY_IS_NEW = _EMPTY_KEPT and _set_empty() == {}  # the receiver's __setstate__({}) would change nothing


class TimeStats:
    """A SchedulerReqTimeStats as received: its pickled state is its __dict__."""

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple:
        state = self.__dict__
        if not state and _EMPTY_KEPT:
            return _NEW, _ARGS, {}
        return _NEW, _ARGS, _round_trip(state)


class Array(msgspec.Struct, gc=False):
    """An array.array as received: the arguments pickle reconstructs it from."""

    cls: type
    typecode: str
    mformat: int  # the items' machine format (array's own code)
    items: bytes

    def __reduce__(self) -> tuple:
        return _array_reconstructor, (self.cls, self.typecode, self.mformat, self.items)

    def array(self) -> array:
        return _array_reconstructor(self.cls, self.typecode, self.mformat, self.items)


_INT64 = (array, "q", array("q").__reduce_ex__(pickle.HIGHEST_PROTOCOL)[1][2])  # this host's array('q')
_KIND = (attrgetter("cls"), attrgetter("typecode"), attrgetter("mformat"))
_ITEMS = attrgetter("items")


def _int64s(rows: Any) -> bool:
    """Whether rows is a list of received array('q') (Array) only. Counted field by field:
    a set of (cls, typecode, mformat) would build and hash a tuple per row, twice a batch."""
    if type(rows) is not list or not rows:
        return False
    n = len(rows)
    return list(map(type, rows)).count(Array) == n and all(
        list(map(field, rows)).count(want) == n for field, want in zip(_KIND, _INT64, strict=True)
    )


# How many rows of a step may differ in length from its middle row for its rows to be
# read in runs: each start among them differs (its ids begin with the prompt context);
# rows of many lengths (speculative decoding's) are cheaper one by one.
MAX_OTHERS = 8


def id_rows(rows: list) -> list[list[int]]:
    """decode_ids as lists of ints, from their joined bytes as one numpy array (which
    also gives the bounds of IdRows): each run of rows of as many ids in one view (a
    decode step is one run, a few starts break it), rows of many lengths sliced apart."""
    if not (rows and _int64s(rows)):
        return [(a.array() if type(a) is Array else a).tolist() for a in rows]
    items = list(map(_ITEMS, rows))
    sizes = list(map(len, items))  # bytes: 8 per id
    n = len(sizes)
    ids = np.frombuffer(b"".join(items), "=i8")
    common = sizes[n // 2]
    alike = sizes.count(common)
    if alike < n - MAX_OTHERS:
        return id_rows_of(ids, [size >> 3 for size in sizes])
    out = IdRows()
    if ids.size:
        out.widen(int(ids.min()), int(ids.max()))
    if alike == n:  # a decode step: one view
        out += ids.reshape(n, common >> 3).tolist() if common else [[] for _ in range(n)]
        return out
    k = np.array(sizes) >> 3  # ids per row
    ends = np.cumsum(k).tolist()
    firsts = [0, *(np.flatnonzero(k[1:] != k[:-1]) + 1).tolist()]
    for first, end in zip(firsts, [*firsts[1:], n], strict=True):
        width, count = sizes[first] >> 3, end - first
        at = ends[first] - width
        out += ids[at : at + count * width].reshape(count, width).tolist() if width else [[] for _ in range(count)]
    return out


MESSAGES = "sglang.srt.managers.io_struct"  # the module of the messages' classes

# What a message to the detokenizer holds besides its own class, as SGLang 0.5.23's
# scheduler pickles it (module, name).
SAFE = frozenset({
    ("msgspec._utils", "rebuild"),  # how a keyword-only msgspec Struct unpickles: cls(**fields)
    ("array", "array"),  # the class an array's reconstruction names (an Array's cls)
    (MESSAGES, "PickleWrapper"),  # opaque bytes (customized_info): passed on, never loaded here
    ("sglang.srt.utils.weight_versions", "WeightVersionSpan"),
    ("sglang.srt.sampling.sampling_mask", "_chunk_from_buffers"),  # three numpy arrays
    ("numpy", "dtype"), ("numpy", "ndarray"), ("numpy._core.numeric", "_frombuffer"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "scalar"),
    ("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"),  # a tensor: routed_experts, indexer_topk
})


def _storage(data: bytes) -> Any:
    """A tensor's storage from the bytes torch pickles it as: torch's _load_from_bytes
    loads them with weights_only=False, which runs any pickle inside."""
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


_SWAPS = {_GLOBAL: TimeStats, _ARRAY: Array, ("torch.storage", "_load_from_bytes"): _storage}


class Refused(pickle.UnpicklingError):
    """A frame names a global that no message to the detokenizer holds."""


class _Unpickler(pickle.Unpickler):
    allowed: frozenset[tuple[str, str]] = SAFE

    def find_class(self, module: str, name: str) -> Any:
        swap = _SWAPS.get((module, name))
        if swap is not None:
            return swap
        if (module, name) not in self.allowed:
            # quoted: the names are the frame's, and the message is logged
            raise Refused(f"the frame names {f'{module}.{name}'!r}, which SGLang's scheduler does not send to a "
                          f"detokenizer (DETOKD_SGLANG_PICKLE_ALLOW={f'{module}:{name}'!r} would allow it)")
        return super().find_class(module, name)


def loader(messages: Iterable[str] = (), extra: Iterable[tuple[str, str]] = ()) -> Callable[[bytes], Any]:
    """The `loads` of frames that may name the message classes `messages` of io_struct,
    what they hold (`SAFE`), and the globals `extra` an operator allowed."""
    allowed = SAFE | {(MESSAGES, m) for m in messages} | frozenset(extra)
    unpickler = type("_Unpickler", (_Unpickler,), {"allowed": allowed})
    return lambda frame: unpickler(io.BytesIO(frame)).load()


def allowances(spec: str) -> frozenset[tuple[str, str]]:
    """DETOKD_SGLANG_PICKLE_ALLOW's globals: `module:name`, comma-separated."""
    pairs = [item.strip().split(":") for item in spec.split(",") if item.strip()]
    wrong = [":".join(p) for p in pairs if len(p) != 2 or not all(p)]
    if wrong:
        raise ValueError(f"DETOKD_SGLANG_PICKLE_ALLOW: {wrong[0]!r} is not module:name")
    return frozenset((module, name) for module, name in pairs)


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


class _Call:
    """Pickles as func(*args)."""

    __slots__ = ("reduced",)

    def __init__(self, func: Any, *args: Any) -> None:
        self.reduced = (func, args)

    def __reduce__(self) -> tuple:
        return self.reduced


class _EmptyTimeStatsList(list):
    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple:
        return list, (_Call(map, _NEW, _Call(repeat, SchedulerReqTimeStats, len(self))),)


class _Int64ArrayList(list):
    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple:
        return list, (_Call(map, array, _Call(repeat, "q"), list(map(_ITEMS, self))),)


def compact(name: str, value: Any) -> Any:
    """A copied BatchStrOutput field in its compact pickled form where it has one."""
    if type(value) is not list or not value:
        return value
    if name == "time_stats":
        if _EMPTY_IS_NEW and set(map(type, value)) == {TimeStats} and not any(map(len, map(vars, value))):
            return _EmptyTimeStatsList(value)
    elif name == "output_ids":
        if _int64s(value):
            return _Int64ArrayList(value)
    return value
