"""End-to-end detokenizer benchmark through real processes (docs/performance.md).

    scheduler (this process) --tokens--> implementation --text--> worker (subprocess)
         ^                                                          |
         +---------------------- ack of each whole step ------------+

The scheduler sends one `tokens` frame per step of B streams; the worker acks each
whole step with its latency (one CLOCK_MONOTONIC for all processes). At most --window
steps are in flight, so latency measures the pipeline, not a queue; a second phase
sends one step at a time (the idle latency an engine sees). detokd and every baseline
run behind the same sockets on the same prebuilt frames; their text is checked
against Vocab.reference. Figures: tokens/s, step latency p50/p99/max, CPU per million
tokens, peak RSS, and flatness (CPU per token of long outputs against short ones).

    python -m detokbench bench --quick              # smoke run, seconds
    python -m detokbench bench                      # the full run behind docs/performance.md
    python -m detokbench bench --report docs/bench/results.json   # markdown tables + plots again

Modules: workload (corpus, streams, frames), worker (the receiving process), harness
(starting implementations), runs (one configuration; the flatness run), report
(figures, tables, plots), cli (the command line and the whole run).
"""
