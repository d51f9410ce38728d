"""detokd.sockets: what a peer's register address must look like (in-process), and what
`detokd serve` does with the ipc path it is told to bind (real `detokd serve` processes
against real Unix sockets held by the test). The other cases of the live-socket check (a
path that is not a socket, one held by a ZMQ socket, a stale one) and the process-level
register tests are in tests/test_peers.py. And the private pyzmq method detokd's
CURVE authenticator overrides, checked before it starts.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
import zmq.auth.base

from detokd.config import ConfigError, to_toml
from detokd.process import ipc_config
from detokd.sockets import ZAP_REPLY, check_zap_reply, register_address_problem, start_authenticator

PLAIN = ["tcp://127.0.0.1:5560", "tcp://10.0.0.5:1", "tcp://[::1]:65535", "tcp://[fd00::1]:5560", "ipc:///run/engine/w-1.sock"]

# Each could match an allow pattern as a string while ZMQ reaches somewhere else.
ESCAPES = [
    "tcp://127.0.0.1:0;127.0.0.2:5560",  # ZMQ: source 127.0.0.1, destination 127.0.0.2
    "tcp://lo;127.0.0.2:5560",  # a source interface
    "tcp://[fe80::1%lo]:5560",  # an interface scope
    "tcp://10.0.0.1.evil.example:5560",  # a name: `10.0.0.*` would match it
    "tcp://localhost:5560",
    "tcp://127.1:5560", "tcp://010.0.0.1:5560", "tcp://[0:0::1]:5560", "tcp://::1:5560",  # not the canonical spelling
    "tcp://127.0.0.1:0", "tcp://127.0.0.1:05560", "tcp://127.0.0.1:65536", "tcp://127.0.0.1:*", "tcp://127.0.0.1",
    "ipc:///run/engine/../../tmp/x.sock", "ipc:///run/engine/./w.sock", "ipc:////run/engine/w.sock",
    "ipc://w.sock", "ipc://@abstract", "ipc:///run/engine/w\n.sock",
    "inproc://w", "udp://127.0.0.1:5560", "ws://127.0.0.1:5560",
]


@pytest.mark.parametrize("address", PLAIN)
def test_a_plain_tcp_or_ipc_address_may_be_registered(address: str) -> None:
    assert register_address_problem(address) is None


@pytest.mark.parametrize("address", ESCAPES)
def test_an_address_that_is_not_one_plain_destination_is_refused_before_matching(address: str) -> None:
    assert register_address_problem(address) is not None


def test_an_input_path_whose_holder_never_accepts_is_refused_within_a_second_and_exit_2(tmp_path: Path) -> None:
    """A holder that listens and never accepts, its backlog full: a connect to it waits
    for ever, so a check without a deadline kept detokd at "starting" for good."""
    cfg = ipc_config(tmp_path)
    path = cfg.input[len("ipc://"):]
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    holder.bind(path)
    holder.listen(0)
    queued = []
    while True:  # fill the backlog: the next connect would wait for an accept
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.setblocking(False)
        try:
            c.connect(path)
        except BlockingIOError:
            c.close()
            break
        queued.append(c)
    config = tmp_path / "detokd.toml"
    config.write_text(to_toml(cfg))
    try:
        # The deadline is the test's, not detokd's: without the fix this run never ends.
        t0 = time.monotonic()
        r = subprocess.run(
            [sys.executable, "-m", "detokd", "serve", "--config", str(config), "--metrics-port", "0"],
            capture_output=True, text=True, timeout=60,
        )
        elapsed = time.monotonic() - t0
    except subprocess.TimeoutExpired:
        raise AssertionError("detokd still starting 60 s later: the check of the input path has no deadline") from None
    finally:
        for c in queued:
            c.close()
    naming = [line for line in r.stderr.splitlines() if path in line]  # beside it: the metrics port's line
    assert r.returncode == 2 and len(naming) == 1, r.stderr
    assert naming[0].startswith("detokd: error: input ") and f"{path} did not take a connect within 1 s" in naming[0], r.stderr
    assert Path(path).is_socket()  # the holder's socket is still there
    assert elapsed < 20, elapsed  # the imports (~3 s) and the 1 s deadline, not a wait for ever
    holder.close()


def test_the_pyzmq_method_the_authenticator_overrides_is_there_as_it_is_overridden():
    """Fails on a pyzmq upgrade that renames or reshapes it, as detokd's start-up would."""
    check_zap_reply()


@pytest.mark.parametrize("change", ["removed", "reshaped"])
def test_a_pyzmq_without_it_fails_the_authenticators_start_naming_it(monkeypatch, change):
    if change == "removed":
        monkeypatch.delattr(zmq.auth.base.Authenticator, ZAP_REPLY)
    else:
        monkeypatch.setattr(zmq.auth.base.Authenticator, ZAP_REPLY, lambda self, request_id, status: None)
    ctx = zmq.Context()
    try:
        with pytest.raises(ConfigError, match=f"pyzmq .*{ZAP_REPLY}"):
            start_authenticator(ctx, None)
    finally:
        ctx.term()
