"""Starting the processes of the benchmark: the worker, and each implementation under test.

detokd runs through detokd.process.DetokdProcess (a config file, readiness by the
notify socket, stop by signal); the baselines are `python -m detokbench baselines
--algo NAME`. Each implementation PULLs at its own ipc:// input in a temporary folder and
PUSHes text to the one worker (worker.py), which acks whole steps to the scheduler.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import zmq

from detokd.config import Config
from detokd.launch import derive_address
from detokd.process import DetokdProcess
from detokrig.children import detokd_process, spawn, stop_proc
from detokrig.engine import push
from detokrig.proc import ProcTree
from detokrig.sink import pull

from .worker import ACK_CONFIG, ACK_DUMP, Configure, Dump, Quit


class Stall(RuntimeError):
    """No ack came in time: the implementation (or the worker) is stuck."""


class Harness:
    """The worker process and the scheduler's sockets."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ctx = zmq.Context()
        self.text_addr = f"ipc://{tmp}/text"
        self.ack_addr = f"ipc://{tmp}/ack"
        self.ack = pull(self.ctx, self.ack_addr, hwm=0)
        self.worker = spawn([sys.executable, "-m", "detokbench.bench.worker", self.text_addr, self.ack_addr], tmp / "worker.log")
        self.worker_tree = ProcTree(self.worker.pid)
        self.self_tree = ProcTree(os.getpid())
        self.ctl = push(self.ctx, self.text_addr, hwm=0)
        self.poller = zmq.Poller()
        self.poller.register(self.ack, zmq.POLLIN)
        self.dec = msgspec.msgpack.Decoder()
        self.enc = msgspec.msgpack.Encoder().encode
        self.cid = 0

    def recv_ack(self, timeout_s: float) -> list:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Stall(f"no ack within {timeout_s:.0f}s")
            if self.poller.poll(min(left, 1.0) * 1000):
                return self.dec.decode(self.ack.recv())
            if self.worker.poll() is not None:
                raise RuntimeError(f"the worker process exited ({self.worker.returncode}); see {self.tmp}/worker.log")

    def ask(self, msg: Configure | Dump, kind: int) -> list:
        """Send the worker a control message; its answer (acks of steps before it are dropped)."""
        self.ctl.send(self.enc(msg))
        while True:
            a = self.recv_ack(60)
            if a[0] == kind and a[1] == self.cid:
                return a

    def configure(self, expected: int, check: str, watch: list[str]) -> None:
        self.cid += 1
        self.ask(Configure(self.cid, expected, check, watch), ACK_CONFIG)

    def dump(self) -> dict:
        return self.ask(Dump(self.cid), ACK_DUMP)[2]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ctl.send(self.enc(Quit()))
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.worker.wait(3)
        stop_proc(self.worker)
        self.ctx.destroy(linger=0)


class Impl:
    """One implementation process (detokd or a baseline) for one tokenizer."""

    def __init__(self, name: str, tokenizer: str, h: Harness, args) -> None:
        self.name, self.tokenizer, self.h = name, tokenizer, h
        self.shards = args.shards if name == "detokd" else 1
        base = f"ipc://{h.tmp}/in-{name}-{tokenizer}"
        self.detokd: DetokdProcess | None = None
        self.proc: subprocess.Popen
        if name == "detokd":
            settings = {"max_states": args.max_states} if args.max_states else {}
            cfg = msgspec.structs.replace(Config(), input=base, workers=[h.text_addr], tokenizer=tokenizer,
                                          log_level="warning", **settings)
            extra = ["--shards", str(self.shards)] if self.shards > 1 else []
            self.detokd = detokd_process(cfg, h.tmp, extra, shlex.split(args.detokd_cmd) if args.detokd_cmd else None)
            self.detokd.spawn()
            self.proc = self.detokd.proc
            self.log_path = self.detokd.log_path
        else:
            self.log_path = h.tmp / f"{name}-{tokenizer}.log"
            self.proc = spawn([sys.executable, "-m", "detokbench", "baselines", "--algo", name, "--input", base,
                               "--worker", h.text_addr, "--tokenizer", tokenizer], self.log_path)
        self.tree = ProcTree(self.proc.pid)
        addrs = [base] if self.shards == 1 else [derive_address(base, i) for i in range(self.shards)]
        self.socks = [push(h.ctx, a, hwm=0) for a in addrs]

    def log_tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        for s in self.socks:
            s.close(linger=0)
        if self.detokd is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.detokd.stop(5.0)
        else:
            stop_proc(self.proc)

