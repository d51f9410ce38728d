"""A fresh SGLang process for the plugin tests (plugin state is process-global).

usage: sglang_child.py loader [mismatch]       -> load_plugins(); is the launch method replaced?
       sglang_child.py launch ORACLE ARGS...   -> SGLang's server args from its own command-line
           parser (ARGS as after `python -m sglang.launch_server`), then launch the detokenizer
           through SGLang's launch function, talk to it, kill detokd's decoding process (if
           detokd's) and talk again, kill the process SGLang started, watch SGLang see it.
           ORACLE is the tokenizer folder whose decode the answers must equal.
       sglang_child.py orphan ORACLE ARGS...   -> talk to it, then die without a word.
Prints one JSON line; the warnings SGLang's plugin logger got are in it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import warnings

warnings.simplefilter("ignore")


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelname, record.getMessage()))


def capture() -> Captured:
    h = Captured()
    log = logging.getLogger("sglang.srt.plugins")
    log.addHandler(h)
    log.setLevel(logging.INFO)
    return h


def loader(mismatch: bool) -> dict:
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.managers import io_struct
    from sglang.srt.plugins import load_plugins

    if mismatch:
        # A modified copy in this process only: SGLang's BatchStrOutput minus time_stats.
        from detokd.sglang.schema import declared_annotations

        declared = declared_annotations(io_struct.BatchStrOutput)  # kept: only the field goes
        fields = [(n, declared[n]) for n in io_struct.BatchStrOutput.__struct_fields__ if n != "time_stats"]
        io_struct.BatchStrOutput = dataclasses.make_dataclass("BatchStrOutput", fields)
    before = Engine.__dict__["_launch_detokenizer_subprocesses"].__func__
    logs = capture()
    load_plugins()
    after = Engine.__dict__["_launch_detokenizer_subprocesses"].__func__
    return {"replaced": after is not before, "wraps_original": getattr(after, "__wrapped__", None) is before,
            "logs": logs.records}


def launch(oracle_dir: str, argv: list[str], orphan: bool = False) -> dict:

    from sglang.srt.entrypoints.engine import Engine, _set_envs_and_config
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import PortArgs, prepare_server_args

    logs = capture()
    load_plugins()
    # What launch_server and Engine._launch_subprocesses do before they launch the detokenizer.
    server_args = prepare_server_args(argv)
    server_args.resolve_once()
    _set_envs_and_config(server_args)
    publish(server_args, role="tokenizer")
    port_args = PortArgs.init_new(server_args)
    procs, names = Engine._launch_detokenizer_subprocesses(
        server_args=server_args, port_args=port_args, run_detokenizer_process_func=Engine.run_detokenizer_process_func
    )
    if orphan:
        # SGLang dies abruptly once its detokenizer answered: no teardown of its children.
        out = talk_and_kill(procs, names, port_args, oracle_dir, logs, kill=False)
        out["pids"] = [procs[0].pid, *decoding_pids(procs[0])]
        print("RESULT " + json.dumps(out), flush=True)
        os._exit(0)
    try:
        return talk_and_kill(procs, names, port_args, oracle_dir, logs)
    finally:
        for p in procs:
            p.kill()


def decoding_pids(proc) -> list[int]:
    """detokd's decoding process, forked by the process SGLang started (none for SGLang's own)."""
    import psutil

    pids = []
    for c in psutil.Process(proc.pid).children():
        try:
            if "(detokd decoding)" in " ".join(c.cmdline()):
                pids.append(c.pid)
        except psutil.Error:  # one that is dying
            pass
    return pids


def talk_and_kill(procs, names, port_args, oracle_dir: str, logs: Captured, kill: bool = True) -> dict:
    import time
    from array import array

    import psutil
    import zmq
    from sglang.srt.managers import io_struct
    from sglang.srt.utils.watchdog import SubprocessWatchdog
    from transformers import AutoTokenizer

    out = {"names": names, "logs": logs.records}

    # The scheduler's and the TokenizerManager's ends of SGLang's own addresses.
    ctx = zmq.Context()
    to_tokenizer = ctx.socket(zmq.PULL)
    to_tokenizer.bind(port_args.tokenizer_ipc_name)
    to_detokenizer = ctx.socket(zmq.PUSH)
    to_detokenizer.connect(port_args.detokenizer_ipc_name)
    if oracle_dir.endswith(".json"):  # a tiktoken file: SGLang reads those with its own class
        from sglang.srt.tokenizer.tiktoken_tokenizer import TiktokenTokenizer

        tok = TiktokenTokenizer(oracle_dir)
    else:
        tok = AutoTokenizer.from_pretrained(oracle_dir)
    ids = tok.encode("Hello from the scheduler, ünïcode ✓", add_special_tokens=False)
    n = 1
    from sglang.srt.managers.multi_tokenizer_mixin import MultiDetokenizerRouter

    # SGLang 0.5.22 and older's router routes rows by their HTTP worker alone (it asserts
    # each names one): the row names the TokenizerManager's address there, as a
    # TokenizerManager stamps it; 0.5.23 routes a row that names none by its rid.
    behind_router = "detokenizer_router" in names
    ipc = port_args.tokenizer_ipc_name if behind_router and not hasattr(MultiDetokenizerRouter, "_pick_for") else None
    fields = dict(
        rids=["r0"], http_worker_ipcs=[ipc], finished_reasons=[{"type": "length", "length": len(ids)}],
        decoded_texts=[""], decode_ids=[array("q", ids)], read_offsets=[0], output_ids=None,
        skip_special_tokens=[True], spaces_between_special_tokens=[True], no_stop_trim=[False],
        prompt_tokens=[3], reasoning_tokens=[0], completion_tokens=[len(ids)], cached_tokens=[0],
        input_token_logprobs_val=None, input_token_logprobs_idx=None, output_token_logprobs_val=None,
        output_token_logprobs_idx=None, input_top_logprobs_val=None, input_top_logprobs_idx=None,
        output_top_logprobs_val=None, output_top_logprobs_idx=None, input_token_ids_logprobs_val=None,
        input_token_ids_logprobs_idx=None, output_token_ids_logprobs_val=None, output_token_ids_logprobs_idx=None,
        output_token_entropy_val=None, output_token_sampling_mask=None, output_hidden_states=None,
        routed_experts=None, indexer_topk=None, placeholder_tokens_idx=None, placeholder_tokens_val=None,
        output_token_sampling_logprobs=None,
    )
    has = set(io_struct.BatchTokenIDOutput.__struct_fields__)  # 0.5.20 has output_token_sampling_logprobs

    def ask(rid: str):
        """One request's one row; the detokenizer's answer, or None."""
        batch = io_struct.BatchTokenIDOutput(**{k: v for k, v in {**fields, "rids": [rid]}.items() if k in has})
        io_struct.sock_send(to_detokenizer, batch)
        return io_struct.sock_recv(to_tokenizer) if to_tokenizer.poll(60_000) else None

    # SGLang's watchdog, as _launch_subprocesses sets it up; it SIGQUITs this process,
    # and so does a detokenizer that fails.
    seen = threading.Event()
    signal.signal(signal.SIGQUIT, lambda *_: seen.set())
    reply = ask("r0")
    out["reply_type"] = type(reply).__name__
    out["output_strs"] = reply.output_strs if reply is not None else None
    out["expected"] = [tok.decode(ids, skip_special_tokens=True)] * n
    out["rids"] = reply.rids if reply is not None else None
    # Set by SGLang's run_detokenizer_process before it serves, so known once it answered.
    titles = [" ".join(psutil.Process(p.pid).cmdline()) for p in procs]
    out["titles"] = titles
    out["sglangs_own"] = "sglang::detokenizer" in titles[0] and "(detokd)" not in titles[0]  # detokd's says so
    if not kill:
        return out

    watchdog = SubprocessWatchdog(processes=procs, process_names=names, interval=0.1)
    watchdog.start()
    decoding = [pid for p in procs for pid in decoding_pids(p)]
    out["decoding"] = len(decoding)
    if decoding:  # detokd's: its decoding process dies, SGLang does not see it, the next row is answered
        # Sent once the sender's socket has seen the connection go (a row sent while the
        # kill is under way can be lost with it: docs/sglang.md): this socket's, or, behind
        # SGLang's router, the router's, which it has seen before the next process is forked.
        gone = to_detokenizer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        os.kill(decoding[0], signal.SIGKILL)
        killed = time.monotonic()
        if behind_router:
            while set(decoding_pids(procs[0])) <= {decoding[0]}:
                time.sleep(0.01)
        else:
            gone.poll(10_000)
        again = ask("r1")
        out["after_restart"] = {"rids": again.rids if again else None, "output_strs": again.output_strs if again else None,
                                "seconds": time.monotonic() - killed, "death_seen": seen.is_set()}
    procs[0].kill()
    out["death_seen"] = seen.wait(30)
    procs[0].join(10)
    out["exitcode"] = procs[0].exitcode
    watchdog.stop()
    return out


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "loader":
        result = loader(sys.argv[2:] == ["mismatch"])
    else:
        result = launch(sys.argv[2], sys.argv[3:], orphan=mode == "orphan")
    print("RESULT " + json.dumps(result), flush=True)
