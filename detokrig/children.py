"""The tools' child processes: this checkout's detokd, the baselines, bench's worker.

Every child gets the checkout first on PYTHONPATH, so it runs this checkout's detokd,
detokrig and detokbench wherever the tool was started from, and is stopped when the tool exits.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
from pathlib import Path

from detokd.config import Config
from detokd.process import DetokdProcess

from . import ROOT

_STARTED: list[subprocess.Popen] = []
_DETOKDS: list[DetokdProcess] = []


def child_env() -> dict[str, str]:
    """This process' environment, with the checkout first on PYTHONPATH."""
    env = dict(os.environ)
    paths = [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return env


def stop_proc(p: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM to its session, SIGKILL after `grace` seconds."""
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)  # its own session: whatever it forked goes too
    except (ProcessLookupError, PermissionError):
        p.terminate()
    try:
        p.wait(grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            p.kill()
        p.wait(5)


@atexit.register
def _cleanup() -> None:
    for p in _STARTED:
        with contextlib.suppress(Exception):
            stop_proc(p, 2.0)
    for d in _DETOKDS:
        try:
            d.stop(2.0)
        except Exception:
            d.kill()


def spawn(cmd: list[str], log_path: Path) -> subprocess.Popen:
    """`cmd` in the checkout, in a session of its own, its output to `log_path`."""
    with open(log_path, "wb") as logf:
        p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=str(ROOT), env=child_env(),
                             start_new_session=True)
    _STARTED.append(p)
    return p


def detokd_process(config: Config, folder: Path, args: list[str] = (), command: list[str] | None = None) -> DetokdProcess:
    """A DetokdProcess of this checkout (or of `command`, a `... detokd [serve]` prefix),
    stopped at exit if still running; not yet spawned."""
    if command and command[-1] == "serve":
        command = command[:-1]  # DetokdProcess adds `serve`
    d = DetokdProcess(config, args=list(args), folder=folder, env=child_env(), command=command or None)
    _DETOKDS.append(d)
    return d
