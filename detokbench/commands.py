"""The subcommands of `python -m detokbench` and their dispatch.

Each command is a module with `main(argv) -> int`; only the chosen one is imported, so
`--help` is quick and sglang-bench's imports stay out of every other command.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from detokrig import ROOT

PROG = "python -m detokbench"
COMMANDS = {  # name: (module, summary)
    "bench": ("detokbench.bench.cli",
              "end-to-end benchmark: detokd and the baselines between a scheduler and a worker process"),
    "baselines": ("detokbench.baselines_server",
                  "serve one baseline detokenizer behind detokd's wire protocol (bench starts them)"),
    "scale": ("detokbench.scale", "detokd alone on a harness too cheap to matter: 1 vs N shards, CPU per token"),
    "soak": ("detokbench.soak", "millions of tokens with request churn through a real detokd: is RSS flat?"),
    "fuzz": ("detokbench.fuzz", "honest and hostile frames through a real detokd: alive, exact, counted, RSS kept"),
    "worst-frames": ("detokbench.worst_frames", "what one worst-case frame at the default caps costs a real detokd"),
    "gc-pauses": ("detokbench.gc_pauses", "the collector's pauses in detokd's loop under continuous batching, "
                  "in-process: its policy against once a second"),
    "sglang-bench": ("detokbench.sglang_bench",
                     "detokd in SGLang mode against SGLang's own detokenizer (in SGLang's environment)"),
    "sglang-aging": ("detokbench.sglang_aging", "does detokd in SGLang mode slow down as it ages? "
                     "one process for all passes against a fresh one per pass"),
    "rust-bench": ("detokbench.rust_bench", "SGLang's Rust server against its Python front end with SGLang's "
                   "detokenizer or detokd, under bench_serving; --exactness: the front-end cases (SGLang's environment)"),
}


def command_line(name: str, argv: list[str]) -> str:
    """How a run was started, for the results it writes."""
    return shlex.join([*PROG.split(), name, *argv])


def commit() -> str | None:
    """The checkout's commit, "-dirty" when its tracked files differ from it; None outside git."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)

    try:
        head = git("rev-parse", "--short", "HEAD")
        return None if head.returncode else head.stdout.strip() + ("-dirty" if git("diff", "--quiet", "HEAD").returncode else "")
    except OSError:
        return None


def machine() -> dict:
    """The host: cores, OS, CPU model and memory (detokd's per-row work is bound by memory, so
    its figures depend on the host's caches)."""
    info = {"cpus": os.cpu_count(), "platform": platform.platform()}
    with contextlib.suppress(OSError, StopIteration):
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line for line in f if line.startswith("model name")).split(":", 1)[1].strip()
        with open("/proc/meminfo") as f:
            info["mem_gb"] = round(int(f.readline().split()[1]) / 1024 / 1024, 1)
    return info


def versions() -> dict:
    """Python's and the libraries' versions the figures depend on."""
    out = {"python": platform.python_version()}
    for mod in ("detokd", "tokenizers", "transformers", "zmq", "msgspec", "psutil"):
        with contextlib.suppress(Exception):
            out[mod] = __import__(mod).__version__
    return out


def header(name: str, argv: list[str]) -> dict:
    """The keys every command's results open with: how it was started, from which commit,
    on what."""
    return {"command": command_line(name, argv), "commit": commit(), "machine": machine(), "versions": versions()}


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """A command's argument parser, its module docstring as the description."""
    return argparse.ArgumentParser(prog=f"{PROG} {name}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def write_json(path: str | Path, doc: object) -> None:
    """A command's results, readable by a person and by the next command."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")


def verdict(problems: list[str], json_path: str | os.PathLike | None = None, doc: dict | None = None) -> int:
    """`doc` written to `json_path` (when given), a FAIL line per problem, OK or
    FAILED; the exit status."""
    if json_path is not None and doc is not None:
        write_json(json_path, doc)
    for p in problems:
        print("FAIL:", p)
    print("FAILED" if problems else "OK")
    return 1 if problems else 0


def pyplot():
    """matplotlib's pyplot, drawing to files (the Agg backend), or None when matplotlib is
    not installed: a command then gives its figures without their plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: {PROG} COMMAND [args]   ({PROG} COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"{PROG}: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    # Tokenizers come from the zoo's packages: nothing is fetched from a model hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # A SIGTERM (a timeout, an operator) unwinds as Ctrl-C does: each command's `finally`
    # stops what it started, SGLang servers in sessions of their own among them.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])
