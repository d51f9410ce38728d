"""detokd in SGLang's place, against SGLang's own detokenizer, on the same message stream.

Both processes get the scenario of runs.py, built by SGLang's own scheduler code
(output_streamer's accumulator over real Reqs), in both IPC encodings, three tokenizer
families, two HTTP workers, and two detokenizers behind SGLang's router (SGLang's own
two, then detokd's); both outputs are decoded with SGLang's own decoder and compared
field by field, in the order each process sent them. Where the two differ, the test
says which is right and why (docs/sglang.md, "Where detokd differs").
"""

from __future__ import annotations

import os

import msgspec
import pytest
from conftest import vocab
from replay import accumulate, plain
from runs import CASES, DIFFERS, MULTI, ROUTED, RUNS, expected_text, ids_of, matches_oracle

from detokd import zoo
from detokd.sglang.process import run_sglang_detokenizer
from detokrig.sglang_replay import DetokenizerDied, Scripted, SglangDetokenizerUnderTest, build_stream

ALL = [pytest.param(*c, 1, id=f"{c[0]}-{c[1]}-{c[2]}w") for c in [*CASES, MULTI]] + [
    pytest.param(*c, id=f"{c[0]}-{c[1]}-{c[2]}w-{c[3]}d") for c in ROUTED
]
# The first test starts every process of runs.py and waits until each answers: minutes.
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module", autouse=True)
def processes_end_with_this_module():
    """The modules after it read their runs, not the processes: their ~8 GB (~18 processes
    forked from SGLang's import) would stay beside the next modules' SGLang servers."""
    yield
    RUNS.close()


@pytest.fixture(scope="module")
def pair():
    def get(name, enc, workers, detokenizers):
        return RUNS(name, enc, workers, "sglang", detokenizers), RUNS(name, enc, workers, "detokd", detokenizers)

    return get


@pytest.mark.parametrize("name,enc,workers,detokenizers", ALL)
def test_each_process_sends_each_receiver_the_same_messages_with_the_same_rids_in_the_same_order(
    pair, name, enc, workers, detokenizers
):
    theirs, ours = pair(name, enc, workers, detokenizers)
    assert len(ours.received) == len(theirs.received) == workers
    assert len(ours.streams) == len(theirs.streams)
    for t, o in zip(theirs.streams, ours.streams, strict=True):
        assert [(type(m).__name__, list(m.rids)) for m in o] == [(type(m).__name__, list(m.rids)) for m in t]


@pytest.mark.parametrize("name,enc,workers,detokenizers", [p for p in ALL if p.values[3] > 1])
def test_behind_sglangs_router_every_detokenizer_answers_some_requests_and_every_request_is_answered(
    pair, name, enc, workers, detokenizers
):
    """--detokenizer-worker-num 2: the router pins each rid to one detokenizer, so the
    scenario's requests are spread over both processes, and none is lost between them."""
    for run in pair(name, enc, workers, detokenizers):
        answered = [{rid for m in s if type(m).__name__ == "BatchStrOutput" for rid in m.rids} for s in run.streams]
        assert all(answered[:detokenizers]), [len(a) for a in answered]
        assert set().union(*answered) == {s.rid for s in run.requests}


@pytest.mark.parametrize("name,enc,workers,detokenizers", ALL)
def test_every_field_but_the_text_chunks_equals_sglangs(pair, name, enc, workers, detokenizers):
    """Logprobs, token counts, hidden states, time stats, routed experts in base64,
    finish reasons, embeddings: all of it, message by message."""
    theirs, ours = pair(name, enc, workers, detokenizers)

    def value(run, msg, field):
        v = plain(getattr(msg, field))
        if field == "http_worker_ipcs" and v is not None:  # each process has its own addresses
            v = [run.proc.http_worker_ipcs.index(ipc) for ipc in v]
        return v

    compared = 0
    for t, o in zip(theirs.streams, ours.streams, strict=True):
        for mt, mo in zip(t, o, strict=True):
            for field in mt.__struct_fields__:
                if field == "output_strs":
                    continue
                assert value(ours, mo, field) == value(theirs, mt, field), (type(mt).__name__, list(mt.rids), field)
                compared += 1
    assert compared > 500


@pytest.mark.parametrize("name,enc,workers,detokenizers", ALL)
def test_each_request_accumulates_sglangs_text_which_is_the_oracles(pair, name, enc, workers, detokenizers):
    theirs, ours = pair(name, enc, workers, detokenizers)
    ctx, earlier = ours.contexts(), ours.earlier()
    for t, o in zip(theirs.streams, ours.streams, strict=True):
        acc_t, acc_o = accumulate(t), accumulate(o)
        assert acc_o.keys() == acc_t.keys()
        for rid, lives in acc_o.items():
            if rid.startswith(("emb-", "straddle-")) or rid in DIFFERS:  # straddles and DIFFERS: tests below
                continue
            scripted = ours.lifetimes()[rid]
            wants = [expected_text(name, s, c, e) for s, c, e in zip(scripted, ctx[rid], earlier[rid], strict=True)]
            assert [a.text for a in lives] == wants, rid
            assert [a.text for a in lives] == [a.text for a in acc_t[rid]], rid
            assert [a.finished_reason for a in lives] == [a.finished_reason for a in acc_t[rid]], rid


@pytest.mark.parametrize("name,enc,workers,detokenizers", [p for p in ALL if p.values[3] > 1])
def test_one_detokd_process_gives_each_request_what_sglangs_routed_processes_give(
    pair, name, enc, workers, detokenizers
):
    """--detokenizer-worker-num 2 as the plugin serves it by default: one detokd process
    on SGLang's address, answering a step in one message where SGLang's router and its two
    detokenizers answer in two. Each request's lifetimes, text, finish reasons and
    output ids, as a TokenizerManager assembles them, are the same."""
    theirs, _ = pair(name, enc, workers, detokenizers)
    ours = RUNS(name, enc, workers, "detokd", 1)
    assert ours.proc.detokenizers == 1 and len(ours.received) == len(theirs.received) == workers
    ctx, earlier = ours.contexts(), ours.earlier()

    def ends(lives):
        return [(a.finished_reason, a.output_ids) for a in lives]

    compared = 0
    for t, o in zip(theirs.received, ours.received, strict=True):
        acc_t, acc_o = accumulate(t), accumulate(o)
        assert acc_o.keys() == acc_t.keys()
        for rid, lives in acc_o.items():
            if rid.startswith("emb-"):
                continue
            assert ends(lives) == ends(acc_t[rid]), rid
            scripted = ours.lifetimes()[rid]
            for a, s, c, e in zip(lives, scripted, ctx[rid], earlier[rid], strict=True):
                assert matches_oracle(a.text, expected_text(name, s, c, e), s), rid
            if not rid.startswith("straddle-") and rid not in DIFFERS:  # their texts: the tests below
                assert [a.text for a in lives] == [a.text for a in acc_t[rid]], rid
            compared += 1
    assert compared == len({s.rid for s in ours.requests})


@pytest.mark.parametrize("name,enc,workers,detokenizers", ALL)
def test_a_stop_string_whose_start_the_scheduler_let_out_leaks_no_further_than_through_sglang(
    pair, name, enc, workers, detokenizers
):
    """SGLang's scheduler checks its stop-string hold-back in token space: beside a split
    character it lets a row go whose text begins the stop string. Then the client has
    the oracle's text plus (at most) those first characters, and nothing of the rest:
    detokd's client gets exactly what SGLang's gets. Some requests of the scenario do
    straddle so on the byte-level families (counted)."""
    theirs, ours = pair(name, enc, workers, detokenizers)
    ctx, earlier = ours.contexts(), ours.earlier()
    straddled = 0
    for t, o in zip(theirs.streams, ours.streams, strict=True):
        acc_t, acc_o = accumulate(t), accumulate(o)
        for rid in (r for r in acc_o if r.startswith("straddle-")):
            (scripted,), (c,), (e,) = ours.lifetimes()[rid], ctx[rid], earlier[rid]
            (got,), (sglangs,) = acc_o[rid], acc_t[rid]
            want = expected_text(name, scripted, c, e)
            assert got.text == sglangs.text, rid
            assert got.finished_reason == sglangs.finished_reason, rid
            leaked = got.text[len(want) :]
            assert got.text.startswith(want) and scripted.stop_str[: len(leaked)] == leaked != scripted.stop_str, rid
            straddled += bool(leaked)
    if "ByteLevel" in vocab(name).decoder_types():
        assert straddled > 0


@pytest.mark.parametrize("name,enc,workers,detokenizers", ALL)
def test_a_stop_string_also_in_earlier_rows_is_cut_where_the_scheduler_matched_it_not_at_sglangs_first(
    pair, name, enc, workers, detokenizers
):
    """"END" in an earlier row that the scheduler did not check (a reasoning section;
    scripted), and again in the finishing row, where it stopped. detokd cuts at the first
    past the earlier rows' text; SGLang's detokenizer at the first in the whole text
    (`find`), which it sent already, so its finishing row sends nothing and the text
    before the "END" the scheduler matched is lost (docs/sglang.md, "Where detokd
    differs"). Both finish the same."""
    theirs, ours = pair(name, enc, workers, detokenizers)
    ctx, earlier = ours.contexts(), ours.earlier()
    compared = 0
    for t, o in zip(theirs.streams, ours.streams, strict=True):
        acc_t, acc_o = accumulate(t), accumulate(o)
        for rid in (r for r in acc_o if r in DIFFERS):
            (scripted,), (c,), (e,) = ours.lifetimes()[rid], ctx[rid], earlier[rid]
            (got,), (sglangs,) = acc_o[rid], acc_t[rid]
            whole = expected_text(name, msgspec.structs.replace(scripted, finish="length"), c, e)
            assert got.text == expected_text(name, scripted, c, e) == whole[: whole.rindex("END")], rid
            assert finishing_texts(t, rid) == [""] and whole.index("END") < len(sglangs.text), rid
            assert got.text.startswith(sglangs.text) and sglangs.text != got.text, rid
            assert got.finished_reason == sglangs.finished_reason, rid
            compared += 1
    assert compared == len(DIFFERS)


def finishing_texts(stream, rid: str) -> list[str]:
    """The text of `rid`'s finishing rows in one process's answers."""
    return [m.output_strs[i] for m in stream if type(m).__name__ == "BatchStrOutput"
            for i, r in enumerate(m.rids) if r == rid and m.finished_reasons[i] is not None]


@pytest.mark.parametrize("name,enc,workers,detokenizers", ALL)
def test_detokd_streams_no_later_than_sglang_except_inside_a_byte_fallback_run(pair, name, enc, workers, detokenizers):
    """Chunks may split differently (detokd sends a U+FFFD once no id can complete it;
    SGLang waits for the next clean text), but detokd never keeps back text SGLang sent,
    except characters of a byte-fallback run (<0x..> pieces) that is still open: Hugging
    Face turns a whole invalid run into U+FFFD, so a later byte can still rewrite them."""
    theirs, ours = pair(name, enc, workers, detokenizers)
    fallback = "ByteFallback" in vocab(name).decoder_types()
    for t, o in zip(theirs.streams, ours.streams, strict=True):
        sent_t: dict[str, str] = {}
        sent_o: dict[str, str] = {}
        for mt, mo in zip(t, o, strict=True):
            if type(mt).__name__ != "BatchStrOutput":
                continue
            for i, rid in enumerate(mt.rids):
                if mt.finished_reasons[i] is not None:
                    sent_t.pop(rid, None), sent_o.pop(rid, None)
                    continue
                sent_t[rid] = sent_t.get(rid, "") + mt.output_strs[i]
                sent_o[rid] = sent_o.get(rid, "") + mo.output_strs[i]
                if not fallback:
                    assert len(sent_o[rid].rstrip("\ufffd")) >= len(sent_t[rid]), rid


def test_a_state_evicted_to_stay_within_capacity_kills_sglang_and_aborts_one_request_in_detokd():
    """SGLang #2812. SGLANG_DETOKENIZER_MAX_STATES=2 and three live requests: SGLang's
    detokenizer raises on the evicted request's next row and dies (SIGQUIT to the
    engine); detokd answers that row with an abort finish reason (the client gets an
    error) and every other request goes on exactly."""
    name = "deepseek"
    out = ids_of(name, "One two three four five six seven eight nine ten.")
    reqs = [Scripted(rid=f"r{k}", prompt_ids=[1, 2, 3], output_ids=out, first_step=k) for k in range(3)]
    # One after the other: a SIGQUIT does not say which child sent it.
    os.environ["SGLANG_DETOKENIZER_MAX_STATES"] = "2"
    try:
        with SglangDetokenizerUnderTest(zoo.build(name), encoding="msgpack") as sglang:
            with pytest.raises(DetokenizerDied):
                sglang.exchange(build_stream(reqs, encoding="msgpack"), timeout=600)
        with SglangDetokenizerUnderTest(zoo.build(name), encoding="msgpack", target=run_sglang_detokenizer) as detokd:
            (got,) = detokd.exchange(build_stream(reqs, encoding="msgpack"), timeout=600)
    finally:
        del os.environ["SGLANG_DETOKENIZER_MAX_STATES"]
    acc = accumulate(got)
    # Until the engine hears of the abort, each further row of r0 is answered with one.
    first, *later = acc["r0"]
    assert vocab(name).reference([1, 2, 3], out).startswith(first.text)
    for a in [first, *later]:
        assert a.finished_reason["type"] == "abort" and "evicted" in a.finished_reason["message"]
    assert all(a.text == "" for a in later)
    for rid in ("r1", "r2"):
        (a,) = acc[rid]
        assert a.text == vocab(name).reference([1, 2, 3], out) and a.finished_reason["type"] == "length"
