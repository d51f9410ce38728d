"""`detokd demo`: real multilingual text streaming through a live detokd.

Three parties, as in production: `detokd serve` in its own process (started by
DetokdProcess; default config, addresses in a temporary folder), a synthetic
scheduler (SchedulerClient) replaying real text tokenized with the same tokenizer
as many concurrent streams, and a worker showing one stream live. At the end
every stream's text is checked against the reference decode (Vocab.reference).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import threading
import time

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
    """The live view: stream 0's text and a progress line, redrawn in place on a
    terminal; plain appended lines elsewhere (CI logs)."""

    def __init__(self, show: bool) -> None:
        self.show = show
        self.tty = sys.stdout.isatty()
        self.last = 0.0

    def update(self, text: str, delta: str, progress: str, force: bool = False) -> None:
        if not self.show:
            return
        now = time.monotonic()
        if self.tty:
            if force or now - self.last >= 0.1:
                lines = text.splitlines()[-14:]
                sys.stdout.write("\x1b[H\x1b[J── stream demo-0, live ──\n" + "\n".join(lines) + "\n\n" + progress + "\n")
                sys.stdout.flush()
                self.last = now
        else:
            if delta:
                sys.stdout.write(delta)
            if force or now - self.last >= 1.0:
                sys.stdout.write(f"\n[{progress}]\n")
                self.last = now
            sys.stdout.flush()


def run(streams: int = 64, steps: int = 400, tokenizer: str | None = None, show: bool = True, interval: float = STEP_INTERVAL) -> int:
    name = tokenizer or Config().tokenizer
    print(f"detokd demo: loading tokenizer {name} ...", file=sys.stderr)
    vocab = load(name)
    tail, outs = _streams(vocab, streams, steps)
    folder = tempfile.mkdtemp(prefix="detokd-demo-")
    cfg = ipc_config(folder, tokenizer=name, log_level="warning")
    ctx = zmq.Context()
    worker = ctx.socket(zmq.PULL)
    worker.bind(cfg.workers[0])
    # Its own session: Ctrl-C reaches the demo, which stops the server itself.
    server = DetokdProcess(cfg, folder=folder, popen={"start_new_session": True})
    scheduler = _Scheduler(cfg.input, tail, outs, interval)
    texts = [[] for _ in outs]
    done: set[int] = set()
    screen = _Screen(show)
    t0 = time.monotonic()
    first = None
    code = 0
    received = 0
    try:
        poller = zmq.Poller()
        poller.register(worker, zmq.POLLIN)
        try:
            server.start()  # returns once detokd says it is ready (READY=1)
        except NotReady as e:
            print(e, file=sys.stderr)
            return 1
        print(f"detokd serving on {cfg.input}; {len(outs)} streams of {steps} tokens", file=sys.stderr)
        scheduler.start()
        while len(done) < len(outs):
            if server.returncode is not None:
                print(f"\ndetokd exited with code {server.returncode}:\n{server.log()[-3000:]}", file=sys.stderr)
                return 1
            if not poller.poll(200):
                continue
            msg = _text.decode(worker.recv())
            first = first or time.monotonic()
            delta0 = ""
            for row in msg.rows:
                i = int(row.rid.split("-")[1])
                if row.error:
                    print(f"\n{row.rid}: error {row.error}", file=sys.stderr)
                    done.add(i)
                    continue
                texts[i].append(row.text)
                received += 1
                if i == 0:
                    delta0 += row.text
                if row.finish is not None:
                    done.add(i)
            elapsed = max(1e-9, time.monotonic() - first)
            progress = f"{len(outs)} streams · {len(done)} finished · {received:,} rows · {received / elapsed:,.0f} tokens/s"
            screen.update("".join(texts[0]), delta0, progress, force=len(done) == len(outs))
        wall = time.monotonic() - t0
        bad = []
        for i, ids in enumerate(outs):
            want = vocab.reference(tail, ids)
            if "".join(texts[i]) != want:
                bad.append(i)
        total = sum(len(o) for o in outs)
        print(f"\n{len(outs)} streams, {total:,} tokens in {wall:.1f}s ({total / wall:,.0f} tokens/s, paced at {1 / interval:.0f} steps/s)")
        if bad:
            print(f"MISMATCH: {len(bad)} of {len(outs)} streams differ from the reference decode (first: demo-{bad[0]})")
            code = 1
        else:
            print(f"all {len(outs)} streams match the reference decode exactly")
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
