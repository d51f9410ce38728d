"""The wire messages of PROTOCOL.md v1 as msgspec Structs.

One ZMQ frame holds one MessagePack map; `type` tags the message. Unknown keys are
ignored and missing optional keys take their defaults, so older and newer peers
interoperate. `meta` and embedding `data` stay msgspec.Raw: they are copied into
the output as the exact bytes that came in, never decoded.
"""

from __future__ import annotations

from typing import Union

import msgspec
from msgspec import Raw, Struct

NIL = Raw(b"\xc0")  # MessagePack nil, the default of every opaque field


# Schedulers encode Start and Row (detokd.client): keys at their default are left
# out, as PROTOCOL.md allows, which halves a one-id row and its decode.
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


class Tokens(Struct, tag_field="type", tag="tokens"):
    rows: list[Row]


class EmbeddingRow(Struct):
    rid: str
    worker: int = 0
    data: Raw = NIL
    meta: Raw = NIL


class Embeddings(Struct, tag_field="type", tag="embeddings"):
    rows: list[EmbeddingRow]


class Abort(Struct, tag_field="type", tag="abort"):
    rids: list[str]


class Register(Struct, tag_field="type", tag="register"):
    worker: int
    address: str


class Control(Struct, tag_field="type", tag="control"):
    op: str


Inbound = Union[Tokens, Embeddings, Abort, Register, Control]


class OutRow(Struct, gc=False):
    rid: str
    text: str = ""
    finish: Union[Finish, None] = None
    n_ids: int = 0
    meta: Raw = NIL
    error: Union[str, None] = None


class Text(Struct, tag_field="type", tag="text"):
    rows: list[OutRow]


class StoppedRow(Struct):
    rid: str
    vid: int
    matched: str
    n_ids: int


class Stopped(Struct, tag_field="type", tag="stopped"):
    rows: list[StoppedRow]


# Error words of OutRow.error. The first four are PROTOCOL.md's; the rest are
# detokd's documented extensions (docs/protocol.md).
UNKNOWN_RID = "unknown_rid"
EVICTED = "evicted"
SEQUENCE_GAP = "sequence_gap"
BAD_IDS = "bad_ids"
BAD_ROW = "bad_row"  # the row did not match the schema (wrong type, missing rid...)
BAD_START = "bad_start"  # start names a worker detokd has no address for
WORKER_STALLED = "worker_stalled"  # an earlier message for this rid could not be queued
INTERNAL = "internal"  # an unexpected failure while decoding this rid; the rest go on

ERRORS = (UNKNOWN_RID, EVICTED, SEQUENCE_GAP, BAD_IDS, BAD_ROW, BAD_START, WORKER_STALLED, INTERNAL)

_inbound = msgspec.msgpack.Decoder(Inbound)


class _LooseTokens(Struct):
    type: str
    rows: list[Raw]


_loose_tokens = msgspec.msgpack.Decoder(_LooseTokens)
_row = msgspec.msgpack.Decoder(Row)
_rid_only = msgspec.msgpack.Decoder(dict[str, Raw])
_str = msgspec.msgpack.Decoder(str)
_encoder = msgspec.msgpack.Encoder()

decode_inbound = _inbound.decode
encode = _encoder.encode
DecodeError = msgspec.DecodeError  # ValidationError is a subclass


def salvage_rows(frame: bytes) -> tuple[list[Row], list[str]] | None:
    """Per-row decode of a `tokens` frame that failed as a whole.

    One malformed row must not sink the rows of every other request in the batch:
    returns the rows that decode, and the rids of those that do not but still name
    one (they get a `bad_row` error). None when the frame is not a tokens batch.
    """
    try:
        loose = _loose_tokens.decode(frame)
    except DecodeError:
        return None
    if loose.type != "tokens":
        return None
    good: list[Row] = []
    bad: list[str] = []
    for raw in loose.rows:
        try:
            good.append(_row.decode(raw))
        except DecodeError:
            rid = _rid_of(raw)
            if rid is not None:
                bad.append(rid)
    return good, bad


def _rid_of(raw: Raw) -> str | None:
    try:
        return _str.decode(_rid_only.decode(raw)["rid"])
    except (DecodeError, KeyError):
        return None
