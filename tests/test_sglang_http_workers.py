"""detokd.sglang.http_workers: which addresses a row may name as its HTTP worker, each
refusal against a real socket or file (tests/sglang/test_hostile_batches.py: the same
between real processes)."""

from __future__ import annotations

import os
import socket
import tempfile
from dataclasses import dataclass

import pytest
import zmq

from detokd.sglang.http_workers import HttpWorkerAddresses, sglangs_addresses


def reserved() -> str:
    """An address as SGLang makes one: a file tempfile reserves in the temp folder."""
    return f"ipc://{tempfile.NamedTemporaryFile(delete=False).name}"


@pytest.fixture
def made():
    """Addresses of SGLang's form; their files are removed after the test."""
    addresses: list[str] = []

    def make() -> str:
        addresses.append(reserved())
        return addresses[-1]

    yield make
    for a in addresses:
        try:
            os.unlink(a.removeprefix("ipc://"))
        except FileNotFoundError:
            pass


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def bound(ctx):
    """A TokenizerManager's end: a PULL socket bound at the address (its file becomes the
    socket), held open until the test ends (a socket no one holds is closed when collected)."""
    held: list[zmq.Socket] = []

    def bind(address: str) -> zmq.Socket:
        held.append(ctx.socket(zmq.PULL))
        held[-1].bind(address)
        return held[-1]

    return bind


def test_a_listening_socket_of_this_user_at_an_address_sglang_makes_is_an_http_workers(made, bound):
    address = made()
    bound(address)
    assert HttpWorkerAddresses(4).refusal(address) is None


def test_one_of_sglangs_own_addresses_is_refused_though_it_listens(made, bound):
    """The router's or the scheduler's address is made the same way and listens too."""
    address = made()
    bound(address)
    why = HttpWorkerAddresses(4, frozenset({address})).refusal(address)
    assert why is not None and "SGLang's own" in why


def test_an_address_nothing_made_is_refused(made):
    address = made()
    os.unlink(address.removeprefix("ipc://"))
    assert HttpWorkerAddresses(4).refusal(address) == "no such socket"


def test_a_reserved_file_nothing_bound_is_refused(made):
    assert HttpWorkerAddresses(4).refusal(made()) == "it is not a socket"


def test_a_socket_nobody_listens_on_any_more_is_refused(made):
    """A worker that died leaves its socket file (ZMQ removes none); nothing accepts there."""
    address = made()
    os.unlink(address.removeprefix("ipc://"))
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(address.removeprefix("ipc://"))
    addresses = HttpWorkerAddresses(4)
    assert addresses.refusal(address) == "nothing listens on it"
    other = made()
    c = zmq.Context()
    worker = c.socket(zmq.PULL)
    worker.bind(other)
    assert addresses.refusal(other) is None
    c.destroy(linger=0)  # the worker dies: its socket file stays, its listener goes
    assert os.path.exists(other.removeprefix("ipc://"))
    assert addresses.gone(other) == "nothing listens on it"


def test_another_users_socket_is_refused(made, bound):
    address = made()
    bound(address)
    assert HttpWorkerAddresses(4, uid=os.geteuid() + 1).refusal(address) == "it is another user's socket"


@pytest.mark.parametrize("form", [
    "ipc://{folder}/sub/tmpabcdefgh",  # not in the temp folder itself
    "ipc://{folder}/../tmpabcdefgh",
    "ipc://{folder}/tmpabcdefg",  # not tempfile's name
    "ipc://{folder}/tmpabcdefghi",
    "ipc://{folder}/sglang_load_collector_x_1234abcd.sock",  # a socket of SGLang's, of a name of its own
    "ipc://{folder}/tmpABCDEFGH",
    "ipc://@tmpabcdefgh",  # the abstract namespace
    "tcp://127.0.0.1:5555",
    "ipc://{folder}/tmpabc\x00efgh",
    "",
])
def test_an_address_of_another_form_is_refused_by_its_form_alone(form):
    address = form.format(folder=tempfile.gettempdir())
    why = HttpWorkerAddresses(4).refusal(address)
    assert why is not None and "no HTTP worker address of that form" in why


def test_sglangs_own_addresses_are_every_address_its_port_args_hold():
    @dataclass(frozen=True)
    class Spec:
        bind_endpoint: str
        connect_endpoints: tuple[str, ...]
        rank: int

    @dataclass
    class PortArgs:
        tokenizer_ipc_name: str
        detokenizer_ipc_name: str
        nccl_port: int
        tokenizer_worker_ipc_name: str | None
        spec: Spec | None
        instance_id: str = "abc"

    args = PortArgs("ipc:///tmp/tmpaaaaaaaa", "ipc:///tmp/tmpbbbbbbbb", 1234, None,
                    Spec("tcp://10.0.0.1:1", ("tcp://10.0.0.2:2", "ipc:///tmp/tmpcccccccc"), 0))
    assert sglangs_addresses(args) == {"ipc:///tmp/tmpaaaaaaaa", "ipc:///tmp/tmpbbbbbbbb", "tcp://10.0.0.1:1",
                                       "tcp://10.0.0.2:2", "ipc:///tmp/tmpcccccccc"}
