"""Baseline detokenizers that `python -m detokbench bench` runs beside detokd, through the
same harness, each written here from its published algorithm (no code copied):
naive (re-decode everything each step), sglang (SGLang's DetokenizerManager, its
garbage collector not frozen, as in the real one), decodestream (vLLM's
FastIncrementalDetokenizer) and floor (msgpack, a join of per-token bytes, UTF-8).
docs/performance.md, "The baselines", says what each does and leaves out.

Each is a class with a per-request `step(ids) -> str` / `finish() -> str` (checked
in-process by tests/test_baselines.py) and a class-level `step_batch` the server loop
(detokbench.baselines_server) calls once per inbound message.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from pathlib import Path
from typing import Sequence

from detokd.core.decoder import byte_level_alphabet
from detokd.tokenizer import resolve

REPLACEMENT = "\ufffd"


# --------------------------------------------------------------------------- tokenizers


def tokenizer_dir(name_or_path: str) -> Path:
    """A zoo name (deepseek, mistral_v3, qwen2, ...) or a folder with tokenizer.json, as
    detokd resolves its `tokenizer` setting (a tokenizer.json file: its folder)."""
    p = resolve(name_or_path)
    return p if p.is_dir() else p.parent


class Tok:
    """One tokenizer, loaded the ways the baselines need it (each lazily)."""

    def __init__(self, name_or_path: str) -> None:
        self.name = name_or_path
        self.dir = tokenizer_dir(name_or_path)
        self._fast = None
        self._hf = None
        self._tables: dict[bool, list[bytes]] = {}
        self._strip_first: bool | None = None

    @property
    def fast(self):
        """tokenizers.Tokenizer (Rust)."""
        if self._fast is None:
            from tokenizers import Tokenizer

            self._fast = Tokenizer.from_file(str(self.dir / "tokenizer.json"))
        return self._fast

    @property
    def hf(self):
        """transformers' tokenizer, what SGLang's DetokenizerManager calls."""
        if self._hf is None:
            os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(str(self.dir))
        return self._hf

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.fast.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- the floor's precomputed per-token bytes

    def _decoder_json(self) -> dict:
        with open(self.dir / "tokenizer.json", encoding="utf-8") as f:
            return json.load(f).get("decoder") or {}

    def _decoder_kinds(self) -> list[dict]:
        d = self._decoder_json()
        return d.get("decoders", []) if d.get("type") == "Sequence" else [d]

    @property
    def strip_first_space(self) -> bool:
        """SentencePiece decoders strip the text's one leading space (Strip start=1)."""
        if self._strip_first is None:
            self._strip_first = any(
                k.get("type") == "Strip" and k.get("start", 0) > 0 for k in self._decoder_kinds()
            )
        return self._strip_first

    def byte_table(self, skip_special_tokens: bool = True) -> list[bytes]:
        """The bytes each id contributes to the text, for every id of the vocabulary."""
        table = self._tables.get(skip_special_tokens)
        if table is not None:
            return table
        fast = self.fast
        kinds = {k.get("type") for k in self._decoder_kinds()}
        n = fast.get_vocab_size(with_added_tokens=True)
        added = fast.get_added_tokens_decoder()
        if "ByteLevel" in kinds:
            inv = byte_level_alphabet()

            def piece(tok: str) -> bytes:
                return bytes(inv[c] for c in tok)
        elif "ByteFallback" in kinds or "Metaspace" in kinds or "Replace" in kinds:
            byte_re = re.compile(r"<0x([0-9A-Fa-f]{2})>")

            def piece(tok: str) -> bytes:
                m = byte_re.fullmatch(tok)
                if m:
                    return bytes([int(m.group(1), 16)])
                return tok.replace("\u2581", " ").encode()
        else:  # WordPiece and others: an approximation, good enough for a speed floor

            def piece(tok: str) -> bytes:
                return tok.encode()

        table = [b""] * n
        for i in range(n):
            a = added.get(i)
            if a is not None:
                table[i] = b"" if (a.special and skip_special_tokens) else a.content.encode()
                continue
            t = fast.id_to_token(i)
            if t is not None:
                table[i] = piece(t)
        self._tables[skip_special_tokens] = table
        return table


# --------------------------------------------------------------------------- algorithms


class Stream:
    """One request's incremental detokenizer."""

    def __init__(
        self,
        tok: Tok,
        prompt_tail: Sequence[int] = (),
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tok = tok
        self.skip = skip_special_tokens
        self.spaces = spaces_between_special_tokens

    def step(self, ids: Sequence[int]) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def finish(self) -> str:
        return ""

    @classmethod
    def prepare(cls, tok: Tok) -> None:
        """Load what the algorithm needs before the first request (outside any timing)."""
        tok.fast  # noqa: B018

    @classmethod
    def step_batch(cls, streams: Sequence["Stream"], idss: Sequence[Sequence[int]], finishing: Sequence[bool]) -> list[str]:
        """One step of many requests; a finishing request's text includes its flush."""
        return [s.step(ids) + s.finish() if f else s.step(ids) for s, ids, f in zip(streams, idss, finishing)]


class NaiveStream(Stream):
    """Full re-decode of every id each step, send the new suffix."""

    def __init__(self, tok, prompt_tail=(), skip_special_tokens=True, spaces_between_special_tokens=True):
        super().__init__(tok, prompt_tail, skip_special_tokens, spaces_between_special_tokens)
        self._decode = tok.fast.decode
        self.ids = list(prompt_tail)
        self.sent = len(self._decode(self.ids, skip_special_tokens=self.skip)) if self.ids else 0

    def step(self, ids):
        self.ids.extend(ids)
        text = self._decode(self.ids, skip_special_tokens=self.skip)
        if text.endswith(REPLACEMENT):  # maybe a character still incomplete: wait
            return ""
        new = text[self.sent:]
        self.sent = len(text)
        return new

    def finish(self):
        text = self._decode(self.ids, skip_special_tokens=self.skip)
        new = text[self.sent:]
        self.sent = len(text)
        return new


def _is_cjk(cp: int) -> bool:
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B73F
        or 0x2B740 <= cp <= 0x2B81F
        or 0x2B820 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


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

    def __init__(self, tok, prompt_tail=(), skip_special_tokens=True, spaces_between_special_tokens=True):
        super().__init__(tok, prompt_tail, skip_special_tokens, spaces_between_special_tokens)
        tail = list(prompt_tail)[-self.INIT_OFFSET:] if prompt_tail else []
        self.decode_ids: list[int] = tail
        self.surr_offset = 0
        self.read_offset = len(tail)
        self.decoded_text = ""
        self.sent_offset = 0

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
        for s, ids in zip(streams, idss):
            s.decode_ids.extend(ids)
            read_ids.append(s.decode_ids[s.surr_offset:])
            surr_ids.append(s.decode_ids[s.surr_offset : s.read_offset])
        # One flag for the whole batch, from its first request, as SGLang does.
        first = streams[0]
        hf = first.tok.hf
        surr_texts = hf.batch_decode(
            surr_ids, skip_special_tokens=first.skip, spaces_between_special_tokens=first.spaces
        )
        read_texts = hf.batch_decode(
            read_ids, skip_special_tokens=first.skip, spaces_between_special_tokens=first.spaces
        )
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

    def __init__(self, tok, prompt_tail=(), skip_special_tokens=True, spaces_between_special_tokens=True):
        super().__init__(tok, prompt_tail, skip_special_tokens, spaces_between_special_tokens)
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

    def __init__(self, tok, prompt_tail=(), skip_special_tokens=True, spaces_between_special_tokens=True):
        super().__init__(tok, prompt_tail, skip_special_tokens, spaces_between_special_tokens)
        self.table = tok.byte_table(skip_special_tokens)
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


ALGOS: dict[str, type[Stream]] = {
    "naive": NaiveStream,
    "sglang": SGLangStream,
    "decodestream": DecodeStreamStream,
    "floor": FloorStream,
}
