"""Stop strings (issue "Stop strings"): StopScanner and trim_engine_stop.

The rules (docs/protocol.md "Stop strings", docs/stop-strings.md): the stop that ends the text
is the first to complete, and of those completing on the same character the longer; the
text ends just before it, or just after it with no_stop_trim. While no stop has completed,
the scanner holds back exactly the longest tail of the text that is a proper prefix of
some stop string, and sends everything else at once. None of this depends on how the text
is split into steps. The tests compare against a naive reading of these rules.
"""

from __future__ import annotations

import tracemalloc

import pytest
from conftest import cut, engine_cut
from hypothesis import given
from hypothesis import strategies as st

from detokd.core.stops import CACHE_BYTES, STATE_BYTES, StopAutomata, StopAutomaton, StopScanner, trim_engine_stop

AUTOMATA = StopAutomata(budget=1 << 40)  # the unit and property tests' own, never full


def scanner(stops: list[str], keep: bool) -> StopScanner:
    return StopScanner(AUTOMATA.get(stops), keep)


class CountingScanner(StopScanner):
    """A scanner that counts its work, for the cost tests: characters scanned, and
    characters built into text to send."""

    __slots__ = ("scanned", "copied")

    def __init__(self, stops: list[str], keep: bool) -> None:
        super().__init__(AUTOMATA.get(stops), keep)
        self.scanned = self.copied = 0

    def feed(self, text: str) -> tuple[str, str | None]:
        self.scanned += len(text)
        return super().feed(text)

    def _sent(self, start: int, text: str, n: int) -> str:
        self.copied += n
        return super()._sent(start, text, n)


# --- the rules, naively ---------------------------------------------------------------------


def pending(text: str, stops: list[str]) -> str:
    """The longest tail of text that is a proper prefix of some stop string."""
    for k in range(len(text), 0, -1):
        tail = text[-k:]
        if any(len(s) > k and s.startswith(tail) for s in stops):
            return tail
    return ""


def scan(stops: list[str], chunks: list[str], keep: bool) -> tuple[list[str], str | None, str]:
    """Feed chunks until a stop completes: (texts sent per chunk, the stop, what flush gives)."""
    sc = scanner(stops, keep)
    sent = []
    for chunk in chunks:
        text, found = sc.feed(chunk)
        sent.append(text)
        if found is not None:
            return sent, found, ""
    return sent, None, sc.flush()


# --- unit cases -----------------------------------------------------------------------------


def test_text_without_stops_passes_through_at_once() -> None:
    assert scan(["END"], ["hello ", "world"], False) == (["hello ", "world"], None, "")


def test_a_stop_within_one_chunk_cuts_the_text_before_it() -> None:
    assert scan(["END"], ["hello END world"], False) == (["hello "], "END", "")


def test_no_stop_trim_keeps_the_stop_string() -> None:
    assert scan(["END"], ["hello END world"], True) == (["hello END"], "END", "")


def test_a_stop_split_across_chunks_is_found_and_never_sent() -> None:
    assert scan(["END"], ["abc E", "N", "D and more"], False) == (["abc ", "", ""], "END", "")


def test_only_a_possible_beginning_of_a_stop_is_held_back() -> None:
    """Not a fixed max_len - 1 characters: "hello" could begin no stop string."""
    sc = scanner(["<|im_end|>"], False)
    assert sc.feed("hello") == ("hello", None) and sc.held == ""
    assert sc.feed(" <|im") == (" ", None) and sc.held == "<|im"
    assert sc.feed("_start|>") == ("<|im_start|>", None) and sc.held == ""


def test_the_held_tail_is_the_longest_one_that_could_still_become_a_stop() -> None:
    sc = scanner(["abcd", "bcx"], False)
    assert sc.feed("zabc") == ("z", None) and sc.held == "abc"
    # "abcd" can no longer complete, but "bcx" just did.
    assert sc.feed("x") == ("a", "bcx")


def test_the_first_stop_to_complete_wins_over_one_that_began_earlier() -> None:
    assert scan(["abcdef", "cd"], ["abcdef"], False) == (["ab"], "cd", "")


def test_of_stops_completing_on_the_same_character_the_longer_wins() -> None:
    assert scan(["cd", "bcd"], ["abcd"], False) == (["a"], "bcd", "")
    assert scan(["bcd", "cd"], ["ab", "cd"], True) == (["a", "bcd"], "bcd", "")


def test_a_stop_inside_a_longer_stop_string_is_found() -> None:
    """Aho-Corasick's failure links: "bc" ends inside the text of a longer candidate."""
    assert scan(["abd", "bc"], ["ab", "c"], False) == (["", "a"], "bc", "")


def test_stops_of_multibyte_characters() -> None:
    assert scan(["你好", "👍🏽"], ["ok 你", "好 no"], False) == (["ok ", ""], "你好", "")
    assert scan(["👍🏽"], ["yes 👍", "🏽!"], True) == (["yes ", "👍🏽"], "👍🏽", "")
    # 👍 alone (no skin tone) is not the stop: it is sent once the next character shows it.
    assert scan(["👍🏽"], ["a 👍", "!"], False) == (["a ", "👍!"], None, "")


def test_flush_gives_back_a_held_tail_that_never_completed() -> None:
    sc = scanner(["</answer>"], False)
    assert sc.feed("x </ans") == ("x ", None)
    assert sc.flush() == "</ans"
    assert sc.held == "" and sc.state == 0


def test_empty_stop_strings_are_ignored() -> None:
    assert scan(["", "Z"], ["abc"], False) == (["abc"], None, "")


def test_requests_with_the_same_stop_list_share_one_automaton() -> None:
    automata = StopAutomata(budget=1 << 30)
    assert automata.get(["a", "b"]) is automata.get(["a", "b"])
    assert automata.cost(["a", "b"]) == 0 and automata.cost(["a", "c"]) == 2


def test_two_detokenizers_keep_their_automata_and_budgets_apart() -> None:
    one, two = StopAutomata(budget=1 << 30), StopAutomata(budget=1 << 30)
    a = one.get(["apart"])
    assert two.cost(["apart"]) == 5 and two.get(["apart"]) is not a
    assert (one.alive, one.alive_bytes) == (two.alive, two.alive_bytes) == (1, a.nbytes)


# --- properties -------------------------------------------------------------------------------

# A small alphabet makes stops overlap and recur; multi-byte characters and the texts of
# special tokens (which appear in the text with skip_special_tokens=False) come along.
ALPHABET = "abcé你👍🏽 \n"
SPECIAL_TEXTS = ("</s>", "<|im_end|>", "<｜end▁of▁sentence｜>", "[SEP]")
stop_lists = st.lists(
    st.one_of(st.text(st.sampled_from(ALPHABET), min_size=1, max_size=4), st.sampled_from(SPECIAL_TEXTS)),
    min_size=1,
    max_size=5,
)


@st.composite
def streams(draw) -> tuple[list[str], list[str], bool]:
    """(stops, chunks, keep): text with stop strings (or their beginnings) inserted."""
    stops = draw(stop_lists)
    pieces = draw(
        st.lists(
            st.one_of(
                st.text(st.sampled_from(ALPHABET), max_size=6),
                st.sampled_from(stops),
                st.sampled_from(stops).flatmap(lambda s: st.integers(0, len(s)).map(lambda k: s[:k])),
            ),
            max_size=8,
        )
    )
    text = "".join(pieces)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]  # empty chunks too
    return stops, chunks, draw(st.booleans())


@given(streams())
def test_final_text_is_cut_at_the_first_stop_to_complete(case) -> None:
    stops, chunks, keep = case
    sent, found, flushed = scan(stops, chunks, keep)
    assert ("".join(sent) + flushed, found) == cut("".join(chunks), stops, keep)


@given(streams())
def test_sent_text_is_always_a_prefix_of_the_final_text(case) -> None:
    stops, chunks, keep = case
    final, _ = cut("".join(chunks), stops, keep)
    sent = ""
    for text in scan(stops, chunks, keep)[0]:
        sent += text
        assert final.startswith(sent)


@given(streams())
def test_held_back_is_exactly_the_longest_tail_that_may_begin_a_stop(case) -> None:
    stops, chunks, keep = case
    sc = scanner(stops, keep)
    fed = sent = ""
    for chunk in chunks:
        text, found = sc.feed(chunk)
        if found is not None:
            break
        fed += chunk
        sent += text
        assert sc.held == pending(fed, stops)
        assert sent + sc.held == fed


# --- cost -------------------------------------------------------------------------------------


def test_each_step_scans_only_its_new_characters() -> None:
    """Over a long stream that keeps almost matching, each feed scans its own characters
    and no more: never the text before them, nor the held tail again."""
    stops = ["<|im_end|>", "<|endoftext|>", "\n\nUser:", "a" * 40 + "!"]
    sc = CountingScanner(stops, False)
    unit = "text <|im_en, " + "a" * 39 + " and \n\nUser, 你好 👍🏽 <|endoftext"
    total = 0
    for k in range(20_000):
        chunk = unit[k % len(unit) : k % len(unit) + 1 + k % 5]
        before = sc.scanned
        text, found = sc.feed(chunk)
        assert found is None
        assert sc.scanned - before == len(chunk)
        assert len(sc.held) < max(map(len, stops))
        total += len(chunk)
    assert sc.scanned == total


def test_a_long_held_stop_prefix_costs_each_step_only_its_new_characters() -> None:
    """A 200,000-character stop fed a few characters at a time: the held tail grows to
    almost all of it, and no step copies it (building held + text per step was
    quadratic: 3M characters over 30,000 ids took 5.7 s)."""
    stop = "ab" * 100_000
    sc = CountingScanner([stop, "zz"], False)
    fed = 0
    for k in range(0, len(stop) - 1, 7):
        chunk = stop[k : min(k + 7, len(stop) - 1)]
        before = sc.copied
        assert sc.feed(chunk) == ("", None)
        assert sc.copied == before  # nothing sent, nothing built
        fed += len(chunk)
    assert sc.scanned == fed and len(sc.held) == fed
    # The held tail goes out whole once it can no longer be the stop, built once.
    text, found = sc.feed("c")
    assert (text, found) == (stop[:-1] + "c", None) and sc.copied == fed + 1


def test_what_a_scanner_builds_is_what_it_sends_for_every_split() -> None:
    """Characters built to send are exactly the characters sent, however the text is cut."""
    stops = ["abcabd", "bca", "d" * 30]
    text = ("abcab" + "d" * 29 + "x") * 50 + "abcabd"
    for step in (1, 2, 3, 7, 31, len(text)):
        sc = CountingScanner(stops, True)
        sent = ""
        for k in range(0, len(text), step):
            out, found = sc.feed(text[k : k + step])
            sent += out
            if found:
                break
        assert sc.copied == len(sent)
        assert (sent, found) == cut(text, stops, True)


def test_the_automaton_cache_is_bounded_in_bytes() -> None:
    """Ten finished requests with one long stop string each must not pin their
    automata forever (ten of 500,000 characters held 1.39 GB)."""
    automata = StopAutomata(budget=1 << 40)
    for k in range(10):
        a = automata.get([f"{k}" + "x" * 60_000])
        assert a.nbytes > CACHE_BYTES // 5
        assert automata.cache.nbytes <= CACHE_BYTES
    assert len(automata.cache) < 10
    assert automata.get(["9" + "x" * 60_000]) is a  # the newest is still shared


def test_an_automaton_bigger_than_the_cache_is_built_but_not_kept() -> None:
    automata = StopAutomata(budget=1 << 30, cache_bytes=50_000)
    big = ["Q" * 1000]
    sc = StopScanner(automata.get(big), False)
    assert len(automata.cache) == 0 and automata.alive == 1
    assert sc.feed("a" + "Q" * 1000) == ("a", big[0])


def test_an_automaton_is_counted_alive_while_a_request_holds_it_after_the_cache_let_it_go() -> None:
    automata = StopAutomata(budget=1 << 30)
    sc = StopScanner(automata.get(["alive-" + "z" * 500]), False)
    assert (automata.alive, automata.alive_bytes) == (1, sc.ac.nbytes)
    automata.cache.pop(("alive-" + "z" * 500,))
    assert (automata.alive, automata.alive_bytes) == (1, sc.ac.nbytes)  # the request still holds it
    del sc
    assert (automata.alive, automata.alive_bytes) == (0, 0)  # freed with its last holder, counted out


def test_make_room_lets_cached_automata_go_oldest_first_but_not_what_requests_hold() -> None:
    automata = StopAutomata(budget=0)
    held = StopScanner(automata.get(["held-" + "h" * 300]), False)
    old, new = automata.get(["old-" + "o" * 300]), automata.get(["new-" + "n" * 300])
    size = old.nbytes
    del old, new  # now only the cache holds them
    automata.budget = automata.alive_bytes + STATE_BYTES * 301 - size + 1  # one of the two must go
    assert automata.make_room(300)
    assert ("old-" + "o" * 300,) not in automata.cache and ("new-" + "n" * 300,) in automata.cache
    automata.budget = held.ac.nbytes
    assert not automata.make_room(300)  # only what a request holds is left: no room
    assert len(automata.cache) == 0 and automata.alive_bytes == held.ac.nbytes


@pytest.mark.parametrize("kind", ["one long", "cjk", "many short", "overlapping"])
def test_an_automatons_size_estimate_is_not_below_what_it_holds(kind: str) -> None:
    stops = {
        "one long": ["x" * 20_000],
        "cjk": ["".join(chr(0x4E00 + i % 700) for i in range(20_000))],
        "many short": ["<|im_end|>", "</s>", "\n\nUser:", "Observation:"],
        "overlapping": [("abcab" * 40)[i:] + str(i) for i in range(100)],
    }[kind]
    tracemalloc.start()
    try:
        a = StopAutomaton(stops)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held <= a.nbytes <= 2 * held + 20_000


# --- the engine's own stop string -------------------------------------------------------------


def test_engine_stop_is_cut_at_the_first_occurrence_the_finishing_row_completes() -> None:
    """All of this is the finishing row's text: the engine checks after every step, so it
    stopped on the first occurrence it saw, as a token ' fallback' stops on its first 'l'."""
    assert trim_engine_stop("", "a STOP b STOP c", 0, "STOP", False) == "a "
    assert trim_engine_stop("Byte", " fallback", 0, "l", False) == " fa"


def test_an_engine_stop_wholly_in_earlier_rows_text_stays() -> None:
    """The first 6 characters are earlier rows' text not sent yet (stream=false, or held
    back): an occurrence there did not stop the engine (a reasoning section it did not
    check, say), so the cut is at the next one."""
    assert trim_engine_stop("", "a STOP b STOP c", 6, "STOP", False) == "a STOP b "


def test_an_engine_stop_that_began_in_earlier_rows_text_is_the_one_it_completed() -> None:
    assert trim_engine_stop("", "a STOP b STOP c", 4, "STOP", False) == "a "


def test_engine_stop_with_no_stop_trim_keeps_it() -> None:
    assert trim_engine_stop("", "a STOP b STOP c", 0, "STOP", True) == "a STOP"
    assert trim_engine_stop("", "a STOP b STOP c", 6, "STOP", True) == "a STOP b STOP"


def test_engine_stop_that_began_in_sent_text_sends_nothing_more() -> None:
    """The engine let 'ST' out (it checks in token space) before it matched 'STOP'."""
    assert trim_engine_stop("text ST", "OP and on", 0, "STOP", False) == ""


def test_engine_stop_that_began_in_sent_text_with_no_stop_trim_sends_its_rest() -> None:
    assert trim_engine_stop("text ST", "OP and on", 0, "STOP", True) == "OP"


def test_engine_stop_wholly_in_sent_text_is_past_recall() -> None:
    """An occurrence that ended in sent text is not the one the engine matched now."""
    assert trim_engine_stop("a STOP", " more", 0, "STOP", False) == " more"


@given(
    text=st.text(alphabet="ab👩\u200d", max_size=16),
    stop=st.text(alphabet="ab👩\u200d", min_size=1, max_size=4),
    data=st.data(),
    keep=st.booleans(),
)
def test_engine_stop_trim_is_the_rule_on_the_whole_text_for_any_split(text, stop, data, keep) -> None:
    """However the text falls into sent text, earlier rows' text not sent yet, and the
    finishing row's text: sent + trimmed is the whole text cut before the first
    occurrence ending past the earlier rows' text (through it, with keep), or the sent
    text alone when that cut lies in it."""
    sent = data.draw(st.integers(0, len(text)), label="sent")
    earlier = data.draw(st.integers(sent, len(text)), label="earlier")
    got = text[:sent] + trim_engine_stop(text[:sent], text[sent:], earlier - sent, stop, keep)
    assert got == text[: max(sent, engine_cut(text, earlier, stop, keep))]


@pytest.mark.parametrize("matched", [None, "", 0, 2, "absent"])
def test_engine_stop_that_is_no_string_in_the_text_leaves_it_alone(matched) -> None:
    """Stop token ids (0 included) are trimmed as ids by the core, not as text here."""
    assert trim_engine_stop("sent 0 ", "text 0 2", 0, matched, False) == "text 0 2"
