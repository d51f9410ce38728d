"""Frames peers send detokd, shared by the tests and `detokbench fuzz`.

Honest id streams (`CORPUS`, `mixed_ids`) and hostile frames: `Hostile` (malformed
MessagePack, wrong shapes, hostile values) and `OverCaps` (frames beyond the caps of
docs/protocol.md "too_large", built from a Config's caps). Frames are encoded with
plain msgspec.msgpack on dicts, or bytes written by hand, independently of
detokd.wire, so they test detokd's decoding instead of sharing it.
"""

from __future__ import annotations

import random
from typing import Sequence

import msgspec

from detokd.wire.native import MAX_ADDRESS, MAX_OP

enc = msgspec.msgpack.encode

CORPUS = (
    "The quick brown fox jumps over the lazy dog. ",
    "数据库连接失败，请稍后重试。深度学习模型的推理速度",
    "こんにちは世界！カタカナとひらがな。",
    "Ünïcödé façade naïve café — “quotes” ‘and’ … ",
    "🙂🚀👩‍👩‍👧‍👦 emoji sequences 🇫🇷🇯🇵 ",
    "def f(x):\n    return x ** 2  # code\n\tindent ",
    "Привет, мир! Γειά σου Κόσμε. مرحبا بالعالم. שלום עולם ",
    "  leading spaces and\r\nCRLF\n\n",
)


def mixed_ids(rng: random.Random, n: int, pieces: Sequence[Sequence[int]], size: int, *,
              random_share: float = 0.15, max_run: int = 12) -> list[int]:
    """n output ids: runs of real multilingual text (1..max_run ids of a piece), and in
    `random_share` of the draws 1-3 random ids from the whole vocabulary (byte tokens
    that never complete, special tokens). `pieces`: a corpus (CORPUS) encoded by the
    tokenizer; `size`: its vocabulary size."""
    out: list[int] = []
    while len(out) < n:
        if rng.random() < random_share:
            out += [rng.randrange(size) for _ in range(rng.randint(1, 3))]
        else:
            p = rng.choice(pieces)
            a = rng.randrange(len(p))
            out += p[a : a + rng.randint(1, max_run)]
    return out[:n]


def _str8(b: bytes) -> bytes:
    """A MessagePack str holding these bytes as they are (UTF-8 or not)."""
    return (bytes([0xA0 | len(b)]) if len(b) < 32 else b"\xd9" + bytes([len(b)])) + b


def _map(*pairs: bytes) -> bytes:
    """A MessagePack map of these keys and values; an odd count leaves the last
    value for the caller to append."""
    return bytes([0x80 | (len(pairs) + 1) // 2]) + b"".join(pairs)


def _arr(*items: bytes) -> bytes:
    return bytes([0x90 | len(items)]) + b"".join(items)


def S(s: str) -> bytes:
    return _str8(s.encode())


class Hostile:
    """Malformed frames: `gens` holds (weight, generator) pairs, each generator giving
    (frame or multipart frames, bad). A `bad` frame detokd must count in
    detokd_bad_frames; the others are schema-valid but hostile (negative, huge,
    out-of-vocabulary ids, unknown workers and ops...: answered with error rows).
    Hostile rows only use rids starting with "x-", never a valid request's rid."""

    MAP_MARKERS = set(range(0x80, 0x90)) | {0xDE, 0xDF}

    def __init__(self, rng: random.Random, vocab_size: int) -> None:
        self.rng = rng
        self.vocab_size = vocab_size
        self.n = 0
        self.big_left = 6  # the expensive ones (hundreds of thousands of rows), a few times
        self.gens = [
            (8, self.random_bytes), (2, self.empty), (3, self.not_a_map), (3, self.no_type),
            (3, self.unknown_type), (4, self.wrong_shape), (6, self.bad_rows), (2, self.non_utf8),
            (3, self.truncated), (2, self.lying_header), (1, self.deep), (2, self.huge),
            (3, self.multipart), (4, self.bad_ids), (2, self.bad_seq), (1, self.bad_worker),
            (1, self.unknown_op), (1, self.odd_embeddings), (1, self.odd_register), (1, self.junk_abort),
            (1, self.huge_register),
        ]

    def rid(self) -> str:
        self.n += 1
        return f"x-{self.n}"

    # --- bad frames: detokd cannot decode them
    def random_bytes(self):
        b = bytes(self.rng.randrange(256) for _ in range(self.rng.randint(1, 80)))
        if b[0] in self.MAP_MARKERS:  # a top level that is not a map never decodes
            b = b"\xc1" + b[1:]
        return b, True

    def empty(self):
        return b"", True

    def not_a_map(self):
        return enc(self.rng.choice([7, -1, "tokens", None, [1, 2], b"\x00\xff", 3.5, True, [{"type": "tokens", "rows": []}]])), True

    def no_type(self):
        return enc(self.rng.choice([{}, {"rows": []}, {"TYPE": "tokens", "rows": []}, {"kind": "abort", "rids": []}])), True

    def unknown_type(self):
        return enc({"type": self.rng.choice(["bogus", "Tokens", "text", "stopped", "", 5, None, ["tokens"]]), "rows": []}), True

    def wrong_shape(self):
        return enc(self.rng.choice([
            {"type": "tokens"}, {"type": "tokens", "rows": 5}, {"type": "tokens", "rows": {"rid": "x"}},
            {"type": "abort", "rids": [1, 2]}, {"type": "abort"}, {"type": "register", "worker": "w", "address": 1},
            {"type": "register", "worker": 1}, {"type": "control"}, {"type": "control", "op": 7},
            {"type": "embeddings", "rows": {"a": 1}}, {"type": "embeddings", "rows": [{"worker": 0}]},
        ])), True

    def bad_rows(self):
        """A tokens batch with rows that fail the schema: ids > 2**64 (as a float, the
        only way MessagePack can carry them), ids of the wrong type, no rid..."""
        rows = []
        for _ in range(self.rng.randint(1, 4)):
            rows.append(self.rng.choice([
                {"rid": self.rid(), "ids": [2.0**64 * self.rng.randint(1, 1000)]},
                {"rid": self.rid(), "ids": [1e300, -1e300, float("inf")]},
                {"rid": self.rid(), "ids": "123"},
                {"rid": self.rid(), "ids": [[1, 2]]},
                {"rid": self.rid(), "ids": [None]},
                {"rid": self.rid(), "seq": "0"},
                {"rid": self.rid(), "start": 5},
                {"rid": self.rid(), "start": {"worker": "0"}},
                {"rid": self.rid(), "finish": {}},
                {"rid": 12345},
                {"ids": [1, 2, 3]},
                "not a row",
                None,
            ]))
        return enc({"type": "tokens", "rows": rows}), True

    def non_utf8(self):
        junk = b"\xff" + bytes(self.rng.choice([0xFF, 0xFE, 0xC0, 0x80, 0xED]) for _ in range(self.rng.randint(0, 5)))
        return self.rng.choice([
            _map(S("type"), _str8(b"tok" + junk)),
            _map(S("type"), S("tokens"), S("rows"), _arr(_map(S("rid"), _str8(junk)))),
            _map(S("type"), S("abort"), S("rids"), _arr(_str8(b"x-" + junk))),
            _map(S("type"), S("control"), S("op"), _str8(junk)),
        ]), True

    def truncated(self):
        full = enc({"type": "tokens", "rows": [{"rid": self.rid(), "ids": list(range(1, 40)), "start": {"worker": 0}}]})
        return full[: self.rng.randrange(1, len(full))], True

    def lying_header(self):
        """Lengths that claim gigabytes the frame does not hold."""
        return self.rng.choice([
            b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff",
            _map(S("type"), S("tokens"), S("rows")) + b"\xdd\xff\xff\xff\xff",
            _map(S("type"), S("tokens"), S("rows")) + _arr(_map(S("rid"), S("x-l"), S("ids")) + b"\xdd\x7f\xff\xff\xff"),
            _map(S("type"), S("tokens"), S("rows")) + _arr(_map(S("rid"), b"\xdb\xff\xff\xff\xff")),
            _map(S("type"), S("embeddings"), S("rows")) + _arr(_map(S("rid"), S("x-l"), S("data"), b"\xc6\xff\xff\xff\xff")),
        ]), True

    def deep(self):
        """Nesting far deeper than any decoder recurses (in opaque meta, or where rows go)."""
        nest = b"\x91" * self.rng.choice([2_000, 100_000]) + b"\xc0"
        return self.rng.choice([
            _map(S("type"), S("tokens"), S("rows")) + _arr(_map(S("rid"), S(self.rid()), S("ids"), _arr(), S("meta") + nest)),
            _map(S("type"), S("tokens"), S("rows")) + nest,
            _map(S("type"), S("embeddings"), S("rows")) + _arr(_map(S("rid"), S(self.rid()), S("data") + nest)),
        ]), True

    def huge(self):
        if self.big_left > 0 and self.rng.random() < 0.2:
            self.big_left -= 1
            n = 200_000
            return self.rng.choice([
                enc({"type": "tokens", "rows": [1] * n}),
                enc({"type": "tokens", "rows": [{"rid": "x-huge", "ids": "no"}] * n}),
                enc({"type": "abort", "rids": [None] * n}),
            ]), True
        return enc({"type": "tokens", "rows": [{"rid": self.rid(), "ids": [1.5] * 5000}]}), True

    def multipart(self):
        valid = enc({"type": "tokens", "rows": [{"rid": self.rid(), "ids": [1, 2]}]})
        return [valid, valid] if self.rng.random() < 0.5 else [b"", b"\xc1", valid], True

    # --- schema-valid, hostile values: error rows, not bad frames
    def bad_ids(self):
        bad = self.rng.choice([-1, -(2**63), 2**64 - 1, 2**63, self.vocab_size, self.vocab_size + 1, 2**32])
        row = {"rid": self.rid(), "ids": [5, bad, 7], "start": {"worker": self.rng.randrange(2)}}
        if self.rng.random() < 0.3:
            row["start"]["prompt_tail"] = [bad]
        return enc({"type": "tokens", "rows": [row]}), False

    def bad_seq(self):
        return enc({"type": "tokens", "rows": [{"rid": self.rid(), "ids": [5], "seq": self.rng.choice([-5, 2**63 - 1, -(2**63), 3])}]}), False

    def bad_worker(self):
        return enc({"type": "tokens", "rows": [{"rid": self.rid(), "ids": [5], "start": {"worker": self.rng.choice([-1, 99, 2**63 - 1])}}]}), False

    def unknown_op(self):
        op = self.rng.choice(["reboot", "debug_stall:5", "", "FLUSH", "x" * 1000])
        return enc({"type": "control", "op": op}), len(op) > MAX_OP  # a bad frame past MAX_OP

    def odd_embeddings(self):
        return enc({"type": "embeddings", "rows": [{"rid": self.rid(), "worker": self.rng.choice([-3, 42, 2**40]), "data": [1.0]}]}), False

    def odd_register(self):
        """Workers far from the real ones, at addresses that are garbage or lead nowhere."""
        address = self.rng.choice(["garbage", "tcp://", "tcp://no-port", "ipc://", "ipc:///" + "x" * 300,
                                   "ipc:///nonexistent/dir/w.sock", "inproc://nobody"])
        return enc({"type": "register", "worker": self.rng.randint(100, 103), "address": address}), False

    def huge_register(self):
        """An address past MAX_ADDRESS: a bad frame, never a register refused (or taken)."""
        address = "tcp://" + "h" * self.rng.randint(MAX_ADDRESS, 4 * MAX_ADDRESS) + ":1"
        return enc({"type": "register", "worker": 0, "address": address}), True

    def junk_abort(self):
        return enc({"type": "abort", "rids": [self.rid(), "", "x-" + "y" * 500]}), False


class OverCaps:
    """Frames beyond one of detokd's caps (config keys max_*), each (frame, bad) like
    Hostile's. Over max_rows a frame is bad; over every other cap the row gets
    `too_large`, or, for a rid over max_rid_len, no row at all. `oversized` frames (over
    max_frame_bytes) are never read by detokd: send them from a socket of their own,
    whose connection ZMQ drops. Rids start with "x-". `quiet_id` is an id whose text
    is "" (a special token, skipped): a row within a frame's budget beside one past it
    then ends without text."""

    def __init__(self, rng: random.Random, caps, quiet_id: int = 0) -> None:
        self.rng = rng
        self.caps = caps
        self.quiet_id = quiet_id
        self.n = 0
        self._oversized = b"\x00" * (caps.max_frame_bytes + 1)  # built once: 64 MiB by default

    def rid(self) -> str:
        self.n += 1
        return f"x-c{self.n}"

    def _start(self, **start) -> bytes:
        return enc({"type": "tokens", "rows": [{"rid": self.rid(), "ids": [100, 101], "start": start}]})

    def huge_rid(self):
        n = self.caps.max_rid_len + self.rng.choice([1, 7, 5000])
        return enc({"type": "tokens", "rows": [{"rid": "x-" + "r" * n, "ids": [100], "start": {}}]}), False

    def over_row_ids(self):
        return enc({"type": "tokens", "rows": [{"rid": self.rid(), "ids": [100] * (self.caps.max_row_ids + 1), "start": {}}]}), False

    def over_prompt_tail(self):
        return self._start(prompt_tail=[100] * (self.caps.max_wire_prompt_tail + 1)), False

    def many_stops(self):
        return self._start(stop=[f"s{i}" for i in range(self.caps.max_stop_strings + 1)]), False

    def long_stops(self):
        return self._start(stop=["z" * (self.caps.max_stop_chars // 2 + 1)] * 2), False

    def huge_meta(self):
        meta = "m" * (self.caps.max_meta_bytes + 1)
        return enc({"type": "tokens", "rows": [{"rid": self.rid(), "ids": [100], "start": {}, "meta": meta}]}), False

    def over_frame_ids(self):
        """Two rows of just over half max_frame_ids ids each: the second is past the budget."""
        ids = [self.quiet_id] * (self.caps.max_frame_ids // 2 + 1)
        rows = [{"rid": self.rid(), "ids": ids, "start": {}, "finish": {"reason": "length"}} for _ in range(2)]
        return enc({"type": "tokens", "rows": rows}), False

    def over_rows(self):
        return enc({"type": "tokens", "rows": [{"rid": self.rid(), "ids": [100]}] * (self.caps.max_rows + 1)}), True

    def oversized(self):
        return self._oversized, False
