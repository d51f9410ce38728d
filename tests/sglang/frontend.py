"""SGLang's own HTTP server and TokenizerManager around the stand-in scheduler, as a test rig.

`Frontend` starts `serve_standin.py` (SGLang's launch_server path; the detokenizer is
detokd through its plugin, or SGLang's own) in a process group of its own, waits until
/health answers 200 (SGLang's warmup request has then gone through the detokenizer), and
kills the group on close. The model folder holds a real tokenizer and a config.json of
an architecture SGLang accepts; no weights exist or are read.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SERVE = HERE / "serve_standin.py"
# SGLang's crash path waits ~5 s for py-spy and up to 60 s for CUDA core dumps; neither exists here.
QUIET_CRASH = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}
# What to do the day SGLang's launch starts no detokenizer process unless told otherwise
# (issue 43, item 5): test_plugin.py checks the setting's default, test_frontend.py the launch.
RUST_SERVER_DEFAULT = (
    "SGLang {version} starts no detokenizer process when SGLANG_RUST_SERVER is not set ({what}): its Rust "
    "server, which tokenizes and detokenizes itself, has become its default, so DETOKD_SGLANG=1 replaces nothing "
    "and detokd is unused unless the operator sets SGLANG_RUST_SERVER=0. Say so in docs/sglang.md (The Rust "
    "server: which to pick), make detokd/sglang/plugin.py's rust_server() line name the default, and set "
    "SGLANG_RUST_SERVER=0 where these tests start SGLang's Python server (tests/sglang/frontend.py)")


def rust_server_default(what: str) -> str:
    import sglang

    return RUST_SERVER_DEFAULT.format(version=sglang.__version__, what=what)

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

class Frontend:
    """One SGLang server: `detokenizer` is "detokd" (the plugin) or "sglang" (its own);
    `env` is set over what the server's environment would be."""

    def __init__(self, model: Path, *, detokenizer: str, encoding: str, workers: int = 1, router: bool = False,
                 plugin_path: Path, log_dir: Path, extra: tuple[str, ...] = (), env: dict | None = None,
                 tag: str = ""):
        self.detokenizer, self.encoding, self.workers, self.extra = detokenizer, encoding, workers, extra
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        tag = f"{model.name}-{detokenizer}-{encoding}-{workers}{'-router' if router else ''}{tag}"
        self.standin_log = log_dir / f"{tag}.standin.jsonl"
        self.launch_record = log_dir / f"{tag}.launch.json"  # serve_standin.py's record_launch
        self.server_log = log_dir / f"{tag}.server.log"
        env_extra = env
        env = {k: v for k, v in os.environ.items()
               if k not in ("DETOKD_SGLANG", "DETOKD_SGLANG_ROUTER", "SGLANG_PLUGINS", "SGLANG_RUST_SERVER")}
        env.update(QUIET_CRASH, HF_HUB_OFFLINE="1", STANDIN_LOG=str(self.standin_log),
                   STANDIN_LAUNCH=str(self.launch_record),
                   SGLANG_USE_PICKLE_IPC="1" if encoding == "pickle" else "0",
                   DETOKD_SGLANG="1" if detokenizer == "detokd" else "0",
                   DETOKD_SGLANG_ROUTER="1" if router else "0",
                   PYTHONPATH=os.pathsep.join([str(plugin_path), str(ROOT), str(HERE)]))
        env.update(env_extra or {})
        args = ["--model-path", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                "--device", "cpu", "--detokenizer-worker-num", str(workers), *extra]
        self._out = open(self.server_log, "w")
        self.proc = subprocess.Popen([sys.executable, str(SERVE), *args], env=env, stdout=self._out,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 1200) -> None:
        """Until /health answers 200. A launch that finished without a detokenizer process
        fails at once, saying what to do: its /health would never answer here."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang's server exited ({self.proc.returncode}):\n{self.log_tail()}")
            if self.launched() == []:
                raise RuntimeError(rust_server_default("its launch finished with none running"))
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"SGLang's server did not answer /health within {timeout:.0f} s:\n{self.log_tail()}")

    def launched(self) -> list[str] | None:
        """The titles of the detokenizer processes SGLang's launch started, once it said
        it is done (serve_standin.py's launch callback); None before."""
        if not self.launch_record.exists():
            return None
        return json.loads(self.launch_record.read_text())["detokenizers"]

    def wait_launched(self, timeout: float = 120) -> list[str]:
        """launched(), once SGLang called the launch callback: right after the warmup
        request, on a server that answers /health. (SGLang drops the callback under
        --tokenizer-worker-num > 1, whose HTTP workers warm up by themselves.)"""
        deadline = time.monotonic() + timeout
        while (launched := self.launched()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"SGLang did not call the launch callback within {timeout:.0f} s")
            time.sleep(0.1)
        return launched

    def log_tail(self, n: int = 6000) -> str:
        self._out.flush()
        return self.server_log.read_text(errors="replace")[-n:]

    def records(self) -> dict[str, dict]:
        """The stand-in's record of every finished request, by rid."""
        if not self.standin_log.exists():
            return {}
        return {r["rid"]: r for r in map(json.loads, self.standin_log.read_text().splitlines())}

    def detokenizer_processes(self) -> list[psutil.Process]:
        """The server's detokenizer processes (not the router), by their process titles."""
        out = []
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                title = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if "sglang::detokenizer" in title and "router" not in title:
                out.append(p)
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(30)
        self._out.close()
