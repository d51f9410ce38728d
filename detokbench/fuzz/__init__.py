"""Fuzz run: N frames of honest and hostile traffic through a real detokd; does it
survive, stay exact, and keep its memory?

    honest scheduler (SchedulerClient) --\\
    hostile peer (raw PUSH)  ------------+--> `detokd serve` --text--> 2 workers (threads here)
    oversized senders (one PUSH each) --/

* Honest traffic: waves of 1..8 concurrent requests, real multilingual text encoded
  by the default tokenizer with random ids sprinkled in (detokbench.frames mixed_ids),
  half with a prompt tail, on both workers; one `tokens` frame per step through
  detokd.client.SchedulerClient; between waves, now and then a `flush` control (sent
  by the honest scheduler itself, so it never cuts a live honest request). Every
  honest text is compared at the end with Vocab.reference (the oracle).
* Hostile traffic, from another PUSH socket: every generator of detokbench.frames
  Hostile (malformed MessagePack, wrong types, unknown message types, ids outside the
  vocabulary, seq off, registers (refused: register is off by default), aborts of
  random rids, multipart messages...) and OverCaps (a rid over max_rid_len, rows over
  max_row_ids, max_wire_prompt_tail, max_stop_strings, max_stop_chars, max_meta_bytes,
  a row past its frame's max_frame_ids, frames over max_rows), plus sessions of "s-" requests that run a few steps and then
  end in a seq gap, an abort or a finish. Frames over max_frame_bytes go from a
  short-lived PUSH socket each (ZMQ drops that connection) and wait for the disconnect.
* detokd's RSS (/proc/<pid>/status VmRSS) is read after the warm-up (the first
  --warmup of the frames, which include every kind at least once, so first-use
  buffers and caches are in place) and at the end, each after a fence (a row on each
  input socket, answered: every frame before it was handled); VmHWM is the peak.
  /metrics is scraped at the end.

    python -m detokbench fuzz                   # 100,000 frames
    python -m detokbench fuzz --frames 3000 --json /tmp/f.json

    traffic   what the peers send: the honest scheduler, hostile sessions, oversized frames
    workers   the two tokenizer workers, checking what detokd sends them
    run       one run, in steps, and its verdict
    cli       the command line and the printed summary

Exit status 0 when detokd lived (and exited 0 on SIGTERM), every honest stream was
exact, hostile rows never got text, detokd counted exactly the frames it read, the
bad ones among them, the over-cap rows (too_large) and the refused registers, and the end RSS is within --rss-tolerance of the post-warm-up
RSS; 1 otherwise.
"""

