"""detokd in SGLang mode against SGLang's own detokenizer process, on SGLang's own stream
(docs/sglang.md, "Measured gain").

    fake scheduler (this process) --BatchTokenIDOutput--> detokenizer --BatchStrOutput--> this process

The stream: B requests of the corpus (DeepSeek tokenizer), 5 prompt ids each, 1 or
--ids-per-step new ids per step (--varied-ids: 1 to that many, as speculative decoding
accepts them); all finishing at the last step, or with --lifetime L staggered as under
continuous batching (the percentiles then take the steps with all B live). Every
message is built by SGLang's own scheduler code (sglang_replay.build_stream) and
encoded as sock_send does, before any timing; one built stream is sent to both
processes, each started as SGLang's Engine starts its detokenizer and warmed up.
Per pass: latency (one step in flight) and throughput (--window steps in flight).
ABBA rounds (sglang, detokd, detokd, sglang) so drift hits both alike. CPU per token and
per row from /proc over a pass, against the encoding's floor (this process decoding the
frames and encoding the answers, nothing else); peak RSS (VmHWM). Answers are checked
against the other process and the Hugging Face oracle; mismatches are counted, never
hidden.

    python -m detokbench sglang-bench --json docs/bench/sglang.json --plot docs/bench/sglang.png
    python -m detokbench sglang-bench --summary docs/bench/sglang*.json   # the recorded runs, one table

The defaults take ~7-9 minutes on 2 cores.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import platform
import random
import statistics
import subprocess
import time
from collections import deque
from pathlib import Path

from detokd import zoo
from detokd.sglang.process import run_sglang_detokenizer as detokd_target
from detokd.tokenizer import load

from . import ROOT
from .bench.report import log, machine, md_head, pct
from .commands import command_line, parser, write_json
from .corpus import corpus
from .proc import loadavg, memory, tick_cpu_s
from .sglang_replay import (
    Scripted, SglangDetokenizerUnderTest, accumulate, build_stream, freeze_gc_req, ipc_encoding, route,
)

TARGETS = {"sglang": None, "detokd": detokd_target}
PROMPT = 5  # prompt ids per request: SGLang's incremental-detokenization context
TOKENIZER = "deepseek"
ANSWER_TIMEOUT = 60.0  # seconds without an answer before the pass counts as hung


# --- the stream ------------------------------------------------------------------------


def requests(ids: list[int], batch: int, steps: int, tag: str, per_step: int = 1,
             lifetime: int | None = None, varied: bool = False) -> list[Scripted]:
    """B requests over the corpus ids (a ring), each from its own offset, `per_step` new
    ids each step (speculative decoding: SGLang's scheduler appends them all at once), or
    with `varied` 1 to `per_step` of them, drawn per request and step (seeded): the draft
    tokens speculative decoding accepts vary.

    lifetime None: all B live the whole stream (they start at step 0 and finish at its
    last). lifetime L: B slots, each running requests of L steps back to back, slot s's
    first starting at step s*L//B, so ~B/L requests start and ~B/L finish every step, as
    under continuous batching; no slot starts a request that would outlast the stream,
    so B are live from step L-1 to the last full lifetime's end and fewer at either end
    (`steady_steps`)."""
    spans = [(0, steps)] * batch if lifetime is None else [  # (first step, steps) of each request
        (first, lifetime) for s in range(batch) for first in range(s * lifetime // batch, steps - lifetime + 1, lifetime)
    ]
    ring = ids * (2 + ((lifetime or steps) * per_step + PROMPT) // len(ids))
    out = []
    for i, (first, n_steps) in enumerate(spans):
        draw = random.Random(i).randint
        chunks = [draw(1, per_step) if varied else per_step for _ in range(n_steps)]
        at = PROMPT + (i * 97) % len(ids)  # 97 is prime to the corpus length: distinct offsets
        out.append(Scripted(rid=f"{tag}{i}", prompt_ids=ring[at - PROMPT : at], output_ids=ring[at : at + sum(chunks)],
                            chunks=None if per_step == 1 else chunks, first_step=first))
    return out


def encode(messages: list, encoding: str) -> list[bytes]:
    """What SGLang's sock_send puts on the wire, done ahead of time."""
    from sglang.srt.managers.io_struct import msgpack_encode

    with ipc_encoding(encoding):
        if encoding == "pickle":
            return [pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL) for m in messages]
        return [msgpack_encode(m) for m in messages]


def decode(frames: list[bytes], encoding: str) -> list:
    """What SGLang's sock_recv makes of them."""
    from sglang.srt.managers.io_struct import msgpack_decode

    with ipc_encoding(encoding):
        return [pickle.loads(f) if encoding == "pickle" else msgpack_decode(f) for f in frames]


class Stream:
    """One batch size's prebuilt frames under one encoding, and what they must add up to."""

    def __init__(self, vocab, ids: list[int], batch: int, steps: int, encoding: str, per_step: int = 1,
                 lifetime: int | None = None, varied: bool = False):
        self.batch, self.steps, self.encoding, self.per_step = batch, steps, encoding, per_step
        t0 = time.perf_counter()
        self.reqs = requests(ids, batch, steps, "r", per_step, lifetime, varied)
        self.tokens = sum(len(s.output_ids) for s in self.reqs)
        messages = build_stream(self.reqs, encoding=encoding)
        self.step_rids = [list(m.rids) for m in messages]
        self.rows = sum(map(len, self.step_rids))
        # The steps whose latency the percentiles take: every step of the streams that
        # start and finish together; the steps with all B live of a staggered one (the
        # ramps up and down carry fewer rows, so they would flatter its tail).
        self.steady_steps = [k for k, rids in enumerate(self.step_rids) if lifetime is None or len(rids) == batch]
        self.frames = encode(messages, encoding)
        self.warmup = build_stream(requests(ids, batch, 8, "warm", per_step, varied=varied), encoding=encoding)
        self.build_seconds = time.perf_counter() - t0
        self.oracle = {s.rid: vocab.reference(s.prompt_ids, s.output_ids) for s in self.reqs}
        self.megabytes = sum(map(len, self.frames)) / 1e6
        self._answers_due: dict[int, list[dict[int, list[str]]]] = {}

    def answers_due(self, detokenizers: int) -> list[dict[int, list[str]]]:
        """Each step's answers through `detokenizers` processes: the rids of each one
        SGLang's router gives some of the step's rows (computed once per count)."""
        if detokenizers not in self._answers_due:
            steps = []
            for rids in self.step_rids:
                by: dict[int, list[str]] = {}
                for r in rids:
                    by.setdefault(route(None, r, detokenizers), []).append(r)
                steps.append(by)
            self._answers_due[detokenizers] = steps
        return self._answers_due[detokenizers]


# --- one process ------------------------------------------------------------------------


class Hung(RuntimeError):
    pass


def run_pass(proc: SglangDetokenizerUnderTest, stream: Stream, window: int) -> dict:
    """Send the whole stream with at most `window` steps unanswered; time every step."""
    push, pull = proc._push, proc._pulls[0]
    pids = {p.name: p.pid for p in proc.processes}
    n, detokenizers = len(stream.frames), proc.detokenizers
    due = stream.answers_due(detokenizers)
    owed: list[deque] = [deque() for _ in range(detokenizers)]  # per detokenizer, the steps it has yet to answer
    left = [len(d) for d in due]  # answers each step waits for
    sent_at = [0] * n
    latency_ns = [0] * n
    got: list[bytes] = []
    keys: list[tuple[int, int]] = []  # (step, detokenizer) of each answer
    expected = sum(left)
    gc.collect()
    gc.disable()
    load = loadavg()
    cpu0 = {name: tick_cpu_s(pid) for name, pid in pids.items()}
    t0 = time.perf_counter_ns()
    sent = completed = 0
    try:
        while len(got) < expected:
            while sent < n and sent - completed < window:
                sent_at[sent] = time.perf_counter_ns()
                push.send(stream.frames[sent], copy=False)
                for d in due[sent]:
                    owed[d].append(sent)
                sent += 1
            if not pull.poll(ANSWER_TIMEOUT * 1000):
                proc._check_alive()
                raise Hung(f"no answer to step {completed} of {n} within {ANSWER_TIMEOUT}s ({sent} sent)")
            while len(got) < expected and pull.poll(0):  # what is there, then wait again
                frame = pull.recv(copy=True)
                at = time.perf_counter_ns()
                d = 0 if detokenizers == 1 else route(None, decode([frame], stream.encoding)[0].rids[0], detokenizers)
                k = owed[d].popleft()
                got.append(frame)
                keys.append((k, d))
                left[k] -= 1
                if not left[k]:
                    latency_ns[k] = at - sent_at[k]
                    completed += 1
    finally:
        wall = (time.perf_counter_ns() - t0) / 1e9
        cpu_by = {name: tick_cpu_s(pid) - cpu0[name] for name, pid in pids.items()}
        gc.enable()
    if pull.poll(200):
        raise AssertionError(f"more answers than due ({expected}): the step accounting would be wrong")
    rows = stream.rows
    tokens = stream.tokens
    cpu = sum(cpu_by.values())
    answers = decode(got, stream.encoding)
    # Each answer against the rows it should hold: the rids of its step routed to its detokenizer.
    want = [due[k][d] for k, d in keys]
    return dict(
        wall_s=wall, rows=rows, tokens=tokens, tokens_per_s=tokens / wall, cpu_s=cpu, cpu_us_per_token=cpu / tokens * 1e6,
        cpu_us_per_row=cpu / rows * 1e6, cpu_s_by_process=cpu_by,
        loadavg_1m=load, latency_ms=[x / 1e6 for x in latency_ns], answers=answers, answers_due=want, answer_frames=got,
    )


def floor(stream: Stream, answer_frames: list[bytes], reps: int = 3) -> dict:
    """The encoding's floor, CPU per row (best of `reps`, this process): decoding the
    stream's frames and encoding the same answers with nothing else done. "floor":
    SGLang's own (sock_recv's and sock_send's: pickle, or io_struct's msgpack with every
    field a Python object); "floor_raw" (msgpack): detokd's schema Structs, whose copied
    fields stay msgpack bytes."""
    from sglang.srt.managers import io_struct

    from detokd.sglang import schema

    rows = stream.rows
    with ipc_encoding(stream.encoding):
        if stream.encoding == "pickle":
            ways = {"floor": (pickle.loads, lambda o: pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL), pickle.loads)}
        else:
            raw = schema.MsgpackCodec()
            ways = {"floor": (io_struct.msgpack_decode, io_struct.msgpack_encode, io_struct.msgpack_decode),
                    "floor_raw": (raw.decode, raw.encode, msgspec_decoder(schema.BatchStrOutput))}
        out = {}
        gc.collect()
        gc.disable()  # as in the passes: this process' heap (the streams) is no part of the floor
        for key, (dec, enc, dec_answer) in ways.items():
            answers = [dec_answer(f) for f in answer_frames]
            best_dec = best_enc = float("inf")
            for _ in range(reps):
                t0 = time.process_time()
                for f in stream.frames:
                    dec(f)
                t1 = time.process_time()
                for a in answers:
                    enc(a)
                t2 = time.process_time()
                best_dec, best_enc = min(best_dec, t1 - t0), min(best_enc, t2 - t1)
            out[f"{key}_decode_us_per_row"] = best_dec / rows * 1e6
            out[f"{key}_encode_us_per_row"] = best_enc / rows * 1e6
            out[f"{key}_us_per_row"] = (best_dec + best_enc) / rows * 1e6
        gc.enable()
    return out


def msgspec_decoder(cls):
    import msgspec

    return msgspec.msgpack.Decoder(cls).decode


def check(stream: Stream, answers: list, due: list[list[str]]) -> tuple[dict[str, str], dict]:
    """Per rid text, and the problems: answers without the rows due (one answer per step
    and detokenizer), texts off the oracle."""
    shape = [list(a.rids) for a in answers] == due and all(type(a).__name__ == "BatchStrOutput" for a in answers)
    acc = accumulate(answers)
    texts = {rid: lives[-1].text for rid, lives in acc.items()}
    unfinished = sum(1 for lives in acc.values() if lives[-1].finished_reason is None)
    wrong = [rid for rid, want in stream.oracle.items() if texts.get(rid) != want]
    return texts, dict(one_answer_per_step=shape, rids=len(texts), unfinished=unfinished, off_oracle=len(wrong),
                       off_oracle_examples=wrong[:3])


# --- the run ----------------------------------------------------------------------------


def by_process(p: dict) -> str:
    """A pass's CPU per row, process by process."""
    return " ".join(f"{who} {cpu / p['rows'] * 1e6:.2f}" for who, cpu in p["cpu_s_by_process"].items())


def bench_encoding(encoding: str, procs: dict, vocab, ids, args, raw: list[dict]) -> list[dict]:
    results = []
    for batch in sorted(args.batch):
        stream = Stream(vocab, ids, batch, args.steps, encoding, args.ids_per_step, args.lifetime, args.varied_ids)
        log(f"[{encoding} B={batch}] built {len(stream.frames)} steps ({stream.megabytes:.1f} MB, {len(stream.reqs)} requests, "
            f"{len(stream.steady_steps)} steps timed) in {stream.build_seconds:.1f}s")
        for name, proc in procs.items():
            # --freeze-gc: what SGLang's /freeze_gc endpoint makes its detokenizer do (gc.freeze()).
            proc.exchange([*stream.warmup, *([freeze_gc_req()] if args.freeze_gc else [])])
        first_text: dict[str, dict] = {}
        passes = []
        floors = None
        for r in range(args.rounds):
            order = ["sglang", "detokd", "detokd", "sglang"] if r % 2 == 0 else ["detokd", "sglang", "sglang", "detokd"]
            for slot, name in enumerate(order):
                for mode, window in (("latency", 1), ("throughput", args.window)):
                    p = run_pass(procs[name], stream, window)
                    texts, problems = check(stream, p.pop("answers"), p.pop("answers_due"))
                    answer_frames = p.pop("answer_frames")
                    if floors is None and name == "sglang":
                        floors = floor(stream, answer_frames)
                        log(f"[{encoding} B={batch}] floor " + " ".join(f"{k} {v:.2f}" for k, v in floors.items()))
                    first_text.setdefault(name, texts)
                    problems["same_as_first_pass"] = texts == first_text[name]
                    every = p.pop("latency_ms")
                    lat = [every[k] for k in stream.steady_steps]
                    passes.append(dict(target=name, mode=mode, round=r, slot=slot, lat=lat, every=every, **p, **problems))
                    log(f"[{encoding} B={batch}] r{r} {name:6} {mode:10} {p['tokens_per_s']:>9.0f} tok/s "
                        f"p50 {pct(lat, 50):6.2f} ms p99 {pct(lat, 99):6.2f} ms cpu {p['cpu_us_per_token']:5.2f} us/tok {p['cpu_us_per_row']:5.2f} us/row "
                        f"off-oracle {problems['off_oracle']} load {p['loadavg_1m']:.1f}"
                        + (f" by process {by_process(p)}" if len(p["cpu_s_by_process"]) > 1 else ""))
        agree = first_text["sglang"] == first_text["detokd"]
        differing = sum(1 for rid in first_text["sglang"] if first_text["sglang"][rid] != first_text["detokd"].get(rid))
        for name, proc in procs.items():
            mem = [memory(p.pid) for p in proc.processes]
            for mode in ("latency", "throughput"):
                mine = [p for p in passes if p["target"] == name and p["mode"] == mode]
                lat = [x for p in mine for x in p["lat"]]
                every = [x for p in mine for x in p["every"]]
                results.append(dict(
                    encoding=encoding, batch=batch, steps=args.steps, ids_per_step=args.ids_per_step, varied_ids=args.varied_ids, lifetime=args.lifetime,
                    requests=len(stream.reqs), rows=stream.rows, target=name,
                    mode=mode, freeze_gc=args.freeze_gc,
                    window=1 if mode == "latency" else args.window, passes=len(mine),
                    tokens_per_s_median=statistics.median(p["tokens_per_s"] for p in mine),
                    tokens_per_s_all=[p["tokens_per_s"] for p in mine],
                    loadavg_1m_per_pass=[p["loadavg_1m"] for p in mine],
                    latency_ms_p50=pct(lat, 50), latency_ms_p99=pct(lat, 99), latency_ms_max=max(lat),
                    latency_steps=len(stream.steady_steps), latency_ms_p99_every_step=pct(every, 99),
                    cpu_us_per_token=sum(p["cpu_s"] for p in mine) / sum(p["tokens"] for p in mine) * 1e6,
                    cpu_us_per_row=sum(p["cpu_s"] for p in mine) / sum(p["rows"] for p in mine) * 1e6,
                    cpu_us_per_row_by_process={
                        who: sum(p["cpu_s_by_process"][who] for p in mine) / (len(mine) * stream.rows) * 1e6
                        for who in mine[0]["cpu_s_by_process"]
                    },
                    detokenizers=proc.detokenizers, detokenizers_asked=args.detokenizers,
                    **floors,
                    vm_hwm_mb=sum(m.hwm_kb for m in mem) / 1024, vm_rss_mb=sum(m.rss_kb for m in mem) / 1024,
                    text_equal_across_targets=agree, rids_differing_across_targets=differing,
                    off_oracle=sum(p["off_oracle"] for p in mine),
                    off_oracle_examples=[x for p in mine for x in p["off_oracle_examples"]][:3],
                    one_answer_per_step=all(p["one_answer_per_step"] for p in mine),
                    unfinished=sum(p["unfinished"] for p in mine),
                    same_text_every_pass=all(p["same_as_first_pass"] for p in mine),
                    build_seconds=stream.build_seconds, stream_mb=stream.megabytes,
                ))
        raw += [dict(encoding=encoding, batch=batch, **{k: v for k, v in p.items() if k not in ("lat", "every")},
                     latency_ms=[round(x, 3) for x in p["every"]]) for p in passes]
        log(f"[{encoding} B={batch}] texts equal across targets: {agree} ({differing} rids differ)")
    return results


def environment() -> dict:
    import sglang

    from detokd import __version__

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    # The CPU model: detokd's per-row work is bound by memory, so its gain depends on the host's caches.
    return dict(python=platform.python_version(), machine=platform.machine(), cpus=os.cpu_count(), cpu=machine().get("cpu"),
                sglang=sglang.__version__, detokd=__version__, commit=commit, tokenizer=TOKENIZER)


def label(r: dict) -> str:
    """A result's target with its layout: N processes behind SGLang's router, or detokd's
    one process for N asked."""
    target = r["target"] + (f" ×{r['detokenizers']} + router" if r.get("detokenizers", 1) > 1 else "")
    if r.get("detokenizers_asked", 1) > 1 and r.get("detokenizers", 1) == 1:
        target += f" (one process for {r['detokenizers_asked']})"
    return target


def table(results: list[dict]) -> str:
    rows = md_head("encoding", "ids/step", "B", "target", "mode", "tokens/s", "p50 ms", "p99 ms", "max ms", "CPU us/token",
                   "CPU us/row", "floor us/row", "VmHWM MB", "text ok")
    for r in results:
        ok = r["text_equal_across_targets"] and not r["off_oracle"] and r["one_answer_per_step"] and r["same_text_every_pass"]
        floor_row = f"{r['floor_us_per_row']:.2f}" + (f" (raw {r['floor_raw_us_per_row']:.2f})" if "floor_raw_us_per_row" in r else "")
        target = label(r)
        rows.append(f"| {r['encoding']} | {'1-' if r.get('varied_ids') else ''}{r['ids_per_step']} | {r['batch']} | {target} | {r['mode']}"
                    f"{'' if r['mode'] == 'latency' else ' (w=' + str(r['window']) + ')'} | {r['tokens_per_s_median']:,.0f} | "
                    f"{r['latency_ms_p50']:.2f} | {r['latency_ms_p99']:.2f} | {r['latency_ms_max']:.2f} | "
                    f"{r['cpu_us_per_token']:.2f} | {r['cpu_us_per_row']:.2f} | {floor_row} | {r['vm_hwm_mb']:.0f} | {'yes' if ok else 'NO'} |")
    return "\n".join(rows)


def stream_of(args: dict, sglang: dict, detokd: dict) -> str:
    """How a recorded run's stream was made and served, in a few words."""
    k = args.get("ids_per_step", 1)
    words = [f"{'1-' if args.get('varied_ids') else ''}{k} id{'s' if k > 1 else ''}"]
    words.append(f"L = {args['lifetime']}" if args.get("lifetime") else "all at once")
    if args.get("freeze_gc"):
        words.append("GC frozen")
    if sglang.get("detokenizers", 1) > 1:
        words.append(f"N = {sglang['detokenizers']}" + (", detokd's behind the router too" if detokd.get("detokenizers", 1) > 1 else ""))
    return ", ".join(words)


def _rates(results: tuple[dict, ...]) -> str:
    return " / ".join(f"{r['tokens_per_s_median']:,.0f}" for r in results)


def summary(paths: list[str]) -> str:
    """One row per recorded run, IPC and batch size: the figures the docs quote, read
    back from the JSON files that hold them (medians of the passes; p99 pooled)."""
    rows = md_head("run", "commit", "CPU", "stream", "IPC", "B", "SGLang tokens/s, 1 / 8 in flight",
                   "detokd tokens/s, 1 / 8 in flight", "gain", "detokd p50 / p99, ms", "CPU µs/row: SGLang / detokd / floor")
    for path in paths:
        doc = json.loads(Path(path).read_text())
        if "results" not in doc:  # another command's JSON beside them (sglang-aging's)
            log(f"{path}: not a sglang-bench run, left out")
            continue
        got = {(r["encoding"], r["batch"], r["target"], r["mode"]): r for r in doc["results"]}
        for encoding, batch in sorted({(e, b) for e, b, _, _ in got}, key=lambda c: (c[0] != "pickle", c[1])):
            s, d = (tuple(got.get((encoding, batch, t, m)) for m in ("latency", "throughput")) for t in ("sglang", "detokd"))
            if None in (*s, *d):
                continue  # a run cut short: only whole cases are quoted
            gain = " / ".join(f"{dr['tokens_per_s_median'] / sr['tokens_per_s_median']:.1f}×" for sr, dr in zip(s, d))
            rows.append(f"| {Path(path).name} | {doc['environment'].get('commit', '?')} | {doc['environment'].get('cpu') or '—'} | {stream_of(doc['args'], s[0], d[0])} | {encoding} "
                        f"| {batch} | {_rates(s)} | {_rates(d)} | {gain} | {d[0]['latency_ms_p50']:.2f} / {d[0]['latency_ms_p99']:.2f} "
                        f"| {s[0]['cpu_us_per_row']:.1f} / {d[0]['cpu_us_per_row']:.2f} / {d[0]['floor_us_per_row']:.2f} |")
    return "\n".join(rows)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["encoding"], r["batch"]) for r in results})
    labels = [f"{e}\nB={b}" for e, b in cases]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [("throughput", "tokens_per_s_median", "tokens/s (pipelined)"),
              ("latency", "latency_ms_p50", "step latency p50 (ms), one step in flight"),
              ("latency", "latency_ms_p99", "step latency p99 (ms), one step in flight")]
    width = 0.38
    for ax, (mode, key, title) in zip(axes, panels):
        for k, target in enumerate(TARGETS):
            val = {(r["encoding"], r["batch"]): r[key] for r in results if r["target"] == target and r["mode"] == mode}
            xs = [i + (k - 0.5) * width for i in range(len(cases))]
            bars = ax.bar(xs, [val[c] for c in cases], width, label=label(next(r for r in results if r["target"] == target)))
            ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.set_xticks(range(len(cases)), labels)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    per_step = results[0].get("ids_per_step", 1)
    per_step = f"1-{per_step} ids" if results[0].get("varied_ids") else f"{per_step} id"
    fig.suptitle(f"detokd vs SGLang's detokenizer process, SGLang's own stream (DeepSeek tokenizer, {per_step}/request/step)"
                 + (f", requests {results[0]['lifetime']} steps long, staggered" if results[0].get("lifetime") else "")
                 + (", GC frozen" if any(r.get("freeze_gc") for r in results) else ""), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> int:
    ap = parser("sglang-bench", __doc__)
    ap.add_argument("--batch", type=int, nargs="+", default=[256, 1024], help="concurrent requests (default 256 1024)")
    ap.add_argument("--steps", type=int, default=300, help="decode steps per pass (default 300)")
    ap.add_argument("--lifetime", type=int, metavar="L", help="steps each request lives, staggered as under continuous "
                    "batching (default: all B start at the first step and finish at the last)")
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds per batch size (default 2: 4 passes per target and mode)")
    ap.add_argument("--ids-per-step", type=int, default=1, help="new ids per request per step (default 1; speculative "
                    "decoding: 2-8)")
    ap.add_argument("--varied-ids", action="store_true", help="with --ids-per-step K: 1 to K per request and step (seeded)")
    ap.add_argument("--detokd-router", action="store_true", help="with --detokenizers N > 1, N detokd processes "
                    "behind SGLang's router too (DETOKD_SGLANG_ROUTER=1), not the plugin's one process")
    ap.add_argument("--detokenizers", type=int, default=1, help="SGLang's --detokenizer-worker-num (default 1), against "
                    "detokd as the plugin serves it (one process)")
    ap.add_argument("--window", type=int, default=8, help="steps in flight in the throughput mode (default 8)")
    ap.add_argument("--encodings", nargs="+", choices=["pickle", "msgpack"], default=["pickle", "msgpack"],
                    help="SGLang IPC encodings (SGLANG_USE_PICKLE_IPC), each with its own pair of processes")
    ap.add_argument("--freeze-gc", action="store_true", help="after the warm-up, send both a FreezeGCReq, as SGLang's "
                    "/freeze_gc does (off by default, as in SGLang)")
    ap.add_argument("--json", metavar="PATH", help="write the environment, arguments, summary and every pass here")
    ap.add_argument("--plot", metavar="PATH", help="write a PNG chart (needs matplotlib; or --plot-only later)")
    ap.add_argument("--plot-only", metavar="JSON", help="only draw --plot from an earlier --json file (any python with matplotlib)")
    ap.add_argument("--summary", metavar="JSON", nargs="+", help="only print the table of earlier --json files (any python)")
    args = ap.parse_args(argv)
    if args.lifetime is not None and not 1 <= args.lifetime <= args.steps // 2:
        ap.error(f"--lifetime must be 1 to half of --steps ({args.steps}): the batch is full only after one lifetime "
                 "and until the last request that fits has started")

    if args.summary:
        print(summary(args.summary))
        return 0
    if args.plot_only:
        plot(json.loads(Path(args.plot_only).read_text())["results"], args.plot)
        return 0
    t_start = time.perf_counter()
    vocab = load(TOKENIZER)
    ids = vocab.hf.encode(corpus(), add_special_tokens=False)
    folder = zoo.build(TOKENIZER)
    # detokd serves --detokenizer-worker-num N as the plugin does: one process, unless asked otherwise.
    count = {"sglang": args.detokenizers, "detokd": args.detokenizers if args.detokd_router else 1}
    procs = {enc: {name: SglangDetokenizerUnderTest(folder, encoding=enc, detokenizers=count[name], target=fn).start()
                   for name, fn in TARGETS.items()}
             for enc in args.encodings}
    results, raw, failure = [], [], None
    try:
        for enc in args.encodings:
            results += bench_encoding(enc, procs[enc], vocab, ids, args, raw)
    except Exception as e:  # a crash, a hang, an impossible answer: report it with what was measured so far
        failure = f"{type(e).__name__}: {e}"
        log(f"FAILED: {failure}")
    finally:
        for pair in procs.values():
            for p in pair.values():
                p.close()
    doc = dict(command=command_line("sglang-bench", argv), environment=environment(), args={k: v for k, v in vars(args).items() if k != "plot_only"},
               corpus_ids=len(ids), seconds=time.perf_counter() - t_start, failure=failure, results=results,
               passes=raw)
    if args.json:
        write_json(args.json, doc)
    if results:
        print(table(results))
    if args.plot and results:
        try:
            plot(results, args.plot)
        except ImportError:
            log(f"matplotlib missing: draw it later with --plot-only {args.json} --plot {args.plot}")
    log(f"total {doc['seconds']:.0f}s")
    return 1 if failure else 0

