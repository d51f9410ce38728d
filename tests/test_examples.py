"""examples/: the SSE engine runs as a real process around a real detokd.

The example starts detokd itself (through DetokdProcess) and prints its pid; the test
reads its stdout with a deadline, streams completions over HTTP and checks each
reply against the oracle, Vocab.reference of the tokenizer the example serves.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import alive, oracle, vocab

REPO = Path(__file__).resolve().parents[1]


def encode(text: str) -> list[int]:
    return vocab("deepseek").backend.encode(text, add_special_tokens=False).ids


class _Lines:
    """A subprocess's stdout lines, read on a thread, waited for with a deadline."""

    def __init__(self, stream) -> None:
        import queue
        import threading

        self.q: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.q.put(line)

    def wait_for(self, prefix: str, timeout: float = 30.0) -> str:
        import queue

        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no line starting {prefix!r}; got {self.seen}"
            try:
                line = self.q.get(timeout=left)
            except queue.Empty:
                continue
            self.seen.append(line)
            if line.startswith(prefix):
                return line.strip()


def _sse(port: int, body: dict) -> tuple[list[str], list[dict]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    deltas, events = [], []
    while True:
        line = resp.readline()
        assert line, "stream ended without [DONE]"
        line = line.decode().rstrip("\n")
        if not line:
            continue
        assert line.startswith("data: "), line
        if line == "data: [DONE]":
            break
        ev = json.loads(line[len("data: "):])
        events.append(ev)
        deltas.append(ev["choices"][0]["text"])
    conn.close()
    return deltas, events


@contextlib.contextmanager
def sse_example(tmp_path: Path, *args: str):
    """The example running on a free port, as (its process, its port, its detokd's pid);
    whatever the test does, neither outlives the block. Its stderr: tmp_path/example.log."""
    with open(tmp_path / "example.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "examples" / "sse_engine.py"), "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=log, text=True,
        )
    lines = _Lines(proc.stdout)
    detokd_pid = None
    try:
        detokd_pid = int(lines.wait_for("detokd pid").split()[-1])
        yield proc, int(lines.wait_for("serving on http://127.0.0.1:").split(":")[2].split("/")[0]), detokd_pid
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            if detokd_pid is not None and alive(detokd_pid):
                os.kill(detokd_pid, signal.SIGKILL)


def test_the_sse_example_streams_every_reply_exactly_and_stops_detokd_with_it(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("sse_engine", REPO / "examples" / "sse_engine.py")
    example = importlib.util.module_from_spec(spec)
    sys.modules["sse_engine"] = example  # its dataclasses look their module up
    try:
        spec.loader.exec_module(example)
    finally:
        del sys.modules["sse_engine"]
    v = vocab("deepseek")

    with sse_example(tmp_path, "--step-ms", "2") as (proc, port, detokd_pid):
        for prompt in ["hi", "héllo 世界 🙂, naïve?"]:
            ids = encode(example.reply_for(prompt))
            tail = encode(prompt)[-example.PROMPT_TAIL:]
            want = oracle(v, tail, ids, True)
            deltas, events = _sse(port, {"prompt": prompt, "stream": True})
            assert "".join(deltas) == want
            assert len([d for d in deltas if d]) > 3  # it streamed, in pieces
            assert events[-1]["choices"][0]["finish_reason"] == "stop"
        # Not streamed, cut by max_tokens.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "x", "max_tokens": 5}))
        resp = conn.getresponse()
        out = json.loads(resp.read())
        ids = encode(example.reply_for("x"))[:5]
        assert out["choices"][0] == {"text": oracle(v, encode("x")[-example.PROMPT_TAIL:], ids, True), "index": 0, "logprobs": None, "finish_reason": "length"}
        conn.close()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=20)
    err = (tmp_path / "example.log").read_text()
    assert rc == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    deadline = time.monotonic() + 5
    while alive(detokd_pid):
        assert time.monotonic() < deadline, "detokd outlived the example"
        time.sleep(0.02)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_a_killed_sse_example_takes_its_detokd_along(tmp_path: Path) -> None:
    with open(tmp_path / "example.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "examples" / "sse_engine.py"), "--port", "0"],
            stdout=subprocess.PIPE, stderr=log, text=True,
        )
    lines = _Lines(proc.stdout)
    try:
        detokd_pid = int(lines.wait_for("detokd pid").split()[-1])
        proc.kill()  # no chance to clean up
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while alive(detokd_pid):
            assert time.monotonic() < deadline, "detokd outlived a SIGKILLed example"
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_sse_example_passes_openai_stop_to_detokd_and_stops_generating_on_stopped(tmp_path: Path) -> None:
    """OpenAI `stop` reaches detokd: the reply ends before the stop string, with
    finish_reason stop; the fake engine hears `stopped` and generates no further
    (it logs how many of the reply's ids it had sent: fewer than all). The default
    step, 20 ms, leaves the reply ~1 s of generation after the stop."""
    with sse_example(tmp_path) as (proc, port, _):
        deltas, events = _sse(port, {"prompt": "hi", "stream": True, "stop": ["said:", "never there"]})
        assert "".join(deltas) == "You "
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "x", "stop": "marche"}))
        out = json.loads(conn.getresponse().read())
        conn.close()
        assert out["choices"][0]["text"].endswith("Ça ") and out["choices"][0]["finish_reason"] == "stop"
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=20)
    err = (tmp_path / "example.log").read_text()
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    import re

    # "marche" comes near the reply's end, which may be sent before `stopped` is read.
    [(sent, total)] = re.findall(r"detokd found stop 'said:'; generation stopped after (\d+) of (\d+) ids", err)
    assert int(sent) < int(total), (sent, total)
