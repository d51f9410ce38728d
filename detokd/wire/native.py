"""The native dialect: docs/protocol.md v1 over ZMQ.

One ZMQ frame holds one MessagePack map; `type` tags the message. Unknown keys are
ignored and missing optional keys take their defaults, so older and newer peers
interoperate. v1's rows are the core's records (detokd.core.records) as they are;
this module adds the envelopes and the dispatch (one `match` over the tagged union). `meta` and embedding `data` stay
msgspec.Raw: they are copied into the output as the exact bytes that came in,
never decoded.
"""

from __future__ import annotations

import functools
import operator
import struct
from typing import TYPE_CHECKING, Annotated, Union

import msgspec
from msgspec import Meta, Raw, Struct

from .. import logs
from ..core.records import (  # noqa: F401 (v1's rows and error words, re-exported for peers)
    BAD_IDS,
    BAD_ROW,
    BAD_START,
    EVICTED,
    INTERNAL,
    NIL,
    OVERLOADED,
    RID_COLLISION,
    SEQUENCE_GAP,
    SHUTDOWN,
    TOO_LARGE,
    UNKNOWN_RID,
    WORKER_STALLED,
    Finish,
    OutRow,
    Row,
    Start,
    StoppedRow,
    Unread,
)
from ..output import Output, Registration, WorkerOut
from . import msgpack_scan

if TYPE_CHECKING:
    from ..config import Config
    from ..core.api import Core
    from ..core.detokenizer import Limits
    from ..core.outbox import Produced
    from ..core.stats import Stats
    from ..delivery import Delivery
    from ..gc_policy import GcPolicy

log = logs.get(__name__)


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


# Peers' strings that are no rid: an address (a unix socket path is at most 107 bytes,
# a tcp one a few dozen) and an op, bounded so a frame cannot make detokd log or keep
# megabytes of them; longer ones fail to decode (a bad frame).
MAX_ADDRESS = 1024
MAX_OP = 256


class Register(Struct, tag_field="type", tag="register"):
    worker: int
    address: Annotated[str, Meta(max_length=MAX_ADDRESS)]


class Control(Struct, tag_field="type", tag="control"):
    op: Annotated[str, Meta(max_length=MAX_OP)]


Inbound = Union[Tokens, Embeddings, Abort, Register, Control]


class Text(Struct, tag_field="type", tag="text"):
    rows: list[OutRow]


class Stopped(Struct, tag_field="type", tag="stopped"):
    rows: list[StoppedRow]


_inbound = msgspec.msgpack.Decoder(Inbound)


class _RidOnly(Struct):
    rid: str


_row = msgspec.msgpack.Decoder(Row)
_rid_only = msgspec.msgpack.Decoder(_RidOnly)  # every other field skipped, in C
_str = msgspec.msgpack.Decoder(str)
_encoder = msgspec.msgpack.Encoder()

decode_inbound = _inbound.decode
encode = _encoder.encode
DecodeError = msgspec.DecodeError  # ValidationError is a subclass


@functools.cache
def _capped(max_rows: int) -> tuple[type, type, type]:
    """Tokens, Embeddings and Abort with at most `max_rows` rows or rids, refused from the
    list's length header, before one element is read: 60 M empty rids fit in a 57 MiB
    abort, 3 s to decode alone. Subclasses of the messages above."""

    # The classes are built at run time (msgspec reads their annotations then), so mypy
    # sees variables where types go: valid-type is ignored on those lines.
    def many(name: str, base: type, field: str, item: type, tag: str) -> type:
        items = Annotated[list[item], Meta(max_length=max_rows)]  # type: ignore[valid-type]
        return msgspec.defstruct(name, [(field, items)], bases=(base,), tag=tag)

    return (many("CappedTokens", Tokens, "rows", Row, tag="tokens"),
            many("CappedEmbeddings", Embeddings, "rows", EmbeddingRow, tag="embeddings"),
            many("CappedAbort", Abort, "rids", str, tag="abort"))


@functools.cache
def capped(max_rows: int) -> msgspec.msgpack.Decoder:
    """The decoder of Inbound whose lists hold at most `max_rows` rows or rids."""
    tokens, embeddings, abort = _capped(max_rows)
    return msgspec.msgpack.Decoder(Union[tokens, embeddings, abort, Register, Control])


EMPTY = Raw(b"\x90")  # MessagePack's empty array: what a list left out reads as


class _StartSizes(Struct, gc=False):
    """A start as sizing reads it: its lists as their bytes."""

    prompt_tail: Raw = EMPTY
    stop: Raw = EMPTY


class _Sizes(Struct, gc=False):
    """A tokens row as sizing reads it: its lists as their bytes, every other key skipped."""

    ids: Raw = EMPTY
    start: Union[_StartSizes, None] = None


class SizedTokens(Struct, tag_field="type", tag="tokens", gc=False):
    """A tokens message as sizing reads it: no id a Python int yet."""

    rows: list[_Sizes]


@functools.cache
def sizing(max_rows: int) -> msgspec.msgpack.Decoder:
    """capped(max_rows)'s decoder, but for a tokens message, whose rows it reads only as
    the bytes of their lists (SizedTokens): enough to find the rows whose lists pass a
    cap before any item of them is decoded. Every other message comes out whole."""
    _, embeddings, abort = _capped(max_rows)
    rows = Annotated[list[_Sizes], Meta(max_length=max_rows)]
    sized = msgspec.defstruct("CappedSizedTokens", [("rows", rows)], bases=(SizedTokens,), tag="tokens")
    return msgspec.msgpack.Decoder(Union[sized, embeddings, abort, Register, Control])


_lead = struct.Struct("B").unpack_from  # a buffer's first byte, as a 1-tuple
_first = operator.itemgetter(0)


def array_lens(raws: list[Raw]) -> list[int]:
    """array_len of each. An array of at most 15 items has its length in its lead byte (a
    fixarray), read with no Python call of its own: ~80 ns an array, against ~400
    through array_len."""
    leads = map(_first, map(_lead, raws))
    return [b - 0x90 if 0x90 <= b <= 0x9F else array_len(raw) for b, raw in zip(leads, raws, strict=True)]


def array_len(raw: Raw | bytes) -> int:
    """How many items the array in these bytes holds, from its header; 0 when they are
    no array (the decode of its row then says what is wrong)."""
    buf = memoryview(raw)
    if not buf or not (0x90 <= buf[0] <= 0x9F or buf[0] in (0xDC, 0xDD)):
        return 0
    try:
        return msgpack_scan.header(buf, 0)[2]
    except msgpack_scan.Malformed:
        return 0


def start_over_caps(start: _StartSizes | None, limits: Limits) -> bool:
    """Whether a start's prompt_tail or stop list holds more items than its cap (their
    bytes bound how many they hold: an item is a byte or more)."""
    if start is None:
        return False
    tail, stop = start.prompt_tail, start.stop
    return ((len(tail) > limits.wire_prompt_tail and array_len(tail) > limits.wire_prompt_tail)
            or (len(stop) > limits.stop_strings and array_len(stop) > limits.stop_strings))


class _LooseTokens(Struct):
    type: str
    rows: list[Raw]


@functools.cache
def _loose(max_rows: int) -> msgspec.msgpack.Decoder:
    """A tokens frame's rows as raw bytes each, at most `max_rows` (from the length header)."""
    rows = Annotated[list[Raw], Meta(max_length=max_rows)]
    return msgspec.msgpack.Decoder(msgspec.defstruct("CappedLooseTokens", [("rows", rows)], bases=(_LooseTokens,)))


def salvage_rows(frame: bytes, limits: Limits, sizes: list[_Sizes] | None = None,
                 ) -> tuple[list[Row], list[str]] | None:
    """Per-row decode of a `tokens` frame that failed as a whole, or holds lists over a cap.

    One malformed row must not sink the rows of every other request in the batch:
    returns the rows that decode (read_rows: those over a cap with their lists unread),
    and the rids of those that do not but still name one (they get a `bad_row` error).
    A row nested too deep for the decoder is such a row: then the frame is split by
    msgpack_scan, which walks any depth. None when the frame is not a tokens batch, or
    has more than `limits.rows` rows (dropped whole, as a frame that decodes would be).
    `sizes`: the frame's rows as sizing read them, where it did.
    """
    rows: list[Raw] | list[bytes]
    try:
        raws = _loose(limits.rows).decode(frame)
        if raws.type != "tokens":
            return None
        rows = list(raws.rows)
    except DecodeError:
        return None
    except RecursionError:  # a value nested deeper than msgspec goes: walk the frame instead
        try:
            spans = _rows_of(frame, limits.rows)
        except (msgpack_scan.Malformed, DecodeError):
            return None
        if spans is None:
            return None
        rows = [frame[start:stop] for start, stop in spans]
    return read_rows(rows, limits, sizes)


class _StartUnread(Struct, gc=False):
    """A Start whose lists stay bytes."""

    worker: int = 0
    vid: int = 0
    prompt_tail: Raw = EMPTY
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: Raw = EMPTY
    no_stop_trim: bool = False
    stream: bool = True


class _RowUnread(Struct, gc=False):
    """A Row whose lists stay bytes."""

    rid: str
    ids: Raw = EMPTY
    seq: int = 0
    start: Union[_StartUnread, None] = None
    finish: Union[Finish, None] = None
    meta: Raw = NIL


_sizes = msgspec.msgpack.Decoder(_Sizes)
_row_unread = msgspec.msgpack.Decoder(_RowUnread)
_strs = msgspec.msgpack.Decoder(list[str])


def read_rows(raws: list[Raw] | list[bytes], limits: Limits,
              sizes: list[_Sizes] | None = None) -> tuple[list[Row], list[str]]:
    """Each row decoded alone: the rows that decode, and the rids of those that do not.

    A row of more than `max_row_ids` ids, whose ids take the rows before it past
    `max_frame_ids` (the core's budget, counted as it counts: over the rows it is
    handed), or whose start holds more than `max_wire_prompt_tail` ids or
    `max_stop_strings` stop strings, keeps its lists unread (Unread: only their
    lengths), and the core answers it too_large as it would have, whatever the lists
    hold: their items never become Python objects. `sizes`: each row as sizing read it,
    if known.
    """
    good: list[Row] = []
    bad: list[str] = []
    spent = 0
    for k, raw in enumerate(raws):
        size = sizes[k] if sizes is not None else _size_of(raw)
        n = array_len(size.ids) if size is not None else 0
        over = size is not None and (n > limits.row_ids or (n and spent + n > limits.frame_ids)
                                     or start_over_caps(size.start, limits))
        try:
            row = _read_unread(raw, n, limits) if over else _row.decode(raw)
        except (DecodeError, RecursionError):
            rid = _rid_of(raw)
            if rid is not None:
                bad.append(rid)
            continue
        spent += len(row.ids)
        good.append(row)
    return good, bad


def _size_of(raw: Raw | bytes) -> _Sizes | None:
    """A row as sizing reads it, or None when it does not read so (its decode fails too)."""
    try:
        return _sizes.decode(raw)
    except (DecodeError, RecursionError):
        return None


def _read_unread(raw: Raw | bytes, n: int, limits: Limits) -> Row:
    """A row over a cap, its ids and prompt_tail unread; its stop list too when it is
    over its cap (the core sums a stop list's characters when its length is within)."""
    u = _row_unread.decode(raw)
    start = u.start
    if start is None:
        return Row(u.rid, Unread(n), u.seq, None, u.finish, u.meta)
    stops = array_len(start.stop)
    stop = Unread(stops) if stops > limits.stop_strings else _strs.decode(start.stop)
    return Row(u.rid, Unread(n), u.seq, Start(
        start.worker, start.vid, Unread(array_len(start.prompt_tail)), start.skip_special_tokens,
        start.spaces_between_special_tokens, stop, start.no_stop_trim, start.stream), u.finish, u.meta)


def _rows_of(frame: bytes, max_rows: int) -> list[tuple[int, int]] | None:
    """Where each row of a tokens frame lies, or None when it is no tokens frame."""
    kind, rows = None, None
    for key_at, key_end, value_at, value_end in msgpack_scan.entries(frame, 0, 64):
        key = _str.decode(frame[key_at:key_end])
        if key == "type":
            kind = _str.decode(frame[value_at:value_end])
        elif key == "rows":
            rows = value_at
    if kind != "tokens" or rows is None:
        return None
    return msgpack_scan.items(frame, rows, max_rows)


def _rid_of(raw: bytes | Raw) -> str | None:
    """The rid a row that failed the schema names, or None. msgspec reads it; only a row
    nested too deep for msgspec is walked, in Python, which would take seconds over the
    rows of one large frame (65,536 rows of a thousand ids: 11 s)."""
    try:
        return _rid_only.decode(raw).rid
    except DecodeError:
        return None
    except RecursionError:
        pass
    buf = memoryview(raw)
    try:
        for key_at, key_end, value_at, value_end in msgpack_scan.entries(buf, 0, 64):
            if _str.decode(buf[key_at:key_end]) == "rid":
                return _str.decode(buf[value_at:value_end])
    except (msgpack_scan.Malformed, DecodeError):
        pass
    return None


def encode_text(rows: list[OutRow]) -> bytes:
    return encode(Text(rows))


def encode_stopped(rows: list[StoppedRow]) -> bytes:
    return encode(Stopped(rows))


# A frame of at most this many bytes is decoded whole, as it comes, whatever its lists:
# their items are at most ~3 MB of Python objects (an id is 36 bytes for 3 on the wire at
# worst), and sizing its rows first would cost a large batch (4,096 rows of one id,
# ~120 KB) a tenth more. A larger tokens frame is sized first.
WHOLE_FRAME_BYTES = 256 << 10


class NativeDialect:
    """Frames of PROTOCOL v1 in; the core's calls, and what they produced encoded, out."""

    name = "native"

    def __init__(self, core: Core, gc_policy: GcPolicy, stats: Stats) -> None:
        self.core = core
        self.gc_policy = gc_policy
        self.stats = stats
        limits = core.limits
        self.decode = capped(limits.rows).decode  # every list of rows within max_rows
        self.sizing = sizing(limits.rows).decode
        # Rows whose ids are no more bytes than this hold no more ids than either cap
        # allows (an id is a byte or more on the wire).
        self.within_caps = min(limits.row_ids, limits.frame_ids)

    encode_text = staticmethod(encode_text)  # a method: a test's dialect may refuse to encode

    @classmethod
    def make(cls, core: Core, delivery: Delivery, gc_policy: GcPolicy, stats: Stats, cfg: Config) -> NativeDialect:
        """The DialectFactory of `detokd serve`."""
        return cls(core, gc_policy, stats)

    def handle(self, frame: bytes) -> Output | None:
        """One inbound frame: decode it, do what it says, and return what it produced.
        A frame that does not decode is counted; the rows of a tokens frame that still
        decode go on. None when the frame held no message at all."""
        try:
            msg = self.decode(frame) if len(frame) <= WHOLE_FRAME_BYTES else self._decode_sized(frame)
        except Exception as exc:  # DecodeError; RecursionError for nesting deeper than msgspec goes
            msg = self._salvage(frame, exc)
            if msg is None:
                return None
        match msg:
            case Tokens(rows=rows):
                return self.encoded(self.core.tokens(rows, len(frame)))
            case Embeddings(rows=rows):
                return self.embeddings(rows)
            case Abort(rids=rids):
                self.core.abort(rids)
            case Register(worker=worker, address=address):
                return Output(register=Registration(worker, address))
            case Control(op=op):
                self.control(op)
        return Output()

    def _decode_sized(self, frame: bytes) -> Inbound:
        """A frame that could hold more items than a cap allows. Its rows' lists are
        sized first, as bytes (which bound their length) and then, if need be, counted
        from their headers: within the caps, the frame is decoded whole as any other;
        past them, row by row, each row over a cap with its lists unread (read_rows)."""
        msg = self.sizing(frame)
        if not isinstance(msg, SizedTokens):
            return msg
        limits, rows = self.core.limits, msg.rows
        over = any(start_over_caps(row.start, limits) for row in rows if row.start is not None)
        ids = [row.ids for row in rows]
        if not over and sum(map(len, ids)) > self.within_caps:
            counts = array_lens(ids)
            over = max(counts) > limits.row_ids or sum(counts) > limits.frame_ids
        return self._read_by_row(frame, rows) if over else self.decode(frame)

    def _read_by_row(self, frame: bytes, sizes: list[_Sizes]) -> Tokens:
        """A tokens frame with lists over a cap (`sizes`: its rows as sizing read them),
        its rows decoded one by one; a row that does not decode makes it a bad frame, as
        it would have whole."""
        salvaged = salvage_rows(frame, self.core.limits, sizes)
        if salvaged is None:  # sizing read it as a tokens frame of at most max_rows rows
            raise DecodeError("a tokens frame that sizing read cannot be read by row")
        rows, bad = salvaged
        if bad:
            self.stats.bad_frames += 1
            return self._answer_bad_rows(frame, rows, bad, "a row does not match the schema")
        return Tokens(rows)

    def _salvage(self, frame: bytes, exc: Exception) -> Tokens | None:
        """A frame that did not decode: counted; the rows of a tokens frame that still
        decode, as a Tokens message (the others answered bad_row), or None."""
        self.stats.bad_frames += 1
        salvaged = salvage_rows(frame, self.core.limits)
        if salvaged is None:
            log.warning("bad frame (%d bytes): %s", len(frame), exc)
            return None
        return self._answer_bad_rows(frame, *salvaged, exc)

    def _answer_bad_rows(self, frame: bytes, rows: list[Row], bad: list[str], why: object) -> Tokens:
        log.warning("tokens frame (%d bytes) with %d bad row(s), answered bad_row; %d good row(s) go on: %s",
                    len(frame), len(bad), len(rows), why)
        self.core.bad_rows(bad)
        return Tokens(rows)

    def encoded(self, produced: Produced, first: list[WorkerOut] | None = None) -> Output:
        """What the core produced, as each worker's `text` message and the `stopped` one."""
        workers = first or []
        for worker, rows in produced.rows.items():
            try:
                frame = self.encode_text(rows)
            except Exception as exc:  # a value a peer sent that cannot be sent on: those requests fail, not the process
                frame = self._unencodable(worker, rows, exc)
            workers.append(WorkerOut(worker, [frame], rows))
        stopped = produced.stopped
        if stopped:
            return Output(workers, encode_stopped(stopped), len(stopped))
        return Output(workers)

    def _unencodable(self, worker: int, rows: list[OutRow], exc: Exception) -> bytes:
        log.error("%d row(s) for worker %d cannot be encoded (%s: %.200s); their requests fail with internal",
                  len(rows), worker, type(exc).__name__, exc)
        return encode_text(self.core.stalled(worker, rows, INTERNAL))

    def stalled(self, out: WorkerOut) -> list[OutRow]:
        return self.core.stalled(out.worker, out.rows)  # every row of a message is the core's

    def encode_loose(self, worker: int, rows: list[OutRow]) -> list[bytes]:
        return [encode_text(rows)]

    def embeddings(self, rows: list[EmbeddingRow]) -> Output:
        """Not decoded: each worker gets its rows in one `embeddings` message. The caps
        of a tokens row hold: a rid beyond max_rid_len gets no row (it would be echoed to
        every worker), a meta beyond max_meta_bytes a `too_large` row, not the embedding."""
        core = self.core
        limits = core.limits
        by_worker: dict[int, list[EmbeddingRow]] = {}
        for row in rows:
            if len(row.rid) > limits.rid_len or len(row.meta) > limits.meta_bytes:
                core.too_large_embedding(row.rid, row.worker)
                continue
            by_worker.setdefault(row.worker, []).append(row)
        passed = []
        for worker, batch in by_worker.items():
            if not core.known(worker):
                self.stats.error(BAD_START)
                log.warning("embeddings for worker %d, which has no address: %d rows dropped", worker, len(batch))
                continue
            passed.append(WorkerOut(worker, [encode(Embeddings(batch))], [], passthrough=True))
        return self.encoded(core.take(), passed)

    def control(self, op: str) -> None:
        if op == "freeze_gc":
            self.gc_policy.freeze()
        elif op == "flush":
            log.info("flush: dropped %d request states", self.core.flush())
        else:
            log.warning("unknown control op %r ignored", op)
