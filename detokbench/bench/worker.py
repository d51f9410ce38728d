"""The receiving side of the benchmark, a tokenizer worker process that acks whole steps:
`python -m detokbench.bench.worker TEXT_ADDR ACK_ADDR` (started by harness.Harness).

It counts the rows of each step (step number and send time ride in every row's `meta`)
and acks step k to ACK_ADDR once all its rows are in, with its latency: the receipt of
the last row minus the send (CLOCK_MONOTONIC, one clock for every process). The
scheduler steers it with the control messages below, on the same socket.
"""

from __future__ import annotations

import gc
import sys
import time
from collections import defaultdict
from operator import attrgetter
from typing import Callable, Union

import msgspec

from detokd.wire.native import Text
from detokrig.engine import push
from detokrig.sink import pull


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


class Steps:
    """The worker's state for one configuration: rows counted per step, the kept texts,
    the errors. `ack` sends an ack message."""

    def __init__(self, ack: Callable[[tuple], None], cfg: Configure | None = None) -> None:
        cfg = cfg or Configure(0, 1)
        self.ack, self.expected = ack, cfg.expected
        self.keep_all = cfg.check == "all"
        self.watch = set(cfg.watch) if cfg.check == "sample" else set()
        self.counts: dict[int, int] = {}
        self.texts: defaultdict[str, list[str]] = defaultdict(list)
        self.errors: list[list] = []
        self.n_errors = self.bad_frames = 0

    def account(self, step: int, n: int, t_send: int, t: int) -> None:
        """n more rows of `step`; its ack once all are in."""
        c = self.counts.get(step, 0) + n
        if c >= self.expected:
            self.counts.pop(step, None)
            self.ack((ACK_STEP, step, t, t - t_send))
        else:
            self.counts[step] = c

    def rows(self, rows: list, t: int) -> None:
        """One `text` message received at t: usually every row of one step."""
        if any(map(_error, rows)):
            self.one_by_one(rows, t)
            return
        if self.keep_all or self.watch:
            keep_all, watch, texts = self.keep_all, self.watch, self.texts
            for r in rows:
                if keep_all or r.rid in watch:
                    texts[r.rid].append(r.text)
        try:
            s0, t0 = _meta(rows[0].meta)
            same = _meta(rows[-1].meta)[0] == s0
        except msgspec.DecodeError:
            same = False
        if same:
            self.account(s0, len(rows), t0, t)
            return
        for r in rows:
            try:
                s, ts = _meta(r.meta)
            except msgspec.DecodeError:
                continue
            self.account(s, 1, ts, t)

    def one_by_one(self, rows: list, t: int) -> None:
        """Rows with errors (rare): count the errors, account every row that has a
        step (an unsolicited row, e.g. evicted, has none in its meta)."""
        for r in rows:
            if r.error is not None:
                self.n_errors += 1
                if len(self.errors) < 50:
                    self.errors.append([r.rid, r.error])
            try:
                step, t_send = _meta(r.meta)
            except msgspec.DecodeError:
                continue
            if self.keep_all or r.rid in self.watch:
                self.texts[r.rid].append(r.text)
            self.account(step, 1, t_send, t)

    def dump(self) -> dict:
        return {
            "texts": {k: "".join(v) for k, v in self.texts.items()},
            "errors": self.errors,
            "n_errors": self.n_errors,
            "bad_frames": self.bad_frames,
        }


_meta = msgspec.msgpack.Decoder(tuple[int, int]).decode


def main(text_addr: str, ack_addr: str) -> int:
    import zmq

    gc.disable()
    ctx = zmq.Context()
    text = pull(ctx, text_addr, hwm=0)
    ack = push(ctx, ack_addr, hwm=0)
    inbound = msgspec.msgpack.Decoder(Inbound)
    enc = msgspec.msgpack.Encoder().encode

    def send(a: tuple) -> None:
        ack.send(enc(a))

    steps = Steps(send)
    while True:
        frame = text.recv()
        t = time.monotonic_ns()
        try:
            msg = inbound.decode(frame)
        except msgspec.DecodeError:
            steps.bad_frames += 1
            continue
        if type(msg) is Text:
            if msg.rows:
                steps.rows(msg.rows, t)
        elif type(msg) is Configure:
            steps = Steps(send, msg)
            send((ACK_CONFIG, msg.cid))
        elif type(msg) is Dump:
            send((ACK_DUMP, msg.cid, steps.dump()))
        elif type(msg) is Quit:
            break
    ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
