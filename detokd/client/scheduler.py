"""SchedulerClient: what an engine's scheduler uses to send token ids to detokd.

It batches one step's rows, tracks each rid's `seq` and sends one `tokens` message
per detokd shard. Sharding: every message about a rid goes to shard
`crc32(utf8(rid)) % n`, so any number of scheduler processes (in any language:
CRC-32 is zlib's) agree on a rid's shard without talking to each other, and a shard
sees all rows of its rids.

A shard that dies takes what its input queue and the socket buffers held, and ZMQ
tells the sender nothing. With `watch=True` a socket monitor on each shard's PUSH sees
the connection break, and `lost()` names the requests it may have cost (the live ones
on that shard, and those among its last rows), for the engine to fail.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from detokd.wire.native import (
    NIL,
    Abort,
    Control,
    EmbeddingRow,
    Embeddings,
    Finish,
    Register,
    Row,
    Start,
    Stopped,
    StoppedRow,
    Tokens,
    encode,
)

__all__ = ["SchedulerClient", "shard_for"]


_stopped = msgspec.msgpack.Decoder(Stopped)
# With watch=True, the rids of the last rows sent to each shard, up to this many rows:
# what a broken connection may have taken (ZMQ's queues and the socket buffers on both
# sides, and detokd's input queue: 1,000 messages) is taken as lost with it.
IN_FLIGHT_ROWS = 4096
# ZMQ_EVENTS and its bit as plain ints, as detokd.delivery has them: `&` with pyzmq's
# flag enums builds an Enum on each test (~0.7 µs); a watching client asks on every
# `take` and `lost`.
EVENTS = int(zmq.EVENTS)
POLLIN = int(zmq.POLLIN)


def shard_for(rid: str, n: int) -> int:
    """The shard of `rid` among `n`: stable across processes, hosts and languages.

    Not Python's hash(): it is salted per process, so two schedulers would disagree.
    """
    return zlib.crc32(rid.encode()) % n if n > 1 else 0


def _raw(obj: Any) -> msgspec.Raw:
    # meta/data are opaque to detokd: encode once here, detokd copies the bytes through.
    if obj is None:
        return NIL
    if isinstance(obj, msgspec.Raw):
        return obj
    return msgspec.Raw(encode(obj))


def _ids(ids: Sequence[int]) -> list[int]:
    if isinstance(ids, list):
        return ids
    tolist = getattr(ids, "tolist", None)  # numpy / torch: plain ints, not np.int64
    return tolist() if tolist is not None else list(ids)


class Tracked:
    """What the client keeps of one live rid. The shard is cached so the hash runs
    once per request. A __slots__ class: its attribute reads and writes are cheaper
    than the list it replaces (and than a msgspec Struct's), which keeps `add` fast."""

    __slots__ = ("seq", "vid", "shard")

    def __init__(self, seq: int, vid: int, shard: int) -> None:
        self.seq = seq  # the seq the rid's next row carries: ids sent since its (re)start
        self.vid = vid  # the vid of its last start; a new one restarts seq at 0
        self.shard = shard


def curve_client(sock: zmq.Socket, server_key: bytes | None, keypair: tuple[bytes, bytes] | None) -> None:
    """Make `sock` a CURVE client of the server whose public key is `server_key`."""
    if server_key is None:
        return
    if keypair is None:
        raise ValueError("a CURVE client needs its own key pair as well as the server's public key")
    sock.curve_publickey, sock.curve_secretkey = keypair
    sock.curve_serverkey = server_key


class _Watch:
    """One shard's connection events (a socket monitor), and the rids of the last rows
    sent on it: a connection that breaks takes an unknown part of them (ZMQ
    acknowledges nothing), a restarted detokd forgets the rest."""

    def __init__(self, monitor: zmq.Socket) -> None:
        self.monitor = monitor
        self.connected = False
        self.recent: deque[Sequence[str]] = deque()
        self.rows = 0

    def sent(self, rids: Sequence[str]) -> None:
        self.recent.append(rids)
        self.rows += len(rids)
        while self.rows > IN_FLIGHT_ROWS and len(self.recent) > 1:
            self.rows -= len(self.recent.popleft())

    def take_recent(self) -> set[str]:
        rids = {rid for group in self.recent for rid in group}
        self.recent.clear()
        self.rows = 0
        return rids

    def broke(self) -> bool:
        """Whether the connection broke since the last look (read without waiting)."""
        broke = False
        while cast(int, self.monitor.get(EVENTS)) & POLLIN:  # ZMQ_EVENTS is an int option
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED and self.connected:
                self.connected, broke = False, True
        return broke


class SchedulerClient:
    """PUSH side of detokd's input, one socket per shard. Not thread-safe.

    Call `add`/`begin` for every request that produced ids in this step, then
    `flush()` once: each shard gets one `tokens` message with its rows in the
    order they were added. `seq` is tracked per rid, so a lost row is detected by
    detokd. Sends block when a shard's queue holds `sndhwm` messages (detokd is
    down or behind); pass `send_timeout` (seconds) to get zmq.Again instead.
    """

    def __init__(
        self,
        addresses: list[str] | str,
        *,
        context: zmq.Context | None = None,
        sndhwm: int = 100_000,
        send_timeout: float | None = None,
        curve_server_key: bytes | None = None,
        curve_keypair: tuple[bytes, bytes] | None = None,
        watch: bool = False,
        feedback: str | None = None,
    ) -> None:
        """`curve_server_key` (detokd's public key) and `curve_keypair` (this client's
        public, secret; zmq.auth.load_certificate) connect with CURVE (docs/security.md).
        `watch`: notice a shard's connection breaking (a restart), and say in `lost()`
        which requests it may have taken rows of. `feedback`: bind a PULL socket there
        for detokd's `stopped` rows (`stopped()`); the address is detokd's `feedback` key."""
        self.addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        if not self.addresses:
            raise ValueError("SchedulerClient needs at least one detokd input address")
        self._own_context = context is None
        self._ctx = context if context is not None else zmq.Context()
        self._socks: list[zmq.Socket] = []
        self._watches: list[_Watch] = []
        for addr in self.addresses:
            s = self._ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, sndhwm)
            if send_timeout is not None:
                s.setsockopt(zmq.SNDTIMEO, int(send_timeout * 1000))
            curve_client(s, curve_server_key, curve_keypair)
            if watch:  # before the connect: the first event may come at once
                self._watches.append(_Watch(s.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)))
            s.connect(addr)
            self._socks.append(s)
        self._n = len(self._socks)
        self._pending: list[list[Row]] = [[] for _ in self._socks]
        self._reqs: dict[str, Tracked] = {}
        self._lost: set[str] = set()
        self.feedback_socket: zmq.Socket | None = None
        self.stale_stopped = 0  # `stopped` rows about a request no longer tracked under that vid
        if feedback is not None:
            self.feedback_socket = self._ctx.socket(zmq.PULL)
            self.feedback_socket.bind(feedback)

    @property
    def n_shards(self) -> int:
        return self._n

    def shard_of(self, rid: str) -> int:
        t = self._reqs.get(rid)
        return t.shard if t is not None else shard_for(rid, self._n)

    def seq_of(self, rid: str) -> int | None:
        """The seq the next row of `rid` will carry (None: the rid is not tracked)."""
        t = self._reqs.get(rid)
        return None if t is None else t.seq

    def __len__(self) -> int:
        """Requests being tracked (started and not yet finished, aborted or forgotten)."""
        return len(self._reqs)

    def add(
        self,
        rid: str,
        ids: Sequence[int] = (),
        *,
        start: Start | None = None,
        finish: Finish | None = None,
        meta: Any = None,
    ) -> None:
        """Queue one row of `rid` for this step; `ids` are the new ids only (a delta)."""
        ids = _ids(ids)
        t = self._reqs.get(rid)
        if t is None:
            t = self._reqs[rid] = Tracked(0, start.vid if start else 0, shard_for(rid, self._n))
        elif start is not None and start.vid != t.vid:
            # A new vid restarts the request in detokd, and its seq with it.
            t.seq, t.vid = 0, start.vid
        self._pending[t.shard].append(Row(rid, ids, t.seq, start, finish, _raw(meta)))
        t.seq += len(ids)
        if finish is not None:
            # The rid may be reused by a new request (with a new start) after this.
            del self._reqs[rid]

    def begin(
        self,
        rid: str,
        ids: Sequence[int] = (),
        *,
        worker: int = 0,
        vid: int = 0,
        prompt_tail: Sequence[int] = (),
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] = (),
        no_stop_trim: bool = False,
        stream: bool = True,
        finish: Finish | None = None,
        meta: Any = None,
    ) -> None:
        """`add` with a `start` built from keyword arguments: a request's first row."""
        start = Start(
            worker=worker,
            vid=vid,
            prompt_tail=_ids(prompt_tail),
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
            stop=list(stop),
            no_stop_trim=no_stop_trim,
            stream=stream,
        )
        self.add(rid, ids, start=start, finish=finish, meta=meta)

    def flush(self) -> None:
        """Send the queued rows: one `tokens` message per shard that has any."""
        if not self._watches:
            for shard, msg in self.take():
                self._send(shard, msg)
            return
        for shard, rows in enumerate(self._pending):
            if rows:
                self._pending[shard] = []
                self._send(shard, encode(Tokens(rows)), [row.rid for row in rows])

    def lost(self) -> list[str]:
        """With watch=True: the rids whose rows a shard's broken connection may have
        taken since the last call (a shard restarted, or the link failed). Without an
        acknowledgement nobody can tell which arrived: fail those requests. Their
        tracking ends here (a restarted shard knows none of them; their later rows
        would be answered unknown_rid); a rid may then start anew."""
        self._watch_connections()
        lost, self._lost = sorted(self._lost), set()
        return lost

    def _watch_connections(self) -> None:
        for shard in range(len(self._watches)):
            self._watch_shard(shard)

    def _watch_shard(self, shard: int) -> None:
        watch = self._watches[shard]
        if watch.broke():
            gone = {rid for rid, t in self._reqs.items() if t.shard == shard}
            for rid in gone:
                del self._reqs[rid]
            self._lost |= gone | watch.take_recent()

    def take(self) -> list[tuple[int, bytes]]:
        """The queued rows as encoded `tokens` messages, (shard, frame) per shard that
        has any, without sending them: for an engine that sends from another thread,
        or a benchmark that replays recorded steps."""
        out = []
        for shard, rows in enumerate(self._pending):
            if rows:
                self._pending[shard] = []
                out.append((shard, encode(Tokens(rows))))
        return out

    def _send(self, shard: int, msg: bytes, rids: Sequence[str] = ()) -> None:
        if not self._socks:
            raise RuntimeError("SchedulerClient is closed")
        if self._watches:
            self._watch_shard(shard)  # first: a connection that broke took what came before
        self._socks[shard].send(msg)
        if self._watches and rids:
            self._watches[shard].sent(rids)

    def stopped(self, timeout: float = 0.0) -> list[StoppedRow]:
        """The requests detokd stopped on a stop string since the last call, waiting up
        to `timeout` s for the first. Stop generating each one: its worker already has
        the finishing row, and this call queues the request's own finishing row
        (`Finish("stop", matched)`, sent by the next flush), which frees detokd's state
        of it; the client forgets the rid. Rows about a rid not tracked under that
        vid (it finished or restarted meanwhile) are not returned (`stale_stopped`)."""
        sock = self.feedback_socket
        if sock is None:
            raise RuntimeError("SchedulerClient has no feedback address")
        out: list[StoppedRow] = []
        wait = int(timeout * 1000)
        while sock.poll(wait):
            wait = 0
            for row in _stopped.decode(sock.recv()).rows:
                t = self._reqs.get(row.rid)
                if t is None or t.vid != row.vid:
                    self.stale_stopped += 1
                    continue
                self.add(row.rid, finish=Finish("stop", row.matched))
                out.append(row)
        return out

    def forget(self, rid: str) -> None:
        """Stop tracking `rid` without telling detokd (it ended some other way)."""
        self._reqs.pop(rid, None)

    def abort(self, rids: Iterable[str]) -> None:
        """Tell detokd to drop these requests now. Their rows still queued in this
        step are dropped too: nobody wants their text any more."""
        by_shard: dict[int, list[str]] = {}
        for rid in rids:
            by_shard.setdefault(self.shard_of(rid), []).append(rid)
            self._reqs.pop(rid, None)
        for shard, group in by_shard.items():
            gone = set(group)
            pend = self._pending[shard]
            if pend:
                self._pending[shard] = [r for r in pend if r.rid not in gone]
            self._send(shard, encode(Abort(group)))

    def register(self, worker: int, address: str) -> None:
        """Point worker `worker` at `address` on every shard (any shard may serve it)."""
        msg = encode(Register(worker, address))
        for shard in range(self._n):
            self._send(shard, msg)

    def control(self, op: str) -> None:
        """Send a control op ("freeze_gc", "flush") to every shard.

        Queued rows go first, so each shard sees everything in call order. After
        "flush" detokd holds no request, so this client forgets every rid too.
        """
        self.flush()
        msg = encode(Control(op))
        for shard in range(self._n):
            self._send(shard, msg)
        if op == "flush":
            self._reqs.clear()

    def embeddings(self, rows: Iterable[EmbeddingRow | Mapping[str, Any]]) -> None:
        """Forward embedding results to workers through detokd, now (not decoded).

        A row is an EmbeddingRow or a mapping {rid, worker, data, meta} whose data
        and meta are any MessagePack-able objects.
        """
        by_shard: dict[int, list[EmbeddingRow]] = {}
        for r in rows:
            if not isinstance(r, EmbeddingRow):
                r = EmbeddingRow(
                    r["rid"], r.get("worker", 0), _raw(r.get("data")), _raw(r.get("meta"))
                )
            by_shard.setdefault(self.shard_of(r.rid), []).append(r)
        for shard, group in by_shard.items():
            self._send(shard, encode(Embeddings(group)), [r.rid for r in group])

    def close(self, linger: float = 5.0) -> None:
        """Send what is queued, then close; waits at most `linger` s for delivery
        (messages to a detokd that is not up yet wait in the queue until then)."""
        if not self._socks:
            return
        try:
            self.flush()
        finally:
            for s, watch in zip(self._socks, self._watches, strict=False):  # no watches unless watch=True
                s.disable_monitor()
                watch.monitor.close(linger=0)
            for s in self._socks:
                s.close(linger=int(linger * 1000))
            self._socks = []
            if self.feedback_socket is not None:
                self.feedback_socket.close(linger=0)
            if self._own_context:
                self._ctx.term()

    def __enter__(self) -> SchedulerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
