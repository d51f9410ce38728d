"""The detokd SGLang plugin, loaded by SGLang's own plugin loader in fresh processes.

Each case is a child process of its own (plugin state is process-global) that imports
SGLang, and most start a detokenizer process that imports it too: ~10 s of CPU each. So
every child the selected tests read (`reads`) starts on first use, two at a time (this
machine's cores), and each test reads its own child's result.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import alive
from models import ROOT, entry_points, model_folder, plugin_path  # noqa: F401  (a fixture)

from detokd import zoo
from detokrig.sglang_frontend import rust_server_default

CHILD = Path(__file__).with_name("sglang_child.py")
CHILD_TIMEOUT = 480
BAD_PICKLE_ALLOW = "fractions.Fraction"  # module:name is fractions:Fraction
# The first test waits for its child among all of them: minutes on two cores.
pytestmark = pytest.mark.timeout(1800)
# The children a test reads: the module starts those of the tests selected, and no other.
reads = pytest.mark.sglang_child
# What detokd does with a setting or a file, the same on every release (pyproject.toml).
detokds_own_code = pytest.mark.detokds_own_code


def run_child(plugin_path: Path, *args: str, detokd_sglang: str | None = None, router: bool = False,
              extra_env: dict[str, str] | None = None, fails: bool = False) -> dict:
    """The child's result; `fails`: a child expected to exit with an error, as its exit
    status and output."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("DETOKD_SGLANG", "DETOKD_SGLANG_ROUTER", "DETOKD_SGLANG_PICKLE_ALLOW",
                        "SGLANG_PLUGINS", "SGLANG_RUST_SERVER")}
    env.update(extra_env or {})
    env["PYTHONPATH"] = os.pathsep.join([str(plugin_path), str(ROOT)])
    env["HF_HUB_OFFLINE"] = "1"
    if detokd_sglang is not None:
        env["DETOKD_SGLANG"] = detokd_sglang
    if router:
        env["DETOKD_SGLANG_ROUTER"] = "1"
    p = subprocess.run([sys.executable, str(CHILD), *args], env=env, capture_output=True, text=True,
                       timeout=CHILD_TIMEOUT)
    if fails:
        return {"returncode": p.returncode, "stdout": p.stdout, "stderr": p.stderr}
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"child failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return {**json.loads(lines[-1][len("RESULT "):]), "stderr": p.stderr}


def warnings_of(result: dict) -> list[str]:
    return [msg for level, msg in result["logs"] if level == "WARNING"]


def tiktoken_file(folder: Path) -> str:
    """A tokenizer SGLang decodes with a class of its own (TiktokenTokenizer, for a
    `--tokenizer-path` ending in .json) and detokd cannot: no Hugging Face fast backend.
    Every byte a token, one merge, SGLang's three special tokens."""
    path = folder / "tokenizer.json"
    regular = [{"bytes": [b], "token": b} for b in range(256)] + [{"bytes": list(b"he"), "token": 256}]
    special = [{"bytes": list(t.encode()), "token": 257 + k} for k, t in enumerate(["<|pad|>", "<|separator|>", "<|eos|>"])]
    path.write_text(json.dumps({"regular_tokens": regular, "special_tokens": special, "word_split": "V1"}))
    return str(path)


@pytest.fixture(scope="module")
def children(request, plugin_path, tmp_path_factory) -> dict[str, Future]:
    """Every child the selected tests of this module read, by case, started two at a time:
    {case: its result}. A `launch` child gets SGLang's own command-line arguments
    (`--device cpu` added) and the tokenizer folder its answer must be the decode of."""
    wanted = {case for item in request.session.items if item.module is request.module
              for mark in item.iter_markers("sglang_child") for case in mark.args}
    root = tmp_path_factory.mktemp("models")
    qwen2 = str(model_folder(root, "qwen2"))  # the model's own tokenizer: not detokd's default
    bare = str(model_folder(root, None))
    mistral = str(zoo.build("mistral_v3"))
    tiktoken = tiktoken_file(tmp_path_factory.mktemp("tiktoken"))
    cases = {
        "loader, unset": (["loader"], None),
        "loader, false": (["loader"], "false"),
        "loader, 1": (["loader"], "1"),
        "loader, True": (["loader"], "True"),
        "loader, mismatch": (["loader", "mismatch"], "1"),
        "loader, rust server": (["loader"], "1"),
        "loader, rust server, require": (["loader"], "require"),
        "sglang's own": (["launch", qwen2, "--model-path", qwen2], None),
        # --model-path only, as most deployments launch SGLang, with a deprecated parser
        # name that SGLang resolves ("qwen25" -> "qwen") in its runtime context.
        "model path": (["launch", qwen2, "--model-path", qwen2, "--tool-call-parser", "qwen25"], "1"),
        "tokenizer path": (["launch", mistral, "--model-path", bare, "--tokenizer-path", mistral], "1"),
        "tiktoken": (["launch", tiktoken, "--model-path", bare, "--tokenizer-path", tiktoken], "1"),
        "two processes": (["launch", qwen2, "--model-path", qwen2, "--detokenizer-worker-num", "2"], "1"),
        "two processes, router": (["launch", qwen2, "--model-path", qwen2, "--detokenizer-worker-num", "2"], "1"),
        "orphan": (["orphan", qwen2, "--model-path", qwen2], "1"),
    }
    # A port another process listens on, for the whole module: detokd's metrics port.
    taken = socket.create_server(("127.0.0.1", 0))
    cases["metrics port taken"] = (["launch", qwen2, "--model-path", qwen2], "1")
    # A DETOKD_CONFIG naming a CURVE key file that is not there.
    missing_key = tmp_path_factory.mktemp("curve") / "detokd.toml"
    missing_key.write_text(f'curve_secret_key = "{missing_key.parent}/gone.key_secret"\n')
    cases["missing CURVE key"] = (["launch", qwen2, "--model-path", qwen2], "1")
    # SGLang's addresses in a TMPDIR every user may write, without the sticky bit (a
    # Kubernetes emptyDir mounted on /tmp): SGLang's own detokenizer serves there.
    shared = tmp_path_factory.mktemp("shared-tmp")
    shared.chmod(0o777)
    cases["shared TMPDIR"] = (["launch", qwen2, "--model-path", qwen2], "1")
    envs = {"metrics port taken": {"DETOKD_METRICS_PORT": str(taken.getsockname()[1])},
            "missing CURVE key": {"DETOKD_CONFIG": str(missing_key)},
            "shared TMPDIR": {"TMPDIR": str(shared)},
            "loader, rust server": {"SGLANG_RUST_SERVER": "1"}, "loader, rust server, require": {"SGLANG_RUST_SERVER": "1"}}
    cases["pickle allow malformed"] = (["launch", qwen2, "--model-path", qwen2], "1")
    envs["pickle allow malformed"] = {"DETOKD_SGLANG_PICKLE_ALLOW": BAD_PICKLE_ALLOW}
    pool = ThreadPoolExecutor(2)
    futures = {}
    for case, (args, detokd_sglang) in cases.items():
        if case not in wanted:
            continue
        if args[0] != "loader":
            args = [*args, "--device", "cpu"]
        futures[case] = pool.submit(run_child, plugin_path, *args, detokd_sglang=detokd_sglang,
                                    router=case.endswith("router"), extra_env=envs.get(case),
                                    fails=case == "loader, rust server, require" and has_rust_server())
    yield futures
    pool.shutdown(cancel_futures=True)
    taken.close()


def test_the_entry_point_names_the_plugins_register_function():
    assert entry_points() == {"detokd": "detokd.sglang.plugin:register"}


@reads("loader, unset")
def test_without_detokd_sglang_sglangs_loader_leaves_the_launch_method_alone(children):
    result = children["loader, unset"].result()
    messages = [msg for _, msg in result["logs"]]
    assert "Executed general plugin: detokd" in messages  # discovered and run, by SGLang
    assert result["replaced"] is False
    assert not [m for m in messages if m.startswith(("detokd", "Applied"))]


@reads("loader, false")
@detokds_own_code
def test_a_false_detokd_sglang_leaves_the_launch_method_alone(children):
    assert children["loader, false"].result()["replaced"] is False


def test_enabled_is_true_only_for_one_true_yes(monkeypatch):
    from detokd.sglang import plugin

    for value, want in [("1", True), ("true", True), (" YES ", True), ("0", False), ("no", False), ("", False), ("on", False)]:
        monkeypatch.setenv("DETOKD_SGLANG", value)
        assert plugin.enabled() is want, value


@pytest.mark.parametrize("value", ["1", "True"])
@reads("loader, 1", "loader, True")
def test_with_detokd_sglang_the_launch_method_is_wrapped_around_sglangs_own(children, value):
    result = children[f"loader, {value}"].result()
    assert result["replaced"] is True and result["wraps_original"] is True
    assert not warnings_of(result)


@reads("loader, mismatch")
def test_on_a_schema_mismatch_the_method_stays_and_the_warning_names_the_field(children):
    result = children["loader, mismatch"].result()
    assert result["replaced"] is False
    (warning,) = [w for w in warnings_of(result) if "detokd" in w]
    assert "BatchStrOutput" in warning and "'time_stats'" in warning


def has_rust_server() -> bool:
    """Whether the installed SGLang has the opt-in Rust server (0.5.20 to 0.5.23 do)."""
    from sglang.srt.environ import envs

    return hasattr(envs, "SGLANG_RUST_SERVER")


def test_sglangs_rust_server_is_off_unless_the_operator_turns_it_on(monkeypatch):
    """The day SGLANG_RUST_SERVER defaults to true, SGLang's launch starts no detokenizer
    process and detokd is unused unless the operator sets SGLANG_RUST_SERVER=0: this
    fails saying what to do (issue 43, item 5; test_frontend.py watches the launch)."""
    from sglang.srt.environ import envs

    from detokd.sglang import plugin

    monkeypatch.delenv("SGLANG_RUST_SERVER", raising=False)
    setting = getattr(envs, "SGLANG_RUST_SERVER", None)
    assert setting is None or setting.get() is False, rust_server_default("SGLANG_RUST_SERVER defaults to true")
    assert plugin.rust_server() is False


@reads("loader, rust server")
def test_with_sglangs_rust_server_on_one_line_says_detokd_is_not_used(children):
    """SGLANG_RUST_SERVER=1: SGLang's Rust server tokenizes and detokenizes itself and its
    launch starts no detokenizer process, so the hook would never run: one warning line
    says so instead of silence (a release without the setting loads the plugin as ever)."""
    result = children["loader, rust server"].result()
    lines = [w for w in warnings_of(result) if "detokd" in w]
    if not has_rust_server():
        assert result["replaced"] is True and not lines, lines
        return
    assert len(lines) == 1, lines
    assert lines[0].startswith("detokd: not used") and "SGLANG_RUST_SERVER" in lines[0], lines[0]
    assert result["replaced"] is False


@reads("loader, rust server, require")
def test_with_sglangs_rust_server_on_detokd_sglang_require_fails_the_launch_in_one_line(children):
    result = children["loader, rust server, require"].result()
    if not has_rust_server():
        assert result["replaced"] is True
        return
    assert result["returncode"] != 0 and "RESULT" not in result["stdout"], result
    (line,) = [line for line in result["stderr"].splitlines() if "require" in line]
    assert line.startswith("detokd: DETOKD_SGLANG=require, and detokd is not used") and "SGLANG_RUST_SERVER" in line
    assert "Traceback" not in result["stderr"], result["stderr"][-3000:]


def assert_answers_and_dies_seen(result: dict) -> None:
    assert result["names"] == ["detokenizer"]
    assert result["reply_type"] == "BatchStrOutput" and result["rids"] == ["r0"]
    assert result["output_strs"] == result["expected"]
    assert result["death_seen"] is True and result["exitcode"] == -9
    if not result["sglangs_own"]:
        assert_outlives_its_decoding_process(result)


def assert_outlives_its_decoding_process(result: dict) -> None:
    """detokd's decoding process SIGKILLed: SGLang's watchdog sees nothing (the process
    it started lives on), and the next request is answered exactly by the next one."""
    assert result["decoding"] >= 1
    again = result["after_restart"]
    assert again["death_seen"] is False
    assert again["rids"] == ["r1"] and again["output_strs"] == result["expected"], again
    assert again["seconds"] < 2, again


def assert_detokds(result: dict) -> None:
    assert result["sglangs_own"] is False, warnings_of(result)
    infos = [msg for level, msg in result["logs"] if "replaced SGLang's detokenizer" in msg]
    import sglang

    assert len(infos) == 1 and f"(SGLang {sglang.__version__})" in infos[0]


@reads("sglang's own")
def test_sglangs_own_detokenizer_starts_answers_and_its_death_is_seen_without_the_plugin(children):
    result = children["sglang's own"].result()
    assert result["sglangs_own"] is True
    assert_answers_and_dies_seen(result)


@reads("model path")
def test_a_plain_model_path_launch_decodes_with_the_models_own_tokenizer(children):
    """`--model-path` alone: server_args.tokenizer_path stays None and SGLang resolves the
    tokenizer in its runtime context. The model's tokenizer (Qwen2) is not detokd's
    packaged default, so any other would garble."""
    result = children["model path"].result()
    assert_detokds(result)
    assert_answers_and_dies_seen(result)


@reads("model path")
def test_settings_are_read_as_sglang_resolved_them_not_as_given(children):
    """`--tool-call-parser qwen25` is SGLang's deprecated name of "qwen": its own
    detokenizer reads the resolved value from the runtime context, and so does detokd."""
    (line,) = [line for line in children["model path"].result()["stderr"].splitlines() if "settings from SGLang" in line]
    assert "tool_call_parser='qwen'" in line and "HTTP workers 1" in line


@reads("tokenizer path")
@detokds_own_code
def test_a_tokenizer_path_beside_a_bare_model_folder_is_the_tokenizer_detokd_decodes_with(children):
    result = children["tokenizer path"].result()
    assert_detokds(result)
    assert_answers_and_dies_seen(result)


@reads("tiktoken")
@detokds_own_code
def test_a_tokenizer_detokd_cannot_decode_as_sglang_does_keeps_sglangs_own_with_a_warning(children):
    result = children["tiktoken"].result()
    assert result["sglangs_own"] is True
    (warning,) = [w for w in warnings_of(result) if "detokd" in w]
    assert "keeping SGLang's own detokenizer" in warning and "fast (tokenizers) backend" in warning
    assert_answers_and_dies_seen(result)


@reads("metrics port taken")
@detokds_own_code
def test_a_metrics_port_in_use_keeps_sglangs_own_with_a_warning_not_a_dead_server(children):
    """detokd binds its metrics port after it told SGLang it serves, when failing would end
    SGLang's server: so it tries the port before."""
    result = children["metrics port taken"].result()
    assert result["sglangs_own"] is True
    (warning,) = [w for w in warnings_of(result) if "detokd" in w]
    assert "keeping SGLang's own detokenizer" in warning and "cannot serve metrics on 127.0.0.1:" in warning
    assert_answers_and_dies_seen(result)


@reads("pickle allow malformed")
@detokds_own_code
def test_a_malformed_pickle_allow_list_keeps_sglangs_own_with_a_warning_naming_it(children):
    """DETOKD_SGLANG_PICKLE_ALLOW is read before detokd tells the launch it serves: a
    value not of the form module:name is a fallback like any other, never a dead server
    (under DETOKD_SGLANG=require, then, a launch failure of one line, as
    test_fallback.py's require case shows for a bad DETOKD_CONFIG)."""
    result = children["pickle allow malformed"].result()
    assert result["sglangs_own"] is True
    (warning,) = [w for w in warnings_of(result) if "detokd" in w]
    assert "keeping SGLang's own detokenizer" in warning
    assert f"DETOKD_SGLANG_PICKLE_ALLOW: {BAD_PICKLE_ALLOW!r} is not module:name" in warning
    assert_answers_and_dies_seen(result)


@reads("two processes")
def test_several_detokenizer_processes_asked_for_are_one_detokd_on_sglangs_address(children):
    """--detokenizer-worker-num 2: one detokd process serves SGLang's address, as SGLang
    starts one detokenizer (SGLang's router in front of two would cost more per row than
    detokd spends in all); the log says so, it answers, and SGLang's watchdog sees it die."""
    result = children["two processes"].result()
    assert result["names"] == ["detokenizer"] and "(detokd)" in result["titles"][0]
    infos = [msg for level, msg in result["logs"] if "replaced SGLang's detokenizer" in msg]
    assert len(infos) == 1 and "one process for --detokenizer-worker-num 2" in infos[0]
    assert "DETOKD_SGLANG_ROUTER=1" in infos[0]
    assert result["rids"] == ["r0"] and result["output_strs"] == result["expected"]
    assert result["death_seen"] is True and result["exitcode"] == -9
    assert_outlives_its_decoding_process(result)


@reads("two processes, router")
def test_with_detokd_sglang_router_they_are_detokds_behind_sglangs_own_router(children):
    """DETOKD_SGLANG_ROUTER=1: SGLang's launch starts two detokd processes on private
    addresses and its own MultiDetokenizerRouter in front of them; the router's answer
    comes from detokd, and SGLang's watchdog sees a worker die."""
    result = children["two processes, router"].result()
    assert result["names"] == ["detokenizer_0", "detokenizer_1", "detokenizer_router"]
    assert ["(detokd)" in t for t in result["titles"]] == [True, True, False]
    infos = [msg for level, msg in result["logs"] if "replaced SGLang's detokenizer" in msg]
    assert len(infos) == 1 and "2 processes behind SGLang's router" in infos[0]
    assert result["rids"] == ["r0"] and result["output_strs"] == result["expected"]
    assert result["death_seen"] is True and result["exitcode"] == -9
    assert result["decoding"] == 2
    assert_outlives_its_decoding_process(result)


@reads("orphan")
@detokds_own_code
def test_detokds_process_dies_with_sglang(children):
    """SGLang killed without a word (os._exit, no teardown of its children): the
    detokenizer it started goes too (prctl PDEATHSIG, as SGLang's own), never an orphan
    holding SGLang's addresses."""
    result = children["orphan"].result()
    assert result["sglangs_own"] is False and result["output_strs"] == result["expected"]
    pids = result["pids"]
    assert len(pids) == 2  # the process SGLang started, and the decoding process it forked
    deadline = time.monotonic() + 30
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(alive, pids)), f"detokd's processes {pids} outlived SGLang"


@reads("missing CURVE key")
@detokds_own_code
def test_a_curve_key_that_cannot_be_read_keeps_sglangs_own_before_the_verdict(children):
    """Every check runs before detokd tells SGLang it serves: a CURVE key file that is
    not there is a fallback with one warning, never a detokenizer that SIGQUITs SGLang
    once it tries to bind."""
    result = children["missing CURVE key"].result()
    assert result["sglangs_own"] is True
    (warning,) = [w for w in warnings_of(result) if "detokd" in w]
    assert "keeping SGLang's own detokenizer" in warning and "cannot read CURVE key" in warning
    assert_answers_and_dies_seen(result)


@reads("shared TMPDIR")
@detokds_own_code
def test_sglangs_addresses_in_a_folder_every_user_may_write_are_served_with_the_tmpdir_advice(children):
    """A 0777 TMPDIR without the sticky bit: SGLang's own detokenizer serves there, so
    detokd does too (it never refuses what SGLang's own would serve), and says to set
    TMPDIR to a private folder."""
    result = children["shared TMPDIR"].result()
    assert_detokds(result)
    assert_answers_and_dies_seen(result)
    warnings = [line for line in result["stderr"].splitlines() if "not sticky" in line]
    assert warnings and all("detokd" in w and "TMPDIR" in w for w in warnings), warnings


@reads("model path")
def test_sglang_mode_counts_ids_and_special_tokens_as_the_tokenizer_command_does(children):
    """The count an operator reads in SGLang's log is the one `detokd tokenizer` prints for
    the same tokenizer (both: the ids skip_special_tokens removes)."""
    import re

    (line,) = [line for line in children["model path"].result()["stderr"].splitlines()
               if "decodes with SGLang's tokenizer" in line]
    name, ids, special = re.search(r"SGLang's tokenizer (\S+): (\d+) ids, (\d+) special", line).groups()
    out = subprocess.run([sys.executable, "-m", "detokd", "tokenizer", name, "--trials", "1"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True).stdout
    assert re.search(r"^ids\s+(\d+) \((\d+) special", out, re.M).groups() == (ids, special), (line, out)
