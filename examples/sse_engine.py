"""A fake engine around a real detokd, serving OpenAI-style server-sent events.

    python examples/sse_engine.py --port 8000
    curl -N -d '{"prompt": "hi", "stream": true}' http://127.0.0.1:8000/v1/completions

Three parts, as in a real deployment, here in one process except detokd:

- detokd itself: `detokd serve`, a subprocess started by detokd.process.DetokdProcess,
  on ipc:// sockets in a temp dir;
- a fake scheduler (SchedulerClient): "generates" each reply by tokenizing a fixed
  text (the prompt echoed, then a multilingual paragraph) with the same tokenizer
  detokd serves, and sends the ids a few per step, like an engine's decode loop;
  the request's OpenAI `stop` strings go to detokd, which watches for them, and a
  request detokd stopped (its `stopped` row, on the feedback socket) stops generating;
- a tokenizer worker (WorkerClient): an HTTP server, standard library only, that
  streams each request's text deltas as `data: {...}` events, then `data: [DONE]`.

Ctrl-C (SIGINT) or SIGTERM stops everything, detokd included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from detokd import zoo
from detokd.client import DetokdError, SchedulerClient, WorkerClient, run
from detokd.launch import die_with_parent
from detokd.process import DetokdProcess, NotReady, ipc_config
from detokd.wire.native import Finish

log = logging.getLogger("sse_engine")

TOKENIZER = "deepseek"  # detokd's default; the scheduler must tokenize with the same one
PROMPT_TAIL = 8  # prompt ids sent as context for the first output characters
MAX_BODY = 1 << 20

PARAGRAPH = (
    "Streaming text must never split a character: 日本語のテキスト, 中文文本, "
    "한국어 문장, русский текст, العربية, עברית, हिन्दी, ελληνικά, and emoji 🙂🚀👩‍💻 "
    "arrive whole, one delta at a time. Ça marche très bien, naïve café — ¿verdad? ¡Sí!"
)


def reply_for(prompt: str) -> str:
    """What the fake model "generates" for a prompt (the test computes the same)."""
    return f"You said: {prompt}\n\n{PARAGRAPH}"


# --------------------------------------------------------------------------- scheduler


@dataclass
class _Gen:
    rid: str
    ids: list[int]  # the whole reply, known up front: this model is fake
    prompt_tail: list[int]
    finish: Finish
    stop: list[str]
    sent: int = 0


@dataclass
class FakeScheduler:
    """An engine's decode loop without the model: each step, every running request
    yields 1..max_per_step new ids, and one `tokens` message per shard leaves."""

    client: SchedulerClient
    tokenizer: object  # tokenizers.Tokenizer
    step: float = 0.02
    max_per_step: int = 4
    rng: random.Random = field(default_factory=random.Random)
    running: dict[str, _Gen] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def submit(self, rid: str, prompt: str, max_tokens: int | None = None, stop: list[str] = ()) -> list[int]:
        enc = self.tokenizer.encode
        ids = enc(reply_for(prompt), add_special_tokens=False).ids
        eos = self.tokenizer.token_to_id("<｜end▁of▁sentence｜>")
        if max_tokens is not None and max_tokens < len(ids) + 1:
            ids, finish = ids[:max(max_tokens, 0)], Finish("length")
        else:
            # Like a real model: the reply ends with the EOS token, the stop token that
            # finished it (matched is an int: detokd does not render it).
            ids, finish = ids + [eos], Finish("stop", eos)
        tail = enc(prompt, add_special_tokens=False).ids[-PROMPT_TAIL:]
        self.running[rid] = _Gen(rid, ids, tail, finish, list(stop))
        self.wake.set()
        return ids

    def cancel(self, rid: str) -> None:
        if self.running.pop(rid, None) is not None:
            self.client.abort([rid])

    async def run(self) -> None:
        c = self.client
        while True:
            if not self.running:
                self.wake.clear()
                await self.wake.wait()
            for row in c.stopped():  # the client queued each one's finishing row
                g = self.running.pop(row.rid, None)
                if g is not None:
                    log.info("%s: detokd found stop %r; generation stopped after %d of %d ids",
                             row.rid, row.matched, g.sent, len(g.ids))
            for g in list(self.running.values()):
                new = g.ids[g.sent : g.sent + self.rng.randint(1, self.max_per_step)]
                done = g.sent + len(new) >= len(g.ids)
                fin = g.finish if done else None
                if g.sent == 0:
                    c.begin(g.rid, new, prompt_tail=g.prompt_tail, stop=g.stop, finish=fin)
                else:
                    c.add(g.rid, new, finish=fin)
                g.sent += len(new)
                if done:
                    del self.running[g.rid]
            c.flush()  # one message per detokd shard per step
            await asyncio.sleep(self.step)


# --------------------------------------------------------------------------- HTTP worker


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            411: "Length Required", 413: "Payload Too Large", 502: "Bad Gateway"}


async def _read_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[str, str, bytes]:
    """A minimal HTTP/1.1 request: request line, headers, Content-Length body."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError as e:
        raise HttpError(400, "headers too large") from e
    lines = head.decode("latin-1").split("\r\n")
    try:
        method, target, _version = lines[0].split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ln)}
    except ValueError as e:
        raise HttpError(400, "malformed request") from e
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise HttpError(411, "send a Content-Length body")
    try:
        n = int(headers.get("content-length", "0"))
    except ValueError as e:
        raise HttpError(400, "bad Content-Length") from e
    if n > MAX_BODY:
        raise HttpError(413, "body too large")
    if n and headers.get("expect", "").lower() == "100-continue":  # curl, for bodies > 1 KiB
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    body = await reader.readexactly(n) if n else b""
    return method, target.split("?", 1)[0], body


def _response(status: int, body: bytes, ctype: str = "application/json") -> bytes:
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\nContent-Type: {ctype}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class App:
    def __init__(self, worker: WorkerClient, scheduler: FakeScheduler, model: str) -> None:
        self.worker = worker
        self.scheduler = scheduler
        self.model = model
        self.handlers: set[asyncio.Task] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            try:
                method, path, body = await _read_request(reader, writer)
                if path == "/health":
                    writer.write(_response(200, b'{"status":"ok"}'))
                elif path != "/v1/completions":
                    raise HttpError(404, f"no route {path}")
                elif method != "POST":
                    raise HttpError(405, "POST only")
                else:
                    await self.completions(body, writer)
            except HttpError as e:
                writer.write(_response(e.status, json.dumps({"error": {"message": str(e)}}).encode()))
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away
        except asyncio.CancelledError:
            pass  # shutdown; ending quietly spares asyncio's "exception in callback" noise
        finally:
            self.handlers.discard(task)
            writer.close()

    async def shutdown(self) -> None:
        """End open requests (each aborts its rid) while the scheduler still runs."""
        for t in list(self.handlers):
            t.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)

    async def completions(self, body: bytes, writer: asyncio.StreamWriter) -> None:
        try:
            req = json.loads(body or b"{}")
            prompt = req.get("prompt", "")
            if isinstance(prompt, list):  # OpenAI allows a list of one prompt
                prompt = prompt[0] if prompt else ""
            if not isinstance(prompt, str):
                raise TypeError("prompt must be a string")
            max_tokens = req.get("max_tokens")
            if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)):
                raise TypeError("max_tokens must be an integer")
            stop = req.get("stop") or []
            stop = [stop] if isinstance(stop, str) else stop
            if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(x, str) and x for x in stop):
                raise TypeError("stop must be a string or a list of at most 4 non-empty strings")
        except (ValueError, TypeError, AttributeError) as e:
            raise HttpError(400, f"bad request body: {e}") from e
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        # Open the stream before the scheduler can send anything for this rid.
        stream = self.worker.stream(rid)
        self.scheduler.submit(rid, prompt, max_tokens, stop)

        def chunk(text: str, reason: str | None) -> dict:
            return {
                "id": rid, "object": "text_completion", "created": created, "model": self.model,
                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": reason}],
            }

        try:
            if not req.get("stream", False):
                try:
                    text = await stream.text()
                except DetokdError as e:
                    raise HttpError(502, f"detokenizer: {e.error}") from e
                out = chunk(text, stream.finish.reason if stream.finish else None)
                writer.write(_response(200, json.dumps(out, ensure_ascii=False).encode()))
                return
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Cache-Control: no-cache\r\nConnection: close\r\n\r\n"
            )
            try:
                async for delta in stream:
                    writer.write(_event(chunk(delta, None)))
                    await writer.drain()  # backpressure, and notice a client that left
                writer.write(_event(chunk("", stream.finish.reason if stream.finish else None)))
            except DetokdError as e:
                writer.write(_event({"error": {"message": f"detokenizer: {e.error}", "type": "server_error"}}))
            writer.write(b"data: [DONE]\n\n")
            await writer.drain()
        finally:
            if not stream.done:  # the client left (or we failed): stop generating
                stream.close()
                self.scheduler.cancel(rid)


# --------------------------------------------------------------------------- main


async def amain(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="detokd-sse-"))
    cfg = ipc_config(tmp, tokenizer=TOKENIZER, feedback=True)
    inp, wad = cfg.input, cfg.workers[0]
    # Own process group: a terminal's Ctrl-C reaches detokd through us, once. And it
    # dies with us, even if we are SIGKILLed.
    detokd = DetokdProcess(cfg, folder=tmp, popen={"process_group": 0, "preexec_fn": die_with_parent}).spawn()
    print(f"detokd pid {detokd.pid}", flush=True)
    scheduler_client = SchedulerClient(inp, feedback=cfg.feedback)  # binds it: detokd connects
    worker = WorkerClient(wad)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(zoo.build(TOKENIZER) / "tokenizer.json"))
    scheduler = FakeScheduler(scheduler_client, tok, step=args.step_ms / 1000, rng=random.Random(args.seed))
    app = App(worker, scheduler, model=TOKENIZER)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    status = 0

    async def watch_detokd() -> None:
        nonlocal status
        while detokd.returncode is None:
            await asyncio.sleep(0.2)
        log.error("detokd exited with %s:\n%s", detokd.returncode, detokd.log()[-3000:])
        status = 1
        stop.set()

    def crashed(t: asyncio.Task) -> None:
        nonlocal status
        if not t.cancelled() and t.exception() is not None:
            log.error("%s failed", t.get_name(), exc_info=t.exception())
            status = 1
            stop.set()

    tasks = [
        asyncio.create_task(scheduler.run(), name="scheduler"),
        asyncio.create_task(watch_detokd(), name="detokd watcher"),
    ]
    for t in tasks:
        t.add_done_callback(crashed)
    server = await asyncio.start_server(app.handle, args.host, args.port)
    try:
        await worker.start()
        try:
            await asyncio.to_thread(detokd.wait_ready)  # serve only once detokd does (READY=1)
        except NotReady as e:
            log.error("%s", e)
            return 1
        port = server.sockets[0].getsockname()[1]
        print(f"serving on http://{args.host}:{port}/v1/completions", flush=True)
        await stop.wait()
        log.info("stopping")
    finally:
        server.close()
        await app.shutdown()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await worker.aclose()  # open streams end with WorkerClosed
        scheduler_client.close(linger=0)
        try:
            await asyncio.to_thread(detokd.stop, 10)
        except subprocess.TimeoutExpired:
            log.error("detokd did not stop within 10 s: killed it")
            status = 1
        shutil.rmtree(tmp, ignore_errors=True)
    return status


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    ap.add_argument("--step-ms", type=float, default=20.0, help="the fake model's time per step")
    ap.add_argument("--seed", type=int, default=None, help="seed for how many ids each step yields")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
