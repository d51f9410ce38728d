"""SGLang's Rust server against SGLang's Python front end with SGLang's own detokenizer
or detokd (issue 43), under SGLang's own bench_serving; with --exactness, which of the
three gives the oracle's text on the front-end cases (docs/sglang.md, "detokd or
SGLang's Rust server?").

Three setups, each SGLang's launch_server path around the stand-in scheduler
(detokrig/sglang_standin.py: no model; SGLang's own Req decides every finish and its
SchedulerOutputStreamer what each step sends; one step every --step-ms while requests run):

    rust    SGLANG_RUST_SERVER=1: the stand-in hosts SGLang's Rust server as SGLang's
            scheduler does (Scheduler.maybe_init_rust_server: RustServer.launch; drain,
            push_generation, control and health replies); the HTTP server, tokenizer
            and detokenizer are Rust threads in the scheduler's process
    sglang  SGLang's Python HTTP server and TokenizerManager, SGLang's detokenizer process
    detokd  the same with detokd's process as the detokenizer (DETOKD_SGLANG=1)

The load is `python -m sglang.bench_serving --backend sglang --dataset-name random-ids
--random-input-len 32 --random-output-len 256 --random-range-ratio 1 --max-concurrency C
--num-prompts N` (random-ids: prompts of random token ids, nothing downloaded; `random`
would fetch ShareGPT). The setups alternate (A B C C B A A B C ...) so drift hits all
alike; one server runs at a time and serves every concurrency once per start. Per load:
bench_serving's output tok/s, TTFT and ITL; the CPU of each process of the stack, and of
each thread of the Rust server's process by name, per 1,000 output tokens (/proc/PID/stat
and /proc/PID/task/TID/stat, sampled every 0.1 s); bench_serving's own CPU apart. The
window is the stand-in's: from the admission of the first measured request, for
bench_serving's duration. Every answer is checked: each text must equal the oracle's text
(the Hugging Face decode of the ids the stand-in emitted, in SGLang's prompt context) of
one measured request, each used once; a load with a failed request or a text off the
oracle fails the run and posts no figure.

--exactness sends the front-end cases (detokrig/sglang_cases.py, extended with SGLang's
own fields on /v1/completions and engine aborts) through each setup, on each of
--tokenizers, and records per case class how many answers equal the oracle, the finish
each client saw, and the fields the client sent that the scheduler never got.

    python -m detokbench rust-bench --json docs/bench/rust-server.json --plot docs/bench/rust-server.png
    python -m detokbench rust-bench --exactness --json docs/bench/rust-server-exactness.json
    python -m detokbench rust-bench --summary docs/bench/rust-server*.json   # the tables again

In SGLang's 0.5.23 environment. The defaults take ~45 minutes on 2 cores, --exactness ~8.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from detokrig import sglang_cases as cases
from detokrig.proc import loadavg, thread_ticks, tick_cpu_s
from detokrig.sglang_frontend import Frontend, model_folder, plugin_dist

from .commands import header, parser, pyplot, verdict

SETUPS = {
    "rust": "SGLang's Rust server (SGLANG_RUST_SERVER=1)",
    "sglang": "Python front end + SGLang's detokenizer",
    "detokd": "Python front end + detokd",
}
# The Rust server's threads by name (comm), in groups; the process's main thread is the
# scheduler's loop (here the stand-in's: its Req and streamer work, drain, push_generation).
THREAD_GROUPS = (("detokenizer", "detokenizer"), ("tokenizer", "tokenizer"), ("from-scheduler", "rings"),
                 ("to-scheduler", "rings"), ("api-runtime", "http"), ("tokio", "http"), ("ZMQ", "zmq"))
# What says which front end serves, in SGLang's log.
IDENTITY = ("SGLANG_RUST_SERVER enabled", "replaced SGLang's detokenizer", "keeping SGLang's own detokenizer")


def thread_group(name: str, main: bool) -> str:
    if main:
        return "scheduler"
    return next((group for prefix, group in THREAD_GROUPS if name.startswith(prefix)), "other")


class Sampler(threading.Thread):
    """Every `period` s: the CPU seconds so far of each role's processes (utime + stime of
    /proc/PID/stat: all their threads, gone ones included) and of each thread of
    `threads_of` (/proc/PID/task/TID/stat), against time.monotonic()."""

    def __init__(self, roles: dict[str, list[int]], threads_of: int | None, period: float = 0.1):
        super().__init__(daemon=True)
        self.roles, self.threads_of, self.period = dict(roles), threads_of, period
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._last: dict[int, float] = {}  # a process that exits keeps its last count
        self._done = threading.Event()
        self._lock = threading.Lock()

    def track(self, role: str, pid: int) -> None:
        with self._lock:
            self.roles[role] = [pid]

    def sample(self) -> None:
        t = time.monotonic()
        with self._lock:
            roles = dict(self.roles)
        snap = {}
        for role, pids in roles.items():
            for pid in pids:
                try:
                    self._last[pid] = tick_cpu_s(pid)
                except OSError:
                    pass
            snap["process\t" + role] = sum(self._last.get(p, 0.0) for p in pids)
        if self.threads_of is not None:
            for tid, (name, s) in thread_ticks(self.threads_of).items():
                snap[f"thread\t{thread_group(name, tid == self.threads_of)}\t{name}\t{tid}"] = s
        self.samples.append((t, snap))

    def run(self) -> None:
        self.sample()
        while not self._done.wait(self.period):
            self.sample()

    def stop(self) -> None:
        self._done.set()
        self.join()
        self.sample()

    def value_at(self, t: float, key: str) -> float:
        """`key`'s count at `t`, linear between the samples around it (0 before it first appears)."""
        pts = [(ts, snap[key]) for ts, snap in self.samples if key in snap]
        if not pts or t < pts[0][0]:
            return 0.0 if not pts or key not in self.samples[0][1] else pts[0][1]
        for (t0, v0), (t1, v1) in zip(pts, pts[1:], strict=False):
            if t0 <= t <= t1:
                return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1
        return pts[-1][1]

    def delta(self, start: float, end: float) -> dict[str, float]:
        keys = {k for _, snap in self.samples for k in snap}
        return {k: self.value_at(end, k) - self.value_at(start, k) for k in sorted(keys)}


# --- one load ------------------------------------------------------------------------------


def client_command(fe: Frontend, model: Path, concurrency: int, prompts: int, args, out: Path) -> list[str]:
    return [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", fe.url,
            "--tokenizer", str(model), "--dataset-name", "random-ids", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--random-range-ratio", "1",
            "--max-concurrency", str(concurrency), "--num-prompts", str(prompts),
            "--output-file", str(out), "--output-details", "--disable-tqdm"]


BENCH_KEYS = ("duration", "completed", "total_output_tokens", "output_throughput", "request_throughput",
              "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_e2e_latency_ms",
              "p99_e2e_latency_ms", "max_output_tokens_per_s", "max_concurrent_requests")


def run_load(fe: Frontend, setup: str, model: Path, concurrency: int, args, out_dir: Path) -> dict:
    """bench_serving against `fe` at one concurrency; its figures, the CPU over the
    measured window, and the check of every answer."""
    prompts = args.num_prompts or args.prompts_per_client * concurrency
    out = out_dir / f"bench-{setup}-c{concurrency}.jsonl"
    seen = set(fe.records())
    procs = fe.processes()
    roles = {role: [p.pid for p in ps] for role, ps in procs.items()}
    rust_pid = roles["scheduler"][0] if setup == "rust" else None
    sampler = Sampler(roles, rust_pid)
    sampler.start()
    cmd = client_command(fe, model, concurrency, prompts, args, out)
    log = out_dir / f"bench-{setup}-c{concurrency}.log"
    load = loadavg()
    with open(log, "w") as f:
        client = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        sampler.track("client", client.pid)
        try:
            rc = client.wait(timeout=600 + prompts * args.output_len / 500)
        finally:
            if client.poll() is None:
                client.kill()
            sampler.stop()
    doc = dict(concurrency=concurrency, num_prompts=prompts, client_command=cmd, loadavg_1m_before=load,
               loadavg_1m_after=loadavg())
    if rc != 0 or not out.exists():
        return {**doc, "failure": f"bench_serving exited {rc}: {log.read_text(errors='replace')[-2000:]}"}
    result = json.loads(out.read_text().splitlines()[-1])
    doc["bench"] = {k: result.get(k) for k in BENCH_KEYS}
    measured = sorted((r for rid, r in fe.records().items() if rid not in seen and not rid.startswith("HEALTH_CHECK")),
                      key=lambda r: r["admitted"])[-prompts:]
    doc["check"] = check(args.tokenizer, result, measured, prompts)
    if not measured:
        return {**doc, "failure": "the stand-in recorded none of the measured requests"}
    start = measured[0]["admitted"]
    cpu = sampler.delta(start, start + result["duration"])
    doc.update(cpu_figures(cpu, result["total_output_tokens"]))
    if not doc["check"]["ok"]:
        doc["failure"] = f"answers off the oracle or failed: {doc['check']}"
    return doc


def check(name: str, result: dict, measured: list[dict], prompts: int) -> dict:
    """Every answer against the oracle's texts of the measured requests, each text used once."""
    texts, errors = result.get("generated_texts", []), [e for e in result.get("errors", []) if e]
    want = Counter(cases.oracle(name, r) for r in measured)
    exact = sum((Counter(texts) & want).values())
    off = [t for t in texts if t not in want][:2]
    ok = (result.get("completed") == prompts == len(texts) == len(measured) == exact) and not errors
    return dict(ok=ok, answers=len(texts), measured_requests=len(measured), checked=len(texts), exact=exact,
                failed=len(errors), first_error=errors[0][:500] if errors else None,
                off_oracle_examples=[t[:200] for t in off])


def cpu_figures(cpu: dict[str, float], tokens: int) -> dict:
    """CPU seconds by process role and (Rust server) by thread group, and per 1,000 output tokens."""
    per_1k = 1000 / tokens if tokens else 0.0
    processes = {k.split("\t")[1]: v for k, v in cpu.items() if k.startswith("process\t")}
    groups: dict[str, float] = {}
    threads: dict[str, float] = {}
    for k, v in cpu.items():
        if k.startswith("thread\t"):
            _, group, name, _tid = k.split("\t")
            groups[group] = groups.get(group, 0.0) + v
            threads[name] = threads.get(name, 0.0) + v
    stack = sum(v for role, v in processes.items() if role != "client")
    detok = groups.get("detokenizer", 0.0) if groups else processes.get("detokenizer", 0.0)
    ms = {role: v * per_1k * 1000 for role, v in processes.items()}
    return dict(
        cpu_s_by_process=processes, cpu_s_by_thread_group=groups or None, cpu_s_by_thread_name=threads or None,
        cpu_ms_per_1k_tokens=dict(
            stack=stack * per_1k * 1000, detokenizer=detok * per_1k * 1000, client=ms.get("client", 0.0),
            by_process={r: v for r, v in ms.items() if r != "client"},
            by_thread_group={g: v * per_1k * 1000 for g, v in groups.items()} or None,
        ),
    )


def identity(fe: Frontend) -> dict:
    """What an operator sees: the processes' titles (`ps -eo args`), the names of the
    scheduler's threads (`ps -T`) and SGLang's log lines that name the front end."""
    procs = fe.processes()
    titles = sorted(" ".join(p.cmdline()).strip()[:100] for ps in procs.values() for p in ps)
    threads = sorted({name for p in procs.get("scheduler", []) for name, _ in thread_ticks(p.pid).values()})
    lines = [line.split("] ", 1)[-1] for line in fe.log_tail(1 << 22).splitlines() if any(s in line for s in IDENTITY)]
    return dict(titles=titles, scheduler_threads=threads, log=lines[:4])


# --- the runs -------------------------------------------------------------------------------


def order(setups: list[str], runs: int) -> list[tuple[int, str]]:
    """(run, setup): A B C, then C B A, then A B C, ..."""
    return [(r, s) for r in range(runs) for s in (setups if r % 2 == 0 else setups[::-1])]


def start(setup: str, model: Path, root: Path, args, tag: str, step_ms: float | None) -> Frontend:
    env = {"STANDIN_STEP_MS": str(step_ms)} if step_ms else {}
    fe = Frontend(model, detokenizer=setup, encoding=args.encoding, plugin_path=plugin_dist(root / "dist"),
                  log_dir=root, env=env, tag=tag)
    try:
        fe.wait_ready(args.start_timeout)
    except BaseException:
        fe.close()
        raise
    return fe


def load_mode(args, argv: list[str], root: Path) -> int:
    model = model_folder(root, args.tokenizer)
    doc = {**header("rust-bench", argv), "setups": {s: SETUPS[s] for s in args.setups},
           "settings": dict(tokenizer=args.tokenizer, encoding=args.encoding, step_ms=args.step_ms,
                            input_len=args.input_len, output_len=args.output_len, concurrency=args.concurrency,
                            runs=args.runs, prompts_per_client=args.prompts_per_client, num_prompts=args.num_prompts),
           "order": [s for _, s in order(args.setups, args.runs)], "runs": [], "failure": None}
    problems: list[str] = []
    for run, setup in order(args.setups, args.runs):
        t0 = time.monotonic()
        print(f"run {run + 1}/{args.runs}: {SETUPS[setup]} ...", flush=True)
        entry = dict(setup=setup, run=run)
        doc["runs"].append(entry)
        try:
            fe = start(setup, model, root, args, f"-run{run}", args.step_ms)
        except Exception as e:
            entry["failure"] = f"{type(e).__name__}: {e}"[-3000:]
            problems.append(f"{setup} run {run}: did not start")
            continue
        try:
            entry["start_s"] = time.monotonic() - t0
            entry["identity"] = identity(fe)
            entry["loads"] = []
            for c in args.concurrency:
                load = run_load(fe, setup, model, c, args, root)
                entry["loads"].append(load)
                print("  " + line_of(setup, load), flush=True)
                if load.get("failure"):
                    problems.append(f"{setup} run {run} concurrency {c}: {load['failure'][:500]}")
        finally:
            fe.close()
    doc["summary"] = summarize(doc)
    if problems:
        doc["failure"] = problems[0]
    print(table(doc))
    if args.plot:
        plot(doc, args.plot)
    return verdict(problems, args.json, doc)


def line_of(setup: str, load: dict) -> str:
    if "bench" not in load or "cpu_ms_per_1k_tokens" not in load:
        return f"{setup} C={load['concurrency']}: FAILED {load.get('failure', '')[:300]}"
    b, cpu, ck = load["bench"], load["cpu_ms_per_1k_tokens"], load["check"]
    return (f"{setup} C={load['concurrency']}: {b['output_throughput']:,.0f} tok/s, ITL p50/p99 "
            f"{b['median_itl_ms']:.1f}/{b['p99_itl_ms']:.1f} ms, CPU per 1k tokens {cpu['stack']:.1f} ms "
            f"(detokenizer {cpu['detokenizer']:.2f}, client {cpu['client']:.1f}); "
            f"{ck['exact']}/{ck['answers']} answers exact")


def summarize(doc: dict) -> dict:
    """Per setup and concurrency: median, min and max over the runs of each figure."""
    figures = {
        "output_tok_s": lambda ld: ld["bench"]["output_throughput"],
        "itl_p50_ms": lambda ld: ld["bench"]["median_itl_ms"],
        "itl_p99_ms": lambda ld: ld["bench"]["p99_itl_ms"],
        "ttft_p50_ms": lambda ld: ld["bench"]["median_ttft_ms"],
        "ttft_p99_ms": lambda ld: ld["bench"]["p99_ttft_ms"],
        "cpu_ms_per_1k_stack": lambda ld: ld["cpu_ms_per_1k_tokens"]["stack"],
        "cpu_ms_per_1k_detokenizer": lambda ld: ld["cpu_ms_per_1k_tokens"]["detokenizer"],
        "cpu_ms_per_1k_client": lambda ld: ld["cpu_ms_per_1k_tokens"]["client"],
    }
    out: dict = {}
    for entry in doc["runs"]:
        for ld in entry.get("loads", []):
            if ld.get("failure"):
                continue
            per = out.setdefault(entry["setup"], {}).setdefault(str(ld["concurrency"]), {})
            for name, get in figures.items():
                per.setdefault(name, []).append(get(ld))
    for per_c in out.values():
        for per in per_c.values():
            for name, xs in per.items():
                per[name] = dict(median=statistics.median(xs), min=min(xs), max=max(xs), n=len(xs))
    return out


def table(doc: dict) -> str:
    """The record's figures, one row per concurrency and figure, a column per setup: median (min-max)."""
    s = doc.get("summary") or summarize(doc)
    setups = [x for x in SETUPS if x in s]
    if not setups:
        return "(no figures)"
    rows = [("output_tok_s", "output tok/s", "{:,.0f}"), ("itl_p99_ms", "ITL p99, ms", "{:.0f}"),
            ("ttft_p99_ms", "TTFT p99, ms", "{:.0f}"), ("cpu_ms_per_1k_stack", "CPU ms per 1k tokens, stack", "{:.1f}"),
            ("cpu_ms_per_1k_detokenizer", "CPU ms per 1k tokens, detokenizer", "{:.2f}"),
            ("cpu_ms_per_1k_client", "CPU ms per 1k tokens, bench_serving", "{:.1f}")]
    out = ["| concurrency | figure | " + " | ".join(SETUPS[x] for x in setups) + " |",
           "| --- | --- | " + " | ".join("---" for _ in setups) + " |"]
    for c in sorted({c for x in setups for c in s[x]}, key=int):
        for key, label, fmt in rows:
            cells = []
            for x in setups:
                f = s[x].get(c, {}).get(key)
                cells.append("-" if f is None else f"{fmt.format(f['median'])} ({fmt.format(f['min'])}-{fmt.format(f['max'])})")
            out.append(f"| {int(c):,} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(doc: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        print("(no plot: matplotlib is not installed)")
        return
    s = doc["summary"]
    setups = [x for x in SETUPS if x in s]
    conc = sorted({c for x in setups for c in s[x]}, key=int)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (key, label) in zip(axes, (("output_tok_s", "output tokens/s"), ("itl_p99_ms", "ITL p99, ms"),
                                       ("cpu_ms_per_1k_stack", "CPU ms per 1k output tokens, whole stack")), strict=True):
        width = 0.8 / len(setups)
        for i, x in enumerate(setups):
            xs = [j + i * width for j in range(len(conc))]
            med = [s[x][c][key]["median"] if c in s[x] else 0 for c in conc]
            lo = [m - s[x][c][key]["min"] if c in s[x] else 0 for m, c in zip(med, conc, strict=True)]
            hi = [s[x][c][key]["max"] - m if c in s[x] else 0 for m, c in zip(med, conc, strict=True)]
            ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=SETUPS[x])
        ax.set_xticks([j + width * (len(setups) - 1) / 2 for j in range(len(conc))], [f"C = {int(c):,}" for c in conc])
        ax.set_title(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{doc['command']}  ({doc.get('commit')}; bars: median, whiskers: range of runs)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --- exactness ------------------------------------------------------------------------------


def exactness_mode(args, argv: list[str], root: Path) -> int:
    doc = {**header("rust-bench", argv), "setups": {s: SETUPS[s] for s in args.setups},
           "settings": dict(tokenizers=args.tokenizers, encoding=args.encoding, step_ms=args.step_ms),
           "results": {}, "failure": None}
    problems: list[str] = []
    for name in args.tokenizers:
        model = model_folder(root, name)
        mix = cases.requests_for(name, extended=True)
        for setup in args.setups:
            print(f"{name}: {SETUPS[setup]} ...", flush=True)
            try:
                fe = start(setup, model, root, args, f"-exact-{name}", args.step_ms)
            except Exception as e:
                problems.append(f"{name} {setup}: did not start: {type(e).__name__}: {e}"[-2000:])
                continue
            try:
                with ThreadPoolExecutor(len(mix)) as pool:
                    answers = list(pool.map(lambda r: cases.call(fe, r), mix))  # noqa: B023 (fe: this server)
                time.sleep(1.0)  # the hung-up request's abort reaches the stand-in's record
                records = cases.records_by_case(fe)
                result = compare(name, mix, answers, records)
                result["identity"] = identity(fe)
            finally:
                fe.close()
            doc["results"].setdefault(name, {})[setup] = result
            if result["unchecked"]:
                problems.append(f"{name} {setup}: {result['unchecked']} requests without a record to check them against")
            print(exactness_table(doc, name, [setup]), flush=True)
    for name in doc["results"]:
        print(f"\n{name}:\n" + exactness_table(doc, name))
    if problems:
        doc["failure"] = problems[0]
    return verdict(problems, args.json, doc)


def compare(name: str, mix: list[dict], answers: list[dict], records: dict[str, dict]) -> dict:
    """Per request and per case class: text against the oracle (with the flags the client
    asked for), the finish the client saw against the scheduler's, the fields it ignored."""
    per_request, unchecked = [], 0
    for r, a in zip(mix, answers, strict=True):
        rec = records.get(r["rid"])
        if rec is None:
            unchecked += 1
            per_request.append(dict(rid=r["rid"], kind=r["kind"], record=False, error=a.get("error")))
            continue
        want = cases.oracle(name, rec, cases.asked(r))
        hangup = r["api"] == "hangup"
        seen, engine = cases.finish_type(a["finish"]), rec["finish"]["type"]
        per_request.append(dict(
            rid=r["rid"], kind=r["kind"], record=True,
            exact=None if hangup else a["text"] == want,
            text=a["text"], oracle=want, finish_seen=seen, finish_engine=engine,
            finish_ok=(engine == "abort") if hangup else seen == engine,
            error=a.get("error"), ignored=cases.ignored(r, rec),
        ))
    classes: dict[str, dict] = {}
    for p in per_request:
        c = classes.setdefault(p["kind"], dict(n=0, exact=0, finish_ok=0, finish_seen=[], ignored=[], errors=0,
                                               unchecked=0))
        c["n"] += 1
        if not p["record"]:
            c["unchecked"] += 1
            continue
        c["exact"] += bool(p["exact"])
        c["finish_ok"] += p["finish_ok"]
        c["errors"] += p["error"] is not None
        c["finish_seen"] = sorted(set(c["finish_seen"]) | {str(p["finish_seen"])})
        c["ignored"] = sorted(set(c["ignored"]) | set(p["ignored"]))
    return dict(classes=classes, requests=per_request, unchecked=unchecked)


def exactness_table(doc: dict, name: str, setups: list[str] | None = None) -> str:
    res = doc["results"][name]
    setups = [s for s in (setups or SETUPS) if s in res]
    kinds = list(dict.fromkeys(k for s in setups for k in res[s]["classes"]))
    out = ["| case class | " + " | ".join(SETUPS[s] for s in setups) + " |",
           "| --- | " + " | ".join("---" for _ in setups) + " |"]
    for k in kinds:
        cells = []
        for s in setups:
            c = res[s]["classes"].get(k)
            if c is None:
                cells.append("-")
                continue
            hangup = k == "client hangs up"
            text = (("server aborted it" if c["finish_ok"] == c["n"] else "server did not abort it") if hangup
                    else f"{c['exact']}/{c['n']} exact")
            notes = []
            if c["finish_ok"] < c["n"] and not hangup:
                notes.append(f"finish {c['finish_ok']}/{c['n']} right (seen: {', '.join(c['finish_seen'])})")
            if c["ignored"]:
                notes.append("ignored: " + ", ".join(c["ignored"]))
            if c["errors"]:
                notes.append(f"{c['errors']} error events")
            if c["unchecked"]:
                notes.append(f"{c['unchecked']} without a record")
            cells.append(text + ("; " + "; ".join(notes) if notes else ""))
        out.append(f"| {k} | " + " | ".join(cells) + " |")
    total = [sum(c["exact"] for c in res[s]["classes"].values()) for s in setups]
    n = [sum(c["n"] for k, c in res[s]["classes"].items() if k != "client hangs up") for s in setups]
    out.append("| all but the hang-up | " + " | ".join(f"{t}/{m} exact" for t, m in zip(total, n, strict=True)) + " |")
    return "\n".join(out)


def summary(paths: list[str]) -> str:
    out = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        if "results" in doc:
            for name in doc["results"]:
                out.append(f"{path}: {name}, at {doc.get('commit')}\n" + exactness_table(doc, name))
        elif "runs" in doc:
            out.append(f"{path}: {doc.get('settings')}, at {doc.get('commit')}\n" + table(doc))
    return "\n\n".join(out)


def main(argv: list[str]) -> int:
    ap = parser("rust-bench", __doc__)
    ap.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[256, 1024], help="bench_serving's --max-concurrency")
    ap.add_argument("--runs", type=int, default=3, help="starts of each setup, alternated")
    ap.add_argument("--prompts-per-client", type=int, default=4, help="--num-prompts is this many times the concurrency")
    ap.add_argument("--num-prompts", type=int, help="--num-prompts for every concurrency instead")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--step-ms", type=float, help="the stand-in's step interval (default: 20 for the load, "
                    "the front-end tests' pacing for --exactness)")
    ap.add_argument("--tokenizer", default="deepseek", help="the model folder's tokenizer for the load")
    ap.add_argument("--encoding", choices=("pickle", "msgpack"), default="pickle",
                    help="SGLang's IPC between its Python processes (pickle is its default)")
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--exactness", action="store_true", help="the front-end cases instead of the load")
    ap.add_argument("--tokenizers", nargs="+", default=["deepseek", "mistral_v1"], help="for --exactness")
    ap.add_argument("--work-dir", help="keep the model folders, servers' logs and bench_serving's output here "
                    "(default: a temporary folder, removed at the end)")
    ap.add_argument("--json", help="write the record here")
    ap.add_argument("--plot", help="write a PNG of the figures here (matplotlib)")
    ap.add_argument("--summary", nargs="+", metavar="JSON", help="print the tables of recorded runs, run nothing")
    args = ap.parse_args(argv)
    if args.summary:
        print(summary(args.summary))
        return 0
    if args.step_ms is None and not args.exactness:
        args.step_ms = 20.0
    run = exactness_mode if args.exactness else load_mode
    if args.work_dir:
        Path(args.work_dir).mkdir(parents=True, exist_ok=True)
        return run(args, argv, Path(args.work_dir))
    with tempfile.TemporaryDirectory(prefix="rust-bench-") as tmp:
        return run(args, argv, Path(tmp))
