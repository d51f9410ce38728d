"""Wire dialects: frames in, the core's rows; the core's output rows, frames out.

`dialect.Dialect` is what the loop asks of one. `native` speaks docs/protocol.md v1
(docs/protocol.md); SGLang's IPC is a dialect too, kept with the rest of SGLang mode in
detokd.sglang (dialect.py).
"""
