"""detokd's decoding process SIGKILLed under load behind SGLang's own HTTP server, as the
front-end tests read it (test_frontend.py, "A decoding process that dies").

Each kill: STREAMS streaming /generate clients in flight, the decoding process SIGKILLed
at a chosen moment, /health and /health_generate probed from the kill on, AFTER more
clients started right after it; every client ends or is given up at the deadline. Then
the restarts are used up (SGLang's own detokenizer takes over in the process SGLang
started), and SGLang is stopped as its users stop it: every detokd process must go.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import psutil
import requests

from detokrig.sglang_frontend import Frontend
from detokrig.waits import wait_until

STREAMS = 32  # clients in flight at a kill
AFTER = 8  # clients started once the kill is under way
AFTER_S = 0.2  # ... this long after it
DEADLINE_S = 60.0  # after the kill: a client not ended by then waits for a row that died
MAX_NEW = 400  # ids per client: seconds of stand-in steps, so each kill finds them streaming
FALLBACK_LINE = "detokd's decoding process keeps dying"


@dataclass
class Stream:
    """One streaming /generate client, as it saw its stream."""

    rid: str
    text: str = ""
    finish: dict | None = None
    first_at: float | None = None  # time.monotonic() of its first chunk
    chunks: int = 0
    ended: bool = False  # its stream ended with a finish reason before the deadline


@dataclass
class Clients:
    """Streaming clients of one server, their deadline settable while they run."""

    fe: Frontend
    deadline: float = float("inf")
    progress: dict[str, int] = field(default_factory=dict)  # rid -> chunks so far

    def stream(self, rid: str, max_new: int = MAX_NEW) -> Stream:
        s = Stream(rid)
        body = {"text": f"Keep talking. [reply {sum(map(ord, rid)) % 5}] [step 1]", "rid": rid, "stream": True,
                "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}}
        try:
            with requests.post(self.fe.url + "/generate", json=body, stream=True, timeout=(10, DEADLINE_S)) as resp:
                for line in resp.iter_lines():
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[len(b"data: "):])
                    s.chunks += 1
                    self.progress[rid] = s.chunks
                    s.first_at = s.first_at or time.monotonic()
                    s.text = chunk.get("text", s.text)
                    s.finish = chunk.get("meta_info", {}).get("finish_reason") or s.finish
                    if time.monotonic() > self.deadline:
                        return s
        except requests.RequestException:
            return s  # a read that outlasted DEADLINE_S: the stream never ended
        s.ended = s.finish is not None
        return s

    def probe(self, path: str, since: float) -> float | None:
        """Seconds from `since` until `path` answers 200, or None by the deadline."""
        while time.monotonic() < self.deadline:
            try:
                if requests.get(self.fe.url + path, timeout=15).status_code == 200:
                    return time.monotonic() - since
            except requests.RequestException:
                pass
            time.sleep(0.1)
        return None


@dataclass
class Kill:
    """One SIGKILL of the decoding process under load, and what every client saw."""

    moment: str  # "mid-stream": every client had chunks; "at start": most were still starting
    at: float  # time.monotonic() of the kill
    killed: int  # the decoding process's pid
    replaced_by: list[int]  # the decoding processes after it
    streams: list[Stream]
    after: list[Stream]
    health_s: float | None
    health_generate_s: float | None
    server_up: bool


def kill_under_load(fe: Frontend, tag: str, moment: str) -> Kill:
    clients = Clients(fe)
    with ThreadPoolExecutor(STREAMS + AFTER + 2) as pool:
        rids = [f"{tag}-s{i}" for i in range(STREAMS)]
        streams = [pool.submit(clients.stream, rid) for rid in rids]
        want, least = (STREAMS, 3) if moment == "mid-stream" else (STREAMS // 4, 1)
        wait_until(lambda: sum(clients.progress.get(r, 0) >= least for r in rids) >= want, 120,
                   f"{want} clients streaming")
        (decoding,) = fe.decoding_processes()
        decoding.kill()
        at = time.monotonic()
        clients.deadline = at + DEADLINE_S
        health = pool.submit(clients.probe, "/health", at)
        health_generate = pool.submit(clients.probe, "/health_generate", at)
        time.sleep(max(0.0, at + AFTER_S - time.monotonic()))  # when the `after` clients start, not a wait for a state
        after = [pool.submit(clients.stream, f"{tag}-a{i}", 60) for i in range(AFTER)]
        kill = Kill(moment, at, decoding.pid, [], [f.result() for f in streams], [f.result() for f in after],
                    health.result(), health_generate.result(), fe.proc.poll() is None)
    kill.replaced_by = [p.pid for p in fe.decoding_processes()]
    return kill


def supervisor_uss(fe: Frontend) -> int:
    """The unshared memory of the process SGLang started (pages shared with the decoding
    process it forked are the child's too: RSS would count them twice)."""
    (supervisor,) = fe.detokenizer_processes()
    return supervisor.memory_full_info().uss


def kill_until_sglangs_own(fe: Frontend, most: int = 5) -> int:
    """SIGKILL each decoding process as soon as it is there, until the restarts end and
    SGLang's own detokenizer serves; how many kills it took."""
    kills = 0
    while FALLBACK_LINE not in fe.log_tail(1 << 22):
        assert kills < most, f"still restarting after {kills} kills in a row"
        pids = wait_until(lambda: [p.pid for p in fe.decoding_processes()] or FALLBACK_LINE in fe.log_tail(1 << 22),
                          60, "a decoding process, or SGLang's own")
        if pids is True:
            break
        victim = pids[0]
        psutil.Process(victim).kill()
        kills += 1
        wait_until(lambda: victim not in [p.pid for p in fe.decoding_processes()], 30, "the kill")  # noqa: B023
    return kills


def stop_cleanly(fe: Frontend) -> tuple[int | None, list[int]]:
    """SIGTERM to SGLang's server, as its users stop it: its exit status, and the detokd
    processes still there after it (none, if its shutdown ended every one)."""
    ours = [p.pid for p in fe.detokenizer_processes() + fe.decoding_processes()]
    fe.proc.send_signal(signal.SIGTERM)
    try:
        code = fe.proc.wait(120)
    except subprocess.TimeoutExpired:
        code = None

    def left() -> list[int]:
        return [pid for pid in ours if _running(pid)]

    try:
        wait_until(lambda: not left(), 30, "detokd's processes to end")
    except TimeoutError:
        pass  # the test names them
    return code, left()


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
