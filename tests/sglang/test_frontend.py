"""detokd behind SGLang's own HTTP server and TokenizerManager, with real clients.

SGLang's launch_server path on CPU with a plain `--model-path` (SGLang resolves the
tokenizer itself), the stand-in scheduler (detokrig/sglang_standin.py: SGLang's Req and output
streamer, no model) and the detokenizer the plugin starts: detokd, also for
--detokenizer-worker-num 2 (one process, or two behind SGLang's router with
DETOKD_SGLANG_ROUTER), or SGLang's own for comparison. ~30 concurrent mixed
requests per server through the `openai` client (/v1/completions, /v1/chat/completions)
and SGLang's /generate, streaming and not, one client hanging up mid-stream. Each
client's text must equal the oracle (the tokenizer's decode of the ids the stand-in
emitted, in SGLang's prompt context, with SGLang's trim rules) and SGLang's own run.
"""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from models import model_folder, plugin_path  # noqa: F401  (a fixture: this worktree's entry point)

from detokrig.sglang_cases import call, oracle, requests_for
from detokrig.sglang_frontend import Frontend


def _router_routes_by_rid() -> bool:
    from sglang.srt.managers.multi_tokenizer_mixin import MultiDetokenizerRouter

    return hasattr(MultiDetokenizerRouter, "_pick_for")


# SGLang 0.5.22 and older's MultiDetokenizerRouter routes rows by their HTTP worker alone
# and asserts each names one, which the TokenizerManager stamps only with several HTTP
# workers: SGLang's own router serves only that layout there (runs.py, ROUTED).
ROUTER_EXTRA = () if _router_routes_by_rid() else ("--tokenizer-worker-num", "2")

# (tokenizer, encoding): not DeepSeek, detokd's packaged default, so a wrong tokenizer shows.
CASES = [("qwen2", "pickle"), ("mistral_v3", "msgpack")]
# Per case: SGLang's own detokenizer, detokd, and detokd under --detokenizer-worker-num 2:
# (detokenizer, worker num, behind SGLang's router). Under SGLang's default encoding, detokd's
# default layout (one process); under the other, two detokd processes behind SGLang's router.
# Where that layout needs two HTTP workers (ROUTER_EXTRA), SGLang's own runs in it too, so
# that what SGLang does when a detokenizer dies there is compared with its own.
RUNS = {
    ("qwen2", "pickle"): [("sglang", 1, False), ("detokd", 1, False), ("detokd", 2, False)],
    ("mistral_v3", "msgpack"): [("sglang", 2, True) if ROUTER_EXTRA else ("sglang", 1, False),
                                ("detokd", 1, False), ("detokd", 2, True)],
}
# The first test runs every case's servers (11 processes that import SGLang and torch,
# ~10 s of CPU each, per case): minutes on two cores, past pytest's per-test timeout.
pytestmark = pytest.mark.timeout(1800)


@dataclass
class Served:
    """One server's run, as the tests read it: the mix, what each client got, the
    stand-in's records, and what the server did after (detokd's runs only)."""

    mix: list[dict]
    answers: dict[str, dict]
    records: dict[str, dict]
    titles: list[str]  # its detokenizer processes' titles (the router's not among them)
    health: int | None = None  # /health after the mix (its hang-up included)
    health_generate: int | None = None
    exit_after_kill: int | None = None  # the server's exit status once a detokd process was killed
    log: str = ""  # the server's log, as it was after the mix


def run_case(root: Path, plugin_path: Path, name: str, enc: str) -> dict[tuple, Served]:
    """The case's servers (SGLang's own detokenizer, detokd, detokd under worker num 2),
    started together (SGLang's imports dominate start-up), the whole mix sent to each at
    once, what the tests check recorded, then every server closed. One case at a time:
    the three servers are 9-11 processes of SGLang and torch, ~9 GB."""
    model = model_folder(root, name)
    fes = {(name, enc, det, workers, router): Frontend(model, detokenizer=det, encoding=enc, workers=workers,
                                                        router=router, plugin_path=plugin_path, log_dir=root,
                                                        extra=ROUTER_EXTRA if router else ())
           for det, workers, router in RUNS[name, enc]}
    try:
        for fe in fes.values():
            fe.wait_ready()
        mix = requests_for(name)
        jobs = [(key, r) for key in fes for r in mix]
        with ThreadPoolExecutor(len(jobs)) as pool:
            done = list(pool.map(lambda job: call(fes[job[0]], job[1]), jobs))
        out = {}
        for key, fe in fes.items():
            answers = {r["rid"]: answer for (k, r), answer in zip(jobs, done, strict=True) if k == key}
            titles = [" ".join(p.cmdline()) for p in fe.detokenizer_processes()]
            out[key] = Served(mix, answers, fe.records(), titles, log=fe.log_tail(1 << 22))
        for key, fe in fes.items():
            if key[2] == "detokd":
                out[key].health = requests.get(fe.url + "/health", timeout=30).status_code
                out[key].health_generate = requests.get(fe.url + "/health_generate", timeout=60).status_code
        # Then one detokenizer process of every server is SIGKILLed, SGLang's own included
        # (its answers are in): each server gets the same 120 s to end.
        for fe in fes.values():
            fe.detokenizer_processes()[0].kill()
        deadline = time.monotonic() + 120
        for key, fe in fes.items():
            try:
                out[key].exit_after_kill = fe.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass  # still serving without that detokenizer: the tests compare
        return out
    finally:
        for fe in fes.values():
            fe.close()


@pytest.fixture(scope="module")
def served(plugin_path, tmp_path_factory):  # noqa: F811
    """{(name, enc, detokenizer, worker num, DETOKD_SGLANG_ROUTER): Served} of every case."""
    root = tmp_path_factory.mktemp("frontend")
    out = {}
    for name, enc in CASES:
        out.update(run_case(root, plugin_path, name, enc))
    return out


def keys(det: str):
    return [(n, e, d, w, r) for n, e in CASES for d, w, r in RUNS[n, e] if d == det]


def sglangs(key: tuple) -> tuple:
    """The key of the same case's run through SGLang's own detokenizer."""
    return next(k for k in keys("sglang") if k[:2] == key[:2])


def key_id(key) -> str:
    name, enc, _, workers, router = key
    return f"{name}-{enc}-{workers}w" + ("-router" if router else "")


@pytest.mark.parametrize("key", keys("detokd"), ids=key_id)
def test_every_clients_text_is_the_oracles(served, key):
    run = served[key]
    processes = key[3] if key[4] else 1  # behind SGLang's router: as many as asked
    assert len(run.titles) == processes and all("(detokd)" in t for t in run.titles), run.titles
    wrong = {r["rid"]: (run.answers[r["rid"]]["text"], oracle(key[0], run.records[r["rid"]]))
             for r in run.mix
             if r["api"] != "hangup" and run.answers[r["rid"]]["text"] != oracle(key[0], run.records[r["rid"]])}
    assert not wrong, wrong


@pytest.mark.parametrize("key", keys("detokd"), ids=key_id)
def test_finish_reasons_usage_and_logprobs_are_sglangs_own(served, key):
    """Against the same mix through SGLang's own detokenizer; its text may differ only
    where SGLang's own is not the oracle's (docs/sglang.md: a stop string that began in
    sent text)."""
    name, enc = key[:2]
    mine, theirs = served[key], served[sglangs(key)]
    for r in mine.mix:
        if r["api"] == "hangup":
            continue
        a, b = mine.answers[r["rid"]], theirs.answers[r["rid"]]
        assert (a["finish"], a["usage"], a.get("logprobs")) == (b["finish"], b["usage"], b.get("logprobs")), r
        assert a["text"] == b["text"] or b["text"] != oracle(name, theirs.records[r["rid"]]), r
    # The forwarded fields were there to compare: logprobs reached the client.
    assert all(mine.answers[r["rid"]]["logprobs"] for r in mine.mix if "logprobs" in r["params"])


@pytest.mark.parametrize("key", keys("detokd"), ids=key_id)
def test_a_client_hanging_up_aborts_its_request_and_the_server_stays_healthy(served, key):
    run = served[key]
    rec = run.records.get("hangup")
    assert rec is not None and rec["finish"]["type"] == "abort", rec
    assert (run.health, run.health_generate) == (200, 200)


@pytest.mark.parametrize("key", keys("detokd"), ids=key_id)
def test_detokds_lines_in_sglangs_log_say_they_are_detokds_and_what_to_do_about_tmp(served, key):
    """SGLang's addresses sit in /tmp here (TMPDIR unset): detokd's warning says to set
    TMPDIR (test_fallback.py: set, the warning goes)."""
    log = served[key].log
    warnings = [line for line in log.splitlines() if "writable by every user" in line]
    assert warnings and all("detokd" in line and "TMPDIR" in line for line in warnings), warnings
    ours = [line for line in log.splitlines() if "detokd" in line.lower()]
    assert any("replaced SGLang's detokenizer" in line for line in ours)


@pytest.mark.parametrize("key", keys("detokd"), ids=key_id)
def test_killing_detokd_ends_sglangs_server_as_killing_its_own_does(served, key):
    """A SIGKILLed detokenizer has no say in what SGLang does next: its server ends (its
    watchdog), except where SGLang's own, killed in the same layout, outlives it too
    (0.5.22 and older behind the router, whose layout needs two HTTP workers)."""
    own = sglangs(key)
    same_layout = own[3:] == key[3:]
    ends = served[own].exit_after_kill is not None if same_layout else True
    assert (served[key].exit_after_kill is not None) == ends, (served[key].exit_after_kill, served[own].exit_after_kill)
