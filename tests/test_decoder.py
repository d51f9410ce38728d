"""Exact incremental decoding (issue "Exact incremental decoding").

The specification is docs/protocol.md's text semantics. For any prompt tail, any output ids
and any split of them into steps, a decoder's step texts followed by finish() concatenate
to `decode(tail + out)[len(decode(tail)):]`, computed by transformers' own decode (the
`oracle` of conftest), with skip_special_tokens either way; and text once emitted is never
taken back. Every property runs on all eight zoo tokenizers, through the fast codec that
make_codec picks and through the generic window codec.

Cost is specified by counting work (tokenizer calls, ids decoded, state held), not by
timing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import pytest
from conftest import ALL, fast_codec, oracle, vocab, window_codec
from hypothesis import given, settings
from hypothesis import strategies as st

from detokd.core.decoder import (
    MAX_OPEN_RUN,
    REPLACEMENT,
    ByteCodec,
    ByteDecoder,
    PieceCodec,
    PieceDecoder,
    PromptDecoder,
    RunTooLong,
    WindowCodec,
    WindowDecoder,
    WordByteDecoder,
    byte_level_alphabet,
    make_codec,
)

BYTE_LEVEL = ("deepseek", "qwen2", "qwen3_6", "mistral_tekken")
SENTENCEPIECE = ("mistral_v1", "mistral_v3", "mistral_v7")
WORDPIECE = ("minilm",)
CODECS = ("fast", "window")

# Where the fast path's subtleties live (byte-level specials, byte fallback, WordPiece),
# the fast codec explores the whole profile; everything else half of it.
HEAVY = {("deepseek", "fast"), ("mistral_v3", "fast"), ("minilm", "fast")}


def codec_for(name: str, kind: str):
    """"fast": the fast codec; "word": the same, releasing text as SGLang does; "window"."""
    if kind == "window":
        return window_codec(name)
    return fast_codec(name, "word" if kind == "word" else "char")


def budget(name: str, kind: str) -> int:
    full = settings.default.max_examples
    return full if (name, kind) in HEAVY else max(10, full // 2)


# --- what streams are made of -------------------------------------------------------------

FRAGMENTS = (
    "Hello, wörld! Naïve café, façade. ",
    "Привет, мир! Съешь же ещё этих булок. ",
    "Γειά σου κόσμε· ἀρχή. ",
    "مرحبا بالعالم، كيف حالك؟ ",
    "नमस्ते दुनिया, क्षत्रिय। ",
    "你好，世界。日本語のテキスト、한국어 문장. ",
    "𠀋𪚥𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ",  # outside the BMP: four UTF-8 bytes each
    "👩‍👩‍👧‍👦 👍🏽 🤖 🏳️‍🌈 ",  # ZWJ sequences and skin tones
    "def f(x):\n\treturn x**2  # ok\n",
    '{"a": [1, 2.5e-3], "b": null}\n',
    "   \n\n\t\t  \r\n ",
    "don't do it , he said . isn't it ?",  # WordPiece clean-up territory
)
CHARS = "".join(sorted(set("".join(FRAGMENTS))))

texts = st.lists(
    st.one_of(
        st.sampled_from(FRAGMENTS),
        st.text(st.sampled_from(CHARS), min_size=1, max_size=12),
        st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=4),
    ),
    max_size=5,
).map("".join)


def encode(name: str, text: str) -> list[int]:
    return vocab(name).backend.encode(text, add_special_tokens=False).ids


@lru_cache(maxsize=None)
def byte_ids(name: str) -> tuple[int, ...]:
    """Ids that stand for one raw byte: <0xXX> pieces, or byte-level single-byte tokens."""
    v = vocab(name)
    if name in BYTE_LEVEL:
        alphabet = byte_level_alphabet()
        return tuple(i for i, t in enumerate(v.tokens) if t is not None and len(t) == 1 and t in alphabet)
    return tuple(i for i, t in enumerate(v.tokens) if t and len(t) == 6 and t.startswith("<0x") and t.endswith(">"))


@lru_cache(maxsize=None)
def added_ids(name: str) -> tuple[int, ...]:
    """Special ids and other added tokens (deepseek's 53 that survive skip)."""
    v = vocab(name)
    return tuple(sorted(v.special | set(v.backend.get_added_tokens_decoder())))


def any_id(name: str) -> st.SearchStrategy[int]:
    size = vocab(name).size
    choices = [st.integers(0, size - 1), st.sampled_from(added_ids(name))]
    if byte_ids(name):
        choices.append(st.sampled_from(byte_ids(name)))
    return st.one_of(choices)


@dataclass
class Case:
    tail: list[int]
    rows: list[list[int]]
    skip: bool

    @property
    def out(self) -> list[int]:
        return [i for row in self.rows for i in row]


def soup(name: str) -> st.SearchStrategy[list[int]]:
    """Raw bytes and added tokens jumbled: broken characters, runs split by specials."""
    parts = [st.sampled_from(added_ids(name))] + ([st.sampled_from(byte_ids(name))] * 2 if byte_ids(name) else [])
    return st.lists(st.one_of(parts), max_size=16)


@st.composite
def cases(draw, name: str) -> Case:
    out = encode(name, draw(texts)) if draw(st.integers(0, 3)) else draw(soup(name))
    # Raw ids in clusters, so byte runs broken by specials and the like come up often.
    clusters = st.lists(any_id(name), min_size=1, max_size=4)
    for pos, ids in draw(st.lists(st.tuples(st.integers(0, 10**6), clusters), max_size=4)):
        pos %= len(out) + 1
        out[pos:pos] = ids
    how = draw(st.sampled_from(["none", "ids", "text", "split"]))
    if how == "ids":
        tail = draw(st.lists(any_id(name), max_size=8))
    elif how == "text":  # the end of some prompt, cut anywhere (mid-character too)
        ids = encode(name, draw(texts))
        tail = ids[: draw(st.integers(0, len(ids)))][-8:]
    elif how == "split":  # prompt and output are one encoding: the cut may split a character
        k = draw(st.integers(0, len(out)))
        tail, out = out[:k][-8:], out[k:]
    else:
        tail = []
    sizes = draw(st.lists(st.integers(0, 4), max_size=len(out) + 3))  # 0: an empty row
    rows, at = [], 0
    for n in sizes:
        rows.append(out[at : at + n])
        at += n
    rows.append(out[at:])
    return Case(tail, rows, draw(st.booleans()))


def run(codec, case: Case) -> tuple[list[str], str]:
    """Step texts, and finish()'s text."""
    d = codec.new(case.tail, case.skip)
    return [d.step(list(row)) for row in case.rows], d.finish()


def check_each(name: str, kind: str, prop) -> None:
    """Run `prop(vocab, codec, case)` over generated cases, with this pair's budget."""

    @settings(max_examples=budget(name, kind))
    @given(case=cases(name))
    def check(case: Case) -> None:
        prop(vocab(name), codec_for(name, kind), case)

    check()


# --- the properties -------------------------------------------------------------------------


@pytest.mark.parametrize("name,kind", [(n, k) for n in ALL for k in CODECS] + [(n, "word") for n in BYTE_LEVEL + SENTENCEPIECE])
def test_streamed_text_equals_the_oracle(name: str, kind: str) -> None:
    def prop(v, codec, case: Case) -> None:
        steps, last = run(codec, case)
        assert "".join(steps) + last == oracle(v, case.tail, case.out, case.skip)

    check_each(name, kind, prop)


@pytest.mark.parametrize("name,kind", [(n, k) for n in ALL for k in CODECS] + [(n, "word") for n in BYTE_LEVEL + SENTENCEPIECE])
def test_emitted_text_is_never_taken_back(name: str, kind: str) -> None:
    """After every step, all text sent so far is a prefix of the final text; in
    particular no step ends in a U+FFFD that stands for a character still being split."""

    def prop(v, codec, case: Case) -> None:
        want = oracle(v, case.tail, case.out, case.skip)
        sent = ""
        for piece in run(codec, case)[0]:
            if piece.endswith(REPLACEMENT):
                at = len(sent) + len(piece) - 1
                assert want[at : at + 1] == REPLACEMENT, f"premature U+FFFD at {at} of {want!r}"
            sent += piece
            assert want.startswith(sent), f"sent {sent!r}, final text {want!r}"

    check_each(name, kind, prop)


@pytest.mark.parametrize("name,kind", [(n, "fast") for n in ALL] + [(n, "word") for n in BYTE_LEVEL + SENTENCEPIECE])
def test_the_settled_text_lookup_gives_what_step_would(name: str, kind: str) -> None:
    """The core's fast path reads `decoder.settled_text[i]` for a one-id row instead of
    calling step: it must give the same text and leave the stream unchanged."""

    def prop(v, codec, case: Case) -> None:
        stepped, looked = codec.new(case.tail, case.skip), codec.new(case.tail, case.skip)
        for row in case.rows:
            want = stepped.step(list(row))
            settled = looked.settled_text
            text = settled[row[0]] if settled is not None and len(row) == 1 else None
            got = looked.step(list(row)) if text is None else text
            assert got == want
        assert looked.finish() == stepped.finish()

    check_each(name, kind, prop)


@pytest.mark.parametrize("name,kind", [(n, k) for n in ALL for k in CODECS] + [(n, "word") for n in BYTE_LEVEL + SENTENCEPIECE])
def test_peek_is_the_oracles_text_of_the_ids_so_far_past_what_was_committed(name: str, kind: str) -> None:
    """What the engine's stop-string trim reads before a finishing row (Request._unsent):
    after any row, the text committed so far and then `peek()` are the oracle's text of
    the ids so far, and peeking changes nothing that follows."""

    def prop(v, codec, case: Case) -> None:
        peeked, plain = codec.new(case.tail, case.skip), codec.new(case.tail, case.skip)
        committed, ids = "", []
        for row in case.rows:
            text = peeked.step(list(row))
            assert text == plain.step(list(row))
            committed, ids = committed + text, ids + list(row)
            assert committed + peeked.peek() == oracle(v, case.tail, ids, case.skip)
        assert peeked.finish() == plain.finish()

    check_each(name, kind, prop)


# --- explicit cases -----------------------------------------------------------------------


def printable_as_sglang(text: str) -> str:
    """sglang.utils.find_printable_text of text followed by a split character, read
    naively: through a trailing CJK ideograph, else up to the last space."""
    import unicodedata

    if text and unicodedata.name(text[-1], "").startswith("CJK") and "IDEOGRAPH" in unicodedata.name(text[-1], ""):
        return text
    return text[: text.rfind(" ") + 1]


@pytest.mark.parametrize("width", [1, 2, 3])
@pytest.mark.parametrize("name", BYTE_LEVEL)
@pytest.mark.parametrize("text", ["Emoji: 👨\u200d👩\u200d👧 family", "古文 𠀀𪚥 龘靐齉爩，服务器", "a b\u200d🤖 c"])
def test_word_release_sends_what_sglang_sends_while_a_character_is_split(name: str, text: str, width: int) -> None:
    """`width` ids a step: while the decoder holds part of a character, the text since
    the last whole step goes out only as far as SGLang's detokenizer sends it."""
    v = vocab(name)
    ids = v.backend.encode(text, add_special_tokens=False).ids
    d = fast_codec(name, "word").new([], True)
    assert isinstance(d, WordByteDecoder)
    sent, clean, best = "", "", 0  # what went out; the text up to the last whole step
    for k in range(width, len(ids) + width, width):
        sent += d.step(ids[k - width : k])
        full = v.decode(ids[:k], True)
        if full.endswith(REPLACEMENT):  # a character is split here (valid UTF-8: one U+FFFD)
            dirty = full[len(clean) : -1]
            best = max(best, len(printable_as_sglang(dirty)))  # SGLang never takes text back
            assert sent == clean + dirty[:best]
        else:
            assert sent == full
            clean, best = full, 0
    assert sent + d.finish() == v.decode(ids, True)



def stream(codec, tail: list[int], steps: list[list[int]], skip: bool) -> tuple[list[str], str]:
    d = codec.new(tail, skip)
    return [d.step(s) for s in steps], d.finish()


@pytest.mark.parametrize("name", ALL)
def test_spaces_between_special_tokens_is_ignored_by_fast_decode(name: str) -> None:
    """transformers' fast decode ignores the flag for all these tokenizers, so detokd
    ignoring Start.spaces_between_special_tokens matches the oracle (docs/decoding.md)."""
    v = vocab(name)
    adds = list(added_ids(name))
    text = encode(name, "Hello there, wörld 🤖")
    ids = adds[:3] + text[:2] + adds[-2:] + text[2:] + adds[3:5] + adds[3:5]
    for skip in (False, True):
        spaced = v.hf.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=True)
        tight = v.hf.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=False)
        assert spaced == tight


def held_state(d) -> int:
    """How much a decoder holds: window ids, open byte run, or buffered UTF-8 bytes."""
    if isinstance(d, WindowDecoder):
        return len(d.ids)
    if isinstance(d, PieceDecoder):
        return len(d.run or b"")
    assert isinstance(d, ByteDecoder)
    return len(d.pending)


@pytest.mark.parametrize("kind", CODECS)
@pytest.mark.parametrize("name", ALL)
def test_ids_that_decode_to_nothing_never_stall_the_stream(name: str, kind: str) -> None:
    """Skipped specials decode to "" forever. A long run of them, even right after half
    a character, keeps the decoder's state small and loses no text (SGLang #8031)."""
    v, codec = vocab(name), codec_for(name, kind)
    nothing = sorted(v.special)[0]
    head = encode(name, "héllo 🤖")
    tail_ids = encode(name, " and again")
    d = codec.new([], True)
    sent = d.step(head[:-1])  # the emoji's last piece is missing
    for _ in range(2000):
        sent += d.step([nothing])
        assert held_state(d) <= 40
    sent += d.step(head[-1:]) + d.step(tail_ids)
    want = oracle(v, [], head[:-1] + [nothing] * 2000 + head[-1:] + tail_ids, True)
    assert want.startswith(sent)
    assert len(want) - len(sent) <= len(v.decode(tail_ids[-1:], True)) + 1  # at most the last id waits
    assert sent + d.finish() == want


def byte_tokens(name: str, data: bytes) -> list[int]:
    """The ids of these raw bytes, one byte per id."""
    v = vocab(name)
    if name in BYTE_LEVEL:
        inverse = {b: c for c, b in byte_level_alphabet().items()}
        token = {t: i for i, t in enumerate(v.tokens) if t is not None}
        return [token[inverse[b]] for b in data]
    token = {t: i for i, t in enumerate(v.tokens) if t is not None}
    return [token[f"<0x{b:02X}>"] for b in data]


INVALID = (
    b"\x80\xbf",  # lone continuation bytes
    b"\xff\xfe",  # never valid in UTF-8
    b"\xe2\x82A",  # a character cut short by another
    b"\xc0\xaf",  # overlong
    b"\xed\xa0\x80",  # a surrogate
    b"\xf0\x9f\xa4",  # cut short
    b"\xe2\x82\xac\xe2",  # a complete character, then a broken one
)


@pytest.mark.parametrize("data", INVALID, ids=lambda b: b.hex())
@pytest.mark.parametrize("kind", CODECS)
@pytest.mark.parametrize("name", BYTE_LEVEL + SENTENCEPIECE)
def test_runs_of_invalid_bytes_decode_exactly(name: str, kind: str, data: bytes) -> None:
    """Between text, and at the very end of the stream, with either skip flag."""
    v, codec = vocab(name), codec_for(name, kind)
    ok, bad = encode(name, "ok"), byte_tokens(name, data)
    for out in (ok + bad + encode(name, " then"), ok + bad):
        for skip in (False, True):
            want = oracle(v, [], out, skip)
            steps, last = stream(codec, [], [[i] for i in out], skip)
            sent = ""
            for s in steps:
                sent += s
                assert want.startswith(sent)
            assert sent + last == want


@pytest.mark.parametrize("kind", CODECS)
@pytest.mark.parametrize("name", BYTE_LEVEL + SENTENCEPIECE)
def test_skipped_specials_inside_a_character_are_invisible(name: str, kind: str) -> None:
    """With skip_special_tokens the tokenizer drops specials before its decoder runs, so
    the bytes on both sides of them are one character (or one byte-fallback run): no
    text may go out that a byte after the specials changes (on SentencePiece, the "A" of
    a run that a later byte breaks)."""
    v, codec = vocab(name), codec_for(name, kind)
    special = sorted(v.special)[-1]
    ids: list[int] = []
    for i in byte_tokens(name, "A€".encode()):
        ids += [i, special, special]
    ids += byte_tokens(name, b"\xe2") + encode(name, "the")
    for skip in (False, True):
        want = oracle(v, [], ids, skip)
        steps, last = stream(codec, [], [[i] for i in ids], skip)
        sent = ""
        for s in steps:
            sent += s
            assert want.startswith(sent), f"sent {sent!r}, final text {want!r}"
        assert sent + last == want


@pytest.mark.parametrize("kind", CODECS)
@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_a_byte_fallback_run_is_held_until_it_ends(name: str, kind: str) -> None:
    """Hugging Face's ByteFallback decodes a run of <0xXX> pieces all or nothing: one
    byte that breaks it turns the € it already completed into U+FFFD too."""
    v, codec = vocab(name), codec_for(name, kind)
    euro = byte_tokens(name, b"\xe2\x82\xac")
    the = encode(name, "the")  # "▁the": SentencePiece adds the word's space itself
    broken = euro + byte_tokens(name, b"\xe2") + the
    steps, last = stream(codec, [], [[i] for i in broken], False)
    want = oracle(v, [], broken, False)
    assert "€" not in "".join(steps) and want.startswith(REPLACEMENT * 4)
    assert "".join(steps) + last == want
    steps, last = stream(codec, [], [[i] for i in euro + the], False)
    want = oracle(v, [], euro + the, False)
    assert want.startswith("€") and "".join(steps) + last == want


@pytest.mark.parametrize("kind", CODECS)
@pytest.mark.parametrize("name", ALL)
def test_a_prompt_ending_mid_character_never_leaks_prompt_text(name: str, kind: str) -> None:
    """vLLM #48853. Every cut of "Hello 🤖 world" into prompt and output."""
    v, codec = vocab(name), codec_for(name, kind)
    ids = encode(name, "Hello 🤖 world")
    for k in range(1, len(ids)):
        for skip in (False, True):
            steps, last = stream(codec, ids[:k], [[i] for i in ids[k:]], skip)
            got = "".join(steps) + last
            assert got == oracle(v, ids[:k], ids[k:], skip)
            assert "ello" not in got
            if name in BYTE_LEVEL and k >= 2:  # the emoji is the prompt's, whole or cut
                assert got == " world"


@pytest.mark.parametrize("name", ALL)
def test_a_fast_decoder_counts_the_prompt_characters_it_still_has_to_drop(name: str) -> None:
    """The byte and piece decoders share one base: after a prompt ending mid-character
    (or in an open byte run) they hold `prompt_left` characters of the prompt's text,
    which the first text they commit comes out without; until then no settled_text lookup."""
    v, codec = vocab(name), fast_codec(name)
    ids = encode(name, "Hello 🤖 world")
    for k in range(1, len(ids)):
        d = codec.new(ids[:k], False)
        assert isinstance(d, PromptDecoder) and not hasattr(d, "__dict__")
        whole, committed = v.decode(ids[:k], False), codec.new([], False).step(ids[:k])
        assert d.prompt_left == len(whole) - len(committed)
        assert (d.settled_text is None) == bool(d.prompt_left or held_state(d) or isinstance(d, PieceDecoder) and d.fresh)
        got = "".join(d.step([i]) for i in ids[k:]) + d.finish()
        assert got == oracle(v, ids[:k], ids[k:], False) and d.prompt_left == 0


# --- choosing a codec -----------------------------------------------------------------------


def test_every_zoo_tokenizer_is_in_one_family_here() -> None:
    assert sorted(BYTE_LEVEL + SENTENCEPIECE + WORDPIECE) == sorted(ALL)


@pytest.mark.parametrize("name", ALL)
def test_make_codec_picks_the_fast_codec(name: str) -> None:
    codec = make_codec(vocab(name))
    assert type(codec) is (ByteCodec if name in BYTE_LEVEL else PieceCodec)


def test_make_codec_gives_the_window_codec_when_asked() -> None:
    assert type(make_codec(vocab("deepseek"), prefer="window")) is WindowCodec


@pytest.mark.parametrize("name", BYTE_LEVEL)
def test_byte_table_agrees_with_every_single_token_decode(name: str) -> None:
    codec = fast_codec(name)
    ids = list(range(codec.vocab.size))
    ref = codec.vocab.backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
    assert [i for i, r in zip(ids, ref, strict=True) if codec.bytes_keep_special[i].decode("utf-8", "replace") != r] == []


# --- cost: work per step does not grow with the stream ---------------------------------------

LONG = 20_000


def long_stream(name: str) -> list[list[int]]:
    """About LONG ids of text in every script, with added tokens now and then, in rows of
    1 to 4 ids (a fixed pattern: the test counts work, it needs no randomness)."""
    chunk = encode(name, "".join(FRAGMENTS))
    adds = added_ids(name)
    ids: list[int] = []
    while len(ids) < LONG:
        ids += chunk
        ids.append(adds[len(ids) % len(adds)])
    ids = ids[:LONG]
    rows, at, n = [], 0, 0
    while at < len(ids):
        n = n % 4 + 1
        rows.append(ids[at : at + n])
        at += n
    return rows


class CountingVocab:
    """A Vocab that counts the tokenizer's work done through it."""

    def __init__(self, v) -> None:
        self._v = v
        self.calls = 0
        self.ids = 0

    def __getattr__(self, attr):
        return getattr(self._v, attr)

    def decode(self, ids, skip_special_tokens):
        self.calls += 1
        self.ids += len(ids)
        return self._v.decode(ids, skip_special_tokens)


@pytest.mark.parametrize("skip", [False, True], ids=["keep", "skip"])
@pytest.mark.parametrize("name", ["deepseek", "mistral_v3", "minilm"])
def test_window_codec_work_per_step_is_bounded(name: str, skip: bool) -> None:
    v = vocab(name)
    counted = CountingVocab(v)
    codec = WindowCodec(counted)
    d = codec.new(encode(name, "prompt tail")[-8:], skip)
    rows = long_stream(name)
    run = longest_byte_run(name, [i for row in rows for i in row])
    calls, decoded, window = [], [], []
    for row in rows:
        c0, n0 = counted.calls, counted.ids
        d.step(row)
        calls.append(counted.calls - c0)
        decoded.append(counted.ids - n0)
        window.append(len(d.ids))
    # The window is cut back to its size, except that an open byte run stays whole.
    assert max(window) <= codec.window + run
    # The window, its stable part, and the cuts tried (at most one per id beyond the context).
    assert max(calls) <= 2 + codec.window - codec.context
    assert max(decoded) <= max(calls) * (codec.window + run + 4)
    # The same work at the end as at the start: nothing accumulates.
    assert max(calls[-2000:]) <= max(calls[:2000]) and max(decoded[-2000:]) <= max(decoded[:2000])


BROKEN_RUNS = (b"\xf0", b"\xe2", b"\xf0\x9f", b"\x80", b"\xf0\x9f\xa4")


@pytest.mark.parametrize("unit", BROKEN_RUNS, ids=lambda b: b.hex())
@pytest.mark.parametrize("skip", [False, True], ids=["keep", "skip"])
@pytest.mark.parametrize("name", BYTE_LEVEL)
def test_window_codec_work_stays_bounded_over_a_run_of_broken_bytes(name: str, skip: bool, unit: bytes) -> None:
    """Byte-level ids forced onto the window codec, one lone byte per row: the text is
    all U+FFFD, final except its last character. Backing off every trailing U+FFFD left
    the window uncut and each step decoding the whole run (8,000 rows of 0xF0 on
    deepseek took 11.7 s)."""
    v = vocab(name)
    counted = CountingVocab(v)
    codec = WindowCodec(counted)
    run = byte_tokens(name, unit * (600 // len(unit)))
    end = byte_tokens(name, "🤖".encode()) + encode(name, " ok")
    d = codec.new([], skip)
    sent, most = "", 0
    for i in run + end:
        n0 = counted.ids
        sent += d.step([i])
        most = max(most, counted.ids - n0)
        assert len(d.ids) <= codec.window
    assert most <= (2 + codec.window - codec.context) * codec.window
    want = oracle(v, [], run + end, skip)
    assert want.startswith(sent) and sent + d.finish() == want


@pytest.mark.parametrize("skip", [False, True], ids=["keep", "skip"])
@pytest.mark.parametrize("name", ALL)
def test_fast_codec_makes_no_tokenizer_calls_and_holds_little(name: str, skip: bool, monkeypatch) -> None:
    codec = fast_codec(name)
    counted = CountingVocab(vocab(name))
    monkeypatch.setattr(codec, "vocab", counted)
    d = codec.new(encode(name, "prompt tail")[-8:], skip)
    counted.calls = 0  # the prompt's text, once, at start
    rows = long_stream(name)
    most = 0
    for row in rows:
        d.step(row)
        most = max(most, held_state(d))
    assert counted.calls == 0
    if isinstance(d, ByteDecoder):
        assert most <= 3  # an unfinished character
    else:
        assert most <= longest_byte_run(name, [i for row in rows for i in row])


def longest_byte_run(name: str, ids: list[int]) -> int:
    """The longest run of <0xXX> pieces in ids (0 for a tokenizer without them)."""
    is_byte = set(byte_ids(name)) if name in SENTENCEPIECE else set()
    longest = n = 0
    for i in ids:
        n = n + 1 if i in is_byte else 0
        longest = max(longest, n)
    return longest


@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_piece_decoder_holds_only_the_open_byte_run(name: str) -> None:
    codec = fast_codec(name)
    run = byte_tokens(name, "ü".encode() * 500)  # one long valid run
    d = codec.new([], False)
    sent = ""
    for k, i in enumerate(run, 1):
        sent += d.step([i])
        assert held_state(d) == k
    ok = encode(name, "ok")
    sent += d.step(ok)
    assert held_state(d) == 0 and sent == oracle(vocab(name), [], run + ok, False)
    assert sent.startswith("ü" * 500)


# --- cost: an open byte-fallback run on the window codec ---------------------------------------


@pytest.mark.parametrize("skip", [False, True], ids=["keep", "skip"])
@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_window_codec_work_is_linear_in_an_open_byte_run(name: str, skip: bool) -> None:
    """One-id rows of a byte-fallback run that stays open: the cut steps back over the
    whole run, so decoding the window each row cost the run again, O(run) a row and
    O(run^2) a run (6,000 rows: ~10 s on mistral_v3). Rows that only extend the run
    now decode nothing; the row that ends it decodes the run once."""
    v = vocab(name)
    word = encode(name, " ok then")
    for n in (1500, 6000):
        counted = CountingVocab(v)
        codec = WindowCodec(counted)
        run = byte_tokens(name, "中".encode() * (n // 3))
        d = codec.new([], skip)
        sent = "".join(d.step([i]) for i in run)
        assert counted.ids <= 2 * codec.window  # the rows before the run was open
        sent += "".join(d.step([i]) for i in word) + d.finish()
        assert counted.ids <= 2 * len(word) * (len(run) + codec.window)  # the run decoded a few times, not once a row
        assert sent == oracle(v, [], run + word, skip)


@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_window_codec_work_per_id_does_not_grow_with_the_runs(name: str) -> None:
    """Runs of byte pieces between words, in one-id rows: the ids decoded per id stay
    the same when the runs get longer or more numerous (the window is cut after each)."""
    v = vocab(name)
    word = encode(name, " ok")

    def per_id(length: int, runs: int) -> float:
        counted = CountingVocab(v)
        ids = (byte_tokens(name, "中".encode() * (length // 3)) + word) * runs
        d = WindowCodec(counted).new([], True)
        sent = "".join(d.step([i]) for i in ids) + d.finish()
        assert sent == oracle(v, [], ids, True)
        return counted.ids / len(ids)

    base = per_id(60, 20)
    for length, runs in ((60, 80), (600, 8), (3000, 2)):
        assert per_id(length, runs) <= base * 1.5, (length, runs)


@pytest.mark.parametrize("kind", CODECS)
@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_an_open_byte_run_is_bounded(name: str, kind: str) -> None:
    """An open run is held whole until it ends (all or nothing), so it is bounded: a run
    of MAX_OPEN_RUN pieces is served exactly, one that goes on past it (and past the
    window codec's window) raises RunTooLong, which the dispatcher answers too_large."""
    v, codec = vocab(name), codec_for(name, kind)
    run = byte_tokens(name, "中".encode() * (MAX_OPEN_RUN // 3))
    word = encode(name, " ok")
    d = codec.new([], True)
    sent = d.step(run) + "".join(d.step([i]) for i in word) + d.finish()
    assert sent == oracle(v, [], run + word, True)
    d = codec.new([], True)
    d.step(run)
    with pytest.raises(RunTooLong):
        for _ in range(64):
            d.step(byte_tokens(name, "中".encode()))
