"""End-to-end detokenizer benchmark through real processes: `python -m detokbench bench`.

docs/performance.md, "What is measured", says what and how. Modules: workload (corpus,
streams, frames), worker (the receiving process), harness (starting implementations),
pipeline (steps in flight, clocks), runs (one configuration), flatness (the flatness run),
report (figures, tables, plots), cli (the command line and the whole run).
"""
