"""detokd.delivery.Delivery over real ZMQ sockets, fed by a real core.

Workers are PULL sockets on ipc:// addresses; the core (a real Detokenizer) returns
what a batch produced, the native dialect encodes it, and the conductor hands it to
Delivery and applies the stall policy (the core's `stalled`) to a lost message.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import zmq
from conftest import fast_codec, vocab
from utils import wait_until

from detokd.conductor import Conductor
from detokd.core.detokenizer import Detokenizer
from detokd.core.outbox import Outbox
from detokd.core.stats import Stats
from detokd.delivery import Delivery, RegisterPolicy
from detokd.output import Output, Registration
from detokd.wire import native

IDS = vocab("deepseek").backend.encode("Grüße, 世界!", add_special_tokens=False).ids


class Rig:
    def __init__(self, folder: Path, hwm: int = 100, queue_bytes: int = 1 << 20) -> None:
        self.ctx = zmq.Context()
        self.addresses = [f"ipc://{folder}/w{i}.sock" for i in range(2)]
        self.stats = Stats()
        self.outbox = Outbox(range(2))
        self.core = Detokenizer(fast_codec("deepseek"), vocab("deepseek").size, self.outbox,
                                max_states=1000, max_prompt_tail=8, stats=self.stats)
        # Register on and open (tests/test_peers.py holds the policy itself).
        open_register = RegisterPolicy(enabled=True, allow=("*",), replace=True)
        self.delivery = Delivery(
            self.ctx, self.addresses, feedback=None, hwm=hwm, queue_bytes=queue_bytes, linger_ms=0,
            stats=self.stats, policy=open_register,
        )
        self.use(native.NativeDialect(self.core, None, self.stats))
        self.pulls: dict[int, zmq.Socket] = {}

    def use(self, dialect: native.NativeDialect) -> None:
        self.dialect = dialect
        self.conductor = Conductor(dialect, self.core, self.delivery, self.stats)

    def bind(self, worker: int) -> zmq.Socket:
        s = self.pulls[worker] = self.ctx.socket(zmq.PULL)
        s.bind(self.addresses[worker])
        return s

    def register(self, worker: int, address: str) -> None:
        """A peer's register, as the loop delivers the native dialect's Output of one."""
        self.conductor.deliver(Output(register=Registration(worker, address)))

    def step(self, rows: list[native.Row]) -> None:
        self.delivery.flush()  # as the loop does at each turn
        self.conductor.deliver(self.dialect.encoded(self.core.tokens(rows)))

    def messages(self, worker: int, n: int) -> list[list[native.OutRow]]:
        """The next n messages of a worker, each its list of rows (fails at a deadline)."""
        s, out = self.pulls[worker], []

        def arrived() -> bool:
            self.delivery.flush()  # as the loop would: backlogged frames move on meanwhile
            return bool(s.poll(10))

        for _ in range(n):
            wait_until(arrived, 5, f"worker {worker}'s message {len(out) + 1} of {n}")
            out.append(msgspec.msgpack.decode(s.recv(), type=native.Text).rows)
        return out

    def drained(self, worker: int) -> bool:
        """The loop's flush, once; whether the worker's backlog is empty now."""
        self.delivery.flush()
        return not self.delivery.workers[worker].backlog

    def close(self) -> None:
        self.delivery.close()
        self.ctx.destroy(linger=0)


@pytest.fixture
def rig(tmp_path):
    made = []

    def make(**kw) -> Rig:
        made.append(Rig(tmp_path, **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


def start(rid: str, worker: int) -> native.Row:
    return native.Row(rid, IDS, 0, native.Start(worker=worker))


def test_each_worker_gets_one_message_per_batch_with_its_rows_in_order(rig) -> None:
    r = rig()
    r.bind(0), r.bind(1)
    r.step([start(f"r{i}", i % 2) for i in range(6)])
    (first,), (second,) = r.messages(0, 1), r.messages(1, 1)
    assert [x.rid for x in first] == ["r0", "r2", "r4"] and [x.rid for x in second] == ["r1", "r3", "r5"]
    r.step([start("only0", 0)])  # a worker with no rows in a batch gets no message
    assert [x.rid for x in r.messages(0, 1)[0]] == ["only0"]
    assert not r.pulls[1].poll(50)
    assert [(w.sent, w.dropped) for w in r.delivery.workers.values()] == [(2, 0), (1, 0)]


def test_a_full_queue_loses_only_that_workers_message_and_send_owed_sends_what_it_is_owed(rig) -> None:
    # A worker's queue is ZMQ's (hwm messages) and behind it a backlog bounded in bytes.
    r = rig(hwm=4, queue_bytes=1000)
    r.bind(1)  # worker 0 is bound by nobody: its queue fills
    r.step([start("warm", 1)])  # its arrival says worker 1 is connected, not queueing
    assert r.messages(1, 1)[0][0].rid == "warm"
    w0 = r.delivery.workers[0]
    steps = 0
    while w0.dropped == 0:
        steps += 1
        assert steps < 1000, "worker 0's queue never filled"
        before = w0.backlog_bytes
        r.step([start(f"a{steps}", 0), start(f"b{steps}", 1)])  # worker 0's message is lost, not 1's
        assert w0.backlog_bytes <= 1000
        assert r.messages(1, 1)[0][0].rid == f"b{steps}"
    lost = f"a{steps}"
    assert w0.backlog_bytes == before > 1000 - 200 and not r.delivery.has_room(w0)  # full: a frame here is ~75 bytes
    assert r.delivery.workers[1].dropped == 0 and not r.delivery.workers[1].backlog
    assert lost not in r.core.table and r.stats.errors[native.WORKER_STALLED] == 1
    r.delivery.flush()
    r.conductor.send_owed()  # still no room: still owed
    assert set(w0.owed) == {lost}
    r.bind(0)
    wait_until(lambda: r.drained(0), 5, "worker 0's backlog to drain")
    queued = r.messages(0, steps - 1)
    assert [m[0].rid for m in queued] == [f"a{i}" for i in range(1, steps)]  # in order, ZMQ's then the backlog's
    wait_until(lambda: r.delivery.has_room(w0), 5, "room in worker 0's queue")
    r.conductor.send_owed()
    (owed,) = r.messages(0, 1)
    assert [(x.rid, x.error) for x in owed] == [(lost, native.WORKER_STALLED)]
    r.conductor.send_owed()  # sent once
    assert not r.pulls[0].poll(50) and not w0.owed and w0.backlog_bytes == 0


def test_register_refuses_an_address_zmq_refuses_and_keeps_the_worker_as_it_was(rig) -> None:
    # Plain enough for the policy (tests/test_sockets.py holds the others), too long
    # for a unix socket path: ZMQ's connect refuses it.
    address = "ipc:///" + "x" * 200
    r = rig()
    assert r.delivery.register(1, address) is False
    assert r.delivery.workers[1].address == r.addresses[1]
    assert r.delivery.register(7, address) is False
    r.register(7, address)  # the loop's way: the core learns of no worker either
    assert not r.delivery.known(7) and not r.core.known(7)
    assert r.stats.errors["bad_register"] == 3


def test_register_adds_a_worker_and_moves_one_that_rebound(rig, tmp_path) -> None:
    r = rig()
    moved = f"ipc://{tmp_path}/moved.sock"
    assert not r.core.known(2)
    r.register(2, r.addresses[0])  # the loop's way: delivery connects it, then the core routes to it
    assert r.delivery.known(2) and r.core.known(2)
    assert r.delivery.register(1, moved)
    r.addresses[1] = moved
    r.bind(1)
    r.step([start("m", 1)])
    assert [x.rid for x in r.messages(1, 1)[0]] == ["m"]


class Refusing(native.NativeDialect):
    """The native dialect, but a message holding a rid that begins "poison" cannot be
    encoded: a stand-in for a value the encoder refuses (msgspec encodes every value the
    native core makes, so only a bug reaches this path)."""

    def encode_text(self, rows):
        if any(row.rid.startswith("poison") for row in rows):
            raise ValueError("cannot encode")
        return super().encode_text(rows)


def test_a_message_that_cannot_be_encoded_fails_its_own_requests_and_no_other(rig):
    r = rig()
    r.use(Refusing(r.core, None, r.stats))
    r.bind(0), r.bind(1)
    wait_until(lambda: all(r.delivery.has_room(w) for w in r.delivery.workers.values()), 5, "both workers connected")
    finish = native.Finish("length")
    r.step([
        native.Row("good", IDS, 0, native.Start(worker=0), None),
        native.Row("poison", IDS[:2], 0, native.Start(worker=0), None),
        native.Row("other", IDS, 0, native.Start(worker=1), finish),
    ])
    (failed,) = r.messages(0, 1)
    assert [(row.rid, row.text, row.error) for row in failed] == [("good", "", "internal"), ("poison", "", "internal")]
    (served,) = r.messages(1, 1)
    assert [(row.rid, row.text, row.finish) for row in served] == [("other", vocab("deepseek").backend.decode(IDS), finish)]
    r.step([native.Row("good", IDS[:1], len(IDS), None, finish)])  # its later rows get the same error
    (later,) = r.messages(0, 1)
    assert [(row.rid, row.error) for row in later] == [("good", "internal")]
    assert r.stats.errors["internal"] == 3
