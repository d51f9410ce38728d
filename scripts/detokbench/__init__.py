"""The benchmarks' shared pieces: scripts/bench.py, scripts/scale.py and scripts/soak.py.

    proc      CPU time and peak RSS of process trees, from /proc; the machine's other load
    workload  the multilingual corpus, its streams, and their frames (detokd.wire.native)
    worker    the receiving side of bench.py: decodes `text`, acks each whole step
    harness   starting implementations: detokd through DetokdProcess, the baselines
    runs      one configuration, and the flatness run, through one implementation
    report    figures, tables, JSON summaries and plots
    cli       bench.py's command line and its whole run (also `python -m detokbench`)

The entry scripts put scripts/ (this package's parent) and the checkout on sys.path.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout
SCRIPTS = ROOT / "scripts"
