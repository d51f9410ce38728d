"""The SGLang dialect: SGLang 0.5.23's detokenizer IPC over the shared core.

SGLang's scheduler PUSHes BatchTokenIDOutput (column lists, one entry per request of the
step) and the detokenizer answers each with one BatchStrOutput to the TokenizerManager,
or, with several HTTP workers, one sub-batch to each worker the rows name. This module
turns a batch into the core's rows and the core's output rows back into BatchStrOutput;
detokd.sglang.schema holds the messages (both of SGLang's encodings: pickle, and msgpack
with every field the detokenizer only copies forwarded as raw bytes).

SGLang's rows carry no start or seq. A rid the table does not hold starts a request: its
first row's decode_ids are the prompt context (decode_ids[:read_offset], at most five
prompt ids) followed by output ids, as SGLang's scheduler builds them. A rid detokd ended
itself (a tombstone: evicted, say) instead gets an abort finish reason, which SGLang's
TokenizerManager turns into an error for the client (SGLang's own detokenizer raised and
died there, #2812). SGLang's scheduler matches stop strings itself and withholds a row
while the text could begin one (missing a prefix beside a split character: the core's
engine-stop trim finds those in the text already sent); trims on finish are SGLang's
rules (the matched stop token is dropped unless no_stop_trim or a tool-call closing token). Where detokd
differs from SGLang on purpose, docs/sglang.md says so.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec

from ..core.records import BAD_ROW, WORKER_STALLED, Finish, OutRow, Row, Start, StoppedRow
from .. import logs
from . import schema
from .id_rows import in_vocabulary

if TYPE_CHECKING:
    from ..core.detokenizer import Detokenizer
    from ..delivery import Delivery
    from ..gc_policy import GcPolicy
    from ..core.stats import Stats

log = logs.get(__name__)

GPT_OSS_CALL = 200012  # <|call|>: a stop token SGLang keeps with the gpt-oss tool parser


# A row's meta is its position in the batch, as opaque bytes like every meta (the core
# neither reads nor sizes it differently); rows detokd sends on its own (an eviction
# notice) carry nil there.
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
    values = {"rids": rids, "http_worker_ipcs": ipcs, "finished_reasons": reasons,
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
    name = "sglang"

    def __init__(
        self,
        core: Detokenizer,
        delivery: Delivery,
        gc_policy: GcPolicy,
        stats: Stats,
        *,
        ipc: schema.MsgpackCodec | schema.PickleCodec,
        vocab_size: int,
        http_workers: bool = False,
        keep_stop_ids: frozenset[int] = frozenset(),
        falsy_no_match: bool = False,
        split: Any = None,
    ) -> None:
        self.core = core
        self.delivery = delivery
        self.gc_policy = gc_policy
        self.stats = stats
        self.ipc = ipc
        self.vocab_size = vocab_size
        self.http_workers = http_workers  # tokenizer_worker_num > 1: route rows by http_worker_ipcs
        self.keep_stop_ids = keep_stop_ids  # stop tokens SGLang never trims (tool-call closers)
        # The release's trim test (detokd.sglang.release): `if not matched` trims nothing
        # for a matched 0 or "" (0.5.20 and older), `is None` trims them.
        self.falsy_no_match = falsy_no_match
        # The release's split of a batch for one HTTP worker (release.Split); the
        # installed release's if not given.
        self.split = split
        self.worker_of: dict[str, int] = {}  # http worker ipc name -> delivery's worker index
        self.positions: list[msgspec.Raw] = []  # each position's meta, up to the largest batch within max_rows
        self.batch: Any = None  # the BatchTokenIDOutput being answered
        self.blank: Any = None  # its BatchStrOutput with empty texts, for splitting per worker
        self.cause: str | None = None  # why the batch in hand is answered with aborts, if it is
        self.texts: list[str] | None = None  # its output_strs so far: the quick path's rows
        self.quick_batch: Any = None  # the last batch the quick path answered
        self.beam_warned = False

    # --- inbound ------------------------------------------------------------------------

    def handle(self, frame: bytes) -> bool:
        try:
            msg = self.ipc.decode(frame)
        except Exception as exc:  # a frame of another schema, or not SGLang's at all
            batch = self.ipc.unread_batch(frame, self.core.limits.rows)
            if batch is not None and self._answerable(batch):  # its rids read: each of its requests is answered
                self._unreadable(batch, exc)
                return True
            self.stats.bad_frames += 1
            log.warning("bad frame (%d bytes): %s", len(frame), cause_of(exc))
            return False
        kind = schema.kind(msg)
        if kind == "BatchTokenIDOutput":
            self.tokens(msg, len(frame))
        elif kind == "BatchEmbeddingOutput":
            self.embeddings(msg, frame)
        elif kind == "FreezeGCReq":
            self.gc_policy.freeze()
        elif kind == "ConfigureLoggingReq":
            if msg.log_level is not None:
                logging.getLogger().setLevel(msg.log_level.upper())
        else:
            self.stats.bad_frames += 1
            log.warning("%s is not a message for the detokenizer; ignored", kind)
            return False
        return True

    def tokens(self, batch: Any, frame_bytes: int | None = None) -> None:
        """One scheduler step: each request's new ids become one core row."""
        if not self._answerable(batch):
            self.stats.bad_frames += 1
            return
        self._answering(batch)
        try:
            if not self.beam_warned and schema.has_beam_search(batch):
                self.beam_warned = True
                log.error("a batch carries beam-search results, which detokd does not decode: they pass through as they are")
            ids = self.ipc.ids(batch)
            if self._quick_fits(batch, ids):
                self._quick(batch, ids)
                return
            rows = self._rows(batch, ids)
        except Exception as exc:
            self._unreadable(batch, exc)
            return
        self.core.tokens(rows, ids_at_most=frame_bytes)

    def _answerable(self, batch: Any) -> bool:
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
        elif not checked and self.http_workers and not _strings([i for i in batch.http_worker_ipcs or () if i is not None]):
            why = "its http_worker_ipcs are not strings"
        else:
            return True
        log.error("a batch cannot be answered (%s): dropped, its requests get no answer", why)
        return False

    def _answering(self, batch: Any) -> None:
        self.batch, self.blank, self.cause, self.texts = batch, None, None, None
        if not self.http_workers:
            self.core.answer_batch(0)  # an empty batch still gets its (empty) answer

    def _unreadable(self, batch: Any, exc: Exception) -> None:
        """A batch that does not read as the schema says (a field of another type): each
        of its requests fails with an abort naming the cause, never a success without
        its text; their later rows are aborted too (the core's tombstones)."""
        self._answering(batch)
        self.cause = cause_of(exc)
        log.error("a batch of %d requests cannot be read (%s); each of them is aborted", len(batch.rids or []), self.cause)
        ipcs = batch.http_worker_ipcs or []
        positions = grown(self.positions, len(batch.rids or []))
        for i, rid in enumerate(batch.rids or []):
            worker = 0
            if self.http_workers:
                worker = self._worker(ipcs[i] if i < len(ipcs) else None)
                if worker is None:
                    continue
            self.core.fail(rid, worker, BAD_ROW, positions[i])

    def _rows(self, batch: Any, id_rows: list[list[int]]) -> list[Row]:
        rids = batch.rids or []
        ipcs = batch.http_worker_ipcs
        rows = []
        grown(self.positions, len(rids))
        for i, (rid, ids) in enumerate(zip(rids, id_rows)):
            worker = 0
            if self.http_workers:
                worker = self._worker(ipcs[i] if ipcs else None)
                if worker is None:
                    continue
            rows.append(self._row(batch, i, rid, ids, worker))
        return rows

    def _row(self, batch: Any, i: int, rid: str, ids: list[int], worker: int) -> Row:
        """Row i of the batch as the core's row: a live request's next ids, or the start
        of a new one (its ids begin with the prompt context)."""
        vocab_size = self.vocab_size
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

    def _quick_fits(self, batch: Any, ids: list[list[int]]) -> bool:
        """Whether the quick path may take this batch: one TokenizerManager (several get
        sub-batches, built from the core's rows), and a batch the core would take whole."""
        return (not self.http_workers and len(batch.rids or []) == len(ids)
                and self.core.takes_whole(len(ids), sum(map(len, ids))))

    def _quick(self, batch: Any, id_rows: list[list[int]]) -> None:
        core = self.core
        quick = core.quick
        rids = batch.rids
        reasons = batch.finished_reasons
        n = len(rids)
        positions = grown(self.positions, n)
        texts = [""] * n
        in_vocab = in_vocabulary(id_rows, self.vocab_size)
        pending: list[Row] = []
        start = False  # whether pending holds a start
        i = 0
        while i < n:
            if reasons[i] is None:
                if start:  # a start may evict a request of a later row: the core goes first
                    core.tokens(pending, ids_at_most=0)
                    pending, start = [], False
                i = quick(rids, id_rows, reasons, positions, texts, i, in_vocab)
                if i == n:
                    break
            row = self._row(batch, i, rids[i], id_rows[i], 0)
            pending.append(row)
            start = start or row.start is not None
            i += 1
        if pending:
            core.tokens(pending, ids_at_most=0)  # 0: takes_whole checked the frame's id budget
        self.texts, self.quick_batch = texts, batch

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
        self.stats.clamped_ids += sum(1 for a, b in zip(ids, out) if a != b)
        return out

    def _worker(self, ipc: str | None) -> int | None:
        w = self.worker_of.get(ipc) if ipc is not None else None
        if w is not None:
            return w
        if ipc is None:
            self.stats.error(BAD_ROW)
            log.warning("a row names no http worker ipc: it cannot be answered and is skipped")
            return None
        # SGLang's scheduler names the HTTP worker of each row, as its own detokenizer
        # trusts it to: a destination of the engine's, not a peer's `register`.
        w = len(self.delivery.workers)
        if not self.delivery.connect_worker(w, ipc):
            return None
        self.worker_of[ipc] = w
        return w

    def embeddings(self, msg: Any, frame: bytes) -> None:
        """Not decoded: SGLang's detokenizer returns the message unchanged, so the frame
        as received is what it would send (to each worker its rows, with several)."""
        if not self.http_workers:
            self.delivery.send(0, frame)
            return
        full = msg if self.ipc.name == "pickle" else _io().msgpack_decode(frame)
        for worker, out in self._split(full, msg.http_worker_ipcs or []):
            self.delivery.send(worker, self._encode_object(out))

    def stalled(self, worker: int, rows: list[OutRow]) -> list[OutRow]:
        """The message holding `rows` was lost to `worker`'s full queue (delivery's stall
        policy): the core fails their requests, and those of the quick path's rows the
        message held, which the core never saw as rows."""
        return self._fail(worker, rows, WORKER_STALLED)

    def unencodable(self, worker: int, rows: list[OutRow], exc: Exception) -> bytes | list[bytes]:
        """The answer holds a value SGLang's encoder refuses (a copied field the
        scheduler filled with something else): each request of it is aborted, in an
        answer that copies nothing from the batch but its rids."""
        self.cause = cause_of(exc)
        log.error("the answer to a batch of %d requests cannot be encoded (%s); each of them is aborted",
                  len(self.batch.rids or []), self.cause)
        self._fail(worker, list(rows), BAD_ROW)
        return self._aborts(rows)

    def _fail(self, worker: int, rows: list[OutRow], error: str) -> list[OutRow]:
        batch = self.batch
        if self.quick_batch is batch and not self.http_workers:
            core_rows = {_position(row.meta) for row in rows}
            seq_of = self.core.seq_of
            for i, rid in enumerate(batch.rids):
                if i not in core_rows:
                    rows.append(OutRow(rid, "", None, seq_of(rid) or 0))
        return self.core.stalled(worker, rows, error)

    # --- outbound -----------------------------------------------------------------------

    def encode_text(self, rows: list[OutRow]) -> bytes | list[bytes]:
        """The BatchStrOutput answering the batch in hand, for one worker's rows."""
        batch = self.batch
        # Rows of this batch, by position; a notice for a request of another batch (an
        # eviction, error rows owed after a stall) has none: its next row is answered
        # from its tombstone instead.
        mine = [(i, row) for row in rows if (i := _position(row.meta)) is not None]
        if rows and not mine:
            return []
        if self.cause is not None:
            return self._aborts(rows)
        if not self.http_workers:
            texts, self.texts = self.texts or [""] * len(batch.rids or []), None
            aborts = {}
            for i, row in mine:
                texts[i] = row.text
                if row.error is not None:
                    aborts[i] = abort_reason(row.error, self.cause if row.error == BAD_ROW else None)
            out = self.ipc.str_output(batch, texts)
            if aborts:
                out.finished_reasons = [aborts.get(i, r) for i, r in enumerate(out.finished_reasons)]
            return self.ipc.encode(out)
        if not mine:
            return []
        if self.blank is None:
            blank = self.ipc.str_output(batch, [""] * len(batch.rids))
            self.blank = blank if self.ipc.name == "pickle" else _io().msgpack_decode(self.ipc.encode(blank))
        frames = []
        for sub, picked in self._subsets(self.blank, [i for i, _ in mine], [row for _, row in mine]):
            sub.output_strs = [row.text for row in picked]
            sub.finished_reasons = [
                abort_reason(row.error, self.cause if row.error == BAD_ROW else None) if row.error is not None else r
                for row, r in zip(picked, sub.finished_reasons)
            ]
            frames.append(self._encode_object(sub))
        return frames

    def _aborts(self, rows: list[OutRow]) -> bytes:
        """The answer that aborts the requests of this batch's `rows` (with one HTTP
        worker: every request of the batch), each with its row's error word."""
        batch = self.batch
        rids = batch.rids or []
        reasons: dict[int, dict] = {}
        for row in rows:
            i = _position(row.meta)
            if i is not None:  # a row of another batch's request is answered from its tombstone
                error = row.error or BAD_ROW
                reasons[i] = abort_reason(error, self.cause if error == BAD_ROW else None)
        if not self.http_workers:
            for i in range(len(rids)):
                reasons.setdefault(i, abort_reason(BAD_ROW, self.cause))
        order = sorted(reasons)
        ipcs = batch.http_worker_ipcs if self.http_workers else None  # (unchecked with one worker)
        picked = None if ipcs is None else [ipcs[i] if i < len(ipcs) else None for i in order]
        return self._encode_object(aborted_output([rids[i] for i in order], picked, [reasons[i] for i in order]))

    def _encode_object(self, obj: Any) -> bytes:
        """An SGLang message object, encoded as SGLang's sock_send would."""
        if self.ipc.name == "pickle":
            return self.ipc.encode(obj)
        return _io().msgpack_encode(obj)

    def _subsets(self, full: Any, indices: list[int], rows: list[OutRow]):
        """SGLang's own split of a batch into one worker's rows, as the release splits:
        one sub-batch, or one message per row (older releases, or where a field cannot
        be split, as its detokenizer falls back)."""
        if self.split is None:
            from .release import detect

            self.split = detect().split
        row_at = dict(zip(indices, rows))
        for sub, held in self.split(full, indices):
            yield sub, [row_at[i] for i in held]

    def _split(self, full: Any, ipcs: list[str | None]):
        by_worker: dict[int, list[int]] = {}
        for i, ipc in enumerate(ipcs):
            w = self._worker(ipc)
            if w is not None:
                by_worker.setdefault(w, []).append(i)
        for w, indices in by_worker.items():
            for sub, _ in self._subsets(full, indices, [None] * len(indices)):
                yield w, sub

    @staticmethod
    def encode_stopped(rows: list[StoppedRow]) -> bytes:
        # SGLang sends no stop strings, so detokd never finds one of its own.
        raise AssertionError("the sglang dialect has no feedback socket")
