"""The SGLang messages detokd reads, as the attributes it reads of them.

Either form of a message matches: SGLang's own class (pickle IPC) or the msgspec
mirror schema.py builds for the installed release (msgpack IPC). Both are built at run
time from the release, so these Protocols name what detokd relies on, and schema.py's
READS table checks the same fields against the release's annotations at start-up.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeAlias

# A finish reason as SGLang's to_json() spells it ({"type": "stop", "matched": ...}), or
# None while the request runs.
FinishReason: TypeAlias = dict[str, Any] | None


class RoutedBatch(Protocol):
    """A batch's rows, by request, and the HTTP worker (TokenizerManager) of each."""

    rids: list[str] | None
    http_worker_ipcs: list[str | None] | None


class TokenBatch(RoutedBatch, Protocol):
    """BatchTokenIDOutput: one scheduler step's new ids of each request."""

    finished_reasons: list[FinishReason]
    decode_ids: Any  # array('q') rows (pickle), their Ext or IdRows (msgpack): read by a codec's ids()
    read_offsets: list[int]
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    no_stop_trim: list[bool]
    completion_tokens: Any  # a list of ints (pickle), its raw bytes (msgpack): read by a codec's completion_tokens()


class EmbeddingBatch(RoutedBatch, Protocol):
    """BatchEmbeddingOutput: forwarded to each request's HTTP worker as it came."""


class StrBatch(RoutedBatch, Protocol):
    """BatchStrOutput as detokd builds it: the texts and finish reasons it writes per row."""

    finished_reasons: list[FinishReason]
    output_strs: list[str]


class FreezeGCReq(Protocol):
    """Freeze the collector: its kind alone is read (detokd's GC policy, not its fields)."""


class ConfigureLoggingReq(Protocol):
    log_level: str | None


Message: TypeAlias = TokenBatch | EmbeddingBatch | FreezeGCReq | ConfigureLoggingReq
