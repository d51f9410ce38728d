"""`python -m detokbench soak --quick` end to end: 10,000 requests of churn through a real
detokd end as they were meant to (finished, aborted, or abandoned and evicted), the checked
texts are the oracle's, RSS is judged flat on enough samples, and the verdict comes out
whether or not matplotlib is there to draw the plot. The full run and its figures:
docs/reliability.md, "Soak"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from detokbench import soak
from detokrig.proc import memory
from detokrig.rig import Sampler

REPO = Path(__file__).resolve().parents[1]
# The command as `python -m detokbench` runs it, in a Python that cannot import matplotlib.
WITHOUT_MATPLOTLIB = ("import sys; sys.modules['matplotlib'] = None; from detokbench.commands import main; "
                      "sys.exit(main(sys.argv[1:]))")


def test_a_quick_soak_without_matplotlib_gives_its_verdict_and_each_request_its_fate(tmp_path):
    p = subprocess.run([sys.executable, "-c", WITHOUT_MATPLOTLIB, "soak", "--quick", "--out", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.splitlines()[-1] == "OK" and "matplotlib is not installed: no plot" in p.stdout
    assert not (tmp_path / "soak-quick.png").exists()
    doc = json.loads((tmp_path / "soak-quick.json").read_text())
    sm = doc["summary"]
    assert sm["requests"] == 10_000 and sm["tokens"] == sm["tokens_sent"]
    assert all(sm["fates"][f] > 0 for f in ("finished", "aborted", "abandoned"))
    assert {k: sm[k] for k in soak.MUST_BE_0} == dict.fromkeys(soak.MUST_BE_0, 0)
    assert sm["checked_texts"] > 100 and sm["abandoned_requests_evicted"] > 0
    assert sm["flatness"]["flat"] and len(doc["samples"]) >= 10
    assert sm["detokd_exit"] == 0

    png = soak.plot(doc["samples"], sm, tmp_path / "soak-quick.png")  # the same run drawn where matplotlib is
    assert png is not None and png.read_bytes().startswith(b"\x89PNG")


def test_flatness_takes_the_sample_nearest_a_window_the_sampler_missed():
    # The sampler thread starved from 0.3 to 0.9 of the run: no sample lies in 0.7-0.8.
    samples = [{"t": i / 20, "rss_mb": 100.0} for i in range(7)] + [{"t": t, "rss_mb": 103.0} for t in (0.9, 0.95, 1.0)]
    f = soak.flatness(samples, threshold=0.02)
    assert (f["rss_q3_mb"], f["rss_end_mb"], f["last_quarter_growth"]) == (103.0, 103.0, 0.0)


def test_the_sampler_keeps_half_to_all_of_its_most_samples_and_slows_down_at_each_halving():
    calls = iter(range(100))
    this = SimpleNamespace(memory=lambda: memory(os.getpid()), metrics=lambda: {"detokd_tokens_total": next(calls)},
                           detokd=SimpleNamespace(pid=os.getpid()))
    sampler = Sampler(this, interval=0.01, t0=time.monotonic(), most=8)
    for n in range(1, 40):
        sampler.sample()
        assert 4 <= len(sampler.samples) < 8 or n < 4
    assert sampler.interval == 0.01 * 2**8  # halved at the 8th sample, then at every 4th: 12, 16, ... 36
    assert sampler.samples[0]["tokens"] == 0  # the run's start is kept
