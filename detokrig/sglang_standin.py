"""A stand-in for SGLang's scheduler process: SGLang's front end and detokenizer, no model.

`run_standin_scheduler` has the signature of sglang's `run_scheduler_process`, so
`launch_server(server_args, run_scheduler_process_func=run_standin_scheduler)` starts it
through SGLang's own launch path. It speaks the scheduler's side of SGLang's IPC: it
reports ready through the pipe as the real scheduler does, PULLs what the
TokenizerManager sends, and streams to the detokenizer through SGLang's own output code.
What it does not have is a model: each request's output ids are a reply chosen by its
prompt (`reply_ids`), emitted a few per step. Everything between the ids and the client
is SGLang's own: `Req` (max_new_tokens, stop strings and their hold-back, stop token ids,
eos, `to_finish` for aborts) and `SchedulerOutputStreamer` (what goes out at each step).

Each finished request is recorded as one JSON line in $STANDIN_LOG (rid, the ids the
detokenizer decodes them in, how many of them came before the finishing row, the finish,
the sampling fields it got, when it was admitted and finished): the oracle's input.

With SGLANG_RUST_SERVER=1 the stand-in hosts SGLang's Rust server as the real scheduler
does (`Scheduler.maybe_init_rust_server`: `RustServer.launch` with the stand-in as the
scheduler), drains its request ring instead of the zmq socket and pushes each step
through it (`SchedulerOutputStreamer` with `rust_server` set: `push_generation`); control
requests and health probes are answered through it as the scheduler answers them.
$STANDIN_STEP_MS paces the steps on a fixed clock (one every that many ms while requests
run, or back to back when a step takes longer), as an engine's forward passes would.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from typing import Any

from detokrig.sglang_replay import append_output_logprobs

logger = logging.getLogger(__name__)
# One step every STEP_S while requests run: slow enough that a stream has many rows,
# fast enough that ~30 requests of ~60 ids end in seconds.
STEP_S = 0.004
LOG_ENV = "STANDIN_LOG"
STEP_MS_ENV = "STANDIN_STEP_MS"

# Replies in many scripts; the prompt picks one with "[reply K]" and its ids per step
# with "[step N]". A reply ends with eos; past it (ignore_eos) it starts over.
REPLIES = [
    "Hello, world! 世界你好 🤖🎉👍🏽 Привет, мир! مرحبا بالعالم. Done.",
    "Emoji: 👨\u200d👩\u200d👧 family and more, then the answer is 42. END of story.",
    "古文 𠀀𪚥 龘靐齉爩，服务器在高并发下稳定运行。The server stays up.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю. STOP here.",
    "def f(x):\n    return x * 2  # ½ ∑ ∫ → ≠ ≤ ≥\n\n\tTabs and  double  spaces.",
]
# Reply 1 carries a special token in its middle (rendered or skipped per request).
SPECIAL_IN = 1


def tag(text: str, name: str, default: int) -> int:
    m = re.search(rf"\[{name} (\d+)\]", text)
    return int(m.group(1)) if m else default


def case_of(text: str) -> str | None:
    """The "[case NAME]" a client put in its prompt: how a record is found when the
    front end did not pass the client's rid on."""
    m = re.search(r"\[case ([\w.-]+)\]", text)
    return m.group(1) if m else None


def reply_ids(tokenizer: Any, prompt_ids: list[int]) -> list[int]:
    """The ids the model would answer `prompt_ids` with, one cycle of them."""
    prompt = tokenizer.decode(prompt_ids)
    k = tag(prompt, "reply", 0) % len(REPLIES)
    ids = tokenizer.encode(REPLIES[k], add_special_tokens=False)
    others = [i for i, t in sorted(tokenizer.added_tokens_decoder.items()) if t.special and i != tokenizer.eos_token_id]
    if k == SPECIAL_IN and others:
        ids = ids[: len(ids) // 2] + [others[0]] + ids[len(ids) // 2 :]
    return ids + [tokenizer.eos_token_id]


class Standin:
    """The scheduler's loop, minus the model."""

    def __init__(self, server_args: Any, port_args: Any):
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.managers.scheduler_components.ipc_channels import SchedulerIpcChannels
        from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
        from sglang.srt.runtime_context import get_model, get_serving
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        from sglang.srt.utils.hf_transformers_utils import get_tokenizer

        self.model_config = ModelConfig.from_server_args(server_args)
        # The tokenizer as Scheduler.init_tokenizer loads it (Req.tail_str decodes with it).
        self.tokenizer = get_tokenizer(
            get_serving().tokenizer_path,
            tokenizer_mode=get_serving().tokenizer_mode,
            trust_remote_code=get_model().trust_remote_code,
            revision=get_model().revision,
            tokenizer_backend=get_serving().tokenizer_backend,
        )
        self.channels = SchedulerIpcChannels.create(
            port_args=port_args, is_rank_zero=True, skip_tokenizer_init=False,
            metrics_enabled=False, enable_scripted_runtime=False,
        )
        kwargs = dict(
            send_to_detokenizer=self.channels.send_to_detokenizer, tree_cache=None, server_args=server_args,
            is_generation=True, spec_algorithm=SpeculativeAlgorithm.NONE,
            disaggregation_mode=DisaggregationMode.NULL, enable_hicache_storage=lambda: False,
        )
        if "ps" in getattr(SchedulerOutputStreamer, "__dataclass_fields__", {}):  # 0.5.20: the ranks as a field of its own
            from sglang.srt.distributed.parallel_state_wrapper import ParallelState

            kwargs["ps"] = ParallelState.trivial()
        self.streamer = SchedulerOutputStreamer(**kwargs)
        self.max_req_len = self.model_config.context_len
        self.running: dict[str, Any] = {}
        self.replies: dict[str, tuple[list[int], int, int | None]] = {}  # ids, per step, abort after
        self.cases: dict[str, str | None] = {}
        self.admitted: dict[str, float] = {}  # time.monotonic(), a clock every process on the host shares
        path = os.environ.get(LOG_ENV)
        self.log = open(path, "a", buffering=1) if path else None
        step_ms = os.environ.get(STEP_MS_ENV)
        self.interval = float(step_ms) / 1000 if step_ms else None
        self.rust_server = None
        self.server_args, self.port_args = server_args, port_args
        from sglang.srt.environ import envs

        if getattr(envs, "SGLANG_RUST_SERVER", None) is not None and envs.SGLANG_RUST_SERVER.get():
            self._host_rust_server()

    def _host_rust_server(self) -> None:
        """What Scheduler.__init__ sets up before `maybe_init_rust_server`, which then
        runs as SGLang's own code with the stand-in as `self`: RustServer.launch reads
        the model config, the tokenizer, the KV-events publisher, the load-snapshot
        writer and the token budget from its scheduler."""
        import types
        from collections import deque

        from sglang.srt.managers.load_snapshot import create_load_snapshot_writer
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.managers.scheduler_components.kv_events_publisher import SchedulerKvEventsPublisher
        from sglang.srt.runtime_context import get_observability, get_parallel, get_schedule

        info = self.init_info()
        self.page_size = get_schedule().page_size
        self.max_total_num_tokens = info["max_total_num_tokens"]
        self.max_req_input_len = info["max_req_input_len"]
        self.kv_events_publisher = SchedulerKvEventsPublisher(
            kv_events_config=get_observability().kv_events_config, tree_cache=None,
            send_metrics_from_scheduler=None, max_running_requests=get_schedule().max_running_requests or 0,
            max_total_num_tokens=self.max_total_num_tokens, get_stats=lambda: None,
        )
        try:
            self.load_snapshot_writer = create_load_snapshot_writer(
                self.port_args, get_parallel().num_dp_ranks, get_parallel().dp_rank or 0,
                publish_interval=get_observability().load_snapshot_publish_interval,
            )
        except Exception:  # the scheduler logs it and serves without (/v1/loads)
            self.load_snapshot_writer = None
        self._engine_paused = False
        self.return_health_check_ipcs: deque = deque()
        for name in ("_hosts_rust_server", "get_rust_server_class", "rust_server_tokenizer_path",
                     "maybe_init_rust_server", "send_control_output", "maybe_send_health_check_signal"):
            setattr(self, name, types.MethodType(getattr(Scheduler, name), self))
        self.maybe_init_rust_server()
        self.streamer.rust_server = self.rust_server

    def init_info(self) -> dict:
        """What Scheduler.get_init_info reports."""
        return {"status": "ready", "max_total_num_tokens": 1 << 20, "max_req_input_len": self.max_req_len - 1,
                "startup_time": None, "hicache_object_layout": None}

    def receive(self) -> list:
        """What the TokenizerManager (or the Rust server's ring) has sent, without waiting."""
        if self.rust_server is not None:
            from sglang.srt.environ import envs

            return self.rust_server.drain(envs.SGLANG_SCHEDULER_MAX_RECV_PER_POLL.get())
        import zmq
        from sglang.srt.managers.io_struct import sock_recv

        out = []
        while True:
            try:
                out.append(sock_recv(self.channels.recv_from_tokenizer, zmq.NOBLOCK))
            except zmq.ZMQError:
                return out

    def idle_wait(self) -> None:
        if self.rust_server is not None:
            self.idle_sleeper.maybe_sleep()
        else:
            self.channels.recv_from_tokenizer.poll(100)

    def serve_forever(self) -> None:
        next_step = 0.0
        while True:
            if not self.running:
                self.idle_wait()
            for msg in self.receive():
                self.handle(msg)
            if self.rust_server is not None:
                self.maybe_send_health_check_signal()
            if not self.running:
                continue
            if self.interval is None:
                self.step()
                time.sleep(STEP_S)
                continue
            wait = next_step - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            next_step = max(next_step, time.monotonic() - self.interval) + self.interval
            self.step()

    def handle(self, msg: Any) -> None:
        from sglang.srt.managers import io_struct as io
        from sglang.srt.managers.schedule_batch import FINISH_ABORT
        from sglang.srt.managers.utils import is_health_check_generate_req

        if isinstance(msg, io.TokenizedGenerateReqInput):
            if self.rust_server is not None and is_health_check_generate_req(msg) and self.running:
                # Scheduler.process_input_requests: a probe while busy is answered by the
                # running requests' progress (maybe_send_health_check_signal).
                self.return_health_check_ipcs.append(getattr(msg, "http_worker_ipc", None))
                return
            msg.unwrap_pickle_fields()
            self.admit(msg)
        elif isinstance(msg, io.AbortReq):
            # The real scheduler's "abort method 3": the running request finishes at its next step.
            for rid, req in self.running.items():
                if msg.abort_all or rid.startswith(msg.rid):
                    req.to_finish = FINISH_ABORT(msg.abort_message) if msg.abort_message else FINISH_ABORT()
        elif isinstance(msg, getattr(io, "GetInternalStateReq", ())):  # /server_info
            self.send_control_output(self.internal_state(), msg)
        elif isinstance(msg, getattr(io, "FlushCacheReqInput", ())):
            self.send_control_output(io.FlushCacheReqOutput(success=True), msg)
        else:
            logger.warning("the stand-in scheduler does not answer %s", type(msg).__name__)

    def send_control_output(self, output: Any, recv_req: Any) -> None:
        """Scheduler.send_control_output over the zmq socket (with the Rust server,
        the scheduler's own method replaces this one)."""
        self.channels.send_to_tokenizer.send_output(output, recv_req)

    @staticmethod
    def internal_state() -> Any:
        """/server_info's internal state: the resolved server args, as the scheduler's
        InternalState reports them (no memory or speculative figures: no model)."""
        from sglang.srt.managers.io_struct import GetInternalStateReqOutput
        from sglang.srt.runtime_context import get_context
        from sglang.srt.utils.msgspec_utils import msgspec_to_builtins

        state = get_context().resolved_server_args_dict()
        state.pop("custom_sigquit_handler", None)
        return GetInternalStateReqOutput(internal_state=msgspec_to_builtins(state))

    def admit(self, recv: Any) -> None:
        from sglang.srt.managers.schedule_batch import Req

        req = Req(
            recv.rid, recv.input_text, recv.input_ids, recv.sampling_params,
            return_logprob=recv.return_logprob, top_logprobs_num=recv.top_logprobs_num,
            token_ids_logprob=recv.token_ids_logprob, stream=recv.stream,
            eos_token_ids=self.model_config.hf_eos_token_id, vocab_size=self.model_config.vocab_size,
            http_worker_ipc=recv.http_worker_ipc, time_stats=recv.time_stats,
        )
        req.tokenizer = self.tokenizer
        sp = req.sampling_params
        # Scheduler.init_req_max_new_tokens without the KV-memory bound a stand-in lacks.
        sp.max_new_tokens = max(0, min(sp.max_new_tokens if sp.max_new_tokens is not None else 1 << 30,
                                       self.max_req_len - len(req.origin_input_ids) - 1))
        if req.return_logprob:
            self._init_logprobs(req)
        prompt = list(recv.input_ids)
        text = self.tokenizer.decode(prompt)
        abort_after = tag(text, "abort", -1)
        self.replies[req.rid] = (reply_ids(self.tokenizer, prompt), tag(text, "step", 1),
                                 None if abort_after < 0 else abort_after)
        self.cases[req.rid] = case_of(text)
        self.admitted[req.rid] = time.monotonic()
        self.running[req.rid] = req

    def step(self) -> None:
        """One decode step: each running request gets its next ids, SGLang's Req decides
        whether it finished, SGLang's streamer decides what goes to the detokenizer."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        reqs = list(self.running.values())
        for req in reqs:
            if req.finished() or req.to_finish:
                req.update_finish_state()
                continue
            reply, per_step, abort_after = self.replies[req.rid]
            start = len(req.output_ids)
            if abort_after is not None and start >= abort_after:
                # "[abort N]": the engine ends the request after N ids, as the real
                # scheduler's aborts do (to_finish, sent at the next step).
                req.to_finish = FINISH_ABORT("the stand-in aborts it ([abort N])")
                req.update_finish_state()
                continue
            new = [reply[(start + j) % len(reply)] for j in range(per_step)]
            req.output_ids.extend(new)
            if req.return_logprob:
                append_output_logprobs(req.logprob, new, start)
            req.update_finish_state(len(new))
        sent = {req.rid: req.send_token_offset for req in reqs}  # output ids in the rows before this step's
        self.streamer.stream_output(reqs, any(r.return_logprob for r in reqs))
        for req in reqs:
            if req.finished():
                del self.running[req.rid]
                del self.replies[req.rid]
                self._record(req, sent[req.rid], self.cases.pop(req.rid), self.admitted.pop(req.rid))

    def _record(self, req: Any, earlier: int, case: str | None, admitted: float) -> None:
        if self.log is None:
            return
        if req.read_offset is None:
            # The Rust server's stream carries no decode offsets (rust_server_mode):
            # the context is what SGLang's scheduler would have sent, by its own code.
            req.init_incremental_detokenize()
        ctx = list(req.origin_input_ids_unpadded[req.surr_offset : req.read_offset])
        sp = req.sampling_params
        self.log.write(json.dumps({
            "rid": req.rid, "case": case, "context": ctx, "output_ids": list(req.output_ids_through_stop),
            "earlier": earlier,
            "finish": req.finished_reason.to_json(), "prompt_tokens": len(req.origin_input_ids),
            "skip_special_tokens": sp.skip_special_tokens,
            "spaces_between_special_tokens": sp.spaces_between_special_tokens,
            "no_stop_trim": sp.no_stop_trim, "ignore_eos": sp.ignore_eos, "stop": list(getattr(sp, "stop_strs", None) or []),
            "stop_token_ids": sorted(sp.stop_token_ids or []),
            "admitted": admitted, "finished": time.monotonic(),
        }) + "\n")

    # Deterministic logprobs of the right shapes: the TokenizerManager reads them from
    # the fields the detokenizer forwards.
    @staticmethod
    def _init_logprobs(req: Any) -> None:
        lp = req.logprob
        n = len(req.origin_input_ids)
        lp.input_token_logprobs_val = [None] + [-(i + 1) / 16 for i in range(n - 1)]
        lp.input_token_logprobs_idx = list(req.origin_input_ids)
        lp.input_top_logprobs_val = [None] + [[-0.5, -1.5] for _ in range(n - 1)]
        lp.input_top_logprobs_idx = [None] + [[t, 0] for t in list(req.origin_input_ids)[1:]]
        lp.input_token_ids_logprobs_val = [None] * n
        lp.input_token_ids_logprobs_idx = [None] * n
        for name in ("val", "idx"):
            for kind in ("token", "top", "token_ids"):
                setattr(lp, f"output_{kind}_logprobs_{name}", [])


def run_standin_scheduler(server_args, port_args, gpu_id, tp_rank, *rest, **__):
    """sglang's run_scheduler_process, with the Standin as the Scheduler. Its arguments
    after tp_rank end in pp_rank, dp_rank, pipe_writer (0.5.20 has attn_cp_rank,
    moe_dp_rank and moe_ep_rank before them): the pipe is the first one that sends."""
    at = next(i for i, arg in enumerate(rest) if hasattr(arg, "send"))
    pp_rank, dp_rank, pipe_writer = rest[at - 2], rest[at - 1], rest[at]
    import signal

    import psutil
    import setproctitle
    from sglang.srt import runtime_context as rc
    from sglang.srt.plugins import load_plugins
    from sglang.srt.utils.common import configure_logger

    load_plugins()
    if hasattr(rc, "SpawnRanks"):  # 0.5.21 and newer publish the scheduler's ranks
        rc.publish(server_args, role="scheduler", ranks=rc.SpawnRanks(
            world_rank=rc.spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=pp_rank), dp_rank=dp_rank,
            gpu_id=gpu_id))
    else:
        rc.publish(server_args, role="scheduler")
    # As configure_scheduler_process names and logs the scheduler (the Rust server logs here).
    setproctitle.setproctitle("sglang::scheduler")
    configure_logger(server_args)
    parent = psutil.Process().parent()
    try:
        standin = Standin(server_args, port_args)
        pipe_writer.send(standin.init_info())
        standin.serve_forever()
    except Exception:
        import traceback

        traceback.print_exc()
        parent.send_signal(signal.SIGQUIT)
