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
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable


class StopAutomaton:
    """The trie of the stop strings with failure links; shared by requests alike."""

    __slots__ = ("goto", "fail", "depth", "match", "longest")

    def __init__(self, stops: Iterable[str]) -> None:
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        terminal: list[str | None] = [None]
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
        self.goto, self.fail, self.depth, self.match = goto, fail, depth, match
        self.longest = max(depth)

    def advance(self, state: int, ch: str) -> int:
        goto, fail = self.goto, self.fail
        while True:
            nxt = goto[state].get(ch)
            if nxt is not None:
                return nxt
            if state == 0:
                return 0
            state = fail[state]


_cache: OrderedDict[tuple[str, ...], StopAutomaton] = OrderedDict()


def automaton(stops: list[str]) -> StopAutomaton:
    """Requests of one deployment share a handful of stop lists: build each once."""
    key = tuple(stops)
    a = _cache.get(key)
    if a is None:
        a = _cache[key] = StopAutomaton(key)
        if len(_cache) > 1024:
            _cache.popitem(last=False)
    else:
        _cache.move_to_end(key)
    return a


class StopScanner:
    """One request's position in its automaton, and the text it holds back."""

    __slots__ = ("ac", "state", "held", "keep", "scanned")

    def __init__(self, stops: list[str], keep_stop: bool) -> None:
        self.ac = automaton(stops)
        self.state = 0
        self.held = ""
        self.keep = keep_stop  # no_stop_trim: the matched stop stays in the text
        self.scanned = 0  # characters fed in all, for the cost bound's test

    def feed(self, text: str) -> tuple[str, str | None]:
        """Scan new text; return (text safe to send, the stop string that completed)."""
        if not text:
            return "", None
        ac = self.ac
        advance, match = ac.advance, ac.match
        state = self.state
        self.scanned += len(text)
        for k, ch in enumerate(text):
            state = advance(state, ch)
            s = match[state]
            if s is not None:
                end = len(self.held) + k + 1
                full = self.held + text
                self.held, self.state = "", 0
                return (full[:end] if self.keep else full[: end - len(s)]), s
        self.state = state
        full = self.held + text
        d = ac.depth[state]
        self.held = full[len(full) - d :] if d else ""
        return full[: len(full) - d], None

    def flush(self) -> str:
        """End of stream: the held tail turned out not to be a stop string."""
        held, self.held, self.state = self.held, "", 0
        return held


def trim_engine_stop(text: str, matched: str | int | None, keep: bool) -> str:
    """Cut unsent text at the engine's matched stop string: its last occurrence.

    The engine stopped right after the occurrence that ended the request, so it is
    the last one; an earlier occurrence (in text the engine did not check, such as
    a reasoning section) stays. Only text not yet sent can be cut: a request that
    wants a stop string spanning rows trimmed exactly declares it in Start.stop.
    """
    if not isinstance(matched, str) or not matched:
        return text
    at = text.rfind(matched)
    if at < 0:
        return text
    return text[: at + len(matched)] if keep else text[:at]
