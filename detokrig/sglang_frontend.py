"""SGLang's own HTTP server and TokenizerManager around the stand-in scheduler, as a test rig.

`Frontend` starts `serve_standin.py` (SGLang's launch_server path; the detokenizer is
detokd through its plugin, or SGLang's own) in a process group of its own, waits until
/health answers 200 and every HTTP worker's warmup request has gone through the
detokenizer, and kills the group on close. The model folder holds a real tokenizer and a
config.json of an architecture SGLang accepts; no weights exist or are read.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import psutil
import requests

from detokd import zoo
from detokd.tokenizer import Vocab, load

from . import ROOT

SERVE = Path(__file__).resolve().parent / "serve_standin.py"
# SGLang's crash path waits ~5 s for py-spy and up to 60 s for CUDA core dumps; neither exists here.
QUIET_CRASH = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}
# What to do the day SGLang's launch starts no detokenizer process unless told otherwise
# (issue 43, item 5): test_plugin.py checks the setting's default, test_frontend.py the launch.
RUST_SERVER_DEFAULT = (
    "SGLang {version} starts no detokenizer process when SGLANG_RUST_SERVER is not set ({what}): its Rust "
    "server, which tokenizes and detokenizes itself, has become its default, so DETOKD_SGLANG=1 replaces nothing "
    "and detokd is unused unless the operator sets SGLANG_RUST_SERVER=0. Say so in docs/sglang.md (detokd or "
    "SGLang's Rust server?), make detokd/sglang/plugin.py's rust_server() line name the default, and set "
    "SGLANG_RUST_SERVER=0 where these tests start SGLang's Python server (detokrig/sglang_frontend.py)")


def rust_server_default(what: str) -> str:
    import sglang

    return RUST_SERVER_DEFAULT.format(version=sglang.__version__, what=what)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Frontend:
    """One SGLang server: `detokenizer` is "detokd" (the plugin), "sglang" (its own) or
    "rust" (SGLANG_RUST_SERVER=1: SGLang's Rust server in the stand-in scheduler's
    process, no Python front end or detokenizer); `env` is set over what the server's
    environment would be."""

    def __init__(self, model: Path, *, detokenizer: str, encoding: str, workers: int = 1, router: bool = False,
                 plugin_path: Path, log_dir: Path, extra: tuple[str, ...] = (), env: dict | None = None,
                 tag: str = ""):
        self.detokenizer, self.encoding, self.workers, self.extra = detokenizer, encoding, workers, extra
        # SGLang's HTTP workers (--tokenizer-worker-num): each warms up, and answers /health, by itself.
        self.http_workers = int(extra[extra.index("--tokenizer-worker-num") + 1]) if "--tokenizer-worker-num" in extra else 1
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
                   SGLANG_RUST_SERVER="1" if detokenizer == "rust" else "0",
                   PYTHONPATH=os.pathsep.join([str(plugin_path), str(ROOT)]))
        env.update(env_extra or {})
        args = ["--model-path", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                "--device", "cpu", "--detokenizer-worker-num", str(workers), *extra]
        self._out = open(self.server_log, "w")
        self.proc = subprocess.Popen([sys.executable, str(SERVE), *args], env=env, stdout=self._out,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 1200) -> None:
        """Until /health answers 200 and every HTTP worker has finished its warmup. A
        launch of the Python server that finished without a detokenizer process fails at
        once, saying what to do: its /health would never answer here."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang's server exited ({self.proc.returncode}):\n{self.log_tail()}")
            if self.launched() == [] and self.detokenizer != "rust":
                raise RuntimeError(rust_server_default("its launch finished with none running"))
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200 and self._all_workers_up():
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"SGLang's server did not answer /health within {timeout:.0f} s:\n{self.log_tail()}")

    def _all_workers_up(self) -> bool:
        """Under --tokenizer-worker-num N, each HTTP worker warms up by itself and answers
        /health (and /health_generate) 503 until it has: one worker's 200 says nothing of
        the others'. Each logs the line below when its warmup is through."""
        n = self.http_workers
        return n == 1 or self.log_tail(1 << 30).count("The server is fired up and ready to roll!") >= n

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
        """The server's detokenizer processes as SGLang started them (not its router, not
        the decoding processes detokd's fork), by their process titles."""
        return self._titled(lambda title: "router" not in title and "decoding" not in title)

    def decoding_processes(self) -> list[psutil.Process]:
        """detokd's decoding processes, each forked by a detokenizer process SGLang started."""
        return self._titled(lambda title: "(detokd decoding)" in title)

    def _titled(self, pick) -> list[psutil.Process]:
        out = []
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                title = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if "sglang::detokenizer" in title and pick(title):
                out.append(p)
        return out

    def processes(self) -> dict[str, list[psutil.Process]]:
        """The server's processes by role: "frontend" (the process launch_server runs
        in: SGLang's HTTP server and TokenizerManager, or with the Rust server only the
        launcher that waits for the scheduler), "scheduler", "detokenizer" (and SGLang's
        "router" in front of several), and "other" (multiprocessing's resource tracker)."""
        out: dict[str, list[psutil.Process]] = {"frontend": [psutil.Process(self.proc.pid)]}
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                title = " ".join(p.cmdline())
            except psutil.Error:
                continue
            role = ("scheduler" if title.startswith("sglang::scheduler") else
                    "router" if "sglang::detokenizer" in title and "router" in title else
                    "detokenizer" if "sglang::detokenizer" in title else "other")
            out.setdefault(role, []).append(p)
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(30)
        self._out.close()


# --- what a server serves -----------------------------------------------------------------

# A chat template for /v1/chat/completions: the messages' contents in order, then the
# assistant's turn (the stand-in scheduler reads its tags from the prompt).
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@functools.cache
def vocab(name: str) -> Vocab:
    return load(name)


def eos_of(name: str) -> int:
    """The tokenizer's eos, or its first special token when it names none."""
    v = vocab(name)
    return v.hf.eos_token_id if v.hf.eos_token_id is not None else sorted(v.special)[0]


def model_folder(root: Path, name: str | None) -> Path:
    """A weightless model folder (a tiny LlamaForCausalLM config) holding the packaged
    tokenizer `name` with a chat template, or no tokenizer at all (None: SGLang must be
    told one with --tokenizer-path)."""
    folder = root / f"model-{name or 'bare'}"
    if folder.exists():
        return folder
    # Servers started side by side may ask for the same folder at once.
    return zoo.built_aside(folder, lambda building: _fill_model_folder(building, name))


def _fill_model_folder(building: Path, name: str | None) -> None:
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2, "max_position_embeddings": 4096, "torch_dtype": "float32",
    }
    if name is not None:
        for f in zoo.build(name).iterdir():
            if f.is_file():
                shutil.copy(f, building / f.name)
        v, eos = vocab(name), eos_of(name)
        tc_path = building / "tokenizer_config.json"
        tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
        tc.update(eos_token=v.hf.convert_ids_to_tokens(eos), chat_template=CHAT_TEMPLATE)
        tc_path.write_text(json.dumps(tc))
        config.update(vocab_size=v.size, eos_token_id=eos)
    (building / "config.json").write_text(json.dumps(config))


def entry_points() -> dict[str, str]:
    """detokd's `sglang.srt.plugins` entry points, as pyproject.toml declares them."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["sglang.srt.plugins"]


def plugin_dist(folder: Path) -> Path:
    """`folder`, holding a dist-info that declares this checkout's entry point: put first
    on a child's path, SGLang discovers the plugin through importlib.metadata as a pip
    install would make it (entry_points() keeps the first distribution of a name,
    shadowing an older install)."""
    info = folder / "detokd-0.1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: detokd\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points().items())
    )
    return folder
