"""SGLang's own detokenizer process, driven by the replay harness: the reference side of
the differential test. What it does right is asserted against the Hugging Face oracle;
where it deviates, a test named after the deviation pins it."""

from __future__ import annotations

import base64
from functools import lru_cache

import pytest

from detokd import zoo
from detokd.sglang.replay import (
    DetokenizerProcess,
    Scripted,
    accumulate,
    embedding_batch,
    freeze_gc_req,
    health_check_batch,
    plain,
    prompt_context,
)
from conftest import vocab

ENCODINGS = ("pickle", "msgpack")
# Each SGLang process costs ~15 s of CPU to import, so the encodings (a transport
# concern) are crossed with one tokenizer, and the others take one encoding each.
CASES_SINGLE = [("deepseek", "pickle"), ("deepseek", "msgpack"), ("qwen2", "pickle"), ("mistral_v3", "msgpack")]
MULTI = ("deepseek", "msgpack")  # the two-HTTP-worker run

TEXT = "Hello, world! 世界你好 🤖🎉👍🏽 Привет, мир! مرحبا بالعالم. Done."
STOP_TEXT = "The answer is 42. END of story"

# Fields the detokenizer transforms rather than copies (detokenizer_manager.py:508-560).
TRANSFORMED = {"output_strs", "routed_experts", "indexer_topk", "placeholder_tokens_idx", "placeholder_tokens_val"}


def _ids(name: str, text: str) -> list[int]:
    return vocab(name).hf.encode(text, add_special_tokens=False)


def _specials(name: str) -> tuple[int, int]:
    """(the stop token, another special token): eos when the tokenizer names one."""
    v = vocab(name)
    specials = sorted(v.special)
    eos = v.hf.eos_token_id if v.hf.eos_token_id is not None else specials[0]
    return eos, next(t for t in specials if t != eos)


def _chunks(n: int) -> list[int]:
    """A ragged partition of n: 1, 2, 3, 1, 2, 3, ... (multi-token steps split emoji)."""
    out, k = [], 0
    while sum(out) < n:
        out.append(min(1 + k % 3, n - sum(out)))
        k += 1
    return out


def scenario(name: str, worker_count: int = 1) -> list[Scripted]:
    out = _ids(name, TEXT)
    eos, other = _specials(name)
    prompt = _ids(name, "Translate the following text, please:")
    mid = len(out) // 2
    with_specials = out[:mid] + [other, eos] + out[mid:]
    upto = STOP_TEXT.index("END") + len("END")
    # The scheduler stops on the token that completes the stop string.
    stop_ids = _ids(name, STOP_TEXT)
    stop_at = next(k for k in range(1, len(stop_ids) + 1) if "END" in vocab(name).hf.decode(stop_ids[:k]))
    assert len(vocab(name).hf.decode(stop_ids[:stop_at])) >= upto
    w = lambda i: i % worker_count  # noqa: E731
    return [
        Scripted(rid="multilingual", prompt_ids=prompt, output_ids=out, chunks=_chunks(len(out)),
                 logprobs=True, hidden_states=True, routed_experts=True, indexer_topk=True,
                 customized_info=True, cached_tokens=3, retract_after_chunk=3, http_worker=w(0)),
        Scripted(rid="one-per-step", prompt_ids=prompt[:2], output_ids=out, http_worker=w(1), first_step=2),
        Scripted(rid="specials-skipped", prompt_ids=prompt, output_ids=with_specials, http_worker=w(0)),
        Scripted(rid="specials-kept", prompt_ids=prompt, output_ids=with_specials, skip_special_tokens=False,
                 spaces_between_special_tokens=False, http_worker=w(1), first_step=1),
        Scripted(rid="stop-token", prompt_ids=prompt, output_ids=out[:mid] + [eos], finish="matched_token",
                 chunks=_chunks(mid + 1), http_worker=w(0)),
        Scripted(rid="stop-token-kept", prompt_ids=prompt, output_ids=out[:mid] + [eos], finish="matched_token",
                 no_stop_trim=True, skip_special_tokens=False, http_worker=w(1)),
        Scripted(rid="stop-str", prompt_ids=prompt, output_ids=stop_ids[:stop_at], finish="matched_str",
                 stop_str="END", http_worker=w(0)),
        Scripted(rid="stop-str-kept", prompt_ids=prompt, output_ids=stop_ids[:stop_at], finish="matched_str",
                 stop_str="END", no_stop_trim=True, http_worker=w(1), first_step=3),
        Scripted(rid="aborted", prompt_ids=prompt, output_ids=out[:5], finish="abort", abort_message="client gone",
                 http_worker=w(0)),
        Scripted(rid="reused", prompt_ids=prompt, output_ids=out[:4], http_worker=w(1)),
        Scripted(rid="reused", prompt_ids=prompt[:3], output_ids=out[4:9], http_worker=w(1), first_step=6),
    ]


class Run:
    """One exchange through one detokenizer process, with what was sent."""

    def __init__(self, name: str, proc: DetokenizerProcess):
        self.name, self.proc = name, proc
        self.requests = scenario(name, proc.http_workers)
        enc, ipcs = proc.encoding, proc.http_worker_ipcs
        self.sent = [
            *proc.build(self.requests, tokenizer=vocab(name).hf),
            health_check_batch(encoding=enc),
            freeze_gc_req(),
            embedding_batch(["emb-0", "emb-1"], encoding=enc, http_worker_ipcs=ipcs,
                            workers=[0, 1 % proc.http_workers]),
        ]
        self.received = proc.exchange(self.sent)


@pytest.fixture(scope="module")
def runs():
    # All processes start at once: SGLang's import dominates and overlaps across them.
    procs = {}
    try:
        for name, enc in CASES_SINGLE:
            procs[name, enc, 1] = DetokenizerProcess(zoo.build(name), encoding=enc).start()
        name, enc = MULTI
        procs[name, enc, 2] = DetokenizerProcess(zoo.build(name), encoding=enc, http_workers=2).start()
        cache = {}

        def get(name, enc, workers=1):
            if (name, enc, workers) not in cache:
                cache[name, enc, workers] = Run(name, procs[name, enc, workers])
            return cache[name, enc, workers]

        yield get
    finally:
        for p in procs.values():
            p.close()


CASES = [pytest.param(n, e, id=f"{n}-{e}") for n, e in CASES_SINGLE]


def expected_text(name: str, s: Scripted, ctx: list[int]) -> str:
    """The oracle with SGLang's context and trim rules (detokenizer_manager.py:198-229)."""
    hf = vocab(name).hf
    out = list(s.output_ids)
    if s.finish == "matched_token" and not s.no_stop_trim:
        out = out[:-1]
    kw = dict(skip_special_tokens=s.skip_special_tokens, spaces_between_special_tokens=s.spaces_between_special_tokens)
    text = hf.decode(ctx + out, **kw)[len(hf.decode(ctx, **kw)) :]
    if s.finish == "matched_str":
        pos = text.find(s.stop_str)
        text = text[: pos + len(s.stop_str)] if s.no_stop_trim else text[:pos]
    return text


def lifetimes(run: Run) -> dict[str, list[Scripted]]:
    out: dict[str, list[Scripted]] = {}
    for s in run.requests:
        out.setdefault(s.rid, []).append(s)
    return out


def contexts(run: Run) -> dict[str, list[list[int]]]:
    """Per rid lifetime, the first row's decode_ids[:read_offset] (a reused rid gets its own)."""
    seen: dict[str, list[list[int]]] = {}
    open_: set[str] = set()
    for m in run.sent:
        if type(m).__name__ != "BatchTokenIDOutput":
            continue
        for i, rid in enumerate(m.rids):
            if rid not in open_:
                seen.setdefault(rid, []).append(list(m.decode_ids[i][: m.read_offsets[i]]))
                open_.add(rid)
            if m.finished_reasons[i] is not None:
                open_.discard(rid)
    return seen


@pytest.mark.parametrize("name,enc", CASES)
def test_every_message_gets_one_output_with_the_same_rids_in_order(runs, name, enc):
    run = runs(name, enc)
    answered = [m for m in run.sent if type(m).__name__ != "FreezeGCReq"]
    (got,) = run.received
    assert [list(o.rids) for o in got] == [list(m.rids) for m in answered]
    kinds = {"BatchTokenIDOutput": "BatchStrOutput", "BatchEmbeddingOutput": "BatchEmbeddingOutput"}
    assert [type(o).__name__ for o in got] == [kinds[type(m).__name__] for m in answered]


@pytest.mark.parametrize("name,enc", CASES)
def test_passthrough_fields_arrive_as_sent(runs, name, enc):
    run = runs(name, enc)
    answered = [m for m in run.sent if type(m).__name__ != "FreezeGCReq"]
    (got,) = run.received
    checked = 0
    for sent, out in zip(answered, got):
        for field in out.__struct_fields__:
            if field in TRANSFORMED or field not in sent.__struct_fields__:
                continue
            assert plain(getattr(out, field)) == plain(getattr(sent, field)), field
            checked += 1
    assert checked > 100


@pytest.mark.parametrize("name,enc", CASES)
def test_routed_experts_and_indexer_topk_arrive_base64_encoded(runs, name, enc):
    run = runs(name, enc)
    (got,) = run.received
    pairs = [(m, o) for m, o in zip(run.sent, got) if type(o).__name__ == "BatchStrOutput" and m.routed_experts]
    assert pairs
    for sent, out in pairs:
        for field in ("routed_experts", "indexer_topk"):
            want = [None if t is None else base64.b64encode(t.numpy().tobytes()).decode() for t in getattr(sent, field)]
            assert getattr(out, field) == want
        assert out.placeholder_tokens_idx is None and out.placeholder_tokens_val is None


@pytest.mark.parametrize("name,enc", CASES)
def test_each_request_streams_the_oracle_text_and_its_finish_reason(runs, name, enc):
    run = runs(name, enc)
    (got,) = run.received
    acc = accumulate(got)
    ctx = contexts(run)
    for rid, scripted in lifetimes(run).items():
        assert len(acc[rid]) == len(scripted), rid
        for k, (s, a) in enumerate(zip(scripted, acc[rid])):
            assert a.text == expected_text(name, s, ctx[rid][k]), (rid, k)
            assert a.finished_reason is not None and a.finished_reason["type"] == {
                "length": "length", "matched_token": "stop", "matched_str": "stop", "abort": "abort"}[s.finish]


@pytest.mark.parametrize("name,enc", CASES)
def test_the_prompt_context_is_the_last_five_prompt_ids(runs, name, enc):
    run = runs(name, enc)
    for rid, scripted in lifetimes(run).items():
        assert contexts(run)[rid] == [s.prompt_ids[-5:] for s in scripted]
    assert prompt_context(run.sent)["multilingual"] == run.requests[0].prompt_ids[-5:]


@pytest.mark.parametrize("name,enc", CASES)
def test_no_streamed_chunk_ends_inside_a_character(runs, name, enc):
    (got,) = runs(name, enc).received
    streaming = [o.output_strs[i] for o in got if type(o).__name__ == "BatchStrOutput"
                 for i in range(len(o.rids)) if o.finished_reasons[i] is None]
    assert streaming and not any(c.endswith("\ufffd") for c in streaming)


def test_two_http_workers_each_get_exactly_their_rows_with_the_oracle_text(runs):
    name, enc = MULTI
    run = runs(name, enc, 2)
    ipcs = run.proc.http_worker_ipcs
    for w, got in enumerate(run.received):
        assert got
        for out in got:
            rows = set(out.rids)
            mine = {s.rid for s in run.requests if s.http_worker == w} | {f"emb-{w}"}
            assert rows <= mine, (w, rows)
        acc = accumulate(got)
        ctx = contexts(run)
        for rid, scripted in lifetimes(run).items():
            if scripted[0].http_worker != w:
                assert rid not in acc
                continue
            assert [a.text for a in acc[rid]] == [expected_text(name, s, c) for s, c in zip(scripted, ctx[rid])]
    assert len(ipcs) == 2 and None not in ipcs


def test_sglang_multi_worker_mode_answers_an_idle_batch_with_nothing(runs):
    name, enc = MULTI
    run = runs(name, enc, 2)
    # The idle batch has no rows, so no http_worker_ipcs to fan out to
    # (multi_tokenizer_mixin.py:546-558): no worker sees an empty BatchStrOutput.
    assert not any(len(o.rids) == 0 for got in run.received for o in got)
    (single,) = runs(name, enc).received
    assert any(type(o).__name__ == "BatchStrOutput" and len(o.rids) == 0 for o in single)


def test_sglang_multi_worker_outputs_keep_the_rows_http_worker_ipcs(runs):
    run = runs(*MULTI, 2)
    for w, got in enumerate(run.received):
        for out in got:
            assert out.http_worker_ipcs in (None, [run.proc.http_worker_ipcs[w]] * len(out.rids))
