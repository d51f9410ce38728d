"""The SGLang dialect: SGLang 0.5.23's detokenizer IPC over the shared core.

SGLang's scheduler PUSHes BatchTokenIDOutput (column lists, one entry per request of the
step) and the detokenizer answers each with one BatchStrOutput to the TokenizerManager,
or, with several HTTP workers, one sub-batch to each worker the rows name. This module
turns a batch into the core's rows and the core's output rows back into BatchStrOutput;
detokd.sglang.schema holds the messages (both of SGLang's encodings: pickle, and msgpack
with every field the detokenizer only copies forwarded as raw bytes).

SGLang's rows carry no start or seq. A rid the table does not hold starts a request: its
first row's decode_ids are the prompt context (decode_ids[:read_offset], at most five
prompt ids) followed by every output id so far (completion_tokens of them), as SGLang's
scheduler builds them. A rid detokd ended itself (a tombstone: evicted, say) instead gets
an abort finish reason, which SGLang's TokenizerManager turns into an error for the
client (SGLang's own detokenizer raised and died there, #2812); so does a later row of a
request this process never saw (fewer output ids than completion_tokens: it began before
a restart), which is never decoded without its context.

SGLang's scheduler matches stop strings itself and withholds a row while the text could
begin one (missing a prefix beside a split character: the core's engine-stop trim finds
those in the text already sent); trims on finish are SGLang's rules (the matched stop
token is dropped unless no_stop_trim or a tool-call closing token). Where detokd differs
from SGLang on purpose, docs/sglang.md says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar, cast

import msgspec

from .. import logs
from ..core.bounded import BoundedMap
from ..core.outbox import Produced
from ..core.records import BAD_ROW, RESTARTED, UNKNOWN_RID, WORKER_STALLED, Finish, OutRow, Row, Start
from ..output import Output, WorkerOut
from . import schema
from .http_workers import HttpWorkerAddresses
from .id_rows import in_vocabulary

if TYPE_CHECKING:
    from ..core.api import Core
    from ..core.stats import Stats
    from ..delivery import Delivery
    from ..gc_policy import GcPolicy
    from .types import ConfigureLoggingReq, EmbeddingBatch, FreezeGCReq, RoutedBatch, TokenBatch

log = logs.get(__name__)
_R = TypeVar("_R")  # what _subsets carries along with each row of a sub-batch

GPT_OSS_CALL = 200012  # <|call|>: a stop token SGLang keeps with the gpt-oss tool parser
# Addresses refused as HTTP workers, remembered so each is judged once (http_workers.py):
# at most this many, and their bytes (a longer one is judged again, by its form alone).
REFUSED_MAX = 4096
REFUSED_BYTES = 1 << 20


# A row's meta is its position in the batch, as opaque bytes like every meta (the core
# neither reads nor sizes it differently); rows detokd sends on its own (an eviction
# notice, a collision's notice to the other worker, error rows owed after a stall)
# carry nil there. The position is what tells those apart from the batch's own rows,
# which the core answers in order but not one for one (an eviction notice, a
# collision's two rows, none for a rid beyond max_rid_len).
_position = msgspec.msgpack.Decoder(int | None).decode


def grown(positions: list[msgspec.Raw], n: int) -> list[msgspec.Raw]:
    """`positions` holding the meta of each position below `n`, each made once (a plain
    list: the quick path indexes it, and only an exact list's indexing is specialised)."""
    while len(positions) < n:
        positions.append(msgspec.Raw(msgspec.msgpack.encode(len(positions))))
    return positions


def _io():
    """SGLang's io_struct: its own encoder and decoder, for the multi-worker split."""
    from sglang.srt.managers import io_struct

    return io_struct


def abort_reason(error: str, cause: str | None = None) -> dict:
    """The finish reason of a row detokd could not decode: an abort, as SGLang's
    FINISH_ABORT.to_json() spells it, so the client gets an error, not silence."""
    message = f"detokd: {error}" if cause is None else f"detokd: {error} ({cause})"
    return {"type": "abort", "message": message, "status_code": 500, "err_type": "InternalServerError"}


# Per-row fields the TokenizerManager indexes for every rid of a BatchStrOutput,
# whatever the request asked for; an abort answer fills them with empty values.
_COUNTS = ("prompt_tokens", "completion_tokens", "reasoning_tokens", "cached_tokens", "retraction_counts")


def aborted_output(rids: list[str], ipcs: list[str | None] | None, reasons: list[dict]) -> Any:
    """A BatchStrOutput that aborts each of `rids`, built from nothing else the engine
    sent: what answers a batch whose own values cannot be read or sent on. Every field
    the TokenizerManager reads per row holds an empty value, every other one None."""
    from array import array

    cls = _io().BatchStrOutput
    n = len(rids)
    values: dict[str, Any] = {"rids": rids, "http_worker_ipcs": ipcs, "finished_reasons": reasons,
                              "output_strs": [""] * n, "output_ids": [array("q")] * n}
    values.update((name, [0] * n) for name in _COUNTS)
    return cls(**{name: values.get(name) for name in schema.field_names(cls)})


def _strings(values: Any) -> bool:
    """Whether `values` is a list of strings: one C loop (join), not a Python one per row."""
    if type(values) is not list:
        return False
    try:
        "".join(values)
    except TypeError:
        return False
    return True


def cause_of(exc: BaseException) -> str:
    """An exception as the abort message quotes it: short, whatever the peer put in it."""
    return f"{type(exc).__name__}: {exc}"[:200]


class SglangDialect:
    """SGLang's messages in, by type (`handlers`); each BatchTokenIDOutput's answer out,
    built from what the core returns for it. Nothing of one frame stays here for the
    next: the batch in hand, its texts and why it is aborted are the handler's locals."""

    name = "sglang"

    def __init__(
        self,
        core: Core,
        delivery: Delivery,
        gc_policy: GcPolicy,
        stats: Stats,
        *,
        ipc: schema.MsgpackCodec | schema.PickleCodec,
        vocab_size: int,
        http_workers: int = 1,
        own_addresses: frozenset[str] = frozenset(),
        keep_stop_ids: frozenset[int] = frozenset(),
        falsy_no_match: bool = False,
        split: Any = None,
        restarted: bool = False,
    ) -> None:
        self.core = core
        self.delivery = delivery  # only to connect the HTTP workers the batches name
        self.gc_policy = gc_policy
        self.stats = stats
        self.ipc = ipc
        self.vocab_size = vocab_size
        self.http_workers = http_workers > 1  # tokenizer_worker_num > 1: route rows by http_worker_ipcs
        # Which addresses a row may name as its HTTP worker: SGLang's workers', twice
        # tokenizer_worker_num at once at most, none of SGLang's own (own_addresses).
        self.addresses = HttpWorkerAddresses(2 * http_workers, own_addresses)
        self.refused: BoundedMap[str, str] = BoundedMap(REFUSED_MAX, REFUSED_BYTES, lambda a, why: len(a) + 100)
        self.keep_stop_ids = keep_stop_ids  # stop tokens SGLang never trims (tool-call closers)
        # The release's trim test (detokd.sglang.release): `if not matched` trims nothing
        # for a matched 0 or "" (0.5.20 and older), `is None` trims them.
        self.falsy_no_match = falsy_no_match
        # The release's split of a batch for one HTTP worker (release.Split); the
        # installed release's if not given.
        self.split = split
        # What a later row of a request this process never saw is answered: its process
        # died and this one took its place (restarted), or no one knows why.
        self.unseen = RESTARTED if restarted else UNKNOWN_RID
        self.worker_of: dict[str, int] = {}  # http worker ipc name -> delivery's worker index
        self.replaced = 0  # dead HTTP workers whose place went to a new one
        self.positions: list[msgspec.Raw] = []  # each position's meta, up to the largest batch within max_rows
        self.beam_warned = False
        by_name: dict[str, Callable[[Any, bytes], Output | None]] = {
            "BatchTokenIDOutput": self.tokens,
            "BatchEmbeddingOutput": self.embeddings,
            "FreezeGCReq": self._freeze_gc,
            "ConfigureLoggingReq": self._configure_logging,
        }
        # The decoded type -> its handler.
        self.handlers: dict[type, Callable[[Any, bytes], Output | None]] = {
            cls: by_name[name] for cls, name in ipc.classes.items()
        }

    # --- inbound ------------------------------------------------------------------------

    def handle(self, frame: bytes) -> Output | None:
        try:
            msg = self.ipc.decode(frame)
        except Exception as exc:  # a frame of another schema, or not SGLang's at all
            batch = self.ipc.unread_batch(frame, self.core.limits.rows)
            if batch is not None and self._answerable(batch):  # its rids read: each of its requests is answered
                return self._unreadable(batch, exc)
            self.stats.bad_frames += 1
            log.warning("bad frame (%d bytes): %s", len(frame), cause_of(exc))
            return None
        handler = self.handlers.get(type(msg))
        if handler is None:
            self.stats.bad_frames += 1
            log.warning("%s is not a message for the detokenizer; ignored", type(msg).__name__)
            return None
        return handler(msg, frame)

    def _freeze_gc(self, msg: FreezeGCReq, frame: bytes) -> Output:
        self.gc_policy.freeze()
        return Output()

    def _configure_logging(self, msg: ConfigureLoggingReq, frame: bytes) -> Output:
        if msg.log_level is not None:
            logging.getLogger().setLevel(msg.log_level.upper())
        return Output()

    def tokens(self, batch: TokenBatch, frame: bytes) -> Output:
        """One scheduler step: each request's new ids become one core row (or a quick
        row's text), and what the core returns the step's answer."""
        if not self._answerable(batch):
            self.stats.bad_frames += 1
            return Output()
        try:
            if not self.beam_warned and schema.has_beam_search(batch):
                self.beam_warned = True
                log.error(
                    "a batch carries beam-search results, which detokd does not decode: they pass through as they are"
                )
            ids = self.ipc.ids(batch)
            if self._quick_fits(batch, ids):
                texts, produced = self._quick(batch, ids)
                return self._answer(batch, produced, texts)
            rows = self._rows(batch, ids)
        except Exception as exc:
            return self._unreadable(batch, exc)
        return self._answer(batch, self.core.tokens(rows, ids_at_most=len(frame)))

    def _answerable(self, batch: RoutedBatch) -> bool:
        """Whether a batch's rids (and HTTP workers) can be answered at all: at most
        max_rows of them, checked before anything is sized by them, and strings (a
        pickle can hold any value; msgpack's decoder has checked them). A batch that is
        not is dropped whole, logged."""
        rids, most = batch.rids, self.core.limits.rows
        if rids is None:
            return True
        checked = self.ipc.name == "msgpack"
        if not checked and not _strings(rids):
            why = "its rids are not a list of strings"
        elif len(rids) > most:
            why = f"{len(rids)} rows, more than max_rows = {most}"
        elif not checked and self.http_workers and not _strings(
            [i for i in batch.http_worker_ipcs or () if i is not None]
        ):
            why = "its http_worker_ipcs are not strings"
        else:
            return True
        log.error("a batch cannot be answered (%s): dropped, its requests get no answer", why)
        return False

    def _unreadable(self, batch: RoutedBatch, exc: Exception) -> Output:
        """A batch that does not read as the schema says (a field of another type): each
        of its requests fails with an abort naming the cause, never a success without
        its text; their later rows are aborted too (the core's tombstones)."""
        cause = cause_of(exc)
        log.error("a batch of %d requests cannot be read (%s); each of them is aborted", len(batch.rids or []), cause)
        ipcs = batch.http_worker_ipcs or []
        positions = grown(self.positions, len(batch.rids or []))
        replaced = self.replaced
        failing = []
        worker: int | None  # None: a row of no HTTP worker, skipped
        for i, rid in enumerate(batch.rids or []):
            worker = 0
            if self.http_workers:
                worker = self._worker(ipcs[i] if i < len(ipcs) else None)
                if worker is None:
                    continue
            failing.append((i, rid, worker))
        if self.replaced != replaced:
            failing = [(i, rid, w) for i, rid, w in failing if self._still_placed(ipcs[i])]
        for i, rid, worker in failing:
            self.core.fail(rid, worker, BAD_ROW, positions[i])
        # With a cause, _answer reads only the batch's rids and HTTP workers.
        return self._answer(cast("TokenBatch", batch), self.core.take(), cause=cause)

    def _rows(self, batch: TokenBatch, id_rows: list[list[int]]) -> list[Row]:
        rids = batch.rids or []
        ipcs = batch.http_worker_ipcs
        rows = []
        grown(self.positions, len(rids))
        counts = _Counts(self.ipc, batch)
        replaced = self.replaced
        worker: int | None  # None: a row of no HTTP worker, skipped
        # Strict: decode_ids of another length than rids is a batch that does not read as
        # the schema says (`tokens` aborts it), not one whose surplus rows go unanswered.
        for i, (rid, ids) in enumerate(zip(rids, id_rows, strict=True)):
            worker = 0
            if self.http_workers:
                worker = self._worker(ipcs[i] if ipcs else None)
                if worker is None:
                    continue
            rows.append(self._row(batch, i, rid, ids, worker, counts))
        if self.replaced != replaced and ipcs:
            rows = [row for row in rows if self._still_placed(ipcs[_position(row.meta) or 0])]
        return rows

    def _row(self, batch: TokenBatch, i: int, rid: str, ids: list[int], worker: int, counts: _Counts) -> Row:
        """Row i of the batch as the core's row: a live request's next ids, the start of a
        new one (its ids begin with the prompt context), or a row the core answers with an
        error (its request ended here, or began before this process)."""
        vocab_size = self.vocab_size
        sent = len(ids)  # as the scheduler sent them: a stop token's trim comes next
        if ids and (max(ids) >= vocab_size or min(ids) < 0):
            ids = self._clamp(ids)
        finish = None
        reason = batch.finished_reasons[i]
        if reason is not None:
            finish, trim = self._finish(reason, ids, batch.no_stop_trim[i])
            if trim:
                ids = ids[:-1]
        meta = self.positions[i]
        seq = self.core.seq_of(rid)
        if seq is not None:
            return Row(rid, ids, seq, None, finish, meta)
        if self.core.ended(rid):
            return Row(rid, ids, 0, None, finish, meta)  # answered with its error
        context = batch.read_offsets[i]
        if sent - context < counts[i]:  # not every output id so far: not the request's first row
            self.core.end(rid, worker, self.unseen)
            return Row(rid, ids, 0, None, finish, meta)  # answered with that error
        start = Start(
            worker=worker,
            prompt_tail=ids[:context],
            skip_special_tokens=batch.skip_special_tokens[i],
            spaces_between_special_tokens=batch.spaces_between_special_tokens[i],
            no_stop_trim=batch.no_stop_trim[i],
        )
        return Row(rid, ids[context:], 0, start, finish, meta)

    # --- the quick path ---------------------------------------------------------------
    #
    # Most rows of a step are a live streaming request's next ids, which the core answers
    # by position (Detokenizer.quick, its own fast path): their text goes straight into
    # the batch's output_strs, with no Row or OutRow and no round trip of the position.
    # Every other row (a start, a finish, an id outside the vocabulary) goes to the core
    # as before, in order, once the batch is read; only a start can change another row's
    # request (it may evict one), so the rows gathered up to a start go to the core
    # before the next quick row. (A batch naming a rid twice: a later quick row cannot
    # overtake an earlier row of its rid unnoticed, the core sees its seq gap.)

    def _quick_fits(self, batch: TokenBatch, ids: list[list[int]]) -> bool:
        """Whether the quick path may take this batch: one TokenizerManager (several get
        sub-batches, built from the core's rows), and a batch the core would take whole."""
        return (not self.http_workers and len(batch.rids or []) == len(ids)
                and self.core.takes_whole(len(ids), sum(map(len, ids))))

    def _quick(self, batch: TokenBatch, id_rows: list[list[int]]) -> tuple[list[str], Produced]:
        """The batch's output_strs (a core row's is "" here: its OutRow has the text) and
        what the core produced for the rest."""
        core = self.core
        quick = core.quick
        rids = batch.rids or []
        reasons = batch.finished_reasons
        n = len(rids)
        positions = grown(self.positions, n)
        in_vocab = in_vocabulary(id_rows, self.vocab_size)
        counts = _Counts(self.ipc, batch)
        texts: list[str] = []
        produced: Produced | None = None
        pending: list[Row] = []
        start = False  # whether pending holds a start
        i = 0
        while i < n:
            if reasons[i] is None:
                if start:  # a start may evict a request of a later row: the core goes first
                    produced = _joined(produced, core.tokens(pending, ids_at_most=0))
                    pending, start = [], False
                got = quick(rids, id_rows, reasons, positions, i, in_vocab)
                if texts:
                    texts += got
                else:
                    texts = got
                i += len(got)
                if i == n:
                    break
            row = self._row(batch, i, rids[i], id_rows[i], 0, counts)
            pending.append(row)
            texts.append("")
            start = start or row.start is not None
            i += 1
        # 0: takes_whole checked the frame's id budget
        return texts, _joined(produced, core.tokens(pending, ids_at_most=0) if pending else core.take())

    def _finish(self, reason: dict | None, ids: list[int], no_stop_trim: bool) -> tuple[Finish | None, bool]:
        """The core's Finish for SGLang's finish reason, and whether to drop the row's
        last id first: SGLang's stop-token trim, which takes the last id to be the
        matched one. A matched string is the core's engine-stop trim; nothing else is
        trimmed (a list of stop ids: SGLang does not trim those either)."""
        if reason is None:
            return None, False
        kind = str(reason.get("type", "abort"))
        matched = reason.get("matched")
        if self.falsy_no_match and not matched:
            matched = None
        if type(matched) is int:
            keep = no_stop_trim or not ids or ids[-1] in self.keep_stop_ids
            return Finish(kind), not keep
        return Finish(kind, matched if type(matched) is str else None), False

    def _clamp(self, ids: list[int]) -> list[int]:
        """SGLang decodes an id outside the vocabulary as id 0 (multimodal placeholders);
        so does detokd, counted."""
        vocab_size = self.vocab_size
        out = [i if 0 <= i < vocab_size else 0 for i in ids]
        self.stats.clamped_ids += sum(1 for a, b in zip(ids, out, strict=True) if a != b)
        return out

    def _worker(self, ipc: str | None) -> int | None:
        """The delivery index of the HTTP worker a row names, or None: a bad_row, skipped
        (there is nobody to answer it to)."""
        w = self.worker_of.get(ipc) if ipc is not None else None
        if w is not None:
            return w
        if ipc is None:
            why = "it names no http worker ipc"
        else:
            refused = self.refused.get(ipc) or self._connect(ipc)
            if refused is None:
                return self.worker_of[ipc]
            why = f"its http worker ipc {ipc[:120]!r} is not one of SGLang's HTTP workers: {refused}"
        self.stats.error(BAD_ROW)
        log.warning("a row cannot be answered (%s); skipped", why)
        return None

    def _connect(self, ipc: str) -> str | None:
        """Judge an address no row named before (http_workers.py) and connect it if an
        HTTP worker of SGLang's listens there: None, or why not (remembered)."""
        why = self.addresses.refusal(ipc)
        if why is None:
            why = self._place(ipc)
        if why is not None:
            self.refused.put(ipc, why)
        return why

    def _place(self, ipc: str) -> str | None:
        """Connect `ipc`: as a new worker while fewer than `most` are, else in the place
        of one whose worker no longer listens (a dead worker's replacement). None, or
        why not."""
        if len(self.worker_of) < self.addresses.most:
            w = len(self.delivery.workers)
            if not self.delivery.connect_worker(w, ipc):
                return "ZMQ refuses the address"
            self.core.add_worker(w)
        else:
            gone = next((old for old in self.worker_of if self.addresses.gone(old) is not None), None)
            if gone is None:
                return f"{self.addresses.most} HTTP workers are connected and listening, twice tokenizer_worker_num"
            w = self.worker_of[gone]
            if not self.delivery.replace_worker(w, ipc):
                return "ZMQ refuses the address"
            del self.worker_of[gone]
            self.refused.put(gone, "its HTTP worker is gone")  # its requests' later rows are not the new one's
            self.replaced += 1
        self.worker_of[ipc] = w
        return None

    def _still_placed(self, ipc: str | None) -> bool:
        """Whether a row of a batch in hand still goes to the worker it was given: not
        when a later row of the batch gave that worker's place to a new HTTP worker (the
        core routes a request by its worker's index, which is now the new one's)."""
        if ipc in self.worker_of:
            return True
        self.stats.error(BAD_ROW)
        return False

    def embeddings(self, msg: EmbeddingBatch, frame: bytes) -> Output:
        """Not decoded: SGLang's detokenizer returns the message unchanged, so the frame
        as received is what it would send (to each worker its rows, with several)."""
        if not self.http_workers:
            return Output([WorkerOut(0, [frame], [], passthrough=True)])
        full = msg if self.ipc.name == "pickle" else _io().msgpack_decode(frame)
        return Output([WorkerOut(worker, [self._encode_object(out)], [], passthrough=True)
                       for worker, out in self._split(full, msg.http_worker_ipcs or [])])

    def stalled(self, out: WorkerOut) -> list[OutRow]:
        """`out` was lost to its worker (a full queue, a broken connection): the core
        fails the requests of its rows, and those of the quick path's rows it held
        (`carries`: the batch), which the core never saw as rows."""
        return self._fail(out.worker, list(out.rows), WORKER_STALLED, out.carries)

    def encode_loose(self, worker: int, rows: list[OutRow]) -> list[bytes]:
        """Rows of no batch in hand have no place in an answer (SGLang's rows are
        answered within their own batch): their requests' next rows are answered from
        their tombstones instead."""
        return []

    def _fail(self, worker: int, rows: list[OutRow], error: str, batch: Any) -> list[OutRow]:
        if batch is not None:
            core_rows = {_position(row.meta) for row in rows}
            seq_of = self.core.seq_of
            for i, rid in enumerate(batch.rids):
                if i not in core_rows:
                    rows.append(OutRow(rid, "", None, seq_of(rid) or 0))
        return self.core.stalled(worker, rows, error)

    # --- outbound -----------------------------------------------------------------------

    def _answer(
        self, batch: TokenBatch, produced: Produced, texts: list[str] | None = None, cause: str | None = None
    ) -> Output:
        """The answer to `batch`, for each worker its rows: from `texts`, the quick path's
        output_strs, and the core's rows placed by position; aborts throughout when the
        batch cannot be read (`cause`). With one TokenizerManager every batch is
        answered, an empty one too (its health check waits on that)."""
        shares = produced.rows
        if not self.http_workers and 0 not in shares:
            shares = {0: [], **shares}
        carries = batch if texts is not None and not self.http_workers else None
        blank = None  # the batch's BatchStrOutput with empty texts, for splitting per worker
        out = []
        for worker, rows in shares.items():
            # Rows of this batch, by position; a notice for a request of another batch (an
            # eviction) has none: its next row is answered from its tombstone instead.
            mine = [(i, row) for row in rows if (i := _position(row.meta)) is not None]
            if rows and not mine:
                frames = []
            elif cause is not None:
                frames = [self._aborts(batch, rows, cause)]
            else:
                try:
                    if self.http_workers:
                        frames, blank = self._sub_batches(batch, mine, blank)
                    else:
                        frames = [self._whole(batch, mine, texts)]
                except Exception as exc:  # a value the scheduler sent that SGLang's encoder refuses
                    cause = cause_of(exc)
                    log.error("the answer to a batch of %d requests cannot be encoded (%s); each of them is aborted",
                              len(batch.rids or []), cause)
                    self._fail(worker, list(rows), BAD_ROW, carries)
                    frames = [self._aborts(batch, rows, cause)]
                texts = None  # the quick path's texts are the first worker's
            out.append(WorkerOut(worker, frames, rows, carries))
        return Output(out)

    def _whole(self, batch: TokenBatch, mine: list[tuple[int, OutRow]], texts: list[str] | None) -> bytes:
        """The one BatchStrOutput answering the whole batch."""
        texts = texts or [""] * len(batch.rids or [])
        aborts = {}
        for i, row in mine:
            texts[i] = row.text
            if row.error is not None:
                aborts[i] = abort_reason(row.error)
        out = self.ipc.str_output(batch, texts)
        if aborts:
            out.finished_reasons = [aborts.get(i, r) for i, r in enumerate(out.finished_reasons)]
        return self.ipc.encode(out)

    def _sub_batches(self, batch: TokenBatch, mine: list[tuple[int, OutRow]], blank: Any) -> tuple[list[bytes], Any]:
        """One HTTP worker's rows of the batch, as SGLang splits a batch for it; and the
        blank answer they were split from, made once a batch."""
        if not mine:
            return [], blank
        if blank is None:
            blank = self.ipc.str_output(batch, [""] * len(batch.rids or []))
            blank = blank if self.ipc.name == "pickle" else _io().msgpack_decode(self.ipc.encode(blank))
        frames = []
        for sub, picked in self._subsets(blank, [i for i, _ in mine], [row for _, row in mine]):
            sub.output_strs = [row.text for row in picked]
            sub.finished_reasons = [
                abort_reason(row.error) if row.error is not None else r
                for row, r in zip(picked, sub.finished_reasons, strict=True)  # the split keeps each row's reason
            ]
            frames.append(self._encode_object(sub))
        return frames, blank

    def _aborts(self, batch: TokenBatch, rows: list[OutRow], cause: str) -> bytes:
        """The answer that aborts the requests of the batch's `rows` (with one HTTP
        worker: every request of the batch), each with its row's error word."""
        rids = batch.rids or []
        reasons: dict[int, dict] = {}
        for row in rows:
            i = _position(row.meta)
            if i is not None:  # a row of another batch's request is answered from its tombstone
                error = row.error or BAD_ROW
                reasons[i] = abort_reason(error, cause if error == BAD_ROW else None)
        if not self.http_workers:
            for i in range(len(rids)):
                reasons.setdefault(i, abort_reason(BAD_ROW, cause))
        order = sorted(reasons)
        ipcs = batch.http_worker_ipcs if self.http_workers else None  # (unchecked with one worker)
        picked = None if ipcs is None else [ipcs[i] if i < len(ipcs) else None for i in order]
        return self._encode_object(aborted_output([rids[i] for i in order], picked, [reasons[i] for i in order]))

    def _encode_object(self, obj: Any) -> bytes:
        """An SGLang message object, encoded as SGLang's sock_send would."""
        if self.ipc.name == "pickle":
            return self.ipc.encode(obj)
        return _io().msgpack_encode(obj)

    def _subsets(self, full: Any, indices: list[int], rows: list[_R]) -> Iterator[tuple[Any, list[_R]]]:
        """SGLang's own split of a batch into one worker's rows, as the release splits:
        one sub-batch, or one message per row (older releases, or where a field cannot
        be split, as its detokenizer falls back)."""
        if self.split is None:
            from .release import detect

            self.split = detect().split
        row_at = dict(zip(indices, rows, strict=True))
        for sub, held in self.split(full, indices):
            yield sub, [row_at[i] for i in held]

    def _split(self, full: Any, ipcs: list[str | None]) -> Iterator[tuple[int, Any]]:
        by_worker: dict[int, list[int]] = {}
        replaced = self.replaced
        for i, ipc in enumerate(ipcs):
            w = self._worker(ipc)
            if w is not None:
                by_worker.setdefault(w, []).append(i)
        if self.replaced != replaced:
            by_worker = {w: kept for w, indices in by_worker.items()
                         if (kept := [i for i in indices if self._still_placed(ipcs[i])])}
        for w, indices in by_worker.items():
            for sub, _ in self._subsets(full, indices, [None] * len(indices)):
                yield w, sub


class _Counts:
    """A batch's completion_tokens, read on the first look: only a row of a rid new to
    this process needs them (a start, most of the time), and in msgpack they are raw."""

    __slots__ = ("ipc", "batch", "values")

    def __init__(self, ipc: schema.MsgpackCodec | schema.PickleCodec, batch: TokenBatch) -> None:
        self.ipc, self.batch = ipc, batch
        self.values: list[int] | None = None

    def __getitem__(self, i: int) -> int:
        if self.values is None:
            self.values = self.ipc.completion_tokens(self.batch)
        return self.values[i]


def _joined(first: Produced | None, then: Produced) -> Produced:
    """What the core produced over several calls, in order."""
    if first is None:
        return then
    for worker, rows in then.rows.items():
        first.rows.setdefault(worker, []).extend(rows)
    first.stopped += then.stopped
    return first
