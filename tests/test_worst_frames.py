"""`python -m detokbench worst-frames` end to end, small (--quick): every worst-frame scenario runs
against real detokd processes at the default caps. The full run and its figures:
docs/bench/worst.json (issue #13)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import vocab

from detokd.config import Config

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = {
    "mass_start", "mass_start_evict", "longest_token", "malformed", "stop_holdback", "stop_distinct",
    "abort_mass", "abort_over", "embeddings_mass", "register_huge", "control_huge", "window_byte_run",
}
UNANSWERED = {"abort_mass", "abort_over", "register_huge", "control_huge"}  # message types with no answer


def test_after_each_worst_frame_of_every_type_the_probe_is_exact_health_stays_ok_and_sigterm_ends_detokd_within_its_grace(tmp_path):
    out = tmp_path / "worst.json"
    run = subprocess.Popen(
        [sys.executable, "-m", "detokbench", "worst-frames", "--quick", "--json", str(out)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    v = vocab("deepseek")  # loads while the script's detokds start
    vocabs = {"deepseek": v, "mistral_v3": vocab("mistral_v3")}
    log, _ = run.communicate(timeout=300)
    assert run.returncode == 0, log[-4000:]
    report = json.loads(out.read_text())
    assert report["quick"] and {s["name"] for s in report["scenarios"]} == SCENARIOS
    for s in report["scenarios"]:
        name = s["name"]
        assert s["completed"], (name, s.get("error"))
        assert s["frame"]["bytes"] <= report["caps"]["max_frame_bytes"], name
        probe = s["probe"]
        assert probe["text"] == vocabs[s["settings"].get("tokenizer", "deepseek")].reference([], probe["ids"]), name
        if name in UNANSWERED:
            assert s["answer"]["rows"] == 0, name
        else:
            assert s["answer_s"] is not None and s["answer"]["rows"] >= s["frame"]["rows"], name
        health = s["health"]
        assert health["polls"] >= 1 and health["non_200"] == 0, (name, health)
        term = s["sigterm"]
        assert term["returncode"] == 0 and term["exit_s"] < term["grace_s"] and not term["grace_ran_out"], (name, term)
    by_name = {s["name"]: s for s in report["scenarios"]}
    # What each frame must have made detokd answer, row by row.
    assert by_name["malformed"]["answer"]["errors"] == {"bad_row": by_name["malformed"]["frame"]["rows"]}
    evict = by_name["mass_start_evict"]
    assert evict["answer"]["errors"] == {"evicted": evict["frame"]["rows"] - evict["settings"]["max_states"]}
    longest = by_name["longest_token"]
    tid = longest["frame"]["token"]
    text_bytes = [len(v.decode([i], True).encode()) for i in range(v.size)]
    assert text_bytes[tid] == max(text_bytes)
    rows, per_row = longest["frame"]["rows"], longest["frame"]["ids"] // longest["frame"]["rows"]
    served = min(rows, report["caps"]["max_frame_ids"] // per_row)  # rows past the frame's id budget: too_large
    assert longest["answer"]["text_bytes"] == served * per_row * text_bytes[tid]
    assert longest["answer"]["errors"] == ({"too_large": rows - served} if served < rows else {})
    # Each start's stop list is a distinct max_stop_chars: the frame's build budget takes so many.
    # An embeddings row within the caps is forwarded; the byte run's rows are all answered, "" each.
    assert by_name["embeddings_mass"]["answer"]["errors"] == {} and by_name["window_byte_run"]["answer"]["errors"] == {}
    # The byte run, max_rows rows even at --quick: linear in it (a codec quadratic in the
    # run took ~10 s for 6,000 rows, hours for these), and its text the oracle's.
    run = by_name["window_byte_run"]
    mistral = vocabs["mistral_v3"]
    token = {t: i for i, t in enumerate(mistral.tokens) if t}
    ids = [token[f"<0x{b:02X}>"] for b in "中".encode()] * ((run["frame"]["rows"] - 1) // 3)
    ids += mistral.backend.encode(" end", add_special_tokens=False).ids[-1:]
    assert run["answer"]["text_bytes"] == len(mistral.reference([], ids).encode())
    assert run["answer_s"] < Config().health_timeout, run["answer_s"]
    distinct, caps = by_name["stop_distinct"], report["caps"]
    built = caps["max_frame_stop_chars"] // caps["max_stop_chars"]
    assert distinct["answer"]["errors"] == {"too_large": distinct["frame"]["rows"] - built}
