"""Incremental decoding: token ids in, exact text out, O(new ids) per step.

The text of a request is `decode(tail + out)[len(decode(tail)):]` (docs/protocol.md).
Every decoder here decodes the whole sequence tail + out *incrementally* and drops
the first `len(decode(tail))` characters of what it commits, so the prompt's own
text can never leak into the output, also when the prompt ends mid-character.

A decoder commits text only once no later id can change it, and never takes text
back. Three codecs, one per shape of tokenizer decoder:

- ByteCodec, for byte-level BPE: each id maps to fixed bytes; the text is the
  lossy UTF-8 decode of their concatenation, done by an incremental UTF-8 decoder
  that holds an incomplete character until it completes (or the stream ends).
- PieceCodec, for decoders that map each token to text on its own, with one rule
  for the first token of the text (SentencePiece's Replace/Fuse/Strip and Metaspace,
  WordPiece's "##" joins and clean-up): two precomputed tables, `first` and `next`.
  With ByteFallback, runs of <0xXX> tokens become text only when the run ends:
  Hugging Face turns a whole invalid run into U+FFFD per byte, so a later byte can
  rewrite characters an earlier one completed.
- WindowCodec, the exact generic path for any other decoder: it decodes a bounded
  window of ids with the tokenizer itself and commits the prefix that the last id
  cannot change.

Each codec's tables are computed from the tokenizer's own decoder and verified
against the tokenizer's decode at start-up; `make_codec` falls back to the window
path for a tokenizer whose tables do not verify.
"""

from __future__ import annotations

import codecs
import random
from typing import TYPE_CHECKING, Any, Protocol

from .. import logs
from ..tokenizer import Vocab

log = logs.get(__name__)

REPLACEMENT = "\ufffd"
PENDING_BYTES = 3  # the most bytes of an unfinished UTF-8 character
_utf8_decode = codecs.utf_8_decode
# An open ByteFallback run is held whole until it ends (its text is all or nothing), so
# it is bounded: 64 Ki pieces is 21,845 three-byte characters none of which has a piece.
MAX_OPEN_RUN = 1 << 16


class RunTooLong(ValueError):
    """An open byte-fallback run past MAX_OPEN_RUN: the request cannot be served exactly."""


class Decoder(Protocol):
    # While not None, the text of one more id `i` is `settled_text[i]` when that is not None:
    # the caller may look it up instead of calling step (the decoder's state would not
    # change). None while the decoder holds anything back.
    settled_text: list[str | None] | None

    def step(self, ids: list[int]) -> str:
        """Feed new ids (all < vocab size); return the text they commit."""

    def finish(self) -> str:
        """End of stream: return what is still held, decoded as the tokenizer would."""

    def peek(self) -> str:
        """What `finish` would return now, the state unchanged: the text of the ids fed
        so far that is not committed yet (rendered as if the stream ended here)."""


class Codec(Protocol):
    name: str

    def new(self, tail: list[int], skip_special: bool) -> Decoder: ...


class PromptDecoder:
    """What the byte and piece decoders share: the prompt tail is fed first, and the
    characters of its text that come out later are dropped from what they commit.

    The oracle's prompt text is the tail's full decode: what the decoder committed
    from it, plus what it still holds (an unfinished character, an open byte run) as
    `finish` would render it. The held part comes out again, completed or not, in
    the output's first committed text, and is dropped from there.

    A subclass defines step and finish (each passing what it commits through
    `_emit`), `held` (what it holds, rendered as finish would) and `settle` (sets
    `settled_text` for its new state).
    """

    __slots__ = ("prompt_left", "settled_text")

    def __init__(self) -> None:
        self.prompt_left = 0  # characters of the prompt's text still to drop
        self.settled_text: list[str | None] | None = None

    def step(self, ids: list[int]) -> str:
        raise NotImplementedError

    def finish(self) -> str:
        raise NotImplementedError

    def held(self) -> str:
        raise NotImplementedError

    def peek(self) -> str:
        return self.held()[self.prompt_left :]  # as finish's _emit would drop the prompt's

    def settle(self) -> None:
        raise NotImplementedError

    def _prime(self, tail: list[int]) -> None:
        if tail:
            self.step(tail)  # the prompt's committed text: never output
            self.prompt_left = len(self.held())
        self.settle()

    def _emit(self, text: str) -> str:
        """Committed text, less the prompt's characters still in it; sets settled_text anew."""
        left = self.prompt_left
        if left and text:
            text, self.prompt_left = text[left:], max(0, left - len(text))
        self.settle()
        return text


# --- byte-level BPE ----------------------------------------------------------------------


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable character map, inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class ByteDecoder(PromptDecoder):
    """Bytes pending an incomplete character, and the tables to map ids to bytes.

    Most tokens are whole characters on their own; `id_text` holds their text, so the
    common step (one id, nothing pending) is a list lookup with no UTF-8 decode.
    """

    __slots__ = ("id_bytes", "id_text", "pending")

    def __init__(self, id_bytes: list[bytes], id_text: list[str | None]) -> None:
        super().__init__()
        self.id_bytes = id_bytes
        self.id_text = id_text  # None where an id's bytes are no whole characters
        self.pending = b""
        self.settled_text = id_text

    def settle(self) -> None:
        self.settled_text = None if self.pending or self.prompt_left else self.id_text

    def step(self, ids: list[int]) -> str:
        if len(ids) == 1 and not self.pending:
            i = ids[0]
            text = self.id_text[i]
            if text is not None:
                if not self.prompt_left:
                    return text  # nothing held before or after: settled_text stays as it is
                return self._emit(text)
            text, n = _utf8_decode(self.id_bytes[i], "replace", False)
            self.pending = self.id_bytes[i][n:]
        else:
            id_bytes = self.id_bytes
            data = self.pending + b"".join([id_bytes[i] for i in ids])
            # C's incremental UTF-8: invalid bytes become U+FFFD (maximal subparts, as
            # Rust's from_utf8_lossy), an incomplete character at the end stays pending.
            text, n = _utf8_decode(data, "replace", False)
            self.pending = data[n:]
        return self._emit(text)

    def held(self) -> str:
        return _utf8_decode(self.pending, "replace", True)[0] if self.pending else ""

    def finish(self) -> str:
        text = self.held()
        self.pending = b""
        return self._emit(text)


class WordRelease(PromptDecoder):
    """A decoder that, while a character is split across ids, sends the text since its
    last whole step only as SGLang's detokenizer sends it: all of it when it ends in a
    CJK ideograph, else up to its last space (sglang.utils.find_printable_text). The
    same text in the end, never sooner than SGLang's; so a stop string an engine checks
    in token space, and misses the start of beside a split character, reaches the client
    no further than it does through SGLang's own detokenizer. Mixed into a decoder class
    that says when a character is `split`.
    """

    if not TYPE_CHECKING:  # the concrete classes hold these: two bases with slots cannot mix
        __slots__ = ()
    dirty: str
    released: int

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.dirty = ""  # text since the last step that ended on a whole character
        self.released = 0  # how much of it went out

    def split(self) -> bool:
        """Whether the text so far ends inside a character split across ids."""
        raise NotImplementedError

    def step(self, ids: list[int]) -> str:
        text = super().step(ids)
        if self.split():
            dirty = self.dirty + text
            n = _printable(dirty)
            out = dirty[self.released : n] if n > self.released else ""
            self.dirty, self.released = dirty, max(n, self.released)
            return out
        if self.dirty:  # the split character completed: the rest goes out with it
            text = self.dirty[self.released :] + text
            self.dirty, self.released = "", 0
        return text

    def finish(self) -> str:
        text = self.dirty[self.released :] + super().finish()
        self.dirty, self.released = "", 0
        return text

    def peek(self) -> str:
        return self.dirty[self.released :] + super().peek()


class WordByteDecoder(WordRelease, ByteDecoder):
    __slots__ = ("dirty", "released")

    def split(self) -> bool:
        return bool(self.pending)


# CJK ideograph blocks, as SGLang's detokenizer tells them (unified, extensions A-E,
# compatibility ideographs and their supplement); none begins below _CJK_FROM.
_CJK_FROM = 0x3400
_CJK = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
        (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def _printable(text: str) -> int:
    """How much of `text`, followed by a split character, SGLang's detokenizer sends."""
    if text:
        c = ord(text[-1])
        if c >= _CJK_FROM and any(lo <= c <= hi for lo, hi in _CJK):
            return len(text)
    return text.rfind(" ") + 1


def _whole(b: bytes) -> str | None:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return None


class ByteCodec:
    """Byte-level BPE: a token is a fixed byte string; skipped specials are empty."""

    name = "bytes"

    def __init__(self, vocab: Vocab, release: str = "char") -> None:
        self.decoder = WordByteDecoder if release == "word" else ByteDecoder
        alphabet = byte_level_alphabet()
        id_bytes: list[bytes] = []
        for tok in vocab.tokens:
            if tok is None:
                id_bytes.append(b"")
            elif all(c in alphabet for c in tok):
                id_bytes.append(bytes([alphabet[c] for c in tok]))
            else:  # added tokens outside the byte alphabet decode to their own UTF-8
                id_bytes.append(tok.encode())
        self.vocab = vocab
        # Each id's bytes, and its text where they are whole characters, with special
        # tokens kept or skipped (skipped, they are empty).
        self.bytes_keep_special = id_bytes
        self.bytes_skip_special = [b"" if i in vocab.special else t for i, t in enumerate(id_bytes)]
        self.text_keep_special = [_whole(t) for t in self.bytes_keep_special]
        self.text_skip_special = [_whole(t) for t in self.bytes_skip_special]

    def new(self, tail: list[int], skip_special: bool) -> ByteDecoder:
        if skip_special:
            d = self.decoder(self.bytes_skip_special, self.text_skip_special)
        else:
            d = self.decoder(self.bytes_keep_special, self.text_keep_special)
        d._prime(tail)
        if isinstance(d, WordRelease):  # the prompt's text is never sent, held or not
            d.dirty, d.released = "", 0
        return d


# --- per-token pieces (SentencePiece, WordPiece, Metaspace) ----------------------------------


class PieceDecoder(PromptDecoder):
    __slots__ = ("first", "next", "byte_of", "strip", "fresh", "run", "run_first")

    def __init__(self, codec: PieceCodec, skip_special: bool) -> None:
        super().__init__()
        # Each id's text as the text's first token, and after another (None: skipped).
        self.first = codec.first_skip_special if skip_special else codec.first_keep_special
        self.next = codec.next_skip_special if skip_special else codec.next_keep_special
        self.byte_of = codec.byte_of
        self.strip = codec.strip
        self.fresh = True  # no token has reached the decoder yet
        self.run: bytearray | None = None  # open ByteFallback run
        self.run_first = False

    def settle(self) -> None:
        self.settled_text = None if self.fresh or self.run is not None or self.prompt_left else self.next

    def held(self) -> str:
        """The open byte run, rendered as if it ended here."""
        run = self.run
        if run is None:
            return ""
        try:
            text = run.decode("utf-8")
        except UnicodeDecodeError:
            text = REPLACEMENT * len(run)  # Hugging Face's ByteFallback: one per byte
        if self.run_first and self.strip and text[:1] == " ":
            text = text[1:]
        return text

    def _close_run(self) -> str:
        text = self.held()
        self.run = None
        return text

    def step(self, ids: list[int]) -> str:
        out = []
        byte_of = self.byte_of
        for i in ids:
            b = byte_of[i]
            if b >= 0:
                if self.run is None:
                    self.run = bytearray()
                    self.run_first = self.fresh
                    self.fresh = False
                self.run.append(b)
                continue
            piece = (self.first if self.fresh else self.next)[i]
            if piece is None:  # a skipped special token: invisible to the decoder
                continue
            self.fresh = False
            if self.run is not None:
                out.append(self._close_run())
            out.append(piece)
        if self.run is not None and len(self.run) > MAX_OPEN_RUN:
            raise RunTooLong(len(self.run))
        return self._emit("".join(out))

    def finish(self) -> str:
        return self._emit(self._close_run() if self.run is not None else "")


class WordPieceDecoder(WordRelease, PieceDecoder):
    __slots__ = ("dirty", "released")

    def split(self) -> bool:
        """An open byte run that is no whole UTF-8 yet (where the tokenizer's decode ends
        in U+FFFD, as SGLang's detokenizer tells a split character)."""
        return self.run is not None and _whole(bytes(self.run)) is None


class PieceCodec:
    """Decoders that render each token alone, given only whether it comes first."""

    name = "pieces"

    def __init__(self, vocab: Vocab, release: str = "char") -> None:
        self.decoder = WordPieceDecoder if release == "word" else PieceDecoder
        types = vocab.decoder_types()
        dec = vocab.backend.decoder
        anchor = "a"  # a plain token to stand before each one, making it "not first"
        base = dec.decode([anchor])
        self.vocab = vocab
        self.strip = "Strip" in types
        fallback = "ByteFallback" in types
        n = vocab.size
        self.byte_of = [-1] * n  # the byte a <0xXX> piece stands for, else -1
        first: list[str | None] = [None] * n
        nxt: list[str | None] = [None] * n
        for i, tok in enumerate(vocab.tokens):
            if tok is None:
                first[i] = nxt[i] = ""
                continue
            if fallback and len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
                try:
                    self.byte_of[i] = int(tok[3:5], 16)
                    continue
                except ValueError:
                    pass
            first[i] = dec.decode([tok])
            pair = dec.decode([anchor, tok])
            nxt[i] = pair[len(base) :] if pair.startswith(base) else pair
        self.first_keep_special, self.next_keep_special = first, nxt
        self.first_skip_special = [None if i in vocab.special else p for i, p in enumerate(first)]
        self.next_skip_special = [None if i in vocab.special else p for i, p in enumerate(nxt)]

    def new(self, tail: list[int], skip_special: bool) -> PieceDecoder:
        d = self.decoder(self, skip_special)
        d._prime(tail)
        if isinstance(d, WordRelease):  # the prompt's text is never sent, held or not
            d.dirty, d.released = "", 0
        return d


# --- the generic window ----------------------------------------------------------------------


class WindowDecoder:
    """Decodes a bounded window of ids with the tokenizer and commits what is stable.

    Invariant: the first `committed` characters of decode(window) have been sent
    (or belong to the prompt). The last `hold` ids, an open byte run, and up to
    PENDING_BYTES trailing U+FFFD stay uncommitted; the window is cut at the front only where the cut
    leaves the text's end unchanged, so `committed` stays meaningful.

    With skip_special, special ids never enter the window: the tokenizer drops them
    before its decoder runs, so they are invisible to it. Kept, they would hide an
    open byte run at the window's end (the run goes on across them) and, after an
    unfinished character, pile up in a window that can never be cut.
    """

    __slots__ = ("codec", "skip_special", "hidden", "ids", "committed", "text")
    settled_text: list[str | None] | None = None  # every step goes through the tokenizer

    def __init__(self, codec: WindowCodec, tail: list[int], skip_special: bool) -> None:
        self.codec = codec
        self.skip_special = skip_special
        self.hidden = codec.vocab.special if skip_special else frozenset()
        hidden = self.hidden
        self.ids = [i for i in tail if i not in hidden]
        self.text = codec.vocab.decode(self.ids, skip_special) if tail else ""
        self.committed = len(self.text)  # the prompt's text is never emitted

    def step(self, ids: list[int]) -> str:
        hidden = self.hidden
        if hidden:
            ids = [i for i in ids if i not in hidden]
        if not ids:
            return ""
        codec = self.codec
        if codec.byte_runs and self._in_run(ids):
            # Byte pieces that extend an open run the cut below already steps back over:
            # nothing before the run can be committed yet either, so decoding now would
            # only cost the whole run again, per row (quadratic in the run's length).
            self.ids.extend(ids)
            if len(self.ids) > codec.window + MAX_OPEN_RUN:
                raise RunTooLong(len(self.ids))
            return ""
        self.ids.extend(ids)
        decode = codec.vocab.decode
        text = decode(self.ids, self.skip_special)
        cut = len(self.ids) - codec.hold
        if codec.byte_runs:
            while cut > 0 and codec.is_byte[self.ids[cut - 1]]:
                cut -= 1
        stable = decode(self.ids[:cut], self.skip_special) if cut > 0 else ""
        n = _common_prefix(stable, text)
        # A later id can still complete the character an incomplete UTF-8 sequence at
        # the end stands for: at most 3 bytes, so at most 3 U+FFFD (one per byte, as
        # ByteFallback renders them; one in all, as lossy UTF-8 does). Those before
        # are final: backing off all of them left a run of broken bytes uncommitted,
        # so the window could never be cut and each step decoded the whole run.
        floor = max(self.committed, n - PENDING_BYTES)
        while n > floor and text[n - 1] == REPLACEMENT:
            n -= 1
        out = text[self.committed : n] if n > self.committed else ""
        self.committed = max(self.committed, n)
        self.text = text
        self._trim()
        return out

    def _in_run(self, ids: list[int]) -> bool:
        """Whether `ids` are all byte pieces and the window's last `hold` ids are too:
        then the last step's cut stood at the run's start, and this one's would too."""
        is_byte, window, hold = self.codec.is_byte, self.ids, self.codec.hold
        if len(window) < hold or not all([is_byte[i] for i in window[-hold:]]):
            return False
        return all([is_byte[i] for i in ids])

    def finish(self) -> str:
        out = self.peek()
        self.committed = len(self.text)
        return out

    def peek(self) -> str:
        if self.codec.byte_runs and self.ids and self.codec.is_byte[self.ids[-1]]:
            self.text = self.codec.vocab.decode(self.ids, self.skip_special)  # rows taken by _in_run
        return self.text[self.committed :]

    def _trim(self) -> None:
        codec = self.codec
        excess = len(self.ids) - codec.window
        if excess <= 0:
            return
        # Cut no further than the committed text reaches, and only where the rest
        # decodes to exactly the end of the current text.
        for d in range(excess, len(self.ids) - codec.context):
            rest = self.ids[d:]
            text = codec.vocab.decode(rest, self.skip_special)
            gone = len(self.text) - len(text)
            if 0 <= gone <= self.committed and self.text.endswith(text):
                self.ids, self.text, self.committed = rest, text, self.committed - gone
                return


def _common_prefix(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class WindowCodec:
    name = "window"

    def __init__(self, vocab: Vocab, hold: int = 1, context: int = 8, window: int = 32) -> None:
        self.vocab = vocab
        # transformers' clean-up rewrites across up to three tokens (" ' " -> "'").
        self.hold = 3 if vocab.cleanup else hold
        self.context = context
        self.window = window
        self.byte_runs = "ByteFallback" in vocab.decoder_types()
        self.is_byte = [
            bool(tok and len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">")) for tok in vocab.tokens
        ]

    def new(self, tail: list[int], skip_special: bool) -> WindowDecoder:
        return WindowDecoder(self, tail, skip_special)


# --- choosing a codec ----------------------------------------------------------------------


def make_codec(vocab: Vocab, prefer: str = "auto", release: str = "char") -> Codec:
    """The fastest codec that reproduces this tokenizer's decode exactly. `release`:
    "word" sends the text before a character split across ids as SGLang's detokenizer
    does (WordRelease; the window codec, for tokenizers no fast codec fits, ignores it)."""
    if prefer == "window":
        return WindowCodec(vocab)
    types = vocab.decoder_types()
    candidate: Codec | None = None
    if vocab.cleanup:
        candidate = None  # transformers' clean-up is not per-token: only the window is exact
    elif types == ["ByteLevel"]:
        candidate = ByteCodec(vocab, release)
    elif types and set(types) <= {"Replace", "ByteFallback", "Fuse", "Strip", "Metaspace", "WordPiece"}:
        candidate = PieceCodec(vocab, release)
    if candidate is not None:
        bad = self_check(vocab, candidate)
        if bad is None:
            return candidate
        log.warning("tokenizer %s: %s codec disagrees with decode (%s); using the window codec",
                    vocab.name, candidate.name, bad)
    elif prefer != "auto":
        raise ValueError(f"no {prefer} codec for tokenizer {vocab.name}")
    return WindowCodec(vocab)


def self_check(vocab: Vocab, codec: Codec, trials: int = 200, seed: int = 0) -> str | None:
    """Decode random id streams, split at random, and compare with the tokenizer's decode."""
    rng = random.Random(seed)
    sample = vocab.backend.encode("Hello, wörld! 你好，世界 🤖👍🏽 Привет عالم नमस्ते\n\tdef f(x): return x**2").ids
    specials = sorted(vocab.special) or [0]
    for t in range(trials):
        n = rng.randrange(1, 24)
        pool = [rng.randrange(vocab.size) for _ in range(4)] + sample + specials[:8]
        ids = [rng.choice(pool) for _ in range(n)]
        k = rng.randrange(0, len(ids))
        tail, out = ids[:k], ids[k:]
        skip = bool(t & 1)
        d = codec.new(tail, skip)
        got = []
        i = 0
        while i < len(out):
            j = i + rng.randrange(1, 4)
            got.append(d.step(out[i:j]))
            i = j
        got.append(d.finish())
        want = vocab.reference(tail, out, skip)
        if "".join(got) != want:
            return f"ids {tail}|{out} skip={skip}: {''.join(got)!r} != {want!r}"
    return None
