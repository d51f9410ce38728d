"""Model folders and detokd's plugin entry point, made as SGLang finds them.

No weights exist or are read: SGLang's launch, front end and detokenizer read a model
folder's config.json and its tokenizer files only.
"""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest
from conftest import vocab

from detokd import zoo

ROOT = Path(__file__).resolve().parents[2]
# A chat template for /v1/chat/completions: the messages' contents in order, then the
# assistant's turn (the stand-in scheduler reads its tags from the prompt).
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> Path:
    """A dist-info declaring this worktree's entry point, to put first on a child's path, so
    SGLang discovers the plugin through importlib.metadata as a pip install would make it
    (entry_points() keeps the first distribution of a name, shadowing an older install)."""
    d = tmp_path_factory.mktemp("dist")
    info = d / "detokd-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: detokd\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points().items())
    )
    return d


def entry_points() -> dict[str, str]:
    """detokd's `sglang.srt.plugins` entry points, as pyproject.toml declares them."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["sglang.srt.plugins"]


def eos_of(name: str) -> int:
    """The tokenizer's eos, or its first special token when it names none."""
    v = vocab(name)
    return v.hf.eos_token_id if v.hf.eos_token_id is not None else sorted(v.special)[0]


def model_folder(root: Path, name: str | None) -> Path:
    """A weightless model folder (a tiny LlamaForCausalLM config) holding the packaged
    tokenizer `name` with a chat template, or no tokenizer at all (None: SGLang must be
    told one with --tokenizer-path)."""
    folder = root / f"model-{name or 'bare'}"
    if folder.exists():
        return folder
    # Tests that start servers side by side may ask for the same folder at once.
    return zoo.built_aside(folder, lambda building: _fill_model_folder(building, name))


def _fill_model_folder(building: Path, name: str | None) -> None:
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2, "max_position_embeddings": 4096, "torch_dtype": "float32",
    }
    if name is not None:
        for f in zoo.build(name).iterdir():
            if f.is_file():
                shutil.copy(f, building / f.name)
        v, eos = vocab(name), eos_of(name)
        tc_path = building / "tokenizer_config.json"
        tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
        tc.update(eos_token=v.hf.convert_ids_to_tokens(eos), chat_template=CHAT_TEMPLATE)
        tc_path.write_text(json.dumps(tc))
        config.update(vocab_size=v.size, eos_token_id=eos)
    (building / "config.json").write_text(json.dumps(config))
