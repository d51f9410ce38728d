"""The core's records: a request's rows in, its output rows out.

The core consumes `Row`s and produces `OutRow`s whatever wire they came on. docs/protocol.md
v1 was designed around these shapes, so the native dialect decodes its frames straight
into them (detokd.wire.native adds only the envelopes); another dialect builds them
from its own messages. `meta` is opaque to the core: it comes back, untouched, on the
output row of the same input row (the native dialect keeps the frame's raw bytes there,
another dialect its own handle to the row's other fields).
"""

from __future__ import annotations

from typing import Union

from msgspec import Raw, Struct

NIL = Raw(b"\xc0")  # MessagePack nil, the default of every opaque field


# Schedulers encode Start and Row (detokd.client): keys at their default are left
# out, as docs/protocol.md allows, which halves a one-id row and its decode.
class Start(Struct, frozen=True, gc=False, omit_defaults=True):
    worker: int = 0
    vid: int = 0
    prompt_tail: list[int] = []
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: list[str] = []
    no_stop_trim: bool = False
    stream: bool = True


class Finish(Struct, frozen=True, gc=False):
    reason: str
    matched: Union[str, int, None] = None


class Row(Struct, gc=False, omit_defaults=True):
    rid: str
    ids: list[int] = []
    seq: int = 0
    start: Union[Start, None] = None
    finish: Union[Finish, None] = None
    meta: Raw = NIL


class Unread(list):
    """A list of a Row that its dialect never read (its ids, its start's prompt_tail or
    stop strings), because it passes a cap (`max_row_ids`, the frame's `max_frame_ids`,
    `max_wire_prompt_tail`, `max_stop_strings`): only its length. The core answers such
    a row `too_large` by the lengths alone, as it answers any row over a cap, so a frame
    cannot make detokd hold those items as Python objects (an id is 36 bytes for 5 on the
    wire). Reading one is a bug, and raises."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        raise TypeError(f"{self!r}: a list over a cap is never read")

    def __getitem__(self, i):
        raise TypeError(f"{self!r}: a list over a cap is never read")

    def __eq__(self, other: object) -> bool:  # list's would compare the (empty) items
        return self is other

    __hash__ = None  # as a list's

    def __repr__(self) -> str:
        return f"Unread({self.n})"


class OutRow(Struct, gc=False):
    rid: str
    text: str = ""
    finish: Union[Finish, None] = None
    n_ids: int = 0
    meta: Raw = NIL
    error: Union[str, None] = None


class StoppedRow(Struct):
    """A stop string detokd found itself: the scheduler may stop generating `rid`."""

    rid: str
    vid: int
    matched: str
    n_ids: int


def error_row(rid: str, error: str, *, n_ids: int = 0, meta: Raw = NIL) -> OutRow:
    """The row that fails a request: no text, no finish, why in `error`."""
    return OutRow(rid, "", None, n_ids, meta, error)


# Error words of OutRow.error. The first four are docs/protocol.md's; the rest are
# detokd's documented extensions (docs/protocol.md).
UNKNOWN_RID = "unknown_rid"
EVICTED = "evicted"
SEQUENCE_GAP = "sequence_gap"
BAD_IDS = "bad_ids"
BAD_ROW = "bad_row"  # the row did not match the schema (wrong type, missing rid...)
BAD_START = "bad_start"  # start names a worker detokd has no address for
WORKER_STALLED = "worker_stalled"  # an earlier message for this rid could not be queued
INTERNAL = "internal"  # an unexpected failure while decoding this rid; the rest go on
TOO_LARGE = "too_large"  # the row or its start is beyond a configured cap (max_row_ids, ...)
RID_COLLISION = "rid_collision"  # a start for a live rid named another worker: both are told
OVERLOADED = "overloaded"  # detokd's memory is above max_rss_mb, or a new stop list's above max_stop_bytes: refused
SHUTDOWN = "shutdown"  # read while stopping, after the time shutdown gives decoding ran out
RESTARTED = "restarted"  # a later row of a request that began before this process (SGLang mode, after a restart)
