"""Delivery: every outbound socket, and what happens when a peer stops reading.

Each worker gets its own PUSH socket and its own queue, bounded in bytes, and so does
the scheduler's feedback address (its `stopped` rows echo rids: a message of them can be
megabytes). Sends never block:
a worker that stops reading fills its own queue and only its requests fail
(`worker_stalled`), while every other worker is served as before (SGLang #29366
fanned out one message per request and stalled everyone behind one slow peer). The
stall policy: `deliver` returns the messages a full queue lost, whose requests the
loop has the core fail; the worker is owed their error rows (`owe`), which the loop
sends once its queue has room (`owed_ready`, `settle_owed`).

A worker's queue is ZMQ's (`send_hwm` messages, kept short, and only while the worker
is connected: ZMQ_IMMEDIATE) and, behind it, a backlog here (`send_queue_bytes`). ZMQ
counts messages only and shows no depth, so bytes are counted where they can be: in
the backlog, which the loop drains into ZMQ whenever the socket can take more
(`flush`, woken by the socket's POLLOUT).

ZMQ tells a sender nothing of what a broken connection took with it (its queue, the
socket buffers). A socket monitor tells that it broke (`watch_connections`), and the
last messages that entered ZMQ's queue are then taken as possibly lost: the loop
fails the requests they leave live (`take_broken`, `fail_going`), and the worker is
told once it is back; those they ended are only counted (`_broken`).

Frames are encoded by the wire dialect, which hands them over in an `Output`; delivery
only moves bytes and never calls back into the dialect or the core.
"""

from __future__ import annotations

import fnmatch
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from . import logs
from .config import Config
from .core.bounded import BoundedMap
from .core.records import OutRow
from .core.stats import Stats, WorkerFigures
from .output import Output, WorkerOut
from .sockets import Curve, ipc_folder_problem, register_address_problem

log = logs.get(__name__)

FEEDBACK = -1  # the feedback queue's index among the backlogged: no worker's
# Rows taken as lost when a worker's connection breaks: those of the last messages ZMQ
# took, up to this many rows or bytes of frames, whichever comes first (ZMQ's queue and
# the socket buffers hold ~1 MB: 16 batch-sized messages, or a few thousand one-row
# ones). Bounded in rows too: a kept row costs a few hundred bytes of Python objects.
IN_FLIGHT_ROWS = 4096
IN_FLIGHT_BYTES = 1 << 20
MAX_OWED = 65536  # error rows kept per worker for when it has room again
MAX_OWED_BYTES = 16 << 20  # and their bytes: rids are the peer's strings, of any length
# Frames below this size are copied into ZMQ's message; larger ones are handed over
# zero-copy (tracking a zero-copy frame until ZMQ is done with it costs more than
# copying a small one).
COPY_BELOW = 65536
# ZMQ_EVENTS and its bits as plain ints: `&` with pyzmq's flag enums builds an Enum on
# each test (~0.7 µs, more than half the option read), and the loop tests them each turn.
EVENTS = int(zmq.EVENTS)
POLLIN = int(zmq.POLLIN)
POLLOUT = int(zmq.POLLOUT)
# Seconds between two reads of the workers' ZMQ queue state for /metrics' writable gauge,
# at most: a read costs ~1 µs a worker, and a busy loop turns every few µs.
ROOM_EVERY = 0.05


def owed_cost(rid: str, row: OutRow) -> int:
    return len(rid) + 120  # the rid twice (key and row) shares one string; the row's fixed size


def _owed() -> BoundedMap[str, OutRow]:
    return BoundedMap(MAX_OWED, MAX_OWED_BYTES, owed_cost)


REGISTER_REFUSED = "register_refused"  # detokd_errors kind of a register the policy refused
BAD_REGISTER = "bad_register"  # detokd_errors kind of a worker address ZMQ cannot connect to


@dataclass(frozen=True)
class RegisterPolicy:
    """Who may point a worker's rows somewhere else (docs/protocol.md, `register`).

    Anyone who reaches the input can send `register`; left open, a stranger could
    name worker 0 with its own address and receive every later row of it. So it is
    off unless enabled, only addresses matching an allow-list, no existing worker
    moved unless `replace`, and at most `max_added` workers added at run time.
    """

    enabled: bool = False
    allow: tuple[str, ...] = ()
    replace: bool = False
    max_added: int = 16
    # CURVE is on: a registered tcp worker would be plaintext (no key comes in a register).
    tcp_needs_curve: bool = False

    @classmethod
    def of(cls, cfg: Config, curve: bool) -> RegisterPolicy:
        """The register_* keys; with CURVE on (`curve`), a tcp register is refused unless
        curve_plaintext names "register"."""
        return cls(
            cfg.register_enabled, tuple(cfg.register_allow), cfg.register_replace, cfg.register_max,
            tcp_needs_curve=curve and "register" not in cfg.curve_plaintext,
        )

    def refusal(self, delivery: Delivery, index: int, address: str) -> str | None:
        """Why this register is refused, or None."""
        if not self.enabled:
            return "register is disabled (register_enabled = false)"
        problem = register_address_problem(address)
        if problem is None and (taken := ipc_folder_problem(address)) is not None:
            problem = taken[0]  # a worker registers once bound: a path it may not own is refused
        if problem is not None:
            return problem
        if not any(fnmatch.fnmatchcase(address, pattern) for pattern in self.allow):
            return "the address matches no register_allow pattern"
        if self.tcp_needs_curve and address.startswith("tcp://"):
            return "CURVE is on and a registered tcp worker would be plaintext (curve_plaintext lacks \"register\")"
        w = delivery.workers.get(index)
        if w is not None:
            if w.address != address and not self.replace:
                return "the worker exists and register_replace = false"
        elif delivery.added >= self.max_added:
            return f"register_max ({self.max_added}) workers were added already"
        return None


@dataclass(slots=True)
class Queued:
    """A frame waiting in a backlog, with the rows it carries (to fail them if lost)."""

    frame: bytes
    rows: Sequence[OutRow]


@dataclass(slots=True)
class Sent:
    """A message ZMQ took, by the rows it carries and its size."""

    rows: Sequence[OutRow]
    nbytes: int


@dataclass
class Worker:
    index: int
    address: str
    socket: zmq.Socket | None = None
    monitor: zmq.Socket | None = None  # the socket's connection events (workers only)
    connected: bool = False
    sent: int = 0  # messages queued (in ZMQ's queue or the backlog)
    dropped: int = 0  # messages that found the queue full
    disconnects: int = 0  # connections that broke, each failing the live requests with rows in flight on it
    backlog: deque[Queued] = field(default_factory=deque)  # frames waiting for room in ZMQ's queue, in order
    backlog_bytes: int = 0
    in_flight: deque[Sent] = field(default_factory=deque)  # the last messages ZMQ took
    in_flight_bytes: int = 0  # at most IN_FLIGHT_BYTES, but for the last message
    in_flight_rows: int = 0  # at most IN_FLIGHT_ROWS, but for the last message
    owed: BoundedMap[str, OutRow] = field(default_factory=_owed)  # rid -> error row a full queue kept from this worker


class Delivery:
    def __init__(
        self,
        ctx: zmq.Context,
        workers: list[str],
        *,
        feedback: str | None,
        hwm: int,
        queue_bytes: int,
        linger_ms: int,
        stats: Stats,
        policy: RegisterPolicy = RegisterPolicy(),
        curve: Curve | None = None,
    ) -> None:
        self.ctx = ctx
        self.policy = policy
        self.curve = curve
        self.added = 0  # workers added by `register` at run time
        self.hwm = hwm
        self.queue_bytes = queue_bytes  # each worker's backlog at most
        self.linger_ms = linger_ms
        self.poller: zmq.Poller | None = None  # the loop's: a backlogged worker's POLLOUT wakes it
        self.broken: list[WorkerOut] = []  # live requests' rows lost with a connection, for the loop to fail
        self.backlogged: dict[int, Worker] = {}
        self.room: dict[int, bool] = {}  # worker -> its ZMQ queue had room when last read for /metrics
        self.room_read = 0.0  # when
        self.stats = stats
        self.workers: dict[int, Worker] = {}
        self.feedback: Worker | None = None  # the scheduler's `stopped` messages, queued as a worker's
        try:
            for i, address in enumerate(workers):
                if not self.connect_worker(i, address):
                    raise ValueError(f"cannot connect to worker {i} at {address}")
            if feedback:
                sock, _ = self._connect(feedback, curve.feedback if curve else None)
                self.feedback = Worker(FEEDBACK, feedback, sock)
        except BaseException:  # any failure (setsockopt's OverflowError too): an open socket would hang ctx.term()
            self.close()
            raise

    # --- destinations -------------------------------------------------------------------

    def register(self, index: int, address: str) -> bool:
        """A peer's `register`: applied only if the RegisterPolicy allows it; every
        change and every refusal is logged, refusals counted. False when refused."""
        why = self.policy.refusal(self, index, address)
        if why is not None:
            self.stats.error(REGISTER_REFUSED)
            log.warning("register of worker %d at %r refused: %s", index, address, why)
            return False
        new = index not in self.workers
        changed = new or self.workers[index].address != address
        if not self.connect_worker(index, address):
            return False
        if new:
            self.added += 1
        if changed:
            self.stats.register_changes += 1
        return True

    def connect_worker(self, index: int, address: str) -> bool:
        """Add worker `index`, or move it to a new address (it rebound elsewhere): for
        destinations detokd trusts (the config's workers, the ones a dialect derives from
        its engine's own messages); a peer's `register` goes through `register`.

        Connects at once (ZMQ connects need no listener yet), so an address ZMQ refuses
        (malformed, an unknown transport, a path too long, no sockets left) is refused
        here and the worker stays as it was: a bad address must not take the loop down
        at its next send. False when refused.
        """
        w = self.workers.get(index)
        if w is not None and w.address == address:
            return True
        old = None if w is None else w.address
        key = self.curve.workers.get(index) if self.curve is not None else None
        try:
            sock, monitor = self._connect(address, key, worker=True)
        except zmq.ZMQError as exc:
            self.stats.error(BAD_REGISTER)
            log.warning("worker %d: cannot connect to %r (%s); register refused", index, address, exc.strerror)
            return False
        if w is None:
            self.workers[index] = w = Worker(index, address, sock, monitor)
        else:
            self._unwatch(w)
            self._read_events(w)
            if w.connected:  # the old connection ends: what was in flight on it goes with it
                self._broken(w, "moved")
            # Immediate: ZMQ's queue holds only frames for a connected peer, which linger
            # gives a chance to reach it; the backlog is the worker's and follows it.
            self._close_socket(w, self.linger_ms)
            w.socket, w.monitor, w.address = sock, monitor, address
            if w.backlog:
                self._watch(w)
        # Who receives a worker's text is a security event: every change is logged, past
        # the rate limiter (changes are few: register_max added, moves only to allowed
        # addresses with register_replace).
        curve = " (CURVE)" if key is not None else ""
        if old is None:
            log.info("worker %d at %r%s", index, address, curve, extra=logs.UNLIMITED)
        else:
            log.info("worker %d moved from %r to %r%s", index, old, address, curve, extra=logs.UNLIMITED)
        return True

    def replace_worker(self, index: int, address: str) -> bool:
        """Worker `index` is another peer from now on, at `address`: the one it was is
        gone (a dialect's HTTP worker that died). What was queued for the old peer is
        dropped, never sent to the new one, whose requests those rows are not. False
        when ZMQ refuses the address."""
        w = self.workers[index]
        dropped = len(w.backlog)
        self._unwatch(w)
        w.backlog.clear()
        w.backlog_bytes = 0
        w.in_flight.clear()
        w.in_flight_bytes = w.in_flight_rows = 0
        w.owed.clear()
        if dropped:
            log.info("worker %d: %d message(s) queued for %r dropped, its peer is gone", index, dropped, w.address)
        return self.connect_worker(index, address)

    def known(self, index: int) -> bool:
        return index in self.workers

    # --- connections ----------------------------------------------------------------

    def watch_connections(self) -> None:
        """Read each worker's connection events; a connection that broke fails the
        requests whose rows were in flight on it (the loop calls this between batches)."""
        for w in self.workers.values():
            self._read_events(w)

    def _read_events(self, w: Worker) -> None:
        # Asked first: a read that finds nothing raises zmq.Again, several times dearer,
        # and nearly every turn finds nothing.
        # pyzmq types every option's value int | bytes; EVENTS is an int.
        while w.monitor is not None and w.monitor.get(EVENTS) & POLLIN:  # type: ignore[operator]
            try:
                event = recv_monitor_message(w.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_CONNECTED:
                w.connected = True
            elif event == zmq.EVENT_DISCONNECTED and w.connected:
                w.connected = False
                self._broken(w, "disconnected")

    def _broken(self, w: Worker, how: str) -> None:
        """ZMQ drops the queue of a connection that ends (ZMQ_IMMEDIATE), and the socket
        buffers go with it; no peer acknowledges a message, so any of the last messages
        ZMQ took may be lost, and on one connection a lost message loses all after it.

        A request whose last row there went on (no finish, no error) continues on another
        connection after a possible hole: it fails (worker_stalled), and the worker is
        owed its error row. A request whose last row there ended it is over: the worker
        has its whole text or lacks only a tail that includes the ending row, so failing
        it could contradict a finish the worker read (every clean worker exit would).
        It is counted as unconfirmed (detokd_worker_unconfirmed_total), never failed."""
        last = {row.rid: row for sent in w.in_flight for row in sent.rows}  # each rid's last row
        w.in_flight.clear()
        w.in_flight_bytes = w.in_flight_rows = 0
        w.disconnects += 1
        going = [row for row in last.values() if row.finish is None and row.error is None]
        ended = len(last) - len(going)
        unconfirmed = self.stats.unconfirmed
        unconfirmed[w.index] = unconfirmed.get(w.index, 0) + ended
        if going:
            self.broken.append(WorkerOut(w.index, [], going))
        # A clean restart of a worker that read everything is no failure: info, not warning.
        log.log(
            logging.WARNING if going else logging.INFO,
            "worker %d %s: %d live request(s) with rows in flight failed (worker_stalled); "
            "%d ended request(s) whose last row it may not have read (unconfirmed)", w.index, how, len(going), ended,
        )

    def take_broken(self) -> list[WorkerOut]:
        """The rows of live requests that broken connections took (since the last take):
        the loop fails their requests and hands the error rows to `fail_going`."""
        broken, self.broken = self.broken, []
        return broken

    def ahead(self, index: int, errors: list[OutRow]) -> list[OutRow]:
        """Those of `errors` whose requests still have rows in the worker's backlog."""
        queued = {row.rid for q in self.workers[index].backlog for row in q.rows}
        return [row for row in errors if row.rid in queued]

    def fail_going(self, index: int, errors: list[OutRow], ahead: list[OutRow], frames: list[bytes]) -> None:
        """The error rows of requests that failed with the connection. Those with rows
        still in the backlog (`ahead`, encoded as `frames`) go ahead of it, so the worker
        hears of the failure before any later row (a finish among them would read as a
        success); the others are owed for when the worker has room, as a full queue's are."""
        w = self.workers[index]
        if frames:
            for frame in reversed(frames):
                w.backlog.appendleft(Queued(frame, ahead))
                w.backlog_bytes += len(frame)
            for row in ahead:  # told now: an error owed from an earlier loss would repeat it
                w.owed.pop(row.rid)
            told = {row.rid for row in ahead}
            errors = [row for row in errors if row.rid not in told]
        self._keep_owed(w, errors)

    def _close_socket(self, w: Worker, linger: int) -> None:
        if w.socket is None:  # a monitor comes only with its socket
            return
        if w.monitor is not None:
            w.socket.disable_monitor()
            w.monitor.close(linger=0)
            w.monitor = None
        w.socket.close(linger=linger)
        w.socket = None

    def _connect(
        self, address: str, server_key: bytes | None = None, *, worker: bool = False
    ) -> tuple[zmq.Socket, zmq.Socket | None]:
        """A PUSH socket connected to `address`, and for a worker the monitor of its
        connection (enabled before the connect: its first event may come at once).
        A worker's socket is ZMQ_IMMEDIATE: ZMQ queues a frame only on a completed
        connection, so frames for a peer not (yet) there wait in the backlog, bounded in
        bytes and ours to move when `register` moves the worker; a plain socket would
        hold them in a queue for an address it may never reach, lost when it is closed."""
        s = self.ctx.socket(zmq.PUSH)
        monitor = None
        try:
            if worker:
                s.setsockopt(zmq.IMMEDIATE, 1)
                monitor = s.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            if server_key is not None:
                assert self.curve is not None, "a server key comes only from the CURVE config"
                self.curve.connect_to(s, server_key)
            s.setsockopt(zmq.SNDHWM, self.hwm)
            s.setsockopt(zmq.LINGER, self.linger_ms)
            s.connect(address)
        except BaseException:  # not only ZMQError: setsockopt raises OverflowError
            if monitor is not None:
                s.disable_monitor()
                monitor.close(linger=0)
            s.close(linger=0)
            raise
        return s, monitor

    # --- sending ------------------------------------------------------------------------

    def send(self, index: int, frame: bytes, rows: Sequence[OutRow] = ()) -> bool:
        """Queue one frame for a worker: into ZMQ's queue, or behind it into the
        backlog while ZMQ's is full. False when there is no such worker or the backlog
        has no room for the frame (it is lost and counted). `rows`: what the frame
        carries, failed if a broken connection takes it."""
        w = self.workers.get(index)
        return w is not None and self._queue(w, frame, rows)

    def _queue(self, w: Worker, frame: bytes, rows: Sequence[OutRow]) -> bool:
        if w.socket is None:
            return False
        if w.backlog:
            self._drain(w)
        if not w.backlog:
            try:
                w.socket.send(frame, zmq.NOBLOCK, copy=len(frame) < COPY_BELOW)
                w.sent += 1
                self._took(w, rows, len(frame))
                return True
            except zmq.Again:
                pass
        if w.backlog_bytes + len(frame) > self.queue_bytes:
            w.dropped += 1
            return False
        w.backlog.append(Queued(frame, rows))
        w.backlog_bytes += len(frame)
        w.sent += 1
        if len(w.backlog) == 1:
            self._watch(w)
        return True

    @staticmethod
    def _took(w: Worker, rows: Sequence[OutRow], nbytes: int) -> None:
        """ZMQ took a message of these rows: remember them while they may be in flight."""
        if w.index == FEEDBACK:  # a lost `stopped` message leaves the text unaffected
            return
        w.in_flight.append(Sent(rows, nbytes))
        w.in_flight_bytes += nbytes
        w.in_flight_rows += len(rows)
        while (w.in_flight_bytes > IN_FLIGHT_BYTES or w.in_flight_rows > IN_FLIGHT_ROWS) and len(w.in_flight) > 1:
            old = w.in_flight.popleft()
            w.in_flight_bytes -= old.nbytes
            w.in_flight_rows -= len(old.rows)

    def flush(self) -> None:
        """Move backlogged frames into ZMQ's queues while they take them, in order."""
        for w in list(self.backlogged.values()):
            self._drain(w)

    def _drain(self, w: Worker) -> None:
        backlog, sock = w.backlog, w.socket
        assert sock is not None, "a worker's socket closes only at shutdown, after the last drain"
        asked = False
        while backlog:
            queued = backlog[0]
            frame = queued.frame
            try:
                sock.send(frame, zmq.NOBLOCK, copy=len(frame) < COPY_BELOW)
            except zmq.Again:
                # A non-blocking send reads ZMQ's "the I/O thread took them" notices at
                # most once a millisecond; asking for EVENTS reads them now.
                if asked or not sock.getsockopt(EVENTS) & POLLOUT:  # type: ignore[operator]  # an int (_read_events)
                    return
                asked = True
                continue
            asked = False
            backlog.popleft()
            w.backlog_bytes -= len(frame)
            self._took(w, queued.rows, len(frame))
        self._unwatch(w)

    def _watch(self, w: Worker) -> None:
        self.backlogged[w.index] = w
        if self.poller is not None:
            self.poller.register(w.socket, zmq.POLLOUT)

    def _unwatch(self, w: Worker) -> None:
        if self.backlogged.pop(w.index, None) is not None and self.poller is not None:
            self.poller.unregister(w.socket)

    def _send_frames(self, index: int, frames: list[bytes], rows: list[OutRow]) -> bool:
        """Queue what a dialect encoded for one worker's rows: a frame, or several."""
        if len(frames) == 1:
            return self.send(index, frames[0], rows)
        return all([self.send(index, frame, rows) for frame in frames])

    def deliver(self, out: Output) -> list[WorkerOut]:
        """Send what a frame produced: each worker its message (or the few a dialect
        needs for it), the scheduler its feedback. Returns the workers' messages lost
        to a full queue: the stall policy (the loop has their requests failed and
        `owe`s the worker their error rows)."""
        lost = []
        for share in out.workers:
            if not self._send_frames(share.worker, share.frames, share.rows):
                lost.append(share)
        if out.feedback is not None and self.feedback is not None and not self._queue(self.feedback, out.feedback, ()):
            self.stats.feedback_dropped += out.feedback_rows
            log.warning("feedback queue full: %d stopped rows lost (the scheduler generates until its own stop)",
                        out.feedback_rows)
        return lost

    def owe(self, index: int, rows: list[OutRow]) -> None:
        """Error rows `index` is owed once its queue has room."""
        w = self.workers.get(index)
        if w is not None:
            self._keep_owed(w, rows)

    def _keep_owed(self, w: Worker, rows: list[OutRow]) -> None:
        for row in rows:
            w.owed.put(row.rid, row)

    def owed_ready(self) -> list[Worker]:
        """The workers owed error rows whose queue has room for them now."""
        return [w for w in self.workers.values() if w.owed and self.has_room(w)]

    def settle_owed(self, w: Worker, frames: list[bytes], rows: list[OutRow]) -> None:
        """Send a worker the owed `rows` (encoded as `frames`; the others owed are for
        rids that began a new request since), and forget them all once queued."""
        if rows and not self._send_frames(w.index, frames, rows):
            return
        w.owed.clear()

    @staticmethod
    def has_room(w: Worker) -> bool:
        """Whether a frame would go straight into the worker's ZMQ queue: no backlog,
        and ZMQ's queue below its mark (ZMQ exposes no depth, only this)."""
        return (
            w.socket is not None and not w.backlog
            and bool(w.socket.getsockopt(EVENTS) & POLLOUT)  # type: ignore[operator]  # an int (_read_events)
        )

    def read_room(self, now: float) -> None:
        """On the loop's thread (ZMQ sockets are not thread-safe): each worker's queue
        room, for /metrics, at most every ROOM_EVERY s."""
        if now - self.room_read >= ROOM_EVERY:
            self.room_read = now
            self.room = {w.index: self.has_room(w) for w in self.workers.values()}

    def publish(self) -> None:
        """Per-worker figures for /metrics, on its thread: plain reads, each atomic under
        the GIL. A worker with a backlog is not writable; one without is as its ZMQ queue
        was when the loop last read it, at most ROOM_EVERY s before."""
        room = self.room
        self.stats.workers = {
            w.index: WorkerFigures(
                sent=w.sent, dropped=w.dropped, disconnects=w.disconnects,
                writable=not w.backlog and room.get(w.index, False),
                owed=len(w.owed), backlog=len(w.backlog), backlog_bytes=w.backlog_bytes,
            )
            for w in list(self.workers.values())  # a register may add one meanwhile
        }
        if self.feedback is not None:
            self.stats.feedback_backlog_bytes = self.feedback.backlog_bytes

    def close(self) -> None:
        """Give backlogged frames up to linger_ms to enter ZMQ's queues, which then get
        what is left of it to leave; what cannot is logged."""
        deadline = time.monotonic() + self.linger_ms / 1000
        while self.backlogged and (left := deadline - time.monotonic()) > 0:
            poller = zmq.Poller()
            for w in self.backlogged.values():
                poller.register(w.socket, zmq.POLLOUT)
            if poller.poll(int(left * 1000) + 1):
                self.flush()
        for w in self.backlogged.values():
            log.warning(
                "worker %d: %d queued messages (%d bytes) not sent at shutdown",
                w.index, len(w.backlog), w.backlog_bytes,
            )
        linger = max(0, int((deadline - time.monotonic()) * 1000))
        for w in self.workers.values():
            self._close_socket(w, linger)
        if self.feedback is not None and self.feedback.socket is not None:
            self.feedback.socket.close(linger=linger)
            self.feedback.socket = None
