"""SGLang 0.5.23's detokenizer IPC, as detokd reads and writes it.

SGLang's scheduler sends the detokenizer BatchTokenIDOutput (and BatchEmbeddingOutput,
FreezeGCReq, ConfigureLoggingReq); the detokenizer sends the TokenizerManager a
BatchStrOutput. Both ends use io_struct.sock_send / sock_recv, whose form is fixed at
import time by SGLANG_USE_PICKLE_IPC (default: on, i.e. pickle).

msgpack form (SGLANG_USE_PICKLE_IPC=0)
    Every message class is a msgspec Struct with tag=True, array_like=True and
    omit_defaults off, so a frame is the msgpack array ``[ClassName, f1, f2, ...]`` holding
    every field in declaration order (the base-class fields rids, http_worker_ipcs - or
    rid, http_worker_ipc - come first). Nested values: array.array is ext 1, torch.Tensor
    ext 2, np.ndarray ext 3; each ext payload is a big-endian u32 n, n bytes of msgpack
    metadata (the typecode; [shape, dtype, device]; [shape, dtype]) and the raw
    native-endian item bytes. Dicts (finished_reasons, cached_tokens_details) are msgpack
    maps; opaque objects (time_stats, customized_info) are nested PickleWrapper structs
    ``["PickleWrapper", <bin: pickle bytes>]``; beam_search_output, weight_versions and
    the other nested structs are array-like lists too.
    The Structs below mirror those classes: the fields detokd reads are typed, every
    field the detokenizer only copies into BatchStrOutput is msgspec.Raw - its encoded
    bytes, never turned into Python objects and written back verbatim, so SGLang's own
    decoder sees exactly the values its scheduler sent. Tensors the detokenizer turns
    into base64 (routed_experts, indexer_topk) are read as msgpack Ext and base64'd from
    the raw bytes of the payload, without torch.

pickle form (the default)
    send_pyobj(obj, protocol=HIGHEST_PROTOCOL) / recv_pyobj. A Struct pickles as
    ``msgspec._utils.rebuild(cls, {field: value})``, with every nested value a full
    Python object (array.array, torch.Tensor, SGLang's time-stats objects); pickle is a
    stack machine, so no field can be skipped or read lazily, and the classes must be
    importable. The cheapest exact way is therefore the one SGLang pays itself:
    pickle.loads the frame (detokd runs inside SGLang's environment when the plugin
    launches it, so the classes import), read the same attribute names the msgpack
    Structs type (decode_ids elements are array.array here, ext 1 in msgpack: both read by
    the codec's ids()), build SGLang's own
    BatchStrOutput from the computed fields plus *references* to the received objects
    (no copies), and pickle.dumps it with HIGHEST_PROTOCOL. A custom Unpickler mapping
    the message class to a lighter one saves nothing: the nested objects dominate and
    still have to be built. One of them is the exception: each row's time stats, whose
    Python __setstate__ / __getstate__ were half of the round trip (detokd.sglang.pickled
    skips them where SGLang's round trip leaves the state as it is).

In both forms a frame the detokenizer returns unchanged (BatchEmbeddingOutput) is best
forwarded as the received bytes: decoding them gives the object SGLang would re-encode.

`check()` compares these Structs against the installed SGLang (names and order of every
mirrored class's fields, the declared types of the fields detokd reads, the wire config,
and which BatchStrOutput fields the installed detokenizer copies, computes or clears) and
raises SchemaMismatch naming the first difference.
"""

from __future__ import annotations

import ast
import base64
import dataclasses
import inspect
import textwrap
from collections.abc import Mapping
from typing import Any, Union, get_args

import msgspec
from msgspec import Raw
from msgspec.msgpack import Ext

from ..wire import msgpack_scan
from .id_rows import IdRows, ids_of, int64_rows

SCHEMA = "sglang-0.5.23"

# msgpack nil: the encoding of a None field, the default of every optional passthrough.
NIL = Raw(b"\xc0")
_EXT_TENSOR = 2

FinishReason = Union[dict[str, Union[str, int, list[int], None]], None]


class SchemaMismatch(RuntimeError):
    """The installed SGLang's IPC classes differ from the ones detokd speaks."""


class _Batch(msgspec.Struct, tag=True, kw_only=True, array_like=True):
    rids: Union[list[str], None] = None
    http_worker_ipcs: Union[list[Union[str, None]], None] = None


class _Single(msgspec.Struct, tag=True, kw_only=True, array_like=True):
    rid: Union[str, None] = None
    http_worker_ipc: Union[str, None] = None


class BatchTokenIDOutput(_Batch, kw_only=True):
    finished_reasons: list[FinishReason]
    decoded_texts: list[str]
    decode_ids: list[Ext]  # array('q') as SGLang's ext 1; read them with the codec's ids()
    read_offsets: list[int]
    output_ids: Raw
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    no_stop_trim: list[bool]
    prompt_tokens: Raw
    reasoning_tokens: Raw
    completion_tokens: Raw
    cached_tokens: Raw
    input_token_logprobs_val: Raw
    input_token_logprobs_idx: Raw
    output_token_logprobs_val: Raw
    output_token_logprobs_idx: Raw
    input_top_logprobs_val: Raw
    input_top_logprobs_idx: Raw
    output_top_logprobs_val: Raw
    output_top_logprobs_idx: Raw
    input_token_ids_logprobs_val: Raw
    input_token_ids_logprobs_idx: Raw
    output_token_ids_logprobs_val: Raw
    output_token_ids_logprobs_idx: Raw
    output_token_entropy_val: Raw
    output_token_sampling_mask: Raw
    output_hidden_states: Raw
    # Tensors (ext 2); BatchStrOutput carries them base64'd.
    routed_experts: Union[list[Union[Ext, None]], None]
    indexer_topk: Union[list[Union[Ext, None]], None]
    placeholder_tokens_idx: Raw
    placeholder_tokens_val: Raw
    retraction_counts: Raw = NIL
    # Not nil when the batch carries beam-search results (see has_beam_search).
    beam_search_output: Raw = NIL
    weight_versions: Raw = NIL
    token_steps: Raw = NIL
    customized_info: Raw = NIL
    cached_tokens_details: Raw = NIL
    dp_ranks: Raw = NIL
    time_stats: Raw = NIL
    image_tokens: Raw = NIL
    audio_tokens: Raw = NIL
    video_tokens: Raw = NIL
    spec_verify_ct: Raw = NIL
    spec_num_correct_drafts: Raw = NIL
    spec_num_block_accept_tokens: Raw = NIL
    spec_num_cap_tokens: Raw = NIL
    spec_correct_drafts_histogram: Raw = NIL
    spec_cap_lens_histogram: Raw = NIL
    input_top_logprobs_val_flat: Raw = NIL
    input_top_logprobs_idx_flat: Raw = NIL
    input_top_logprobs_flat_null_prefix: Raw = NIL


class BatchStrOutput(_Batch, kw_only=True):
    finished_reasons: list[FinishReason]
    output_strs: list[str]
    output_ids: Raw
    prompt_tokens: Raw
    completion_tokens: Raw
    reasoning_tokens: Raw
    cached_tokens: Raw
    input_token_logprobs_val: Raw
    input_token_logprobs_idx: Raw
    output_token_logprobs_val: Raw
    output_token_logprobs_idx: Raw
    input_top_logprobs_val: Raw
    input_top_logprobs_idx: Raw
    output_top_logprobs_val: Raw
    output_top_logprobs_idx: Raw
    input_token_ids_logprobs_val: Raw
    input_token_ids_logprobs_idx: Raw
    output_token_ids_logprobs_val: Raw
    output_token_ids_logprobs_idx: Raw
    output_token_entropy_val: Raw
    output_token_sampling_mask: Raw
    output_hidden_states: Raw
    routed_experts: Union[list[Union[str, None]], None]
    indexer_topk: Union[list[Union[str, None]], None]
    placeholder_tokens_idx: None
    placeholder_tokens_val: None
    retraction_counts: Raw = NIL
    beam_search_output: Raw = NIL
    weight_versions: Raw = NIL
    token_steps: Raw = NIL
    customized_info: Raw = NIL
    cached_tokens_details: Raw = NIL
    dp_ranks: Raw = NIL
    time_stats: Raw = NIL
    image_tokens: Raw = NIL
    audio_tokens: Raw = NIL
    video_tokens: Raw = NIL
    spec_verify_ct: Raw = NIL
    spec_num_correct_drafts: Raw = NIL
    spec_num_block_accept_tokens: Raw = NIL
    spec_num_cap_tokens: Raw = NIL
    spec_correct_drafts_histogram: Raw = NIL
    spec_cap_lens_histogram: Raw = NIL
    input_top_logprobs_val_flat: Raw = NIL
    input_top_logprobs_idx_flat: Raw = NIL
    input_top_logprobs_flat_null_prefix: Raw = NIL


class BatchEmbeddingOutput(_Batch, kw_only=True):
    # Returned unchanged by the detokenizer: forward the received frame.
    finished_reasons: Raw
    embeddings: Raw
    prompt_tokens: Raw
    cached_tokens: Raw
    placeholder_tokens_idx: Raw
    placeholder_tokens_val: Raw
    retraction_counts: Raw = NIL
    cached_tokens_details: Raw = NIL
    time_stats: Raw = NIL
    pooled_hidden_states: Raw = NIL


class FreezeGCReq(_Single, kw_only=True):
    gc_threshold: Union[list[int], None] = None


class ConfigureLoggingReq(_Single, kw_only=True):
    log_requests: Raw = NIL
    log_requests_level: Raw = NIL
    log_requests_format: Raw = NIL
    log_level: Union[str, None] = None
    dump_requests_folder: Raw = NIL
    dump_requests_threshold: Raw = NIL
    crash_dump_folder: Raw = NIL
    dump_requests_exclude_meta_keys: Raw = NIL


Inbound = Union[BatchTokenIDOutput, BatchEmbeddingOutput, FreezeGCReq, ConfigureLoggingReq]

# What MsgpackCodec decodes a batch as: decode_ids left raw, read by the codec itself
# (each run of rows of one length in numpy views over those bytes, with no Ext object per row).
RawIdsBatch = msgspec.defstruct(
    "BatchTokenIDOutput", [("decode_ids", Raw)], bases=(BatchTokenIDOutput,), kw_only=True, module=__name__,
)
_RawIdsInbound = Union[RawIdsBatch, BatchEmbeddingOutput, FreezeGCReq, ConfigureLoggingReq]



class UnreadBatch(msgspec.Struct):
    """What is left of a BatchTokenIDOutput whose fields do not read as the schema says:
    its rids and HTTP workers, so that each of its requests can still be answered
    (with an abort) instead of never."""

    rids: Union[list[str], None]
    http_worker_ipcs: Union[list[Union[str, None]], None]


_rids = msgspec.msgpack.Decoder(Union[list[str], None])
_ipcs = msgspec.msgpack.Decoder(Union[list[Union[str, None]], None])
_tag = msgspec.msgpack.Decoder(str)
MIRRORED = (BatchTokenIDOutput, BatchStrOutput, BatchEmbeddingOutput, FreezeGCReq, ConfigureLoggingReq)

# SGLang 0.5.23's annotation of every field the mirrors type (the fields detokd reads or
# computes; a Raw field is copied whatever it holds): a field whose type changes while its
# name stays would fail every batch at run time, so the check compares these too.
ANNOTATIONS = {
    "BatchTokenIDOutput": {
        "rids": "Optional[List[str]]", "http_worker_ipcs": "Optional[List[Optional[str]]]",
        "finished_reasons": "List[Optional[FinishReasonDict]]", "decoded_texts": "List[str]",
        "decode_ids": "List[array]", "read_offsets": "List[int]", "skip_special_tokens": "List[bool]",
        "spaces_between_special_tokens": "List[bool]", "no_stop_trim": "List[bool]",
        "routed_experts": "Optional[List[Optional[torch.Tensor]]]", "indexer_topk": "Optional[List[Optional[torch.Tensor]]]",
    },
    "BatchStrOutput": {
        "rids": "Optional[List[str]]", "http_worker_ipcs": "Optional[List[Optional[str]]]",
        "finished_reasons": "List[Optional[FinishReasonDict]]", "output_strs": "List[str]",
        "routed_experts": "Optional[List[Optional[str]]]", "indexer_topk": "Optional[List[Optional[str]]]",
        "placeholder_tokens_idx": "Optional[List[Optional[List[int]]]]",
        "placeholder_tokens_val": "Optional[List[Optional[List[int]]]]",
    },
    "BatchEmbeddingOutput": {"rids": "Optional[List[str]]", "http_worker_ipcs": "Optional[List[Optional[str]]]"},
    "FreezeGCReq": {"rid": "Optional[str]", "http_worker_ipc": "Optional[str]", "gc_threshold": "Optional[List[int]]"},
    "ConfigureLoggingReq": {"rid": "Optional[str]", "http_worker_ipc": "Optional[str]", "log_level": "Optional[str]"},
}


def typed_fields(ours: type) -> list[str]:
    """The fields a mirror types: every one but the Raw passthroughs."""
    return [f.name for f in msgspec.structs.fields(ours) if f.type is not Raw]


def annotations(cls: type) -> dict[str, str]:
    """A class's field annotations, its bases' first, as source text."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        for name, ann in getattr(klass, "__annotations__", {}).items():
            out[name] = ann if isinstance(ann, str) else getattr(ann, "__name__", repr(ann))
    return out

# How the detokenizer fills each BatchStrOutput field: "copy" (the same-named
# BatchTokenIDOutput field, as is), "none", or "computed" (output_strs, base64 tensors).
FILLS: dict[str, str] = {
    name: ("computed" if name in ("output_strs", "routed_experts", "indexer_topk")
           else "none" if name in ("placeholder_tokens_idx", "placeholder_tokens_val")
           else "copy")
    for name in BatchStrOutput.__struct_fields__
}
COPIED = tuple(name for name, how in FILLS.items() if how == "copy")


def tensor_b64(ext: Ext) -> str:
    """base64 of a tensor ext's raw item bytes: SGLang's b64encode(t.numpy().tobytes())."""
    if ext.code != _EXT_TENSOR:
        raise msgspec.ValidationError(f"expected a tensor (ext {_EXT_TENSOR}), got ext {ext.code}")
    data = memoryview(ext.data)
    n = int.from_bytes(data[:4], "big")
    return base64.b64encode(data[4 + n :]).decode("ascii")


class TensorBudget:
    """The bytes the tensors of one answer may expand to. A pickled tensor is a view:
    a stride of 0 makes one stored element any number of elements, and a frame may name
    one tensor many times, each costing its full size once base64'd. Beyond the budget
    (max_frame_bytes) nothing is materialised: the answer cannot be built."""

    def __init__(self, nbytes: int) -> None:
        self.left = nbytes

    def b64(self, t: Any) -> str:
        nbytes = t.numel() * t.element_size()
        if nbytes > self.left:
            raise ValueError(f"the batch's tensors expand past max_frame_bytes ({nbytes} bytes more, {self.left} left)")
        self.left -= nbytes
        return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _b64_list(items: Any, one) -> Any:
    if items is None:
        return None
    return [None if t is None else one(t) for t in items]


class MsgpackCodec:
    """SGLANG_USE_PICKLE_IPC=0: decode into the Structs above, encode BatchStrOutput."""

    name = "msgpack"

    def __init__(self) -> None:
        self._decoder = msgspec.msgpack.Decoder(_RawIdsInbound)
        self._typed = msgspec.msgpack.Decoder(Inbound)
        self._exts = msgspec.msgpack.Decoder(list[Ext])
        self._encoder = msgspec.msgpack.Encoder()

    def decode(self, frame: bytes) -> Inbound:
        """The message; a batch's decode_ids read (IdRows, or the Ext of each row)."""
        try:
            msg = self._decoder.decode(frame)
            if type(msg) is RawIdsBatch:
                rows = int64_rows(msg.decode_ids)
                msg.decode_ids = self._exts.decode(msg.decode_ids) if rows is None else rows
            return msg
        except msgspec.DecodeError:
            return self._typed.decode(frame)  # raises what the schema finds first, as if read in one go

    @staticmethod
    def unread_batch(frame: bytes, most: int) -> UnreadBatch | None:
        """The rids of a BatchTokenIDOutput frame that fails `decode`, or None when even
        they cannot be read (or are more than `most`). The frame is walked, not decoded:
        a field nested deeper than msgspec goes sinks no more than that field."""
        try:
            tag, rids, ipcs = msgpack_scan.items(frame, 0, 1024, take=3)
            if _tag.decode(frame[slice(*tag)]) != BatchTokenIDOutput.__name__:
                return None
            if msgpack_scan.header(frame, rids[0])[2] > most:
                return None
            return UnreadBatch(_rids.decode(frame[slice(*rids)]), _ipcs.decode(frame[slice(*ipcs)]))
        except (msgpack_scan.Malformed, msgspec.DecodeError, ValueError):
            return None

    @staticmethod
    def ids(tok: BatchTokenIDOutput) -> list[list[int]]:
        rows = tok.decode_ids
        return rows if type(rows) is IdRows else ids_of(rows)

    def str_output(self, tok: BatchTokenIDOutput, output_strs: list[str]) -> BatchStrOutput:
        return BatchStrOutput(
            **{name: getattr(tok, name) for name in COPIED},
            output_strs=output_strs,
            routed_experts=_b64_list(tok.routed_experts, tensor_b64),
            indexer_topk=_b64_list(tok.indexer_topk, tensor_b64),
            placeholder_tokens_idx=None,
            placeholder_tokens_val=None,
        )

    def encode(self, out: BatchStrOutput) -> bytes:
        return self._encoder.encode(out)

    def encode_str_output(self, tok: BatchTokenIDOutput, output_strs: list[str]) -> bytes:
        return self.encode(self.str_output(tok, output_strs))


class PickleCodec:
    """The default form: SGLang's own objects, read by attribute (the names above)."""

    name = "pickle"

    def __init__(self, allow: frozenset[tuple[str, str]] = frozenset(), tensor_bytes: int = 64 << 20) -> None:
        """`allow`: globals a frame may name beyond the inbound messages and what they
        hold; `tensor_bytes`: what the tensors of one answer may expand to (TensorBudget)."""
        self.tensor_bytes = tensor_bytes
        from sglang.srt.managers import io_struct

        from . import pickled

        self._out = io_struct.BatchStrOutput
        self._id_rows = pickled.id_rows
        self.decode = pickled.loader([kind.__name__ for kind in get_args(Inbound)], allow)
        self.encode = pickled.dumps
        self._compact = pickled.compact

    @staticmethod
    def unread_batch(frame: bytes, most: int) -> None:
        """A pickle that does not load has no rids to read."""
        return None

    def ids(self, tok: Any) -> list[list[int]]:
        return self._id_rows(tok.decode_ids)

    def str_output(self, tok: Any, output_strs: list[str]) -> Any:
        fields = {name: getattr(tok, name) for name in COPIED}
        for name in ("time_stats", "output_ids"):
            fields[name] = self._compact(name, fields[name])
        tensors = TensorBudget(self.tensor_bytes)
        return self._out(
            **fields,
            output_strs=output_strs,
            routed_experts=_b64_list(tok.routed_experts, tensors.b64),
            indexer_topk=_b64_list(tok.indexer_topk, tensors.b64),
            placeholder_tokens_idx=None,
            placeholder_tokens_val=None,
        )

    def encode_str_output(self, tok: Any, output_strs: list[str]) -> bytes:
        return self.encode(self.str_output(tok, output_strs))


def codec(use_pickle: bool | None = None, allow: frozenset[tuple[str, str]] = frozenset(),
          tensor_bytes: int = 64 << 20) -> MsgpackCodec | PickleCodec:
    """The codec of the running SGLang (its SGLANG_USE_PICKLE_IPC), or the one asked for;
    `allow`, `tensor_bytes`: see PickleCodec (a msgpack tensor's bytes are in the frame)."""
    if use_pickle is None:
        from sglang.srt.environ import envs

        use_pickle = bool(envs.SGLANG_USE_PICKLE_IPC.get())
    return PickleCodec(allow, tensor_bytes) if use_pickle else MsgpackCodec()


def kind(obj: Any) -> str:
    """The SGLang class name of a decoded frame, in either form."""
    return type(obj).__name__


def has_beam_search(tok: Any) -> bool:
    """Whether a BatchTokenIDOutput (either form) carries beam results, which SGLang's
    detokenizer decodes into beam_search_output and detokd does not."""
    beams = tok.beam_search_output
    if isinstance(beams, Raw):
        return bytes(beams) not in (b"\xc0", b"\x90")  # nil, empty array
    return beams is not None and len(beams) > 0


# ---------------------------------------------------------------- the schema check


def field_names(cls: type) -> tuple[str, ...]:
    """A message class's fields in declaration order (a Struct's or a dataclass's)."""
    return _field_names(cls)


def _field_names(cls: type) -> tuple[str, ...]:
    if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        return tuple(cls.__struct_fields__)
    if dataclasses.is_dataclass(cls):
        return tuple(f.name for f in dataclasses.fields(cls))
    raise SchemaMismatch(f"{getattr(cls, '__name__', cls)!r} is neither a msgspec Struct nor a dataclass")


def _first_difference(ours: tuple[str, ...], theirs: tuple[str, ...]) -> str:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            if b not in ours:
                return f"field {b!r} (position {i}) is new in SGLang; detokd has {a!r} there"
            if a not in theirs:
                return f"field {a!r} (position {i}) is gone from SGLang; SGLang has {b!r} there"
            return f"field {b!r} moved to position {i}; detokd has {a!r} there"
    if len(theirs) > len(ours):
        return f"field {theirs[len(ours)]!r} (position {len(ours)}) is new in SGLang"
    return f"field {ours[len(theirs)]!r} (position {len(theirs)}) is gone from SGLang"


def installed_fills() -> dict[str, str]:
    """How the installed DetokenizerManager fills BatchStrOutput, read from its source:
    `name=recv_obj.name` is a copy, `name=None` is none, anything else is computed."""
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager

    tree = ast.parse(textwrap.dedent(inspect.getsource(DetokenizerManager.handle_batch_token_id_out)))
    calls = [
        n for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "BatchStrOutput"
    ]
    if len(calls) != 1:
        raise SchemaMismatch(f"DetokenizerManager.handle_batch_token_id_out builds BatchStrOutput {len(calls)} times")
    fills = {}
    for kw in calls[0].keywords:
        v = kw.value
        if isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and v.attr == kw.arg:
            fills[kw.arg] = "copy"
        elif isinstance(v, ast.Constant) and v.value is None:
            fills[kw.arg] = "none"
        else:
            fills[kw.arg] = "computed"
    return fills


def check(theirs: Mapping[str, type] | None = None, fills: Mapping[str, str] | None = None) -> None:
    """Raise SchemaMismatch unless the installed SGLang speaks this schema.

    `theirs` replaces installed io_struct classes by name and `fills` the detokenizer's
    BatchStrOutput filling (for testing against a modified copy, not an edited SGLang)."""
    from sglang.srt.managers import io_struct

    theirs = dict(theirs or {})
    for ours in MIRRORED:
        name = ours.__name__
        cls = theirs.get(name) or getattr(io_struct, name, None)
        if cls is None:
            raise SchemaMismatch(f"{name}: no such class in sglang.srt.managers.io_struct")
        a, b = _field_names(ours), _field_names(cls)
        if a != b:
            raise SchemaMismatch(f"{name}: {_first_difference(a, b)}")
        if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
            cfg, mine = cls.__struct_config__, ours.__struct_config__
            for key in ("tag", "tag_field", "array_like", "omit_defaults"):
                if getattr(cfg, key) != getattr(mine, key):
                    raise SchemaMismatch(
                        f"{name}: wire config {key}={getattr(cfg, key)!r}, detokd speaks {getattr(mine, key)!r}"
                    )
        declared = annotations(cls)
        for field, want in ANNOTATIONS[name].items():
            if declared.get(field) != want:
                raise SchemaMismatch(f"{name}.{field}: SGLang declares {declared.get(field)!r}, detokd reads {want!r}")
    fills = dict(installed_fills() if fills is None else fills)
    for field, how in FILLS.items():
        got = fills.get(field, "default")
        if got != how:
            raise SchemaMismatch(
                f"BatchStrOutput: field {field!r} is filled as {got!r} by SGLang's detokenizer, detokd fills it as {how!r}"
            )
    extra = sorted(set(fills) - set(FILLS))
    if extra:
        raise SchemaMismatch(f"BatchStrOutput: SGLang's detokenizer fills unknown field {extra[0]!r}")
