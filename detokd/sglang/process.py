"""The process SGLang starts as its detokenizer, when the detokd plugin is on.

`run_sglang_detokenizer(server_args, port_args)` has the signature of SGLang's own
(sglang.srt.managers.detokenizer_manager.run_detokenizer_process), so SGLang's Engine
starts, watches and kills it as it would its own. It dies with its parent, and SGLang's
watchdog sees its exit; but it does not decode. It decides, then supervises the
process that does, which SGLang never sees: a death there (an exception that escapes,
SIGKILL, the OOM killer) is not SGLang's, and SGLang's server outlives it.

Settings come from SGLang, read where SGLang's own detokenizer reads them (its runtime
context, resolved: the tokenizer, the HTTP worker count, the tool-call parser), and from
its environment (IPC encoding, SGLANG_DETOKENIZER_MAX_STATES); DETOKD_CONFIG may name a
detokd TOML file for the rest (metrics_port, log_level, caps...), DETOKD_METRICS_PORT
sets just the metrics port.

Started by the plugin with a `verdict` pipe, the process first decides (`prepare`):
it imports every SGLang module and symbol it uses, builds the schema from the installed
release's classes and detects how that release behaves (detokd.sglang.schema, .release),
reads and validates DETOKD_CONFIG and the CURVE keys it names, loads SGLang's tokenizer
and checks detokd's tables against it (detokd.sglang.vocab), builds the codec, binds the
metrics port. Only then does it tell the plugin whether it serves. Any failure before
that is a refusal naming its cause: SGLang's addresses stay free for SGLang's own
detokenizer, which the plugin then starts.

Once it serves, it forks the decoding process (detokd.launch.Forks), which binds
SGLang's addresses and runs detokd's loop, and forks it again within a second when it
dies. Rows the dead process had not answered are lost with it; the requests they
belonged to are ended by their next row, which the new process answers with an abort
(`detokd: restarted`: SglangDialect). Three deaths in a row, each within a minute of its
start, end the restarts: SGLang's own DetokenizerManager then serves the same addresses
from this process (`run_detokenizer_process`, as SGLang starts it), and SGLang's log
says so once. Nothing detokd does after the verdict can take SGLang down.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
from dataclasses import dataclass
from typing import Callable

from .. import __version__, logs, server, sockets
from ..config import Config, load
from ..launch import GAVE_UP, Backoff, Forks, Supervisor
from ..tokenizer import Vocab, of
from . import release, schema
from . import vocab as sglang_vocab
from .dialect import SglangDialect
from .http_workers import sglangs_addresses
from .plugin import cause

log = logs.get(__name__)

# As `ps` shows them: the process SGLang started, and the one it forks to decode.
TITLE = "sglang::detokenizer (detokd)"
DECODING_TITLE = "sglang::detokenizer (detokd decoding)"
# Forked again at once, then after 0.2 s; a third death in a row, each within a minute of
# its start, ends the restarts (run_sglang_detokenizer falls back to SGLang's own).
RESTARTS = Backoff(restart_delay=0.1, max_delay=1.0, max_restarts=2, restart_window=60.0, give_up=True)


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
    make_dialect: Callable  # (restarted: bool) -> a Server's DialectFactory
    server: server.Prepared


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

    def make(restarted: bool) -> Callable:
        def dialect(core, delivery, gc_policy, stats, cfg) -> SglangDialect:
            if ipc.name == "pickle":
                ipc.tensor_bytes = cfg.max_frame_bytes  # what a frame's tensors may expand to
            return SglangDialect(
                core, delivery, gc_policy, stats,
                ipc=ipc, vocab_size=vocab.size, http_workers=workers, own_addresses=own,
                keep_stop_ids=frozenset(keep), falsy_no_match=rel.falsy_no_match, split=rel.split,
                restarted=restarted,
            )

        return dialect

    return make


def prepare(server_args, port_args, use_pickle: bool | None = None) -> Prepared:
    """Everything detokd's process needs, decided before it tells the plugin it serves:
    the schema from the installed classes, the release's behaviour (every SGLang symbol
    either uses, imported), the IPC codec, SGLang's tokenizer checked, DETOKD_CONFIG
    read and validated, then all a server decides before it binds (server.prepare: the
    CURVE keys read, the codec built, the metrics port bound). SGLang's ipc addresses in
    a folder a stranger could write are said, never refused: SGLang's own detokenizer
    would serve them. Raises what it cannot do."""
    from . import pickled

    built = schema.build()
    rel = release.detect()
    ipc = schema.codec(use_pickle, pickled.allowances(os.environ.get("DETOKD_SGLANG_PICKLE_ALLOW", "")), built=built)
    vocab, fingerprint = sglangs_vocab(server_args)
    cfg = config(port_args, vocab.name)
    take_reserved_path(cfg.input)  # first: the folder check sees the path as detokd will bind it
    ready = server.prepare(cfg, vocab, ipc_folders_fatal=False)
    dialect = dialect_factory(vocab, built, rel, ipc, sglangs_addresses(port_args))
    return Prepared(vocab, fingerprint, cfg, dialect, ready)


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
    setproctitle.setproctitle(TITLE)
    configure_logger(server_args)
    own_lines()
    sockets.IPC_ADVICE = sglangs_ipc_advice()
    publish(server_args, role="detokenizer")
    try:
        ready = prepare(server_args, port_args)
    except Exception as exc:
        if verdict is None:  # no plugin to fall back to: a failure of SGLang's detokenizer
            log.exception("detokd cannot serve SGLang %s's detokenizer", sglang.__version__)
            psutil.Process().parent().send_signal(signal.SIGQUIT)
            raise
        # Nothing is bound: the plugin starts SGLang's own detokenizer instead.
        verdict.send(Verdict(False, cause(exc), sglang.__version__))
        return
    log.info("detokd decodes with SGLang's tokenizer %s: %d ids, %d special (as `detokd tokenizer` counts: the ids "
             "skip_special_tokens removes); fingerprint %s",
             ready.vocab.name, ready.vocab.size, len(ready.vocab.special), ready.fingerprint)
    if verdict is not None:
        verdict.send(Verdict(True, f"{ready.vocab.name} ({ready.fingerprint})", sglang.__version__))
        verdict.close()
    # SIGKILL, as SGLang's own processes die with theirs: this one only goes when SGLang does.
    decoding = Forks(lambda index, restarts: serve(ready, restarts), death_signal=signal.SIGKILL)
    ended = Supervisor(decoding, 1, backoff=RESTARTS).run()
    if ended == GAVE_UP:
        serve_sglangs_own(server_args, port_args, ready)


def serve(ready: Prepared, restarts: int) -> int:
    """The decoding process: detokd's loop on SGLang's addresses until it is stopped.
    Its failure is its own: logged, and its exit status is the supervisor's to read."""
    import setproctitle
    import sglang

    setproctitle.setproctitle(DECODING_TITLE)
    try:
        srv = server.Server(ready.cfg, ready.make_dialect(restarts > 0), prepared=ready.server)
        dialect = srv.dialect
        assert isinstance(dialect, SglangDialect)  # what make_dialect builds
        log.info("detokd %s serves SGLang %s's detokenizer (%s IPC)%s", __version__, sglang.__version__,
                 dialect.ipc.name, f", restarted ({restarts} since start)" if restarts else "")
        return srv.run()
    except Exception:
        log.exception("detokd's decoding process failed")
        return 1


def serve_sglangs_own(server_args, port_args, ready: Prepared) -> None:
    """The restarts are over: SGLang's own DetokenizerManager serves SGLang's addresses
    from this process, as SGLang's launch would have started it, until SGLang ends."""
    import sglang
    from sglang.srt.managers.detokenizer_manager import run_detokenizer_process

    if ready.server.metrics is not None:
        ready.server.metrics.close()  # nothing of detokd's answers there any more
    log.error("detokd's decoding process keeps dying: SGLang %s's own detokenizer serves from now on, in the "
              "process SGLang started as its detokenizer (the causes are above)", sglang.__version__)
    run_detokenizer_process(server_args, port_args)
