"""One batch from a scheduler costs its own requests and nothing else: detokd's SGLang
process, started as SGLang starts its detokenizer and fed by a scheduler's socket,
answers a batch it cannot read, or cannot answer, with an abort of each of its requests
naming the cause, and goes on: the batches around it are answered exactly, and the
process never exits (which would SIGQUIT SGLang's whole server). Every hostile value is
one SGLang's own classes carry and detokd's pickle allow-list admits. With two HTTP
workers, rows naming addresses no HTTP worker of SGLang's has cost no socket and lock
no worker out (detokd/sglang/http_workers.py)."""

from __future__ import annotations

import os
import pickle
import random
import socket
import string
import sys
import tempfile
import time
import urllib.request
from array import array

import msgspec
import pytest
import torch
from conftest import vocab
from replay import accumulate
from runs import ids_of

from detokd import zoo
from detokd.sglang.process import run_sglang_detokenizer
from detokrig.sglang_replay import (
    Scripted,
    SglangDetokenizerUnderTest,
    build_stream,
    http_worker_address,
    ipc_encoding,
    remove_ipc,
)

NAME = "deepseek"
PROMPT_TEXT = "Say something:"
TEXT = "Hello, world! 世界你好 🤖 Привет. Done."


class RefusedState:
    """SGLang's SchedulerReqTimeStats pickled with a state its own __setstate__ refuses (a
    time with no clock difference to rebase it by): the sender's __getstate__, patched."""

    def __call__(self, n: int) -> list:
        from sglang.srt.observability.req_time_stats import SchedulerReqTimeStats

        return [object.__new__(SchedulerReqTimeStats) for _ in range(n)]

    @staticmethod
    def patch(monkeypatch) -> None:
        from sglang.srt.observability.req_time_stats import SchedulerReqTimeStats

        monkeypatch.setattr(SchedulerReqTimeStats, "__getstate__", lambda self: {"start_time": 1.0})


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


# (encoding, case): the field of one batch that is set to a hostile value, and the
# exception detokd names in the abort. The first three fail only when the answer is
# encoded (pickle: the value, its pickling, SGLang's own __setstate__); the stride-0
# tensor would expand to 1.2 GB; msgpack's ext 1 is no tensor; its 2,000-deep field
# sinks the typed decode and its fallback alike. A batch with fewer id rows than rids
# leaves no row unanswered (a row without ids would be a finish with no text).
CASES = {
    "pickle": {
        "str-as-tensor": ("routed_experts", lambda n: ["x"] * n, "AttributeError"),
        "nested-5000": ("output_hidden_states", lambda n: [nested(5000)] * n, "RecursionError"),
        "time-stats": ("time_stats", RefusedState(), "KeyError"),
        "expanded-tensor": ("routed_experts", lambda n: [torch.ones(1).expand(300_000_000)] * n, "max_frame_bytes"),
        "ids-short": ("decode_ids", lambda n: [torch.tensor([100, 101])] * (n - 1), "ValueError"),
    },
    "msgpack": {
        "array-as-tensor": ("routed_experts", lambda n: [array("q", [1])] * n, "ValidationError"),
        "nested-2000": ("output_hidden_states", lambda n: msgspec.Raw(b"\x91" * 2000 + b"\xc0"), "RecursionError"),
        "ids-short": ("decode_ids", lambda n: [array("q", [100, 101])] * (n - 1), "ValueError"),
    },
}


def scripted(rid: str) -> Scripted:
    return Scripted(rid=rid, prompt_ids=ids_of(NAME, PROMPT_TEXT), output_ids=ids_of(NAME, TEXT))


def want(s: Scripted) -> str:
    v = vocab(NAME)
    ctx = s.prompt_ids[-5:]  # SGLang's read_offset context (the scheduler's five prompt ids)
    return v.hf.decode(ctx + s.output_ids)[len(v.hf.decode(ctx)) :]


def frame(proc: SglangDetokenizerUnderTest, message) -> bytes:
    """A message as SGLang's scheduler puts it on the socket (deep values need a deeper stack)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20000)
    try:
        with ipc_encoding(proc.encoding):
            if proc.encoding == "pickle":
                return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            from sglang.srt.managers import io_struct

            return io_struct.msgpack_encode(message)
    finally:
        sys.setrecursionlimit(limit)


def rss(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) * 1024


@pytest.fixture(scope="module", params=list(CASES))
def proc(request):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with SglangDetokenizerUnderTest(zoo.build(NAME), encoding=request.param, target=run_sglang_detokenizer) as p:
        p.exchange([], timeout=900)  # imported and serving
        yield p


def test_a_batch_that_cannot_be_read_or_answered_aborts_its_own_requests_and_nothing_else(proc, monkeypatch):
    for case, (field, value, cause) in CASES[proc.encoding].items():
        good = scripted(f"good-{case}")
        steps = build_stream([good], encoding=proc.encoding, tokenizer=vocab(NAME).hf)
        hostile = _hostile_batch(proc, case, field, value)
        half = len(steps) // 2
        proc.send(steps[:half])
        with monkeypatch.context() as m:
            if isinstance(value, RefusedState):
                value.patch(m)
            proc._push.send(frame(proc, hostile))
        before = rss(proc.processes[0].pid, "VmRSS")
        got = accumulate(proc.exchange(steps[half:])[0])
        peak = rss(proc.processes[0].pid, "VmHWM")
        assert [(life.text, life.finished_reason["type"]) for life in got[good.rid]] == [(want(good), "length")], case
        for rid in hostile.rids:
            (life,) = got[rid]
            assert life.text == "" and life.finished_reason["type"] == "abort", (case, life)
            assert "detokd: bad_row" in life.finished_reason["message"] and cause in life.finished_reason["message"], case
        # Nothing the size of the expanded tensor (1.2 GB) was ever built.
        assert peak - before < 400 << 20, (case, before, peak)


def _hostile_batch(proc, case: str, field: str, value):
    """A batch of two starting requests, as the scheduler builds it, with `field` set to
    the hostile value (msgpack: a Raw value is written as its bytes)."""
    two = [Scripted(rid=f"bad-{case}-{k}", prompt_ids=[1, 2, 3], output_ids=[100, 101], chunks=[2]) for k in range(2)]
    (batch,) = build_stream(two, encoding=proc.encoding, tokenizer=vocab(NAME).hf)
    setattr(batch, field, value(len(batch.rids)))
    return batch


def test_a_batch_of_more_rows_than_max_rows_is_dropped_whole_and_the_process_goes_on(proc):
    """A batch beyond max_rows (65,536 by default) is refused before anything is
    sized by it: 3 M rids must not leave a position per rid behind."""
    many = [f"m{i}" for i in range(70_000)]
    hostile = _hostile_batch(proc, "many", "rids", lambda n: many[:n])
    for name in ("http_worker_ipcs", "finished_reasons", "decoded_texts", "decode_ids", "read_offsets", "output_ids",
                 "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "prompt_tokens",
                 "reasoning_tokens", "completion_tokens", "cached_tokens"):
        column = getattr(hostile, name)
        if isinstance(column, list) and column:
            setattr(hostile, name, [column[0]] * len(many))
    hostile.rids = many
    good = scripted("after-many")
    proc._push.send(frame(proc, hostile))
    got = accumulate(proc.exchange(build_stream([good], encoding=proc.encoding, tokenizer=vocab(NAME).hf))[0])
    assert not set(got) & set(many)
    assert [(life.text, life.finished_reason["type"]) for life in got[good.rid]] == [(want(good), "length")]


# --- rows naming HTTP workers that are not SGLang's (issue 42, item 7) -------------------

FAKES = 3000  # rows of one hostile batch, each naming an address of its own
FD_SLACK = 16  # descriptors a round may add: none per refused address, a few per real worker
FD_CEILING = 100  # the process holds ~30 with its two workers connected


@pytest.fixture(scope="module")
def two_workers():
    """detokd's process under --tokenizer-worker-num 2: two real HTTP workers' PULL sockets
    at addresses made as SGLang makes them, and detokd's metrics on a port of its own."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    port = free_port()
    with pytest.MonkeyPatch.context() as m:  # the spawned process reads it at its start
        m.setenv("DETOKD_METRICS_PORT", str(port))
        p = SglangDetokenizerUnderTest(zoo.build(NAME), encoding="pickle", http_workers=2,
                                       target=run_sglang_detokenizer).start()
    p.metrics_url = f"http://127.0.0.1:{port}/metrics"
    try:
        serving(p, f"http://127.0.0.1:{port}/health")
        yield p
    finally:
        p.close()


def serving(p: SglangDetokenizerUnderTest, health: str, timeout: float = 900) -> None:
    """Wait until the process serves (its /health answers), having seen no row yet."""
    deadline = time.monotonic() + timeout
    while True:
        p._check_alive()
        try:
            with urllib.request.urlopen(health, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"detokd's process did not serve within {timeout:.0f} s")
        time.sleep(0.5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def made_up_addresses(n: int) -> list[str]:
    """Addresses of SGLang's form (tempfile's names in the temp folder) that nothing made,
    and two that exist there as this user's: a socket nobody listens on (a dead worker's)
    and a file SGLang's tempfile reserved but nothing bound."""
    rng = random.Random(n)
    alphabet = string.ascii_lowercase + string.digits + "_"
    folder = tempfile.gettempdir()
    made_up = [f"ipc://{folder}/tmp{''.join(rng.choices(alphabet, k=8))}" for _ in range(n - 2)]
    dead = http_worker_address()
    os.unlink(dead.removeprefix("ipc://"))
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(dead.removeprefix("ipc://"))  # closed unlistened: the socket file stays
    return [dead, http_worker_address(), *made_up]


def hostile_batch(addresses: list[str], tag: str):
    """One scheduler step of a starting request per address, each row naming its own."""
    rows = [Scripted(rid=f"{tag}-{i}", prompt_ids=[1, 2, 3], output_ids=[100, 101], chunks=[2], http_worker=i)
            for i in range(len(addresses))]
    (batch,) = build_stream(rows, encoding="pickle", http_worker_ipcs=addresses, tokenizer=vocab(NAME).hf)
    return batch


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def metric(p: SglangDetokenizerUnderTest, name: str, label: str = "") -> float:
    """The sum of a metric's samples (those with `label` in their labels) on detokd's /metrics."""
    with urllib.request.urlopen(p.metrics_url, timeout=30) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


def bad_rows(p: SglangDetokenizerUnderTest) -> float:
    return metric(p, "detokd_errors_total", 'kind="bad_row"')


def until(p: SglangDetokenizerUnderTest, name: str, value: float, timeout: float = 60) -> None:
    """Wait until detokd's process shows `name` (summed) at `value`: a state it reaches
    between batches (a connection seen broken, a message queued)."""
    deadline = time.monotonic() + timeout
    while metric(p, name) != value:
        p._check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} is {metric(p, name)}, not {value}, after {timeout:.0f} s")
        time.sleep(0.1)


def one_request_on_each_worker(p: SglangDetokenizerUnderTest, tag: str) -> None:
    """A request on each real HTTP worker: each gets its exact text, and only its own."""
    mine = [Scripted(rid=f"{tag}-w{w}", prompt_ids=ids_of(NAME, PROMPT_TEXT), output_ids=ids_of(NAME, TEXT),
                     http_worker=w) for w in range(2)]
    steps = build_stream(mine, encoding="pickle", http_worker_ipcs=p.http_worker_ipcs, tokenizer=vocab(NAME).hf)
    for w, outputs in enumerate(p.exchange(steps, timeout=120)):
        got = accumulate(outputs)
        assert list(got) == [mine[w].rid], (w, list(got)[:5])
        assert [(life.text, life.finished_reason["type"]) for life in got[mine[w].rid]] == [(want(mine[w]), "length")]


def test_a_batch_naming_3000_made_up_http_workers_costs_no_socket_and_locks_no_worker_out(two_workers):
    """The batch comes first, before any real worker's row: had its addresses taken the
    places of HTTP workers, the real ones would find none. Each of its rows is a bad_row;
    the process holds no descriptor for any of them; a second batch of 3,000 other
    addresses adds none either."""
    p = two_workers
    first, second = made_up_addresses(FAKES), made_up_addresses(FAKES)
    try:
        p.send([hostile_batch(first, "fake")])
        one_request_on_each_worker(p, "after")
        pid = p.processes[0].pid
        held = descriptors(pid)
        assert held <= FD_CEILING, held
        assert bad_rows(p) == FAKES
        p.send([hostile_batch(second, "fake2")])
        one_request_on_each_worker(p, "again")
        assert descriptors(pid) <= held + FD_SLACK, (held, descriptors(pid))
        assert bad_rows(p) == 2 * FAKES
    finally:
        for address in first[:2] + second[:2]:
            remove_ipc(address)


class ExtraWorker:
    """One more HTTP worker's PULL socket, at an address made as SGLang makes them, in a
    context of its own: closing it leaves no listener, as a worker that died."""

    def __init__(self) -> None:
        import zmq

        self.address = http_worker_address()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.bind(self.address)

    def until(self, rid: str, finished: bool = True, timeout: float = 120) -> list:
        """Every output that arrives until one with a row of `rid` (its finishing row)."""
        from sglang.srt.managers.io_struct import sock_recv

        got: list = []
        deadline = time.monotonic() + timeout
        while not (rid in (lives := accumulate(got)) and (lives[rid][-1].finished_reason is not None or not finished)):
            if not self.sock.poll(max(0.0, deadline - time.monotonic()) * 1000):
                raise TimeoutError(f"{rid} did not finish at {self.address} within {timeout:.0f} s: {list(lives)}")
            with ipc_encoding("pickle"):
                got.append(sock_recv(self.sock))
        return got

    def die(self) -> None:
        if self.ctx is not None:
            self.sock.close(linger=0)
            self.ctx.term()  # returns once the listener is closed
            self.ctx = None

    def remove(self) -> None:
        self.die()
        remove_ipc(self.address)


def test_a_dead_http_workers_place_goes_to_its_replacement_with_nothing_of_its_requests(two_workers):
    """uvicorn replaces a dead HTTP worker by a new one at a new address. With the real two
    and two more (C, D), every place is taken (twice tokenizer_worker_num). C dies with a
    request running, whose next row detokd queues for it; C's replacement E gets C's place:
    its own request's exact text, nothing of C's request (neither what was queued for C
    nor the row of it in E's first batch, a bad_row); D is served still."""
    p = two_workers
    one_request_on_each_worker(p, "before")  # A and B hold their places
    c, d, e = ExtraWorker(), ExtraWorker(), ExtraWorker()
    try:
        addresses = [*p.http_worker_ipcs, c.address, d.address, e.address]
        text = ids_of(NAME, TEXT)
        third = len(text) // 3
        on_c = Scripted(rid="on-c", prompt_ids=ids_of(NAME, PROMPT_TEXT), output_ids=text,
                        chunks=[third, third, len(text) - 2 * third], http_worker=2)
        on_d = [Scripted(rid=f"on-d{k}", prompt_ids=ids_of(NAME, PROMPT_TEXT), output_ids=text, chunks=[len(text)],
                         first_step=2 * k, http_worker=3) for k in range(2)]
        on_e = Scripted(rid="on-e", prompt_ids=ids_of(NAME, PROMPT_TEXT), output_ids=text, chunks=[len(text)],
                        first_step=2, http_worker=4)
        steps = build_stream([on_c, *on_d, on_e], encoding="pickle", http_worker_ipcs=addresses,
                             tokenizer=vocab(NAME).hf)
        assert len(steps) == 3

        p.exchange(steps[:1])  # C's first row, D's request: four places taken
        c.until("on-c", finished=False)
        assert [life.text for life in accumulate(d.until("on-d0"))["on-d0"]] == [want(on_d[0])]
        disconnects = metric(p, "detokd_worker_disconnects_total")
        c.die()
        until(p, "detokd_worker_disconnects_total", disconnects + 1)  # detokd saw C go
        p.exchange(steps[1:2])  # C's second row: queued for C
        until(p, "detokd_worker_backlog_messages", 1)
        before = bad_rows(p)
        p.exchange(steps[2:])  # C's last row, D's second request, E's first: E takes C's place
        got = accumulate(e.until("on-e"))
        assert list(got) == ["on-e"], list(got)
        assert [(life.text, life.finished_reason["type"]) for life in got["on-e"]] == [(want(on_e), "length")]
        assert [life.text for life in accumulate(d.until("on-d1"))["on-d1"]] == [want(on_d[1])]
        assert bad_rows(p) == before + 1  # C's last row
        assert metric(p, "detokd_worker_backlog_messages") == 0
    finally:
        for w in (c, d, e):
            w.remove()

