#!/usr/bin/env python
"""End-to-end detokenizer benchmark through real processes (issue "Speed").

    scheduler (this process) --tokens--> implementation --text--> worker (subprocess)
         ^                                                          |
         +---------------------- ack of each whole step ------------+

* The scheduler PUSHes one `tokens` message per step (PROTOCOL.md v1) to the
  implementation under test, over ipc:// sockets in a temporary folder. B streams,
  each one row per step with `--ids-per-row` new ids (4: speculative decoding).
* The worker PULLs the `text` messages, counts the rows of each step (the step number
  and the send time ride in each row's `meta`, which every implementation copies
  through untouched) and, once all B rows of step k are in, PUSHes an ack of step k
  back to the scheduler with the step's latency: worker receive time of its last row
  minus scheduler send time (one CLOCK_MONOTONIC for all processes).
* Flow control: at most `--window` steps are in flight (sent, not yet acked); the
  scheduler sends step k once step k-window has been acked. With window 2 the
  implementation decodes step k while the worker reads step k-1 and the scheduler
  waits, so the pipeline runs as fast as it absorbs, without an unbounded queue that
  would turn latency into a measure of the queue length. A second phase of each run
  sends one step at a time (window 1): its latency is the pure per-step latency of an
  idle pipeline, which is what an engine that sends a step every few ms sees.
* Every implementation is a process behind the same sockets: `detokd` (the real
  `python -m detokd serve ...`) and the baselines of scripts/baselines.py
  (naive, sglang, decodestream, floor). All run on the same streams, one after the
  other, for each configuration.
* A round starts every stream (step 0 carries the `start` rows), runs `--steps` steps
  and finishes them all; the throughput phase repeats rounds (same rids, new requests)
  for `--min-seconds`.

Messages are built before the timed run (they are the same for every implementation):
all rows of a step share `seq` and `meta`, so each row is encoded once without them and
a step's frame is `tail.join(pieces)`; the ids repeat with the corpus, so a run of any
length needs one set of pieces per step of the corpus' period, not one per step.

The text every implementation sends is checked (a sample of the streams, or all with
`--check all`) against decode(prompt_tail + out)[len(decode(prompt_tail)):].

Figures: tokens/s through the pipeline, step latency p50/p99/max (idle and loaded),
CPU seconds of the implementation's processes per million tokens (per-thread
/proc/<pid>/task/*/schedstat, ns resolution, cross-checked with psutil), its peak RSS
(VmHWM, reset before each configuration through /proc/<pid>/clear_refs), and a long
run (flatness) that compares CPU per token at output length 32,768 with a control set
of short streams measured alongside (see run_flatness).

    python scripts/bench.py --quick              # smoke run, seconds
    python scripts/bench.py                      # the full run behind docs/performance.md
    python scripts/bench.py --report docs/bench/results.json   # markdown tables + plots again
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, Optional, Union

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402

IMPLS = ("detokd", "sglang", "decodestream", "naive", "floor")
BASELINES = ("sglang", "decodestream", "naive", "floor")
TOKENIZERS = ("deepseek", "mistral_v3", "qwen2")

# --------------------------------------------------------------------------- texts
# Real text in several scripts. Concatenated, tokenized with the tokenizer under test;
# each stream starts at its own offset into that id sequence (wrapping around).

TEXTS: dict[str, str] = {
    "english": (
        "The lighthouse keeper had not spoken to anyone in eleven days when the supply boat "
        "finally rounded the northern point. She watched it through the salt-streaked window, "
        "counting the waves that broke over its bow, and wondered whether the captain would "
        "remember the coffee this time. Fog was rolling in from the west, thick and grey, the "
        "kind that swallowed sound as well as light.\n"
        "Streaming detokenization turns token ids back into text while a model is still "
        "generating. It must never emit half of a character, must keep the leading space of a "
        "word, and should cost the same for the ten-thousandth token as for the first."
    ),
    "chinese": (
        "清晨的山谷里弥漫着薄雾，远处传来几声鸟鸣。老人背着竹篓，沿着蜿蜒的小路慢慢走向茶园。"
        "他在这里种了四十年的茶，每一棵茶树的脾气他都了如指掌。今年春天雨水充足，新芽长得格外鲜嫩。\n"
        "大型语言模型在生成文本时逐个输出词元，服务系统需要把这些词元实时转换成文字并推送给用户。"
        "如果一个汉字的字节被拆分到两个词元中，解码器必须等到字符完整后再发送，否则用户会看到乱码。"
    ),
    "russian": (
        "Поезд опаздывал уже на сорок минут, и на перроне становилось всё холоднее. Старик в "
        "потёртом пальто достал из кармана термос, налил себе чаю и предложил соседке. Она "
        "улыбнулась, поблагодарила и рассказала, что едет к сестре, которую не видела двадцать лет.\n"
        "Каждый токен модели превращается в несколько байтов, а кириллическая буква занимает два "
        "байта в UTF-8, поэтому граница токена иногда проходит прямо посередине символа."
    ),
    "arabic": (
        "في صباح يوم هادئ، خرجت الجدة إلى حديقتها الصغيرة لتسقي أشجار الليمون والزيتون. كانت الشمس "
        "تشرق ببطء فوق أسطح المنازل، والعصافير تغرد على الأغصان. جلست على كرسيها الخشبي وأخذت تتذكر "
        "أيام طفولتها في القرية.\n"
        "تعمل النماذج اللغوية الكبيرة على توليد النص كلمة بعد كلمة، ويجب على الخادم أن يحول الرموز "
        "إلى نص مقروء بسرعة كبيرة ومن دون أخطاء في ترميز الحروف."
    ),
    "hindi": (
        "गाँव के किनारे एक पुराना बरगद का पेड़ था, जिसकी छाँव में बच्चे हर शाम खेलने आते थे। दादी "
        "वहीं बैठकर कहानियाँ सुनाती थीं — राजा-रानी की, चतुर लोमड़ी की, और उस नदी की जो कभी सूखती नहीं थी।\n"
        "देवनागरी के अक्षर UTF-8 में तीन बाइट लेते हैं, और मात्राएँ अलग कोड पॉइंट होती हैं, इसलिए "
        "टोकन की सीमा अक्सर किसी अक्षर के बीच में पड़ती है।"
    ),
    "emoji": (
        "Launch day! 🚀🎉 The team 👩‍💻👨‍💻🧑🏽‍🔬 shipped at 3am ☕☕☕ and the dashboards are all green ✅✅. "
        "Weather: 🌧️ → ⛅ → ☀️. Flags seen at the meetup: 🇯🇵 🇧🇷 🇰🇪 🇩🇪 🇮🇳 🏳️‍🌈. "
        "Family photo: 👨‍👩‍👧‍👦 with the dog 🐕‍🦺 and the robot 🤖. Reactions: 👍🏻 👍🏿 ❤️‍🔥 🫶 😂🤣 🥲 🫠."
    ),
    "code": (
        "def stream_decode(tokenizer, ids, prefix_offset=0, read_offset=0):\n"
        "    \"\"\"Yield text deltas; hold back incomplete UTF-8 sequences.\"\"\"\n"
        "    for i in range(len(ids)):\n"
        "        prefix = tokenizer.decode(ids[prefix_offset:read_offset])\n"
        "        full = tokenizer.decode(ids[prefix_offset:i + 1])\n"
        "        if len(full) > len(prefix) and not full.endswith(\"\\ufffd\"):\n"
        "            yield full[len(prefix):]\n"
        "            prefix_offset, read_offset = read_offset, i + 1\n"
        "\n"
        "const cache = new Map<string, number[]>();\n"
        "for (const [k, v] of Object.entries(cfg)) { if (v?.enabled) cache.set(k, v.ids ?? []); }\n"
        "SELECT rid, COUNT(*) AS n FROM tokens WHERE step >= 42 GROUP BY rid HAVING n > 1;\n"
    ),
}

TAIL = 4  # prompt ids of context each stream starts with


def corpus() -> str:
    return "\n\n".join(TEXTS[k] for k in TEXTS) + "\n\n"


# --------------------------------------------------------------------------- small helpers


def _log(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def fmt_rate(x: Optional[float]) -> str:
    if x is None:
        return "–"
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


def pct(values: list[float], q: float) -> Optional[float]:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return None
    v = sorted(values)
    k = max(0, min(len(v) - 1, math.ceil(q / 100 * len(v)) - 1))
    return v[k]


def lat_stats(ns: list[int]) -> Optional[dict]:
    if not ns:
        return None
    ms = [x / 1e6 for x in ns]
    return {"n": len(ms), "p50_ms": pct(ms, 50), "p99_ms": pct(ms, 99), "max_ms": max(ms), "mean_ms": sum(ms) / len(ms)}


def shard_of(rid: str, n: int) -> int:
    try:
        from detokd.client import shard_for
    except Exception:  # the client may not exist (yet): same rule, zlib's CRC-32
        return zlib.crc32(rid.encode()) % n if n > 1 else 0
    return shard_for(rid, n)


def shard_address(base: str, i: int) -> str:
    try:
        from detokd.launch import derive_address
    except Exception:
        return f"{base}.{i}"
    return derive_address(base, i)


# --------------------------------------------------------------------------- CPU / memory of a process tree


def _task_cpu_ns(pid: int) -> int:
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


def _proc_stat() -> Optional[list[int]]:
    try:
        with open("/proc/stat") as f:
            parts = f.readline().split()
    except OSError:
        return None
    return [int(x) for x in parts[1:9]]  # user nice system idle iowait irq softirq steal


def machine_busy_ns() -> Optional[int]:
    """CPU time all processes of the machine ran (from /proc/stat), in ns."""
    v = _proc_stat()
    if v is None:
        return None
    return (v[0] + v[1] + v[2] + v[5] + v[6]) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def steal_ns() -> Optional[int]:
    """CPU time the hypervisor gave to other guests while this one wanted to run."""
    v = _proc_stat()
    return None if v is None else v[7] * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def other_load(seconds: float = 0.5) -> float:
    """Cores kept busy over `seconds` while the benchmark's own processes sit idle."""
    m0, t0 = machine_busy_ns(), time.monotonic_ns()
    time.sleep(seconds)
    m1, t1 = machine_busy_ns(), time.monotonic_ns()
    if m0 is None or m1 is None:
        return 0.0
    return (m1 - m0) / (t1 - t0)


_WAITED = [0.0]  # seconds spent in wait_quiet so far


def wait_quiet(threshold: float, max_wait: float, progress: "Progress", budget: float = 120.0) -> float:
    """Wait (at most `max_wait` s, and `budget` s over the whole run) until the rest of the
    machine is idle; returns the load seen last."""
    if max_wait <= 0 or _WAITED[0] >= budget:
        return 0.0
    t0 = time.monotonic()
    deadline = t0 + min(max_wait, budget - _WAITED[0])
    load = other_load(0.2)
    while load > threshold and time.monotonic() < deadline:
        progress.update(f"waiting for a quiet machine: other processes keep {load:.2f} cores busy", force=True)
        load = other_load(1.0)
    _WAITED[0] += time.monotonic() - t0
    return load


class ProcTree:
    """CPU time and peak RSS of a process and its children (detokd --shards forks)."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.pid = pid
        self.proc = psutil.Process(pid)
        self.pids = [pid]
        self.schedstat = os.path.exists(f"/proc/{pid}/task/{pid}/schedstat")

    def refresh(self) -> None:
        try:
            self.pids = [self.pid] + [c.pid for c in self.proc.children(recursive=True)]
        except Exception:
            self.pids = [self.pid]

    def cpu_ns(self) -> int:
        if self.schedstat:
            return sum(_task_cpu_ns(p) for p in self.pids)
        return int(self.cpu_psutil() * 1e9)

    def cpu_psutil(self) -> float:
        import psutil

        total = 0.0
        for p in self.pids:
            try:
                t = psutil.Process(p).cpu_times()
                total += t.user + t.system
            except Exception:
                pass
        return total

    def reset_peak(self) -> bool:
        ok = True
        for p in self.pids:
            try:
                with open(f"/proc/{p}/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                ok = False
        return ok

    def peak_rss_mb(self) -> Optional[float]:
        total = 0
        for p in self.pids:
            try:
                with open(f"/proc/{p}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            total += int(line.split()[1])
            except OSError:
                return None
        return total / 1024


# --------------------------------------------------------------------------- worker process (hidden mode)


class _BRow(msgspec.Struct, gc=False):
    rid: str
    text: str = ""
    n_ids: int = 0
    meta: tuple[int, int] = (0, 0)
    error: None = None  # an error row fails this strict decode: the lenient path records it


class _BText(msgspec.Struct, tag_field="type", tag="text", gc=False):
    rows: list[_BRow]


class _BConfig(msgspec.Struct, tag_field="type", tag="bench_config"):
    cid: int
    expected: int
    check: str = "off"
    watch: list[str] = []


class _BDump(msgspec.Struct, tag_field="type", tag="bench_dump"):
    cid: int


class _BQuit(msgspec.Struct, tag_field="type", tag="bench_quit"):
    pass


_ACK_STEP, _ACK_CONFIG, _ACK_DUMP = 0, 1, 2


def worker_main(text_addr: str, ack_addr: str) -> int:
    """The tokenizer worker: PULLs text, acks every complete step to the scheduler."""
    import zmq

    from detokd.wire.native import Text

    gc.disable()
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.bind(text_addr)
    ack = ctx.socket(zmq.PUSH)
    ack.setsockopt(zmq.SNDHWM, 0)
    ack.connect(ack_addr)

    strict = msgspec.msgpack.Decoder(Union[_BText, _BConfig, _BDump, _BQuit])
    lenient = msgspec.msgpack.Decoder(Text)
    meta_dec = msgspec.msgpack.Decoder(tuple[int, int])
    enc = msgspec.msgpack.Encoder().encode
    now = time.monotonic_ns

    expected = 1
    counts: dict[int, int] = {}
    check = "off"
    watch: set[str] = set()
    texts: dict[str, list[str]] = {}
    n_ids: dict[str, int] = {}
    errors: list[list] = []
    n_errors = 0
    bad_frames = 0
    cid = -1

    def account(step: int, n: int, t_send: int, t: int) -> None:
        c = counts.get(step, 0) + n
        if c >= expected:
            counts.pop(step, None)
            ack.send(enc((_ACK_STEP, step, t, t - t_send)))
        else:
            counts[step] = c

    while True:
        frame = pull.recv()
        t = now()
        try:
            msg = strict.decode(frame)
        except msgspec.DecodeError:
            try:
                loose = lenient.decode(frame)
            except msgspec.DecodeError:
                bad_frames += 1
                continue
            for r in loose.rows:
                if r.error is not None:
                    n_errors += 1
                    if len(errors) < 50:
                        errors.append([r.rid, r.error])
                try:
                    step, t_send = meta_dec.decode(r.meta)
                except msgspec.DecodeError:
                    continue  # an unsolicited row (e.g. evicted): no step to count it in
                if check != "off" and (check == "all" or r.rid in watch):
                    texts.setdefault(r.rid, []).append(r.text)
                    n_ids[r.rid] = r.n_ids
                account(step, 1, t_send, t)
            continue
        if type(msg) is _BText:
            rows = msg.rows
            if not rows:
                continue
            if check == "all":
                for r in rows:
                    lst = texts.get(r.rid)
                    if lst is None:
                        lst = texts[r.rid] = []
                    lst.append(r.text)
                    n_ids[r.rid] = r.n_ids
            elif check == "sample":
                for r in rows:
                    if r.rid in watch:
                        texts.setdefault(r.rid, []).append(r.text)
                        n_ids[r.rid] = r.n_ids
            s0, t0 = rows[0].meta
            if rows[-1].meta[0] == s0:
                account(s0, len(rows), t0, t)
            else:
                for r in rows:
                    account(r.meta[0], 1, r.meta[1], t)
        elif type(msg) is _BConfig:
            cid, expected, check, watch = msg.cid, msg.expected, msg.check, set(msg.watch)
            counts.clear()
            texts.clear()
            n_ids.clear()
            errors.clear()
            n_errors = bad_frames = 0
            ack.send(enc((_ACK_CONFIG, cid)))
        elif type(msg) is _BDump:
            payload = {
                "texts": {k: "".join(v) for k, v in texts.items()},
                "n_ids": n_ids,
                "errors": errors,
                "n_errors": n_errors,
                "bad_frames": bad_frames,
                "incomplete_steps": len(counts),
            }
            ack.send(enc((_ACK_DUMP, msg.cid, payload)))
        elif type(msg) is _BQuit:
            break
    ctx.destroy(linger=0)
    return 0


# --------------------------------------------------------------------------- streams and messages


class Corpus:
    """The id sequence of the multilingual text for one tokenizer, and clean stream starts."""

    def __init__(self, tokenizer: str) -> None:
        from baselines import Tok  # scripts/ is on sys.path when this runs as a script

        self.name = tokenizer
        self.tok = Tok(tokenizer)
        fast = self.tok.fast
        self.base = fast.encode(corpus(), add_special_tokens=False).ids
        n = len(self.base)
        self.cyc = self.base * 3
        # Stream starts where the previous ids decode with no broken character and the
        # next ones start a whole character: the prompt tail then means the same to
        # every implementation (no character split across the prompt boundary).
        self.starts: list[int] = []
        for p in range(n, 2 * n):
            head = fast.decode(self.cyc[p - TAIL:p])
            nxt = fast.decode(self.cyc[p:p + 3])
            if "\ufffd" not in head and not nxt.startswith("\ufffd"):
                self.starts.append(p - n)
        if not self.starts:
            raise RuntimeError(f"no clean stream start in the corpus for {tokenizer}")
        self._ref_cache: dict[tuple, str] = {}

    def offset(self, i: int) -> int:
        return self.starts[(i * 7919 + 13) % len(self.starts)]

    def ids(self, off: int, start: int, count: int) -> list[int]:
        n = len(self.base)
        a = off + start
        if a + count <= len(self.cyc):
            return self.cyc[a:a + count]
        return [self.base[(a + j) % n] for j in range(count)]

    def tail(self, off: int) -> list[int]:
        n = len(self.base)
        return [self.base[(off - TAIL + j) % n] for j in range(TAIL)]

    def reference(self, off: int, count: int) -> str:
        key = (off, count)
        r = self._ref_cache.get(key)
        if r is None:
            tail = self.tail(off)
            r = self.tok.decode(tail + self.ids(off, 0, count))[len(self.tok.decode(tail)):]
            self._ref_cache[key] = r
        return r


def _arr_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    if n < 65536:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


class _WRow(msgspec.Struct, omit_defaults=True):
    rid: str
    ids: list = []
    start: Optional[Any] = None
    finish: Optional[Any] = None


_TOKENS_HEAD = b"\x82\xa4type\xa6tokens\xa4rows"  # {"type": "tokens", "rows": [...]}


def step_tail(seq: int, meta: tuple) -> bytes:
    """The end of every row of one step: `"seq": seq, "meta": [step, send time]`."""
    return b"\xa3seq" + msgspec.msgpack.encode(seq) + b"\xa4meta" + msgspec.msgpack.encode(meta)


class Workload:
    """B streams, n ids per row per step, as ready-made frames.

    Every stream starts at step 0 (a `start` row) and reads the corpus' ids from its
    own offset, so all rows of one step share `seq` (= step * n) and `meta` (step
    number, send time). Each row is encoded once without them and ends where they
    go, so a step's frame is `tail.join(pieces)`, with `tail = step_tail(seq, meta)`.
    The ids repeat with the corpus (period P steps), and so do the pieces: a run of
    any length needs P of them, not one per step."""

    def __init__(self, corp: Corpus, batch: int, n: int, tag: str) -> None:
        self.corp, self.batch, self.n = corp, batch, n
        self.rids = [f"{tag}-{i}" for i in range(batch)]
        self.offsets = [corp.offset(i) for i in range(batch)]
        L = len(corp.base)
        self.period = L // math.gcd(L, n)
        self._built: dict[int, dict] = {}

    def frames(self, shards: int) -> dict:
        """{"start": pieces, "cyc": [pieces] * period, "finish": pieces}; pieces is a
        list of (shard, [bytes, ...]), one entry per shard that has rows."""
        b = self._built.get(shards)
        if b is None:
            b = self._built[shards] = self._build(shards)
        return b

    def _build(self, shards: int) -> dict:
        from detokd.wire.native import Finish, Start

        groups: list[list[int]] = [[] for _ in range(shards)]
        for i, rid in enumerate(self.rids):
            groups[shard_of(rid, shards)].append(i)
        groups_nz = [(s, g) for s, g in enumerate(groups) if g]
        enc = msgspec.msgpack.Encoder().encode
        n, corp = self.n, self.corp

        def row(i: int, ids: list, start=None, finish=None) -> bytes:
            b = enc(_WRow(self.rids[i], ids, start, finish))
            head = b[0]
            if not 0x81 <= head <= 0x8D:
                raise RuntimeError("unexpected row encoding")
            return bytes([head + 2]) + b[1:]  # two more keys: seq and meta, in the tail

        def pieces(make) -> list:
            out = []
            for s, g in groups_nz:
                rows = [make(i) for i in g]
                rows[0] = _TOKENS_HEAD + _arr_header(len(g)) + rows[0]
                out.append((s, rows + [b""]))
            return out

        starts = [Start(prompt_tail=corp.tail(off)) for off in self.offsets]
        built = {
            "start": pieces(lambda i: row(i, corp.ids(self.offsets[i], 0, n), start=starts[i])),
            "finish": pieces(lambda i: row(i, [], finish=Finish("length"))),
            "cyc": [],
        }
        for j in range(self.period):
            built["cyc"].append(pieces(lambda i: row(i, corp.ids(self.offsets[i], j * n, n))))
        return built

    def reference(self, i: int, rounds: list[int]) -> str:
        """Everything stream i's rid receives over rounds of these step counts."""
        return "".join(self.corp.reference(self.offsets[i], k * self.n) for k in rounds)


# --------------------------------------------------------------------------- processes


_STARTED: list[subprocess.Popen] = []


def _stop_proc(p: subprocess.Popen, grace: float = 5.0) -> None:
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)  # its own session: the shards it forked go too
    except (ProcessLookupError, PermissionError):
        p.terminate()
    try:
        p.wait(grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            p.kill()
        p.wait(5)


@atexit.register
def _cleanup() -> None:
    for p in _STARTED:
        try:
            _stop_proc(p, 2.0)
        except Exception:
            pass


def _spawn(cmd: list[str], log_path: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logf = open(log_path, "wb")
    p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=str(ROOT), env=env,
                         start_new_session=True)
    logf.close()
    _STARTED.append(p)
    return p


class Stall(RuntimeError):
    pass


class Harness:
    """The worker process and the scheduler's sockets."""

    def __init__(self, tmp: Path, args) -> None:
        import zmq

        self.zmq = zmq
        self.tmp = tmp
        self.args = args
        self.ctx = zmq.Context()
        self.text_addr = f"ipc://{tmp}/text"
        self.ack_addr = f"ipc://{tmp}/ack"
        self.ack = self.ctx.socket(zmq.PULL)
        self.ack.setsockopt(zmq.RCVHWM, 0)
        self.ack.bind(self.ack_addr)
        self.worker = _spawn([sys.executable, str(Path(__file__).resolve()), "--worker-mode", self.text_addr, self.ack_addr],
                             tmp / "worker.log")
        self.worker_tree = ProcTree(self.worker.pid)
        self.self_tree = ProcTree(os.getpid())
        self.ctl = self.ctx.socket(zmq.PUSH)
        self.ctl.setsockopt(zmq.SNDHWM, 0)
        self.ctl.connect(self.text_addr)
        self.poller = zmq.Poller()
        self.poller.register(self.ack, zmq.POLLIN)
        self.dec = msgspec.msgpack.Decoder()
        self.enc = msgspec.msgpack.Encoder().encode
        self.cid = 0

    def recv_ack(self, timeout_s: float) -> list:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Stall(f"no ack within {timeout_s:.0f}s")
            if self.poller.poll(min(left, 1.0) * 1000):
                return self.dec.decode(self.ack.recv())
            if self.worker.poll() is not None:
                raise RuntimeError(f"the worker process exited ({self.worker.returncode}); see {self.tmp}/worker.log")

    def configure(self, expected: int, check: str, watch: list[str]) -> int:
        self.cid += 1
        self.ctl.send(self.enc(_BConfig(self.cid, expected, check, watch)))
        while True:
            a = self.recv_ack(60)
            if a[0] == _ACK_CONFIG and a[1] == self.cid:
                return self.cid

    def dump(self) -> dict:
        self.ctl.send(self.enc(_BDump(self.cid)))
        while True:
            a = self.recv_ack(60)
            if a[0] == _ACK_DUMP and a[1] == self.cid:
                return a[2]

    def close(self) -> None:
        try:
            self.ctl.send(self.enc(_BQuit()))
        except Exception:
            pass
        try:
            self.worker.wait(3)
        except subprocess.TimeoutExpired:
            pass
        _stop_proc(self.worker)
        self.ctx.destroy(linger=0)


class Impl:
    """One implementation process (detokd or a baseline) for one tokenizer."""

    def __init__(self, name: str, tokenizer: str, h: Harness, args) -> None:
        import zmq

        self.name, self.tokenizer, self.h = name, tokenizer, h
        self.shards = args.shards if name == "detokd" else 1
        base = f"ipc://{h.tmp}/in-{name}-{tokenizer}"
        self.log_path = h.tmp / f"{name}-{tokenizer}.log"
        if name == "detokd":
            prefix = shlex.split(args.detokd_cmd) if args.detokd_cmd else [sys.executable, "-m", "detokd", "serve"]
            cmd = prefix + ["--input", base, "--worker", h.text_addr, "--tokenizer", tokenizer, "--log-level", "warning"]
            if self.shards > 1:
                cmd += ["--shards", str(self.shards)]
            if args.max_states:
                cmd += ["--max-states", str(args.max_states)]
            cmd += shlex.split(args.detokd_args or "")
        else:
            cmd = [sys.executable, str(Path(__file__).resolve().parent / "baselines.py"), "--algo", name,
                   "--input", base, "--worker", h.text_addr, "--tokenizer", tokenizer]
        self.cmd = cmd
        self.proc = _spawn(cmd, self.log_path)
        self.tree = ProcTree(self.proc.pid)
        addrs = [base] if self.shards == 1 else [shard_address(base, i) for i in range(self.shards)]
        self.socks = []
        for a in addrs:
            s = h.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(a)
            self.socks.append(s)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        for s in self.socks:
            s.close(linger=0)
        _stop_proc(self.proc)


# --------------------------------------------------------------------------- one run


class Progress:
    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.i = total, 0
        self.tty = sys.stderr.isatty() and not quiet
        self.quiet = quiet
        self.last = 0.0
        self.t0 = time.monotonic()
        self.label = ""
        self.width = 0

    def begin(self, label: str) -> None:
        self.i += 1
        self.label = label
        self.last = 0.0

    def update(self, text: str, force: bool = False) -> None:
        if not self.tty:
            return
        t = time.monotonic()
        if not force and t - self.last < 0.2:
            return
        self.last = t
        line = f"[{self.i}/{self.total} {t - self.t0:5.0f}s] {self.label}  {text}"
        cols = 160
        try:
            cols = os.get_terminal_size(sys.stderr.fileno()).columns - 1
        except OSError:
            pass
        line = line[:cols]
        sys.stderr.write("\r" + line + " " * max(0, self.width - len(line)))
        sys.stderr.flush()
        self.width = len(line)

    def done(self, text: str) -> None:
        if self.tty:
            self.update(text, force=True)
        elif not self.quiet:
            _log(f"[{self.i}/{self.total} {time.monotonic() - self.t0:5.0f}s] {self.label}  {text}")

    def close(self) -> None:
        if self.tty and self.width:
            sys.stderr.write("\r" + " " * self.width + "\r")
            sys.stderr.flush()


_START, _STEP, _FINISH = 0, 1, 2


def run_config(impl: Impl, wl: Workload, *, steps: int, min_seconds: float, max_seconds: float,
               lat_steps: int, lat_max_seconds: float, window: int, check: str,
               progress: Progress) -> dict:
    """One configuration through one implementation.

    Throughput phase: rounds of `steps` steps (every stream starts, runs `steps` steps,
    finishes), `window` steps in flight, until `min_seconds` have passed (at least one
    round; a round is cut short after `max_seconds`). Latency phase: one round of
    `lat_steps` steps, one step in flight. Each round ends with a step of finishing rows."""
    h = impl.h
    B, n = wl.batch, wl.n
    shards = impl.shards
    fr = wl.frames(shards)
    start_p, finish_p, cyc = fr["start"], fr["finish"], fr["cyc"]
    P = len(cyc)
    socks = impl.socks
    sock0 = socks[0]
    single = shards == 1
    if check == "sample":
        watch_idx = sorted({0, B - 1, B // 2, B // 3, (2 * B) // 3, B // 7})
    elif check == "all":
        watch_idx = list(range(B))
    else:
        watch_idx = []
    h.configure(B, check, [wl.rids[i] for i in watch_idx] if check == "sample" else [])

    enc = h.enc
    now = time.monotonic_ns
    kind: list[int] = []
    send_t: list[int] = []
    recv_t: list[int] = []
    lat: list[int] = []
    done = bytearray()
    impl.tree.refresh()
    impl.tree.reset_peak()
    state = {"next": 0}  # lowest step not yet acked
    stall_s = max(30.0, max_seconds * 4)

    def take_ack(timeout: float) -> None:
        a = h.recv_ack(timeout)
        if a[0] != _ACK_STEP:
            return
        _, s, t_recv, l = a
        if s >= len(done) or done[s]:
            return
        done[s] = 1
        lat[s] = l
        recv_t[s] = t_recv
        nx = state["next"]
        while nx < len(done) and done[nx]:
            nx += 1
        state["next"] = nx

    def send(pieces: list, seq: int, k: int) -> None:
        while len(done) - state["next"] >= win[0]:
            take_ack(stall_s)
        t = now()
        tail = step_tail(seq, (len(send_t), t))
        send_t.append(t)
        recv_t.append(0)
        lat.append(0)
        done.append(0)
        kind.append(k)
        if single:
            sock0.send(tail.join(pieces[0][1]))
        else:
            for s, parts in pieces:
                socks[s].send(tail.join(parts))

    win = [window]

    def one_round(nsteps: int, t_cap: float, label: str) -> int:
        """Returns the steps the round ran (it stops early past t_cap)."""
        g0 = len(send_t)
        j = 0
        while j < nsteps:
            send(start_p if j == 0 else cyc[j % P], j * n, _START if j == 0 else _STEP)
            j += 1
            if (j & 15) == 0:
                tm = time.monotonic()
                if tm > t_cap:
                    break
                if progress.tty and tm - progress.last > 0.2:
                    el = (now() - send_t[g0]) / 1e9
                    progress.update(f"{label} step {j}/{nsteps}  {fmt_rate(j * B * n / el if el > 0 else 0)} tok/s")
        send(finish_p, j * n, _FINISH)
        return j

    def drain() -> None:
        while state["next"] < len(done):
            take_ack(stall_s)

    gc_was = gc.isenabled()
    gc.disable()
    try:
        c0 = impl.tree.cpu_ns()
        p0 = impl.tree.cpu_psutil()
        s0 = h.self_tree.cpu_ns()
        w0 = h.worker_tree.cpu_ns()
        m0 = machine_busy_ns()
        st0 = steal_ns()
        t0 = time.monotonic()
        rounds: list[int] = []
        while True:
            rounds.append(one_round(steps, t0 + max_seconds, "throughput"))
            if time.monotonic() - t0 >= min_seconds or rounds[-1] < steps:
                break
        drain()
        g1 = len(send_t)
        c1 = impl.tree.cpu_ns()
        p1 = impl.tree.cpu_psutil()
        s1 = h.self_tree.cpu_ns()
        w1 = h.worker_tree.cpu_ns()
        m1 = machine_busy_ns()
        st1 = steal_ns()
        lat_rounds: list[int] = []
        if lat_steps:
            win[0] = 1
            lat_rounds.append(one_round(lat_steps, time.monotonic() + lat_max_seconds, "latency"))
            drain()
    finally:
        if gc_was:
            gc.enable()

    tokens = sum(rounds) * B * n
    secs = (recv_t[g1 - 1] - send_t[0]) / 1e9
    tput_lat = [lat[g] for g in range(g1) if kind[g] == _STEP]
    idle_lat = [lat[g] for g in range(g1, len(lat)) if kind[g] == _STEP]
    start_lat = [lat[g] / 1e6 for g in range(g1) if kind[g] == _START]
    finish_lat = [lat[g] / 1e6 for g in range(g1) if kind[g] == _FINISH]
    result: dict[str, Any] = dict(
        impl=impl.name, tokenizer=wl.corp.name, batch=B, ids_per_row=n, shards=shards,
        steps=steps, rounds=len(rounds), steps_run=sum(rounds), latency_steps=sum(lat_rounds),
        tokens=tokens, seconds=secs,
        tok_per_s=tokens / secs if secs > 0 else None,
        window=window,
        lat_loaded=lat_stats(tput_lat),
        lat_idle=lat_stats(idle_lat),
        first_step_ms=_median(start_lat),  # step 0: every stream starts
        finish_step_ms=_median(finish_lat),
        cpu_s_per_mtok=(c1 - c0) / 1e9 / tokens * 1e6 if tokens else None,
        cpu_s_per_mtok_psutil=(p1 - p0) / tokens * 1e6 if tokens else None,
        cpu_util=(c1 - c0) / 1e9 / secs if secs > 0 else None,
        scheduler_cpu_s_per_mtok=(s1 - s0) / 1e9 / tokens * 1e6 if tokens else None,
        worker_cpu_s_per_mtok=(w1 - w0) / 1e9 / tokens * 1e6 if tokens else None,
        peak_rss_mb=impl.tree.peak_rss_mb(),
        # Cores kept busy by processes outside the benchmark (another test run, ...)
        # during the throughput phase: should be ~0 for the figures to mean anything.
        other_cores=(max(0, (m1 - m0) - (c1 - c0) - (s1 - s0) - (w1 - w0)) / 1e9 / secs)
        if (m0 is not None and m1 is not None and secs > 0) else None,
        steal_cores=((st1 - st0) / 1e9 / secs) if (st0 is not None and st1 is not None and secs > 0) else None,
        truncated=rounds[-1] < steps,
    )
    # Check the text: each watched rid received every round's text, in order.
    dump = h.dump()
    bad = []
    for i in watch_idx:
        rid = wl.rids[i]
        got = dump["texts"].get(rid, "")
        ref = wl.reference(i, rounds + lat_rounds)
        if got != ref:
            j = next((x for x in range(min(len(got), len(ref))) if got[x] != ref[x]), min(len(got), len(ref)))
            bad.append({"rid": rid, "at": j, "got": got[max(0, j - 10):j + 10], "want": ref[max(0, j - 10):j + 10],
                        "len_got": len(got), "len_want": len(ref)})
    result["check"] = {
        "mode": check, "streams": len(watch_idx), "mismatches": len(bad), "examples": bad[:3],
        "errors": dump["n_errors"], "error_examples": dump["errors"][:5], "bad_frames": dump["bad_frames"],
    }
    return result


# --------------------------------------------------------------------------- the whole benchmark


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="bench.py",
        description="End-to-end detokenizer benchmark: scheduler -> implementation -> worker processes over ipc:// ZMQ.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="a smoke run of a few seconds per implementation (deepseek, B 1 and 64, short streams, every stream checked); writes to a temp folder unless --out is given")
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma list of implementations: " + ", ".join(IMPLS))
    ap.add_argument("--tokenizers", default=",".join(TOKENIZERS), help="comma list of zoo names or tokenizer folders")
    ap.add_argument("--batch", "-B", default="1,64,256,1024", help="comma list of concurrent streams B")
    ap.add_argument("--ids-per-row", default="1,4", help="comma list: new ids per row per step (4 = speculative decoding)")
    ap.add_argument("--steps", type=int, default=1000, help="output length: steps of one round of the throughput phase (window --window)")
    ap.add_argument("--min-seconds", type=float, default=1.0, help="the throughput phase repeats rounds (new requests on the same rids) until this long")
    ap.add_argument("--latency-steps", type=int, default=300, help="steps of the idle-latency phase (one step in flight)")
    ap.add_argument("--window", type=int, default=2, help="steps in flight in the throughput phase")
    ap.add_argument("--max-seconds", type=float, default=2.0, help="cap on the throughput phase of one configuration (slow baselines run fewer steps)")
    ap.add_argument("--latency-max-seconds", type=float, default=1.0, help="cap on the idle-latency phase of one configuration")
    ap.add_argument("--long-steps", type=int, default=32768, help="flatness run: output length (0: no flatness run)")
    ap.add_argument("--long-batch", type=int, default=64, help="flatness run: streams")
    ap.add_argument("--probe-every", type=int, default=64, help="flatness run: steps between two probes (a long-stream step and a short-stream step measured alone, back to back)")
    ap.add_argument("--short-len", type=int, default=256, help="flatness run: output length of the short control streams (their mean position is half of it)")
    ap.add_argument("--long-impls", default="detokd,sglang,decodestream,floor", help="flatness run: implementations (naive is quadratic)")
    ap.add_argument("--long-tokenizers", default="deepseek", help="flatness run: tokenizers")
    ap.add_argument("--long-max-seconds", type=float, default=90.0, help="flatness run: cap per implementation")
    ap.add_argument("--check", choices=("off", "sample", "all"), default="sample", help="compare streamed text with the reference decode: off, a few streams per configuration, or all")
    ap.add_argument("--quiet-cores", type=float, default=0.2, help="a run during which other processes kept more cores than this busy is disturbed: it is retried, and the flatness run ignores such windows")
    ap.add_argument("--retries", type=int, default=1, help="extra attempts of a disturbed configuration (the least disturbed one is kept)")
    ap.add_argument("--quiet-wait", type=float, default=10.0, help="seconds to wait, before each configuration, for other processes to leave the cores idle")
    ap.add_argument("--quiet-budget", type=float, default=120.0, help="seconds of such waiting over the whole run, at most")
    ap.add_argument("--shards", type=int, default=1, help="detokd only: `serve --shards N`, rows routed by crc32(rid) %% N to <input>.<i>")
    ap.add_argument("--max-states", type=int, default=0, help="detokd only: pass --max-states N (0: its default)")
    ap.add_argument("--detokd-cmd", default="", help="command that starts detokd's server, instead of `python -m detokd serve` of this checkout (e.g. \"env PYTHONPATH=/other/tree python -m detokd serve\")")
    ap.add_argument("--detokd-args", default="", help="extra arguments for `python -m detokd serve`")
    ap.add_argument("--out", default=None, help="folder for results.json, table.md and the plots (default docs/bench, or a temp folder with --quick)")
    ap.add_argument("--keep-tmp", action="store_true", help="keep the temporary folder (sockets, process logs)")
    ap.add_argument("--no-plot", action="store_true", help="do not draw the plots")
    ap.add_argument("--quiet", "-q", action="store_true", help="no progress display")
    ap.add_argument("--report", metavar="RESULTS_JSON", help="only print the markdown tables of a results.json (and redraw its plots)")
    ap.add_argument("--summary", action="store_true", help="with --report: the shorter tables of docs/performance.md")
    ap.add_argument("--worker-mode", nargs=2, metavar=("TEXT_ADDR", "ACK_ADDR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        d = ap.parse_args([])
        for name, val in (("tokenizers", "deepseek"), ("batch", "1,64"), ("steps", 200), ("latency_steps", 50),
                          ("long_steps", 2048), ("probe_every", 16), ("check", "all"), ("max_seconds", 1.0), ("min_seconds", 0.2),
                          ("quiet_wait", 0.0), ("retries", 0)):
            if getattr(args, name) == getattr(d, name):
                setattr(args, name, val)
    return args


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def versions() -> dict:
    out = {"python": platform.python_version()}
    for mod in ("tokenizers", "transformers", "zmq", "msgspec", "psutil"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:
            pass
    return out


def machine() -> dict:
    info = {"cpus": os.cpu_count(), "platform": platform.platform()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["mem_gb"] = round(int(f.readline().split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return info


def start_impl(name: str, tokenizer: str, h: Harness, args, corp: Corpus) -> Impl:
    """Launch and wait until it has answered a small warm-up round (64 streams, 8 steps)."""
    impl = Impl(name, tokenizer, h, args)
    wl = Workload(corp, 64, 1, f"warm{name}")
    try:
        fr = wl.frames(impl.shards)
        h.configure(64, "off", [])
        # Frames sent before the process binds wait in the socket: send, then wait.
        for k in range(9):
            pieces = fr["start"] if k == 0 else fr["finish"] if k == 8 else fr["cyc"][k]
            tail = step_tail(k, (k, time.monotonic_ns()))
            for s, parts in pieces:
                impl.socks[s].send(tail.join(parts))
        deadline = time.monotonic() + 180
        got: set[int] = set()
        while len(got) < 9:
            if not impl.alive():
                raise RuntimeError(f"{name} exited ({impl.proc.returncode}):\n{impl.log_tail()}")
            try:
                a = h.recv_ack(2.0)
            except Stall:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not answer within 180 s:\n{impl.log_tail()}")
                continue
            if a[0] == _ACK_STEP:
                got.add(a[1])
        dump = h.dump()
        if dump["n_errors"]:
            _log(f"warning: {name} answered the warm-up with error rows: {dump['errors'][:3]}")
    except BaseException:
        impl.stop()
        raise
    impl.tree.refresh()
    return impl


def run_flatness(impl: Impl, wl_long: Workload, wl_short: Workload, *, steps: int, probe_every: int,
                 short_len: int, window: int, max_seconds: float, check: str, progress: Progress,
                 segments: int = 8) -> dict:
    """Per-token cost at output length ~`steps` against ~`short_len`/2, drift-free.

    B long streams run `steps` steps (window `window`). Every `probe_every` steps the
    pipeline is drained and two steps go through it alone, back to back (in alternating
    order): one of the long streams and one of B short streams (a control set that
    restarts every `short_len` steps, so its rows sit at output positions 1..short_len,
    mean ≈ short_len/2). The
    implementation's CPU time is read around each of the two: both costs are measured
    within a millisecond of each other, so the machine's own drift (a VM's speed moves
    by ±20% over seconds here) cancels in their ratio."""
    h = impl.h
    B, n = wl_long.batch, wl_long.n
    assert wl_short.batch == B and wl_short.n == n
    shards = impl.shards
    L, S = wl_long.frames(shards), wl_short.frames(shards)
    socks, sock0, single = impl.socks, impl.socks[0], shards == 1
    watch_idx = sorted({0, B - 1, B // 2}) if check != "off" else []
    watch = [wl_long.rids[i] for i in watch_idx] + [wl_short.rids[i] for i in watch_idx]
    h.configure(B, "sample" if watch else "off", watch)
    now = time.monotonic_ns
    cpu = impl.tree.cpu_ns
    impl.tree.refresh()
    impl.tree.reset_peak()
    sent = [0]
    acked = [0]
    stall_s = 60.0

    def take_ack() -> None:
        a = h.recv_ack(stall_s)
        if a[0] == _ACK_STEP:
            acked[0] += 1  # steps complete in order; only their count matters here

    def send(pieces: list, seq: int, win: int) -> None:
        while sent[0] - acked[0] >= win:
            take_ack()
        t = now()
        tail = step_tail(seq, (sent[0], t))
        sent[0] += 1
        if single:
            sock0.send(tail.join(pieces[0][1]))
        else:
            for s, parts in pieces:
                socks[s].send(tail.join(parts))

    def drain() -> None:
        while acked[0] < sent[0]:
            take_ack()

    probes: list[list] = []  # [long position, long ns, short position, short ns, machine-other ns, wall ns]
    short_rounds: list[int] = []
    sp = [0]  # the short set's next step in its round
    # Between two probes the control set moves on by `stride` steps, so that every
    # stretch of the long run samples it over a whole round (mean position short_len/2).
    stride = max(1, round(short_len * segments * probe_every / max(1, steps)))

    def short_step(win: int) -> None:
        k = sp[0]
        send(S["start"] if k == 0 else S["cyc"][k % len(S["cyc"])], k * n, win)
        sp[0] = k + 1
        if sp[0] >= short_len:
            send(S["finish"], sp[0] * n, win)
            short_rounds.append(sp[0])
            sp[0] = 0
    gc_was = gc.isenabled()
    gc.disable()
    t0 = time.monotonic()
    c_start, t_start = cpu(), now()
    m_start = machine_busy_ns()
    h_start = h.self_tree.cpu_ns() + h.worker_tree.cpu_ns()
    try:
        j = 0
        while j < steps:
            lp = L["start"] if j == 0 else L["cyc"][j % len(L["cyc"])]
            if j and j % probe_every == 0:
                for _ in range(stride - 1):
                    short_step(window)
                if sp[0] == 0:  # a start step is not measured
                    short_step(window)
                drain()
                pos = sp[0]
                sp_piece = S["cyc"][pos % len(S["cyc"])]
                long_first = len(probes) % 2 == 0  # alternate, so the order's own effect cancels
                m0, w0 = machine_busy_ns(), now()
                hc0 = h.self_tree.cpu_ns() + h.worker_tree.cpu_ns()
                c0 = cpu()
                if long_first:
                    send(lp, j * n, 1)
                else:
                    send(sp_piece, pos * n, 1)
                drain()
                c1 = cpu()
                if long_first:
                    send(sp_piece, pos * n, 1)
                else:
                    send(lp, j * n, 1)
                drain()
                c2 = cpu()
                hc1 = h.self_tree.cpu_ns() + h.worker_tree.cpu_ns()
                m1, w1 = machine_busy_ns(), now()
                lc, sc = (c1 - c0, c2 - c1) if long_first else (c2 - c1, c1 - c0)
                probes.append([j, lc, pos, sc, (m1 or 0) - (m0 or 0) - (c2 - c0) - (hc1 - hc0), w1 - w0])
                sp[0] = pos + 1
                if sp[0] >= short_len:
                    send(S["finish"], sp[0] * n, window)
                    short_rounds.append(sp[0])
                    sp[0] = 0
            else:
                send(lp, j * n, window)
            j += 1
            if (j & 63) == 0:
                tm = time.monotonic()
                if tm - t0 > max_seconds:
                    break
                if progress.tty and tm - progress.last > 0.2:
                    el = (now() - t_start) / 1e9
                    progress.update(f"flatness step {j}/{steps}  {fmt_rate(j * B * n / el if el > 0 else 0)} tok/s  {len(probes)} probes")
        send(L["finish"], j * n, window)
        if sp[0]:
            send(S["finish"], sp[0] * n, window)
            short_rounds.append(sp[0])
        drain()
    finally:
        if gc_was:
            gc.enable()
    secs = (now() - t_start) / 1e9
    tokens = (j + sum(short_rounds)) * B * n
    c_end = cpu()
    m_end = machine_busy_ns()
    h_end = h.self_tree.cpu_ns() + h.worker_tree.cpu_ns()
    summary = flatness_summary(probes, B * n, j, segments)
    result: dict[str, Any] = dict(
        impl=impl.name, tokenizer=wl_long.corp.name, batch=B, ids_per_row=n, shards=shards,
        steps=steps, steps_run=j, probes=len(probes), probe_every=probe_every, short_len=short_len, short_stride=stride,
        tokens=tokens, seconds=secs, tok_per_s=tokens / secs if secs > 0 else None,
        cpu_s_per_mtok=(c_end - c_start) / 1e9 / tokens * 1e6 if tokens else None,
        peak_rss_mb=impl.tree.peak_rss_mb(),
        other_cores=(max(0, (m_end - m_start) - (c_end - c_start) - (h_end - h_start)) / 1e9 / secs)
        if (m_start and m_end and secs) else None,
        flatness=summary, probe_data=probes,
    )
    dump = h.dump()
    bad = 0
    for i in watch_idx:
        if dump["texts"].get(wl_long.rids[i], "") != wl_long.reference(i, [j]):
            bad += 1
        if dump["texts"].get(wl_short.rids[i], "") != wl_short.reference(i, short_rounds):
            bad += 1
    result["check"] = {"mode": "sample" if watch else "off", "streams": len(watch), "mismatches": bad,
                       "examples": [], "errors": dump["n_errors"], "error_examples": dump["errors"][:5],
                       "bad_frames": dump["bad_frames"]}
    return result


def flatness_summary(probes: list, tokens_per_step: int, length: int, segments: int) -> dict:
    """Probe costs in `segments` stretches of the long run: medians of the long and the
    short (control) steps' µs/token, and their ratio. The first stretch has both sets at
    similar lengths (ratio ≈ 1 unless the two sets differ); the last one compares
    output length ≈`length` with the control's ≈short_len/2."""
    if not probes:
        return {"segments": []}
    seg_len = max(1, length // segments)
    out = []
    for k in range(segments):
        ps = [p for p in probes if k * seg_len <= p[0] < (k + 1) * seg_len]
        if not ps:
            continue
        lu = _median([p[1] / 1e3 / tokens_per_step for p in ps])
        su = _median([p[3] / 1e3 / tokens_per_step for p in ps])
        out.append({
            "long_pos": _median([p[0] for p in ps]), "short_pos": sum(p[2] for p in ps) / len(ps),
            "long_us_per_tok": lu, "short_us_per_tok": su, "ratio": lu / su if su else None,
            "probes": len(ps), "other_cores": sum(p[4] for p in ps) / max(1, sum(p[5] for p in ps)),
        })
    first, last = out[0], out[-1]
    return {
        "segments": out,
        "early_len": first["long_pos"], "late_len": last["long_pos"], "short_len": last["short_pos"],
        "early_ratio": first["ratio"], "late_ratio": last["ratio"],
        "late_long_us_per_tok": last["long_us_per_tok"], "late_short_us_per_tok": last["short_us_per_tok"],
        "early_long_us_per_tok": first["long_us_per_tok"], "early_short_us_per_tok": first["short_us_per_tok"],
    }


def run(args) -> int:
    impls = _csv(args.impls)
    for i in impls:
        if i not in IMPLS:
            raise SystemExit(f"unknown implementation {i!r}; known: {', '.join(IMPLS)}")
    toks = _csv(args.tokenizers)
    batches = [int(x) for x in _csv(args.batch)]
    nids = [int(x) for x in _csv(args.ids_per_row)]
    long_impls = [i for i in _csv(args.long_impls) if i in impls] if args.long_steps else []
    long_toks = [t for t in _csv(args.long_tokenizers) if t in toks] if args.long_steps else []
    out_dir = Path(args.out) if args.out else (
        Path(tempfile.mkdtemp(prefix="detokd-bench-quick-")) if args.quick else ROOT / "docs" / "bench")
    out_dir.mkdir(parents=True, exist_ok=True)

    results: dict[str, Any] = {
        "command": "python scripts/bench.py" + ("" if not sys.argv[1:] else " " + shlex.join(sys.argv[1:])),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine(), "versions": versions(),
        "options": {k: v for k, v in vars(args).items() if k not in ("worker_mode", "report")},
        "runs": [], "flatness": [], "failures": [],
    }
    total = len(toks) * len(batches) * len(nids) * len(impls) + len(long_toks) * len(long_impls)
    progress = Progress(total, args.quiet)
    tmp = Path(tempfile.mkdtemp(prefix="detokd-bench-"))
    h = Harness(tmp, args)
    running_all: dict[str, Impl] = {}
    t_start = time.monotonic()

    def save() -> None:
        results["wall_seconds"] = time.monotonic() - t_start
        results["ratios"] = ratios(results["runs"])
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))

    try:
        for tok in toks:
            progress.label = f"{tok}: building the streams"
            progress.update("", force=True)
            corp = Corpus(tok)
            running: dict[str, Impl] = {}
            running_all = running
            for name in impls:
                progress.label = f"{tok}: starting {name}"
                progress.update("", force=True)
                try:
                    running[name] = start_impl(name, tok, h, args, corp)
                except Exception as e:
                    progress.close()
                    _log(f"{name} ({tok}) failed to start: {e}")
                    results["failures"].append({"impl": name, "tokenizer": tok, "error": str(e)})
            cid = 0
            for n in nids:
                for B in batches:
                    cid += 1
                    progress.label = f"{tok} B={B} ids/row={n}: building messages"
                    progress.update("", force=True)
                    wl = Workload(corp, B, n, f"c{cid}")
                    wl.frames(args.shards if "detokd" in impls else 1)
                    if args.shards > 1 and len(impls) > 1:
                        wl.frames(1)
                    for name in impls:
                        progress.begin(f"{name:<12} {tok} B={B} ids/row={n}")
                        impl = running.get(name)
                        if impl is None:
                            continue
                        try:
                            r = None
                            for attempt in range(1 + max(0, args.retries)):
                                wait_quiet(args.quiet_cores, args.quiet_wait, progress, args.quiet_budget)
                                ri = run_config(impl, wl, steps=args.steps, min_seconds=args.min_seconds,
                                                max_seconds=args.max_seconds, lat_steps=args.latency_steps,
                                                lat_max_seconds=args.latency_max_seconds, window=args.window,
                                                check=args.check, progress=progress)
                                ri["attempt"] = attempt + 1
                                if r is None or (ri["other_cores"] or 0) < (r["other_cores"] or 0):
                                    r = ri
                                if (ri["other_cores"] or 0) <= args.quiet_cores:
                                    break
                        except (Stall, RuntimeError) as e:
                            progress.close()
                            _log(f"{name} {tok} B={B} n={n}: {e}\n{impl.log_tail()}")
                            results["failures"].append({"impl": name, "tokenizer": tok, "batch": B, "ids_per_row": n, "error": str(e)})
                            impl.stop()
                            running.pop(name, None)
                            try:
                                running[name] = start_impl(name, tok, h, args, corp)
                            except Exception as e2:
                                _log(f"{name} ({tok}) failed to restart: {e2}")
                            continue
                        results["runs"].append(r)
                        chk = r["check"]
                        flag = "" if not (chk["mismatches"] or chk["errors"]) else f"  CHECK: {chk['mismatches']} mismatches, {chk['errors']} errors"
                        il = r["lat_idle"] or r["lat_loaded"] or {}
                        progress.done(f"{fmt_rate(r['tok_per_s'])} tok/s  p99 {il.get('p99_ms', float('nan')):.2f} ms  "
                                      f"{r['cpu_s_per_mtok'] or 0:.2f} cpu-s/Mtok{flag}")
                    del wl
                    save()
            if tok in long_toks:
                wl = Workload(corp, args.long_batch, 1, "long")
                wl_short = Workload(corp, args.long_batch, 1, "short")
                for name in long_impls:
                    progress.begin(f"{name:<12} {tok} flatness B={args.long_batch} length {args.long_steps}")
                    impl = running.get(name)
                    if impl is None:
                        continue
                    try:
                        wait_quiet(args.quiet_cores, args.quiet_wait, progress, args.quiet_budget)
                        r = run_flatness(impl, wl, wl_short, steps=args.long_steps, probe_every=args.probe_every,
                                         short_len=args.short_len, window=args.window,
                                         max_seconds=args.long_max_seconds, check=args.check, progress=progress)
                    except (Stall, RuntimeError) as e:
                        progress.close()
                        _log(f"{name} {tok} flatness: {e}\n{impl.log_tail()}")
                        results["failures"].append({"impl": name, "tokenizer": tok, "flatness": True, "error": str(e)})
                        continue
                    fl = r["flatness"]
                    results["flatness"].append(r)
                    progress.done(f"{fmt_rate(r['tok_per_s'])} tok/s  µs/token at {fl.get('late_len', 0):.0f}: "
                                  f"{fl.get('late_long_us_per_tok', 0):.3f}, control at {fl.get('short_len', 0):.0f}: "
                                  f"{fl.get('late_short_us_per_tok', 0):.3f} ({fl.get('late_ratio') or 0:.2f}×)")
                del wl, wl_short
                save()
            for impl in running.values():
                impl.stop()
    except KeyboardInterrupt:
        progress.close()
        _log("interrupted: saving what ran")
    finally:
        progress.close()
        for impl in list(running_all.values()):
            impl.stop()
        h.close()
        save()
        if not args.keep_tmp:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        else:
            _log(f"logs and sockets kept in {tmp}")
    results["quiet_wait_seconds"] = _WAITED[0]
    save()
    print(f"results: {out_dir / 'results.json'}  ({results['wall_seconds']:.0f} s, {_WAITED[0]:.0f} s of it waiting for other processes)")
    md = report(results)
    (out_dir / "table.md").write_text(md)
    (out_dir / "summary.md").write_text(report(results, full=False))
    print(md)
    if not args.no_plot:
        for p in plot(results, out_dir):
            print(f"plot: {p}")
    return 1 if results["failures"] else 0


# --------------------------------------------------------------------------- ratios, report, plots


def _index(runs: list[dict]) -> dict:
    return {(r["impl"], r["tokenizer"], r["batch"], r["ids_per_row"]): r for r in runs}


def ratios(runs: list[dict]) -> list[dict]:
    idx = _index(runs)
    out = []
    for (impl, tok, B, n), r in sorted(idx.items(), key=lambda kv: (kv[0][1], kv[0][3], kv[0][2])):
        if impl != "detokd":
            continue
        row = {"tokenizer": tok, "batch": B, "ids_per_row": n, "vs": {}}
        for b in BASELINES:
            o = idx.get((b, tok, B, n))
            if not o:
                continue
            row["vs"][b] = {
                "tok_per_s": (r["tok_per_s"] / o["tok_per_s"]) if r["tok_per_s"] and o["tok_per_s"] else None,
                # > 1: detokd spends less CPU per token than the baseline
                "cpu_per_token": (o["cpu_s_per_mtok"] / r["cpu_s_per_mtok"]) if r["cpu_s_per_mtok"] and o["cpu_s_per_mtok"] else None,
            }
        out.append(row)
    return out


def _f(x, spec=".2f", none="–"):
    return none if x is None else format(x, spec)


def targets(res: dict) -> list[tuple[str, str, Optional[bool]]]:
    idx = _index(res["runs"])
    out = []
    d = idx.get(("detokd", "deepseek", 256, 1))

    def ratio_to(b):
        o = idx.get((b, "deepseek", 256, 1))
        return d["tok_per_s"] / o["tok_per_s"] if d and o and d["tok_per_s"] and o["tok_per_s"] else None

    tps = d["tok_per_s"] if d else None
    out.append(("≥ 1,000,000 tok/s through detokd, B=256, 1 id/row, deepseek", f"{fmt_rate(tps)} tok/s", None if tps is None else tps >= 1e6))
    for b, want in (("sglang", 5), ("decodestream", 2)):
        x = ratio_to(b)
        out.append((f"≥ {want}× the {b} baseline (same configuration)", f"{_f(x)}×", None if x is None else x >= want))
    d1024 = idx.get(("detokd", "deepseek", 1024, 1))
    p99 = (d1024.get("lat_idle") or {}).get("p99_ms") if d1024 else None
    out.append(("p99 step latency ≤ 1 ms at B=1024 (deepseek, 1 id/row, one step in flight)", f"{_f(p99, '.3f')} ms", None if p99 is None else p99 <= 1.0))
    fl = next((f for f in res.get("flatness", []) if f["impl"] == "detokd" and f["tokenizer"] == "deepseek"), None)
    ff = fl["flatness"] if fl else {}
    x = ff.get("late_ratio")
    if x is not None:
        txt = (f"{_f(x)}× ({_f(ff['late_long_us_per_tok'], '.3f')} µs/token at length ≈{ff['late_len']:.0f}, "
               f"{_f(ff['late_short_us_per_tok'], '.3f')} µs at ≈{ff['short_len']:.0f}, measured side by side)")
    else:
        txt = "–"
    out.append((f"per-token CPU at length {fl['steps'] if fl else 32768:,} within 1.1× of length ≈128", txt, None if x is None else x <= 1.1))
    fo = idx.get(("floor", "deepseek", 256, 1))
    c = d["cpu_s_per_mtok"] / fo["cpu_s_per_mtok"] if d and fo and d["cpu_s_per_mtok"] and fo["cpu_s_per_mtok"] else None
    out.append(("within 2× of the floor: detokd's CPU per token ÷ the floor's (B=256, 1 id/row, deepseek)", f"{_f(c)}×", None if c is None else c <= 2))
    return out


def report(res: dict, full: bool = True) -> str:
    """Markdown tables of a results dict; full=False leaves out the per-implementation
    latency table (docs/performance.md embeds that shorter form)."""
    runs = res["runs"]
    quiet = res.get("options", {}).get("quiet_cores", 0.2)

    def disturbed(r) -> bool:
        return (r.get("other_cores") or 0) > quiet

    idx = _index(runs)
    impls = [i for i in IMPLS if any(r["impl"] == i for r in runs)]
    shards = max((r.get("shards", 1) for r in runs if r["impl"] == "detokd"), default=1)
    keys = sorted({(r["tokenizer"], r["ids_per_row"], r["batch"]) for r in runs},
                  key=lambda k: (TOKENIZERS.index(k[0]) if k[0] in TOKENIZERS else 99, k[0], k[1], k[2]))
    L: list[str] = []
    L.append(f"Command: `{res['command']}`  ")
    m = res.get("machine", {})
    L.append(f"Machine: {m.get('cpus')} CPUs ({m.get('cpu', '?')}), {m.get('mem_gb', '?')} GB; "
             f"{res.get('date', '')}; wall time {res.get('wall_seconds', 0):.0f} s  ")
    L.append("Versions: " + ", ".join(f"{k} {v}" for k, v in res.get("versions", {}).items()) + "  ")
    nd = sum(1 for r in runs if disturbed(r))
    L.append(f"Configurations during which other processes of the machine kept more than {quiet} cores busy "
             f"(marked †, after {res.get('options', {}).get('retries', 0)} retry): {nd} of {len(runs)}; "
             f"{res.get('quiet_wait_seconds', 0):.0f} s were spent waiting for a quiet machine.")
    L.append("")
    if any(r["impl"] == "detokd" for r in runs):
        L.append("### Targets\n")
        L.append("| target | measured | met |")
        L.append("| --- | --- | --- |")
        for name, val, ok in targets(res):
            L.append(f"| {name} | {val} | {'–' if ok is None else ('yes' if ok else '**no**')} |")
        L.append("")
    L.append("### Throughput, tokens/s through the whole pipeline\n")
    others = [b for b in BASELINES if b in impls]
    hdr = "| tokenizer | B | ids/row | " + " | ".join(i if i != "detokd" or shards == 1 else f"detokd --shards {shards}" for i in impls)
    ratio_cols = others if "detokd" in impls else []
    if ratio_cols:
        hdr += " | " + " | ".join(f"detokd ÷ {b}" for b in ratio_cols)
    L.append(hdr + " |")
    L.append("|" + " --- |" * (3 + len(impls) + len(ratio_cols)))
    for tok, n, B in keys:
        cells = []
        for i in impls:
            r = idx.get((i, tok, B, n))
            c = fmt_rate(r["tok_per_s"]) if r else "–"
            if r and r.get("truncated"):
                c += f" ({r.get('steps_run', r['steps'])} steps)"
            if r and disturbed(r):
                c += " †"
            cells.append(c)
        if ratio_cols:
            d = idx.get(("detokd", tok, B, n))
            for b in ratio_cols:
                o = idx.get((b, tok, B, n))
                x = d["tok_per_s"] / o["tok_per_s"] if d and o and d["tok_per_s"] and o["tok_per_s"] else None
                cells.append(f"{_f(x, '.1f')}×")
        L.append(f"| {tok} | {B} | {n} | " + " | ".join(cells) + " |")
    L.append("")
    if "detokd" in impls:
        L.append("### detokd: latency (ms) and cost\n")
        L.append("Idle = one step in flight; loaded = the throughput phase (window "
                 f"{res.get('options', {}).get('window', 2)}); first = step 0, which starts every stream.\n")
        L.append("| tokenizer | B | ids/row | tok/s | idle p50 | idle p99 | idle max | loaded p50 | loaded p99 | loaded max | first | cpu-s/Mtok | cores used | peak RSS MB | other cores |")
        L.append("|" + " --- |" * 15)
        for tok, n, B in keys:
            r = idx.get(("detokd", tok, B, n))
            if not r:
                continue
            li, ll = r.get("lat_idle") or {}, r.get("lat_loaded") or {}
            L.append(f"| {tok} | {B} | {n} | {fmt_rate(r['tok_per_s'])} | {_f(li.get('p50_ms'), '.3f')} | {_f(li.get('p99_ms'), '.3f')} | "
                     f"{_f(li.get('max_ms'), '.3f')} | {_f(ll.get('p50_ms'), '.3f')} | {_f(ll.get('p99_ms'), '.3f')} | {_f(ll.get('max_ms'), '.3f')} | "
                     f"{_f(r.get('first_step_ms'), '.2f')} | {_f(r.get('cpu_s_per_mtok'))} | {_f(r.get('cpu_util'))} | "
                     f"{_f(r.get('peak_rss_mb'), '.0f')} | {_f(r.get('other_cores'))}{' †' if disturbed(r) else ''} |")
        L.append("")
    if full:
        L.extend(_latency_table(res, impls, keys, idx))
    L.append("### Step latency p99 (ms), idle, every implementation\n")
    L.append("| tokenizer | B | ids/row | " + " | ".join(impls) + " |")
    L.append("|" + " --- |" * (3 + len(impls)))
    for tok, n, B in keys:
        cells = [_f(((idx.get((i, tok, B, n)) or {}).get("lat_idle") or {}).get("p99_ms"), ".3f") for i in impls]
        L.append(f"| {tok} | {B} | {n} | " + " | ".join(cells) + " |")
    L.append("")
    return _report_tail(res, impls, keys, idx, L, runs)


def _latency_table(res, impls, keys, idx) -> list[str]:
    L = []
    L.append("### Step latency (ms): idle = one step in flight, loaded = the throughput phase\n")
    L.append("| impl | tokenizer | B | ids/row | idle p50 | idle p99 | idle max | loaded p50 | loaded p99 | loaded max | first step |")
    L.append("|" + " --- |" * 11)
    for tok, n, B in keys:
        for i in impls:
            r = idx.get((i, tok, B, n))
            if not r:
                continue
            li, ll = r.get("lat_idle") or {}, r.get("lat_loaded") or {}
            L.append(f"| {i} | {tok} | {B} | {n} | {_f(li.get('p50_ms'), '.3f')} | {_f(li.get('p99_ms'), '.3f')} | {_f(li.get('max_ms'), '.3f')} | "
                     f"{_f(ll.get('p50_ms'), '.3f')} | {_f(ll.get('p99_ms'), '.3f')} | {_f(ll.get('max_ms'), '.3f')} | {_f(r.get('first_step_ms'), '.2f')} |")
    L.append("")
    return L


def _report_tail(res, impls, keys, idx, L, runs) -> str:
    L.append("### Cost: CPU seconds per million tokens and peak RSS of the implementation's process\n")
    L.append("| tokenizer | B | ids/row | " + " | ".join(f"{i} cpu-s/Mtok" for i in impls) + " | " + " | ".join(f"{i} MB" for i in impls) + " |")
    L.append("|" + " --- |" * (3 + 2 * len(impls)))
    for tok, n, B in keys:
        cells = [_f((idx.get((i, tok, B, n)) or {}).get("cpu_s_per_mtok")) for i in impls]
        cells += [_f((idx.get((i, tok, B, n)) or {}).get("peak_rss_mb"), ".0f") for i in impls]
        L.append(f"| {tok} | {B} | {n} | " + " | ".join(cells) + " |")
    L.append("")
    L.append("Harness cost per million tokens (same for every implementation): scheduler "
             + _f(_median([r.get("scheduler_cpu_s_per_mtok") for r in runs if r["batch"] >= 64]))
             + " cpu-s, worker " + _f(_median([r.get("worker_cpu_s_per_mtok") for r in runs if r["batch"] >= 64]))
             + " cpu-s (medians over B ≥ 64).")
    L.append("")
    if res.get("flatness"):
        L.append("### Flatness: CPU µs per token of long outputs against short ones, measured side by side\n")
        L.append("Medians of the probes in the first and the last eighth of the long run: a step of the long "
                 "streams and a step of the short control streams, each alone in the pipeline, back to back "
                 "(alternating which goes first).\n")
        L.append("| impl | tokenizer | B | length | probes | tok/s | start: long / control µs | start ratio | end: long (≈length) / control µs | **end ratio** | other cores |")
        L.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in res["flatness"]:
            fl = r["flatness"]
            L.append(f"| {r['impl']} | {r['tokenizer']} | {r['batch']} | {r.get('steps_run', r['steps'])} | {r.get('probes')} | {fmt_rate(r['tok_per_s'])} | "
                     f"{_f(fl.get('early_long_us_per_tok'), '.3f')} / {_f(fl.get('early_short_us_per_tok'), '.3f')} (≈{_f(fl.get('early_len'), '.0f')} / ≈{_f((fl.get('segments') or [{}])[0].get('short_pos'), '.0f')}) | "
                     f"{_f(fl.get('early_ratio'))}× | "
                     f"{_f(fl.get('late_long_us_per_tok'), '.3f')} / {_f(fl.get('late_short_us_per_tok'), '.3f')} (≈{_f(fl.get('late_len'), '.0f')} / ≈{_f(fl.get('short_len'), '.0f')}) | "
                     f"**{_f(fl.get('late_ratio'))}×** | {_f(r.get('other_cores'))} |")
        L.append("")
    bad = [r for r in runs + res.get("flatness", []) if r["check"]["mismatches"] or r["check"]["errors"]]
    L.append("### Text check\n")
    nchk = sum(r["check"]["streams"] for r in runs + res.get("flatness", []))
    if not bad:
        L.append(f"Every checked stream ({nchk} in all) matched the reference decode; no error rows.")
    else:
        L.append("| impl | tokenizer | B | ids/row | streams checked | mismatches | error rows | example |")
        L.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in bad:
            c = r["check"]
            ex = c["examples"][0] if c["examples"] else (c["error_examples"][0] if c["error_examples"] else "")
            L.append(f"| {r['impl']} | {r['tokenizer']} | {r['batch']} | {r['ids_per_row']} | {c['streams']} | {c['mismatches']} | {c['errors']} | `{json.dumps(ex, ensure_ascii=False)[:160]}` |")
    if res.get("failures"):
        L.append("")
        L.append("### Failures\n")
        for f in res["failures"]:
            L.append(f"- {json.dumps(f, ensure_ascii=False)[:400]}")
    return "\n".join(L) + "\n"


def _median(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


_COLORS = {"detokd": "#d62728", "sglang": "#1f77b4", "decodestream": "#2ca02c", "naive": "#9467bd", "floor": "#7f7f7f"}


def plot(res: dict, out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        _log("matplotlib is not installed: no plots (pip install 'detokd[bench]')")
        return []
    runs = res["runs"]
    if not runs:
        return []
    toks = [t for t in TOKENIZERS if any(r["tokenizer"] == t for r in runs)]
    toks += sorted({r["tokenizer"] for r in runs} - set(toks))
    impls = [i for i in IMPLS if any(r["impl"] == i for r in runs)]
    nids = sorted({r["ids_per_row"] for r in runs})
    styles = {n: s for n, s in zip(nids, ("-", "--", ":", "-."))}
    paths = []
    fig, axes = plt.subplots(2, len(toks), figsize=(5.2 * len(toks), 8.5), squeeze=False)
    for col, tok in enumerate(toks):
        for i in impls:
            for n in nids:
                pts = sorted((r["batch"], r) for r in runs if r["impl"] == i and r["tokenizer"] == tok and r["ids_per_row"] == n)
                if not pts:
                    continue
                xs = [b for b, _ in pts]
                ax = axes[0][col]
                ys = [r["tok_per_s"] or float("nan") for _, r in pts]
                ax.plot(xs, ys, styles[n], marker="o", color=_COLORS.get(i), label=f"{i}, {n} id/row")
                ax = axes[1][col]
                ys = [((r.get("lat_idle") or {}).get("p99_ms") or float("nan")) for _, r in pts]
                ax.plot(xs, ys, styles[n], marker="o", color=_COLORS.get(i), label=f"{i}, {n} id/row")
        ax = axes[0][col]
        ax.set(xscale="log", yscale="log", title=f"{tok}: tokens/s through the pipeline", xlabel="concurrent streams B")
        ax.axhline(1e6, color="k", lw=0.6, ls=":")
        ax.grid(True, which="both", alpha=0.3)
        ax = axes[1][col]
        ax.set(xscale="log", yscale="log", title=f"{tok}: p99 step latency, ms (idle)", xlabel="concurrent streams B")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.axhline(1.0, color="k", lw=0.6, ls=":")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"detokd benchmark ({res.get('machine', {}).get('cpus', '?')} cores shared by scheduler, detokenizer, worker)", fontsize=10)
    fig.tight_layout()
    p = out_dir / "throughput.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    if res.get("flatness"):
        fig, ax = plt.subplots(figsize=(10, 4.8))
        for r in res["flatness"]:
            c = r["flatness"].get("segments") or []
            if c:
                col = _COLORS.get(r["impl"])
                ax.plot([x["long_pos"] for x in c], [x["long_us_per_tok"] for x in c], "-o", color=col,
                        label=f"{r['impl']}: long streams")
                ax.plot([x["long_pos"] for x in c], [x["short_us_per_tok"] for x in c], ":", color=col,
                        label=f"{r['impl']}: control (length ≤ {r.get('short_len')})")
        ax.set(yscale="log", xlabel="output length of the long streams (tokens)", ylabel="CPU µs per token (median of probes)",
               title=f"Per-token cost along long outputs, with a short-stream control measured alongside")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}" if str(f"{v:g}")[0] in "2345" else ""))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        p = out_dir / "flatness.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker_mode:
        return worker_main(*args.worker_mode)
    if args.report:
        res = json.loads(Path(args.report).read_text())
        print(report(res, full=not args.summary))
        if not args.no_plot:
            for p in plot(res, Path(args.report).parent):
                print(f"plot: {p}")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))

    def on_term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
