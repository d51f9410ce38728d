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
import pickle
import random
import statistics
import time
from collections import deque
from functools import partial
from pathlib import Path
from typing import Any, Callable

from detokd import zoo
from detokd.sglang.process import run_sglang_detokenizer as detokd_target
from detokd.tokenizer import load
from detokrig import sglang_replay as replay
from detokrig.corpus import corpus
from detokrig.proc import cpu_s, descendants, loadavg, memory

from .bench.report import log, md_head, pct
from .commands import command_line, commit, machine, parser, pyplot, versions, write_json

TARGETS = {"sglang": None, "detokd": detokd_target}
PROMPT = 5  # prompt ids per request: SGLang's incremental-detokenization context
TOKENIZER = "deepseek"
ANSWER_TIMEOUT = 60.0  # seconds without an answer before the pass counts as hung


# --- the stream ------------------------------------------------------------------------


def requests(ids: list[int], batch: int, steps: int, tag: str, per_step: int = 1,
             lifetime: int | None = None, varied: bool = False) -> list[replay.Scripted]:
    """B requests over the corpus ids (a ring), each from its own offset, `per_step` new
    ids each step (speculative decoding: SGLang's scheduler appends them all at once), or
    with `varied` 1 to `per_step` of them, drawn per request and step (seeded): the draft
    tokens speculative decoding accepts vary.

    lifetime None: all B live the whole stream. lifetime L: B slots, each running
    requests of L steps back to back, slot s's first starting at step s*L//B, so ~B/L
    requests start and ~B/L finish every step, as under continuous batching; no slot
    starts a request that would outlast the stream, so B are live from step L-1 to the
    last full lifetime's end and fewer at either end (`steady_steps`)."""
    spans = [(0, steps)] * batch if lifetime is None else [  # (first step, steps) of each request
        (t, lifetime) for s in range(batch) for t in range(s * lifetime // batch, steps - lifetime + 1, lifetime)
    ]
    ring = ids * (2 + ((lifetime or steps) * per_step + PROMPT) // len(ids))
    out = []
    for i, (first, n_steps) in enumerate(spans):
        draw = random.Random(i).randint
        chunks = [draw(1, per_step) if varied else per_step for _ in range(n_steps)]
        at = PROMPT + (i * 97) % len(ids)  # 97 is prime to the corpus length: distinct offsets
        out.append(replay.Scripted(rid=f"{tag}{i}", prompt_ids=ring[at - PROMPT : at],
                                   output_ids=ring[at : at + sum(chunks)], chunks=None if per_step == 1 else chunks,
                                   first_step=first))
    return out


def sglang_codec(encoding: replay.Encoding) -> tuple[Callable[[Any], bytes], Callable[[bytes], Any]]:
    """(encode, decode) of one message as SGLang's sock_send and sock_recv do them; call
    them under ipc_encoding(encoding)."""
    from sglang.srt.managers.io_struct import msgpack_decode, msgpack_encode

    if encoding == "pickle":
        return partial(pickle.dumps, protocol=pickle.HIGHEST_PROTOCOL), pickle.loads
    return msgpack_encode, msgpack_decode


def decode(frames: list[bytes], encoding: replay.Encoding) -> list:
    with replay.ipc_encoding(encoding):
        return list(map(sglang_codec(encoding)[1], frames))


class Stream:
    """One batch size's prebuilt frames under one encoding, and what they must add up to."""

    def __init__(self, vocab, ids: list[int], batch: int, steps: int, encoding: replay.Encoding, per_step: int = 1,
                 lifetime: int | None = None, varied: bool = False):
        self.encoding = encoding
        t0 = time.perf_counter()
        self.reqs = requests(ids, batch, steps, "r", per_step, lifetime, varied)
        self.tokens = sum(len(s.output_ids) for s in self.reqs)
        messages = replay.build_stream(self.reqs, encoding=encoding)
        self.step_rids = [list(m.rids) for m in messages]
        self.rows = sum(map(len, self.step_rids))
        # The steps whose latency the percentiles take: every step of the streams that
        # start and finish together; the steps with all B live of a staggered one (the
        # ramps up and down carry fewer rows, so they would flatter its tail).
        self.steady_steps = [k for k, rids in enumerate(self.step_rids) if lifetime is None or len(rids) == batch]
        with replay.ipc_encoding(encoding):
            self.frames = list(map(sglang_codec(encoding)[0], messages))
        self.warmup = replay.build_stream(requests(ids, batch, 8, "warm", per_step, varied=varied), encoding=encoding)
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
                    by.setdefault(replay.route(None, r, detokenizers), []).append(r)
                steps.append(by)
            self._answers_due[detokenizers] = steps
        return self._answers_due[detokenizers]


# --- one pass ---------------------------------------------------------------------------


class Hung(RuntimeError):
    pass


def run_pass(proc: replay.SglangDetokenizerUnderTest, stream: Stream, window: int) -> dict:
    """Send the whole stream with at most `window` steps unanswered; time every step; then
    check the answers (`check`: its figures join the pass's; `texts` and `answer_frames`
    are for the caller to pop)."""
    push, pull = proc._push, proc._pulls[0]
    pids = {p.name: p.pid for p in proc.processes}
    n, detokenizers = len(stream.frames), proc.detokenizers
    due = stream.answers_due(detokenizers)
    owed: list[deque] = [deque() for _ in range(detokenizers)]  # per detokenizer, the steps it has yet to answer
    left = [len(d) for d in due]  # answers each step waits for
    sent_at, latency_ns = [0] * n, [0] * n
    got: list[bytes] = []
    keys: list[tuple[int, int]] = []  # (step, detokenizer) of each answer
    expected = sum(left)
    gc.collect()
    gc.disable()
    load = loadavg()
    # Each process with its descendants: detokd's SGLang mode decodes in a child of the
    # process SGLang starts, which only supervises it.
    trees = {name: descendants(pid) for name, pid in pids.items()}
    cpu0 = {name: cpu_s(tree) for name, tree in trees.items()}
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
                d = 0 if detokenizers == 1 else replay.route(None, decode([frame], stream.encoding)[0].rids[0],
                                                             detokenizers)
                k = owed[d].popleft()
                got.append(frame)
                keys.append((k, d))
                left[k] -= 1
                if not left[k]:
                    latency_ns[k] = at - sent_at[k]
                    completed += 1
    finally:
        wall = (time.perf_counter_ns() - t0) / 1e9
        cpu_by = {name: cpu_s(tree) - cpu0[name] for name, tree in trees.items()}
        gc.enable()
    if pull.poll(200):
        raise AssertionError(f"more answers than due ({expected}): the step accounting would be wrong")
    cpu = sum(cpu_by.values())
    # Each answer against the rows it should hold: the rids of its step routed to its detokenizer.
    texts, problems = check(stream, decode(got, stream.encoding), [due[k][d] for k, d in keys])
    return dict(
        wall_s=wall, rows=stream.rows, tokens=stream.tokens, tokens_per_s=stream.tokens / wall, cpu_s=cpu,
        cpu_us_per_token=cpu / stream.tokens * 1e6, cpu_us_per_row=cpu / stream.rows * 1e6, cpu_s_by_process=cpu_by,
        processes_measured={name: len(tree) for name, tree in trees.items()},
        loadavg_1m=load, latency_ms=[x / 1e6 for x in latency_ns], **problems, texts=texts, answer_frames=got,
    )


def check(stream: Stream, answers: list, due: list[list[str]]) -> tuple[dict[str, str], dict]:
    """Per rid text, and the problems: answers without the rows due (one answer per step
    and detokenizer), texts off the oracle."""
    shape = [list(a.rids) for a in answers] == due and all(type(a).__name__ == "BatchStrOutput" for a in answers)
    texts: dict[str, str] = {}
    finished: dict[str, Any] = {}  # each rid's last finished reason
    for a in answers:
        if type(a).__name__ == "BatchStrOutput":  # (the stream's rids are all distinct: no reuse to follow)
            for rid, text, reason in zip(a.rids, a.output_strs, a.finished_reasons, strict=True):
                texts[rid] = texts.get(rid, "") + text
                finished[rid] = reason
    unfinished = sum(1 for reason in finished.values() if reason is None)
    wrong = [rid for rid, want in stream.oracle.items() if texts.get(rid) != want]
    return texts, dict(one_answer_per_step=shape, rids=len(texts), unfinished=unfinished, off_oracle=len(wrong),
                       off_oracle_examples=wrong[:3])


def floor(stream: Stream, answer_frames: list[bytes], reps: int = 3) -> dict:
    """The encoding's floor, CPU per row (best of `reps`, this process): decoding the
    stream's frames and encoding the same answers with nothing else done. "floor":
    SGLang's own (sock_recv's and sock_send's: pickle, or io_struct's msgpack with every
    field a Python object); "floor_raw" (msgpack): detokd's schema Structs, whose copied
    fields stay msgpack bytes."""
    import msgspec

    from detokd.sglang import schema

    out = {}
    with replay.ipc_encoding(stream.encoding):
        encode, decode_one = sglang_codec(stream.encoding)
        ways = {"floor": (decode_one, encode, decode_one)}  # decode a frame, encode an answer, decode an answer
        if stream.encoding == "msgpack":
            raw = schema.MsgpackCodec()
            ways["floor_raw"] = (raw.decode, raw.encode, msgspec.msgpack.Decoder(schema.BatchStrOutput).decode)
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
            out[f"{key}_decode_us_per_row"] = best_dec / stream.rows * 1e6
            out[f"{key}_encode_us_per_row"] = best_enc / stream.rows * 1e6
            out[f"{key}_us_per_row"] = (best_dec + best_enc) / stream.rows * 1e6
        gc.enable()
    return out


# --- the run ----------------------------------------------------------------------------


def abba(stream: Stream, procs: dict, args, case: str) -> tuple[list[dict], dict[str, dict], dict]:
    """args.rounds ABBA rounds of both modes: every pass, each target's texts of its first
    pass, and the floor (measured on SGLang's first answers)."""
    first_text: dict[str, dict] = {}
    passes: list[dict] = []
    floors: dict = {}
    for r in range(args.rounds):
        order = ["sglang", "detokd", "detokd", "sglang"] if r % 2 == 0 else ["detokd", "sglang", "sglang", "detokd"]
        for slot, name in enumerate(order):
            for mode, window in (("latency", 1), ("throughput", args.window)):
                p = run_pass(procs[name], stream, window)
                texts, answer_frames, every = p.pop("texts"), p.pop("answer_frames"), p.pop("latency_ms")
                if not floors and name == "sglang":
                    floors = floor(stream, answer_frames)
                    log(f"{case} floor " + " ".join(f"{k} {v:.2f}" for k, v in floors.items()))
                p["same_as_first_pass"] = texts == first_text.setdefault(name, texts)
                lat = [every[k] for k in stream.steady_steps]
                passes.append(dict(target=name, mode=mode, round=r, slot=slot, lat=lat, every=every, **p))
                by = p["cpu_s_by_process"]
                log(f"{case} r{r} {name:6} {mode:10} {p['tokens_per_s']:>9.0f} tok/s p50 {pct(lat, 50):6.2f} ms "
                    f"p99 {pct(lat, 99):6.2f} ms cpu {p['cpu_us_per_token']:5.2f} us/tok "
                    f"{p['cpu_us_per_row']:5.2f} us/row off-oracle {p['off_oracle']} load {p['loadavg_1m']:.1f}"
                    + (" by process " + " ".join(f"{who} {cpu / p['rows'] * 1e6:.2f}" for who, cpu in by.items())
                       if len(by) > 1 else ""))
    return passes, first_text, floors


def pooled(mine: list[dict], stream: Stream) -> dict:
    """One target's passes of one mode: medians of the passes, the percentiles over their
    steps, CPU over all of them, every problem counted."""
    lat = [x for p in mine for x in p["lat"]]
    cpu = sum(p["cpu_s"] for p in mine)
    rates = [p["tokens_per_s"] for p in mine]
    return dict(
        passes=len(mine), tokens_per_s_median=statistics.median(rates), tokens_per_s_all=rates,
        loadavg_1m_per_pass=[p["loadavg_1m"] for p in mine],
        latency_ms_p50=pct(lat, 50), latency_ms_p99=pct(lat, 99), latency_ms_max=max(lat),
        latency_steps=len(stream.steady_steps),
        latency_ms_p99_every_step=pct([x for p in mine for x in p["every"]], 99),
        cpu_us_per_token=cpu / sum(p["tokens"] for p in mine) * 1e6,
        cpu_us_per_row=cpu / sum(p["rows"] for p in mine) * 1e6,
        cpu_us_per_row_by_process={
            who: sum(p["cpu_s_by_process"][who] for p in mine) / (len(mine) * stream.rows) * 1e6
            for who in mine[0]["cpu_s_by_process"]
        },
        processes_measured=mine[0]["processes_measured"],
        off_oracle=sum(p["off_oracle"] for p in mine),
        off_oracle_examples=[x for p in mine for x in p["off_oracle_examples"]][:3],
        one_answer_per_step=all(p["one_answer_per_step"] for p in mine), unfinished=sum(p["unfinished"] for p in mine),
        same_text_every_pass=all(p["same_as_first_pass"] for p in mine),
    )


def bench_encoding(encoding: replay.Encoding, procs: dict, vocab, ids, args, raw: list[dict]) -> list[dict]:
    from sglang.srt.managers.io_struct import FreezeGCReq

    results = []
    for batch in sorted(args.batch):
        case = f"[{encoding} B={batch}]"
        stream = Stream(vocab, ids, batch, args.steps, encoding, args.ids_per_step, args.lifetime, args.varied_ids)
        log(f"{case} built {len(stream.frames)} steps ({stream.megabytes:.1f} MB, {len(stream.reqs)} requests, "
            f"{len(stream.steady_steps)} steps timed) in {stream.build_seconds:.1f}s")
        for proc in procs.values():
            # --freeze-gc: what SGLang's /freeze_gc endpoint makes its detokenizer do (gc.freeze()).
            proc.exchange([*stream.warmup, *([FreezeGCReq()] if args.freeze_gc else [])])
        passes, first_text, floors = abba(stream, procs, args, case)
        agree = first_text["sglang"] == first_text["detokd"]
        differing = sum(1 for rid, text in first_text["sglang"].items() if text != first_text["detokd"].get(rid))
        for name, proc in procs.items():
            mem = [memory(p.pid) for p in proc.processes]
            for mode in ("latency", "throughput"):
                results.append(dict(
                    encoding=encoding, batch=batch, steps=args.steps, ids_per_step=args.ids_per_step,
                    varied_ids=args.varied_ids, lifetime=args.lifetime, requests=len(stream.reqs), rows=stream.rows,
                    target=name, mode=mode, freeze_gc=args.freeze_gc, window=1 if mode == "latency" else args.window,
                    **pooled([p for p in passes if p["target"] == name and p["mode"] == mode], stream),
                    detokenizers=proc.detokenizers, detokenizers_asked=args.detokenizers, **floors,
                    vm_hwm_mb=sum(m.hwm_kb for m in mem) / 1024, vm_rss_mb=sum(m.rss_kb for m in mem) / 1024,
                    text_equal_across_targets=agree, rids_differing_across_targets=differing,
                    build_seconds=stream.build_seconds, stream_mb=stream.megabytes,
                ))
        raw += [dict(encoding=encoding, batch=batch, **{k: v for k, v in p.items() if k not in ("lat", "every")},
                     latency_ms=[round(x, 3) for x in p["every"]]) for p in passes]
        log(f"{case} texts equal across targets: {agree} ({differing} rids differ)")
    return results


def environment() -> dict:
    """The run's host and versions, SGLang's among them (--summary reads `commit` and `cpu`)."""
    import sglang

    return dict(**versions(), **machine(), sglang=sglang.__version__, commit=commit(), tokenizer=TOKENIZER)


# --- tables and the plot ----------------------------------------------------------------


def label(r: dict) -> str:
    """A result's target with its layout: N processes behind SGLang's router, or detokd's
    one process for N asked."""
    target = r["target"] + (f" ×{r['detokenizers']} + router" if r.get("detokenizers", 1) > 1 else "")
    if r.get("detokenizers_asked", 1) > 1 and r.get("detokenizers", 1) == 1:
        target += f" (one process for {r['detokenizers_asked']})"
    return target


def ids_per_step(args: dict) -> str:
    return f"{'1-' if args.get('varied_ids') else ''}{args.get('ids_per_step', 1)}"


def md_row(*cells: object) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def table(results: list[dict]) -> str:
    rows = md_head("encoding", "ids/step", "B", "target", "mode", "tokens/s", "p50 ms", "p99 ms", "max ms",
                   "CPU us/token", "CPU us/row", "floor us/row", "VmHWM MB", "text ok")
    figures = ("latency_ms_p50", "latency_ms_p99", "latency_ms_max", "cpu_us_per_token", "cpu_us_per_row")
    for r in results:
        checks = ("text_equal_across_targets", "one_answer_per_step", "same_text_every_pass")
        ok = all(r[k] for k in checks) and not r["off_oracle"]
        raw = f" (raw {r['floor_raw_us_per_row']:.2f})" if "floor_raw_us_per_row" in r else ""
        mode = r["mode"] if r["mode"] == "latency" else f"{r['mode']} (w={r['window']})"
        rows.append(md_row(r["encoding"], ids_per_step(r), r["batch"], label(r), mode,
                           f"{r['tokens_per_s_median']:,.0f}", *(f"{r[k]:.2f}" for k in figures),
                           f"{r['floor_us_per_row']:.2f}{raw}", f"{r['vm_hwm_mb']:.0f}", "yes" if ok else "NO"))
    return "\n".join(rows)


def stream_of(args: dict, sglang: dict, detokd: dict) -> str:
    """How a recorded run's stream was made and served, in a few words."""
    words = [f"{ids_per_step(args)} id{'s' if args.get('ids_per_step', 1) > 1 else ''}"]
    words.append(f"L = {args['lifetime']}" if args.get("lifetime") else "all at once")
    if args.get("freeze_gc"):
        words.append("GC frozen")
    if sglang.get("detokenizers", 1) > 1:
        both = ", detokd's behind the router too" if detokd.get("detokenizers", 1) > 1 else ""
        words.append(f"N = {sglang['detokenizers']}{both}")
    return ", ".join(words)


def summary(paths: list[str]) -> str:
    """One row per recorded run, IPC and batch size: the figures the docs quote, read
    back from the JSON files that hold them (medians of the passes; p99 pooled)."""
    rows = md_head("run", "commit", "CPU", "stream", "IPC", "B", "SGLang tokens/s, 1 / 8 in flight",
                   "detokd tokens/s, 1 / 8 in flight", "gain", "detokd p50 / p99, ms",
                   "CPU µs/row: SGLang / detokd / floor")
    for path in paths:
        doc = json.loads(Path(path).read_text())
        if "results" not in doc:  # another command's JSON beside them (sglang-aging's)
            log(f"{path}: not a sglang-bench run, left out")
            continue
        got = {(r["encoding"], r["batch"], r["target"], r["mode"]): r for r in doc["results"]}
        env = doc["environment"]
        for encoding, batch in sorted({(e, b) for e, b, _, _ in got}, key=lambda c: (c[0] != "pickle", c[1])):
            s, d = ([got.get((encoding, batch, t, m)) for m in ("latency", "throughput")] for t in ("sglang", "detokd"))
            if None in (*s, *d):
                continue  # a run cut short: only whole cases are quoted
            speeds = [[r["tokens_per_s_median"] for r in pair] for pair in (s, d)]
            rates = [" / ".join(f"{x:,.0f}" for x in xs) for xs in speeds]
            gain = " / ".join(f"{b / a:.1f}×" for a, b in zip(*speeds, strict=True))
            rows.append(md_row(
                Path(path).name, env.get("commit", "?"), env.get("cpu") or "—", stream_of(doc["args"], s[0], d[0]),
                encoding, batch, *rates, gain, f"{d[0]['latency_ms_p50']:.2f} / {d[0]['latency_ms_p99']:.2f}",
                f"{s[0]['cpu_us_per_row']:.1f} / {d[0]['cpu_us_per_row']:.2f} / {d[0]['floor_us_per_row']:.2f}"))
    return "\n".join(rows)


def plot(results: list[dict], path: str) -> bool:
    """The PNG of a run's results; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    cases = sorted({(r["encoding"], r["batch"]) for r in results})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [("throughput", "tokens_per_s_median", "tokens/s (pipelined)"),
              ("latency", "latency_ms_p50", "step latency p50 (ms), one step in flight"),
              ("latency", "latency_ms_p99", "step latency p99 (ms), one step in flight")]
    width = 0.38
    for ax, (mode, key, title) in zip(axes, panels, strict=True):
        for k, target in enumerate(TARGETS):
            mine = [r for r in results if r["target"] == target]
            val = {(r["encoding"], r["batch"]): r[key] for r in mine if r["mode"] == mode}
            xs = [i + (k - 0.5) * width for i in range(len(cases))]
            bars = ax.bar(xs, [val[c] for c in cases], width, label=label(mine[0]))
            ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.set_xticks(range(len(cases)), [f"{e}\nB={b}" for e, b in cases])
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    first = results[0]
    per_step = f"{ids_per_step(first)} id{'s' if first.get('varied_ids') else ''}"
    fig.suptitle(f"detokd vs SGLang's detokenizer process, SGLang's own stream (DeepSeek tokenizer, "
                 f"{per_step}/request/step)"
                 + (f", requests {first['lifetime']} steps long, staggered" if first.get("lifetime") else "")
                 + (", GC frozen" if any(r.get("freeze_gc") for r in results) else ""), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def arguments(argv: list[str]):
    ap = parser("sglang-bench", __doc__)
    ap.add_argument("--batch", type=int, nargs="+", default=[256, 1024], help="concurrent requests (default 256 1024)")
    ap.add_argument("--steps", type=int, default=300, help="decode steps per pass (default 300)")
    ap.add_argument("--lifetime", type=int, metavar="L", help="steps each request lives, staggered as under "
                    "continuous batching (default: all B start at the first step and finish at the last)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="ABBA rounds per batch size (default 2: 4 passes per target and mode)")
    ap.add_argument("--ids-per-step", type=int, default=1,
                    help="new ids per request per step (default 1; speculative decoding: 2-8)")
    ap.add_argument("--varied-ids", action="store_true",
                    help="with --ids-per-step K: 1 to K per request and step (seeded)")
    ap.add_argument("--detokd-router", action="store_true", help="with --detokenizers N > 1, N detokd processes "
                    "behind SGLang's router too (DETOKD_SGLANG_ROUTER=1), not the plugin's one process")
    ap.add_argument("--detokenizers", type=int, default=1, help="SGLang's --detokenizer-worker-num (default 1), "
                    "against detokd as the plugin serves it (one process)")
    ap.add_argument("--window", type=int, default=8, help="steps in flight in the throughput mode (default 8)")
    ap.add_argument("--encodings", nargs="+", choices=["pickle", "msgpack"], default=["pickle", "msgpack"],
                    help="SGLang IPC encodings (SGLANG_USE_PICKLE_IPC), each with its own pair of processes")
    ap.add_argument("--freeze-gc", action="store_true", help="after the warm-up, send both a FreezeGCReq, as "
                    "SGLang's /freeze_gc does (off by default, as in SGLang)")
    ap.add_argument("--json", metavar="PATH", help="write the environment, arguments, summary and every pass here")
    ap.add_argument("--plot", metavar="PATH", help="write a PNG chart (needs matplotlib; or --plot-only later)")
    ap.add_argument("--plot-only", metavar="JSON",
                    help="only draw --plot from an earlier --json file (any python with matplotlib)")
    ap.add_argument("--summary", metavar="JSON", nargs="+",
                    help="only print the table of earlier --json files (any python)")
    args = ap.parse_args(argv)
    if args.lifetime is not None and not 1 <= args.lifetime <= args.steps // 2:
        ap.error(f"--lifetime must be 1 to half of --steps ({args.steps}): the batch is full only after one "
                 "lifetime and until the last request that fits has started")
    return args


def main(argv: list[str]) -> int:
    args = arguments(argv)
    if args.summary:
        print(summary(args.summary))
        return 0
    if args.plot_only:
        if plot(json.loads(Path(args.plot_only).read_text())["results"], args.plot):
            return 0
        log("matplotlib is not installed: run --plot-only in a Python that has it")
        return 1
    t_start = time.perf_counter()
    vocab = load(TOKENIZER)
    ids = vocab.hf.encode(corpus(), add_special_tokens=False)
    folder = zoo.build(TOKENIZER)
    # detokd serves --detokenizer-worker-num N as the plugin does: one process, unless asked otherwise.
    count = {"sglang": args.detokenizers, "detokd": args.detokenizers if args.detokd_router else 1}
    procs = {enc: {name: replay.SglangDetokenizerUnderTest(folder, encoding=enc, detokenizers=count[name],
                                                           target=fn).start()
                   for name, fn in TARGETS.items()}
             for enc in args.encodings}
    results: list[dict] = []
    raw: list[dict] = []
    failure = None
    try:
        for enc in args.encodings:
            results += bench_encoding(enc, procs[enc], vocab, ids, args, raw)
    except Exception as e:  # a crash, a hang, an impossible answer: report it with what was measured so far
        failure = f"{type(e).__name__}: {e}"
        log(f"FAILED: {failure}")
    finally:
        for pair in procs.values():
            for proc in pair.values():
                proc.close()
    doc = dict(command=command_line("sglang-bench", argv), environment=environment(),
               args={k: v for k, v in vars(args).items() if k != "plot_only"}, corpus_ids=len(ids),
               seconds=time.perf_counter() - t_start, failure=failure, results=results, passes=raw)
    if args.json:
        write_json(args.json, doc)
    if results:
        print(table(results))
    if args.plot and results:
        if not plot(results, args.plot):
            log(f"matplotlib missing: draw it later with --plot-only {args.json} --plot {args.plot}")
    log(f"total {doc['seconds']:.0f}s")
    return 1 if failure else 0
