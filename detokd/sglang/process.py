"""The process SGLang starts as its detokenizer, when the detokd plugin is on.

`run_detokenizer_process(server_args, port_args)` has the signature of SGLang's own, so
SGLang's Engine starts, watches and kills it as it would its own: it binds the address
SGLang's schedulers push to (port_args.detokenizer_ipc_name), pushes to the
TokenizerManager (port_args.tokenizer_ipc_name) or, with several HTTP workers, to the
worker each row names, dies with its parent, and on a failure tells the parent with
SIGQUIT as SGLang's detokenizer does (SGLang's watchdog reads a clean exit as fine).

Settings come from SGLang (tokenizer, IPC encoding, worker count, tool-call parser,
SGLANG_DETOKENIZER_MAX_STATES); DETOKD_CONFIG may name a detokd TOML file for the rest
(metrics_port, log_level, caps...), DETOKD_METRICS_PORT sets just the metrics port.
"""

from __future__ import annotations

import logging
import os
import signal
import stat

from .. import __version__
from ..config import Config, load
from ..server import Server
from ..tokenizer import load as load_tokenizer
from ..wire.sglang import GPT_OSS_CALL, SglangDialect
from . import schema

log = logging.getLogger("detokd.sglang")


def config(server_args, port_args) -> Config:
    """detokd's Config for SGLang's arguments: SGLang's addresses and tokenizer over
    DETOKD_CONFIG's settings (or the defaults)."""
    overrides = {
        "input": port_args.detokenizer_ipc_name,
        "workers": [port_args.tokenizer_ipc_name],
        "tokenizer": server_args.tokenizer_path,
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


def dialect_factory(server_args, vocab, use_pickle: bool | None = None):
    """Builds the SGLang dialect for a Server, from SGLang's own settings."""
    from sglang.srt.parser.response_template import tool_close_token_ids

    ipc = schema.codec(use_pickle)
    parser = getattr(server_args, "tool_call_parser", None)
    keep = set(tool_close_token_ids(parser, vocab.hf)) if parser else set()
    if parser == "gpt-oss":
        keep.add(GPT_OSS_CALL)

    def make(core, delivery, collector, stats, cfg) -> SglangDialect:
        return SglangDialect(
            core, delivery, collector, stats,
            ipc=ipc, vocab_size=core.size, http_workers=server_args.tokenizer_worker_num > 1,
            keep_stop_ids=frozenset(keep),
        )

    return make


def run_detokenizer_process(server_args, port_args) -> None:
    """SGLang's detokenizer process, served by detokd."""
    from sglang.srt.runtime_context import publish
    from sglang.srt.utils import configure_logger, kill_itself_when_parent_died

    import psutil
    import setproctitle

    kill_itself_when_parent_died()
    setproctitle.setproctitle("sglang::detokenizer (detokd)")
    configure_logger(server_args)
    publish(server_args, role="detokenizer")
    parent = psutil.Process().parent()
    try:
        cfg = config(server_args, port_args)
        take_reserved_path(cfg.input)
        vocab = load_tokenizer(cfg.tokenizer)
        server = Server(cfg, vocab, dialect=dialect_factory(server_args, vocab))
        log.info("detokd %s serves SGLang's detokenizer (schema %s, %s IPC)", __version__, schema.SCHEMA, server.dialect.ipc.name)
        server.run()
    except Exception:
        log.exception("detokd's SGLang detokenizer failed")
        parent.send_signal(signal.SIGQUIT)
        raise
