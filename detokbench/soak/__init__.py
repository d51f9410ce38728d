"""Soak test: millions of tokens with churn through a real detokd; is memory flat?

    engine (this process) --tokens/abort--> `python -m detokd serve` --text--> worker (this process)

* The engine keeps `--concurrency` requests going at once; each step it sends one
  `tokens` frame with a row of 1..`--max-delta` new ids for every one of them. Output
  lengths are random (log-uniform between 1 and `--max-len`); ids are runs of real
  multilingual text (the DeepSeek tokenizer's own encodings) with random ids of the
  whole vocabulary sprinkled in; half the requests carry a prompt tail.
* Churn: most requests finish (a finish row); `--abort` of them are aborted midway
  (an `abort` message); `--abandon` of them are simply never sent again, neither
  finished nor aborted, as when an engine loses track of a request. Their states pile
  up until detokd's table is full (`--max-states`) and eviction takes the oldest:
  each evicted request's worker gets an "evicted" row.
* The worker (a thread of this process) counts every row, checks that each finished
  request's last row has n_ids equal to its length and that only abandoned requests
  get errors, and keeps the whole text of every `--check-every`-th request, which is
  compared at the end with the oracle: transformers' decode of prompt tail + output.
* A sampler thread records, every `--interval` seconds, detokd's RSS (/proc) and
  what its /metrics says: live requests, tokens, evictions, errors.
* At the end: JSON with every sample and the summary, a PNG plot (RSS and live
  requests over time, matplotlib), both in `--out` (docs/soak/), and the verdict:
  RSS is flat when it grew by less than `--flat-threshold` over the last quarter
  of the run.

    python -m detokbench soak --quick     # ~1.4M tokens over 10k requests, seconds
    python -m detokbench soak             # ~135M tokens over 1M requests, minutes (docs/reliability.md)
    python -m detokbench soak --requests 110000   # the issue's minimum: >10M tokens, >100k requests

Exit status: 0 when RSS ended flat and every checked text was exact, 1 otherwise.

    churn    the engine: requests with random lengths and fates, one frame per step
    worker   the tokenizer worker: every request's ending, the checked texts
    sampler  RSS and /metrics over time, and whether RSS ended flat
    plot     the PNG
    run      one run in steps, its verdict and summary
    cli      the command line
"""
