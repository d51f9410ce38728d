"""`python -m detokbench bench --quick` end to end: the benchmark the performance figures come
from runs every configuration of its quick plan through real processes, checks every
stream detokd served against the oracle, and writes the tables and plots that
`--report` makes again from its results.json alone. The full run and its figures:
docs/performance.md, "Results"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "detokbench", "bench", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=240)


def test_a_quick_run_measures_every_configuration_with_every_stream_exact_and_its_report_comes_back(tmp_path):
    run = bench("--quick", "--impls", "detokd,floor", "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["failures"] == []
    configurations = {(r["impl"], r["tokenizer"], r["batch"], r["ids_per_row"]) for r in res["runs"]}
    assert configurations == {(i, "deepseek", b, n) for i in ("detokd", "floor") for b in (1, 64) for n in (1, 4)}
    assert {f["impl"] for f in res["flatness"]} == {"detokd", "floor"}
    for r in res["runs"] + res["flatness"]:
        assert r["tok_per_s"] > 0 and r["cpu_s_per_mtok"] > 0, r["impl"]
        if r["impl"] == "detokd":
            c = r["check"]
            assert c["streams"] >= r["batch"] if c["mode"] == "all" else c["streams"] > 0
            assert (c["mismatches"], c["errors"], c["bad_frames"]) == (0, 0, 0), c
    for png in ("throughput.png", "flatness.png"):
        assert (tmp_path / png).read_bytes().startswith(b"\x89PNG"), png

    for flags, table in (((), "table.md"), (("--summary",), "summary.md")):
        again = bench("--report", str(tmp_path / "results.json"), "--no-plot", *flags)
        assert again.returncode == 0 and again.stdout == (tmp_path / table).read_text() + "\n", table


def test_an_implementation_that_fails_to_start_is_recorded_and_the_others_still_measured(tmp_path):
    dead = f"{sys.executable} -c 'raise SystemExit(2)'"  # a detokd command that exits at once
    run = bench("--quick", "--impls", "detokd,floor", "--detokd-cmd", dead, "--no-plot", "--out", str(tmp_path))
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert [(f["impl"], f["tokenizer"]) for f in res["failures"]] == [("detokd", "deepseek")]
    assert {r["impl"] for r in res["runs"]} == {"floor"} and len(res["runs"]) == 4
