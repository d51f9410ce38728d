"""`python -m detokbench baselines`: one baseline of detokbench.baselines behind detokd's wire,
as `bench` starts it (docs/protocol.md v1, the part the benchmark sends):

    python -m detokbench baselines --algo naive|sglang|decodestream|floor \\
        --input ipc:///tmp/x/in --worker ipc:///tmp/x/w0 --tokenizer deepseek

It PULL-binds the input, PUSH-connects to each worker and answers every `tokens` row with
one `text` row (rid, new text, finish, n_ids, meta copied through), the rows of one inbound
message for one worker in one message; an unknown rid gets an `unknown_rid` error row.
Other message types, stop strings, `stream=false` and seq checks are not implemented.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
import sys
from dataclasses import dataclass
from typing import Iterable

import zmq

from detokd.wire import native
from detokd.wire.native import OutRow, Text, Tokens
from detokrig.engine import push
from detokrig.sink import pull

from .baselines import ALGOS, FloorStream, Stream, Tok
from .commands import parser

log = logging.getLogger("baselines")


@dataclass(slots=True)
class State:
    """A live request."""

    stream: Stream
    n_ids: int  # ids so far
    worker: int


class Server:
    """One baseline on one tokenizer: PULLs frames at `input_addr`, PUSHes text to the workers."""

    def __init__(self, algo: str, input_addr: str, workers: list[str], tokenizer: str) -> None:
        self.cls = ALGOS[algo]
        self.tok = Tok(tokenizer)
        self.cls.prepare(self.tok)
        self.batched = "step_batch" in self.cls.__dict__  # SGLang decodes the whole batch at once
        self.floor = self.cls is FloorStream
        if algo != "sglang":
            # Start-up objects (tokenizer tables, modules) out of every future collection, as
            # detokd does; SGLang's DetokenizerManager does not.
            gc.collect()
            gc.freeze()
        self.ctx = zmq.Context()
        self.pull = pull(self.ctx, input_addr, hwm=0)
        self.pushes = [push(self.ctx, w, hwm=0) for w in workers]
        for s in self.pushes:
            s.setsockopt(zmq.LINGER, -1)  # ZMQ's default: queued text still goes out
        self.states: dict[str, State] = {}

    def serve(self) -> None:
        while True:
            try:
                msg = native.decode_inbound(self.pull.recv())
            except native.DecodeError as e:
                log.warning("undecodable message: %s", e)
                continue
            if type(msg) is Tokens:
                for w, rows in self.tokens(msg).items():
                    if w < len(self.pushes):
                        self.pushes[w].send(native.encode(Text(rows)))
                    else:
                        log.warning("no address for worker %d: %d rows dropped", w, len(rows))

    def tokens(self, msg: Tokens) -> dict[int, list[OutRow]]:
        """Every row's text, by worker: row by row, or (SGLang) the batch at once."""
        out: dict[int, list[OutRow]] = {}
        cls, tok, states, batched, floor = self.cls, self.tok, self.states, self.batched, self.floor
        live: list[tuple] = []  # batched: (row, state) of every row, decoded together at the end
        for row in msg.rows:
            rid, start = row.rid, row.start
            if start is not None:
                stream = cls(tok, start.prompt_tail, start.skip_special_tokens, start.spaces_between_special_tokens)
                st = states[rid] = State(stream, 0, start.worker)
            elif (st := states.get(rid)) is None:
                for w in range(len(self.pushes)):
                    out.setdefault(w, []).append(OutRow(rid, "", row.finish, 0, row.meta, native.UNKNOWN_RID))
                continue
            ids = row.ids
            st.n_ids += len(ids)
            if batched:
                live.append((row, st))
                continue
            stream = st.stream
            if floor and not stream._strip:
                # The floor inline: bytes of the ids, one incremental UTF-8 decode.
                table = stream.table
                text = stream._dec(table[ids[0]] if len(ids) == 1 else b"".join([table[i] for i in ids]))
            else:
                text = stream.step(ids)
            if row.finish is not None:
                text += stream.finish()
                del states[rid]
            lst = out.get(st.worker)
            if lst is None:
                lst = out[st.worker] = []
            lst.append(OutRow(rid, text, row.finish, st.n_ids, row.meta))
        if live:
            texts = cls.step_batch([st.stream for _, st in live], [row.ids for row, _ in live],
                                   [row.finish is not None for row, _ in live])
            for (row, st), text in zip(live, texts, strict=True):
                if row.finish is not None:
                    states.pop(row.rid, None)
                out.setdefault(st.worker, []).append(OutRow(row.rid, text, row.finish, st.n_ids, row.meta))
        return out


def main(argv: Iterable[str]) -> int:
    ap = parser("baselines", __doc__)
    ap.add_argument("--algo", required=True, choices=sorted(ALGOS))
    ap.add_argument("--input", required=True, help="address to PULL-bind, e.g. ipc:///tmp/x/in")
    ap.add_argument("--worker", action="append", required=True, help="worker address to PUSH-connect (repeat)")
    ap.add_argument("--tokenizer", default="deepseek", help="zoo name or folder with tokenizer.json")
    args = ap.parse_args(list(argv))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s baselines %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt):
        Server(args.algo, args.input, args.worker, args.tokenizer).serve()
    return 0
