"""What one worst-case inbound frame at detokd's DEFAULT caps costs a real `detokd serve`.

Issue #13: /health must tell a stuck loop from a busy one, and SIGTERM must end detokd
within shutdown_grace_s, "the caps bound the longest frame". This measures how long
that longest frame is. Each scenario builds one PROTOCOL v1 `tokens` frame just under
max_frame_bytes (64 MiB) with detokd.wire.native's Structs and sends it to a fresh
detokd (default config and caps, deepseek tokenizer, one worker) after a warm-up of a
few honest requests (their text checked against Vocab.reference):

* mass_start        max_rows (65,536) rows, each a new request (start, one id), rids
                    padded to ~1 KB so the frame is full
* mass_start_evict  the same frame with max_states = 1024: 64,512 evictions
* longest_token     rows of max_row_ids ids of the id whose text is longest (128 spaces,
                    deepseek 69933), one request each: ~5 bytes in, 128 bytes out per id
                    (max_frame_ids lets the first rows through, the rest get too_large)
* malformed         65,536 rows whose ids end in a string: the frame fails as a whole
                    and every row is salvaged one by one (bad_row each)
* stop_holdback     one request: a start with max_stop_strings stop strings of
                    max_stop_chars characters in all, spaces and a mark each, then rows
                    of 69933: every step holds the spaces back and every character goes
                    through the stop automaton
* stop_distinct     a frame of starts with a distinct max-size stop list each (one
                    automaton apiece, never shared; max_frame_stop_chars lets the first
                    be built, the rest get too_large); with --distinct-starts N only N
                    of them, and a full frame's figures extrapolated from their cost
* abort_mass        an abort of max_rows rids of max_rid_len characters, each a live
                    request's (a frame of as many starts comes first, unmeasured)
* abort_over        an abort of one-byte rids (empty strings) filling the frame: 60 M of
                    them, beyond max_rows (a bad frame, refused from its length header)
* embeddings_mass   max_rows embeddings rows with rids as long as the frame allows,
                    forwarded to the worker
* register_huge     a register whose address fills the frame (a bad frame: the address
                    is past wire.native.MAX_ADDRESS)
* control_huge      a control whose op fills the frame (a bad frame: past MAX_OP)
* window_byte_run   codec = "window" on mistral_v3: max_rows one-id rows of one request,
                    an open byte-fallback run ("中" as <0xE4><0xB8><0xAD>), then a word
                    that ends it and the request (max_rows at --quick too)

Every message type is covered. abort, register and control have no answer: their
"handled" time is the probe's.

For each: (a) seconds from the send until the worker got the frame's answer, and until
the answer to a probe request sent right after it (its text checked against the
oracle); (b) GET /health every 50 ms from a thread (10 s timeout): the worst latency and
every non-200 answer; (c) detokd's VmHWM / VmRSS before and after; (d) on another fresh
detokd, SIGTERM ~100 ms after the same frame was sent: seconds until it exited, and its
exit status (3: the shutdown grace ran out).

    python -m detokbench worst-frames                               # ~150 s (12 scenarios), docs/bench/worst.json
    python -m detokbench worst-frames --quick --json /tmp/worst.json  # seconds
    python -m detokbench worst-frames --only malformed,mass_start

    scenarios  the scale of a run, each scenario's frame, built from detokd.wire.native
    peers      a fresh detokd with its worker and engine; the warm-up
    measures   what one frame costs: answer and probe times, /health, memory, SIGTERM
    cli        the command line, the run of every scenario, the table

--quick builds frames of 128 KiB (512 rows, 1,024 ids a row) at the same caps: a smoke
run, not figures. Exit status 0 when every scenario completed with its probe exact.
"""

