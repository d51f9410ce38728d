"""The baseline detokenizers `python -m detokbench bench` runs beside detokd, each written
here from its published algorithm (docs/performance.md, "The baselines"): a class with a
per-request `step(ids) -> str` / `finish() -> str` (tests/test_baselines.py checks them)
and a class-level `step_batch` that detokbench.baselines_server calls once per message.
"""

from __future__ import annotations

import codecs
import json
import re
from functools import cached_property
from typing import Sequence

from detokd.core.decoder import byte_level_alphabet
from detokd.tokenizer import resolve

REPLACEMENT = "\ufffd"


class Tok:
    """One tokenizer (a zoo name or a folder with tokenizer.json, as detokd resolves its
    `tokenizer` setting), loaded the ways the baselines need it, each lazily."""

    def __init__(self, name_or_path: str) -> None:
        p = resolve(name_or_path)
        self.dir = p if p.is_dir() else p.parent
        self._tables: dict[bool, list[bytes]] = {}

    @cached_property
    def fast(self):
        """tokenizers.Tokenizer (Rust)."""
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.dir / "tokenizer.json"))

    @cached_property
    def hf(self):
        """transformers' tokenizer, what SGLang's DetokenizerManager calls."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.dir))

    @cached_property
    def decoder_kinds(self) -> list[dict]:
        with open(self.dir / "tokenizer.json", encoding="utf-8") as f:
            d = json.load(f).get("decoder") or {}
        return d.get("decoders", []) if d.get("type") == "Sequence" else [d]

    @cached_property
    def strip_first_space(self) -> bool:
        """SentencePiece decoders strip the text's one leading space (Strip start=1)."""
        return any(k.get("type") == "Strip" and k.get("start", 0) > 0 for k in self.decoder_kinds)

    def byte_table(self, skip_special_tokens: bool = True) -> list[bytes]:
        """The bytes each id contributes to the text, for every id of the vocabulary (the floor's)."""
        table = self._tables.get(skip_special_tokens)
        if table is not None:
            return table
        fast = self.fast
        kinds = {k.get("type") for k in self.decoder_kinds}
        added = fast.get_added_tokens_decoder()
        if "ByteLevel" in kinds:
            inv = byte_level_alphabet()

            def piece(tok: str) -> bytes:
                return bytes(inv[c] for c in tok)
        elif "ByteFallback" in kinds or "Metaspace" in kinds or "Replace" in kinds:
            byte_re = re.compile(r"<0x([0-9A-Fa-f]{2})>")

            def piece(tok: str) -> bytes:
                m = byte_re.fullmatch(tok)
                return bytes([int(m.group(1), 16)]) if m else tok.replace("\u2581", " ").encode()
        else:  # WordPiece and others: an approximation, good enough for a speed floor

            def piece(tok: str) -> bytes:
                return tok.encode()

        table = [b""] * fast.get_vocab_size(with_added_tokens=True)
        for i in range(len(table)):
            if (a := added.get(i)) is not None:
                table[i] = b"" if (a.special and skip_special_tokens) else a.content.encode()
            elif (t := fast.id_to_token(i)) is not None:
                table[i] = piece(t)
        self._tables[skip_special_tokens] = table
        return table


class Stream:
    """One request's incremental detokenizer."""

    def __init__(self, tok: Tok, prompt_tail: Sequence[int] = (), skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tok, self.skip, self.spaces = tok, skip_special_tokens, spaces_between_special_tokens

    def step(self, ids: Sequence[int]) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def finish(self) -> str:
        return ""

    @classmethod
    def prepare(cls, tok: Tok) -> None:
        """Load what the algorithm needs before the first request (outside any timing)."""
        tok.fast  # noqa: B018

    @classmethod
    def step_batch(cls, streams: Sequence[Stream], idss: Sequence[Sequence[int]],
                   finishing: Sequence[bool]) -> list[str]:
        """One step of many requests; a finishing request's text includes its flush."""
        return [s.step(ids) + s.finish() if f else s.step(ids) for s, ids, f in zip(streams, idss, finishing, strict=True)]


class NaiveStream(Stream):
    """Full re-decode of every id each step, send the new suffix."""

    def __init__(self, tok: Tok, prompt_tail: Sequence[int] = (), *flags: bool) -> None:
        super().__init__(tok, prompt_tail, *flags)
        self._decode = tok.fast.decode
        self.ids = list(prompt_tail)
        self.sent = len(self._decode(self.ids, skip_special_tokens=self.skip)) if self.ids else 0

    def step(self, ids):
        self.ids.extend(ids)
        return self.finish(hold=True)

    def finish(self, hold: bool = False):
        text = self._decode(self.ids, skip_special_tokens=self.skip)
        if hold and text.endswith(REPLACEMENT):  # maybe a character still incomplete: wait
            return ""
        new, self.sent = text[self.sent:], len(text)
        return new


_CJK = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
        (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def _is_cjk(cp: int) -> bool:
    return any(a <= cp <= b for a, b in _CJK)


def find_printable_text(text: str) -> str:
    """The longest prefix of `text` that holds only whole words (the HF TextStreamer rule)."""
    if text.endswith("\n"):
        return text
    if text and _is_cjk(ord(text[-1])):
        return text
    if len(text) > 1 and _is_cjk(ord(text[-2])):
        return text[:-1]
    return text[: text.rfind(" ") + 1]


class SGLangStream(Stream):
    """SGLang DetokenizerManager's incremental detokenization (surr/read windows)."""

    INIT_OFFSET = 5  # prompt ids that prime the window (INIT_INCREMENTAL_DETOKENIZATION_OFFSET)

    def __init__(self, tok: Tok, prompt_tail: Sequence[int] = (), *flags: bool) -> None:
        super().__init__(tok, prompt_tail, *flags)
        self.decode_ids: list[int] = list(prompt_tail)[-self.INIT_OFFSET:]
        self.surr_offset, self.read_offset = 0, len(self.decode_ids)
        self.decoded_text, self.sent_offset = "", 0

    @classmethod
    def prepare(cls, tok: Tok) -> None:
        tok.hf  # noqa: B018

    def step(self, ids):
        return self.step_batch([self], [ids], [False])[0]

    def finish(self):
        return self.step_batch([self], [[]], [True])[0]

    @classmethod
    def step_batch(cls, streams, idss, finishing):
        surr_ids: list[list[int]] = []
        read_ids: list[list[int]] = []
        for s, ids in zip(streams, idss, strict=True):
            s.decode_ids.extend(ids)
            read_ids.append(s.decode_ids[s.surr_offset:])
            surr_ids.append(s.decode_ids[s.surr_offset : s.read_offset])
        # One flag for the whole batch, from its first request, as SGLang does.
        first = streams[0]
        hf = first.tok.hf
        flags = {"skip_special_tokens": first.skip, "spaces_between_special_tokens": first.spaces}
        surr_texts = hf.batch_decode(surr_ids, **flags)
        read_texts = hf.batch_decode(read_ids, **flags)
        out: list[str] = []
        for i, s in enumerate(streams):
            new_text = read_texts[i][len(surr_texts[i]):]
            if not finishing[i]:
                if new_text and not new_text.endswith(REPLACEMENT):
                    s.decoded_text = s.decoded_text + new_text
                    s.surr_offset = s.read_offset
                    s.read_offset = len(s.decode_ids)
                    new_text = ""
                else:
                    new_text = find_printable_text(new_text)
            output_str = s.decoded_text + new_text
            out.append(output_str[s.sent_offset:])
            s.sent_offset = len(output_str)
        return out


_INVALID_PREFIX = "Invalid prefix encountered"


class DecodeStreamStream(Stream):
    """vLLM's FastIncrementalDetokenizer core: tokenizers' DecodeStream, one step per id."""

    def __init__(self, tok: Tok, prompt_tail: Sequence[int] = (), *flags: bool) -> None:
        super().__init__(tok, prompt_tail, *flags)
        from tokenizers.decoders import DecodeStream

        self._new = DecodeStream
        self._fast = tok.fast
        self.stream = DecodeStream(skip_special_tokens=self.skip)
        self._step = self.stream.step
        suffix = list(prompt_tail)
        if len(suffix) > 4:
            # The shortest suffix of 4..23 ids that decodes without a replacement char.
            for i in range(4, min(len(suffix) + 1, 24)):
                cand = suffix[-i:]
                if REPLACEMENT not in tok.fast.decode(cand, skip_special_tokens=self.skip):
                    suffix = cand
                    break
        for t in suffix:  # prime the stream, discarding its text
            self._protected_step(t)

    def _protected_step(self, t: int):
        try:
            return self._step(self._fast, t)
        except (OverflowError, TypeError):
            return None
        except Exception as e:  # tokenizers raises a plain Exception
            if _INVALID_PREFIX not in str(e):
                raise
            # Non-monotonic byte-fallback output broke the stream: start a fresh one.
            self.stream = self._new(skip_special_tokens=self.skip)
            self._step = self.stream.step
            return self._step(self._fast, t)

    def step(self, ids):
        if len(ids) == 1:
            try:
                return self._step(self._fast, ids[0]) or ""
            except Exception:
                return self._protected_step(ids[0]) or ""
        parts = [self._protected_step(t) for t in ids]
        return "".join([p for p in parts if p])


class FloorStream(Stream):
    """Join of precomputed per-token bytes + an incremental UTF-8 decoder. Nothing else."""

    def __init__(self, tok: Tok, prompt_tail: Sequence[int] = (), *flags: bool) -> None:
        super().__init__(tok, prompt_tail, *flags)
        self.table = tok.byte_table(self.skip)
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        self._dec = dec.decode
        self._strip = False
        if prompt_tail:
            dec.decode(b"".join([self.table[i] for i in prompt_tail]))
        else:
            self._strip = tok.strip_first_space

    @classmethod
    def prepare(cls, tok: Tok) -> None:
        tok.byte_table(True)
        tok.byte_table(False)

    def step(self, ids):
        table = self.table
        text = self._dec(b"".join([table[i] for i in ids]))
        if self._strip and text:
            self._strip = False
            if text[0] == " ":
                return text[1:]
        return text

    def finish(self):
        return self._dec(b"", True)


ALGOS: dict[str, type[Stream]] = {"naive": NaiveStream, "sglang": SGLangStream, "decodestream": DecodeStreamStream,
                                  "floor": FloorStream}
