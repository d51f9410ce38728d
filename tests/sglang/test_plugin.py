"""The detokd SGLang plugin, loaded by SGLang's own plugin loader in fresh processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from conftest import alive
from detokd import zoo

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("sglang_child.py")


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> Path:
    """A dist-info declaring this worktree's entry point, first on the child's path, so
    SGLang discovers the plugin through importlib.metadata as a pip install would make it
    (entry_points() keeps the first distribution of a name, shadowing an older install)."""
    d = tmp_path_factory.mktemp("dist")
    info = d / "detokd-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: detokd\nVersion: 0.1.0\n")
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["sglang.srt.plugins"]
    (info / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
    )
    return d


def run_child(plugin_path: Path, *args: str, detokd_sglang: str | None = None, timeout: float = 480) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DETOKD_SGLANG", "SGLANG_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join([str(plugin_path), str(ROOT)])
    env["HF_HUB_OFFLINE"] = "1"
    if detokd_sglang is not None:
        env["DETOKD_SGLANG"] = detokd_sglang
    p = subprocess.run([sys.executable, str(CHILD), *args], env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"child failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def warnings_of(result: dict) -> list[str]:
    return [msg for level, msg in result["logs"] if level == "WARNING"]


def test_the_entry_point_names_the_plugins_register_function():
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["sglang.srt.plugins"]
    assert eps == {"detokd": "detokd.sglang.plugin:register"}


def test_without_detokd_sglang_sglangs_loader_leaves_the_launch_method_alone(plugin_path):
    result = run_child(plugin_path, "loader")
    messages = [msg for _, msg in result["logs"]]
    assert "Executed general plugin: detokd" in messages  # discovered and run, by SGLang
    assert result["replaced"] is False
    assert not [m for m in messages if m.startswith(("detokd", "Applied"))]


def test_a_false_detokd_sglang_leaves_the_launch_method_alone(plugin_path):
    assert run_child(plugin_path, "loader", detokd_sglang="false")["replaced"] is False


def test_enabled_is_true_only_for_one_true_yes(monkeypatch):
    from detokd.sglang import plugin

    for value, want in [("1", True), ("true", True), (" YES ", True), ("0", False), ("no", False), ("", False), ("on", False)]:
        monkeypatch.setenv("DETOKD_SGLANG", value)
        assert plugin.enabled() is want, value


@pytest.mark.parametrize("value", ["1", "True"])
def test_with_detokd_sglang_the_launch_method_is_wrapped_around_sglangs_own(plugin_path, value):
    result = run_child(plugin_path, "loader", detokd_sglang=value)
    assert result["replaced"] is True and result["wraps_original"] is True
    assert not warnings_of(result)


def test_on_a_schema_mismatch_the_method_stays_and_the_warning_names_the_field(plugin_path):
    result = run_child(plugin_path, "loader", "mismatch", detokd_sglang="1")
    assert result["replaced"] is False
    (warning,) = [w for w in warnings_of(result) if "detokd" in w]
    assert "BatchStrOutput" in warning and "'time_stats'" in warning


def config_only(d: Path) -> Path:
    """A tiny model config SGLang's server args resolve offline (no weights are read)."""
    from transformers import Qwen2Config

    Qwen2Config(architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, vocab_size=151936).to_json_file(d / "config.json")
    return d


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A model folder holding its tokenizer (a real Qwen2 one, not detokd's default)."""
    d = tmp_path_factory.mktemp("model")
    shutil.copytree(zoo.build("qwen2"), d, dirs_exist_ok=True)
    return str(config_only(d))


@pytest.fixture(scope="module")
def bare_model_dir(tmp_path_factory) -> str:
    """A model folder without a tokenizer: SGLang must be told one with --tokenizer-path."""
    return str(config_only(tmp_path_factory.mktemp("bare-model")))


@pytest.fixture(scope="module")
def tiktoken_file(tmp_path_factory) -> str:
    """A tokenizer SGLang decodes with a class of its own (TiktokenTokenizer, for a
    `--tokenizer-path` ending in .json) and detokd cannot: no Hugging Face fast backend.
    Every byte a token, one merge, SGLang's three special tokens."""
    path = tmp_path_factory.mktemp("tiktoken") / "tokenizer.json"
    regular = [{"bytes": [b], "token": b} for b in range(256)] + [{"bytes": list(b"he"), "token": 256}]
    special = [{"bytes": list(t.encode()), "token": 257 + k} for k, t in enumerate(["<|pad|>", "<|separator|>", "<|eos|>"])]
    path.write_text(json.dumps({"regular_tokens": regular, "special_tokens": special, "word_split": "V1"}))
    return str(path)


def launch(plugin_path: Path, oracle: str, *sglang_args: str, mode: str = "launch", detokd_sglang: str | None = "1") -> dict:
    """The detokenizer launched from SGLang's own command-line arguments (`--device cpu` added)."""
    return run_child(plugin_path, mode, oracle, *sglang_args, "--device", "cpu", detokd_sglang=detokd_sglang)


def assert_answers_and_dies_seen(result: dict) -> None:
    assert result["names"] == ["detokenizer"]
    assert result["reply_type"] == "BatchStrOutput" and result["rids"] == ["r0"]
    assert result["output_strs"] == result["expected"]
    assert result["death_seen"] is True and result["exitcode"] == -9


def assert_detokds(result: dict) -> None:
    assert result["sglangs_own"] is False, warnings_of(result)
    infos = [msg for level, msg in result["logs"] if "replaced SGLang's detokenizer" in msg]
    assert len(infos) == 1 and "sglang-0.5.23" in infos[0]


def test_sglangs_own_detokenizer_starts_answers_and_its_death_is_seen_without_the_plugin(plugin_path, model_dir):
    result = launch(plugin_path, model_dir, "--model-path", model_dir, detokd_sglang=None)
    assert result["sglangs_own"] is True
    assert_answers_and_dies_seen(result)


def test_a_plain_model_path_launch_decodes_with_the_models_own_tokenizer(plugin_path, model_dir):
    """`--model-path` alone, as most deployments launch SGLang: server_args.tokenizer_path
    stays None and SGLang resolves the tokenizer in its runtime context. The model's
    tokenizer (Qwen2) is not detokd's packaged default, so any other would garble."""
    result = launch(plugin_path, model_dir, "--model-path", model_dir)
    assert_detokds(result)
    assert_answers_and_dies_seen(result)


def test_a_tokenizer_path_beside_a_bare_model_folder_is_the_tokenizer_detokd_decodes_with(plugin_path, bare_model_dir):
    mistral = str(zoo.build("mistral_v3"))
    result = launch(plugin_path, mistral, "--model-path", bare_model_dir, "--tokenizer-path", mistral)
    assert_detokds(result)
    assert_answers_and_dies_seen(result)


def test_a_tokenizer_detokd_cannot_decode_as_sglang_does_keeps_sglangs_own_with_a_warning(plugin_path, bare_model_dir, tiktoken_file):
    result = launch(plugin_path, tiktoken_file, "--model-path", bare_model_dir, "--tokenizer-path", tiktoken_file)
    assert result["sglangs_own"] is True
    (warning,) = [w for w in warnings_of(result) if "detokd" in w]
    assert "keeping SGLang's own detokenizer" in warning and "fast (tokenizers) backend" in warning
    assert_answers_and_dies_seen(result)


def test_detokds_process_dies_with_sglang(plugin_path, model_dir):
    """SGLang killed without a word (os._exit, no teardown of its children): the
    detokenizer it started goes too (prctl PDEATHSIG, as SGLang's own), never an orphan
    holding SGLang's addresses."""
    result = launch(plugin_path, model_dir, "--model-path", model_dir, mode="orphan")
    assert result["sglangs_own"] is False and result["output_strs"] == result["expected"]
    pid = result["pid"]
    deadline = time.monotonic() + 30
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid), f"detokd's detokenizer (pid {pid}) outlived SGLang"
