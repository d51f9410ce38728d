"""The receiving side of bench.py: a tokenizer worker process that acks whole steps.

    python -m detokbench.bench.worker TEXT_ADDR ACK_ADDR      (started by harness.Harness)

It PULLs detokd.wire.native `text` messages at TEXT_ADDR, counts the rows of each step
(the step number and the send time ride in every row's `meta`, which implementations
copy through untouched) and, once all rows of step k are in, PUSHes an ack of step k
to ACK_ADDR with the step's latency: this process' receive time of the last row minus
the scheduler's send time (CLOCK_MONOTONIC, one clock for every process). The
scheduler steers it with the control messages below, on the same socket.
"""

from __future__ import annotations

import gc
import sys
import time
from operator import attrgetter
from typing import Union

import msgspec

from detokd.wire.native import Text


class Configure(msgspec.Struct, tag_field="type", tag="bench_config"):
    """A new configuration: `expected` rows per step; keep the text of `watch` (or all)."""

    cid: int
    expected: int
    check: str = "off"  # off, sample (the rids of watch), all
    watch: list[str] = []


class Dump(msgspec.Struct, tag_field="type", tag="bench_dump"):
    """Send back the kept texts and the error counts of configuration `cid`."""

    cid: int


class Quit(msgspec.Struct, tag_field="type", tag="bench_quit"):
    pass


Inbound = Union[Text, Configure, Dump, Quit]

# Acks: (ACK_STEP, step, receive time, latency ns), (ACK_CONFIG, cid), (ACK_DUMP, cid, dump)
ACK_STEP, ACK_CONFIG, ACK_DUMP = 0, 1, 2

_error = attrgetter("error")


def main(text_addr: str, ack_addr: str) -> int:
    import zmq

    gc.disable()
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.bind(text_addr)
    ack = ctx.socket(zmq.PUSH)
    ack.setsockopt(zmq.SNDHWM, 0)
    ack.connect(ack_addr)

    inbound = msgspec.msgpack.Decoder(Inbound)
    meta_dec = msgspec.msgpack.Decoder(tuple[int, int]).decode
    enc = msgspec.msgpack.Encoder().encode
    now = time.monotonic_ns

    expected = 1
    counts: dict[int, int] = {}
    check = "off"
    watch: set[str] = set()
    texts: dict[str, list[str]] = {}
    n_ids: dict[str, int] = {}
    errors: list[list] = []
    n_errors = 0
    bad_frames = 0

    def account(step: int, n: int, t_send: int, t: int) -> None:
        c = counts.get(step, 0) + n
        if c >= expected:
            counts.pop(step, None)
            ack.send(enc((ACK_STEP, step, t, t - t_send)))
        else:
            counts[step] = c

    def keep(r) -> None:
        lst = texts.get(r.rid)
        if lst is None:
            lst = texts[r.rid] = []
        lst.append(r.text)
        n_ids[r.rid] = r.n_ids

    def one_by_one(rows, t: int) -> None:
        """Rows with errors (rare): count the errors, account every row that has a
        step (an unsolicited row, e.g. evicted, has none in its meta)."""
        nonlocal n_errors
        for r in rows:
            if r.error is not None:
                n_errors += 1
                if len(errors) < 50:
                    errors.append([r.rid, r.error])
            try:
                step, t_send = meta_dec(r.meta)
            except msgspec.DecodeError:
                continue
            if check == "all" or (check == "sample" and r.rid in watch):
                keep(r)
            account(step, 1, t_send, t)

    while True:
        frame = pull.recv()
        t = now()
        try:
            msg = inbound.decode(frame)
        except msgspec.DecodeError:
            bad_frames += 1
            continue
        if type(msg) is Text:
            rows = msg.rows
            if not rows:
                continue
            if any(map(_error, rows)):
                one_by_one(rows, t)
                continue
            if check == "all":
                for r in rows:
                    keep(r)
            elif check == "sample":
                for r in rows:
                    if r.rid in watch:
                        keep(r)
            try:
                s0, t0 = meta_dec(rows[0].meta)
                same = meta_dec(rows[-1].meta)[0] == s0
            except msgspec.DecodeError:
                same = False
            if same:
                account(s0, len(rows), t0, t)
            else:
                for r in rows:
                    try:
                        s, ts = meta_dec(r.meta)
                    except msgspec.DecodeError:
                        continue
                    account(s, 1, ts, t)
        elif type(msg) is Configure:
            cid, expected, check, watch = msg.cid, msg.expected, msg.check, set(msg.watch)
            counts.clear()
            texts.clear()
            n_ids.clear()
            errors.clear()
            n_errors = bad_frames = 0
            ack.send(enc((ACK_CONFIG, cid)))
        elif type(msg) is Dump:
            payload = {
                "texts": {k: "".join(v) for k, v in texts.items()},
                "n_ids": n_ids,
                "errors": errors,
                "n_errors": n_errors,
                "bad_frames": bad_frames,
                "incomplete_steps": len(counts),
            }
            ack.send(enc((ACK_DUMP, msg.cid, payload)))
        elif type(msg) is Quit:
            break
    ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
