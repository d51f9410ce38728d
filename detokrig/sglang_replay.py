"""Replay a scripted scheduler stream through an SGLang-compatible detokenizer process,
for `detokbench sglang-bench` and the SGLang tests (their own side: tests/sglang/replay.py).

- `Scripted`: one request (prompt, outputs, per-step chunking, HTTP worker, retraction),
  finished by length; the tests' subclass adds flags, stops, aborts and fake payloads.
- `build_stream`: the per-step `BatchTokenIDOutput`, made by SGLang's own scheduler-side
  builder (`Req` + `_GenerationStreamAccumulator`), not by a re-implementation of it.
- `SglangDetokenizerUnderTest`: a detokenizer (SGLang's or detokd's) started as SGLang's
  Engine starts it (N > 1: behind SGLang's MultiDetokenizerRouter), fed by a fake
  scheduler and drained by fake TokenizerManagers.

SGLang picks its IPC encoding once, at import of io_struct, from SGLANG_USE_PICKLE_IPC;
`ipc_encoding` sets the module flag and the environment (inherited by spawned children)
together. Messages must be built under the encoding they are sent with.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import json
import os
import shutil
import signal
import tempfile
import threading
import time
import zlib
from array import array
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal, Sequence

import msgspec

Encoding = Literal["pickle", "msgpack"]

# Rows whose rid starts with this end every exchange: once each receiver has seen its
# fence, everything sent before it has arrived (one PUSH per receiver keeps order).
FENCE_PREFIX = "__replay_fence__"


class Scripted(msgspec.Struct, frozen=True, kw_only=True):
    """One request as the scheduler would stream it, finished by its length. Sampling
    flags, stop tokens and strings, aborts and the payloads a model adds per token are the
    tests' (tests/sglang/replay.py's Request overrides the hooks below): the benchmark
    streams plain text."""

    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    # Tokens appended per step (speculative decoding / multi-token steps); None = 1 each.
    chunks: list[int] | None = None
    # Step of the first chunk; later chunks land on consecutive steps.
    first_step: int = 0
    http_worker: int = 0
    # Chunk index after which the scheduler retracts and later resumes the request.
    retract_after_chunk: int | None = None

    def steps(self) -> list[list[int]]:
        """The output ids appended at each of the request's steps."""
        sizes = self.chunks if self.chunks is not None else [1] * len(self.output_ids)
        if sum(sizes) != len(self.output_ids) or any(n < 1 for n in sizes):
            raise ValueError(f"{self.rid}: chunks {sizes} do not partition {len(self.output_ids)} outputs")
        ends = itertools.accumulate(sizes)
        return [self.output_ids[end - n : end] for n, end in zip(sizes, ends, strict=True)]

    def sampling(self) -> dict:
        """SamplingParams arguments beyond max_new_tokens."""
        return {}

    def req_kwargs(self) -> dict:
        """Req arguments beyond the stream's own: the payloads asked for."""
        return {}

    def started(self, req: Any) -> None:
        """The Req is made, before its first step."""

    def stepped(self, req: Any, base: int) -> None:
        """A step appended req.output_ids[base:]."""

    def finish_reason(self) -> Any:
        """What the scheduler sets on the Req at the last step."""
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH

        return FINISH_LENGTH(length=len(self.output_ids))


# --- encoding -------------------------------------------------------------------------


@contextlib.contextmanager
def ipc_encoding(encoding: Encoding) -> Iterator[None]:
    """Make SGLang's sock_send / sock_recv / wrap_as_pickle (and spawned children) use
    `encoding` for the duration."""
    from sglang.srt.managers import io_struct

    if encoding not in ("pickle", "msgpack"):
        raise ValueError(encoding)
    saved = os.environ.get("SGLANG_USE_PICKLE_IPC"), io_struct._USE_PICKLE_IPC
    os.environ["SGLANG_USE_PICKLE_IPC"] = "1" if encoding == "pickle" else "0"
    io_struct._USE_PICKLE_IPC = encoding == "pickle"
    try:
        yield
    finally:
        env, io_struct._USE_PICKLE_IPC = saved
        if env is None:
            os.environ.pop("SGLANG_USE_PICKLE_IPC", None)
        else:
            os.environ["SGLANG_USE_PICKLE_IPC"] = env


# --- builder --------------------------------------------------------------------------


def _make_req(s: Scripted, ipc: str | None, tokenizer: Any):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    sp = SamplingParams(max_new_tokens=max(len(s.output_ids), 1) + 1, **s.sampling())
    sp.normalize(tokenizer)
    req = Req(s.rid, "", array("q", s.prompt_ids), sp, stream=True, http_worker_ipc=ipc, **s.req_kwargs())
    # Req.tail_str decodes with it when holding back a stop-string prefix.
    req.tokenizer = tokenizer
    s.started(req)
    return req


def _advance(req, s: Scripted, chunk: list[int], last: bool) -> None:
    """What a decode step leaves on the Req: new ids (and their payloads, `stepped`)."""
    base = len(req.output_ids)
    req.output_ids.extend(chunk)
    s.stepped(req, base)
    if last:
        req.finished_reason = s.finish_reason()
        req.finished_len = len(req.output_ids)


def _accumulator(reqs: Sequence[Any]):
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler_components.output_streamer import _GenerationStreamAccumulator
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    # The batch-level flags of OutputStreamer._stream_output_generation, as far as the
    # installed release takes them (0.5.21 and older have no request-level customized info).
    kwargs = dict(
        return_logprob=any(r.return_logprob for r in reqs),
        return_hidden_states=any(r.return_hidden_states for r in reqs),
        return_routed_experts=any(r.return_routed_experts for r in reqs),
        return_indexer_topk=any(r.return_indexer_topk for r in reqs), spec_algorithm=SpeculativeAlgorithm.NONE,
        disaggregation_mode=DisaggregationMode.NULL, default_stream_interval=1, default_force_stream_interval=50,
        get_cached_tokens_details=lambda req: {"device": req.cached_tokens, "host": 0} if req.cached_tokens else None,
        is_request_level_customized_info_key=lambda key: False,
        current_weight_version="default",  # ServerArgs.weight_version default
    )
    takes = inspect.signature(_GenerationStreamAccumulator).parameters
    return _GenerationStreamAccumulator(**{k: v for k, v in kwargs.items() if k in takes})


def build_stream(requests: Sequence[Scripted], *, encoding: Encoding, http_worker_ipcs: Sequence[str | None] = (None,),
                 tokenizer: Any = None) -> list[Any]:
    """The BatchTokenIDOutput of every scheduler step that has something to stream.

    Each step, every request with a chunk due appends it, then SGLang's accumulator
    decides what to send (it holds back a stream whose tail is a stop-string prefix, for
    which `tokenizer` - a HF tokenizer - must be given). Rid reuse: give a later
    Scripted with the same rid a first_step after the earlier one's last step.
    """
    with ipc_encoding(encoding):
        reqs = [_make_req(s, http_worker_ipcs[s.http_worker], tokenizer) for s in requests]
        plans = [s.steps() for s in requests]
        last_step = max((s.first_step + len(p) for s, p in zip(requests, plans, strict=True)), default=0)
        out = []
        for step in range(last_step):
            batch = []
            for s, req, plan in zip(requests, reqs, plans, strict=True):
                k = step - s.first_step
                if 0 <= k < len(plan):
                    _advance(req, s, plan[k], last=k == len(plan) - 1)
                    batch.append(req)
            acc = _accumulator(batch)
            for req in batch:
                acc.accept(req=req)
            payload = acc.to_payload(dp_rank=0, is_idle_batch=False)
            if payload is not None:
                out.append(payload)
            for s, req in zip(requests, reqs, strict=True):
                if s.retract_after_chunk is not None and step - s.first_step == s.retract_after_chunk:
                    req.reset_for_retract()
        return out


def route(http_worker_ipc: str | None, rid: str, detokenizers: int) -> int:
    """The detokenizer SGLang's MultiDetokenizerRouter gives a row (its `_pick_for`): by
    the row's HTTP worker address, or by its rid when the row names none."""
    return zlib.crc32((rid if http_worker_ipc is None else http_worker_ipc).encode()) % detokenizers


def _fence_rids(tag: str, receiver: int, ipc: str | None, detokenizers: int) -> list[str]:
    """A fence rid (`tag` + a suffix) for each detokenizer that sends to this receiver: all
    of them when rows are routed by rid, the one its address picks otherwise. Every
    process's output reaches the receiver in order, so once each of its fences is in, all is."""
    wanted = {route(ipc, "", detokenizers)} if ipc is not None else set(range(detokenizers))
    rids: dict[int, str] = {}
    salt = 0
    while len(rids) < len(wanted):
        rid = f"{tag}{receiver}:{salt}"
        rids.setdefault(route(ipc, rid, detokenizers), rid)
        salt += 1
    return [rids[d] for d in sorted(wanted)]


# --- runner ---------------------------------------------------------------------------

# A weightless model: SGLang's arg resolution reads config.json from model_path; the
# tokenizer itself is loaded from tokenizer_path untouched.
MODEL_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}


def http_worker_address() -> str:
    """An HTTP worker's address as SGLang makes it (http_server.init_multi_tokenizer): a
    file tempfile reserves in the temp folder, which the worker's bind makes its socket."""
    return f"ipc://{tempfile.NamedTemporaryFile(delete=False).name}"


def remove_ipc(address: str) -> None:
    """Remove an ipc address's file (ZMQ leaves a closed socket's behind)."""
    with contextlib.suppress(OSError):
        os.unlink(address.removeprefix("ipc://"))


class DetokenizerDied(RuntimeError):
    """The detokenizer process exited, or signalled its parent (SIGQUIT) that it failed."""


# What a forkserver imports once for every detokenizer it forks (`start_method`).
FORKSERVER_PRELOAD = ["sglang.srt.managers.detokenizer_manager", "sglang.srt.managers.multi_tokenizer_mixin",
                      "detokd.sglang.process"]


def _in_environment(env: dict[str, str], fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """A forked child's start: the environment its parent had when it asked for the child
    (a forkserver holds its own), SGLang's IPC flag read from it as at import."""
    from sglang.srt.managers import io_struct

    os.environ.clear()
    os.environ.update(env)
    io_struct._USE_PICKLE_IPC = env.get("SGLANG_USE_PICKLE_IPC", "1").lower() in ("1", "true")
    return fn(*args, **kwargs)


class SglangDetokenizerUnderTest:
    """A detokenizer process (`target`, SGLang's own by default) on fresh ipc addresses,
    with a fake scheduler and fake TokenizerManager(s) around it; `detokenizers` > 1:
    that many of them behind SGLang's router. Use as a context manager; close() always
    reaps every process.

    `start_method` "forkserver" forks each process from one that imported SGLang once
    (FORKSERVER_PRELOAD): ~1 s instead of ~20 s of CPU each, where many start together.
    Their parent is then the forkserver, which a SIGQUIT from SGLang's detokenizer ends
    instead of reaching this process: use "spawn" where a test reads `sigquit`."""

    def __init__(self, tokenizer: str | os.PathLike, *, encoding: Encoding = "pickle", http_workers: int = 1,
                 detokenizers: int = 1, target: Callable | None = None,
                 start_method: Literal["spawn", "forkserver"] = "spawn"):
        self.tokenizer_dir = Path(tokenizer)
        self.encoding: Encoding = encoding
        self.http_workers = http_workers
        self.detokenizers = detokenizers
        self.target = target
        self.start_method = start_method
        self.processes: list = []  # the detokenizer(s), then SGLang's router if any
        self.sigquit = False
        self.http_worker_ipcs: list[str | None] = []
        self._root: Path | None = None
        self._ctx = None
        self._push = None
        self._pulls: list = []
        self._fences = 0
        self._old_sigquit = None

    # lifecycle

    def _ipc(self, name: str) -> str:
        return f"ipc://{self._root / name}"

    def start(self) -> "SglangDetokenizerUnderTest":
        """Spawn the process(es) (returns at once; the first exchange waits for them)."""
        import zmq
        from sglang.srt.server_args import PortArgs, ServerArgs

        try:
            self._root = Path(tempfile.mkdtemp(prefix="sglang-replay-"))
            model = self._root / "model"
            model.mkdir()
            (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
            server_args = ServerArgs(model_path=str(model), tokenizer_path=str(self.tokenizer_dir), device="cpu",
                                     tokenizer_worker_num=self.http_workers, detokenizer_worker_num=self.detokenizers,
                                     log_level="warning")
            server_args.resolve_once()  # as Engine._launch_subprocesses does before spawning
            port_args = PortArgs(
                tokenizer_ipc_name=self._ipc("tokenizer"), scheduler_input_ipc_name=self._ipc("scheduler"),
                detokenizer_ipc_name=self._ipc("detokenizer"), nccl_port=0, rpc_ipc_name=self._ipc("rpc"),
                metrics_ipc_name=self._ipc("metrics"),
                tokenizer_worker_ipc_name=None if self.http_workers == 1 else self._ipc("tokenizer_worker"),
                decoupled_spec_ipc_config=None, instance_id=self._root.name,
            )
            self._ctx = zmq.Context()
            self._ctx.linger = 0
            if self.http_workers == 1:
                # Single worker: rows carry http_worker_ipc None, output goes to tokenizer_ipc_name.
                self.http_worker_ipcs = [None]
                addresses = [port_args.tokenizer_ipc_name]
            else:
                # Made as SGLang makes them: detokd's process connects no other address.
                self.http_worker_ipcs = addresses = [http_worker_address() for _ in range(self.http_workers)]
            for address in addresses:
                self._pulls.append(self._ctx.socket(zmq.PULL))
                self._pulls[-1].bind(address)
            self._push = self._ctx.socket(zmq.PUSH)
            self._push.connect(port_args.detokenizer_ipc_name)
            if threading.current_thread() is threading.main_thread():
                # SGLang's run_detokenizer_process SIGQUITs its parent on an exception.
                self._old_sigquit = signal.signal(signal.SIGQUIT, self._on_sigquit)
            with ipc_encoding(self.encoding):  # the children inherit it before importing sglang
                self._spawn(server_args, port_args)
        except BaseException:
            self.close()
            raise
        return self

    def _spawn(self, server_args: Any, port_args: Any) -> None:
        """What Engine._launch_detokenizer_subprocesses starts: the detokenizer on SGLang's
        address, or N of them on their own addresses and SGLang's router on SGLang's."""
        import multiprocessing as mp

        from sglang.srt.managers.detokenizer_manager import run_detokenizer_process

        target = self.target or run_detokenizer_process
        context = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            context.set_forkserver_preload(FORKSERVER_PRELOAD)  # read when the forkserver starts

        def start(name: str, fn: Callable, args: tuple, kwargs: dict | None = None) -> None:
            if self.start_method == "forkserver":
                fn, args = _in_environment, (dict(os.environ), fn, *args)
            proc = context.Process(target=fn, name=name, args=args, kwargs=kwargs or {}, daemon=True)
            proc.start()
            self.processes.append(proc)

        if self.detokenizers == 1:
            start("detokenizer", target, (server_args, port_args))
            return
        from sglang.srt.managers.multi_tokenizer_mixin import run_multi_detokenizer_router_process

        own = [self._ipc(f"detokenizer_{i}") for i in range(self.detokenizers)]
        for i, address in enumerate(own):
            start(f"detokenizer_{i}", target, (server_args, replace(port_args, detokenizer_ipc_name=address)))
        # enable_metrics is 0.5.21's and newer.
        takes = inspect.signature(run_multi_detokenizer_router_process).parameters
        start("detokenizer_router", run_multi_detokenizer_router_process, (own, server_args, port_args),
              {"enable_metrics": False} if "enable_metrics" in takes else {})

    def _on_sigquit(self, signum, frame) -> None:
        self.sigquit = True

    def close(self) -> None:
        for proc in self.processes:
            if proc.is_alive():
                proc.terminate()
        for proc in self.processes:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.processes = []
        if self._ctx is not None:
            self._ctx.destroy()  # closes its sockets, which linger 0
        self._ctx, self._push, self._pulls = None, None, []
        if self._old_sigquit is not None:
            signal.signal(signal.SIGQUIT, self._old_sigquit)
            self._old_sigquit = None
        for address in self.http_worker_ipcs:
            if address is not None:
                remove_ipc(address)
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def __enter__(self) -> "SglangDetokenizerUnderTest":
        return self if self.processes else self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # traffic

    def send(self, messages: Iterable[Any]) -> None:
        """Send `messages` as SGLang's scheduler does (sock_send), and no fence."""
        from sglang.srt.managers.io_struct import sock_send

        with ipc_encoding(self.encoding):
            for m in messages:
                sock_send(self._push, m)

    def exchange(self, messages: Iterable[Any], *, timeout: float = 180.0) -> list[list[Any]]:
        """Send `messages` then a fence; return, per receiver (HTTP worker), every output
        that arrived before its fences, in arrival order, fence rows removed."""
        import zmq
        from sglang.srt.managers.io_struct import sock_recv

        self._fences += 1
        tag = f"{FENCE_PREFIX}{self._fences}:"
        ipcs = self.http_worker_ipcs
        # Finished one-token rows: for each receiver, one per detokenizer that sends to it.
        fence_rids = [_fence_rids(tag, i, ipc, self.detokenizers) for i, ipc in enumerate(ipcs)]
        fence_rows = [Scripted(rid=r, prompt_ids=[1], output_ids=[1], http_worker=i)
                      for i, mine in enumerate(fence_rids) for r in mine]
        (fence,) = build_stream(fence_rows, encoding=self.encoding, http_worker_ipcs=ipcs)
        due = list(map(len, fence_rids))  # fence rows each receiver waits for
        got: list[list[Any]] = [[] for _ in self._pulls]
        poller = zmq.Poller()
        for sock in self._pulls:
            poller.register(sock, zmq.POLLIN)
        self.send([*messages, fence])
        with ipc_encoding(self.encoding):
            deadline = time.monotonic() + timeout
            while any(due):
                self._check_alive()
                left = deadline - time.monotonic()
                if left <= 0:
                    pending = [i for i, n in enumerate(due) if n]
                    raise TimeoutError(f"no fence from receivers {pending} within {timeout}s")
                for sock, _ in poller.poll(min(left, 0.5) * 1000):
                    i = self._pulls.index(sock)
                    out = sock_recv(sock, zmq.NOBLOCK)
                    rids = list(getattr(out, "rids", None) or [])
                    fences = [r for r in rids if isinstance(r, str) and r.startswith(FENCE_PREFIX)]
                    if not fences:
                        got[i].append(out)
                    elif len(fences) != len(rids):
                        raise AssertionError(f"fence rows mixed into an output: {rids}")
                    elif any(not r.startswith(tag) for r in fences):
                        raise AssertionError(f"stale fence {fences}")
                    else:
                        due[i] -= len(fences)
        return got

    def _check_alive(self) -> None:
        if self.sigquit:
            raise DetokenizerDied("the detokenizer signalled SIGQUIT (it hit an exception; see its log)")
        for proc in self.processes:
            if not proc.is_alive():
                raise DetokenizerDied(f"{proc.name} exited with code {proc.exitcode}")


def append_output_logprobs(lp: Any, tokens: Sequence[int], start: int) -> None:
    """Deterministic output logprobs of the shapes SGLang's streamer sends, for `tokens`
    at output positions start, start + 1, ...: the TokenizerManager reads them from the
    fields a detokenizer forwards."""
    for k, tok in enumerate(tokens):
        pos = start + k
        lp.output_token_logprobs_val.append(-(pos + 1) / 8)
        lp.output_token_logprobs_idx.append(tok)
        lp.output_top_logprobs_val.append([-(pos + 1) / 8, -4.0])
        lp.output_top_logprobs_idx.append([tok, 0])
        lp.output_token_ids_logprobs_val.append(None)
        lp.output_token_ids_logprobs_idx.append(None)
