"""Engine-side helpers for talking to detokd (PROTOCOL.md v1).

`SchedulerClient` is what an engine's scheduler uses: it batches one step's rows,
tracks each rid's `seq` and sends one `tokens` message per detokd shard.
`WorkerClient` is what a tokenizer worker uses: an asyncio receiver that turns
`text` rows into one async iterator of text deltas per request.

Sharding: every message about a rid goes to shard `crc32(utf8(rid)) % n`, so any
number of scheduler processes (in any language: CRC-32 is zlib's) agree on a
rid's shard without talking to each other, and a shard sees all rows of its rids.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import weakref
import zlib
from collections.abc import AsyncIterator, Awaitable, Iterable, Mapping, Sequence
from typing import Any, TypeVar, Union

import msgspec
import zmq
import zmq.asyncio

from detokd.wire.native import (
    NIL,
    Abort,
    Control,
    EmbeddingRow,
    Embeddings,
    Finish,
    OutRow,
    Register,
    Row,
    Start,
    Text,
    Tokens,
    encode,
)

__all__ = [
    "DetokdError",
    "WorkerClosed",
    "SchedulerClient",
    "WorkerClient",
    "RequestStream",
    "shard_for",
    "run",
]

log = logging.getLogger("detokd.client")

T = TypeVar("T")


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


# --------------------------------------------------------------------------- scheduler


def _curve_client(sock: zmq.Socket, server_key: bytes | None, keypair: tuple[bytes, bytes] | None) -> None:
    if server_key is None:
        return
    if keypair is None:
        raise ValueError("a CURVE client needs its own key pair as well as the server's public key")
    sock.curve_publickey, sock.curve_secretkey = keypair
    sock.curve_serverkey = server_key


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
    ) -> None:
        """`curve_server_key` (detokd's public key) and `curve_keypair` (this client's
        public, secret; zmq.auth.load_certificate) connect with CURVE."""
        self.addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        if not self.addresses:
            raise ValueError("SchedulerClient needs at least one detokd input address")
        self._own_context = context is None
        self._ctx = context if context is not None else zmq.Context()
        self._socks: list[zmq.Socket] = []
        for addr in self.addresses:
            s = self._ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, sndhwm)
            if send_timeout is not None:
                s.setsockopt(zmq.SNDTIMEO, int(send_timeout * 1000))
            _curve_client(s, curve_server_key, curve_keypair)
            s.connect(addr)
            self._socks.append(s)
        self._n = len(self._socks)
        self._pending: list[list[Row]] = [[] for _ in self._socks]
        # rid -> [seq, vid, shard]: the shard is cached so the hash runs once per request.
        self._reqs: dict[str, list[int]] = {}

    @property
    def n_shards(self) -> int:
        return self._n

    def shard_of(self, rid: str) -> int:
        st = self._reqs.get(rid)
        return st[2] if st is not None else shard_for(rid, self._n)

    def seq_of(self, rid: str) -> int | None:
        """The seq the next row of `rid` will carry (None: the rid is not tracked)."""
        st = self._reqs.get(rid)
        return None if st is None else st[0]

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
        st = self._reqs.get(rid)
        if st is None:
            st = self._reqs[rid] = [0, start.vid if start else 0, shard_for(rid, self._n)]
        elif start is not None and start.vid != st[1]:
            # A new vid restarts the request in detokd, and its seq with it.
            st[0], st[1] = 0, start.vid
        self._pending[st[2]].append(Row(rid, ids, st[0], start, finish, _raw(meta)))
        st[0] += len(ids)
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
        for shard, msg in self.take():
            self._send(shard, msg)

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

    def _send(self, shard: int, msg: bytes) -> None:
        if not self._socks:
            raise RuntimeError("SchedulerClient is closed")
        self._socks[shard].send(msg)

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
            self._send(shard, encode(Embeddings(group)))

    def close(self, linger: float = 5.0) -> None:
        """Send what is queued, then close; waits at most `linger` s for delivery
        (messages to a detokd that is not up yet wait in the queue until then)."""
        if not self._socks:
            return
        try:
            self.flush()
        finally:
            for s in self._socks:
                s.close(linger=int(linger * 1000))
            self._socks = []
            if self._own_context:
                self._ctx.term()

    def __enter__(self) -> SchedulerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- worker


class DetokdError(Exception):
    """detokd could not decode request `rid`: `error` is an OutRow error word."""

    def __init__(self, rid: str, error: str) -> None:
        super().__init__(f"detokd error for request {rid!r}: {error}")
        self.rid = rid
        self.error = error


class WorkerClosed(DetokdError):
    """The WorkerClient was closed while this stream was still open."""

    def __init__(self, rid: str) -> None:
        super().__init__(rid, "worker_closed")


_Item = Union[OutRow, EmbeddingRow]
_CLOSED = object()  # put in a sink when the client closes under an open stream
_outbound = msgspec.msgpack.Decoder(Union[Text, Embeddings])


class _Sink:
    """The rows of one claimed rid, waiting for its reader."""

    __slots__ = ("items", "event")

    def __init__(self, items: Iterable[Any] = ()) -> None:
        self.items: collections.deque[Any] = collections.deque(items)
        self.event = asyncio.Event()
        if self.items:
            self.event.set()

    def put(self, item: Any) -> None:
        self.items.append(item)
        self.event.set()

    async def get(self) -> Any:
        while not self.items:
            self.event.clear()
            await self.event.wait()
        return self.items.popleft()


class RequestStream:
    """Async iterator of one request's text deltas (non-empty str).

    Ends after the row with `finish`; raises DetokdError on an error row. After it
    ends, `finish` and `n_ids` hold the last row's values; `meta` is always the
    latest row's meta (msgspec.Raw; `meta_obj()` decodes it). Close it (or use
    `async with`) when giving up early, so later rows of the rid are dropped.
    """

    def __init__(self, worker: WorkerClient, rid: str, sink: _Sink) -> None:
        self.rid = rid
        self.finish: Finish | None = None
        self.n_ids = 0
        self.meta: msgspec.Raw = NIL
        self.error: str | None = None
        self._worker = worker
        self._sink = sink
        self._done = False
        # An abandoned stream (dropped without close) must still release its rid.
        self._finalizer = weakref.finalize(self, worker._release, rid, sink, False)
        self._finalizer.atexit = False

    @property
    def done(self) -> bool:
        return self._done

    def meta_obj(self, type: Any = Any) -> Any:
        return msgspec.msgpack.decode(self.meta, type=type)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> str:
        while True:
            row = await self.next_row()
            if row.text:
                return row.text

    async def next_row(self) -> OutRow:
        """The next raw OutRow of this rid (its text may be "")."""
        if self._done:
            raise StopAsyncIteration
        while True:
            item = await self._sink.get()
            if item is _CLOSED:
                self._end(finished=False)
                raise WorkerClosed(self.rid)
            if isinstance(item, OutRow):
                break
            log.warning("embedding row for %r, which is streaming text: dropped", self.rid)
        self.n_ids, self.meta = item.n_ids, item.meta
        if item.error is not None:
            self.error = item.error
            self._end(finished=True)
            raise DetokdError(self.rid, item.error)
        if item.finish is not None:
            self.finish = item.finish
            self._end(finished=True)
        return item

    async def rows(self) -> AsyncIterator[OutRow]:
        """Raw OutRows of this rid, through the finishing one."""
        while True:
            try:
                yield await self.next_row()
            except StopAsyncIteration:
                return

    async def text(self) -> str:
        """The whole remaining text (waits for the finish)."""
        return "".join([d async for d in self])

    def _end(self, finished: bool) -> None:
        if not self._done:
            self._done = True
            self._finalizer.detach()
            self._worker._release(self.rid, self._sink, finished)

    def close(self) -> None:
        """Stop reading: later rows of this request are dropped, not buffered."""
        self._end(finished=False)

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class WorkerClient:
    """A tokenizer worker's receiver: PULL-binds `address`, detokd shards connect.

    Works under any running asyncio loop (uvloop included: see `run`). Open a
    request's stream before handing the request to the scheduler; rows that
    arrive before anyone asks for them are still kept, for at most
    `max_buffered` rids (the oldest unclaimed rid is dropped first and counted in
    `dropped_rids`), so streams nobody reads cannot grow memory without bound.
    """

    def __init__(
        self,
        address: str,
        *,
        shards: Sequence[str] = (),
        worker: int | None = None,
        max_buffered: int = 1024,
        advertise: str | None = None,
        context: zmq.Context | None = None,
        curve_keypair: tuple[bytes, bytes] | None = None,
        curve_server_key: bytes | None = None,
    ) -> None:
        """`curve_keypair` (public, secret) makes the PULL socket a CURVE server (give
        detokd its public key: curve_worker_keys); `curve_server_key` is detokd's
        public key, for `register`."""
        if max_buffered < 0:
            raise ValueError("max_buffered must be >= 0")
        self.address = address
        # What detokd should connect to: a wildcard bind (tcp://0.0.0.0:port) is not.
        self.advertise = advertise or address
        self.worker = worker
        self.max_buffered = max_buffered
        self._own_context = context is None
        # Any context will do (a plain one too): its asyncio twin makes awaitable sockets.
        self._ctx = zmq.asyncio.Context() if context is None else zmq.asyncio.Context.shadow(context.underlying)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        if curve_keypair is not None:
            self._pull.curve_publickey, self._pull.curve_secretkey = curve_keypair
            self._pull.curve_server = True
        try:
            self._pull.bind(address)
        except zmq.ZMQError:
            self._pull.close()
            if self._own_context:
                self._ctx.term()
            raise
        # The same socket through the plain API, to drain queued frames without a Future each.
        self._pull_now = zmq.Socket.shadow(self._pull.underlying)
        # Registration goes through plain (blocking-API) sockets on the same context,
        # so it can happen here, before any event loop runs.
        self._sync_ctx = zmq.Context.shadow(self._ctx.underlying)
        self._reg: list[zmq.Socket] = []
        for shard in shards if worker is not None else ():
            s = self._sync_ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            _curve_client(s, curve_server_key, curve_keypair)
            s.connect(shard)
            self._reg.append(s)
        self.register()

        self._open: dict[str, _Sink] = {}
        self._buffered: collections.OrderedDict[str, list[_Item]] = collections.OrderedDict()
        # Rids whose stream was closed before its finish: their late rows are dropped
        # until the finishing row. Bounded like the buffer.
        self._abandoned: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._pump: asyncio.Task[None] | None = None
        self._raw_reader = False
        self._closed = False
        self.dropped_rids = 0  # unclaimed rids whose buffered rows were dropped
        self.dropped_rows = 0  # rows of abandoned streams
        self.ignored_errors = 0  # error rows for rids this worker never saw
        self.bad_frames = 0  # frames that are not a text/embeddings message

    def register(self) -> None:
        """(Re)send `register` to every shard, e.g. after a detokd restart."""
        if self.worker is None:
            return
        msg = encode(Register(self.worker, self.advertise))
        for s in self._reg:
            try:
                s.send(msg, zmq.NOBLOCK)
            except zmq.Again:
                log.warning("register for worker %d not queued: shard is full", self.worker)

    # ---- streams

    def stream(self, rid: str) -> RequestStream:
        """The text deltas of `rid`; call from within the running event loop."""
        if self._raw_reader:
            raise RuntimeError("rows() is reading this socket; streams get nothing")
        return RequestStream(self, rid, self._claim(rid))

    async def embedding(self, rid: str) -> EmbeddingRow:
        """Wait for the embedding row of `rid` (its data and meta stay msgspec.Raw)."""
        sink = self._claim(rid)
        done = False
        try:
            while True:
                item = await sink.get()
                if item is _CLOSED:
                    raise WorkerClosed(rid)
                if isinstance(item, EmbeddingRow):
                    done = True
                    return item
                if item.error is not None:
                    done = True
                    raise DetokdError(rid, item.error)
        finally:
            self._release(rid, sink, done)

    def _claim(self, rid: str) -> _Sink:
        """Open `rid`'s sink, with the rows that arrived for it before anyone asked."""
        if self._closed:
            raise RuntimeError("WorkerClient is closed")
        if rid in self._open:
            raise ValueError(f"request {rid!r} already has an open stream")
        self._ensure_pump()
        self._abandoned.pop(rid, None)
        sink = self._open[rid] = _Sink(self._buffered.pop(rid, ()))
        return sink

    def _release(self, rid: str, sink: _Sink, finished: bool) -> None:
        if self._open.get(rid) is not sink:
            return
        del self._open[rid]
        rest = [i for i in sink.items if i is not _CLOSED]
        if finished:
            if rest:  # the rid was reused by a new request: its rows wait for a reader
                self._buffer(rid, rest)
        elif not self._closed and not any(_ends(i) for i in rest):
            self._abandoned[rid] = None
            while len(self._abandoned) > max(self.max_buffered, 1):
                self._abandoned.popitem(last=False)

    def _buffer(self, rid: str, items: list[_Item]) -> None:
        if self.max_buffered == 0:
            self.dropped_rids += 1
            return
        while len(self._buffered) >= self.max_buffered:
            old, _ = self._buffered.popitem(last=False)
            self.dropped_rids += 1
            log.debug("dropped buffered rows of unclaimed request %r", old)
        self._buffered[rid] = items

    @property
    def buffered_rids(self) -> int:
        return len(self._buffered)

    # ---- receiving

    def _dispatch(self, item: _Item) -> None:
        rid = item.rid
        sink = self._open.get(rid)
        if sink is not None:
            sink.put(item)
            return
        if rid in self._abandoned:
            self.dropped_rows += 1
            if _ends(item):
                del self._abandoned[rid]
            return
        buf = self._buffered.get(rid)
        if buf is not None:
            buf.append(item)
        elif isinstance(item, OutRow) and item.error is not None:
            # detokd sends errors for rids it cannot place to every worker: not ours.
            self.ignored_errors += 1
        else:
            self._buffer(rid, [item])

    def _feed(self, frame: bytes) -> None:
        try:
            msg = _outbound.decode(frame)
        except msgspec.DecodeError as e:
            self.bad_frames += 1
            log.warning("dropped a frame that is not a text/embeddings message: %s", e)
            return
        for item in msg.rows:
            self._dispatch(item)

    def _ensure_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run_pump())

    async def start(self) -> None:
        """Start receiving now (otherwise the first stream() starts it)."""
        self._ensure_pump()

    async def _run_pump(self) -> None:
        try:
            while True:
                self._feed(await self._pull.recv())
                # Drain what is already queued without going back through the loop.
                while True:
                    try:
                        frame = self._pull_now.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._feed(frame)
        except asyncio.CancelledError:
            raise
        except Exception:
            if not self._closed:
                log.exception("worker receive loop failed; open streams are closed")
                self._fail_open()
            raise

    async def rows(self) -> AsyncIterator[_Item]:
        """Every received row (OutRow or EmbeddingRow), raw; instead of streams."""
        if self._pump is not None or self._open:
            raise RuntimeError("streams are reading this socket; use one or the other")
        self._raw_reader = True
        try:
            while True:
                frame = await self._pull.recv()
                try:
                    msg = _outbound.decode(frame)
                except msgspec.DecodeError:
                    self.bad_frames += 1
                    continue
                for item in msg.rows:
                    yield item
        finally:
            self._raw_reader = False

    # ---- lifetime

    def _fail_open(self) -> None:
        for sink in list(self._open.values()):
            sink.put(_CLOSED)

    def close(self) -> None:
        """Stop receiving; open streams raise WorkerClosed. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._pump is not None:
            self._pump.cancel()
        self._fail_open()
        self._buffered.clear()
        for s in self._reg:
            s.close(linger=0)
        self._pull.close(linger=0)
        if self._own_context:
            self._ctx.term()

    async def aclose(self) -> None:
        """close(), then wait for the receive task to finish cancelling."""
        pump = self._pump
        self.close()
        if pump is not None:
            try:
                await pump
            except (asyncio.CancelledError, Exception):
                pass

    async def __aenter__(self) -> WorkerClient:
        self._ensure_pump()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _ends(item: Any) -> bool:
    return isinstance(item, EmbeddingRow) or item.finish is not None or item.error is not None


def run(main: Awaitable[T]) -> T:
    """Run a coroutine on uvloop when it is installed, else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)  # type: ignore[arg-type]
    return uvloop.run(main)  # type: ignore[arg-type]
