"""What every implementation decodes: the corpus' ids, streams over it, their frames.

Frames are `tokens` messages encoded before the timed run. All rows of one step share
`seq` (step x ids per row) and `meta` (step number, send time), so each step's frame is
encoded once with a placeholder in both and filled with one bytes.join (Template.fill:
no per-row work while timing). The ids repeat with the corpus (period P steps), so a run
of any length needs P templates, not one per step.
"""

from __future__ import annotations

import math
from typing import Callable

import msgspec

from detokd.client import shard_for
from detokd.tokenizer import load
from detokd.wire.native import Finish, Row, Start, Tokens, encode
from detokrig.corpus import TAIL, corpus


class Corpus:
    """The id sequence of the corpus for one tokenizer, and the stream starts: offsets
    into it (wrapping around) where no character is split across the prompt boundary."""

    def __init__(self, tokenizer: str) -> None:
        self.name = tokenizer
        self.vocab = load(tokenizer)
        fast = self.vocab.backend
        self.base = fast.encode(corpus(), add_special_tokens=False).ids
        # Stream starts where the previous ids decode with no broken character and the
        # next ones start a whole character: the prompt tail then means the same to
        # every implementation (no character split across the prompt boundary).
        self.starts: list[int] = []
        for p in range(len(self.base)):
            head = fast.decode(self.tail(p))
            nxt = fast.decode(self.ids(p, 0, 3))
            if "\ufffd" not in head and not nxt.startswith("\ufffd"):
                self.starts.append(p)
        if not self.starts:
            raise RuntimeError(f"no clean stream start in the corpus for {tokenizer}")
        self._ref_cache: dict[tuple, str] = {}

    def offset(self, i: int) -> int:
        return self.starts[(i * 7919 + 13) % len(self.starts)]

    def ids(self, off: int, start: int, count: int) -> list[int]:
        """`count` ids of the stream at `off` from its `start`th, the corpus read round and round."""
        base, a = self.base, off + start
        return [base[(a + j) % len(base)] for j in range(count)]

    def tail(self, off: int) -> list[int]:
        """The TAIL prompt ids before the stream at `off`."""
        return self.ids(off - TAIL, 0, TAIL)

    def reference(self, off: int, count: int) -> str:
        """The oracle's text of the first `count` ids of the stream at `off`."""
        key = (off, count)
        r = self._ref_cache.get(key)
        if r is None:
            r = self._ref_cache[key] = self.vocab.reference(self.tail(off), self.ids(off, 0, count))
        return r


# Placeholders of a template frame: a seq no scheduler sends (uint64, while ids and
# seqs stay far below) and a meta of 18 bytes no row holds otherwise.
_SEQ_HOLE = 2**64 - 1
_SEQ_BYTES = encode(_SEQ_HOLE)
_META_BYTES = encode(b"\xffdetokbench-meta\xff")
_META_HOLE = msgspec.Raw(_META_BYTES)


class Template:
    """One encoded frame with a step's `seq` and `meta` left open in every row.

    Within a row `seq` comes before `meta`, with the same bytes between them in every row
    of a step (`mid`: nothing, or the same `finish`), so the frame is cut at `seq + mid +
    meta` once, here. A start step's rows have no `seq` hole (seq 0, the default, is left
    out), only `meta` ones."""

    __slots__ = ("mid", "pieces")

    def __init__(self, frame: bytes) -> None:
        holes = frame.count(_META_BYTES)
        if _SEQ_BYTES not in frame:
            self.mid, self.pieces = None, frame.split(_META_BYTES)
            return
        a = frame.index(_SEQ_BYTES) + len(_SEQ_BYTES)
        self.mid = frame[a:frame.index(_META_BYTES, a)]
        self.pieces = frame.split(_SEQ_BYTES + self.mid + _META_BYTES)
        if len(self.pieces) != holes + 1 or frame.count(_SEQ_BYTES) != holes:
            raise ValueError("the rows of a step differ between seq and meta")

    def fill(self, seq: bytes, meta: bytes) -> bytes:
        """The frame with one step's encoded `seq` and `meta` in every row."""
        if self.mid is None:
            return meta.join(self.pieces)
        return (seq + self.mid + meta).join(self.pieces)


def step_values(seq: int, meta: tuple) -> tuple[bytes, bytes]:
    """The encoded `seq` and `meta` of one step, for Template.fill."""
    return encode(seq), encode(meta)


class Workload:
    """B streams, n ids per row per step, as ready-made template frames.

    Every stream starts at step 0 (a `start` row) and reads the corpus' ids from its
    own offset; `frames(shards)` splits the streams over detokd's shards as the
    scheduler client does (crc32 of the rid)."""

    def __init__(self, corp: Corpus, batch: int, n: int, tag: str) -> None:
        self.corp, self.batch, self.n = corp, batch, n
        self.rids = [f"{tag}-{i}" for i in range(batch)]
        self.offsets = [corp.offset(i) for i in range(batch)]
        L = len(corp.base)
        self.period = L // math.gcd(L, n)
        self._built: dict[int, dict] = {}

    def frames(self, shards: int) -> dict:
        """{"start": frames, "cyc": [frames] * period, "finish": frames}; frames is a
        list of (shard, Template), one entry per shard that has rows."""
        if shards in self._built:
            return self._built[shards]
        groups: list[list[int]] = [[] for _ in range(shards)]
        for i, rid in enumerate(self.rids):
            groups[shard_for(rid, shards)].append(i)
        groups_nz = [(s, g) for s, g in enumerate(groups) if g]
        n, corp, rids = self.n, self.corp, self.rids

        def step(row: Callable[[int], Row]) -> list[tuple[int, Template]]:
            return [(s, Template(encode(Tokens([row(i) for i in g])))) for s, g in groups_nz]

        starts = [Start(prompt_tail=corp.tail(off)) for off in self.offsets]
        length = Finish("length")
        b = self._built[shards] = {
            "start": step(lambda i: Row(rids[i], corp.ids(self.offsets[i], 0, n), 0, starts[i], None, _META_HOLE)),
            "finish": step(lambda i: Row(rids[i], [], _SEQ_HOLE, None, length, _META_HOLE)),
            "cyc": [step(lambda i, j=j: Row(rids[i], corp.ids(self.offsets[i], j * n, n), _SEQ_HOLE, None, None, _META_HOLE))
                    for j in range(self.period)],
        }
        return b

    def reference(self, i: int, rounds: list[int]) -> str:
        """Everything stream i's rid receives over rounds of these step counts."""
        return "".join(self.corp.reference(self.offsets[i], k * self.n) for k in rounds)
