"""Wire dialects: frames in, the core's rows; the core's output rows, frames out.

`native` speaks PROTOCOL.md v1 (docs/protocol.md). A dialect decodes and encodes;
it holds no request state and sends nothing itself.
"""
