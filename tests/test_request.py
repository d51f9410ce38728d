"""Request.feed: one request's text logic, row by row (detokd.core.request).

What each row's text is, with a real tokenizer's decoder and a real stop scanner: the
stop token's trim, detokd's own stop strings (and the feedback row they make), the
stream=false buffer, and the trim of a stop string the engine matched, also when it
began in text already sent. The text is always the oracle's, cut where the rules say.
"""

from __future__ import annotations

import pytest
from conftest import ALL, cut, engine_cut, fast_codec, made_by, oracle, vocab, window_codec
from hypothesis import given
from hypothesis import strategies as st

from detokd.core.records import Finish, Start, StoppedRow
from detokd.core.request import SENT_TAIL, Request
from detokd.core.stops import StopAutomata, StopScanner

NAME = "deepseek"
AUTOMATA = StopAutomata(budget=1 << 30)


def ids_of(text: str) -> list[int]:
    return vocab(NAME).backend.encode(text, add_special_tokens=False).ids


def request(*, stop: list[str] = (), keep: bool = False, stream: bool = True, skip: bool = True) -> Request:
    start = Start(stop=list(stop), no_stop_trim=keep, stream=stream, skip_special_tokens=skip)
    scanner = StopScanner(AUTOMATA.get(start.stop), keep) if start.stop else None
    return Request(0, [], start, fast_codec(NAME).new([], skip), scanner)


def play(req: Request, ids: list[int], step: int, finish: Finish | None) -> list[tuple[str, Finish | None, StoppedRow | None]]:
    """Feed `ids` in rows of `step`, the last one with `finish`; stop at a finish."""
    out = []
    for k in range(0, max(len(ids), 1), step):
        last = k + step >= len(ids)
        out.append(req.feed("r", ids[k : k + step], finish if last else None))
        if out[-1][1] is not None:
            break
    return out


def text(rows) -> str:
    return "".join(t for t, _, _ in rows)


TEXT = "Hello, 世界! Émoji 👩‍👩‍👧 done. Привет."


@pytest.mark.parametrize("step", [1, 2, 5])
def test_a_plain_request_streams_the_oracles_text_and_counts_its_ids(step):
    ids = ids_of(TEXT)
    req = request()
    rows = play(req, ids, step, Finish("length"))
    assert text(rows) == oracle(vocab(NAME), [], ids, True)
    assert rows[-1][1] == Finish("length") and req.n_ids == len(ids) and not req.stopped


@pytest.mark.parametrize("keep", [False, True])
def test_the_stop_token_the_engine_matched_is_not_rendered_unless_no_stop_trim(keep):
    v = vocab(NAME)
    eos = v.backend.token_to_id("<｜end▁of▁sentence｜>")
    ids = ids_of("The end") + [eos]
    rows = play(request(keep=keep, skip=False), ids, 2, Finish("stop", eos))
    shown = ids if keep else ids[:-1]
    assert text(rows) == oracle(v, [], shown, False)
    assert "end▁of▁sentence" in oracle(v, [], ids, False)  # it would have shown


def test_a_stop_token_of_id_0_is_trimmed_too():
    # SGLang's detokenizer tests the matched id for truth, so id 0 was never trimmed.
    v = vocab(NAME)
    ids = ids_of("zero") + [0]
    assert text(play(request(skip=False), ids, 1, Finish("stop", 0))) == oracle(v, [], ids[:-1], False)


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("step", [1, 3])
def test_detokds_own_stop_string_ends_the_request_on_the_id_that_completed_it(keep, step):
    stop = "世界"
    ids = ids_of(TEXT)
    req = request(stop=[stop], keep=keep)
    rows = play(req, ids, step, Finish("length"))
    whole = oracle(vocab(NAME), [], ids, True)
    assert text(rows) == cut(whole, [stop], keep)[0]
    _, finish, stopped = rows[-1]
    assert finish == Finish("stop", stop) and req.stopped
    # n_ids: the ids it took to complete the stop string, the first id whose text holds its end.
    n = next(k for k in range(1, len(ids) + 1) if stop in oracle(vocab(NAME), [], ids[:k], True))
    assert stopped == StoppedRow("r", 0, stop, n)


def test_a_held_back_stop_prefix_that_never_completes_goes_out_with_the_finish():
    ids = ids_of("a partial </ans")
    rows = play(request(stop=["</answer>"]), ids, 1, Finish("length"))
    assert text(rows) == oracle(vocab(NAME), [], ids, True)
    assert "</ans" not in text(rows[:-1]) and rows[-1][0].endswith("</ans")


def test_stream_false_sends_nothing_until_the_finishing_row_which_carries_all():
    ids = ids_of(TEXT)
    req = request(stream=False)
    rows = play(req, ids, 2, Finish("length"))
    assert all(t == "" for t, _, _ in rows[:-1]) and req.held > 0
    assert rows[-1][0] == oracle(vocab(NAME), [], ids, True)


def test_a_token_with_the_engines_stop_string_twice_is_cut_at_the_first():
    """Issue #43: qwen2, stop=["l"], the finishing token ' fallback'. SGLang's scheduler
    stopped on that token, at its first 'l'; SGLang's own detokenizer sends 'Byte fa'."""
    v = vocab("qwen2")
    byte, fallback = v.backend.encode("Byte fallback", add_special_tokens=False).ids
    assert v.hf.decode([fallback]) == " fallback"
    req = Request(0, [], Start(), fast_codec("qwen2", "word").new([], True), None)
    assert req.feed("r", [byte], None)[0] == "Byte"
    assert req.feed("r", [fallback], Finish("stop", "l")) == (" fa", Finish("stop", "l"), None)


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("keep", [False, True])
def test_an_engine_stop_string_in_earlier_rows_text_stays_and_the_finishing_rows_is_cut(keep, stream):
    """The engine checks after each step: "done" in an earlier row did not stop it (it did
    not check that text, or missed it), the one in the finishing row did."""
    stop, head = "done", "done once, then"
    ids = ids_of(head + " done, and done again")
    k = next(k for k in range(len(ids)) if oracle(vocab(NAME), [], ids[:k], True) == head)
    req = request(keep=keep, stream=stream)
    sent = req.feed("r", ids[:k], None)[0]
    got = req.feed("r", ids[k:], Finish("stop", stop))[0]
    assert sent + got == head + (" done" if keep else " ")


@pytest.mark.parametrize("keep", [False, True])
def test_an_engine_stop_string_all_in_the_finishing_row_is_cut_at_its_first_occurrence(keep):
    stop = "done"
    ids = ids_of("done once, then done")
    rows = play(request(keep=keep), ids, len(ids), Finish("stop", stop))
    assert text(rows) == ("done" if keep else "")


def test_an_engine_stop_string_that_began_in_sent_text_sends_nothing_more():
    # The engine let the row with "Ем" out before the row that completed "Емоджи" (SGLang
    # checks in token space); what was sent stays sent, the rest of the stop never goes.
    head, stop = "Текст: ", "Емоджи"
    v = vocab(NAME)
    ids = ids_of(head + stop)
    k = next(k for k in range(len(ids)) if oracle(v, [], ids[:k], True).startswith(head + "Ем"))
    req = request()
    first = req.feed("r", ids[:k], None)[0]
    assert first.startswith(head + "Ем") and stop not in first
    assert req.feed("r", ids[k:], Finish("stop", stop)) == ("", Finish("stop", stop), None)


@given(st.integers(0, 700))
def test_after_any_length_of_text_an_engine_stop_reaches_back_sent_tail_characters(before):
    """However much text went out first, a stop string of SENT_TAIL + 1 characters that
    only its last row completed is found in the text sent before it (Request.sent keeps
    at least SENT_TAIL characters), so the finishing row sends nothing."""
    stop = ("Стоп-слово " * 12)[: SENT_TAIL + 1]
    ids = ids_of((TEXT * 30)[:before] + stop)
    req = request()
    sent = "".join(req.feed("r", [i], None)[0] for i in ids[:-1])
    whole = oracle(vocab(NAME), [], ids, True)
    assert whole.endswith(stop) and whole.startswith(sent) and 0 < len(whole) - len(sent) < len(stop)  # it began in sent
    assert req.feed("r", ids[-1:], Finish("stop", stop)) == ("", Finish("stop", stop), None)


def _engine_stop_run(steps: list[int], ids: list[int], stop: str) -> tuple[str, str]:
    """(text sent before the finishing row, text of the finishing row)."""
    req, before, k = request(), "", 0
    for n in steps:
        if k + n >= len(ids):
            break
        before += req.feed("r", ids[k : k + n], None)[0]
        k += n
    return before, req.feed("r", ids[k:], Finish("stop", stop))[0]


@given(st.lists(st.integers(1, 4), max_size=40), st.sampled_from(["世界", "Émoji", "👧 done", "ет."]))
def test_for_any_split_the_client_gets_the_oracle_up_to_the_engines_stop_and_never_past_it(steps, stop):
    """The engine stops on the id that completes its stop string. Whatever the rows
    before, the text ends where the stop begins, or, when the rows let its first
    characters out already, where they ended (SENT_TAIL bounds how far back it looks)."""
    v = vocab(NAME)
    full = ids_of(TEXT)
    ids = full[: next(n for n in range(1, len(full) + 1) if stop in oracle(v, [], full[:n], True))]
    whole = oracle(v, [], ids, True)
    at = whole.find(stop)
    assert len(stop) <= SENT_TAIL + 1
    before, last = _engine_stop_run(steps, ids, stop)
    assert whole.startswith(before + last)
    if len(before) <= at:
        assert before + last == whole[:at]
    else:  # its start went out with an earlier row: nothing more
        assert last == "" and len(before) < at + len(stop)


# --- the engine's stop string, against the oracle -------------------------------------------

# Pieces of text in which a stop string recurs and overlaps: twice in one token (qwen2's
# ' fallback' holds two 'l'), in characters split across ids (rare Han, a ZWJ sequence),
# in CJK that word release sends at once.
PIECES = ["l", "ll", " fallback", "a", " ", "世界", "界", "é", "👩\u200d👧", "\u200d", "𠀀", "Ж", ", "]
CODECS = [pytest.param(n, "fast", id=n) for n in ALL] + [
    pytest.param(n, "window", id=f"{n}-window") for n in ("deepseek", "mistral_v3")
]


def _decoder(name: str, kind: str, release: str, tail: list[int]):
    if kind == "window":
        return window_codec(name).new(tail, True)
    return fast_codec(name, release).new(tail, True)


def _rows(data, out: list[int]) -> tuple[list[list[int]], list[int]]:
    """Any split of `out` into earlier rows (empty ones too) and the finishing row."""
    sizes = data.draw(st.lists(st.integers(0, 4), max_size=len(out) + 2), label="rows")
    rows, k = [], 0
    for n in sizes:
        rows.append(out[k : k + n])
        k += len(rows[-1])
    return rows, out[k:]


def _stop(data, whole: str) -> str:
    """A stop string: a piece of the text (so it occurs, often more than once), or one
    that may not occur at all."""
    if whole and data.draw(st.booleans(), label="from the text"):
        at = data.draw(st.integers(0, len(whole) - 1), label="at")
        return whole[at : at + data.draw(st.integers(1, 4), label="length")]
    return data.draw(st.sampled_from(["l", "ll", "界", "👩\u200d", "§"]), label="stop")


@pytest.mark.parametrize("name,kind", CODECS)
@given(data=st.data())
def test_the_engines_stop_string_is_cut_at_the_first_occurrence_past_the_earlier_rows_text(name, kind, data):
    """Any split of the ids into rows, the last one finishing on the engine's stop string:
    the client's text is the oracle's up to the first occurrence that ends past the
    earlier rows' text (the oracle's text of their ids, as far as the whole text keeps
    it), through it with no_stop_trim; or what was sent, when that occurrence began in
    it. Both release modes, stream true and false, and a stop string of detokd's own
    that holds text back but never completes."""
    v = vocab(name)
    ids = v.backend.encode("".join(data.draw(st.lists(st.sampled_from(PIECES), max_size=14), label="text")),
                           add_special_tokens=False).ids
    k = data.draw(st.integers(0, min(len(ids), 6)), label="prompt ids")
    tail, out = ids[:k], ids[k:]
    whole = oracle(v, tail, out, True)
    stop = _stop(data, whole)
    rows, last = _rows(data, out)
    release = data.draw(st.sampled_from(["char", "word"]), label="release") if kind == "fast" else "char"
    stream, keep, watch = (data.draw(st.booleans(), label=x) for x in ("stream", "no_stop_trim", "watch"))
    start = Start(stop=[stop + "\x07"] if watch else [], no_stop_trim=keep, stream=stream)
    scanner = StopScanner(AUTOMATA.get(start.stop), keep) if watch else None
    req = Request(0, [], start, _decoder(name, kind, release, tail), scanner)

    sent = "".join(req.feed("r", row, None)[0] for row in rows)
    got, finish, stopped = req.feed("r", last, Finish("stop", stop))

    earlier = made_by(oracle(v, tail, out[: len(out) - len(last)], True), whole)
    assert (finish, stopped) == (Finish("stop", stop), None)
    assert whole.startswith(sent) and (stream or sent == "")
    assert sent + got == whole[: max(len(sent), engine_cut(whole, earlier, stop, keep))]
