"""Stop strings: detection with the least hold-back, and trimming by the engine's match.

detokd watches a request's stop strings with an Aho-Corasick automaton over the
characters it commits. Each character costs one transition, so a step scans only
its new characters, never the text before them, whatever the number of stop
strings. The automaton's state is the longest tail of the text that is a prefix
of some stop string: exactly the characters to hold back, so a client never sees
the first half of a stop string and no other text waits.

The stop that ends a request is the first to complete; where two complete on the
same character, the longer (it began first). This rule gives the same answer for
every split of the text into steps.

The held tail is never stored as text: it is the prefix of a stop string that the
automaton's state spells, so a step costs its new characters and what it sends,
never the length of what is held (a long stop's prefix fed id by id was quadratic).
"""

from __future__ import annotations

import sys
import weakref
from typing import Iterable

from .bounded import BoundedMap


class StopAutomaton:
    """The trie of the stop strings with failure links; shared by requests alike."""

    __slots__ = ("goto", "fail", "depth", "match", "spells", "nbytes", "__weakref__")

    def __init__(self, stops: Iterable[str]) -> None:
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        terminal: list[str | None] = [None]
        spells = [""]  # a stop string whose first depth[state] characters are the state's
        wide = 0  # edges on characters beyond Latin-1: each holds a str object of its own
        for s in stops:
            if not s:
                continue
            state = 0
            for ch in s:
                nxt = goto[state].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[state][ch] = nxt
                    goto.append({})
                    depth.append(depth[state] + 1)
                    terminal.append(None)
                    spells.append(s)
                    wide += ch > "\xff"
                state = nxt
            terminal[state] = s
        fail = [0] * len(goto)
        match = list(terminal)  # the longest stop string that ends at this state
        queue = list(goto[0].values())
        for state in queue:  # breadth-first, so a state's failure is settled first
            for ch, nxt in goto[state].items():
                f = fail[state]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[nxt] = goto[f].get(ch, 0) if goto[f].get(ch, 0) != nxt else 0
                if match[nxt] is None:
                    match[nxt] = match[fail[nxt]]
                queue.append(nxt)
        self.goto, self.fail, self.depth, self.match, self.spells = goto, fail, depth, match, spells
        # Its memory, estimated: a state is a small dict and a slot in five lists (and
        # ints past the small-int cache); the stop strings themselves; the wide chars.
        self.nbytes = STATE_BYTES * len(goto) + WIDE_CHAR_BYTES * wide + sum(sys.getsizeof(s) for s in set(spells))

    def spell(self, state: int) -> str:
        """The text a state stands for: the longest tail of the text scanned that is a
        prefix of some stop string."""
        return self.spells[state][: self.depth[state]]

    def advance(self, state: int, ch: str) -> int:
        goto, fail = self.goto, self.fail
        while True:
            nxt = goto[state].get(ch)
            if nxt is not None:
                return nxt
            if state == 0:
                return 0
            state = fail[state]


STATE_BYTES = 300  # measured on CPython 3.11: 500,000 states of one long stop hold 140 MB
WIDE_CHAR_BYTES = 80
CACHE_ENTRIES = 1024
CACHE_BYTES = 64 << 20


class StopAutomata:
    """The automata of one Detokenizer. Requests of a deployment share a handful of stop
    lists, so each is built once and cached, least recently used first out, bounded in
    entries and bytes: a few requests with huge stop strings must not pin gigabytes of
    automata after they end. An automaton bigger than the whole cache is built for its
    request and not kept.

    `alive` and `alive_bytes` count every automaton built here that is still alive,
    cached or held by a live request after the cache let it go (an automaton has no
    cycles: it is freed, and counted out, when its last holder lets go). `make_room`
    keeps them within `budget` bytes."""

    def __init__(self, budget: int, entries: int = CACHE_ENTRIES, cache_bytes: int = CACHE_BYTES) -> None:
        self.budget = budget
        self.cache: BoundedMap[tuple[str, ...], StopAutomaton] = BoundedMap(
            entries, cache_bytes, lambda key, a: a.nbytes)
        self.alive = 0
        self.alive_bytes = 0

    def cost(self, stops: list[str]) -> int:
        """What `get(stops)` would build, in characters: 0 when it is cached."""
        return 0 if tuple(stops) in self.cache else sum(map(len, stops))

    def make_room(self, chars: int) -> bool:
        """Whether an automaton of `chars` characters fits beside those alive within the
        budget, after letting cached ones go, oldest first (one a live request holds
        stays alive, uncached). False when it does not fit even then."""
        need = STATE_BYTES * (chars + 1)
        while self.alive_bytes + need > self.budget and len(self.cache):
            self.cache.pop(next(iter(self.cache)))  # the oldest key; no reference kept: a free one goes at once
        return self.alive_bytes + need <= self.budget

    def get(self, stops: list[str]) -> StopAutomaton:
        key = tuple(stops)
        a = self.cache.get(key)
        if a is None:
            a = StopAutomaton(key)
            self.alive += 1
            self.alive_bytes += a.nbytes
            weakref.finalize(a, self._gone, a.nbytes)
            self.cache.put(key, a)
        else:
            self.cache.refresh(key)
        return a

    def _gone(self, nbytes: int) -> None:
        self.alive -= 1
        self.alive_bytes -= nbytes


class StopScanner:
    """One request's position in its automaton, which spells the text it holds back."""

    __slots__ = ("ac", "state", "keep_stop")

    def __init__(self, ac: StopAutomaton, keep_stop: bool) -> None:
        self.ac = ac
        self.state = 0
        self.keep_stop = keep_stop  # no_stop_trim: the matched stop stays in the text

    @property
    def held(self) -> str:
        return self.ac.spell(self.state)

    def feed(self, text: str) -> tuple[str, str | None]:
        """Scan new text; return (text safe to send, the stop string that completed)."""
        if not text:
            return "", None
        ac = self.ac
        advance, match = ac.advance, ac.match
        start = state = self.state
        for k, ch in enumerate(text):
            state = advance(state, ch)
            s = match[state]
            if s is not None:
                self.state = 0
                end = ac.depth[start] + k + 1  # in held + text
                return self._sent(start, text, end if self.keep_stop else end - len(s)), s
        self.state = state
        return self._sent(start, text, ac.depth[start] + len(text) - ac.depth[state]), None

    def _sent(self, start: int, text: str, n: int) -> str:
        """The first n characters of (what state `start` held) + text, built once."""
        h = self.ac.depth[start]
        if n <= h:
            return self.ac.spells[start][:n] if n else ""
        if not h:
            return text if n == len(text) else text[:n]
        return self.ac.spells[start][:h] + text[: n - h]

    def flush(self) -> str:
        """End of stream: the held tail turned out not to be a stop string."""
        held, self.state = self.held, 0
        return held


def trim_engine_stop(sent: str, text: str, earlier: int, matched: str | int | None, keep: bool) -> str:
    """What of the unsent `text` goes out when the engine stopped on `matched`: the part
    before the first occurrence that ends after the earlier rows' text (through it, with
    `keep`); all of it when there is none. `sent` is the tail of the text already sent;
    the first `earlier` characters of `text` are earlier rows' text not sent yet.

    The engine checks for its stop strings after every step, so an occurrence that
    ended in an earlier row would have stopped it then: the one it matched ends in the
    finishing row, and is the first to. One wholly in earlier rows' text stays (text
    the engine did not check, such as a reasoning section, or an occurrence its check
    missed). It may have begun in sent text (an engine holds a row back while its text
    could begin a stop string, but not always: SGLang checks in token space and misses
    a tail ending in part of a character), so the last len(matched) - 1 sent characters
    are searched too; when it began there, nothing more is sent.
    """
    if not isinstance(matched, str) or not matched:
        return text
    before = sent[max(0, len(sent) - len(matched) + 1) :]
    # The first occurrence that ends past before + text[:earlier] begins no sooner than this.
    at = (before + text).find(matched, max(0, len(before) + earlier - len(matched) + 1))
    if at < 0:
        return text
    end = at + len(matched) if keep else at
    return text[: max(0, end - len(before))]
