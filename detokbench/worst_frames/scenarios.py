"""The worst frames: the scale of a run and, for each scenario, its one frame at the
default caps (built from detokd.wire.native's Structs, or raw MessagePack where the
frame is meant to be malformed)."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field

import msgspec

from detokd.config import Config
from detokd.tokenizer import Vocab
from detokd.wire.native import Abort, Control, EmbeddingRow, Embeddings, Finish, Register, Row, Start, Tokens, encode

CAPS = Config()  # the defaults every scenario runs at


@dataclass(frozen=True)
class Scale:
    frame_bytes: int  # each frame is built just under this
    rows: int
    row_ids: int
    evict_states: int  # max_states of mass_start_evict
    distinct_starts: int  # 0: no stop_distinct; -1: a full frame of them


FULL = Scale(CAPS.max_frame_bytes - 4096, CAPS.max_rows, CAPS.max_row_ids, 1024, -1)  # -1: a full frame
QUICK = Scale(128 * 1024, 512, 1024, 64, -1)


@dataclass
class Frame:
    data: bytes
    rows: int
    ids: int
    note: str
    per_start_bytes: int = 0  # stop_distinct: what one more start adds to a frame
    token: int | None = None  # the one id the rows repeat, where they do


def tokens(rows: list[Row]) -> bytes:
    return encode(Tokens(rows))


def fit(budget: int, fixed: int, per_row: int, cap: int) -> int:
    """Rows of `per_row` bytes that fit beside `fixed` bytes (envelope, first row)."""
    return max(1, min(cap, (budget - fixed - 8) // per_row))


def padded_rid(prefix: str, i: int, width: int) -> str:
    head = f"{prefix}{i:06d}-"
    return head + "x" * (width - len(head))


def mass_start(scale: Scale, vocab: Vocab) -> Frame:
    """max_rows new requests, one id each; rids as long as the frame allows."""
    token = vocab.backend.encode("Hello", add_special_tokens=False).ids[0]
    per_row = (scale.frame_bytes - 16) // scale.rows

    def size(width: int) -> int:
        return len(encode(Row(padded_rid("m-", 0, width), [token], start=Start())))

    width = min(CAPS.max_rid_len, per_row - (size(300) - 300))
    while size(width) > per_row:  # a shorter rid may take a shorter header: settle it
        width -= 1
    rows = [Row(padded_rid("m-", i, width), [token], start=Start()) for i in range(scale.rows)]
    return Frame(tokens(rows), len(rows), len(rows), f"{len(rows)} starts, rids of {width} chars, id {token}")


def longest_token(scale: Scale, vocab: Vocab) -> Frame:
    """Rows of row_ids copies of the longest-text id, one new request each."""
    tid = longest_id(vocab)
    ids = [tid] * scale.row_ids
    n = fit(scale.frame_bytes, 16, len(encode(Row("L-000000", ids, start=Start()))), scale.rows)
    rows = [Row(f"L-{i:06d}", ids, start=Start()) for i in range(n)]
    out = len(vocab.decode([tid], True).encode())
    return Frame(tokens(rows), n, n * len(ids), f"{n} rows x {len(ids)} x id {tid} ({out} bytes of text each)", token=tid)


@functools.cache
def longest_id(vocab: Vocab) -> int:
    """The id whose decode is longest in UTF-8 bytes; the lowest id among equals."""
    return max(range(vocab.size), key=lambda i: (len(vocab.decode([i], True).encode()), -i))


def malformed(scale: Scale, vocab: Vocab) -> Frame:
    """max_rows rows whose ids end in a string: msgspec reads every id of every row
    before it fails, once for the frame and once per row in the salvage."""
    k = (scale.frame_bytes - 16) // scale.rows - len(msgspec.msgpack.encode({"rid": "bad-000000", "ids": ["x"]})) - 3
    msg = {"type": "tokens", "rows": [{"rid": f"bad-{i:06d}", "ids": [1] * k + ["x"]} for i in range(scale.rows)]}
    return Frame(msgspec.msgpack.encode(msg), scale.rows, scale.rows * k, f"{scale.rows} rows of {k} ids and a string")


def holdback_stops() -> list[str]:
    """max_stop_strings strings of max_stop_chars characters in all, each spaces and a
    mark (at the defaults 15 and one), so a text of spaces always holds its last
    spaces back."""
    n = CAPS.max_stop_strings
    each = CAPS.max_stop_chars // n
    return [" " * (each - 1) + chr(0x4E00 + i) for i in range(n)]


def stop_holdback(scale: Scale, vocab: Vocab) -> Frame:
    """One request: its start carries holdback_stops(), every row the longest-text id."""
    tid = longest_id(vocab)
    ids = [tid] * scale.row_ids
    first = Row("S-0", ids, start=Start(stop=holdback_stops()))
    fixed = 16 + len(encode(first))
    n = 1 + fit(scale.frame_bytes, fixed, len(encode(Row("S-0", ids, seq=2**32))), scale.rows - 1)
    rows = [first] + [Row("S-0", ids, seq=k * len(ids)) for k in range(1, n)]
    return Frame(tokens(rows), n, n * len(ids), f"1 start, 256 stops / 65536 chars, {n} rows x {len(ids)} x id {tid}")


def distinct_stops(rng: random.Random) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    each = CAPS.max_stop_chars // CAPS.max_stop_strings
    return ["".join(rng.choices(letters, k=each)) for _ in range(CAPS.max_stop_strings)]


def stop_distinct(scale: Scale, vocab: Vocab) -> Frame:
    """New requests, each with its own stop list: its own automaton. As many as fill
    the frame, or distinct_starts of them (then a full frame is extrapolated)."""
    rng = random.Random(13)
    token = vocab.backend.encode("Hello", add_special_tokens=False).ids[0]
    first = Row("D-000000", [token], start=Start(stop=distinct_stops(rng)))
    per_start = len(encode(first))
    full = fit(scale.frame_bytes, 16, per_start, scale.rows)
    n = full if scale.distinct_starts < 0 else min(full, scale.distinct_starts)
    rows = [first] + [Row(f"D-{i:06d}", [token], start=Start(stop=distinct_stops(rng))) for i in range(1, n)]
    partial = n < full
    note = f"{n} starts of a distinct max stop list each" + (" (partial frame)" if partial else "")
    return Frame(tokens(rows), n, n, note, per_start if partial else 0)


def abort_rids(scale: Scale) -> list[str]:
    width = min(CAPS.max_rid_len, (scale.frame_bytes - 32) // scale.rows - 16)  # the setup's starts fit too
    return [padded_rid("A-", i, width) for i in range(scale.rows)]


def abort_setup(scale: Scale, vocab: Vocab) -> bytes:
    """abort_mass's rids started, so the abort frees live requests."""
    return tokens([Row(rid, [], start=Start()) for rid in abort_rids(scale)])


def abort_mass(scale: Scale, vocab: Vocab) -> Frame:
    rids = abort_rids(scale)
    return Frame(encode(Abort(rids)), len(rids), 0, f"{len(rids)} rids of {len(rids[0])} chars, each live")


def abort_over(scale: Scale, vocab: Vocab) -> Frame:
    n = scale.frame_bytes - 32  # an empty str is one byte: 0xa0
    data = msgspec.msgpack.encode({"type": "abort", "rids": []})[:-1] + b"\xdd" + n.to_bytes(4, "big") + b"\xa0" * n
    return Frame(data, n, 0, f"{n} empty rids (max_rows is {CAPS.max_rows})")


def embeddings_mass(scale: Scale, vocab: Vocab) -> Frame:
    per_row = (scale.frame_bytes - 32) // scale.rows
    width = min(CAPS.max_rid_len, per_row - len(encode(EmbeddingRow("", 0, msgspec.Raw(b"\x91\x01")))) - 3)
    rows = [EmbeddingRow(padded_rid("E-", i, width), 0, msgspec.Raw(b"\x91\x01")) for i in range(scale.rows)]
    return Frame(encode(Embeddings(rows)), len(rows), 0, f"{len(rows)} rows, rids of {width} chars")


def register_huge(scale: Scale, vocab: Vocab) -> Frame:
    address = "ipc://" + "r" * (scale.frame_bytes - 64)
    return Frame(encode(Register(0, address)), 1, 0, f"an address of {len(address)} chars")


def control_huge(scale: Scale, vocab: Vocab) -> Frame:
    op = "x" * (scale.frame_bytes - 64)
    return Frame(encode(Control(op)), 1, 0, f"an op of {len(op)} chars")


def window_byte_run(scale: Scale, vocab: Vocab) -> Frame:
    """max_rows rows at every scale (1.5 MB: its cost is in the rows, not the bytes, so
    --quick catches a codec quadratic in the run), the last one a word that ends the run
    and the request, so its final decode is measured too."""
    token = {t: i for i, t in enumerate(vocab.tokens) if t}
    run = [token[f"<0x{b:02X}>"] for b in "中".encode()] * ((CAPS.max_rows - 1) // 3)
    word = vocab.backend.encode(" end", add_special_tokens=False).ids[-1:]
    rows = [Row("B-0", [i], seq=k, start=Start() if k == 0 else None) for k, i in enumerate(run)]
    rows.append(Row("B-0", word, seq=len(run), finish=Finish("length")))
    return Frame(tokens(rows), len(rows), len(rows), f"{len(run)} one-id rows of one open byte run, then a word")


@dataclass(frozen=True)
class Scenario:
    name: str
    build: object  # (Scale, Vocab) -> Frame
    settings: dict = field(default_factory=dict)  # config keys beyond the defaults
    setup: object = None  # (Scale, Vocab) -> bytes: a frame sent (and answered) before the measured one


def scenarios(scale: Scale) -> list[Scenario]:
    return [
        Scenario("mass_start", mass_start),
        Scenario("mass_start_evict", mass_start, {"max_states": scale.evict_states}),
        Scenario("longest_token", longest_token),
        Scenario("malformed", malformed),
        Scenario("stop_holdback", stop_holdback),
    ] + ([Scenario("stop_distinct", stop_distinct)] if scale.distinct_starts else []) + [
        Scenario("abort_mass", abort_mass, setup=abort_setup),
        Scenario("abort_over", abort_over),
        Scenario("embeddings_mass", embeddings_mass),
        Scenario("register_huge", register_huge),
        Scenario("control_huge", control_huge),
        Scenario("window_byte_run", window_byte_run, {"codec": "window", "tokenizer": "mistral_v3"}),
    ]
