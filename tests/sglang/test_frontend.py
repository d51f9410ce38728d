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
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
import restarts
import sglang
from models import model_folder, plugin_path  # noqa: F401  (a fixture: this worktree's entry point)

from detokd.sglang.release import WINDOW
from detokrig.sglang_cases import call, oracle, requests_for
from detokrig.sglang_frontend import Frontend, rust_server_default
from detokrig.waits import wait_until


def _router_routes_by_rid() -> bool:
    from sglang.srt.managers.multi_tokenizer_mixin import MultiDetokenizerRouter

    return hasattr(MultiDetokenizerRouter, "_pick_for")


# SGLang 0.5.22 and older's MultiDetokenizerRouter routes rows by their HTTP worker alone
# and asserts each names one, which the TokenizerManager stamps only with several HTTP
# workers: SGLang's own router serves only that layout there (runs.py, ROUTED).
ROUTER_EXTRA = () if _router_routes_by_rid() else ("--tokenizer-worker-num", "2")

NEWEST = sglang.__version__ == WINDOW[-1]
# (tokenizer, encoding): not DeepSeek, detokd's packaged default, so a wrong tokenizer shows.
# The newest release runs both; the oldest the one whose layout is its own (SGLang's router
# under two HTTP workers, ROUTER_EXTRA) and which hosts its restarts. The other's three
# servers (~3 min of CPU) would run detokd's code again, not another of SGLang's paths:
# the differential compares both encodings with SGLang's own detokenizer on every release.
CASES = [("qwen2", "pickle"), ("mistral_v3", "msgpack")] if NEWEST else [("mistral_v3", "msgpack")]
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
# Where detokd's decoding process is killed under load (restarts.py): one case per
# release, so both encodings and both tokenizer families are covered across the window.
RESTART_CASE = ("qwen2", "pickle") if NEWEST else ("mistral_v3", "msgpack")
RESTART_HOST = (*RESTART_CASE, "detokd", 1, False)
# The first test runs every case's servers (11 processes that import SGLang and torch,
# ~10 s of CPU each, per case): minutes on two cores, past pytest's per-test timeout.
pytestmark = pytest.mark.timeout(2400)


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
    health_generate_s: float | None = None  # its wait: 503 at once is a worker not up, at ~20 s SGLang's timeout
    exit_after_kill: int | None = None  # the server's exit status once a detokenizer process was killed
    answer_after_kill: tuple[str, str] | None = None  # (what a client got, the oracle's) once it was
    log: str = ""  # the server's log, as it was after the mix
    kills: list[restarts.Kill] = field(default_factory=list)  # the restart host's kills under load
    supervisor_uss: int | None = None  # bytes, after the first kill's load
    fallback_kills: int | None = None  # kills in a row that ended the restarts
    fallback_answer: tuple[str, str] | None = None  # through SGLang's own detokenizer, then
    stopped: tuple[int | None, list[int]] | None = None  # SIGTERM to SGLang: its exit, detokd processes left
    # Its detokenizer processes when SGLang's launch said it was done (None: SGLang does not
    # say so under --tokenizer-worker-num > 1).
    launched: list[str] | None = None


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
            launched = None if fe.http_workers > 1 else fe.wait_launched()
            out[key] = Served(mix, answers, fe.records(), titles, log=fe.log_tail(1 << 22), launched=launched)
        for key, fe in fes.items():
            if key[2] == "detokd":
                out[key].health = requests.get(fe.url + "/health", timeout=30).status_code
                began = time.monotonic()
                out[key].health_generate = requests.get(fe.url + "/health_generate", timeout=60).status_code
                out[key].health_generate_s = time.monotonic() - began
        if RESTART_HOST in fes:
            restart_run(fes[RESTART_HOST], out[RESTART_HOST])
        kill_one_each({k: fe for k, fe in fes.items() if k != RESTART_HOST}, out, name)
        for key, fe in fes.items():
            if key[2] == "detokd":
                out[key].stopped = restarts.stop_cleanly(fe)
        return out
    finally:
        for fe in fes.values():
            fe.close()


def kill_one_each(fes: dict[tuple, Frontend], out: dict[tuple, Served], name: str) -> None:
    """One detokenizer process of every server SIGKILLed: SGLang's own (its answers are
    in), detokd's decoding process. SGLang's own with one detokenizer gets 120 s to end
    (behind a router nothing is asserted of it); detokd's then answer one more request."""
    for key, fe in fes.items():
        (fe.detokenizer_processes() if key[2] == "sglang" else fe.decoding_processes())[0].kill()
    deadline = time.monotonic() + 120
    for key, fe in fes.items():
        if key[2] == "sglang" and key[3:] == (1, False):
            try:
                out[key].exit_after_kill = fe.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass  # still serving without that detokenizer: the test says so
        elif key[2] == "detokd":
            out[key].exit_after_kill = fe.proc.poll()
            if out[key].exit_after_kill is None:
                out[key].answer_after_kill = ask(fe, name, f"after-kill-{key[2]}")


def restart_run(fe: Frontend, served: Served) -> None:
    """detokd's decoding process SIGKILLed under load at two moments, its restarts used up,
    and what the server did each time (restarts.py)."""
    served.kills.append(restarts.kill_under_load(fe, "k1", "mid-stream"))
    served.supervisor_uss = restarts.supervisor_uss(fe)
    served.kills.append(restarts.kill_under_load(fe, "k2", "at start"))
    served.fallback_kills = restarts.kill_until_sglangs_own(fe)
    served.fallback_answer = ask(fe, RESTART_CASE[0], "after-fallback")
    rids = [s.rid for kill in served.kills for s in kill.streams + kill.after]
    # The stand-in records a request once it has finished it, aborted in detokd or not.
    served.records = wait_until(lambda: (got := fe.records()) and all(r in got for r in rids) and got, 300,
                                "the stand-in's record of every request")
    served.log = fe.log_tail(1 << 22)


def ask(fe: Frontend, name: str, rid: str) -> tuple[str, str]:
    """One /generate request: the text its client got, and the oracle's."""
    body = {"text": "Please answer. [reply 3] [step 2]", "rid": rid, "sampling_params": {"max_new_tokens": 200}}
    text = requests.post(fe.url + "/generate", json=body, timeout=300).json()["text"]
    record = wait_until(lambda: fe.records().get(rid), 30, f"the stand-in's record of {rid}")
    return text, oracle(name, record)


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
    assert (run.health, run.health_generate) == (200, 200), f"/health_generate answered in {run.health_generate_s:.1f} s"


@pytest.mark.parametrize("key", keys("detokd"), ids=key_id)
def test_detokds_lines_in_sglangs_log_say_they_are_detokds_and_what_to_do_about_tmp(served, key):
    """SGLang's addresses sit in /tmp here (TMPDIR unset): detokd's warning says to set
    TMPDIR (test_fallback.py: set, the warning goes)."""
    log = served[key].log
    warnings = [line for line in log.splitlines() if "writable by every user" in line]
    assert warnings and all("detokd" in line and "TMPDIR" in line for line in warnings), warnings
    ours = [line for line in log.splitlines() if "detokd" in line.lower()]
    assert any("replaced SGLang's detokenizer" in line for line in ours)


@pytest.mark.parametrize("key", [k for k in keys("detokd") if k != RESTART_HOST], ids=key_id)
def test_sglangs_server_outlives_a_killed_decoding_process_where_killing_its_own_detokenizer_ends_it(served, key):
    """SIGKILL of detokd's decoding process: SGLang's server answers the next request
    exactly. SIGKILL of SGLang's own detokenizer ends its server (its watchdog), except
    behind the router of 0.5.22 and older, whose layout needs two HTTP workers."""
    own = sglangs(key)
    assert served[key].exit_after_kill is None
    text, oracle_text = served[key].answer_after_kill
    assert text == oracle_text
    if own[3:] == (1, False):
        assert served[own].exit_after_kill is not None


@pytest.mark.parametrize("key", keys("detokd"), ids=key_id)
def test_a_clean_sglang_shutdown_ends_every_detokd_process(served, key):
    code, left = served[key].stopped
    assert code is not None and not left, (code, left)


# --- A decoding process that dies (restarts.py), on RESTART_HOST -------------------------


@pytest.fixture(scope="module")
def host(served) -> Served:
    return served[RESTART_HOST]


def outcome(run: Served, s: restarts.Stream, kill: restarts.Kill) -> str:
    """How a client's stream ended: "exact" (a normal finish, the oracle's text),
    "restarted" (an abort naming the restart, after a prefix of the oracle's text), or
    "lost" (no end: its last row went out while the kill was under way)."""
    record = run.records.get(s.rid)
    assert record is not None, f"{s.rid}: the stand-in has no record of it"
    expected = oracle(RESTART_CASE[0], record)
    if s.ended and s.finish.get("type") != "abort":
        assert s.text == expected, s.rid
        return "exact"
    if s.ended:
        assert s.finish.get("message") == "detokd: restarted", (s.rid, s.finish)
        assert expected.startswith(s.text), s.rid
        return "restarted"
    assert record["finished"] < kill.at + 1.0, f"{s.rid}: its last row went out {record['finished'] - kill.at:.2f} s after the kill"
    return "lost"


@pytest.mark.parametrize("k", [0, 1], ids=["mid-stream", "at-start"])
def test_a_killed_decoding_process_ends_every_stream_in_flight_exactly_or_with_an_abort_naming_it(host, k):
    kill = host.kills[k]
    assert kill.server_up and kill.replaced_by and kill.killed not in kill.replaced_by
    outcomes = [outcome(host, s, kill) for s in kill.streams]
    print(f"{kill.moment}: " + ", ".join(f"{o} {outcomes.count(o)}" for o in ("exact", "restarted", "lost")))
    assert "restarted" in outcomes  # the kill found streams in flight
    assert outcomes.count("lost") <= 2, outcomes  # the rows of a step or two die with the process


@pytest.mark.parametrize("k", [0, 1], ids=["mid-stream", "at-start"])
def test_requests_started_after_a_kill_are_exact_and_streaming_within_two_seconds(host, k):
    kill = host.kills[k]
    for s in kill.after:
        assert outcome(host, s, kill) == "exact"
        assert s.first_at - kill.at < 2.0, (s.rid, s.first_at - kill.at)


@pytest.mark.parametrize("k", [0, 1], ids=["mid-stream", "at-start"])
def test_health_answers_200_within_ten_seconds_of_a_kill(host, k):
    kill = host.kills[k]
    assert kill.health_s is not None and kill.health_s < 10, kill.health_s
    assert kill.health_generate_s is not None and kill.health_generate_s < 10, kill.health_generate_s


def test_the_supervising_process_adds_at_most_50_mb_of_its_own(host):
    """USS: the pages only it maps. It imported SGLang and loaded the tokenizer for the
    verdict, and shares those pages with the decoding process it forked."""
    print(f"supervisor USS {host.supervisor_uss / 2**20:.1f} MB")
    assert host.supervisor_uss < 50 * 2**20


def test_deaths_in_a_row_end_the_restarts_and_sglangs_own_serves_said_once(host):
    assert host.fallback_kills <= 3
    assert host.log.count(restarts.FALLBACK_LINE) == 1
    text, oracle_text = host.fallback_answer
    assert text == oracle_text


def test_sglangs_launch_without_sglang_rust_server_starts_a_detokenizer_process(served):
    """SGLang's real launch (launch_server, SGLANG_RUST_SERVER unset) started the
    detokenizer process(es) the plugin replaces: the day its Rust server, which has none,
    becomes the default, this fails saying what to do (issue 43, item 5; a launch that
    ends with none fails in Frontend.wait_ready already, with the same words)."""
    # Each server's detokenizer processes when its launch said it was done; under
    # --tokenizer-worker-num > 1, which drops the launch callback, those serving after the mix.
    started = {key_id(key) + "-" + key[2]: run.titles if run.launched is None else run.launched
               for key, run in served.items()}
    missing = [key for key, titles in started.items() if not titles]
    assert not missing, rust_server_default(f"no detokenizer process in {missing}")
