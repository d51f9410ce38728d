"""The tokenizer detokd decodes with as SGLang's detokenizer: SGLang's own, checked.

SGLang resolves its tokenizer in the runtime context it publishes (a plain `--model-path`
launch leaves `server_args.tokenizer_path` None and the resolved path in
`get_serving().tokenizer_path`), and its DetokenizerManager loads it with its own
`get_tokenizer` (which, for one, forces clean_up_tokenization_spaces off). detokd runs
that same method, so whatever SGLang's detokenizer would decode with, detokd decodes
with: model path, tokenizer path, mode, revision, remote code, backend. Before serving it
checks that the tables it built agree with that tokenizer's own answers; if they do not,
the plugin keeps SGLang's detokenizer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from types import SimpleNamespace

from ..tokenizer import TokenizerError, Vocab

# Text of every kind detokd decodes differently (byte-level and byte-fallback
# characters, CJK, emoji sequences, code, spaces): the decode probe of `mismatch`.
PROBE = "Hello, wörld! 你好，世界 𠀀𪚥 👨\u200d👩\u200d👧 Привет عالم नमस्ते\n\tdef f(x):  return x**2 "


@dataclass(frozen=True)
class Fingerprint:
    """What identifies a vocabulary: its size, its special ids, and its id -> token table."""

    size: int
    special_ids: tuple[int, ...]
    table_sha256: str

    def __str__(self) -> str:
        # all_special_ids: the special-token map, which may differ from the ids
        # skip_special_tokens removes (`detokd tokenizer`'s count), so it is named so.
        return f"{self.size} ids, {len(self.special_ids)} in the special-token map, table {self.table_sha256[:12]}"


def fingerprint(size: int, special_ids, tokens) -> Fingerprint:
    h = hashlib.sha256()
    for t in tokens:
        h.update(b"\x00" if t is None else t.encode("utf-8", "surrogatepass") + b"\x01")
    return Fingerprint(size, tuple(sorted(set(special_ids))), h.hexdigest())


def fingerprint_of(vocab: Vocab) -> Fingerprint:
    """detokd's side: the size and id -> token table it decodes with (read from the backend)."""
    return fingerprint(vocab.size, vocab.hf.all_special_ids, vocab.tokens)


def sglangs_tokenizer(server_args):
    """The tokenizer SGLang's own detokenizer loads: its own init_tokenizer, run on a
    bare holder (needs SGLang's runtime context published in this process)."""
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager

    holder = SimpleNamespace()
    DetokenizerManager.init_tokenizer(holder, server_args)
    if holder.tokenizer is None:
        raise TokenizerError("SGLang loads no tokenizer (skip_tokenizer_init)")
    return holder.tokenizer


def check(vocab: Vocab, tokenizer) -> Fingerprint:
    """The fingerprint detokd's tables for `tokenizer` share with the tokenizer's own
    answers, or TokenizerError saying how they disagree: size, special ids and the
    id -> token table through the tokenizer's Python API (detokd reads its backend), then
    the decode of a probe as SGLang's detokenizer decodes with a fast tokenizer
    (batch_decode), with and without skip_special_tokens, against the reference detokd's
    codecs are held to."""
    size = len(tokenizer)
    theirs = fingerprint(size, tokenizer.all_special_ids, tokenizer.convert_ids_to_tokens(list(range(size))))
    ours = fingerprint_of(vocab)
    if ours != theirs:
        raise TokenizerError(f"detokd's vocabulary ({ours}) is not SGLang's ({theirs})")
    ids = list(vocab.backend.encode(PROBE, add_special_tokens=True).ids) + sorted(vocab.special)[:8]
    for skip in (False, True):
        (want,) = tokenizer.batch_decode([ids], skip_special_tokens=skip, spaces_between_special_tokens=True)
        got = vocab.decode(ids, skip)
        if got != want:
            raise TokenizerError(
                f"decode (skip_special_tokens={skip}) differs: detokd {got[:60]!r}, SGLang {want[:60]!r}")
    return ours
