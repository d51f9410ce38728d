"""SGLang's pickle IPC without its per-row time stats round trip.

In pickle mode every BatchTokenIDOutput carries one SchedulerReqTimeStats per row
(time_stats), which the detokenizer only copies into BatchStrOutput. SGLang's own
detokenizer pays a Python __setstate__ per row to unpickle them (it rebases their times
to its clock) and a Python __getstate__ per row to pickle them again (it rebases them to
the TokenizerManager's): about half of unpickling and pickling a batch.

`loads` unpickles them as TimeStats instead: the state as it arrived, set by pickle's
C default, no Python. Pickled, a TimeStats becomes SGLang's class again with the state
SGLang's round trip would send: the same state when that round trip leaves it as it
is (checked once against the installed class: true of the empty state the scheduler
sends unless metrics or timing are on), else computed by that very round trip. The
TokenizerManager unpickles the same objects either way (object.__new__ of SGLang's
class, then its __setstate__ with that state).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from sglang.srt.observability.req_time_stats import SchedulerReqTimeStats

_GLOBAL = (SchedulerReqTimeStats.__module__, SchedulerReqTimeStats.__qualname__)
_NEW = object.__new__
_ARGS = (SchedulerReqTimeStats,)  # one tuple: pickle writes it once a message, then refers to it


def _round_trip(state: dict) -> Any:
    """What SGLang's detokenizer sends for a received state: __setstate__, __getstate__."""
    obj = _NEW(SchedulerReqTimeStats)
    obj.__setstate__(dict(state))  # it edits the dict it is given
    return obj.__getstate__()


_EMPTY_KEPT = _round_trip({}) == {}


class TimeStats:
    """A SchedulerReqTimeStats as received: its pickled state is its __dict__."""

    def __reduce_ex__(self, protocol: int) -> tuple:
        state = self.__dict__
        if not state and _EMPTY_KEPT:
            return _NEW, _ARGS, {}
        return _NEW, _ARGS, _round_trip(state)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == _GLOBAL:
            return TimeStats
        return super().find_class(module, name)


def loads(frame: bytes) -> Any:
    return _Unpickler(io.BytesIO(frame)).load()


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
