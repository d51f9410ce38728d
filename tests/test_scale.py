"""`python -m detokbench scale`: the scale-out benchmark runs real shards and checks their text.

A tiny run (16 streams, 20 steps) of 1 and 2 shards through `detokd serve
[--shards 2]`: every stream of every round must equal the oracle, and the JSON
must hold what docs/performance.md quotes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_scale_script_runs_shards_and_every_stream_is_exact(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    log = tmp_path / "scale.log"
    with open(log, "w") as f:
        proc = subprocess.run(
            [sys.executable, "-m", "detokbench", "scale", "--batch", "16", "--steps", "20", "--rounds", "2", "--json", str(out)],
            cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=240,
        )
    text = log.read_text()
    assert proc.returncode == 0, text
    res = json.loads(out.read_text())
    assert set(res["runs"]) == {"1", "2"}
    for runs in res["runs"].values():
        assert len(runs) == 2
        assert all(r["wrong_streams"] == 0 and r["tokens_per_s"] > 0 for r in runs)
    assert len(res["ceilings"]) == 2 and res["ratios"]["2"]["median"] > 0
    assert "2 shards / 1:" in text
