"""The soak's tokenizer worker: how every request ended, and the checked texts."""

from __future__ import annotations

import collections
from enum import IntEnum

import msgspec
import zmq

from detokd.wire.native import Text

from ..sink import Sink


class Ending(IntEnum):
    NONE = 0  # no ending row (yet)
    FINISHED = 1  # a finish row whose n_ids is the request's length
    WRONG_END = 2  # a finish row with another n_ids
    EVICTED = 3
    OTHER_ERROR = 4


class Worker(Sink):
    """PULLs every worker address and records each request's ending as it comes: one
    byte per request number (rid "s<n>"), so a million requests cost a megabyte here;
    keeps the whole text of the watched rids only."""

    _decode = msgspec.msgpack.Decoder(Text).decode

    def __init__(self, ctx: zmq.Context, addresses: list[str], lengths, fates) -> None:
        self.lengths, self.fates = lengths, fates
        self.ended = bytearray(len(lengths))
        self.rows = 0
        self.messages = 0
        self.duplicate_endings = 0
        self.texts: dict[str, list[str]] = {}  # watched rids only
        self.errors: dict[str, int] = {}
        super().__init__(ctx, addresses, rcvhwm=100_000)

    def watch(self, rid: str) -> None:
        with self.cond:
            self.texts[rid] = []

    def read(self, frame: bytes) -> list:
        return self._decode(frame).rows

    def keep(self, rows: list) -> None:
        self.messages += 1
        self.rows += len(rows)
        for r in rows:
            t = self.texts.get(r.rid)
            if r.error is None and r.finish is None:
                if t is not None:
                    t.append(r.text)
                continue
            self._end(r)
            if r.error is None and t is not None:
                t.append(r.text)

    def _end(self, r) -> None:
        i = int(r.rid[1:])
        if self.ended[i]:
            self.duplicate_endings += 1
        if r.error is not None:
            self.errors[r.error] = self.errors.get(r.error, 0) + 1
            self.ended[i] = Ending.EVICTED if r.error == "evicted" else Ending.OTHER_ERROR
        else:
            self.ended[i] = Ending.FINISHED if r.n_ids == self.lengths[i] else Ending.WRONG_END

    def endings(self, made: int) -> collections.Counter:
        """(fate, Ending) -> requests, over the first `made` requests."""
        with self.cond:
            return collections.Counter(zip(self.fates[:made], map(Ending, self.ended[:made])))
