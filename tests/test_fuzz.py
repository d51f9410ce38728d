"""`python -m detokbench fuzz` end to end, small: a real detokd under a few thousand honest and
hostile frames (detokrig.frames) survives, serves every honest stream exactly, counts
every frame it read and every bad one, and keeps its RSS within 10% after warm-up.
The 100,000-frame run and its figures: docs/reliability.md "Fuzz run"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_small_fuzz_run_exits_0_with_every_honest_stream_exact(tmp_path):
    out = tmp_path / "fuzz.json"
    # Half the frames are warm-up: a short run's first uses of big frames would otherwise
    # dominate its RSS figure.
    p = subprocess.run(
        [sys.executable, "-m", "detokbench", "fuzz", "--frames", "4000", "--warmup", "0.5", "--seed", "7", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ok"] and res["problems"] == []
    assert res["honest"]["requests"] > 20 and res["honest"]["exact"] == res["honest"]["requests"]
    m = res["metrics"]
    assert m["detokd_frames_total"] == res["frames_read_by_detokd"]
    assert m["detokd_bad_frames_total"] == res["bad_frames_sent"] > 1000
    kinds = res["frames_by_kind"]
    assert kinds["oversized"] >= 1 and kinds["honest"] > 500 and sum(kinds.values()) == 4001  # + the last honest frame
    assert m["detokd_errors_total"]["too_large"] > 0 and m["detokd_errors_total"]["register_refused"] == kinds["odd_register"]
    assert res["rss_kb"]["end"] <= 1.10 * res["rss_kb"]["after_warmup"]
