"""The process SGLang starts as its detokenizer, when the detokd plugin is on.

`run_sglang_detokenizer(server_args, port_args)` has the signature of SGLang's own
(sglang.srt.managers.detokenizer_manager.run_detokenizer_process), so SGLang's Engine
starts, watches and kills it as it would its own: it binds the address SGLang's
schedulers push to (port_args.detokenizer_ipc_name), pushes to the
TokenizerManager (port_args.tokenizer_ipc_name) or, with several HTTP workers, to the
worker each row names, dies with its parent, and on a failure tells the parent with
SIGQUIT as SGLang's detokenizer does (SGLang's watchdog reads a clean exit as fine).

Settings come from SGLang, read where SGLang's own detokenizer reads them (its runtime
context, resolved: the tokenizer, the HTTP worker count, the tool-call parser), and from
its environment (IPC encoding, SGLANG_DETOKENIZER_MAX_STATES); DETOKD_CONFIG may name a
detokd TOML file for the rest (metrics_port, log_level, caps...), DETOKD_METRICS_PORT
sets just the metrics port.

Started by the plugin with a `verdict` pipe, the process first loads SGLang's tokenizer
and checks detokd's tables against it (detokd.sglang.vocab), and says on the pipe
whether it serves; only then does it bind. A refusal leaves SGLang's addresses free for
SGLang's own detokenizer, which the plugin then starts.
"""

from __future__ import annotations

import logging
import os
import signal
import stat

from .. import __version__
from dataclasses import dataclass

from ..config import Config, load
from ..server import Server
from ..tokenizer import Vocab, of
from .dialect import GPT_OSS_CALL, SglangDialect
from . import schema, vocab as sglang_vocab

log = logging.getLogger("detokd.sglang")


@dataclass(frozen=True)
class Verdict:
    """What the process tells the plugin once it has SGLang's tokenizer: whether it serves."""

    serves: bool
    detail: str  # the tokenizer's fingerprint, or why detokd does not serve it


def config(port_args, tokenizer_path: str) -> Config:
    """detokd's Config for SGLang's arguments: SGLang's addresses and tokenizer over
    DETOKD_CONFIG's settings (or the defaults)."""
    overrides = {
        "input": port_args.detokenizer_ipc_name,
        "workers": [port_args.tokenizer_ipc_name],
        "tokenizer": tokenizer_path,
        "release": "word",  # as SGLang's own detokenizer releases text before a split character
        "max_states": int(os.environ.get("SGLANG_DETOKENIZER_MAX_STATES", 1 << 16)),
        "metrics_port": int(os.environ["DETOKD_METRICS_PORT"]) if os.environ.get("DETOKD_METRICS_PORT") else None,
    }
    return load(os.environ.get("DETOKD_CONFIG") or None, overrides)


def take_reserved_path(address: str) -> None:
    """SGLang reserves each ipc address as an empty file of its own making
    (PortArgs: tempfile.NamedTemporaryFile(delete=False)), which its detokenizer's bind
    replaces. detokd never removes what is not a socket, except that reservation: a
    regular, empty file owned by this user."""
    if not address.startswith("ipc://"):
        return
    path = address[len("ipc://") :]
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode) and st.st_size == 0 and st.st_uid == os.getuid():
        os.unlink(path)


def sglangs_vocab(server_args) -> tuple[Vocab, sglang_vocab.Fingerprint]:
    """SGLang's own tokenizer as detokd's Vocab, checked against it (detokd.tokenizer.TokenizerError if
    detokd cannot decode exactly as it does), with the fingerprint both share."""
    from sglang.srt.runtime_context import get_serving

    tokenizer = sglang_vocab.sglangs_tokenizer(server_args)
    vocab = of(tokenizer, get_serving().tokenizer_path)
    return vocab, sglang_vocab.check(vocab, tokenizer)


def dialect_factory(vocab, use_pickle: bool | None = None):
    """Builds the SGLang dialect for a Server, from SGLang's own (resolved) settings."""
    from sglang.srt.parser.response_template import tool_close_token_ids
    from sglang.srt.runtime_context import get_serving

    from . import pickled

    ipc = schema.codec(use_pickle, pickled.allowances(os.environ.get("DETOKD_SGLANG_PICKLE_ALLOW", "")))
    serving = get_serving()
    parser = serving.tool_call_parser
    keep = set(tool_close_token_ids(parser, vocab.hf)) if parser else set()
    if parser == "gpt-oss":
        keep.add(GPT_OSS_CALL)
    # Read as SGLang resolved them (a deprecated parser name on the command line is not
    # what its detokenizer uses): said once, so an operator can check.
    log.info("detokd's settings from SGLang: tool_call_parser=%r (stop ids kept %s), HTTP workers %d, %s IPC",
             parser, sorted(keep), serving.tokenizer_worker_num, ipc.name)

    def make(core, delivery, gc_policy, stats, cfg) -> SglangDialect:
        if ipc.name == "pickle":
            ipc.tensor_bytes = cfg.max_frame_bytes  # what a frame's tensors may expand to
        return SglangDialect(
            core, delivery, gc_policy, stats,
            ipc=ipc, vocab_size=vocab.size, http_workers=serving.tokenizer_worker_num > 1,
            keep_stop_ids=frozenset(keep),
        )

    return make


def run_sglang_detokenizer(server_args, port_args, verdict=None) -> None:
    """SGLang's detokenizer process, served by detokd. `verdict`: the plugin's end of a
    pipe, told a Verdict before anything binds."""
    from sglang.srt.runtime_context import publish
    from sglang.srt.utils import configure_logger, kill_itself_when_parent_died

    import psutil
    import setproctitle

    kill_itself_when_parent_died()
    setproctitle.setproctitle("sglang::detokenizer (detokd)")
    configure_logger(server_args)
    publish(server_args, role="detokenizer")
    parent = psutil.Process().parent()
    told = verdict is None  # whether the plugin knows detokd serves
    try:
        vocab, fingerprint = sglangs_vocab(server_args)
        log.info("detokd decodes with SGLang's tokenizer %s (%s)", vocab.name, fingerprint)
        if verdict is not None:
            verdict.send(Verdict(True, f"{vocab.name} ({fingerprint})"))
            told = True
        cfg = config(port_args, vocab.name)
        take_reserved_path(cfg.input)
        server = Server(cfg, dialect_factory(vocab), vocab)
        log.info("detokd %s serves SGLang's detokenizer (schema %s, %s IPC)", __version__, schema.SCHEMA, server.dialect.ipc.name)
        server.run()
    except Exception as exc:
        if not told:  # nothing is bound: the plugin starts SGLang's own detokenizer instead
            verdict.send(Verdict(False, f"{type(exc).__name__}: {exc}"))
            return
        log.exception("detokd's SGLang detokenizer failed")
        parent.send_signal(signal.SIGQUIT)
        raise
