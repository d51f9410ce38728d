"""End-to-end detokenizer benchmark through real processes (issue "Speed").

    scheduler (this process) --tokens--> implementation --text--> worker (subprocess)
         ^                                                          |
         +---------------------- ack of each whole step ------------+

* The scheduler PUSHes one `tokens` message per step (docs/protocol.md v1) to the
  implementation under test, over ipc:// sockets in a temporary folder. B streams,
  each one row per step with `--ids-per-row` new ids (4: speculative decoding).
* The worker PULLs the `text` messages, counts the rows of each step (the step number
  and the send time ride in each row's `meta`, which every implementation copies
  through untouched) and, once all B rows of step k are in, PUSHes an ack of step k
  back to the scheduler with the step's latency: worker receive time of its last row
  minus scheduler send time (one CLOCK_MONOTONIC for all processes).
* Flow control: at most `--window` steps are in flight (sent, not yet acked); the
  scheduler sends step k once step k-window has been acked. With window 2 the
  implementation decodes step k while the worker reads step k-1 and the scheduler
  waits, so the pipeline runs as fast as it absorbs, without an unbounded queue that
  would turn latency into a measure of the queue length. A second phase of each run
  sends one step at a time (window 1): its latency is the pure per-step latency of an
  idle pipeline, which is what an engine that sends a step every few ms sees.
* Every implementation is a process behind the same sockets: `detokd` (the real
  `python -m detokd serve ...`, through detokd.process.DetokdProcess) and the baselines of detokbench.baselines
  (naive, sglang, decodestream, floor). All run on the same streams, one after the
  other, for each configuration.
* A round starts every stream (step 0 carries the `start` rows), runs `--steps` steps
  and finishes them all; the throughput phase repeats rounds (same rids, new requests)
  for `--min-seconds`.

Messages are built before the timed run (they are the same for every implementation)
from detokd.wire.native's Structs: all rows of a step share `seq` and `meta`, so each
step is encoded once with placeholders there and filled in with one join when sent;
the ids repeat with the corpus, so a run of any length needs one template per step of
the corpus' period, not one per step.

The text every implementation sends is checked (a sample of the streams, or all with
`--check all`) against the oracle, Vocab.reference (detokd/tokenizer.py).

Figures: tokens/s through the pipeline, step latency p50/p99/max (idle and loaded),
CPU seconds of the implementation's processes per million tokens (per-thread
/proc/<pid>/task/*/schedstat, ns resolution, cross-checked with psutil), its peak RSS
(VmHWM, reset before each configuration through /proc/<pid>/clear_refs), and a long
run (flatness) that compares CPU per token at output length 32,768 with a control set
of short streams measured alongside (see run_flatness).

    python -m detokbench bench --quick              # smoke run, seconds
    python -m detokbench bench                      # the full run behind docs/performance.md
    python -m detokbench bench --report docs/bench/results.json   # markdown tables + plots again

One module per concern:

    workload  the multilingual corpus, its streams, and their frames (detokd.wire.native)
    worker    the receiving side: decodes `text`, acks each whole step (its own process)
    harness   starting implementations: detokd through DetokdProcess, the baselines
    runs      one configuration, and the flatness run, through one implementation
    report    figures, tables, JSON summaries and plots
    cli       the command line and the whole run (`python -m detokbench bench`)
"""
