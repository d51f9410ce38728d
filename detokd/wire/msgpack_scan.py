"""Where MessagePack values begin and end, without building them and without recursion.

msgspec decodes nesting by recursion: a value nested a few thousand deep raises
RecursionError wherever it sits, and takes the whole frame with it. The salvage paths
(a tokens frame whose one row is bad, an SGLang batch whose one field is) need the
extent of each top-level value to decode the good ones alone and read the rids of the
bad ones; this walks the bytes with a counter instead of a stack, so no depth is too
deep. It is slow (Python per value) and used only once a frame has failed.
"""

from __future__ import annotations

import struct

# Lead byte -> (header size, where the length is, its format, what it counts), for
# every form whose length is not in the lead byte itself. `counts`: "bytes" of payload,
# or "items" of a container (a map's are key and value, two per entry).
_SIZED = {
    0xC4: (2, 1, ">B", "bytes"), 0xC5: (3, 1, ">H", "bytes"), 0xC6: (5, 1, ">I", "bytes"),  # bin
    0xC7: (3, 1, ">B", "bytes"), 0xC8: (4, 1, ">H", "bytes"), 0xC9: (6, 1, ">I", "bytes"),  # ext
    0xD9: (2, 1, ">B", "bytes"), 0xDA: (3, 1, ">H", "bytes"), 0xDB: (5, 1, ">I", "bytes"),  # str
    0xDC: (3, 1, ">H", "items"), 0xDD: (5, 1, ">I", "items"),  # array
    0xDE: (3, 1, ">H", "pairs"), 0xDF: (5, 1, ">I", "pairs"),  # map
}
_FIXED = {  # lead byte -> the whole value's size
    0xC0: 1, 0xC2: 1, 0xC3: 1, 0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9,
    0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9, 0xD4: 3, 0xD5: 4, 0xD6: 6, 0xD7: 10, 0xD8: 18,
}


class Malformed(ValueError):
    """The bytes are not MessagePack (a reserved byte, or a value cut short)."""


def header(buf: bytes | memoryview, pos: int) -> tuple[int, int, int]:
    """The value at `pos`: (where its payload begins, payload bytes, items it contains).
    A scalar has neither payload nor items beyond its header."""
    if pos >= len(buf):
        raise Malformed(f"a value is cut short at byte {pos}")
    b = buf[pos]
    if b <= 0x7F or b >= 0xE0:
        return pos + 1, 0, 0
    if b <= 0x8F:
        return pos + 1, 0, 2 * (b & 0x0F)
    if b <= 0x9F:
        return pos + 1, 0, b & 0x0F
    if b <= 0xBF:
        return pos + 1, b & 0x1F, 0
    fixed = _FIXED.get(b)
    if fixed is not None:
        return pos + fixed, 0, 0
    sized = _SIZED.get(b)
    if sized is None:
        raise Malformed(f"byte {b:#x} at {pos} begins no MessagePack value")
    size, at, fmt, counts = sized
    if pos + size > len(buf):
        raise Malformed(f"a header is cut short at byte {pos}")
    (n,) = struct.unpack_from(fmt, buf, pos + at)
    if counts == "bytes":
        return pos + size, n, 0
    return pos + size, 0, n if counts == "items" else 2 * n


# Values one call walks at most (~0.3 s of Python): a frame of millions of tiny values
# is refused rather than walked, as a frame msgspec cannot read would be.
MAX_VALUES = 1 << 20


def _end(buf: bytes | memoryview, pos: int, budget: list[int]) -> int:
    """Where the value that begins at `pos` ends, however deeply it nests; each value
    walked spends one of budget[0]."""
    pending = 1
    while pending:
        budget[0] -= 1
        if budget[0] < 0:
            raise Malformed(f"more than {MAX_VALUES} values to walk")
        body, nbytes, items = header(buf, pos)
        pos = body + nbytes
        pending += items - 1
    if pos > len(buf):
        raise Malformed("a value runs past the end of the frame")
    return pos


def end(buf: bytes | memoryview, pos: int) -> int:
    """Where the value that begins at `pos` ends, however deeply it nests."""
    return _end(buf, pos, [MAX_VALUES])


def items(buf: bytes | memoryview, pos: int, most: int, take: int | None = None) -> list[tuple[int, int]]:
    """The (start, end) of each item of the array at `pos` (of its first `take` only, if
    given); Malformed when it is no array or holds more than `most` items (checked
    before one is read)."""
    b = buf[pos] if pos < len(buf) else -1
    if not (0x90 <= b <= 0x9F or b in (0xDC, 0xDD)):
        raise Malformed("not an array")
    at, _, n = header(buf, pos)
    if n > most:
        raise Malformed(f"an array of {n} items, more than {most}")
    budget = [MAX_VALUES]
    out = []
    for _ in range(n if take is None else min(n, take)):
        stop = _end(buf, at, budget)
        out.append((at, stop))
        at = stop
    return out


def entries(buf: bytes | memoryview, pos: int, most: int) -> list[tuple[int, int, int, int]]:
    """The (key start, key end, value start, value end) of each entry of the map at `pos`."""
    b = buf[pos] if pos < len(buf) else -1
    if not (0x80 <= b <= 0x8F or b in (0xDE, 0xDF)):
        raise Malformed("not a map")
    at, _, n = header(buf, pos)
    if n > 2 * most:
        raise Malformed(f"a map of {n // 2} entries, more than {most}")
    budget = [MAX_VALUES]
    out = []
    for _ in range(n // 2):
        key_end = _end(buf, at, budget)
        value_end = _end(buf, key_end, budget)
        out.append((at, key_end, key_end, value_end))
        at = value_end
    return out
