"""The SGLang benchmark commands run end to end on a small stream or load (detokbench
sglang-bench, sglang-aging, rust-bench): the figures the docs quote come from them, so
they must not rot. Each checks every answer against the oracle itself; these tests check
what they record."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from detokbench import rust_bench, sglang_aging, sglang_bench
from detokrig.sglang_cases import requests_for

SMALL = ["--batch", "8", "--steps", "24", "--lifetime", "6"]
pytestmark = pytest.mark.timeout(600)


def test_sglang_bench_records_both_processes_in_both_modes_with_every_text_exact(tmp_path):
    out = tmp_path / "run.json"
    assert sglang_bench.main([*SMALL, "--rounds", "1", "--encodings", "msgpack", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["failure"] is None and doc["environment"]["cpu"]
    got = {(r["target"], r["mode"]): r for r in doc["results"]}
    assert set(got) == {(t, m) for t in ("sglang", "detokd") for m in ("latency", "throughput")}
    for r in got.values():
        assert r["off_oracle"] == 0 and r["text_equal_across_targets"] and r["one_answer_per_step"] and not r["unfinished"]
    # CPU is every decoding process's: detokd's is a child of the process SGLang starts.
    assert {t: list(r["processes_measured"].values()) for (t, _), r in got.items()} == {"sglang": [1], "detokd": [2]}
    assert all(r["cpu_us_per_row"] > 0 for r in got.values())
    assert len(sglang_bench.summary([str(out)]).splitlines()) == 3  # one row: msgpack, B = 8


def test_sglang_aging_records_each_pass_of_both_processes(tmp_path):
    out = tmp_path / "aging.json"
    assert sglang_aging.main([*SMALL, "--passes", "1", "--encoding", "pickle", "--json", str(out)]) == 0
    [p] = json.loads(out.read_text())["passes"]
    old, new = p["long_lived"]["cpu_us_per_row"], p["fresh"]["cpu_us_per_row"]
    # a pass this short may take less than the CPU clock's tick: then there is no ratio
    assert p["ratio"] == (old / new if new else None)
    assert p["long_lived"]["rss_mb"] > 0 and p["fresh"]["rss_mb"] > 0


# rust-bench starts one SGLang server per setup (~1 min of imports each on two cores).
RUST_SMALL = ["--runs", "1", "--concurrency", "4", "--num-prompts", "8", "--output-len", "16"]


@pytest.mark.timeout(1500)
def test_rust_bench_measures_the_three_setups_alternated_and_checks_every_answer(tmp_path):
    out = tmp_path / "rust.json"
    assert rust_bench.main([*RUST_SMALL, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["failure"] is None and doc["commit"] is not None and doc["machine"]["cpus"]
    assert [r["setup"] for r in doc["runs"]] == doc["order"] == ["rust", "sglang", "detokd"]
    for run in doc["runs"]:
        [load] = run["loads"]
        check = load["check"]
        assert check["ok"] and check["checked"] == check["exact"] == check["measured_requests"] == 8, check
        assert load["bench"]["completed"] == 8 and load["bench"]["total_output_tokens"] == 8 * 16
        cpu = load["cpu_ms_per_1k_tokens"]
        assert cpu["stack"] > 0 and set(cpu["by_process"]) >= {"frontend", "scheduler"}
        titles, log = run["identity"]["titles"], run["identity"]["log"]
        detokenizers = [t for t in titles if t.startswith("sglang::detokenizer")]
        if run["setup"] == "rust":  # the HTTP server, tokenizer and detokenizer are the scheduler's threads
            assert not detokenizers and any("SGLANG_RUST_SERVER enabled" in line for line in log)
            assert {"scheduler", "detokenizer", "tokenizer", "http"} <= set(load["cpu_s_by_thread_group"])
        else:  # detokd's: the process SGLang started and the decoding process it forked, both counted
            want = (["sglang::detokenizer (detokd decoding)", "sglang::detokenizer (detokd)"]
                    if run["setup"] == "detokd" else ["sglang::detokenizer"])
            assert sorted(detokenizers) == want, detokenizers
            assert "detokenizer" in cpu["by_process"] and load["cpu_s_by_thread_group"] is None
    assert set(doc["summary"]) == {"rust", "sglang", "detokd"}
    assert "output tok/s" in rust_bench.summary([str(out)])


@pytest.mark.timeout(900)
def test_rust_bench_exactness_checks_every_case_of_the_front_end_mix(tmp_path):
    """One setup, one tokenizer: the record's shape (docs/sglang.md quotes a full run)."""
    out = tmp_path / "exact.json"
    assert rust_bench.main(["--exactness", "--setups", "rust", "--tokenizers", "mistral_v1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())["results"]["mistral_v1"]["rust"]
    mix = requests_for("mistral_v1", extended=True)
    assert res["unchecked"] == 0 and len(res["requests"]) == len(mix)
    assert {k: c["n"] for k, c in res["classes"].items()} == Counter(r["kind"] for r in mix)
    for p in res["requests"]:
        assert p["record"] and (p["exact"] is None) == (p["kind"] == "client hangs up"), p
    assert "| all but the hang-up |" in rust_bench.summary([str(out)])
