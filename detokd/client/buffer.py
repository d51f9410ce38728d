"""What a WorkerClient keeps for rids that have no open stream. Pure Python, no sockets.

Three memories, each a BoundedMap so that rows nobody reads cannot grow memory:

- unclaimed rids: rows that arrived before anyone called stream(rid) (the engine was
  faster than the worker), kept for at most `max_buffered` rids; the oldest rid is
  dropped first and counted in `dropped_rids`;
- abandoned rids: a stream closed (or garbage-collected) before its request ended;
  the late rows of that request are dropped (`dropped_rows`) until its ending row,
  after which the rid may be reused and is buffered like any new one;
- failed rids: a stream ended on an error row, and rows of its request that detokd
  had queued before the failure may still follow it (docs/client.md, "Queues and
  loss"). They are dropped (`stale_rows`) until a row that ends a request (the failed
  one's own finish, queued too, or another error row about it: what follows that is a
  new request's) or until a stream opens for the rid, which is a new request: an engine
  reuses a rid only once the old request has ended for it, and detokd sends the old
  request's rows before any of the new one's.

An error row for a rid that is neither open, buffered, abandoned nor failed is not buffered:
detokd sends errors for rids it cannot place to every worker (`ignored_errors`).
"""

from __future__ import annotations

from typing import Union

from detokd import logs
from detokd.core.bounded import BoundedMap
from detokd.wire.native import EmbeddingRow, OutRow

__all__ = ["Buffer", "Item", "ends"]

log = logs.get(__name__)

Item = Union[OutRow, EmbeddingRow]


def ends(item: Item) -> bool:
    """Whether this row is a request's last: an embedding, a finish or an error."""
    return isinstance(item, EmbeddingRow) or item.finish is not None or item.error is not None


class Buffer:
    """The buffering policy of rids with no reader; `max_buffered` 0 keeps none."""

    def __init__(self, max_buffered: int = 1024) -> None:
        if max_buffered < 0:
            raise ValueError("max_buffered must be >= 0")
        self.max_buffered = max_buffered
        self.unclaimed: BoundedMap[str, list[Item]] = BoundedMap(max(max_buffered, 1))
        self.abandoned: BoundedMap[str, None] = BoundedMap(max(max_buffered, 1))
        self.failed: BoundedMap[str, int] = BoundedMap(max(max_buffered, 1))  # rid -> its stale rows so far
        self.dropped_rids = 0  # unclaimed rids whose buffered rows were dropped
        self.dropped_rows = 0  # rows of abandoned streams
        self.stale_rows = 0  # rows that followed the error row a stream ended on
        self.ignored_errors = 0  # error rows for rids this worker never saw

    def offer(self, item: Item) -> None:
        """A row whose rid has no open stream."""
        rid = item.rid
        if rid in self.abandoned:
            self.dropped_rows += 1
            if ends(item):
                self.abandoned.pop(rid)
            return
        if rid in self.failed:
            self._stale(rid, item)
            return
        rows = self.unclaimed.get(rid)
        if rows is not None:
            rows.append(item)
        elif isinstance(item, OutRow) and item.error is not None:
            self.ignored_errors += 1
        else:
            self.keep(rid, [item])

    def _stale(self, rid: str, item: Item) -> None:
        """A row of a failed rid: dropped; one that ends a request is the failed one's last."""
        seen = self.failed.get(rid) or 0
        if not seen:
            log.info("rows of request %r that follow the error row it failed on are dropped", rid)
        self.stale_rows += 1
        if ends(item):
            self.failed.pop(rid)
        else:
            self.failed.put(rid, seen + 1)

    def claim(self, rid: str) -> list[Item]:
        """A stream opens for `rid`: the rows kept for it, oldest first."""
        self.abandoned.pop(rid)
        self.failed.pop(rid)  # a new request's stream: what comes is its own
        return self.unclaimed.pop(rid) or []

    def keep(self, rid: str, rows: list[Item]) -> None:
        """Buffer `rows` until `rid` is claimed, evicting the oldest unclaimed rid."""
        if self.max_buffered == 0:
            self.dropped_rids += 1
            return
        for old, _ in self.unclaimed.put(rid, rows):
            self.dropped_rids += 1
            log.debug("dropped buffered rows of unclaimed request %r", old)

    def released(self, rid: str, rest: list[Item], finished: bool, failed: bool = False) -> None:
        """A stream of `rid` ended with `rest` still unread. After its request's end
        those rows belong to a new request of the same rid: they wait for a reader.
        Before it, the reader gave up: the request's later rows are dropped. After an
        error row (`failed`), the failed request's rows that follow are dropped."""
        if failed:
            self.failed.put(rid, 0)
            for item in rest:
                self.offer(item)
        elif finished:
            if rest:
                self.keep(rid, rest)
        elif not any(ends(i) for i in rest):
            self.abandoned.put(rid, None)

    def clear(self) -> None:
        self.unclaimed.clear()

    def __len__(self) -> int:
        """Rids with buffered rows."""
        return len(self.unclaimed)
