"""The scenario every SGLang test replays, and the detokenizer processes it runs on.

Each process (SGLang's own detokenizer, or detokd's replacement of it) would cost ~15-25 s
of CPU to import SGLang: all of them are forked from one forkserver that imported it, on
first use. They end with the differential's module; the modules after it read their runs.
"""

from __future__ import annotations

import atexit
import os

from conftest import engine_cut, made_by, vocab
from replay import Request, embedding_batch, health_check_batch, streams

from detokd import zoo
from detokd.sglang.process import run_sglang_detokenizer as detokd_target
from detokrig.sglang_replay import SglangDetokenizerUnderTest, build_stream

# The encodings (a transport concern) are crossed with one tokenizer; the other families
# take one encoding each. (tokenizer, encoding, HTTP workers)
CASES = [("deepseek", "pickle", 1), ("deepseek", "msgpack", 1), ("qwen2", "pickle", 1), ("mistral_v3", "msgpack", 1)]
MULTI = ("deepseek", "msgpack", 2)

def _router_routes_by_rid() -> bool:
    """Whether the installed SGLang's MultiDetokenizerRouter routes a row that names no
    HTTP worker (by its rid: 0.5.23). 0.5.22 and older route by the HTTP worker alone and
    assert every row names one, which SGLang's TokenizerManager stamps only with
    --tokenizer-worker-num > 1: there SGLang's own router serves only that layout."""
    from sglang.srt.managers.multi_tokenizer_mixin import MultiDetokenizerRouter

    return hasattr(MultiDetokenizerRouter, "_pick_for")


# SGLang's multi-detokenizer mode (--detokenizer-worker-num 2: two detokenizers behind its
# router) in both encodings, with the HTTP workers the release's router can serve.
# (tokenizer, encoding, HTTP workers, detokenizers)
_ROUTED_WORKERS = 1 if _router_routes_by_rid() else 2
ROUTED = [("qwen2", "pickle", _ROUTED_WORKERS, 2), ("deepseek", "msgpack", _ROUTED_WORKERS, 2)]
TARGETS = {"sglang": None, "detokd": detokd_target}

TEXT = "Hello, world! 世界你好 🤖🎉👍🏽 Привет, мир! مرحبا بالعالم. Done."
STOP_TEXT = "The answer is 42. END of story"
# "END" in a reasoning section, then far enough on that SGLang's stop-string hold-back
# (the last stop_str_max_len + 1 ids) has let that row go, "END" again.
EARLIER_TEXT = "Think: END? Yes, that is the plan for now, I think. Then END of it"
# The requests whose text detokd cuts elsewhere than SGLang's detokenizer, on purpose.
DIFFERS = {"stop-str-earlier"}
# Stop strings SGLang's scheduler can let begin in sent text: it checks its hold-back in
# token space, so beside a split character (a ZWJ sequence, rare Han) it misses a prefix.
STRADDLES = [
    ("Emoji: 👨\u200d👩\u200d👧 family and more", "\u200d👩"),
    ("古文 𠀀𪚥 龘靐齉爩，服务器在高并发下稳定运行。", "龘靐齉爩，服务器"),
    ("Съешь же ещё этих мягких французских булок", "ещё этих"),
    ("Answer: 42 STOP here", " STOP"),
]


def ids_of(name: str, text: str) -> list[int]:
    return vocab(name).hf.encode(text, add_special_tokens=False)


def specials(name: str) -> tuple[int, int]:
    """(the stop token, another special token): eos when the tokenizer names one."""
    v = vocab(name)
    ordered = sorted(v.special)
    eos = v.hf.eos_token_id if v.hf.eos_token_id is not None else ordered[0]
    return eos, next(t for t in ordered if t != eos)


def ragged(n: int) -> list[int]:
    """A ragged partition of n: 1, 2, 3, 1, 2, 3, ... (multi-token steps split emoji)."""
    out, k = [], 0
    while sum(out) < n:
        out.append(min(1 + k % 3, n - sum(out)))
        k += 1
    return out


def scenario(name: str, workers: int = 1) -> list[Request]:
    out = ids_of(name, TEXT)
    eos, other = specials(name)
    prompt = ids_of(name, "Translate the following text, please:")
    mid = len(out) // 2
    with_specials = out[:mid] + [other, eos] + out[mid:]
    # The scheduler stops on the token that completes the stop string.
    stop_ids = ids_of(name, STOP_TEXT)
    stop_at = next(k for k in range(1, len(stop_ids) + 1) if "END" in vocab(name).hf.decode(stop_ids[:k]))
    w = lambda i: i % workers  # noqa: E731
    straddles = []
    for j, (text, stop) in enumerate(STRADDLES):
        ids = ids_of(name, text)
        at = next(k for k in range(1, len(ids) + 1) if stop in vocab(name).hf.decode(ids[:k]))
        for c, chunks in enumerate([None, ragged(at), ragged(at)[::-1]]):
            straddles.append(Request(rid=f"straddle-{j}-{c}", prompt_ids=prompt[:3], output_ids=ids[:at], chunks=chunks,
                                      finish="matched_str", stop_str=stop, http_worker=w(j + c)))
    # A stop string twice in the token that completes it (qwen2's ' fallback' with "l"):
    # the scheduler stopped on the first. And one that occurs in earlier rows' text too,
    # which the scheduler did not check (scripted): detokd keeps that one, SGLang's
    # detokenizer cuts there (docs/sglang.md, "Where detokd differs").
    twice = ids_of(name, "Byte fallback, all well")
    twice = twice[: next(k for k in range(1, len(twice) + 1) if "l" in vocab(name).hf.decode(twice[:k]))]
    again = ids_of(name, EARLIER_TEXT)
    again = again[: next(k for k in range(1, len(again) + 1) if vocab(name).hf.decode(again[:k]).count("END") == 2)]
    # Ids the tokenizer never produces on its own: ones that render as "" with
    # skip_special_tokens (the specials) between real text, and one outside the vocabulary.
    empties = [other] * 12
    outside = vocab(name).size + 7
    return [
        Request(rid="multilingual", prompt_ids=prompt, output_ids=out, chunks=ragged(len(out)),
                 logprobs=True, hidden_states=True, routed_experts=True, indexer_topk=True,
                 customized_info=True, cached_tokens=3, retract_after_chunk=3, http_worker=w(0)),
        Request(rid="one-per-step", prompt_ids=prompt[:2], output_ids=out, http_worker=w(1), first_step=2),
        Request(rid="specials-skipped", prompt_ids=prompt, output_ids=with_specials, http_worker=w(0)),
        Request(rid="specials-kept", prompt_ids=prompt, output_ids=with_specials, skip_special_tokens=False,
                 spaces_between_special_tokens=False, http_worker=w(1), first_step=1),
        Request(rid="empty-tokens", prompt_ids=prompt, output_ids=out[:3] + empties + out[3:9], http_worker=w(0)),
        Request(rid="out-of-vocabulary", prompt_ids=prompt, output_ids=out[:4] + [outside] + out[4:8],
                 http_worker=w(1)),
        # The same within rows of several ids, where a step's known bounds skip each row's check.
        Request(rid="out-of-vocabulary-ragged", prompt_ids=prompt, output_ids=out[:4] + [outside] + out[4:8],
                 chunks=[3, 3, 3], http_worker=w(0)),
        Request(rid="stop-token", prompt_ids=prompt, output_ids=out[:mid] + [eos], finish="matched_token",
                 chunks=ragged(mid + 1), http_worker=w(0)),
        Request(rid="stop-token-kept", prompt_ids=prompt, output_ids=out[:mid] + [eos], finish="matched_token",
                 no_stop_trim=True, skip_special_tokens=False, http_worker=w(1)),
        Request(rid="stop-str", prompt_ids=prompt, output_ids=stop_ids[:stop_at], finish="matched_str",
                 stop_str="END", http_worker=w(0)),
        Request(rid="stop-str-kept", prompt_ids=prompt, output_ids=stop_ids[:stop_at], finish="matched_str",
                 stop_str="END", no_stop_trim=True, http_worker=w(1), first_step=3),
        Request(rid="stop-str-twice", prompt_ids=prompt, output_ids=twice, finish="matched_str", stop_str="l",
                 http_worker=w(1)),
        Request(rid="stop-str-earlier", prompt_ids=prompt, output_ids=again, finish="matched_str", stop_str="END",
                 http_worker=w(0)),
        Request(rid="aborted", prompt_ids=prompt, output_ids=out[:5], finish="abort", abort_message="client gone",
                 http_worker=w(0)),
        Request(rid="reused", prompt_ids=prompt, output_ids=out[:4], http_worker=w(1)),
        Request(rid="reused", prompt_ids=prompt[:3], output_ids=out[4:9], http_worker=w(1), first_step=6),
        *straddles,
    ]


def expected_text(name: str, s: Request, ctx: list[int], earlier: int) -> str:
    """The oracle with SGLang's context (the first row's decode_ids[:read_offset]), its
    clamp of ids outside the vocabulary to 0, and the trims on finish: a stop token's,
    and a stop string's at the first occurrence that ends past the text of the output
    ids sent in rows before the finishing one (`earlier` of them), as detokd cuts it
    (docs/stop-strings.md; SGLang's own detokenizer cuts at the first in the whole text)."""
    v = vocab(name)
    out = [i if 0 <= i < v.size else 0 for i in s.output_ids]
    if s.finish == "matched_token" and not s.no_stop_trim:
        out = out[:-1]
    kw = dict(skip_special_tokens=s.skip_special_tokens, spaces_between_special_tokens=s.spaces_between_special_tokens)

    def text_of(ids: list[int]) -> str:
        return v.hf.decode(ctx + ids, **kw)[len(v.hf.decode(ctx, **kw)) :]

    text = text_of(out)
    if s.finish == "matched_str":
        text = text[: engine_cut(text, made_by(text_of(out[:earlier]), text), s.stop_str, s.no_stop_trim)]
    return text


def matches_oracle(got: str, want: str, s: Request) -> bool:
    """`got` is the oracle's text `want`; a straddling request may also carry the first
    characters of its stop string, which SGLang's scheduler let out before it matched
    (docs/sglang.md, "Text semantics"), never the whole of it."""
    if got == want:
        return True
    leaked = got[len(want) :]
    return s.rid.startswith("straddle-") and got.startswith(want) and s.stop_str.startswith(leaked) and leaked != s.stop_str


class Run:
    """One exchange of the scenario through one detokenizer (or SGLang's router and its
    detokenizers)."""

    def __init__(self, name: str, proc: SglangDetokenizerUnderTest):
        from sglang.srt.managers.io_struct import FreezeGCReq

        self.name, self.proc = name, proc
        self.requests = scenario(name, proc.http_workers)
        enc, ipcs = proc.encoding, proc.http_worker_ipcs
        self.sent = [
            *build_stream(self.requests, encoding=enc, http_worker_ipcs=ipcs, tokenizer=vocab(name).hf),
            health_check_batch(encoding=enc),
            FreezeGCReq(),
            embedding_batch(["emb-0", "emb-1"], encoding=enc, http_worker_ipcs=ipcs, workers=[0, 1 % proc.http_workers]),
        ]
        self.received = proc.exchange(self.sent, timeout=600)
        # What arrives in the order one process sent it (per receiver and detokenizer).
        self.streams = streams(proc, self.received)

    def lifetimes(self) -> dict[str, list[Request]]:
        out: dict[str, list[Request]] = {}
        for s in self.requests:
            out.setdefault(s.rid, []).append(s)
        return out

    def earlier(self) -> dict[str, list[int]]:
        """Per rid lifetime, the output ids sent in rows before its finishing row."""
        seen: dict[str, list[int]] = {}
        live: set[str] = set()
        for m in self.sent:
            if type(m).__name__ != "BatchTokenIDOutput":
                continue
            for i, rid in enumerate(m.rids):
                if rid not in live:
                    seen.setdefault(rid, []).append(0)
                    live.add(rid)
                if m.finished_reasons[i] is not None:
                    live.discard(rid)
                else:
                    seen[rid][-1] += len(m.output_ids[i])
        return seen

    def contexts(self) -> dict[str, list[list[int]]]:
        """Per rid lifetime, the first row's decode_ids[:read_offset]."""
        seen: dict[str, list[list[int]]] = {}
        live: set[str] = set()
        for m in self.sent:
            if type(m).__name__ != "BatchTokenIDOutput":
                continue
            for i, rid in enumerate(m.rids):
                if rid not in live:
                    seen.setdefault(rid, []).append(list(m.decode_ids[i][: m.read_offsets[i]]))
                    live.add(rid)
                if m.finished_reasons[i] is not None:
                    live.discard(rid)
        return seen


class Runs:
    """Every (tokenizer, encoding, workers, detokenizers, target) process, started together
    on first use."""

    def __init__(self) -> None:
        self.procs: dict[tuple, SglangDetokenizerUnderTest] = {}
        self.done: dict[tuple, Run] = {}

    def _start_all(self) -> None:
        # ROUTED's runs are compared with one detokd process on the same HTTP workers too.
        single = [(*c, 1) for c in [*CASES, MULTI]]
        single += [(n, e, w, 1) for n, e, w, _ in ROUTED if (n, e, w, 1) not in single]
        for name, enc, workers, detokenizers in single + ROUTED:
            for target, fn in TARGETS.items():
                self.procs[name, enc, workers, detokenizers, target] = SglangDetokenizerUnderTest(
                    zoo.build(name), encoding=enc, http_workers=workers, detokenizers=detokenizers, target=fn,
                    start_method="forkserver",
                ).start()
        # Ready once each answers a fence.
        for proc in self.procs.values():
            proc.exchange([], timeout=900)

    def __call__(self, name: str, enc: str, workers: int = 1, target: str = "sglang", detokenizers: int = 1) -> Run:
        key = (name, enc, workers, detokenizers, target)
        if key not in self.done:
            if not self.procs:
                self._start_all()
            try:
                self.done[key] = Run(name, self.procs[key])
            except Exception as exc:  # every test of this process fails with the same cause
                self.done[key] = exc
        run = self.done[key]
        if isinstance(run, Exception):
            raise run
        return run

    def close(self) -> None:
        """Reap the processes; their runs stay readable."""
        while self.procs:
            self.procs.popitem()[1].close()


RUNS = Runs()
atexit.register(RUNS.close)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
