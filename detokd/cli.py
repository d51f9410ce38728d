"""The command line: `detokd serve | demo | tokenizer | config`. Only argument parsing
and exit codes live here; each command's work lives in its own module."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable

from . import __version__, logs
from .config import Config, ConfigError, env_name, flags, load, to_toml
from .tokenizer import TokenizerError

EXIT_CONFIG = 2
EXIT_CRASH = 1
# A shard is a process on a core of its own holding the tokenizer's tables (~190 MB at
# start) and serving a few million tokens/s: 256 of them are ~48 GB and more tokens
# than any engine beside them makes, on more cores than most hosts have. More is a
# slip (`--shards 1000000`) that would start processes until the host runs out of
# memory, so it is refused before one is started.
MAX_SHARDS = 256
log = logs.get(__name__)
CONFIG_HELP = "TOML config file (default: $DETOKD_CONFIG); DETOKD_<KEY> variables override it, flags override both"


def _serve_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--config", "-c", metavar="FILE", help=CONFIG_HELP)
    for key, f in flags().items():  # one flag per key that has one, as Config declares it
        if f.switch:
            sp.add_argument(f.name, dest=key, action="store_const", const=True, help=f"{f.help} (${env_name(key)})")
            continue
        sp.add_argument(
            f.name, dest=key, metavar=f.metavar, choices=f.choices, type=f.type,
            action="append" if f.repeat else "store", help=f"{f.help} (${env_name(key)})",
        )
    sp.add_argument(
        "--shards", type=int, default=1, metavar="N",
        help="run N detokd processes on derived addresses (input.0, input.1, ...)",
    )
    sp.add_argument(
        "--supervisor-port", type=int, metavar="PORT",
        help="with --shards: the supervisor's /health, /status and /metrics on this port (metrics_host)",
    )
    # Set by the supervisor on each shard it starts: the shard's number, on its log lines.
    sp.add_argument("--shard-index", type=int, help=argparse.SUPPRESS)


def _overrides(ns: argparse.Namespace) -> dict:
    return {key: getattr(ns, key) for key in flags()}


def flag(key: str) -> str:
    """The flag that sets a key (every key in _overrides has one)."""
    return flags()[key].name


def cmd_serve(ns: argparse.Namespace) -> int:
    if not 1 <= ns.shards <= MAX_SHARDS:
        raise ConfigError(f"--shards must be 1 to {MAX_SHARDS}, not {ns.shards}")
    cfg = load(ns.config, _overrides(ns), os.environ, flag)
    # Through a bounded queue to stderr, rate-limited and escaped: see detokd/logs.py.
    logs.setup(cfg.log_level, fmt=cfg.log_format, shard=ns.shard_index)
    if ns.supervisor_port is not None and ns.shards < 2:
        raise ConfigError("--supervisor-port needs --shards 2 or more")
    if ns.shards > 1:
        return _serve_shards(ns, cfg)
    if cfg.restart:
        return _serve_restarting(cfg)
    return _serve(cfg)


def _serve(cfg: Config, prepared=None) -> int:
    from .server import Server
    from .wire.native import NativeDialect

    server = Server(cfg, NativeDialect.make, prepared=prepared)
    rc = server.run()
    log.info("stopped: got %s; exit %d", signal.Signals(server.stop_signal).name, rc, extra=logs.UNLIMITED)
    return rc


def _serve_restarting(cfg: Config) -> int:
    """restart = true: this process decides everything that can fail (server.prepare:
    the config, the tokenizer, the metrics port) and supervises one decoding process,
    a fork of it that binds and serves, forked again when it dies (launch.RESTARTS)."""
    from .launch import RESTARTS, Forks, Supervisor
    from .server import prepare

    prepared = prepare(cfg)
    log.info("serving from a decoding process that is restarted when it dies (restart = true)")
    serve = Forks(lambda index, restarts: guarded(lambda: _serve(cfg, prepared)))
    return Supervisor(serve, 1, backoff=RESTARTS).run()  # its last line says why it stopped


def _serve_shards(ns: argparse.Namespace, cfg: Config) -> int:
    from .launch import Commands, StatusPortError, Supervisor, derive_address
    from .metrics import BuildInfo

    if cfg.metrics_port is not None and cfg.metrics_port + ns.shards - 1 > 65535:
        raise ConfigError("metrics_port + shards exceeds 65535")
    sup_port = ns.supervisor_port
    if sup_port is not None:
        if not 0 <= sup_port <= 65535:
            raise ConfigError(f"--supervisor-port {sup_port} is not a port")
        if cfg.metrics_port and cfg.metrics_port <= sup_port < cfg.metrics_port + ns.shards:
            raise ConfigError(f"--supervisor-port {sup_port} is a shard's metrics port (metrics_port + i)")
    try:
        inputs = [derive_address(cfg.input, i) for i in range(ns.shards)]
    except ValueError as exc:
        raise ConfigError(f"--shards: {exc}") from exc

    def argv(i: int) -> list[str]:
        args = ["serve", "--shard-index", str(i)]
        if ns.config:
            args += ["--config", ns.config]
        return args + _shard_flags(cfg, inputs[i], i)

    log.info("%d shards: %s", ns.shards, ", ".join(inputs))
    try:
        return Supervisor(
            Commands(argv), ns.shards, status_port=sup_port, status_host=cfg.metrics_host,
            collectors=[BuildInfo("native")],
        ).run()
    except StatusPortError as exc:
        raise ConfigError(str(exc)) from exc


def _shard_flags(cfg: Config, address: str, i: int) -> list[str]:
    """Shard i's flags: the supervisor's settings, its own input and metrics port."""
    own: dict[str, object] = {
        "input": address, "metrics_port": None if cfg.metrics_port is None else cfg.metrics_port + i,
        "restart": None,  # the shards' supervisor restarts them: no supervisor of its own in each
    }
    args: list[str] = []
    for key, f in flags().items():
        value = own[key] if key in own else getattr(cfg, key)
        if f.switch:
            args += [f.name] if value else []
            continue
        for v in value if f.repeat and isinstance(value, list) else [value]:
            if v is not None:
                args += [f.name, str(v)]
    return args


def cmd_demo(ns: argparse.Namespace) -> int:
    from .demo import run

    return run(streams=ns.streams, steps=ns.steps, tokenizer=ns.tokenizer, show=not ns.quiet)


def cmd_tokenizer(ns: argparse.Namespace) -> int:
    from .core.decoder import make_codec, self_check
    from .tokenizer import load as load_tokenizer

    vocab = load_tokenizer(ns.spec)
    codec = make_codec(vocab)
    print(f"tokenizer  {ns.spec}")
    print(f"ids        {vocab.size} ({len(vocab.special)} special: the ids skip_special_tokens removes)")
    print(f"decoder    {' + '.join(map(str, vocab.decoder_types())) or 'none'}")
    print(f"codec      {codec.name}")
    bad = self_check(vocab, codec, trials=ns.trials, seed=1)
    print(f"self-check {'ok' if bad is None else 'FAILED: ' + bad} ({ns.trials} random streams)")
    return 0 if bad is None else 1


def cmd_config(ns: argparse.Namespace) -> int:
    cfg = load(ns.config, {}, os.environ)
    sys.stdout.write(to_toml(cfg))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="detokd",
        description="Detokenizer sidecar for LLM serving engines: token ids in over ZMQ, exact streamed text out.",
    )
    ap.add_argument("--version", action="version", version=f"detokd {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sp = sub.add_parser(
        "serve", help="run the detokenizer", description="Run detokd: PULL token batches, PUSH text to workers."
    )
    _serve_args(sp)
    sp.set_defaults(func=cmd_serve)

    dp = sub.add_parser("demo", help="stream real multilingual text through a live detokd", description=(
        "Start `detokd serve`, a synthetic scheduler replaying real text as concurrent streams, and a worker; "
        "show one stream live and check every stream against the reference decode."))
    dp.add_argument("--streams", type=int, default=64, help="concurrent requests (default 64)")
    dp.add_argument("--steps", type=int, default=400, help="tokens per stream (default 400)")
    dp.add_argument("--tokenizer", default=None, help="tokenizer to use (default: the config default)")
    dp.add_argument("--quiet", action="store_true", help="no live text, just the summary")
    dp.set_defaults(func=cmd_demo)

    tp = sub.add_parser("tokenizer", help="load a tokenizer and verify detokd decodes it exactly")
    tp.add_argument("spec", help="tokenizer folder, tokenizer.json, or packaged name")
    tp.add_argument("--trials", type=int, default=500)
    tp.set_defaults(func=cmd_tokenizer)

    cp = sub.add_parser("config", help="print the effective config as TOML")
    cp.add_argument("--config", "-c", metavar="FILE", help=CONFIG_HELP)
    cp.set_defaults(func=cmd_config)
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    return guarded(lambda: ns.func(ns))


def guarded(run: Callable[[], int]) -> int:
    """`run()`'s exit status, or the one of its failure, said as the last line."""
    try:
        return run()
    except (ConfigError, TokenizerError) as exc:
        _last_words(f"detokd: error: {exc}")
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130
    except Exception:
        if not logs.active():
            raise
        _last_words("detokd: stopped by an internal error; exit 1", exc_info=True)
        return EXIT_CRASH


def _last_words(message: str, exc_info: bool = False) -> None:
    """Why the process stops, as its last line, after every queued log line: a record
    under log_format json (or with a traceback), else the message itself on stderr."""
    fmt = logs.active()
    if fmt == "json" or (fmt and exc_info):
        log.critical("%s", message, exc_info=exc_info, extra=logs.UNLIMITED)
        logs.close()
    else:
        logs.close()
        print(message, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
