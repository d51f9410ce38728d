"""Whatever detokd's process cannot do before it serves, SGLang serves with its own
detokenizer, and its log says why in one line naming the installed release.

Each case starts SGLang as users do (launch_server with `--model-path` only; the
stand-in scheduler in the model's place), with one thing broken in detokd's process
alone (breakage/sitecustomize.py: as a release lacking it would be) or a bad
DETOKD_CONFIG, and sees the server answer a request with the oracle's text through
SGLang's own detokenizer. DETOKD_SGLANG=require turns the same fallback into a launch
failure of one line. Every server of the module starts on first use, two at a time (each
is SGLang and torch: ~3 GB and ~1 min of CPU), and each test reads its own.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import sglang
from models import model_folder, plugin_path  # noqa: F401  (a fixture)

from detokrig import ROOT
from detokrig.sglang_cases import oracle
from detokrig.sglang_frontend import Frontend

BREAKAGE = Path(__file__).resolve().parent / "breakage"
pytestmark = pytest.mark.timeout(900)
KEEPING = "keeping SGLang's own detokenizer"

# case: (DETOKD_TEST_BREAK, bad DETOKD_CONFIG, what the warning names)
CASES = {
    "missing module": ("module:sglang.srt.managers.detokenizer_manager", None,
                       "No module named 'sglang.srt.managers.detokenizer_manager'"),
    "missing symbol": ("symbol:sglang.srt.managers.multi_tokenizer_mixin:_handle_output_by_index", None,
                       "_handle_output_by_index"),
    "unknown field": ("field:BatchStrOutput:draft_texts", None, "'draft_texts'"),
    "bad DETOKD_CONFIG": (None, "max_state = 10\n", "`max_state`"),
    "tokenizer mismatch": ("vocab:", None, "is not SGLang's"),
}


def serve(root: Path, plugin_path: Path, tag: str, break_spec: str | None, config: str | None,
          detokd_sglang: str = "1") -> Frontend:
    env = {"PYTHONPATH": ":".join(map(str, [BREAKAGE, plugin_path, ROOT])), "DETOKD_SGLANG": detokd_sglang}
    if break_spec:
        env["DETOKD_TEST_BREAK"] = break_spec
    if config is not None:
        path = root / f"{tag}.toml"
        path.write_text(config)
        env["DETOKD_CONFIG"] = str(path)
    return Frontend(model_folder(root, "qwen2"), detokenizer="detokd", encoding="pickle", plugin_path=plugin_path,
                    log_dir=root, env=env, tag=f"-{tag}")


def generate(fe: Frontend) -> tuple[str, str]:
    """One request through the server: what the client got, and the oracle's text."""
    body = {"text": "Please answer. [reply 1] [step 2]", "rid": "probe", "sampling_params": {"max_new_tokens": 200}}
    resp = requests.post(fe.url + "/generate", json=body, timeout=300)
    resp.raise_for_status()
    # The stand-in records a request once its last batch went out: it may follow the answer.
    deadline = time.monotonic() + 60
    while "probe" not in fe.records() and time.monotonic() < deadline:
        time.sleep(0.05)
    return resp.json()["text"], oracle("qwen2", fe.records()["probe"])


def served_once(fe: Frontend) -> tuple[str, str, list[str], str]:
    """Once the server is ready: what a client got and the oracle's text, its detokenizer
    processes' titles and its log; the server is closed however that ends."""
    try:
        fe.wait_ready()
        got, want = generate(fe)
        titles = [" ".join(p.cmdline()) for p in fe.detokenizer_processes()]
        return got, want, titles, fe.log_tail(1 << 20)
    finally:
        fe.close()


def refused_once(fe: Frontend) -> tuple[int, str]:
    """A server expected to fail its launch: its exit status and its log."""
    try:
        return fe.proc.wait(600), fe.log_tail(1 << 20)
    finally:
        fe.close()


@pytest.fixture(scope="module")
def outcomes(plugin_path, tmp_path_factory) -> dict[str, Future]:  # noqa: F811
    """{case: what its server did}, every server of the module started two at a time."""
    root = tmp_path_factory.mktemp("fallback")
    private = root / "private"
    private.mkdir(mode=0o700)
    jobs = {
        case: (lambda case=case: served_once(serve(root, plugin_path, case.replace(" ", "-"), *CASES[case][:2])))
        for case in CASES
    }
    jobs["require"] = lambda: refused_once(serve(root, plugin_path, "require", None, "max_state = 10\n",
                                                 detokd_sglang="require"))
    jobs["tmpdir"] = lambda: (*served_once(Frontend(model_folder(root, "qwen2"), detokenizer="detokd", encoding="pickle",
                                                    plugin_path=plugin_path, log_dir=root, env={"TMPDIR": str(private)},
                                                    tag="-tmpdir")), str(private))
    pool = ThreadPoolExecutor(2)
    yield {case: pool.submit(job) for case, job in jobs.items()}
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("case", list(CASES))
def test_sglang_serves_with_its_own_detokenizer_and_one_line_says_why(case, outcomes):
    got, want, titles, log = outcomes[case].result()
    assert got == want
    assert len(titles) == 1 and "(detokd)" not in titles[0], titles
    (line,) = [line for line in log.splitlines() if KEEPING in line]
    assert f"SGLang {sglang.__version__}" in line and CASES[case][2] in line, line
    assert "replaced SGLang's detokenizer" not in log and "Traceback" not in log


def test_detokd_sglang_require_turns_a_fallback_into_a_launch_failure_of_one_line(outcomes):
    status, log = outcomes["require"].result()
    assert status != 0
    lines = [line for line in log.splitlines() if "DETOKD_SGLANG=require" in line]
    assert len(lines) == 1 and "`max_state`" in lines[0] and f"SGLang {sglang.__version__}" in lines[0]
    assert "Traceback" not in log and KEEPING not in log


def test_with_tmpdir_a_private_folder_detokd_serves_without_the_world_writable_warning(outcomes):
    """SGLang makes its ipc addresses in $TMPDIR; in /tmp detokd warns that another user
    could bind one first, and says to set TMPDIR (tests/sglang/test_frontend.py reads that
    line); in a folder only this user can write there is nothing to warn of."""
    got, want, titles, log, private = outcomes["tmpdir"].result()
    assert got == want and len(titles) == 1 and "(detokd)" in titles[0], titles
    assert "replaced SGLang's detokenizer" in log and private in log  # its addresses were there
    assert "writable by every user" not in log
