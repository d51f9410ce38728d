"""Logging that can neither block the loop nor be forged by a peer.

`setup(level)` puts one bounded `queue.Queue` between every logger and stderr: the
thread that logs (the loop, the HTTP threads) only formats and enqueues; a listener
thread of its own does the writing. A stderr nobody reads then stalls the listener,
never the loop: once the queue is full, records are dropped and counted (`dropped()`,
published as detokd_log_records_dropped on /metrics).

On the way in, every record passes the rate limiter (per message template, bounded
rate and length: a flood of hostile frames costs a few lines) and the escaping
formatter (control characters in a message come out as visible escapes, so a rid or
a control op holding "\\n...CRITICAL..." cannot forge a line).

Two formats: text (a line starting with an ISO 8601 time and its zone), and json
(one object a line, for a log shipper: JSON's own escaping keeps every line one
record). Under `serve --shards` each line names its shard.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import queue
import sys
import threading
import time
import weakref
from collections import OrderedDict
from typing import Callable

__all__ = [
    "get", "setup", "dropped", "escape", "report_suppressed", "RateLimitFilter", "EscapingFormatter", "JsonFormatter",
    "FORMAT",
]

# detokd's floor: every module gets its logger here (get), the core too, so this module
# imports nothing of detokd (tests/test_layers.py).
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# A record's `extra=` keys that become fields of its JSON object: what the line is about.
FIELDS = ("rid", "worker", "error")
RID_CHARS = 64  # of a rid field at most: rids are peer-chosen, up to max_rid_len long
TEMPLATES = 1000  # message templates a rate limiter tracks at most (detokd's are far fewer)
QUEUE_SIZE = 10000  # records waiting for the writer at most; beyond, dropped and counted
DRAIN_TIMEOUT = 1.0  # s the writer gets at exit to write what is queued
# `extra=` of a record the rate limiter lets by without taking its lock: detokd's own
# words (a count of suppressed records, the last words before an exit), never a peer's.
UNLIMITED = {"_detokd_limited": True}

_lock = threading.Lock()
_dropped = 0
_installed: list[tuple[logging.Handler, "_Writer", str]] = []


def dropped() -> int:
    """Records lost since start because the queue to stderr was full (or stderr broke)."""
    return _dropped


def _count_drop() -> None:
    global _dropped
    with _lock:
        _dropped += 1


# C0 controls, DEL, C1 controls, and the two Unicode line separators some viewers break on.
_ESCAPES = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)]}
_ESCAPES.update({0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t", 0x2028: "\\u2028", 0x2029: "\\u2029"})


def escape(text: str) -> str:
    """`text` with every control character written as a visible escape: one line."""
    return text.translate(_ESCAPES)


def iso_time(created: float) -> str:
    """A record's time in ISO 8601 with the local zone's offset, to the millisecond."""
    return datetime.datetime.fromtimestamp(created).astimezone().isoformat(timespec="milliseconds")


class EscapingFormatter(logging.Formatter):
    """Formats a record's message on one line, control characters escaped.

    A traceback or stack (the process's own) keeps its lines, each indented two more
    spaces and escaped within the line: still readable, and no line of it can pass
    for a record of its own (records start at column 0 with a timestamp).
    """

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        return iso_time(record.created)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = escape(record.message)
        return super().formatMessage(record)

    def formatException(self, ei) -> str:  # noqa: N802
        return _indent(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:  # noqa: N802
        return _indent(super().formatStack(stack_info))


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (with its zone), level, logger, message, pid, shard
    (under --shards), the FIELDS the call passed in `extra=`, and exc (a traceback).

    json.dumps escapes every control and non-ASCII character, so no string a peer
    chose can end the line or forge another record.
    """

    def __init__(self, shard: int | None = None) -> None:
        super().__init__()
        self.shard = shard

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": iso_time(record.created), "level": record.levelname, "logger": record.name,
            "message": record.getMessage(), "pid": record.process,
        }
        if self.shard is not None:
            out["shard"] = self.shard
        for key in FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value[:RID_CHARS] if isinstance(value, str) else value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.stack_info:
            out["exc"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=repr)


def _indent(text: str) -> str:
    return "\n".join("  " + escape(line) for line in text.split("\n"))


class _Window:
    """One message template's current period."""

    __slots__ = ("start", "passed", "suppressed", "logger", "level")

    def __init__(self, start: float) -> None:
        self.start = start  # when the period began
        self.passed = 0  # records let through in it
        self.suppressed = 0  # records dropped in it
        self.logger, self.level = "", logging.WARNING  # where and how loud the dropped ones were


class RateLimitFilter(logging.Filter):
    """Per message template, at most `burst` records per `period` seconds, and none
    longer than `max_len` characters. The first record let through after a
    suppressed spell says how many were dropped.

    The messages of detokd's loggers quote what peers send (rids, control ops, worker
    numbers, addresses): a flood of hostile frames must cost a few lines. Works as a
    logger or a handler filter; a record is limited once even if it meets two.
    """

    def __init__(
        self, burst: int = 10, period: float = 10.0, max_len: int = 300, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.burst = burst
        self.period = period
        self.max_len = max_len
        self.clock = clock
        self.windows: OrderedDict[str, _Window] = OrderedDict()  # template -> its window, oldest first
        # The loop and the HTTP threads log at once. A plain lock: no signal handler of
        # detokd's logs (server.py's only sets a flag), so none can nest inside it.
        self.lock = threading.Lock()
        _filters.add(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "_detokd_limited", False):
            return True
        key = record.msg if isinstance(record.msg, str) else type(record.msg).__name__
        with self.lock:
            now = self.clock()
            w = self.windows.get(key)
            if w is None:
                if len(self.windows) >= TEMPLATES:
                    self.windows.popitem(last=False)
                w = self.windows[key] = _Window(now)
            suppressed = 0
            if now - w.start >= self.period:
                suppressed = w.suppressed
                w.start, w.passed, w.suppressed = now, 0, 0
            if w.passed >= self.burst:
                w.suppressed += 1
                w.logger = record.name
                w.level = record.levelno if w.suppressed == 1 else max(w.level, record.levelno)
                return False
            w.passed += 1
        msg = record.getMessage()
        if len(msg) > self.max_len:
            msg = f"{msg[: self.max_len]}... ({len(msg)} characters)"
        if suppressed:
            msg = f"{msg} [{suppressed} similar messages suppressed]"
        record.msg, record.args = msg, None
        record._detokd_limited = True
        return True

    def report(self, force: bool = False) -> None:
        """Say how many records each template lost in a period that is over (all of
        them, `force`), even if no record of it comes again: the count is never lost."""
        due = []
        with self.lock:
            now = self.clock()
            for key, w in self.windows.items():
                if w.suppressed and (force or now - w.start >= self.period):
                    due.append((w.logger, w.level, w.suppressed, now - w.start, key))
                    w.start, w.passed, w.suppressed = now, 0, 0
        for name, level, n, seconds, key in due:
            logging.getLogger(name).log(
                level, "%d similar messages suppressed in %.0f s: %.120r", n, seconds, key, extra=UNLIMITED
            )


_filters: weakref.WeakSet[RateLimitFilter] = weakref.WeakSet()


def get(name: str) -> logging.Logger:
    """The logger of module `name` (its __name__), with a rate limiter of its own.

    What peers send chooses what detokd logs (rids, control ops, worker numbers,
    addresses): each message template gets a bounded rate and length at the logger,
    so the bound holds wherever the records go, through setup()'s handler or another
    program's (SGLang's detokenizer process, an engine using detokd.client). Calling
    it again returns the same logger, still with one limiter."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, RateLimitFilter) for f in logger.filters):
        logger.addFilter(RateLimitFilter())
    return logger
_reported = 0.0


def report_suppressed(force: bool = False, every: float = 1.0) -> None:
    """RateLimitFilter.report on every filter alive, at most once per `every` seconds
    unless `force` (at shutdown). The loop calls it as it turns."""
    global _reported
    now = time.monotonic()
    if not force and now - _reported < every:
        return
    _reported = now
    for f in list(_filters):
        f.report(force)


class _QueueHandler(logging.Handler):
    """Formats on the caller's thread (escaped, traceback included), then enqueues
    without ever waiting: a full queue drops the record and counts it."""

    def __init__(self, q: queue.Queue) -> None:
        super().__init__()
        self.queue = q

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            _count_drop()  # a bad format string: never a traceback on stderr from here
            return
        try:
            self.queue.put_nowait(line)
        except queue.Full:
            _count_drop()


class _Writer:
    """The thread that writes queued lines to a file descriptor (stderr's)."""

    def __init__(self, q: queue.Queue, stream) -> None:
        self.queue, self.stream = q, stream  # held: a collected file object closes its fd
        self.fd = stream.fileno()
        self.thread = threading.Thread(target=self._run, name="detokd-log", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        # os.write, not sys.stderr: a write blocked here holds no Python-level lock
        # that the interpreter's exit would wait for.
        while True:
            line = self.queue.get()
            if line is None:
                return
            data = (line + "\n").encode("utf-8", "backslashreplace")
            try:
                while data:
                    data = data[os.write(self.fd, data) :]
            except OSError:
                _count_drop()  # stderr closed: nothing left to tell

    def stop(self, timeout: float) -> None:
        try:
            self.queue.put(None, timeout=timeout)
        except queue.Full:
            return
        self.thread.join(timeout)


def setup(
    level: str | int = "info", stream=None, queue_size: int = QUEUE_SIZE, *, fmt: str = "text", shard: int | None = None
) -> None:
    """Route every logger through the bounded queue to `stream` (default stderr), as
    `fmt` "text" or "json"; `shard` names the shard on every line.

    Replaces the handlers of the root logger (so detokd.* and third-party loggers
    alike); calling it again replaces the previous setup. Warnings go through it too.
    """
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    _shutdown()
    stream = sys.stderr if stream is None else stream
    q: queue.Queue = queue.Queue(queue_size)
    handler = _QueueHandler(q)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(shard))
    else:
        where = "" if shard is None else f"[shard {shard}] "
        handler.setFormatter(EscapingFormatter(FORMAT.replace("%(name)s", where + "%(name)s")))
    # On the handler, not the "detokd" logger: a logger's filters do not see the
    # records of its children, a handler's filters see every record it gets.
    handler.addFilter(RateLimitFilter())
    writer = _Writer(q, stream)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    logging.captureWarnings(True)
    _installed.append((handler, writer, fmt))


def active() -> str | None:
    """The format setup() routes the logs in ("text", "json"), or None before it."""
    return _installed[-1][2] if _installed else None


def close() -> None:
    """Write what is queued, within a bounded time, and stop: before an os._exit, which
    skips the atexit hook that does the same."""
    _shutdown()


def _shutdown() -> None:
    """Give the writer a bounded time to write what is queued (at exit, or on a new setup)."""
    while _installed:
        handler, writer, _ = _installed.pop()
        logging.getLogger().removeHandler(handler)
        writer.stop(DRAIN_TIMEOUT)


def _after_fork_in_child() -> None:
    """A fork takes no thread along, and a lock another thread held at that moment stays
    held for ever: the child gets new locks, a new queue and a writer thread of its own."""
    global _lock
    _lock = threading.Lock()
    for f in list(_filters):
        f.lock = threading.Lock()
    for k, (handler, writer, fmt) in enumerate(_installed):
        assert isinstance(handler, _QueueHandler)
        handler.queue = queue.Queue(writer.queue.maxsize)
        _installed[k] = (handler, _Writer(handler.queue, writer.stream), fmt)


atexit.register(_shutdown)
os.register_at_fork(after_in_child=_after_fork_in_child)
