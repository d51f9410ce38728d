"""The request state machine (detokd.core.detokenizer.Detokenizer), in-process, real tokenizers.

Rows go in through `Detokenizer.tokens`; what each worker would receive is read from the
Outbox, with no socket anywhere. Tokenizers: deepseek (byte-level
BPE, the default), and mistral_v3 (SentencePiece with byte fallback) for stop strings.
"""

from __future__ import annotations

import itertools

import msgspec
import pytest
from conftest import cut, fast_codec, first_stop, oracle, vocab
from hypothesis import given, settings
from hypothesis import strategies as st

from detokd.core.detokenizer import Detokenizer, Limits
from detokd.core.outbox import Outbox
from detokd.core.request import SENT_TAIL
from detokd.core.stats import Stats
from detokd.wire.native import NIL, Finish, OutRow, Row, Start, StoppedRow


class CoreRig:
    """The core in-process: a Detokenizer with an Outbox of two workers; `step` returns
    what each worker got from one batch."""

    def __init__(self, name: str = "deepseek", max_states: int = 64, limits: Limits = Limits()) -> None:
        self.vocab = vocab(name)
        self.outbox = Outbox()
        self.outbox.open(0)
        self.outbox.open(1)
        self.stats = Stats()
        self.fed: list[StoppedRow] = []
        self.det = Detokenizer(
            fast_codec(name), self.vocab.size, self.outbox, max_states=max_states, max_prompt_tail=8, stats=self.stats,
            limits=limits,
        )

    def step(self, *rows: Row) -> tuple[list[OutRow], list[OutRow]]:
        out = self.det.tokens(list(rows))
        self.fed += out.stopped
        return out.rows.get(0, []), out.rows.get(1, [])

    def stopped(self) -> list[StoppedRow]:
        """The feedback of the steps since the last call."""
        stopped, self.fed = self.fed, []
        return stopped

    def live(self, rid: str) -> bool:
        return rid in self.det.table

    def encode(self, text: str) -> list[int]:
        return self.vocab.backend.encode(text, add_special_tokens=False).ids

    def token(self, text: str) -> int:
        return self.vocab.backend.token_to_id(text)


_rids = itertools.count()


class Req:
    """The engine's side of one request: sends `start` first and keeps `seq`."""

    def __init__(self, **start) -> None:
        self.rid = f"r{next(_rids)}"
        self.start = Start(**start)
        self.seq = 0
        self.sent_start = False

    def row(self, ids=(), finish: Finish | None = None, meta=NIL) -> Row:
        start = None if self.sent_start else self.start
        self.sent_start = True
        row = Row(self.rid, list(ids), self.seq, start, finish, meta)
        self.seq += len(ids)
        return row


@pytest.fixture
def rig():
    return CoreRig()


@pytest.fixture
def mistral():
    return CoreRig("mistral_v3")


def texts_of(rows: list[OutRow], rid: str) -> list[str]:
    return [r.text for r in rows if r.rid == rid]


# --- rows in, rows out --------------------------------------------------------------------


def test_one_output_row_per_input_row_in_arrival_order(rig) -> None:
    a, b, c = Req(worker=0), Req(worker=1), Req(worker=0)
    hello, world, bonjour = rig.encode("Hello"), rig.encode(" world"), rig.encode("Bonjour")
    w0, w1 = rig.step(a.row(hello), b.row(), c.row(bonjour), a.row(world))
    assert [(r.rid, r.n_ids) for r in w0] == [(a.rid, len(hello)), (c.rid, len(bonjour)), (a.rid, len(hello + world))]
    assert [(r.rid, r.text, r.n_ids) for r in w1] == [(b.rid, "", 0)]
    assert "".join(texts_of(w0, a.rid)) == "Hello world"
    assert all(r.error is None and r.finish is None for r in w0 + w1)


def test_each_row_is_decoded_with_its_own_requests_flags(rig) -> None:
    """SGLang #11944 decoded a whole batch with request 0's skip flag."""
    ids = [rig.token("<｜begin▁of▁sentence｜>")] + rig.encode("Hi") + [rig.token("<｜end▁of▁sentence｜>")]
    keep, skip = Req(skip_special_tokens=False), Req(skip_special_tokens=True)
    w0, _ = rig.step(skip.row(ids), keep.row(ids), skip.row(ids))
    assert texts_of(w0, skip.rid) == ["Hi", "Hi"]
    assert texts_of(w0, keep.rid) == ["<｜begin▁of▁sentence｜>Hi<｜end▁of▁sentence｜>"]


def test_the_prompt_tail_gives_the_first_characters_their_context(rig) -> None:
    prompt = rig.encode("Tell me: 🤖")
    a = Req(prompt_tail=prompt[:-1])  # the prompt ends inside the emoji
    w0, _ = rig.step(a.row(prompt[-1:] + rig.encode(" ok")))
    assert w0[0].text == oracle(rig.vocab, prompt[:-1], prompt[-1:] + rig.encode(" ok"), True) == " ok"


def test_a_request_ends_with_its_finishing_row(rig) -> None:
    a = Req()
    hi, there = rig.encode("Hi"), rig.encode(" there")
    rig.step(a.row(hi))
    (done,), _ = rig.step(a.row(there, Finish("length")))
    assert (done.text, done.finish, done.n_ids) == (" there", Finish("length"), len(hi + there))
    assert not rig.live(a.rid)


# --- the engine's stops -------------------------------------------------------------------


@pytest.mark.parametrize("stop", ["<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>"])
def test_a_stop_token_is_not_rendered(rig, stop) -> None:
    """Also id 0 (<｜begin▁of▁sentence｜>), which a truthiness check never trims (SGLang #33151)."""
    sid = rig.token(stop)
    a = Req(skip_special_tokens=False)
    rig.step(a.row(rig.encode("Answer")))
    (done,), _ = rig.step(a.row(rig.encode(" 42") + [sid], Finish("stop", sid)))
    assert done.text == " 42"
    assert done.n_ids == len(rig.encode("Answer") + rig.encode(" 42")) + 1  # the stop token counts
    assert done.finish == Finish("stop", sid)


def test_id_zero_is_a_stop_token_like_any_other(rig) -> None:
    assert rig.token("<｜begin▁of▁sentence｜>") == 0
    a = Req(skip_special_tokens=False)
    (done,), _ = rig.step(a.row(rig.encode("x") + [0], Finish("stop", 0)))
    assert done.text == "x"


def test_no_stop_trim_renders_the_stop_token(rig) -> None:
    sid = rig.token("<｜end▁of▁sentence｜>")
    a = Req(skip_special_tokens=False, no_stop_trim=True)
    (done,), _ = rig.step(a.row(rig.encode("x") + [sid], Finish("stop", sid)))
    assert done.text == "x<｜end▁of▁sentence｜>"


def test_a_stop_token_that_is_not_the_last_id_is_left_alone(rig) -> None:
    sid = rig.token("<｜end▁of▁sentence｜>")
    a = Req(skip_special_tokens=False)
    (done,), _ = rig.step(a.row([sid] + rig.encode("x"), Finish("stop", sid)))
    assert done.text == "<｜end▁of▁sentence｜>x"


@pytest.mark.parametrize("stream", [True, False])
def test_engine_stop_string_is_cut_at_the_first_occurrence_the_finishing_row_completes(rig, stream) -> None:
    """The engine checks after each step, so it stopped on the first occurrence in the
    finishing row; one in an earlier row's text (which it did not check) stays, sent or
    held for stream=false."""
    a = Req(stream=stream)
    (think,), _ = rig.step(a.row(rig.encode("Think: END? ")))
    (done,), _ = rig.step(a.row(rig.encode("Yes. END. Then END tail"), Finish("stop", "END")))
    assert think.text + done.text == "Think: END? Yes. "
    assert done.finish == Finish("stop", "END")


def test_engine_stop_string_with_no_stop_trim_is_kept(rig) -> None:
    a = Req(no_stop_trim=True)
    (done,), _ = rig.step(a.row(rig.encode("Yes END tail"), Finish("stop", "END")))
    assert done.text == "Yes END"


def test_engine_stop_string_that_began_in_sent_text_sends_nothing_more(rig) -> None:
    """The engine let the stop string's first characters out (SGLang checks its hold-back
    in token space, and a tail ending in part of a character slips through): the
    finishing row sends none of the rest."""
    a = Req()
    (first,), _ = rig.step(a.row(rig.encode("Emoji: 👨\u200d")))
    (done,), _ = rig.step(a.row(rig.encode("👩 and more"), Finish("stop", "\u200d👩")))
    assert (first.text, done.text) == ("Emoji: 👨\u200d", "")


def test_engine_stop_string_that_began_in_sent_text_on_the_fast_path_too(rig) -> None:
    """Plain streaming rows skip Request.feed; what they send is kept all the same."""
    a = Req()
    rig.step(a.row(rig.encode("Answer: 42 ST")))
    rig.step(a.row(rig.encode("O")))
    (done,), _ = rig.step(a.row(rig.encode("P tail"), Finish("stop", "STOP")))
    assert done.text == ""


@given(st.integers(0, 700), st.booleans())
def test_after_any_length_of_text_the_fast_paths_keep_what_an_engine_stop_needs(before, by_position) -> None:
    """However long the stream before it, a stop string of SENT_TAIL + 1 characters that
    only the finishing row completes began in sent text: nothing more is sent, whether
    the rows before went through `tokens` or by position through `quick`."""
    rig, a = CoreRig(), Req()
    stop = ("Стоп-слово " * 12)[: SENT_TAIL + 1]
    ids = rig.encode(("Hello, 世界! Émoji 👩‍👩‍👧 done. " * 30)[:before] + stop)
    rig.step(a.row(ids[:1]))
    for i in ids[1:-1]:
        if by_position:
            assert len(rig.det.quick([a.rid], [[i]], [None], [NIL])) == 1
            a.seq += 1
        else:
            rig.step(a.row([i]))
    (done,), _ = rig.step(a.row(ids[-1:], Finish("stop", stop)))
    assert done.text == ""


def test_engine_stop_string_wholly_in_text_already_sent_is_past_recall(rig) -> None:
    """An occurrence that ended in sent text is not the one the engine matched now."""
    a = Req()
    (first,), _ = rig.step(a.row(rig.encode("Yes END")))
    (done,), _ = rig.step(a.row(rig.encode(" more"), Finish("stop", "END")))
    assert (first.text, done.text) == ("Yes END", " more")


# --- stream=false -------------------------------------------------------------------------


def test_without_streaming_the_whole_text_comes_in_the_finishing_row(rig) -> None:
    a = Req(stream=False)
    parts = [rig.encode("Hello"), rig.encode(" wörld 🤖"), [], rig.encode(" done")]
    rows = [rig.step(a.row(ids))[0][0] for ids in parts]
    (done,), _ = rig.step(a.row(rig.encode("!"), Finish("length")))
    assert [r.text for r in rows] == ["", "", "", ""]
    assert [r.n_ids for r in rows] == list(itertools.accumulate(map(len, parts)))
    assert done.text == "Hello wörld 🤖 done!"


def test_without_streaming_stop_tokens_are_still_trimmed(rig) -> None:
    sid = rig.token("<｜end▁of▁sentence｜>")
    a = Req(stream=False, skip_special_tokens=False)
    rig.step(a.row(rig.encode("Hello")))
    (done,), _ = rig.step(a.row([sid], Finish("stop", sid)))
    assert done.text == "Hello"


# --- stops detokd finds itself ----------------------------------------------------------------


def test_a_stop_string_finishes_the_request_at_once(mistral) -> None:
    s = mistral
    a = Req(worker=1, stop=["STOP"])
    ids = s.encode("Hello STOP world")
    _, rows = s.step(a.row(ids))
    assert [(r.text, r.finish) for r in rows] == [("Hello ", Finish("stop", "STOP"))]
    assert rows[0].n_ids == len(ids)


def test_the_stopped_feedback_counts_ids_through_the_completing_one(mistral) -> None:
    s = mistral
    ids = s.encode("Hello STOP world and more")
    through = next(k for k in range(1, len(ids) + 1) if "STOP" in s.vocab.decode(ids[:k], True))
    a = Req(stop=["STOP"], vid=3)
    s.step(a.row(ids[:2]))
    s.step(a.row(ids[2:]))
    assert s.stopped() == [StoppedRow(a.rid, 3, "STOP", through)]


def test_rows_after_a_detected_stop_are_swallowed_until_the_engines_finish(mistral) -> None:
    s = mistral
    a = Req(stop=["STOP"])
    s.step(a.row(s.encode("Hello STOP")))
    assert s.step(a.row(s.encode(" more"))) == ([], [])
    assert s.step(a.row(s.encode(" and more"))) == ([], [])
    assert s.live(a.rid)
    assert s.step(a.row(s.encode("."), Finish("length"))) == ([], [])
    assert not s.live(a.rid)
    assert s.stopped() == [StoppedRow(a.rid, 0, "STOP", len(s.encode("Hello STOP")))]


def test_a_stop_found_in_the_finishing_row_frees_the_request(mistral) -> None:
    s = mistral
    a = Req(stop=["STOP"])
    (done,), _ = s.step(a.row(s.encode("Hello STOP there"), Finish("length")))
    assert (done.text, done.finish) == ("Hello ", Finish("stop", "STOP"))
    assert not s.live(a.rid)


def test_a_stop_string_spanning_rows_is_never_sent_in_part(mistral) -> None:
    s = mistral
    a = Req(stop=["</answer>"])
    ids = s.encode("The answer is 42</answer> and then")
    texts = []
    for i in ids:
        rows, _ = s.step(a.row([i]))
        texts += [r.text for r in rows]
        if rows[0].finish is not None:
            break
    assert "".join(texts) == "The answer is 42"
    assert all("<" not in t for t in texts)


def test_a_stop_equal_to_a_special_tokens_text_needs_it_rendered(mistral) -> None:
    s = mistral
    eos = s.token("</s>")
    ids = s.encode("Hi") + [eos] + s.encode("there")
    shown, hidden = Req(stop=["</s>"], skip_special_tokens=False), Req(stop=["</s>"])
    (stop_row, plain), _ = s.step(shown.row(ids), hidden.row(ids))
    assert (stop_row.text, stop_row.finish) == ("Hi", Finish("stop", "</s>"))
    assert (plain.text, plain.finish) == (oracle(s.vocab, [], ids, True), None)


def test_no_stop_trim_keeps_a_detected_stop_string(mistral) -> None:
    s = mistral
    a = Req(stop=["STOP"], no_stop_trim=True)
    (done,), _ = s.step(a.row(s.encode("Hello STOP world")))
    assert (done.text, done.finish) == ("Hello STOP", Finish("stop", "STOP"))


def test_without_streaming_a_detected_stop_sends_the_whole_text_cut(mistral) -> None:
    s = mistral
    a = Req(stop=["STOP"], stream=False)
    one, two = s.encode("Hello there,"), s.encode("friend STOP world")
    (first,), _ = s.step(a.row(one))
    (done,), _ = s.step(a.row(two))
    assert first.text == ""
    assert (done.text, done.finish) == (cut(oracle(s.vocab, [], one + two, True), ["STOP"], False)[0], Finish("stop", "STOP"))


# --- stop strings through the core, any split ---------------------------------------------------

FRAGMENTS = (
    "Hello, wörld! ", "Привет, мир. ", "你好，世界。", "𠀋𪚥 ", "👍🏽👩‍👩‍👧‍👦 ", "def f(x):\n\treturn x\n", "  \n\n",
)
STOPS = ("END", "</answer>", "\n\n", "。", "👍🏽", "wörld", "x\n", "ab", "abc", "bca")
ALPHABET = "".join(sorted(set("".join(FRAGMENTS + STOPS))))


@st.composite
def stop_cases(draw, name: str):
    v = vocab(name)
    stops = draw(st.lists(st.sampled_from(STOPS), min_size=1, max_size=3, unique=True))
    piece = st.one_of(st.sampled_from(FRAGMENTS), st.sampled_from(stops), st.text(st.sampled_from(ALPHABET), max_size=5))
    pieces = draw(st.lists(piece, max_size=8))
    ids = v.backend.encode("".join(pieces), add_special_tokens=False).ids
    for pos, i in draw(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, v.size - 1)), max_size=2)):
        ids.insert(pos % (len(ids) + 1), i)
    prompt = v.backend.encode(draw(st.sampled_from(FRAGMENTS)), add_special_tokens=False).ids
    tail = prompt[: draw(st.integers(0, len(prompt)))][-8:]
    skip = draw(st.booleans())
    full = oracle(v, tail, ids, skip)
    if full:  # a stop that surely occurs: a piece of the text it will produce
        a = draw(st.integers(0, len(full) - 1))
        piece = full[a : a + draw(st.integers(1, 4))]
        if "\ufffd" not in piece:
            stops.append(piece)
    sizes = draw(st.lists(st.integers(0, 5), max_size=len(ids) + 2))
    rows, at = [], 0
    for n in sizes:
        rows.append(ids[at : at + n])
        at += n
    rows.append(ids[at:])
    return tail, rows, skip, stops, draw(st.booleans()), draw(st.booleans())


@pytest.mark.parametrize("name", ["deepseek", "mistral_v3"])
def test_detected_stops_cut_the_text_at_the_first_to_complete(name) -> None:
    s = CoreRig(name)

    @settings(max_examples=settings.default.max_examples)
    @given(case=stop_cases(name))
    def check(case) -> None:
        tail, rows, skip, stops, keep, stream = case
        ids = [i for r in rows for i in r]
        want, matched = cut(oracle(s.vocab, tail, ids, skip), stops, keep)
        a = Req(prompt_tail=tail, skip_special_tokens=skip, stop=stops, no_stop_trim=keep, stream=stream)
        out = []
        for k, r in enumerate(rows):
            w0, _ = s.step(a.row(r, Finish("length") if k == len(rows) - 1 else None))
            out += w0
        assert all(r.error is None for r in out)
        assert "".join(r.text for r in out) == want
        assert out[-1].finish == (Finish("length") if matched is None else Finish("stop", matched))
        assert [r.finish for r in out[:-1]] == [None] * (len(out) - 1)  # nothing after the stop
        if not stream:
            assert "".join(r.text for r in out[:-1]) == ""
        assert not s.live(a.rid)
        fed = s.stopped()
        if matched is None:
            assert fed == []
            assert len(out) == len(rows)
            return
        ((rid, vid, found, n_ids),) = [(f.rid, f.vid, f.matched, f.n_ids) for f in fed]
        assert (rid, vid, found) == (a.rid, 0, matched)
        # The id that completed the stop: the first prefix of ids whose text holds it
        # (SentencePiece holds a byte-fallback run until it ends, so there it may come later).
        complete = [first_stop(oracle(s.vocab, tail, ids[:k], skip), stops) is not None for k in range(len(ids) + 1)]
        assert complete[n_ids]
        if name == "deepseek":
            assert n_ids == complete.index(True)

    check()


# --- errors -------------------------------------------------------------------------------------


def test_a_sequence_gap_fails_the_request(rig) -> None:
    a = Req(worker=1)
    rig.step(a.row(rig.encode("Hello")))
    a.seq += 1  # a row was lost
    _, (err,) = rig.step(a.row(rig.encode(" world")))
    assert (err.rid, err.error, err.text) == (a.rid, "sequence_gap", "")
    assert not rig.live(a.rid)
    _, (again,) = rig.step(a.row(rig.encode("!")))  # later rows: the same answer, same worker
    assert again.error == "sequence_gap"


@pytest.mark.parametrize("bad", [-1, -(2**40), "size", 2**40], ids=["-1", "very-negative", "size", "huge"])
def test_ids_outside_the_vocabulary_fail_the_request(rig, bad) -> None:
    bad = rig.vocab.size if bad == "size" else bad
    a = Req(worker=1)
    rig.step(a.row(rig.encode("Hello")))
    _, (err,) = rig.step(a.row([bad]))
    assert err.error == "bad_ids"
    b = Req(worker=1)  # in the middle of a longer row, on the first row
    _, (err,) = rig.step(b.row(rig.encode("Hi") + [bad] + rig.encode("there")))
    assert err.error == "bad_ids"
    assert not rig.live(a.rid) and not rig.live(b.rid)


def test_a_prompt_tail_outside_the_vocabulary_fails_the_request(rig) -> None:
    a = Req(worker=1, prompt_tail=[5, rig.vocab.size])
    _, (err,) = rig.step(a.row(rig.encode("Hi")))
    assert err.error == "bad_ids"


def test_a_row_of_an_unknown_rid_gets_an_error_at_every_worker(rig) -> None:
    w0, w1 = rig.step(Row("nobody", [1, 2], 0))
    assert [(r.rid, r.error) for r in w0] == [(r.rid, r.error) for r in w1] == [("nobody", "unknown_rid")]


def test_eviction_tells_the_evicted_requests_worker_at_once() -> None:
    s = CoreRig(max_states=2)
    old, mid, new = Req(worker=1), Req(worker=0), Req(worker=0)
    s.step(old.row(s.encode("a")), mid.row(s.encode("b")))
    w0, w1 = s.step(new.row(s.encode("c")))
    assert [(r.rid, r.error) for r in w1] == [(old.rid, "evicted")]
    assert [(r.rid, r.error) for r in w0] == [(new.rid, None)]
    assert not s.live(old.rid) and s.live(mid.rid) and s.live(new.rid)
    w0, w1 = s.step(old.row(s.encode("d")))  # its engine has not heard yet
    assert w0 == [] and [(r.rid, r.error) for r in w1] == [(old.rid, "evicted")]


@given(st.lists(st.integers(0, 6), min_size=1, max_size=8), st.integers(0, 12))
@settings(max_examples=60)
def test_rows_past_the_frames_id_budget_get_too_large_in_order(sizes, budget) -> None:
    s = CoreRig(limits=Limits(frame_ids=budget))
    reqs = [Req() for _ in sizes]
    ids = [s.encode("héllo wörld, 🙂 ok")[:n] for n in sizes]
    w0, _ = s.step(*(q.row(i) for q, i in zip(reqs, ids, strict=True)))
    within = 0
    for q, i, out in zip(reqs, ids, w0, strict=True):
        within += len(i)
        if within <= budget:
            assert out.error is None and out.text == oracle(s.vocab, [], i, True)
        else:
            assert out.error == "too_large" and not s.live(q.rid)


def test_a_start_with_a_new_vid_restarts_the_request(rig) -> None:
    a = Req(prompt_tail=rig.encode("Say:"))
    rig.step(a.row(rig.encode("Hello there")))
    again = Req(prompt_tail=rig.encode("Say:"), vid=1)
    again.rid = a.rid  # the engine retracted and re-runs it; seq counts from 0 again
    (row,), _ = rig.step(again.row(rig.encode("Bye")))
    assert (row.text, row.n_ids, row.error) == ("Bye", len(rig.encode("Bye")), None)
    (row,), _ = rig.step(again.row(rig.encode(" now"), Finish("length")))
    assert row.text == " now"


def test_a_start_with_the_same_vid_does_not_restart(rig) -> None:
    a = Req()
    rig.step(a.row(rig.encode("Hello")))
    (row,), _ = rig.step(Row(a.rid, rig.encode(" world"), a.seq, a.start))
    assert (row.text, row.error) == (" world", None)


def test_abort_frees_the_state_and_later_rows_are_unknown(rig) -> None:
    a = Req(worker=1)
    rig.step(a.row(rig.encode("Hello")))
    rig.det.abort([a.rid])
    assert not rig.live(a.rid)
    w0, w1 = rig.step(a.row(rig.encode(" world")))
    assert [r.error for r in w0] == [r.error for r in w1] == ["unknown_rid"]


def test_meta_passes_through_as_the_same_bytes(rig) -> None:
    meta = msgspec.Raw(msgspec.msgpack.encode({"logprobs": [-0.5, -1.25], "t": "é"}))
    a = Req(worker=1)
    _, (first,) = rig.step(a.row(rig.encode("Hi"), meta=meta))
    _, (done,) = rig.step(a.row(rig.encode("!"), Finish("length"), meta=meta))
    w0, _ = rig.step(Row("nobody", [1], 0, meta=meta))
    for r in (first, done, w0[0]):
        assert bytes(r.meta) == bytes(meta)
    assert bytes(OutRow("x").meta) == b"\xc0"  # no meta: MessagePack nil



def test_rows_after_a_detected_stop_get_no_row_even_when_out_of_sequence(rig) -> None:
    """The worker already has the finishing row: a stale error row would contradict it."""
    r = Req(stop=["END"])
    ids = rig.encode("one END two three")
    w0, _ = rig.step(r.row(ids))
    assert w0[-1].finish == Finish("stop", "END")
    late = Row(r.rid, [100], r.seq + 5)  # out of sequence, and still swallowed
    assert rig.step(late) == ([], [])
    assert rig.step(r.row([], finish=Finish("stop", "END"))) == ([], [])
    assert not rig.live(r.rid)


def test_evicting_a_request_detokd_already_stopped_sends_no_error() -> None:
    s = CoreRig(max_states=1)
    stopped, other = Req(stop=["END"]), Req()
    s.step(stopped.row(s.encode("one END two")))
    w0, _ = s.step(other.row([100]))
    assert [(row.rid, row.error) for row in w0] == [(other.rid, None)]


@pytest.mark.parametrize("name", ["deepseek", "mistral_v3"])
def test_a_live_request_costs_well_under_4_kib(name) -> None:
    """State per request: the table slot, the request, its decoder and stop scanner."""
    import tracemalloc

    s = CoreRig(name, max_states=4096)
    tail = s.encode("User: hello there, how are you?")[-8:]
    rows = [Row(f"m{i}", [], 0, Start(prompt_tail=tail, stop=["</answer>", "STOP"])) for i in range(2000)]
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    s.step(*rows)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(d.size_diff for d in after.compare_to(before, "filename"))
    assert len(s.det.table) == 2000
    assert grown / 2000 < 1024


def _positions(n: int) -> list[msgspec.Raw]:
    return [msgspec.Raw(msgspec.msgpack.encode(i)) for i in range(n)]


@pytest.mark.parametrize("in_vocab", [False, True])
@pytest.mark.parametrize("per_row", [1, 3])
def test_quick_gives_each_live_row_the_text_tokens_gives_it(per_row, in_vocab) -> None:
    """Detokenizer.quick, a dialect's fast path that places rows by position: each live
    plain streaming row gets the text `tokens` gives it (a settled lookup or a step of
    the decoder), and the requests go on from the same state; whether it checks each
    row's ids against the vocabulary or the dialect vouches for them (in_vocab)."""
    texts = ["Hello 世界 🙂 and more", "Ünïcödé ✓ 日本語 text", "plain ascii words here"]
    ref, fast = CoreRig(), CoreRig()
    ids = [ref.encode(t) for t in texts]
    ids = [x[: min(map(len, ids))] for x in ids]
    reqs = [Req() for _ in texts]
    for rig in (ref, fast):
        rig.step(*(Row(q.rid, [], 0, q.start) for q in reqs))
    rids, metas = [q.rid for q in reqs], _positions(len(reqs))
    for at in range(0, len(ids[0]), per_row):
        rows = [x[at : at + per_row] for x in ids]
        want = [row.text for row in ref.step(*(Row(q.rid, r, at, None) for q, r in zip(reqs, rows, strict=True)))[0]]
        got = fast.det.quick(rids, rows, [None] * len(reqs), metas, in_vocab=in_vocab)
        assert got == want and fast.step() == ([], [])
    ends = [fast.step(Row(q.rid, [], len(x), None, Finish("length")))[0][0].text for q, x in zip(reqs, ids, strict=True)]
    assert ends == [row.text for q, x in zip(reqs, ids, strict=True) for row in ref.step(Row(q.rid, [], len(x), None, Finish("length")))[0]]
    assert fast.stats.rows == ref.stats.rows and fast.stats.tokens == ref.stats.tokens


def test_quick_stops_at_the_first_row_tokens_must_take(rig) -> None:
    live = Req()
    rig.step(live.row())
    ok = rig.encode("ok")[:1]
    for rids, rows, finishes, stop in (
        ([live.rid, "unknown"], [ok, ok], [None, None], 1),
        ([live.rid, live.rid], [ok, ok], [None, Finish("length")], 1),
        ([live.rid, live.rid], [ok, [rig.vocab.size]], [None, None], 1),
        ([live.rid, live.rid], [ok, ok + [rig.vocab.size] + ok], [None, None], 1),
        ([live.rid, live.rid], [ok, ok + [-1]], [None, None], 1),
        ([live.rid, live.rid], [ok, []], [None, None], 1),
        ([live.rid], [ok], [None], 1),
    ):
        assert len(rig.det.quick(rids, rows, finishes, _positions(len(rids)))) == stop
        assert rig.det.quick(rids, rows, finishes, _positions(len(rids)), at=stop) == []
    assert rig.step() == ([], [])


def test_a_decoder_error_on_the_quick_path_is_answered_as_tokens_answers_it(mistral) -> None:
    """An open byte run past its bound (RunTooLong) fails the request with too_large, on
    an error row that carries the row's position."""
    rig = mistral
    q = Req()
    rig.step(q.row())
    piece = {t: i for i, t in enumerate(rig.vocab.tokens) if t}
    han = [piece[f"<0x{b:02X}>"] for b in "中".encode()]
    metas = _positions(2)
    assert rig.det.quick([q.rid], [han * 21845], [None], metas) == [""]
    assert rig.det.quick(["x", q.rid], [[], han], [Finish("length"), None], metas, at=1) == [""]
    (row,), _ = rig.step()
    assert row.error == "too_large" and row.meta == metas[1] and not rig.live(q.rid)
