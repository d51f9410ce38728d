"""`python -m detokbench baselines`: one baseline of detokbench.baselines behind detokd's wire.

Server (the same harness as detokd, docs/protocol.md v1, the subset the benchmark uses):

    python -m detokbench baselines --algo naive|sglang|decodestream|floor \\
        --input ipc:///tmp/x/in --worker ipc:///tmp/x/w0 --tokenizer deepseek

PULL-binds the input, PUSH-connects to each worker, answers every `tokens` row with one
`text` row (rid, new text, finish, n_ids, meta copied through) and rows of one inbound
message that go to one worker leave in one message. `abort`, `register`, `embeddings`
and the `flush`/`freeze_gc` controls are honoured; unknown rids get an `unknown_rid`
error row. Stop strings, `stream=false` and seq checks are not implemented.
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
from dataclasses import dataclass
from typing import Iterable

import zmq

from detokd.wire import native
from detokd.wire.native import Abort, Control, Embeddings, OutRow, Register, Text, Tokens

from .baselines import ALGOS, FloorStream, Stream, Tok
from .commands import parser
from .engine import push
from .sink import pull

log = logging.getLogger("baselines")


@dataclass(slots=True)
class State:
    """A live request."""

    stream: Stream
    n_ids: int  # ids so far
    worker: int


class Server:
    """One baseline on one tokenizer: PULLs frames at `input_addr`, PUSHes text to the
    workers (registered ones too)."""

    def __init__(self, algo: str, input_addr: str, workers: list[str], tokenizer: str, hwm: int = 0) -> None:
        self.cls = ALGOS[algo]
        self.tok = Tok(tokenizer)
        self.cls.prepare(self.tok)
        self.batched = "step_batch" in self.cls.__dict__  # SGLang decodes the whole batch at once
        self.floor = self.cls is FloorStream
        if algo != "sglang":
            # Start-up objects (tokenizer tables, modules) out of every future collection, as
            # detokd does; SGLang's DetokenizerManager does not (until a freeze_gc request).
            gc.collect()
            gc.freeze()
        self.hwm = hwm
        self.ctx = zmq.Context()
        self.pull = pull(self.ctx, input_addr, hwm=hwm)
        self.pushes: dict[int, zmq.Socket] = {}
        for i, w in enumerate(workers):
            self.connect(i, w)
        self.states: dict[str, State] = {}
        log.info("%s serving %s -> %s (%s)", algo, input_addr, workers, self.tok.dir)

    def connect(self, index: int, address: str) -> None:
        old = self.pushes.pop(index, None)
        if old is not None:
            old.close(linger=1000)
        s = push(self.ctx, address, hwm=self.hwm)
        s.setsockopt(zmq.LINGER, -1)  # ZMQ's default: queued text still goes out
        self.pushes[index] = s

    def send(self, by_worker: dict[int, list[OutRow]]) -> None:
        for w, rows in by_worker.items():
            sock = self.pushes.get(w)
            if sock is None:
                log.warning("no address for worker %d: %d rows dropped", w, len(rows))
                continue
            sock.send(native.encode(Text(rows)))

    def serve(self) -> None:
        decode_inbound = native.decode_inbound
        while True:
            frame = self.pull.recv()
            try:
                msg = decode_inbound(frame)
            except native.DecodeError as e:
                log.warning("undecodable message: %s", e)
                continue
            if type(msg) is Tokens:
                self.send(self.tokens(msg))
            elif type(msg) is Abort:
                for rid in msg.rids:
                    self.states.pop(rid, None)
            elif type(msg) is Control:
                self.control(msg.op)
            elif type(msg) is Register:
                self.connect(msg.worker, msg.address)
            elif type(msg) is Embeddings:
                self.embeddings(msg)

    def tokens(self, msg: Tokens) -> dict[int, list[OutRow]]:
        """Every row's text, by worker: row by row, or (SGLang) the batch at once."""
        out: dict[int, list[OutRow]] = {}
        cls, tok, states, batched, floor = self.cls, self.tok, self.states, self.batched, self.floor
        if batched:
            live_rows, streams, idss, fins = [], [], [], []
        for row in msg.rows:
            rid = row.rid
            start = row.start
            if start is not None:
                st = states[rid] = State(
                    cls(tok, start.prompt_tail, start.skip_special_tokens, start.spaces_between_special_tokens), 0, start.worker
                )
            else:
                st = states.get(rid)
                if st is None:
                    err = OutRow(rid, "", row.finish, 0, row.meta, native.UNKNOWN_RID)
                    for w in self.pushes:
                        out.setdefault(w, []).append(err)
                    continue
            ids = row.ids
            st.n_ids += len(ids)
            if batched:
                live_rows.append((row, st))
                streams.append(st.stream)
                idss.append(ids)
                fins.append(row.finish is not None)
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
        if batched and streams:
            texts = cls.step_batch(streams, idss, fins)
            for (row, st), text in zip(live_rows, texts):
                if row.finish is not None:
                    states.pop(row.rid, None)
                out.setdefault(st.worker, []).append(OutRow(row.rid, text, row.finish, st.n_ids, row.meta))
        return out

    def control(self, op: str) -> None:
        if op == "flush":
            self.states.clear()
        elif op == "freeze_gc":
            gc.freeze()
        else:
            log.warning("unknown control op %r", op)

    def embeddings(self, msg: Embeddings) -> None:
        """Forwarded to each row's worker, as detokd does."""
        by: dict[int, list] = {}
        for r in msg.rows:
            by.setdefault(r.worker, []).append(r)
        for w, rows in by.items():
            if w in self.pushes:
                self.pushes[w].send(native.encode(Embeddings(rows)))


def main(argv: Iterable[str]) -> int:
    ap = parser("baselines", __doc__)
    ap.add_argument("--algo", required=True, choices=sorted(ALGOS))
    ap.add_argument("--input", required=True, help="address to PULL-bind, e.g. ipc:///tmp/x/in")
    ap.add_argument("--worker", action="append", required=True, help="worker address to PUSH-connect (repeat)")
    ap.add_argument("--tokenizer", default="deepseek", help="zoo name or folder with tokenizer.json")
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args(list(argv))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s baselines %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        Server(args.algo, args.input, args.worker, args.tokenizer).serve()
    except KeyboardInterrupt:
        pass
    return 0
