"""Loading a tokenizer and caching every vocabulary fact detokd needs.

Nothing on the per-token path may ask the tokenizer for a vocabulary-sized fact
(vLLM #30343: `len(tokenizer)` rebuilt the added vocabulary on every token), so
`Vocab` computes them once here: the id bound, the special ids, each id's token
string, and what kind of decoder the tokenizer runs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

from . import logs, zoo

if TYPE_CHECKING:  # types only: importing transformers costs seconds
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

log = logs.get(__name__)


class TokenizerError(RuntimeError):
    """The configured tokenizer cannot be found or loaded."""


@dataclass(frozen=True, eq=False)
class Vocab:
    name: str
    hf: PreTrainedTokenizerBase  # transformers' fast tokenizer: the oracle's decode
    backend: Tokenizer  # its tokenizers.Tokenizer
    size: int  # ids in [0, size) are in the vocabulary
    special: frozenset[int]
    tokens: tuple[str | None, ...]  # id -> token string as the decoder sees it
    decoder: dict | None  # the decoder's JSON description
    cleanup: bool  # transformers' clean_up_tokenization_spaces
    extra: dict = field(default_factory=dict)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        """The reference text of `ids`, exactly as transformers' fast `decode` gives it."""
        if self.cleanup:
            return cast(str, self.hf.decode(ids, skip_special_tokens=skip_special_tokens))  # one row: one str
        # Same result without transformers' Python overhead (no clean-up to apply).
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def reference(self, tail: list[int], out: list[int], skip_special_tokens: bool = True) -> str:
        """docs/protocol.md's text of output ids `out` after prompt ids `tail`: what
        streaming must add up to, `decode(tail + out)[len(decode(tail)):]`. The one
        oracle of detokd's self-check, the demo, the benchmarks and the tests."""
        full = self.decode(list(tail) + list(out), skip_special_tokens)
        return full[len(self.decode(list(tail), skip_special_tokens)) :] if tail else full

    def decoder_types(self) -> list[str | None]:
        d = self.decoder
        if d is None:
            return []
        if d.get("type") == "Sequence":
            return [x.get("type") for x in d.get("decoders", [])]
        return [d.get("type")]


def resolve(spec: str) -> Path:
    """Map a config's `tokenizer` value to a folder or tokenizer.json file."""
    path = Path(os.path.expanduser(spec))
    if path.is_dir():
        if not (path / "tokenizer.json").exists() and not (path / "tokenizer.model").exists():
            raise TokenizerError(f"tokenizer folder {spec!r} holds neither tokenizer.json nor tokenizer.model")
        return path
    if path.is_file():
        return path
    if spec in zoo.NAMES:
        try:
            return zoo.build(spec)
        except Exception as exc:  # a packaged tokenizer's builder failing is a config problem
            raise TokenizerError(f"packaged tokenizer {spec!r} could not be built: {exc}") from exc
    raise TokenizerError(
        f"tokenizer {spec!r} is neither a folder, a tokenizer.json file, nor a packaged name "
        f"({', '.join(zoo.NAMES)})"
    )


def load(spec: str) -> Vocab:
    path = resolve(spec)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub, even by accident
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        if path.is_dir():
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(path))
        else:
            from transformers import PreTrainedTokenizerFast

            hf = PreTrainedTokenizerFast(tokenizer_file=str(path))
    except Exception as exc:
        raise TokenizerError(f"cannot load tokenizer {spec!r} from {path}: {exc}") from exc
    return of(hf, spec)


def of(hf, name: str) -> Vocab:
    """The Vocab of a tokenizer someone else loaded (SGLang's own, in SGLang mode)."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise TokenizerError(f"tokenizer {name!r} has no fast (tokenizers) backend")
    size = len(hf)
    tokens = tuple(backend.id_to_token(i) for i in range(size))
    cleanup = bool(getattr(hf, "clean_up_tokenization_spaces", False))
    return Vocab(
        name=name,
        hf=hf,
        backend=backend,
        size=size,
        special=_skipped(hf if cleanup else backend, hf.all_special_ids, backend.get_added_tokens_decoder(), size),
        tokens=tokens,
        decoder=_decoder_json(backend),
        cleanup=cleanup,
    )


def _skipped(reference, listed, added, size: int) -> frozenset[int]:
    """The ids that skip_special_tokens removes, as the reference decode (`reference`,
    the same object Vocab.decode calls) removes them.

    Which ids those are has moved between releases (transformers 5.19 with tokenizers
    0.23 keeps added tokens that all_special_ids lists but the tokenizer does not flag
    special, such as Mistral v7's [/REF]), so ask the decode itself: a candidate is
    skipped when it renders alone but vanishes with skip_special_tokens.
    """
    candidates = [i for i in set(listed) | set(added) if 0 <= i < size]
    return frozenset(
        i
        for i in candidates
        if reference.decode([i], skip_special_tokens=False) and not reference.decode([i], skip_special_tokens=True)
    )


def _decoder_json(backend) -> dict | None:
    """The decoder's JSON description. Its own pickle state where the bindings give
    one: parsing the whole tokenizer.json instead would build the vocabulary and
    merges as Python objects, tens of MB of peak memory for one small dict."""
    dec = backend.decoder
    if dec is None:
        return None
    try:
        return json.loads(dec.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return json.loads(backend.to_str()).get("decoder")
