"""The core: what detokd does with token ids, whatever wire they came on.

The request table, the decoders, the stop scanner and the request state machine.
Nothing here opens a socket or knows a wire format: a dialect (detokd.wire) turns
frames into the core's rows, and delivery (detokd.delivery) sends what comes out.
"""
