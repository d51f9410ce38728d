"""One way to start and talk to a `detokd serve` process from Python.

`DetokdProcess` starts detokd on a Config (written to a TOML file beside its log),
waits until it is ready by the documented signal (systemd's notify protocol, see
detokd.readiness: READY=1 once the tokenizer is loaded and every socket bound), stops
it by signal, and reads its log. The demo, the examples, the benchmarks and the tests
all start detokd through it; anything else that supervises detokd can wait on the
same signal (a systemd Type=notify unit) or on /health turning from "starting" to "ok".

`ipc_config` gives a config whose ipc addresses live in one private folder.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from .config import Config, to_toml

__all__ = ["DetokdProcess", "NotReady", "ipc_config"]

_ids = itertools.count()  # several detokds may share a folder: each its own files


class NotReady(RuntimeError):
    """detokd exited, or did not get ready in time; the message ends with its log."""


def ipc_config(folder: str | os.PathLike, *, workers: int = 1, feedback: bool = False, **settings) -> Config:
    """A Config on ipc:// addresses in `folder`: in.sock, w0.sock, w1.sock, ..., fb.sock."""
    folder = Path(folder)
    return msgspec.structs.replace(
        Config(),
        input=f"ipc://{folder}/in.sock",
        workers=[f"ipc://{folder}/w{i}.sock" for i in range(workers)],
        feedback=f"ipc://{folder}/fb.sock" if feedback else None,
        **settings,
    )


class DetokdProcess:
    """A `detokd serve` child process.

    `args` are extra command-line arguments (`--shards 2`: then ready means every
    shard said so). `env` adds to the inherited environment. `popen` passes more
    keyword arguments to subprocess.Popen (`process_group=0`, so a terminal's Ctrl-C
    reaches its parent only; `preexec_fn=launch.die_with_parent`). Use as a context
    manager, or call start() and stop().
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        args: Sequence[str] = (),
        folder: str | os.PathLike | None = None,
        env: Mapping[str, str] | None = None,
        command: Sequence[str] | None = None,
        popen: Mapping[str, Any] | None = None,
    ) -> None:
        self._tmp = None
        if folder is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="detokd-")
            folder = self._tmp.name
        self.folder = Path(folder)
        self.config = config if config is not None else ipc_config(self.folder)
        self.args = list(args)
        self.env = dict(env or {})
        self.command = list(command) if command is not None else [sys.executable, "-m", "detokd"]
        self.popen = dict(popen or {})
        n = next(_ids)
        self.log_path = self.folder / f"detokd-{n}.log"
        self.config_path = self.folder / f"detokd-{n}.toml"
        self.notify_path = self.folder / f"notify-{n}.sock"
        self.proc: subprocess.Popen[bytes] | None = None
        self._notify: socket.socket | None = None

    # --- life cycle ---------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> DetokdProcess:
        """Start detokd and return once it is ready; NotReady if it exits first or
        is not ready within `timeout` seconds."""
        self.spawn()
        self.wait_ready(timeout)
        return self

    def spawn(self) -> DetokdProcess:
        """Start detokd without waiting for it (then `wait_ready`)."""
        self.config_path.write_text(to_toml(self.config))
        self.notify_path.unlink(missing_ok=True)
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._notify.bind(str(self.notify_path))
        env = {**os.environ, **self.env, "NOTIFY_SOCKET": str(self.notify_path)}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.command, "serve", "--config", str(self.config_path), *self.args],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, **self.popen,
            )
        return self

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until detokd said READY=1 (under a supervisor, once every shard has said it to
        the supervisor); NotReady, with detokd killed, if it exits first or takes longer
        than `timeout` seconds."""
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self, timeout: float) -> None:
        proc, notify = self.proc, self._notify
        if proc is None or notify is None:
            raise RuntimeError("wait_ready before spawn")
        deadline = time.monotonic() + timeout
        ready = False
        while not ready:
            left = deadline - time.monotonic()
            if left <= 0:
                raise NotReady(f"detokd not ready within {timeout:.0f} s:\n{self.log()}")
            if proc.poll() is not None:
                raise NotReady(f"detokd exited with {proc.returncode} before it was ready:\n{self.log()}")
            notify.settimeout(min(left, 0.2))  # a bounded wait, so an early exit is seen
            try:
                message = notify.recv(4096)
            except TimeoutError:
                continue
            ready = b"READY=1" in message.split(b"\n")

    def stop(self, timeout: float = 20.0, sig: int = signal.SIGTERM) -> int:
        """Signal detokd and wait for it to exit; its exit code. Killed after `timeout`."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        finally:
            self._close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close()

    def _close(self) -> None:
        if self._notify is not None:
            self._notify.close()
            self._notify = None

    def __enter__(self) -> DetokdProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.stop()
            except subprocess.TimeoutExpired:
                pass
        self.cleanup()

    def cleanup(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # --- looking at it ------------------------------------------------------------------

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("detokd is not spawned")
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log(self) -> str:
        """Everything detokd wrote to stdout and stderr so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    @property
    def input(self) -> str:
        return self.config.input

    @property
    def workers(self) -> list[str]:
        return list(self.config.workers)

    @property
    def feedback(self) -> str | None:
        return self.config.feedback
