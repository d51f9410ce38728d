"""A few GET routes on a thread of their own: the plumbing of /health, /metrics, /status.

HEAD of a route is its GET without the body (Content-Length still the body's): some
load balancers and uptime checkers probe with HEAD.

A route is a function returning (status, body, content type), called on the HTTP
thread: it may read the loop's state (an int, a len()), never change it or wait on it.

Whoever reaches the port chooses what it costs, so every cost is bounded. One thread
serves every connection without blocking (a slow client holds no thread), at most
MAX_CONNECTIONS are open at once (an fd each: the process's fd limit stays ZMQ's), and
each is closed DEADLINE seconds after it was accepted, answered or not: a client that
sends a byte at a time gets no longer than one that sends nothing. A newcomer that
finds every connection open closes the oldest one still sending its request (it has
had the most time) or answered, once that one has been read; else the newcomer is
closed at once. So a flood of slow clients cannot lock a health probe out, and
`dropped` counts what it cost. Client errors go to the rate-limited logger: clients
that reset their connections by the hundred must not write a line each.
"""

from __future__ import annotations

import errno
import http
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable

from . import logs

log = logs.get(__name__)  # what clients do chooses what this logs

Reply = tuple[int, bytes, str]

MAX_CONNECTIONS = 64  # a few probes and scrapers need a handful; fds well below any limit
DEADLINE = 5.0  # s from accept to the answer sent (a probe sends its request in one packet)
MAX_REQUEST = 8192  # bytes of request line and headers
BACKLOG = 1024  # queued by the kernel, no fd of ours: a burst waits here, not in SYN retries (1 s)
TICK = 0.5  # s the thread may sleep with nothing to do: how late close() is seen
SWITCH_INTERVAL = 0.001  # s: how long the loop may keep the GIL from this thread


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port and listening (port 0: any free one)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(BACKLOG)
    except OSError:
        listener.close()
        raise
    return listener


class _Conn:
    __slots__ = ("sock", "peer", "deadline", "turn", "request", "answer")

    def __init__(self, sock: socket.socket, peer: str, deadline: float, turn: int) -> None:
        self.sock, self.peer, self.deadline, self.turn = sock, peer, deadline, turn
        self.request = bytearray()
        self.answer: bytes | None = None  # once the request is in: what is left to send


class Endpoint:
    """Serve `routes` (path -> reply function) on host:port; `port` is the bound one."""

    def __init__(
        self, host: str, port: int, routes: dict[str, Callable[[], Reply]], name: str,
        *, max_connections: int = MAX_CONNECTIONS, deadline: float = DEADLINE, listener: socket.socket | None = None,
    ) -> None:
        """`listener`: a socket `listen` already bound (host and port are then its own),
        as a supervisor holds it across its children's lives."""
        self.routes, self.max_connections, self.deadline = routes, max_connections, deadline
        # Connections closed unanswered: "full" (no room), "deadline" (request not in time).
        self.dropped = {"full": 0, "deadline": 0}
        self.listener = listener if listener is not None else listen(host, port)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.conns: dict[socket.socket, _Conn] = {}  # oldest first, so also by deadline
        self.sel = selectors.DefaultSelector()
        self.closing = False
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)

    def start(self) -> None:
        # Each syscall of this thread gives the GIL up, and taking it back from a busy loop
        # waits out the switch interval: at CPython's 5 ms, /health under a saturated loop
        # takes 10-135 ms, past the 100 ms a probe allows; at 1 ms, 1-9 ms. The loop pays for the
        # shorter interval only while another thread wants the GIL.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))
        self.thread.start()

    def close(self) -> None:
        self.closing = True
        if self.thread.is_alive():
            self.thread.join()
        for c in list(self.conns.values()):
            self._close(c)
        self.sel.close()
        self.listener.close()

    # --- the thread --------------------------------------------------------------------

    def _serve(self) -> None:
        self.sel.register(self.listener, selectors.EVENT_READ)
        listening, turn = True, 0
        resume = 0.0  # when to accept again after the process ran out of fds
        while not self.closing:
            turn += 1
            now = time.monotonic()
            if not listening and now >= resume:
                self.sel.register(self.listener, selectors.EVENT_READ)
                listening = True
            wake = min([now + TICK, *(() if listening else (resume,)), *(c.deadline for c in self.conns.values())])
            acceptable = False
            for key, _ in self.sel.select(max(0.0, wake - now)):
                if key.fileobj is self.listener:
                    acceptable = True
                else:
                    self._step(key.data)
            # Newcomers last: one may close the oldest connection, which this turn has read.
            if acceptable and not self._accept(turn):
                self.sel.unregister(self.listener)
                listening, resume = False, time.monotonic() + TICK
            now = time.monotonic()
            for c in list(self.conns.values()):  # oldest first, so by deadline
                if c.deadline > now:
                    break
                if c.answer is None:
                    self.dropped["deadline"] += 1
                self._close(c)

    def _accept(self, turn: int) -> bool:
        """Take the waiting connections (a bounded batch); False when out of fds."""
        for _ in range(self.max_connections):
            try:
                sock, addr = self.listener.accept()
            except BlockingIOError:
                return True
            except OSError as exc:  # EMFILE, ENFILE: it waits in the backlog meanwhile
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("http port: cannot accept: %s", exc.strerror)
                    return False
                continue  # ECONNABORTED and the like: that client is gone
            if len(self.conns) >= self.max_connections and not self._make_room(turn):
                self.dropped["full"] += 1
                sock.close()
                continue
            sock.setblocking(False)
            c = _Conn(sock, addr[0], time.monotonic() + self.deadline, turn)
            self.conns[sock] = c
            self.sel.register(sock, selectors.EVENT_READ, c)
        return True

    def _make_room(self, turn: int) -> bool:
        """Close the oldest connection that is answered or still sending its request,
        if it was accepted before this turn (so it has been read at least once); True
        if one was."""
        for c in list(self.conns.values()):
            if c.turn == turn:
                return False  # the rest are younger still
            if c.answer is None:
                self._step(c)  # what it sent since is answered, not thrown away
            if c.sock in self.conns and c.answer:
                continue  # its answer is being sent
            if c.sock in self.conns:
                if c.answer is None:
                    self.dropped["full"] += 1
                self._close(c)
            return True
        return False

    def _step(self, c: _Conn) -> None:
        """Read the request, send the answer, then read until the client hangs up: closing
        with bytes unread would reset the connection, and the answer with it."""
        try:
            if c.answer is None:
                data = c.sock.recv(MAX_REQUEST + 1 - len(c.request))
                if not data:  # the client hung up first
                    self._close(c)
                    return
                c.request += data
                end = _end_of_headers(c.request)
                if end < 0 and len(c.request) <= MAX_REQUEST:
                    return
                c.answer = self._reply(bytes(c.request[:end]) if end >= 0 else None)
                self.sel.modify(c.sock, selectors.EVENT_WRITE, c)
            if c.answer:
                c.answer = c.answer[c.sock.send(c.answer):]
                if not c.answer:
                    c.sock.shutdown(socket.SHUT_WR)
                    self.sel.modify(c.sock, selectors.EVENT_READ, c)
            elif not c.sock.recv(65536):
                self._close(c)
        except BlockingIOError:
            return
        except OSError as exc:  # the client reset or hung up: not our bug
            log.info("http client %s: %s", c.peer, type(exc).__name__)
            self._close(c)
        except Exception:  # ours: that request fails, the port goes on
            log.warning("http request from %s failed", c.peer, exc_info=True)
            self._close(c)

    def _reply(self, head: bytes | None) -> bytes:
        """The whole answer to a request head (None: it was too long)."""
        words = head.split(b"\n", 1)[0].split() if head is not None else []
        if head is None:
            code, body, ctype = 431, b"request too long\n", "text/plain"
        elif len(words) != 3 or not words[2].startswith(b"HTTP/"):
            code, body, ctype = 400, b"bad request\n", "text/plain"
        elif words[0] not in (b"GET", b"HEAD"):
            code, body, ctype = 501, b"only GET and HEAD\n", "text/plain"
        elif (route := self.routes.get(words[1].split(b"?")[0].decode("latin-1"))) is None:
            code, body, ctype = 404, b"not found\n", "text/plain"
        else:
            try:
                code, body, ctype = route()
            except Exception:
                log.warning("http route %r failed", words[1][:100], exc_info=True)
                code, body, ctype = 500, b"internal error\n", "text/plain"
        status = f"HTTP/1.0 {code} {http.HTTPStatus(code).phrase}\r\n"
        headers = f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        if words and words[0] == b"HEAD":
            body = b""
        return (status + headers).encode("latin-1") + body

    def _close(self, c: _Conn) -> None:
        del self.conns[c.sock]
        self.sel.unregister(c.sock)
        c.sock.close()


def _end_of_headers(buf: bytearray) -> int:
    """Where the request head ends (a blank line, CRLF or bare LF), or -1."""
    ends = [i for i in (buf.find(b"\r\n\r\n"), buf.find(b"\n\n")) if i >= 0]
    return min(ends) if ends else -1
