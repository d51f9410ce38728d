"""`detokbench sglang-bench` (detokbench/sglang_bench.py): what each request of its
streams is, before SGLang's scheduler code turns them into steps, and how its recorded
runs are read back and drawn again."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from detokbench.sglang_bench import PROMPT, main, requests, summary

REPO = Path(__file__).resolve().parents[1]

IDS = list(range(1000, 1700))  # stands for the corpus' ids: only offsets into it matter here


def live_per_step(reqs, per_step: int = 1) -> Counter:
    live: Counter = Counter()
    for r in reqs:
        for step in range(r.first_step, r.first_step + len(r.output_ids) // per_step):
            live[step] += 1
    return live


def test_by_default_all_requests_start_together_and_finish_together():
    reqs = requests(IDS, batch=16, steps=40, tag="r")
    assert len(reqs) == 16 and {r.first_step for r in reqs} == {0}
    assert {len(r.output_ids) for r in reqs} == {40} and {len(r.prompt_ids) for r in reqs} == {PROMPT}


@pytest.mark.parametrize("batch,steps,lifetime", [(16, 40, 8), (1024, 800, 256), (10, 30, 15), (7, 50, 3), (5, 20, 1)])
def test_with_a_lifetime_requests_start_and_finish_staggered_with_the_batch_full_between_the_ramps(batch, steps, lifetime):
    reqs = requests(IDS, batch, steps, "r", lifetime=lifetime)
    assert len({r.rid for r in reqs}) == len(reqs)
    assert {len(r.output_ids) for r in reqs} == {lifetime}
    assert all(r.first_step + lifetime <= steps for r in reqs)  # none outlasts the stream
    live = live_per_step(reqs)
    assert max(live.values()) == batch
    full = [s for s in range(steps) if live[s] == batch]
    assert full == list(range(full[0], full[-1] + 1)) and full[0] <= lifetime - 1  # full from the first lifetime on
    starts = Counter(r.first_step for r in reqs)
    ends = Counter(r.first_step + lifetime - 1 for r in reqs)
    most = -(-batch // lifetime)  # ceil(B / L)
    assert max(starts.values()) <= most and max(ends.values()) <= most


def test_each_request_continues_its_own_prompt_and_several_ids_per_step_stay_whole():
    reqs = requests(IDS, batch=6, steps=20, tag="x", per_step=3, lifetime=5)
    ring = IDS * 4
    for r in reqs:
        at = ring.index(r.output_ids[0], PROMPT)
        assert r.prompt_ids + r.output_ids == ring[at - PROMPT : at + 15]
        assert r.chunks == [3] * 5
    assert max(live_per_step(reqs, per_step=3).values()) == 6


def test_varied_ids_per_step_are_drawn_from_one_to_k_the_same_every_run():
    reqs = requests(IDS, batch=8, steps=30, tag="s", per_step=4, varied=True)
    chunks = [c for r in reqs for c in r.chunks]
    assert set(chunks) == {1, 2, 3, 4}
    assert all(len(r.chunks) == 30 and len(r.output_ids) == sum(r.chunks) for r in reqs)
    assert requests(IDS, batch=8, steps=30, tag="s", per_step=4, varied=True) == reqs


def recorded_run(tmp_path, rates: dict, args: dict, name: str = "run.json", cpu: str | None = None) -> str:
    """A run's JSON as `--json` writes it, with the fields the summary reads."""
    results = [
        dict(encoding="msgpack", batch=1024, target=target, mode=mode, tokens_per_s_median=rate, detokenizers=1,
             latency_ms_p50=1.5, latency_ms_p99=2.5, cpu_us_per_row=20.0 if target == "sglang" else 1.6, floor_us_per_row=2.7)
        for (target, mode), rate in rates.items()
    ]
    path = tmp_path / name
    environment = dict(commit="abc1234", **({"cpu": cpu} if cpu else {}))  # runs before 2026-12-05 name no CPU
    path.write_text(json.dumps(dict(environment=environment, args=args, results=results)))
    return str(path)


@pytest.mark.parametrize("cpu, shown", [("AMD EPYC", "AMD EPYC"), (None, "—")])
def test_the_summary_reads_each_recorded_run_back_as_one_row_with_its_gains(tmp_path, cpu, shown):
    rates = {("sglang", "latency"): 50_000, ("sglang", "throughput"): 56_000,
             ("detokd", "latency"): 555_000, ("detokd", "throughput"): 810_000}
    path = recorded_run(tmp_path, rates, dict(ids_per_step=4, varied_ids=True, lifetime=256, freeze_gc=True), cpu=cpu)
    rows = summary([path]).splitlines()[2:]
    assert len(rows) == 1
    row = rows[0]
    assert f"| run.json | abc1234 | {shown} | 1-4 ids, L = 256, GC frozen | msgpack | 1024 |" in row
    gains = (rates["detokd", "latency"] / rates["sglang", "latency"], rates["detokd", "throughput"] / rates["sglang", "throughput"])
    assert f"| {gains[0]:.1f}× / {gains[1]:.1f}× |" in row


def test_a_run_cut_short_is_not_quoted(tmp_path):
    path = recorded_run(tmp_path, {("sglang", "latency"): 50_000, ("detokd", "latency"): 555_000}, dict(ids_per_step=1))
    assert summary([path]).splitlines()[2:] == []


def test_another_commands_json_is_left_out_of_the_summary_and_named(tmp_path, capsys):
    aging = tmp_path / "sglang-aging.json"
    aging.write_text(json.dumps(dict(command="python -m detokbench sglang-aging", passes=[])))
    run = recorded_run(tmp_path, {(t, m): 1000 for t in ("sglang", "detokd") for m in ("latency", "throughput")}, dict(ids_per_step=1))
    assert len(summary([str(aging), run]).splitlines()[2:]) == 1
    assert f"{aging}: not a sglang-bench run" in capsys.readouterr().err


@pytest.mark.parametrize("record", ["sglang-epyc.json", "sglang-2detok-one-epyc.json"])
def test_a_recorded_run_is_drawn_again_from_its_json(tmp_path, record):
    png = tmp_path / "again.png"
    assert main(["--plot-only", str(REPO / "docs" / "bench" / record), "--plot", str(png)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG")
