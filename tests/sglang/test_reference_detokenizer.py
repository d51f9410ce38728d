"""SGLang's own detokenizer process, driven by the replay harness: the reference side of
the differential test. What it does right is asserted against the Hugging Face oracle;
where it deviates, a test named after the deviation pins it."""

from __future__ import annotations

import base64

import msgspec
import pytest
from replay import accumulate, plain, prompt_context
from runs import CASES as RUN_CASES
from runs import DIFFERS, MULTI, RUNS, expected_text, matches_oracle

# Fields the detokenizer transforms rather than copies (detokenizer_manager.py:508-560).
TRANSFORMED = {"output_strs", "routed_experts", "indexer_topk", "placeholder_tokens_idx", "placeholder_tokens_val"}
CASES = [pytest.param(n, e, id=f"{n}-{e}") for n, e, _ in RUN_CASES]
pytestmark = pytest.mark.timeout(1800)  # its first test may be the one that starts runs.py's processes


@pytest.fixture(scope="module")
def runs():
    return RUNS


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
    for sent, out in zip(answered, got, strict=True):
        for field in out.__struct_fields__:
            if field in TRANSFORMED or field not in sent.__struct_fields__:
                continue
            assert plain(getattr(out, field)) == plain(getattr(sent, field)), field
            checked += 1
    assert checked > 100


@pytest.mark.parametrize("name,enc", CASES)
def test_routed_experts_and_indexer_topk_arrive_base64_encoded(runs, name, enc):
    run = runs(name, enc)
    answered = [m for m in run.sent if type(m).__name__ != "FreezeGCReq"]
    (got,) = run.received
    pairs = [(m, o) for m, o in zip(answered, got, strict=True) if type(o).__name__ == "BatchStrOutput" and m.routed_experts]
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
    ctx, earlier = run.contexts(), run.earlier()
    for rid, scripted in run.lifetimes().items():
        assert len(acc[rid]) == len(scripted), rid
        for k, (s, a) in enumerate(zip(scripted, acc[rid], strict=True)):
            if rid not in DIFFERS:  # pinned below
                assert matches_oracle(a.text, expected_text(name, s, ctx[rid][k], earlier[rid][k]), s), (rid, k, a.text)
            assert a.finished_reason is not None and a.finished_reason["type"] == {
                "length": "length", "matched_token": "stop", "matched_str": "stop", "abort": "abort"}[s.finish]


@pytest.mark.parametrize("name,enc", CASES)
def test_sglang_cuts_a_stop_string_at_its_first_occurrence_in_the_whole_text(runs, name, enc):
    """Also one in an earlier row's text, which its scheduler did not stop on (`find` in
    trim_matched_stop). That one went out with its row, so the finishing row sends
    nothing, and the text before the occurrence the scheduler matched, not sent yet, is
    lost. detokd cuts at the one in the finishing row (test_differential.py)."""
    run = runs(name, enc)
    (got,) = run.received
    acc, ctx, earlier = accumulate(got), run.contexts(), run.earlier()
    for rid in DIFFERS:
        (s,), (a,) = run.lifetimes()[rid], acc[rid]
        whole = expected_text(name, msgspec.structs.replace(s, finish="length"), ctx[rid][0], earlier[rid][0])
        last = [m.output_strs[i] for m in got if type(m).__name__ == "BatchStrOutput"
                for i, r in enumerate(m.rids) if r == rid and m.finished_reasons[i] is not None]
        assert last == [""] and whole.index(s.stop_str) < len(a.text), a.text
        assert expected_text(name, s, ctx[rid][0], earlier[rid][0]).startswith(a.text)
        assert a.text != expected_text(name, s, ctx[rid][0], earlier[rid][0])


@pytest.mark.parametrize("name,enc", CASES)
def test_the_prompt_context_is_the_last_five_prompt_ids(runs, name, enc):
    run = runs(name, enc)
    for rid, scripted in run.lifetimes().items():
        assert run.contexts()[rid] == [s.prompt_ids[-5:] for s in scripted]
    assert prompt_context(run.sent)["multilingual"] == run.requests[0].prompt_ids[-5:]


@pytest.mark.parametrize("name,enc", CASES)
def test_no_streamed_chunk_ends_inside_a_character(runs, name, enc):
    (got,) = runs(name, enc).received
    streaming = [o.output_strs[i] for o in got if type(o).__name__ == "BatchStrOutput"
                 for i in range(len(o.rids)) if o.finished_reasons[i] is None]
    assert streaming and not any(c.endswith("\ufffd") for c in streaming)


def test_two_http_workers_each_get_exactly_their_rows_with_the_oracle_text(runs):
    name, enc, workers = MULTI
    run = runs(name, enc, workers)
    ipcs = run.proc.http_worker_ipcs
    for w, got in enumerate(run.received):
        assert got
        for out in got:
            rows = set(out.rids)
            mine = {s.rid for s in run.requests if s.http_worker == w} | {f"emb-{w}"}
            assert rows <= mine, (w, rows)
        acc = accumulate(got)
        ctx, earlier = run.contexts(), run.earlier()
        for rid, scripted in run.lifetimes().items():
            if scripted[0].http_worker != w:
                assert rid not in acc
                continue
            if rid in DIFFERS:  # pinned below
                continue
            wants = [expected_text(name, s, c, e) for s, c, e in zip(scripted, ctx[rid], earlier[rid], strict=True)]
            assert len(acc[rid]) == len(wants) and all(
                matches_oracle(a.text, want, s) for a, want, s in zip(acc[rid], wants, scripted, strict=True)), rid
    assert len(ipcs) == 2 and None not in ipcs


def test_sglang_multi_worker_mode_answers_an_idle_batch_with_nothing(runs):
    name, enc, workers = MULTI
    run = runs(name, enc, workers)
    # The idle batch has no rows, so no http_worker_ipcs to fan out to
    # (multi_tokenizer_mixin.py:546-558): no worker sees an empty BatchStrOutput.
    assert not any(len(o.rids) == 0 for got in run.received for o in got)
    (single,) = runs(name, enc).received
    assert any(type(o).__name__ == "BatchStrOutput" and len(o.rids) == 0 for o in single)


def test_sglang_multi_worker_outputs_keep_the_rows_http_worker_ipcs(runs):
    run = runs(*MULTI)
    for w, got in enumerate(run.received):
        for out in got:
            assert out.http_worker_ipcs in (None, [run.proc.http_worker_ipcs[w]] * len(out.rids))
