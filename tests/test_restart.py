"""`detokd serve --restart` (restart = true): the process that loaded the tokenizer
supervises a forked decoding process and forks it again when it dies.

Real `detokd serve` processes, a real engine and worker on ipc sockets: the decoding
process is SIGKILLed mid-stream and the scheduler, the worker and the supervisor go
on (docs/deploy.md, "Restarts").
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import zmq
from conftest import alive
from utils import Engine, Req, Sink, logged, make_ids, wait_until

from detokd.config import to_toml
from detokd.core.records import UNKNOWN_RID
from detokd.process import ipc_config


def decoding(d) -> psutil.Process:
    """The supervisor's decoding process, once it is there."""
    children = wait_until(lambda: psutil.Process(d.pid).children(), 20, "a decoding process")
    (child,) = children
    return child


def test_a_killed_decoding_process_is_forked_again_and_serves_exactly(detokd, zctx):
    """SIGKILL mid-stream: the supervisor lives on and forks a new decoding process,
    which binds the same input. Requests begun before the kill get an error row for
    their next row (unknown_rid: this process never saw them), never text decoded
    without their context; requests sent once the engine's socket has seen the old
    process go, before the new one is up, wait in the engine's queue and are exact.
    (A frame sent while the kill is under way can be lost with the connection: ZMQ
    acknowledges nothing; docs/deploy.md, "Restarts".)"""
    import random

    from zmq.utils.monitor import recv_monitor_message

    d = detokd(args=["--restart"])
    sink = Sink(zctx, d.workers[0])
    d.wait_ready()
    engine = Engine(zctx, d.input)
    gone = engine.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    rng = random.Random(7)
    before = [Req(f"before-{i}", make_ids(rng, 40)) for i in range(8)]
    engine.rows([r.row(5, finish=False) for r in before])
    sink.wait(lambda: all(sink.text(r.rid) for r in before), 20, "the first rows' text")
    first = decoding(d)
    first.kill()
    killed = time.monotonic()
    assert gone.poll(10_000) and recv_monitor_message(gone)["event"] == zmq.EVENT_DISCONNECTED
    after = [Req(f"after-{i}", make_ids(rng, 40)) for i in range(8)]
    engine.rows([r.row(40) for r in after])
    engine.rows([r.row(40) for r in before])
    sink.wait(lambda: all(sink.ended(r.rid) for r in before + after), 20, "every request to end")
    answered = time.monotonic() - killed

    assert alive(d.pid)
    assert decoding(d).pid != first.pid
    for r in after:
        assert sink.text(r.rid) == r.expected() and not sink.errors(r.rid), r.rid
    for r in before:  # its first rows' text, then the error: nothing decoded out of context
        assert sink.errors(r.rid) == [UNKNOWN_RID], r.rid
        assert r.expected().startswith(sink.text(r.rid)), r.rid
    assert answered < 2, f"the new decoding process answered {answered:.2f} s after the kill"
    logged(d, "decoding process 0 (pid")
    gone.close()
    assert d.stop() == 0


def test_the_supervisor_stops_its_decoding_process_and_says_so_last(detokd, zctx):
    d = detokd(args=["--restart"])
    Sink(zctx, d.workers[0])
    d.wait_ready()
    child = decoding(d)
    assert d.stop() == 0
    assert not alive(child.pid)
    lines = d.log().strip().splitlines()
    assert "stopped: got SIGTERM; exit 0" in lines[-1], lines[-3:]


def test_a_decoding_process_outlives_no_supervisor(detokd, zctx):
    """A SIGKILLed supervisor takes its decoding process along (PR_SET_PDEATHSIG):
    no process is left holding the input."""
    d = detokd(args=["--restart"])
    Sink(zctx, d.workers[0])
    d.wait_ready()
    child = decoding(d)
    os.kill(d.pid, signal.SIGKILL)
    wait_until(lambda: not alive(child.pid), 30, "the decoding process to end with its supervisor")


def test_an_input_the_decoding_process_cannot_bind_stops_the_supervisor_with_exit_2(detokd, tmp_path):
    """A config error only the decoding process can meet (its input held by another
    process) is not retried for ever: the supervisor ends with the decoding process's
    exit status 2 and its one-line reason."""
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = tmp_path / "in.sock"
    holder.bind(str(path))
    holder.listen()
    try:
        d = detokd(args=["--restart"])
        assert d.proc.wait(60) == 2
        assert "held by another process" in d.log()
    finally:
        holder.close()


@pytest.mark.parametrize("args", [["--restart"], ["--shards", "2"]])
def test_a_supervisor_says_ready_for_its_children_and_only_it_speaks_to_systemd(tmp_path, args):
    """systemd's NotifyAccess=main hears the main process only: the children tell the
    supervisor (a relay it makes), which says READY=1 once every child has, and
    STOPPING=1 when it stops. Every datagram on NOTIFY_SOCKET is the supervisor's."""
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    path = tmp_path / "systemd-notify.sock"
    notify.bind(str(path))
    config = tmp_path / "c.toml"
    config.write_text(to_toml(ipc_config(tmp_path)))
    proc = subprocess.Popen([sys.executable, "-m", "detokd", "serve", "--config", str(config), *args],
                            env={**os.environ, "NOTIFY_SOCKET": str(path)}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        heard = []
        notify.settimeout(60)
        while not heard or heard[-1][1] != b"READY=1":
            heard.append(datagram(notify))
        assert len(psutil.Process(proc.pid).children()) == (2 if "--shards" in args else 1)
        proc.send_signal(signal.SIGTERM)
        while heard[-1][1] != b"STOPPING=1":
            heard.append(datagram(notify))
        assert proc.wait(60) == 0
        assert {pid for pid, _ in heard} == {proc.pid}, heard
        assert [m for _, m in heard].count(b"READY=1") == 1, heard
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()


def datagram(sock: socket.socket) -> tuple[int, bytes]:
    """The next notify datagram and its sender's pid (SCM_CREDENTIALS)."""
    import struct

    data, ancillary, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(struct.calcsize("3i")))
    (pid,) = [struct.unpack("3i", d[:12])[0] for level, kind, d in ancillary if kind == socket.SCM_CREDENTIALS]
    return pid, data.strip()
