"""`detokd demo`: real multilingual text streaming through a live detokd.

Three parties, as in production: `detokd serve` in its own process (started by
DetokdProcess; default config, addresses in a temporary folder), a synthetic
scheduler (SchedulerClient) replaying real text tokenized with the same tokenizer
as many concurrent streams, and a worker showing one stream live. At the end
every stream's text is checked against the reference decode (Vocab.reference).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import msgspec
import zmq

from .client import SchedulerClient
from .config import Config
from .process import DetokdProcess, NotReady, ipc_config
from .tokenizer import load
from .wire.native import Finish, Text

TEXTS = (
    "detokd turns token ids into text, one step at a time, and never decodes a whole "
    "sequence twice. Characters split across tokens wait until they are whole.\n",
    "流式输出的每一个字都必须完整：一个汉字可能被切成两个或三个标记，解码器要等它完整后再发送。\n",
    "Emoji come in pieces too: 🤖 👍🏽 👩‍👩‍👧‍👦 🇯🇵 — a family is seven code points joined by zero-width joiners.\n",
    "def stream(ids):\n    for delta in detokd.stream(ids):\n        yield delta  # exact, incremental\n\n",
    "Привет, мир! Каждый токен — это несколько байтов UTF-8, и ни один не теряется.\n",
    "مرحبا بالعالم — النص العربي يُكتب من اليمين إلى اليسار.\n",
    "नमस्ते दुनिया — देवनागरी में मात्राएँ अलग टोकन बन सकती हैं।\n",
    "Ελληνικά, 日本語のテキスト、한국어 문장, and ∑ math ∫ symbols ≤ ∞.\n",
)
PROMPT = "User: write something in many languages.\nAssistant:"
STEP_INTERVAL = 0.02  # the synthetic engine's decode step: 50 steps/s, watchable

_text = msgspec.msgpack.Decoder(Text)


def _streams(vocab, n: int, steps: int) -> tuple[list[int], list[list[int]]]:
    corpus = vocab.backend.encode("".join(TEXTS) * 4, add_special_tokens=False).ids
    tail = vocab.backend.encode(PROMPT, add_special_tokens=False).ids
    # Each stream starts elsewhere in the corpus, so they differ; all run `steps` ids.
    outs = []
    for i in range(n):
        at = (i * 37) % len(corpus)
        ids = (corpus[at:] + corpus)[:steps]
        outs.append(ids)
    return tail, outs


class _Scheduler(threading.Thread):
    """Sends one `tokens` batch per step: one new id for every live stream."""

    def __init__(self, address: str, tail: list[int], outs: list[list[int]], interval: float) -> None:
        super().__init__(name="scheduler", daemon=True)
        self.address, self.tail, self.outs, self.interval = address, tail, outs, interval
        self.halt = threading.Event()
        self.sent = 0

    def run(self) -> None:
        client = SchedulerClient(self.address)  # this thread's alone: a client is not thread-safe
        steps = max(len(o) for o in self.outs)
        next_at = time.monotonic()
        try:
            for k in range(steps + 1):
                if self.halt.is_set():
                    break
                for i, ids in enumerate(self.outs):
                    if k > len(ids):
                        continue
                    new, finish = ids[k : k + 1], Finish("length") if k == len(ids) else None
                    if k == 0:
                        client.begin(f"demo-{i}", new, prompt_tail=self.tail, finish=finish)
                    else:
                        client.add(f"demo-{i}", new, finish=finish)
                    self.sent += len(new)
                client.flush()
                next_at += self.interval
                time.sleep(max(0.0, next_at - time.monotonic()))
        finally:
            client.close(linger=1.0)


class _Screen:
    """The live view. On a terminal: stream 0's text and a progress line, redrawn in
    place. Elsewhere (a pipe, CI logs): whole lines only, stream 0's prefixed
    `demo-0 | ` and written once complete, progress lines `[...]` between them, so
    no line is ever cut by another."""

    def __init__(self, show: bool) -> None:
        self.show = show
        self.tty = sys.stdout.isatty()
        self.last = 0.0
        self.partial = ""  # stream 0's text after its last newline, not written yet

    def update(self, text: str, delta: str, progress: str, force: bool = False) -> None:
        if not self.show:
            return
        now = time.monotonic()
        if self.tty:
            if force or now - self.last >= 0.1:
                lines = text.splitlines()[-14:]
                frame = "\x1b[H\x1b[J── stream demo-0, live ──\n" + "\n".join(lines) + "\n\n" + progress + "\n"
                sys.stdout.write(frame)
                sys.stdout.flush()
                self.last = now
            return
        *whole, self.partial = (self.partial + delta).split("\n")
        out = [f"demo-0 | {line}\n" for line in whole]
        if force and self.partial:
            out.append(f"demo-0 | {self.partial}\n")
            self.partial = ""
        if force or now - self.last >= 1.0:
            out.append(f"[{progress}]\n")
            self.last = now
        sys.stdout.write("".join(out))
        sys.stdout.flush()


class _Meter:
    """detokd's own figures, read from its /metrics: tokens decoded and CPU seconds."""

    def __init__(self, server: DetokdProcess) -> None:
        m = re.search(r"health and metrics on port (\d+)", server.log())
        if m is None:
            raise NotReady(f"detokd logged no metrics port:\n{server.log()[-3000:]}")
        self.url = f"http://127.0.0.1:{m.group(1)}/metrics"

    def read(self) -> tuple[float, float]:
        """(detokd_tokens_total, process_cpu_seconds_total) now."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url, timeout=5) as r:
            body = r.read().decode()
        values = {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples}
        return values["detokd_tokens_total"], values["process_cpu_seconds_total"]


def _summary(streams: int, tokens: int, wall: float, interval: float, decoded: float, cpu: float) -> str:
    """The figures that mean something: what was delivered in what time, what the
    synthetic engine offered (the pacing: every stream gets a token a step), and
    detokd's own CPU per token, the cost that decides how far one process scales
    (the kernel counts CPU in 10 ms ticks: a short run's figure is coarse)."""
    offered = streams / interval
    per_token = cpu / decoded if decoded else 0.0
    return (
        f"{streams} streams, {tokens:,} tokens in {wall:.2f} s: {tokens / wall:,.0f} tokens/s delivered\n"
        f"pacing: the synthetic engine offers {streams} streams x {1 / interval:.0f} steps/s "
        f"= {offered:,.0f} tokens/s\n"
        f"detokd: {decoded:,.0f} tokens decoded in {cpu:.3f} s of its CPU = {per_token * 1e6:.1f} us of CPU per token "
        f"(one core at that cost: {1 / per_token if per_token else 0:,.0f} tokens/s)"
    )


def _take(msg: Text, texts: list[list[str]], n_ids: list[int], done: set[int]) -> str:
    """Record a text message's rows per stream; stream 0's new text."""
    delta0 = ""
    for row in msg.rows:
        i = int(row.rid.split("-")[1])
        if row.error:
            print(f"\n{row.rid}: error {row.error}", file=sys.stderr)
            done.add(i)
            continue
        texts[i].append(row.text)
        n_ids[i] = row.n_ids
        if i == 0:
            delta0 += row.text
        if row.finish is not None:
            done.add(i)
    return delta0


def _verdict(vocab, tail: list[int], outs: list[list[int]], texts: list[list[str]]) -> int:
    """Every stream's text against the reference decode, said in one line; 1 if any differs."""
    bad = [i for i, ids in enumerate(outs) if "".join(texts[i]) != vocab.reference(tail, ids)]
    if bad:
        print(f"MISMATCH: {len(bad)} of {len(outs)} streams differ from the reference decode (first: demo-{bad[0]})")
        return 1
    print(f"all {len(outs)} streams match the reference decode exactly")
    return 0


def run(
    streams: int = 64, steps: int = 400, tokenizer: str | None = None, show: bool = True,
    interval: float = STEP_INTERVAL,
) -> int:
    name = tokenizer or Config().tokenizer
    print(f"detokd demo: loading tokenizer {name} ...", file=sys.stderr)
    vocab = load(name)
    tail, outs = _streams(vocab, streams, steps)
    folder = tempfile.mkdtemp(prefix="detokd-demo-")
    cfg = ipc_config(folder, tokenizer=name, metrics_port=0)
    ctx = zmq.Context()
    worker = ctx.socket(zmq.PULL)
    worker.bind(cfg.workers[0])
    # Its own session: Ctrl-C reaches the demo, which stops the server itself.
    server = DetokdProcess(cfg, folder=folder, popen={"start_new_session": True})
    scheduler = _Scheduler(cfg.input, tail, outs, interval)
    texts: list[list[str]] = [[] for _ in outs]
    n_ids = [0] * len(outs)  # each stream's ids decoded so far (its last row's n_ids)
    done: set[int] = set()
    screen = _Screen(show)
    code = 0
    try:
        poller = zmq.Poller()
        poller.register(worker, zmq.POLLIN)
        try:
            server.start()  # returns once detokd says it is ready (READY=1)
            meter = _Meter(server)
        except NotReady as e:
            print(e, file=sys.stderr)
            return 1
        print(f"detokd serving on {cfg.input}; {len(outs)} streams of {steps} tokens", file=sys.stderr)
        decoded0, cpu0 = meter.read()
        t0 = time.monotonic()
        scheduler.start()
        while len(done) < len(outs):
            if server.returncode is not None:
                print(f"\ndetokd exited with code {server.returncode}:\n{server.log()[-3000:]}", file=sys.stderr)
                return 1
            if not poller.poll(200):
                continue
            delta0 = _take(_text.decode(worker.recv()), texts, n_ids, done)
            got, elapsed = sum(n_ids), time.monotonic() - t0
            # A rate over less than a second is one step's burst, not a rate: none yet.
            rate = f" · {got / elapsed:,.0f} tokens/s delivered" if elapsed >= 1.0 else ""
            progress = f"{len(done)} of {len(outs)} streams finished · {got:,} tokens in {elapsed:.2f} s{rate}"
            screen.update("".join(texts[0]), delta0, progress, force=len(done) == len(outs))
        wall = time.monotonic() - t0
        decoded, cpu = meter.read()
        print("\n" + _summary(len(outs), sum(n_ids), wall, interval, decoded - decoded0, cpu - cpu0))
        code = _verdict(vocab, tail, outs, texts)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping", file=sys.stderr)
        code = 130
    finally:
        scheduler.halt.set()
        try:
            server.stop(10)
        except subprocess.TimeoutExpired:
            pass  # stop() killed it
        scheduler.join(5)
        worker.close(linger=0)
        ctx.destroy(linger=0)
        shutil.rmtree(folder, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(run())
