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

Started by the plugin with a `verdict` pipe, the process first decides (`prepare`):
it imports every SGLang module and symbol it uses, builds the schema from the installed
release's classes and detects how that release behaves (detokd.sglang.schema, .release),
reads and validates DETOKD_CONFIG, loads SGLang's tokenizer and checks detokd's tables
against it (detokd.sglang.vocab), tries the metrics port. Only then does it tell the plugin whether it serves,
and only once it serves does it bind. Any failure before that is a refusal naming its
cause: SGLang's addresses stay free for SGLang's own detokenizer, which the plugin then
starts; nothing detokd does there can take SGLang down.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
from dataclasses import dataclass
from typing import Callable

from .. import __version__, logs, sockets
from ..config import Config, ConfigError, load
from ..server import Server
from ..tokenizer import Vocab, of
from . import release, schema
from . import vocab as sglang_vocab
from .dialect import SglangDialect
from .http_workers import sglangs_addresses
from .plugin import cause

log = logs.get(__name__)


@dataclass(frozen=True)
class Verdict:
    """What the process tells the plugin once it has decided: whether it serves."""

    serves: bool
    detail: str  # the tokenizer's fingerprint, or why detokd does not serve (one line)
    version: str = "?"  # the installed SGLang's


@dataclass(frozen=True)
class Prepared:
    """Everything the process serves with, decided before it tells the plugin."""

    vocab: Vocab
    fingerprint: sglang_vocab.Fingerprint
    cfg: Config
    make_dialect: Callable


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


def metrics_port_free(cfg: Config) -> None:
    """The metrics port binds once the verdict is sent, when a failure would take SGLang's
    server down: so it is tried first, and let go for the server to bind a moment later
    (another process taking it in between is the one failure left)."""
    if not cfg.metrics_port:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds it
        try:
            probe.bind((cfg.metrics_host, cfg.metrics_port))
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {cfg.metrics_host}:{cfg.metrics_port}: {exc.strerror}") from exc


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


def dialect_factory(vocab, built: schema.Schema, rel: release.Release, ipc, own: frozenset[str] = frozenset()
                    ) -> Callable:
    """Builds the SGLang dialect for a Server, from SGLang's own (resolved) settings and
    the installed release's behaviour; `own`: SGLang's addresses, none an HTTP worker's."""
    from sglang.srt.runtime_context import get_serving

    serving = get_serving()
    parser = serving.tool_call_parser
    keep = set(rel.tool_closers(parser, vocab.hf)) if parser and rel.tool_closers else set()
    if parser == "gpt-oss" and rel.gpt_oss_call:
        keep.add(release.GPT_OSS_CALL)
    workers = serving.tokenizer_worker_num
    # Read as SGLang resolved them (a deprecated parser name on the command line is not
    # what its detokenizer uses): said once, so an operator can check.
    log.info("detokd's settings from SGLang %s: tool_call_parser=%r (stop ids kept %s), HTTP workers %d%s, "
             "stop-token trim on %s, %s IPC", built.version, parser, sorted(keep), workers,
             f" (answered {rel.split_name})" if workers > 1 else "",
             "`not matched`" if rel.falsy_no_match else "`matched is None`", ipc.name)

    def make(core, delivery, gc_policy, stats, cfg) -> SglangDialect:
        if ipc.name == "pickle":
            ipc.tensor_bytes = cfg.max_frame_bytes  # what a frame's tensors may expand to
        return SglangDialect(
            core, delivery, gc_policy, stats,
            ipc=ipc, vocab_size=vocab.size, http_workers=workers, own_addresses=own,
            keep_stop_ids=frozenset(keep), falsy_no_match=rel.falsy_no_match, split=rel.split,
        )

    return make


def prepare(server_args, port_args, use_pickle: bool | None = None) -> Prepared:
    """Everything detokd's process needs, decided before it tells the plugin it serves:
    the schema from the installed classes, the release's behaviour (every SGLang symbol
    either uses, imported), the IPC codec, SGLang's tokenizer checked, DETOKD_CONFIG
    read and validated, the metrics port free. Raises what it cannot do."""
    from . import pickled

    built = schema.build()
    rel = release.detect()
    ipc = schema.codec(use_pickle, pickled.allowances(os.environ.get("DETOKD_SGLANG_PICKLE_ALLOW", "")), built=built)
    vocab, fingerprint = sglangs_vocab(server_args)
    cfg = config(port_args, vocab.name)
    metrics_port_free(cfg)
    return Prepared(vocab, fingerprint, cfg, dialect_factory(vocab, built, rel, ipc, sglangs_addresses(port_args)))


def own_lines() -> None:
    """Every log line of detokd's in SGLang's log says it is detokd's: SGLang's format
    shows no logger name."""
    factory = logging.getLogRecordFactory()

    def make(*args, **kwargs):
        record = factory(*args, **kwargs)
        if record.name.startswith("detokd") and isinstance(record.msg, str) and not record.msg.startswith("detokd"):
            record.msg = "detokd: " + record.msg
        return record

    logging.setLogRecordFactory(make)


def sglangs_ipc_advice() -> str:
    """What to do about SGLang's ipc addresses in a folder others can write: SGLang makes
    them with tempfile, in $TMPDIR."""
    import tempfile

    return (f"SGLang makes its ipc addresses in {tempfile.gettempdir()} (TMPDIR): start SGLang with TMPDIR set to a "
            "folder only its user can write (mkdir -m 700) (docs/sglang.md)")


def run_sglang_detokenizer(server_args, port_args, verdict=None) -> None:
    """SGLang's detokenizer process, served by detokd. `verdict`: the plugin's end of a
    pipe, told a Verdict before anything binds."""
    import psutil
    import setproctitle
    import sglang
    from sglang.srt.runtime_context import publish
    from sglang.srt.utils import configure_logger, kill_itself_when_parent_died

    kill_itself_when_parent_died()
    setproctitle.setproctitle("sglang::detokenizer (detokd)")
    configure_logger(server_args)
    own_lines()
    sockets.IPC_ADVICE = sglangs_ipc_advice()
    publish(server_args, role="detokenizer")
    parent = psutil.Process().parent()
    try:
        ready = prepare(server_args, port_args)
    except Exception as exc:
        if verdict is None:  # no plugin to fall back to: a failure of SGLang's detokenizer
            log.exception("detokd cannot serve SGLang %s's detokenizer", sglang.__version__)
            parent.send_signal(signal.SIGQUIT)
            raise
        # Nothing is bound: the plugin starts SGLang's own detokenizer instead.
        verdict.send(Verdict(False, cause(exc), sglang.__version__))
        return
    log.info("detokd decodes with SGLang's tokenizer %s: %d ids, %d special (as `detokd tokenizer` counts: the ids "
             "skip_special_tokens removes); fingerprint %s",
             ready.vocab.name, ready.vocab.size, len(ready.vocab.special), ready.fingerprint)
    if verdict is not None:
        verdict.send(Verdict(True, f"{ready.vocab.name} ({ready.fingerprint})", sglang.__version__))
    try:
        take_reserved_path(ready.cfg.input)
        server = Server(ready.cfg, ready.make_dialect, ready.vocab)
        dialect = server.dialect
        assert isinstance(dialect, SglangDialect)  # what make_dialect builds
        log.info("detokd %s serves SGLang %s's detokenizer (%s IPC)", __version__, sglang.__version__, dialect.ipc.name)
        server.run()
    except Exception:
        log.exception("detokd's SGLang detokenizer failed")
        parent.send_signal(signal.SIGQUIT)
        raise
