"""The SGLang benchmark commands run end to end on a small stream (detokbench sglang-bench,
sglang-aging): the figures the docs quote come from them, so they must not rot. Each
checks every pass's text against the oracle itself; these tests check what they record."""

from __future__ import annotations

import json

import pytest

from detokbench import sglang_aging, sglang_bench

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
    assert len(sglang_bench.summary([str(out)]).splitlines()) == 3  # one row: msgpack, B = 8


def test_sglang_aging_records_each_pass_of_both_processes(tmp_path):
    out = tmp_path / "aging.json"
    assert sglang_aging.main([*SMALL, "--passes", "1", "--encoding", "pickle", "--json", str(out)]) == 0
    [p] = json.loads(out.read_text())["passes"]
    old, new = p["long_lived"]["cpu_us_per_row"], p["fresh"]["cpu_us_per_row"]
    # a pass this short may take less than the CPU clock's tick: then there is no ratio
    assert p["ratio"] == (old / new if new else None)
    assert p["long_lived"]["rss_mb"] > 0 and p["fresh"]["rss_mb"] > 0
