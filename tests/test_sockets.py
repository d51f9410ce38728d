"""detokd.sockets in-process: what a peer's register address must look like.

The process-level tests (a real detokd, real sockets) are in tests/test_hardening.py.
"""

from __future__ import annotations

import pytest

from detokd.sockets import register_address_problem

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
