"""The benchmark's baseline algorithms (detokbench.baselines) decode exactly, in-process.

Each baseline streams a multilingual text's ids (chunks of 1 to 4 ids, as with
speculative decoding) and the concatenation of its output must equal
`tokenizer.decode(all_ids)` on the real DeepSeek tokenizer.
"""

from __future__ import annotations

import random

import pytest
from conftest import vocab

from detokbench import baselines
from detokbench.bench import workload
from detokrig.corpus import corpus


@pytest.fixture(scope="module")
def tok():
    pytest.importorskip("tokenizers")
    from detokd import zoo

    try:
        return baselines.Tok(str(zoo.build("deepseek")))
    except zoo.ZooError as e:  # pragma: no cover - the package is a dependency
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def text_ids(tok):
    text = corpus()
    return text, tok.fast.encode(text, add_special_tokens=False).ids


def _chunks(ids, rng):
    i = 0
    while i < len(ids):
        n = rng.randint(1, 4)
        yield ids[i:i + n]
        i += n


def make(algo: str, tok, prompt_tail=()) -> baselines.Stream:
    return baselines.ALGOS[algo](tok, prompt_tail, True, True)


@pytest.mark.parametrize("algo", sorted(baselines.ALGOS))
def test_stream_equals_full_decode(algo, tok, text_ids):
    text, ids = text_ids
    if algo == "sglang":
        pytest.importorskip("transformers")
    want = tok.fast.decode(ids)
    assert want == text  # byte-level BPE round-trips this text
    rng = random.Random(7)
    s = make(algo, tok)
    got = "".join(s.step(c) for c in _chunks(ids, rng)) + s.finish()
    assert got == want


@pytest.mark.parametrize("algo", sorted(baselines.ALGOS))
def test_prompt_tail_context(algo, tok, text_ids):
    """With a prompt tail, the text is decode(tail + out)[len(decode(tail)):]."""
    _, ids = text_ids
    if algo == "sglang":
        pytest.importorskip("transformers")
    # A tail that ends on a whole character, then an output of the next 300 ids.
    cut = next(p for p in range(400, 600) if "\ufffd" not in tok.fast.decode(ids[p - 4:p])
               and not tok.fast.decode(ids[p:p + 3]).startswith("\ufffd"))
    tail, out = ids[cut - 4:cut], ids[cut:cut + 300]
    want = vocab("deepseek").reference(tail, out)
    s = make(algo, tok, prompt_tail=tail)
    got = "".join(s.step([i]) for i in out) + s.finish()
    assert got == want


def test_sglang_batch_matches_single(tok, text_ids):
    """SGLang's batched step (one batch_decode over many requests) equals per-request steps."""
    pytest.importorskip("transformers")
    _, ids = text_ids
    starts = [0, 97, 233, 410]
    streams = [make("sglang", tok) for _ in starts]
    outs = ["" for _ in starts]
    for k in range(0, 160, 2):
        texts = baselines.SGLangStream.step_batch(streams, [ids[s + k:s + k + 2] for s in starts], [False] * len(starts))
        outs = [o + t for o, t in zip(outs, texts, strict=True)]
    texts = baselines.SGLangStream.step_batch(streams, [[] for _ in starts], [True] * len(starts))
    outs = [o + t for o, t in zip(outs, texts, strict=True)]
    assert outs == [tok.fast.decode(ids[s:s + 160]) for s in starts]


def test_floor_flushes_incomplete_character(tok):
    ids = tok.fast.encode("🤖", add_special_tokens=False).ids
    assert len(ids) > 1
    s = make("floor", tok)
    assert s.step(ids[:-1]) == ""
    assert s.finish() == tok.fast.decode(ids[:-1])  # U+FFFD, as the reference decode


def test_bench_frames_are_protocol_messages(tok):
    """The benchmark's pre-encoded frames, filled in for a step, decode as docs/protocol.md
    `tokens` messages with that step's seq and meta in every row."""
    from detokd.client import shard_for
    from detokd.wire import native

    corp = workload.Corpus(str(tok.dir))
    wl = workload.Workload(corp, 20, 4, "t")
    fr = wl.frames(2)
    for k, step in ((0, fr["start"]), (5, fr["cyc"][5]), (9, fr["finish"])):
        rows = []
        for shard, template in step:
            msg = native.decode_inbound(template.fill(*workload.step_values(k * 4, (k, 123))))
            assert isinstance(msg, native.Tokens)
            assert {shard_for(r.rid, 2) for r in msg.rows} == {shard}
            rows += msg.rows
        assert sorted(r.rid for r in rows) == sorted(wl.rids)
        for r in rows:
            i = wl.rids.index(r.rid)
            assert r.seq == k * 4 and bytes(r.meta) == native.encode((k, 123))
            assert (r.start is not None) == (k == 0) and (r.finish is not None) == (k == 9)
            if k == 0:
                assert r.start.prompt_tail == corp.tail(wl.offsets[i])
            if k != 9:
                assert r.ids == corp.ids(wl.offsets[i], k * 4, 4)
