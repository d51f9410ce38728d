"""detokd.http's Endpoint, over real sockets: what a client can and cannot make it do.

Each test runs an Endpoint in this process on a free port of 127.0.0.1, with small
bounds (a few connections, a deadline of a second or so) so that reaching them is cheap.
tests/test_peers.py runs the same bounds on real detokd and supervisor processes.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
from utils import http_get, wait_until

from detokd.http import MAX_REQUEST, Endpoint


@pytest.fixture
def endpoint():
    """Factory: `endpoint(routes, max_connections=.., deadline=..)`, started; closed at teardown."""
    made: list[Endpoint] = []

    def make(routes=None, **bounds) -> Endpoint:
        routes = routes if routes is not None else {"/health": lambda: (200, b"ok\n", "text/plain")}
        e = Endpoint("127.0.0.1", 0, routes, "test-http", **bounds)
        e.start()
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def ask(port: int, request: bytes) -> bytes:
    """Send raw request bytes; everything the endpoint answers before it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def closed_by_server(s: socket.socket, timeout: float) -> bool:
    """Whether the server closes `s` within `timeout` s (it sends nothing before)."""
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_routes_answer_and_everything_else_gets_a_status_of_its_own(endpoint):
    def broken():
        raise RuntimeError("a bug in a route")

    e = endpoint({"/health": lambda: (200, b"ok\n", "text/plain"), "/broken": broken})
    assert http_get(e.port, "/health") == (200, b"ok\n")
    assert http_get(e.port, "/health?verbose=1") == (200, b"ok\n")
    assert ask(e.port, b"GET /health HTTP/1.0\n\n").startswith(b"HTTP/1.0 200 OK\r\n")  # bare LF
    assert http_get(e.port, "/nothing")[0] == 404
    assert http_get(e.port, "/broken")[0] == 500
    assert ask(e.port, b"POST /health HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.0 501 ")
    assert ask(e.port, b"garbage\r\n\r\n").startswith(b"HTTP/1.0 400 ")
    assert ask(e.port, b"GET /health HTTP/1.1\r\nX: " + b"a" * MAX_REQUEST).startswith(b"HTTP/1.0 431 ")
    assert http_get(e.port, "/health") == (200, b"ok\n")  # none of it hurt the port
    assert e.dropped == {"full": 0, "deadline": 0}


def test_a_byte_at_a_time_client_is_closed_at_the_deadline_not_at_a_pause(endpoint):
    """A deadline per connection, not per read: a client that sends a byte every 50 ms
    (never pausing long) is closed once `deadline` s have passed since it connected."""
    e = endpoint(deadline=1.0)
    s = socket.create_connection(("127.0.0.1", e.port))
    t0 = time.monotonic()
    s.settimeout(0.05)
    request = b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 10_000
    sent = 0
    try:
        while time.monotonic() - t0 < 30:
            s.send(request[sent : sent + 1])
            sent += 1
            try:
                if s.recv(1) == b"":
                    break
            except TimeoutError:
                pass
    except (BrokenPipeError, ConnectionResetError):
        pass
    lived = time.monotonic() - t0
    s.close()
    assert 1.0 <= lived < 30, lived
    assert e.dropped == {"full": 0, "deadline": 1}
    print(f"byte-at-a-time client closed after {lived:.2f} s and {sent} bytes (deadline 1 s)")


def test_a_newcomer_finding_every_connection_open_closes_the_oldest_still_sending(endpoint):
    """max_connections 4, all held by clients that sent half a request: a probe is
    answered, and the oldest of the four is closed to make room (counted "full"); the
    other three are left alone."""
    e = endpoint(max_connections=4, deadline=30.0)
    idle = []
    for _ in range(4):
        s = socket.create_connection(("127.0.0.1", e.port))
        s.sendall(b"GET /health HTTP/1.1\r\n")
        idle.append(s)
        n = len(idle)
        wait_until(lambda n=n: len(e.conns) == n, 5, "the endpoint to take the connection")
    assert http_get(e.port, "/health") == (200, b"ok\n")
    assert closed_by_server(idle[0], 5)
    assert not any(closed_by_server(s, 0.2) for s in idle[1:])
    assert e.dropped == {"full": 1, "deadline": 0}
    for s in idle:
        s.close()


def test_a_request_already_in_is_answered_not_closed_to_make_room(endpoint):
    """The oldest connection's whole request arrived while the endpoint was full: a
    newcomer makes it be answered (and so make room), not closed unanswered."""
    e = endpoint(max_connections=2, deadline=30.0)
    first = socket.create_connection(("127.0.0.1", e.port))
    first.sendall(b"GET /health HTTP/1.1\r\n")
    wait_until(lambda: len(e.conns) == 1, 5, "the first connection taken")
    second = socket.create_connection(("127.0.0.1", e.port))
    wait_until(lambda: len(e.conns) == 2, 5, "the second connection taken")
    first.sendall(b"\r\n")  # its request is whole now; the endpoint may not have read it yet
    assert http_get(e.port, "/health") == (200, b"ok\n")
    first.settimeout(5)
    assert first.recv(65536).startswith(b"HTTP/1.0 200 OK")
    assert e.dropped["deadline"] == 0
    first.close()
    second.close()


def test_newcomers_past_the_bound_in_one_burst_are_closed_at_once_and_counted(endpoint):
    """A burst of 40 connections at max_connections 4: the endpoint never holds more than
    4, the rest are closed at once (none waits for the deadline), each counted."""
    e = endpoint(max_connections=4, deadline=30.0)
    burst = [socket.create_connection(("127.0.0.1", e.port)) for _ in range(40)]
    wait_until(lambda: e.dropped["full"] >= 36, 10, "the burst's excess closed")
    assert len(e.conns) <= 4
    assert sum(closed_by_server(s, 1) for s in burst) == e.dropped["full"]
    assert http_get(e.port, "/health") == (200, b"ok\n")  # it makes room for a probe too
    for s in burst:
        s.close()


def test_a_client_that_never_reads_its_answer_is_closed_at_the_deadline(endpoint):
    """A 32 MiB answer to a client that never reads it: the endpoint's one thread sends
    what the socket takes, answers others meanwhile, and closes it at the deadline."""
    e = endpoint({"/health": lambda: (200, b"ok\n", "text/plain"), "/big": lambda: (200, b"x" * (32 << 20), "text/plain")}, deadline=1.5)
    s = socket.create_connection(("127.0.0.1", e.port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(b"GET /big HTTP/1.1\r\n\r\n")
    wait_until(lambda: any(c.answer for c in list(e.conns.values())), 5, "the answer to be under way")
    assert http_get(e.port, "/health") == (200, b"ok\n")
    wait_until(lambda: not e.conns, 10, "the reader-less connection closed at the deadline")
    assert e.dropped == {"full": 0, "deadline": 0}  # it was answered, in part: not "dropped"
    s.close()


OUT_OF_FDS = r"""
import os, resource, sys, time
from detokd.http import Endpoint
e = Endpoint("127.0.0.1", 0, {"/health": lambda: (200, b"ok\n", "text/plain")}, "test-http")
e.start()
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
hog = []
while True:  # every fd taken, as ZMQ's peers might take them
    try:
        hog.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        break
print(e.port, flush=True)
sys.stdin.readline()  # a client is waiting in the backlog now
cpu = time.process_time()
time.sleep(2)  # the window the CPU is measured over
print(time.process_time() - cpu, flush=True)
for fd in hog:
    os.close(fd)
sys.stdin.readline()
"""


def test_out_of_fds_the_port_waits_for_them_without_spinning_and_then_serves():
    """The process has no fd left (for reasons not the port's): a connection waits in the
    kernel's backlog, the port retries twice a second instead of spinning on accept
    (under 10 % of a core over 2 s), and answers it once fds are free again."""
    child = subprocess.Popen([sys.executable, "-c", OUT_OF_FDS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"GET /health HTTP/1.1\r\n\r\n")
        child.stdin.write("go\n")
        child.stdin.flush()
        cpu = float(child.stdout.readline())
        assert cpu < 0.2, f"{cpu:.2f} s of CPU in 2 s"  # (spinning on accept took 0.78 s here on a busy machine)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
        assert answer.startswith(b"HTTP/1.0 200 OK") and answer.endswith(b"ok\n"), answer
        print(f"out of fds: {cpu * 1000:.0f} ms of CPU over 2 s")
        s.close()
        child.stdin.write("done\n")
        child.stdin.flush()
        assert child.wait(10) == 0
    finally:
        child.kill()
