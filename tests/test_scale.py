"""`python -m detokbench scale`: the scale-out benchmark runs real shards and checks their text.

A tiny run (16 streams, 20 steps) of 1 and 2 shards through `detokd serve
[--shards 2]`: every stream of every round must equal the oracle, and the JSON
must hold what docs/performance.md quotes.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from detokrig.waits import wait_until

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


def test_a_run_stopped_by_sigterm_leaves_none_of_its_processes_behind() -> None:
    """A timeout or an operator's SIGTERM ends a detokbench command as Ctrl-C does: what it
    started in sessions of its own (here shards; rust-bench's SGLang servers of ~3 GB)
    is stopped, not left to run on."""
    run = subprocess.Popen([sys.executable, "-m", "detokbench", "scale", "--shards", "2", "--rounds", "1000"],
                           cwd=REPO, stdout=subprocess.DEVNULL)

    def shards() -> list[psutil.Process]:
        procs = psutil.Process(run.pid).children(recursive=True)
        with contextlib.suppress(psutil.Error):  # one that exits while it is read
            if sum("--shard-index" in p.cmdline() for p in procs) == 2:
                return procs
        return []

    started = wait_until(shards, 120, "two shards of the run's")
    run.send_signal(signal.SIGTERM)
    try:
        assert run.wait(60) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(started, timeout=30)
        assert alive == [], [p.cmdline() for p in alive]
    finally:
        for p in started:
            with contextlib.suppress(psutil.Error):
                p.kill()
