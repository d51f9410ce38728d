"""The fuzz run's tokenizer workers: what detokd sends each, checked as it comes."""

from __future__ import annotations

import collections

import msgspec
import zmq

from ..sink import Sink


class Worker(Sink):
    """Keeps the rows of honest ("h-") requests and the fences; of the others only
    counts (errors by kind, hostile rows that got text), so its memory stays small."""

    def __init__(self, ctx: zmq.Context, index: int, address: str) -> None:
        self.index = index
        self.honest: dict[str, list[dict]] = collections.defaultdict(list)
        self.fences: set[str] = set()
        self.errors: collections.Counter = collections.Counter()
        self.messages = 0
        self.rows = 0
        self.problems: list[str] = []
        self.hostile_text = 0  # rows of "x-" rids that carried text: never allowed
        super().__init__(ctx, [address])

    def read(self, frame: bytes) -> dict:
        return msgspec.msgpack.decode(frame)

    def keep(self, msg: dict) -> None:
        self.messages += 1
        if msg.get("type") != "text":
            self.problems.append(f"worker {self.index}: a {msg.get('type')!r} message")
            return
        for row in msg["rows"]:
            self.rows += 1
            rid = row["rid"]
            if row["error"] is not None:
                self.errors[row["error"]] += 1
            if rid.startswith("h-"):
                self.honest[rid].append(row)
            elif rid.startswith("fence-"):
                self.fences.add(rid)
            elif rid.startswith("x-") and row["text"]:
                self.hostile_text += 1

    def ended(self, rid: str) -> bool:
        """An honest request's last row arrived: a finish, or an error."""
        rows = self.honest.get(rid, ())
        return bool(rows) and rows[-1]["finish"] is not None or any(x["error"] for x in rows)
