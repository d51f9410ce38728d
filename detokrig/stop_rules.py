"""The stop-string rules of docs/stop-strings.md, read naively: the oracles of the stop
tests (tests/) and of the SGLang front-end cases (sglang_cases.py)."""

from __future__ import annotations


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(end, stop) of the first stop string to complete in text; ties go to the longer."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if s and len(s) <= end and text[end - len(s) : end] == s]
        if hits:
            return end, max(hits, key=len)
    return None


def cut(text: str, stops: list[str], keep: bool) -> tuple[str, str | None]:
    """The whole text a request ends with, and the stop that ended it."""
    hit = first_stop(text, stops)
    if hit is None:
        return text, None
    end, s = hit
    return (text[:end] if keep else text[: end - len(s)]), s


def engine_cut(text: str, earlier: int, stop: str, keep: bool) -> int:
    """Where a text ends when the engine stopped on the string `stop` and its first
    `earlier` characters are the earlier rows' text: before the first occurrence of
    `stop` that ends after them (after it, with keep); at its end when none does."""
    for end in range(max(earlier + 1, len(stop)), len(text) + 1):
        if text[end - len(stop) : end] == stop:
            return end if keep else end - len(stop)
    return len(text)


def made_by(earlier: str, whole: str) -> int:
    """How much of `whole` the text of the earlier rows' ids (`earlier`, the oracle's)
    already was: their common prefix. A later id may complete a character they split
    (U+FFFD there) or turn a byte-fallback run invalid."""
    n = 0
    while n < min(len(earlier), len(whole)) and earlier[n] == whole[n]:
        n += 1
    return n
