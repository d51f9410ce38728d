"""SGLang general plugin: detokd replaces SGLang's detokenizer process when DETOKD_SGLANG is true.

Registered as the `detokd` entry point of group `sglang.srt.plugins`; SGLang's
load_plugins() calls `register()` in every process that loads plugins. Disabled (the
default) it does nothing at all. Enabled, it checks the schema and, if SGLang speaks
detokd's, wraps `Engine._launch_detokenizer_subprocesses` (AROUND) and launches
`detokd.sglang.process.run_sglang_detokenizer` as SGLang's detokenizer: one
multiprocessing.Process of SGLang's own context (spawn) on SGLang's address, as SGLang's
launch starts one, also under --detokenizer-worker-num N > 1. There SGLang's launch would
put its MultiDetokenizerRouter in front of N processes, and that router (Python that
decodes, splits and re-encodes every batch) costs more CPU per row than one detokd
process spends in all: one detokd serves more than N behind it, for any N
(docs/sglang.md, "Several detokenizers"). DETOKD_SGLANG_ROUTER=1 keeps SGLang's layout
instead: SGLang's own launch, with N detokd processes behind its router. SGLang
records the pids in all_child_pids, watches them with SubprocessWatchdog and kills them
with the process tree. Replacing the launch method rather than SGLang's
run_detokenizer_process keeps the spawn target picklable (a partial of a module
function).

Any SGLang feature detokd does not serve keeps SGLang's own detokenizer, with one warning
line naming the cause and the installed SGLang release; so does anything detokd's process
cannot do before it serves (an SGLang module or symbol missing, a schema it cannot
mirror, a bad DETOKD_CONFIG, a tokenizer it cannot decode exactly as SGLang does): the
launch waits for its verdict before it returns, and the process binds nothing until it
serves. DETOKD_SGLANG=require turns every such fallback into a launch failure of one
line. A release outside the tested window (detokd.sglang.release.WINDOW) is served when
the structural check passes, and the log says it is untested. With SGLang's Rust server
on (SGLANG_RUST_SERVER) there is no detokenizer process to replace: the log says detokd
is not used, and DETOKD_SGLANG=require fails the launch.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

ENV = "DETOKD_SGLANG"
ROUTER_ENV = "DETOKD_SGLANG_ROUTER"  # true: --detokenizer-worker-num N > 1 as SGLang lays it out
RUST_SERVER_ENV = "SGLANG_RUST_SERVER"  # SGLang's opt-in Rust server, which has no detokenizer process
# How long the launch waits for detokd's process to load SGLang's tokenizer (the import of
# SGLang in a spawned process takes most of it; a hub download could take longer).
VERDICT_TIMEOUT_S = 600
TARGET = "sglang.srt.entrypoints.engine.Engine._launch_detokenizer_subprocesses"
# SGLang's plugin logger: what detokd did shows up beside SGLang's own plugin lines.
logger = logging.getLogger("sglang.srt.plugins")

_announced = False
_registered = False


def _true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def enabled() -> bool:
    return _true(ENV) or required()


def required() -> bool:
    """DETOKD_SGLANG=require: detokd serves, or SGLang does not start."""
    return os.environ.get(ENV, "").strip().lower() == "require"


def _sglang_version() -> str:
    try:
        import sglang

        return sglang.__version__
    except Exception:  # noqa: BLE001 - only for the log line
        return "?"


def cause(exc: BaseException) -> str:
    """An exception as one line of a log."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:400]


def keep_sglangs(why: str) -> None:
    """SGLang's own detokenizer runs: one warning line naming the cause and the release,
    or, under DETOKD_SGLANG=require, a launch failure of one line."""
    where = f"SGLang {_sglang_version()}"
    if required():
        raise SystemExit(f"detokd: {ENV}=require, and detokd cannot serve {where}'s detokenizer: {why}")
    logger.warning("detokd: keeping SGLang's own detokenizer on %s: %s", where, why)


def _main_process() -> bool:
    """Whether this is the process that launches SGLang's detokenizer (SGLang's
    schedulers load plugins too, in children of it)."""
    import multiprocessing as mp

    return mp.parent_process() is None


def rust_server() -> bool:
    """Whether SGLang's Rust server is on (SGLANG_RUST_SERVER, read as SGLang reads it):
    it tokenizes and detokenizes itself, and SGLang's launch starts no detokenizer
    process to replace. False where the installed release has no such setting."""
    try:
        from sglang.srt.environ import envs

        setting = getattr(envs, RUST_SERVER_ENV, None)
        return bool(setting is not None and setting.get())
    except Exception:  # noqa: BLE001 - no failure of the plugin may take SGLang down
        return False


def not_used(why: str) -> None:
    """detokd is not used on this launch: one warning line, or under DETOKD_SGLANG=require
    a launch failure of one line."""
    where = f"SGLang {_sglang_version()}"
    if required():
        raise SystemExit(f"detokd: {ENV}=require, and detokd is not used on {where}: {why}")
    logger.warning("detokd: not used on %s: %s", where, why)


def behind_router() -> bool:
    """Whether --detokenizer-worker-num N > 1 starts N detokd processes behind SGLang's
    router (DETOKD_SGLANG_ROUTER) rather than the one that outruns them."""
    return _true(ROUTER_ENV)


def register() -> None:
    """The entry point: hook the detokenizer launch if enabled and the schema matches."""
    global _registered
    if not enabled() or _registered:
        return
    if rust_server():
        if _main_process():
            not_used(f"{RUST_SERVER_ENV} is on, and SGLang's Rust server starts no detokenizer process "
                     f"({RUST_SERVER_ENV}=0 serves with detokd; docs/sglang.md: which to run)")
        return
    # The structural check, in the process that launches the detokenizer (detokd's own
    # process decides again, with everything else, before it serves); no failure of it
    # may take SGLang down.
    try:
        from detokd.sglang import release, schema

        schema.check()
        release.detect()
    except Exception as e:  # noqa: BLE001
        if _main_process():
            keep_sglangs(cause(e))
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, launch_detokenizer, HookType.AROUND)
    _registered = True


def unsupported(server_args: Any, run_detokenizer_process_func: Callable) -> str | None:
    """The first SGLang feature of this launch detokd does not serve, or None."""
    from sglang.srt.managers.detokenizer_manager import run_detokenizer_process
    from sglang.srt.runtime_context import get_serving

    s = get_serving()
    if run_detokenizer_process_func is not run_detokenizer_process:
        name = getattr(run_detokenizer_process_func, "__qualname__", run_detokenizer_process_func)
        return f"a custom run_detokenizer_process_func ({name})"
    if s.skip_tokenizer_init:
        return "skip_tokenizer_init (--skip-tokenizer-init)"
    if s.tokenizer_mode != "auto":
        return f"tokenizer_mode {s.tokenizer_mode!r} (a slow tokenizer)"
    if s.tokenizer_backend != "huggingface":
        return f"tokenizer_backend {s.tokenizer_backend!r}"
    return None


def launch_detokenizer(original: Callable, cls: type, server_args: Any, port_args: Any,
                       run_detokenizer_process_func: Callable):
    """AROUND hook of Engine._launch_detokenizer_subprocesses (a classmethod: cls first)."""
    feature = unsupported(server_args, run_detokenizer_process_func)
    if feature is not None:
        keep_sglangs(f"detokd does not support {feature}")
        return original(cls, server_args=server_args, port_args=port_args,
                        run_detokenizer_process_func=run_detokenizer_process_func)
    try:
        from detokd.sglang.process import run_sglang_detokenizer
    except ImportError as e:
        keep_sglangs(f"cannot import detokd.sglang.process: {e}")
        return original(cls, server_args=server_args, port_args=port_args,
                        run_detokenizer_process_func=run_detokenizer_process_func)
    import functools
    import multiprocessing as mp  # SGLang's module, so its start method (spawn) applies

    from sglang.srt.runtime_context import get_serving

    requested = get_serving().detokenizer_worker_num
    reader, writer = mp.Pipe(duplex=False)
    target = functools.partial(run_sglang_detokenizer, verdict=writer)
    if requested > 1 and not behind_router():
        procs, names = launch_one(target, server_args, port_args)
    else:  # SGLang's own launch, with detokd as the process(es) it starts
        procs, names = original(cls, server_args=server_args, port_args=port_args, run_detokenizer_process_func=target)
    writer.close()  # only the children's copies are left
    workers = [p for p, name in zip(procs, names, strict=True) if name != "detokenizer_router"]
    refusal = await_refusal(reader, workers)
    if refusal is not None:
        for p in procs:
            p.kill()
            p.join(30)
        keep_sglangs(refusal)
        return original(cls, server_args=server_args, port_args=port_args,
                        run_detokenizer_process_func=run_detokenizer_process_func)
    _announce(len(workers), requested)
    return procs, names


def launch_one(target: Callable, server_args: Any, port_args: Any) -> tuple[list, list[str]]:
    """What SGLang's launch starts for one detokenizer: a process of its multiprocessing
    context on port_args.detokenizer_ipc_name, named "detokenizer" for its watchdog."""
    import multiprocessing as mp

    proc = mp.Process(target=target, args=(server_args, port_args))
    proc.start()
    return [proc], ["detokenizer"]


def await_refusal(reader, workers: list, timeout: float = VERDICT_TIMEOUT_S) -> str | None:
    """None once each of detokd's processes says it serves; otherwise why one does not."""
    import time

    deadline = time.monotonic() + timeout
    told = 0
    try:
        while told < len(workers):
            if reader.poll(0.5):
                verdict = reader.recv()
                if not verdict.serves:
                    return verdict.detail
                told += 1
                continue
            dead = [p for p in workers if p.exitcode is not None]
            if dead:  # before all of them said they serve
                return f"a detokd detokenizer exited (code {dead[0].exitcode}) before it decided to serve"
            if time.monotonic() > deadline:
                return f"detokd's detokenizer did not decide to serve within {timeout:.0f} s"
    except EOFError:
        return "every detokd detokenizer exited before it decided to serve"
    finally:
        reader.close()
    return None


def _announce(processes: int, requested: int) -> None:
    global _announced
    if _announced:
        return
    _announced = True
    import detokd
    from detokd.sglang import release

    # An operator who asked for N processes hears why there is one, or what N costs.
    if processes > 1:
        how = (f" ({processes} processes behind SGLang's router, as {ROUTER_ENV} asks: the router costs more per row "
               "than detokd, one process serves more; docs/sglang.md, Several detokenizers)")
    elif requested > 1:
        how = (f" with one process for --detokenizer-worker-num {requested}: SGLang's router in front of "
               f"{requested} would cost more per row than detokd spends in all ({ROUTER_ENV}=1 keeps that layout; "
               "docs/sglang.md, Several detokenizers)")
    else:
        how = ""
    version = _sglang_version()
    if version in release.WINDOW:
        logger.info("detokd %s replaced SGLang's detokenizer (SGLang %s)%s", detokd.__version__, version, how)
    else:  # the structural check passed: served, and said to be untested
        logger.warning("detokd %s replaced SGLang's detokenizer (SGLang %s, a release detokd is untested on: its "
                       "structural check passed; tested: %s)%s",
                       detokd.__version__, version, ", ".join(release.WINDOW), how)
