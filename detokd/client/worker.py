"""WorkerClient: what a tokenizer worker uses to receive detokd's text.

An asyncio receiver that turns `text` rows into one async iterator of text deltas
per request (RequestStream). Rows of rids with no open stream go to the buffering
policy of detokd.client.buffer.
"""

from __future__ import annotations

import asyncio
import collections
import weakref
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, Union

import msgspec
import zmq
import zmq.asyncio

from detokd.wire.native import NIL, EmbeddingRow, Embeddings, Finish, OutRow, Register, Text, encode

from .. import logs
from .buffer import Buffer, Item
from .scheduler import curve_client

__all__ = ["DetokdError", "WorkerClosed", "WorkerClient", "RequestStream"]

log = logs.get(__name__)


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
            self._end(finished=True, failed=True)
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

    def _end(self, finished: bool, failed: bool = False) -> None:
        if not self._done:
            self._done = True
            self._finalizer.detach()
            self._worker._release(self.rid, self._sink, finished, failed)

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
        public key, for `register` (docs/security.md)."""
        self._buffer = Buffer(max_buffered)  # raises on a negative bound, before any socket
        self.address = address
        # What detokd should connect to: a wildcard bind (tcp://0.0.0.0:port) is not.
        self.advertise = advertise or address
        self.worker = worker
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
        self._pull_now: zmq.Socket = zmq.Socket.shadow(self._pull.underlying)
        # Registration goes through plain (blocking-API) sockets on the same context,
        # so it can happen here, before any event loop runs.
        self._sync_ctx: zmq.Context = zmq.Context.shadow(self._ctx.underlying)
        self._reg: list[zmq.Socket] = []
        for shard in shards if worker is not None else ():
            s = self._sync_ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            curve_client(s, curve_server_key, curve_keypair)
            s.connect(shard)
            self._reg.append(s)
        self.register()

        self._open: dict[str, _Sink] = {}
        self._pump: asyncio.Task[None] | None = None
        self._raw_reader = False
        self._closed = False
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
        done = failed = False
        try:
            while True:
                item = await sink.get()
                if item is _CLOSED:
                    raise WorkerClosed(rid)
                if isinstance(item, EmbeddingRow):
                    done = True
                    return item
                if item.error is not None:
                    done = failed = True
                    raise DetokdError(rid, item.error)
        finally:
            self._release(rid, sink, done, failed)

    def _claim(self, rid: str) -> _Sink:
        """Open `rid`'s sink, with the rows that arrived for it before anyone asked."""
        if self._closed:
            raise RuntimeError("WorkerClient is closed")
        if rid in self._open:
            raise ValueError(f"request {rid!r} already has an open stream")
        self._ensure_pump()
        sink = self._open[rid] = _Sink(self._buffer.claim(rid))
        return sink

    def _release(self, rid: str, sink: _Sink, finished: bool, failed: bool = False) -> None:
        """`rid`'s stream ended: after its finish, after an error row (`failed`: rows of
        that request may still follow), or unfinished (closed early)."""
        if self._open.get(rid) is not sink:
            return
        del self._open[rid]
        if finished or not self._closed:  # a closed client buffers nothing new
            self._buffer.released(rid, [i for i in sink.items if i is not _CLOSED], finished, failed)

    @property
    def max_buffered(self) -> int:
        return self._buffer.max_buffered

    @property
    def buffered_rids(self) -> int:
        return len(self._buffer)

    @property
    def dropped_rids(self) -> int:
        """Unclaimed rids whose buffered rows were dropped."""
        return self._buffer.dropped_rids

    @property
    def dropped_rows(self) -> int:
        """Rows of abandoned streams."""
        return self._buffer.dropped_rows

    @property
    def stale_rows(self) -> int:
        """Rows of a request that followed the error row its stream ended on."""
        return self._buffer.stale_rows

    @property
    def ignored_errors(self) -> int:
        """Error rows for rids this worker never saw."""
        return self._buffer.ignored_errors

    # ---- receiving

    def _dispatch(self, item: Item) -> None:
        sink = self._open.get(item.rid)
        if sink is not None:
            sink.put(item)
        else:
            self._buffer.offer(item)

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

    async def rows(self) -> AsyncIterator[Item]:
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
        self._buffer.clear()
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
