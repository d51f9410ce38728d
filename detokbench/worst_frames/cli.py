"""`python -m detokbench worst-frames`: every scenario on its own pair of detokds, the
table, the JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import msgspec
import zmq

from detokd.tokenizer import Vocab, load

from .. import ROOT
from ..commands import command_line
from . import __doc__ as DOC
from .measures import ANSWER_WAIT_S, extrapolate, handle, sigterm
from .peers import Target, warm_up
from .scenarios import CAPS, FULL, QUICK, Scale, Scenario, scenarios


def run_scenario(sc: Scenario, pair: tuple[Target, Target], vocab: Vocab, scale: Scale) -> dict:
    measured, stopped = pair
    out: dict = {"name": sc.name, "settings": sc.settings, "completed": False}
    try:
        frame = sc.build(scale, vocab)
        out["frame"] = {"bytes": len(frame.data), "rows": frame.rows, "ids": frame.ids, "token": frame.token, "note": frame.note}
        if len(frame.data) > CAPS.max_frame_bytes:  # ZMQ would drop it unread
            raise ValueError(f"frame of {len(frame.data)} bytes is over max_frame_bytes")
        for t in pair:
            t.ready()
            warm_up(t, vocab)
            if sc.setup is not None:
                before = len(t.sink.since(0))
                t.send(sc.setup(scale, vocab))
                t.sink.wait(lambda t=t: len(t.sink.since(0)) > before, ANSWER_WAIT_S, "the setup frame's answer")
        out.update(handle(measured, frame, vocab, sc.name))
        measured.close()
        out["exit_after_normal_stop"] = measured.proc.returncode
        out["sigterm"] = sigterm(stopped, frame)
        if frame.per_start_bytes:
            out["extrapolated"] = extrapolate(frame, out, scale)
        out["completed"] = out["probe"]["exact"]
    except Exception as exc:  # a failed scenario is a figure too; the others still run
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for t in pair:
            t.close()
    return out


def mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def table(results: list[dict]) -> str:
    head = (
        f"{'scenario':<17} {'frame MB':>8} {'rows':>6} {'answer s':>8} {'probe s':>8} {'out MB':>8} "
        f"{'health worst s':>14} {'non-200':>7} {'HWM MB before>after':>20} {'SIGTERM exit s (rc)':>20}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        if "health" not in r:
            lines.append(f"{r['name']:<17} FAILED: {r.get('error')}")
            continue
        m, s = r["memory"], r.get("sigterm", {})
        lines.append(
            f"{r['name']:<17} {mb(r['frame']['bytes']):>8} {r['frame']['rows']:>6} {r['answer_s'] or 0:>8.2f} "
            f"{r['probe_s']:>8.2f} {mb(r['answer']['bytes']):>8} {r['health']['worst_latency_s']:>14.3f} "
            f"{r['health']['non_200']:>7} {m['before']['hwm_mb']:>9.0f} > {m['after']['hwm_mb']:<8.0f} "
            f"{s.get('exit_s', float('nan')):>14.2f} ({s.get('returncode')})"
        )
        if "extrapolated" in r:
            e = r["extrapolated"]
            lines.append(
                f"{'':<17} a full frame ({e['starts_in_a_full_frame']} starts): ~{e['full_frame_s']} s, "
                f"~{e['full_frame_rss_mb']} MB more RSS"
            )
    return "\n".join(lines)


def meta(args: argparse.Namespace, command: str) -> dict:
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    caps = {k: getattr(CAPS, k) for k in msgspec.structs.asdict(CAPS) if k.startswith("max_")}
    caps.update(shutdown_grace_s=CAPS.shutdown_grace_s, health_timeout=CAPS.health_timeout, linger_ms=CAPS.linger_ms)
    return {
        "command": command,
        "quick": args.quick,
        "commit": commit,
        "caps": caps,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m detokbench worst-frames", description=DOC.split("\n\n")[0])
    ap.add_argument("--json", default=str(ROOT / "docs" / "bench" / "worst.json"), help="where to write the results")
    ap.add_argument("--quick", action="store_true", help="small frames: a smoke run of a few seconds")
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    ap.add_argument("--distinct-starts", type=int, help="starts in stop_distinct's frame")
    args = ap.parse_args(argv)
    scale = QUICK if args.quick else FULL
    if args.distinct_starts is not None:
        scale = dataclasses.replace(scale, distinct_starts=args.distinct_starts)
    chosen = [s for s in scenarios(scale) if not args.only or s.name in args.only.split(",")]
    started = time.monotonic()
    ctx = zmq.Context()
    results = []
    with tempfile.TemporaryDirectory(prefix="worst-") as root:
        # Every detokd is started up front (a start takes seconds of CPU, mostly loading
        # the tokenizer); each waits idle until its scenario, so none is starting while
        # another is measured.
        pairs = [(Target(ctx, root, sc.name, sc.settings), Target(ctx, root, sc.name, sc.settings)) for sc in chosen]
        vocabs = {name: load(name) for name in {sc.settings.get("tokenizer", "deepseek") for sc in chosen}}
        for sc, pair in zip(chosen, pairs):
            print(f"{sc.name} ...", flush=True)
            results.append(run_scenario(sc, pair, vocabs[sc.settings.get("tokenizer", "deepseek")], scale))
    ctx.destroy(linger=0)
    report = {**meta(args, command_line("worst-frames", argv)), "wall_s": round(time.monotonic() - started, 1), "scenarios": results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    print(table(results))
    print(f"written to {args.json}")
    return 0 if all(r["completed"] for r in results) else 1
