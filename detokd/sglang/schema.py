"""SGLang's detokenizer IPC, as detokd reads and writes it, built from the installed release.

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
    `build()` makes Structs mirroring the installed classes, field for field in their
    declaration order: the fields detokd reads are typed (READS), every field the
    detokenizer only copies into BatchStrOutput is msgspec.Raw - its encoded
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

`build()` reads the installed release (io_struct's classes: their fields in order, wire
config, the declared types of the fields detokd reads; and how its DetokenizerManager
fills BatchStrOutput, from its source) and raises SchemaMismatch naming the first thing
detokd cannot mirror: a field it reads gone or of another type, a BatchStrOutput field
the detokenizer computes in a way detokd does not, or leaves to its default. Fields
SGLang adds that the detokenizer only copies need nothing of detokd: they are Raw.
`check()` is that build, for the plugin's structural check.
"""

from __future__ import annotations

import ast
import base64
import dataclasses
import inspect
import textwrap
from collections.abc import Mapping
from typing import Any, Optional, Union, cast

import msgspec
from msgspec import Raw
from msgspec.msgpack import Ext

from ..core.records import NIL  # msgpack nil: the encoding of a None field, the default of every optional passthrough
from ..wire import msgpack_scan
from .id_rows import IdRows, ids_of, int64_rows
from .types import EmbeddingBatch, StrBatch, TokenBatch

_EXT_TENSOR = 2

FinishReason = Union[dict[str, Union[str, int, list[int], None]], None]
_B64 = Optional[list[Optional[str]]]


class UnreadBatch(msgspec.Struct):
    """What is left of a BatchTokenIDOutput whose fields do not read as the schema says:
    its rids and HTTP workers, so that each of its requests can still be answered
    (with an abort) instead of never."""

    rids: Union[list[str], None]
    http_worker_ipcs: Union[list[Union[str, None]], None]


_rids = msgspec.msgpack.Decoder(Union[list[str], None])
_ipcs = msgspec.msgpack.Decoder(Union[list[Union[str, None]], None])
_tag = msgspec.msgpack.Decoder(str)
_ints = msgspec.msgpack.Decoder(list[int])


class SchemaMismatch(RuntimeError):
    """The installed SGLang's IPC classes differ from what detokd can speak."""


MIRRORED = ("BatchTokenIDOutput", "BatchStrOutput", "BatchEmbeddingOutput", "FreezeGCReq", "ConfigureLoggingReq")
# The scheduler's to the detokenizer.
_INBOUND = ("BatchTokenIDOutput", "BatchEmbeddingOutput", "FreezeGCReq", "ConfigureLoggingReq")
_BATCH = {"rids": ("Optional[List[str]]", Optional[list[str]]),
          "http_worker_ipcs": ("Optional[List[Optional[str]]]", Optional[list[Optional[str]]])}
_SINGLE = {"rid": ("Optional[str]", Optional[str]), "http_worker_ipc": ("Optional[str]", Optional[str])}
# The fields detokd reads or computes, by class: SGLang's annotation (a field whose type
# changes while its name stays would fail every batch at run time, so the build compares
# it) and the type detokd reads it as. One table for every release: these have not changed
# within the window; every other field is Raw, whatever the release adds.
READS: dict[str, dict[str, tuple[str, Any]]] = {
    "BatchTokenIDOutput": {
        **_BATCH,
        "finished_reasons": ("List[Optional[FinishReasonDict]]", list[FinishReason]),
        "decoded_texts": ("List[str]", list[str]),
        "decode_ids": ("List[array]", list[Ext]),  # array('q') as SGLang's ext 1; read with the codec's ids()
        "read_offsets": ("List[int]", list[int]),
        "skip_special_tokens": ("List[bool]", list[bool]),
        "spaces_between_special_tokens": ("List[bool]", list[bool]),
        "no_stop_trim": ("List[bool]", list[bool]),
        # Output ids so far: read (raw, on demand) when a rid is new to this process, to
        # tell a request's first row from a later one of a request begun before it.
        "completion_tokens": ("List[int]", Raw),
        # Tensors (ext 2); BatchStrOutput carries them base64'd.
        "routed_experts": ("Optional[List[Optional[torch.Tensor]]]", Optional[list[Optional[Ext]]]),
        "indexer_topk": ("Optional[List[Optional[torch.Tensor]]]", Optional[list[Optional[Ext]]]),
    },
    "BatchStrOutput": {
        **_BATCH,
        "finished_reasons": ("List[Optional[FinishReasonDict]]", list[FinishReason]),
        "output_strs": ("List[str]", list[str]),
        "routed_experts": ("Optional[List[Optional[str]]]", _B64),
        "indexer_topk": ("Optional[List[Optional[str]]]", _B64),
        "placeholder_tokens_idx": ("Optional[List[Optional[List[int]]]]", None),
        "placeholder_tokens_val": ("Optional[List[Optional[List[int]]]]", None),
    },
    "BatchEmbeddingOutput": dict(_BATCH),  # returned unchanged by the detokenizer: the received frame is forwarded
    "FreezeGCReq": {**_SINGLE, "gc_threshold": ("Optional[List[int]]", Optional[list[int]])},
    "ConfigureLoggingReq": {**_SINGLE, "log_level": ("Optional[str]", Optional[str])},
}
# Fields detokd reads where the release has them: FreezeGCReq.gc_threshold is 0.5.23's
# (detokd's GC policy does not use it).
OPTIONAL = {("FreezeGCReq", "gc_threshold")}
# The BatchStrOutput fields detokd computes, as SGLang's detokenizer computes them:
# the texts, and the tensors base64'd.
COMPUTES = ("output_strs", "routed_experts", "indexer_topk")


def declared_annotations(cls: type) -> dict[str, str]:
    """A class's field annotations, its bases' first, as source text."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        for name, ann in getattr(klass, "__annotations__", {}).items():
            out[name] = ann if isinstance(ann, str) else getattr(ann, "__name__", repr(ann))
    return out


def field_names(cls: type) -> tuple[str, ...]:
    """A message class's fields in declaration order (a Struct's or a dataclass's)."""
    return tuple(name for name, _ in _fields(cls))


def _fields(cls: type) -> list[tuple[str, bool]]:
    """(name, has a default) of each field of an SGLang message class, in declaration order."""
    if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        return [(f.name, f.required is False) for f in msgspec.structs.fields(cls)]
    if dataclasses.is_dataclass(cls):
        return [(f.name, f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)
                for f in dataclasses.fields(cls)]
    raise SchemaMismatch(f"{getattr(cls, '__name__', cls)!r} is neither a msgspec Struct nor a dataclass")


def _struct(name: str, fields: list[tuple[str, bool]], types: Mapping[str, Any]) -> type:
    """A tagged, array-like Struct of SGLang's wire config with these fields in this order:
    `types`' type where it names one, Raw (its bytes, copied as they are) elsewhere."""
    spec: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for field, has_default in fields:
        kind = types.get(field, Raw)
        if has_default:
            spec.append((field, kind, NIL if kind is Raw else None))
        else:
            spec.append((field, kind))
    return msgspec.defstruct(name, spec, tag=True, kw_only=True, array_like=True, module=__name__)


@dataclasses.dataclass(frozen=True)
class Schema:
    """The installed release's messages as detokd speaks them."""

    version: str  # SGLang's
    structs: dict[str, type]  # by SGLang class name: the msgpack mirrors
    copied: tuple[str, ...]  # BatchStrOutput fields copied from the same-named BatchTokenIDOutput field
    nones: tuple[str, ...]  # BatchStrOutput fields the detokenizer sets to None
    computed: tuple[str, ...]  # BatchStrOutput fields detokd computes (a subset of COMPUTES)
    gc_threshold: bool  # FreezeGCReq carries one

    @property
    def name(self) -> str:
        return f"sglang-{self.version}"


def _check_class(name: str, cls: type) -> list[tuple[str, bool]]:
    """The installed class's fields, once the fields detokd reads are there with the
    annotation detokd reads them by, and the wire config is SGLang's."""
    fields = _fields(cls)
    if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        cfg = cls.__struct_config__
        wire = {"tag": name, "tag_field": "type", "array_like": True, "omit_defaults": False}
        for key, value in wire.items():
            if getattr(cfg, key) != value:
                raise SchemaMismatch(f"{name}: wire config {key}={getattr(cfg, key)!r}, detokd speaks {value!r}")
    names = [f for f, _ in fields]
    declared = declared_annotations(cls)
    for field, (want, _) in READS[name].items():
        if field not in names:
            if (name, field) in OPTIONAL:
                continue
            raise SchemaMismatch(f"{name}: field {field!r}, which detokd reads, is gone from SGLang")
        if declared.get(field) != want:
            raise SchemaMismatch(f"{name}.{field}: SGLang declares {declared.get(field)!r}, detokd reads {want!r}")
    return fields


def _str_output_types(tok_fields: list[str], str_fields: list[str], fills: Mapping[str, str]) -> dict[str, Any]:
    """BatchStrOutput's field types as the installed detokenizer fills each field, or
    SchemaMismatch for a field filled in a way detokd does not."""
    reads = READS["BatchStrOutput"]
    types: dict[str, Any] = {}
    for field in str_fields:
        how = fills.get(field, "default")
        if how == "copy" and field in tok_fields:
            types[field] = reads[field][1] if field in reads else Raw
        elif how == "none":
            types[field] = None
        elif how == "computed" and field in COMPUTES:
            types[field] = reads[field][1]
        else:
            why = {"default": "leaves it to its default", "copy": "copies it from a field BatchTokenIDOutput lacks"}
            raise SchemaMismatch(f"BatchStrOutput: field {field!r} is new to detokd: SGLang's detokenizer "
                                 f"{why.get(how, 'computes it')}, which detokd does not mirror")
    extra = sorted(set(fills) - set(str_fields))
    if extra:
        raise SchemaMismatch(f"BatchStrOutput: SGLang's detokenizer fills field {extra[0]!r}, which the class lacks")
    if fills.get("output_strs") != "computed":
        raise SchemaMismatch("BatchStrOutput: SGLang's detokenizer does not compute output_strs")
    return types


def build(theirs: Mapping[str, type] | None = None, fills: Mapping[str, str] | None = None) -> Schema:
    """The installed release's schema, or SchemaMismatch naming what detokd cannot mirror.

    `theirs` replaces installed io_struct classes by name and `fills` the detokenizer's
    BatchStrOutput filling (for testing against a modified copy, not an edited SGLang)."""
    import sglang
    from sglang.srt.managers import io_struct

    theirs = dict(theirs or {})
    fields = {}
    for name in MIRRORED:
        cls = theirs.get(name) or getattr(io_struct, name, None)
        if cls is None:
            raise SchemaMismatch(f"{name}: no such class in sglang.srt.managers.io_struct")
        fields[name] = _check_class(name, cls)
    fills = dict(installed_fills() if fills is None else fills)
    tok_names = [f for f, _ in fields["BatchTokenIDOutput"]]
    str_types = _str_output_types(tok_names, [f for f, _ in fields["BatchStrOutput"]], fills)
    structs = {name: _struct(name, fields[name], {k: t for k, (_, t) in READS[name].items()})
               for name in MIRRORED if name != "BatchStrOutput"}
    structs["BatchStrOutput"] = _struct("BatchStrOutput", fields["BatchStrOutput"], str_types)
    return Schema(
        version=sglang.__version__,
        structs=structs,
        copied=tuple(f for f, how in fills.items() if how == "copy"),
        nones=tuple(f for f, how in fills.items() if how == "none"),
        computed=tuple(f for f, how in fills.items() if how == "computed"),
        gc_threshold="gc_threshold" in dict(fields["FreezeGCReq"]),
    )


_installed: Schema | None = None


def installed() -> Schema:
    """The installed release's schema, built once per process."""
    global _installed
    if _installed is None:
        _installed = build()
    return _installed


def check(theirs: Mapping[str, type] | None = None, fills: Mapping[str, str] | None = None) -> None:
    """Raise SchemaMismatch unless detokd can speak the installed SGLang's schema (build's
    arguments)."""
    build(theirs, fills)


def __getattr__(name: str) -> Any:
    """The installed release's mirrors by SGLang's class names (schema.BatchTokenIDOutput)."""
    if name in MIRRORED:
        return installed().structs[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    """SGLANG_USE_PICKLE_IPC=0: decode into the release's mirrors, encode BatchStrOutput."""

    name = "msgpack"

    def __init__(self, built: Schema | None = None) -> None:
        s = self.schema = built or installed()
        tok = s.structs["BatchTokenIDOutput"]
        others = [s.structs[n] for n in _INBOUND[1:]]
        # decode_ids left raw, read by the codec itself (each run of rows of one length in
        # numpy views over those bytes, with no Ext object per row).
        self.raw_ids = msgspec.defstruct("BatchTokenIDOutput", [("decode_ids", Raw)], bases=(tok,), kw_only=True,
                                         module=__name__)
        self._str = s.structs["BatchStrOutput"]
        # Each decoded type, by the SGLang class it stands for: the dialect's dispatch.
        self.classes: dict[type, str] = {self.raw_ids: "BatchTokenIDOutput", tok: "BatchTokenIDOutput",
                                         **{s.structs[n]: n for n in _INBOUND[1:]}}
        self._decoder = msgspec.msgpack.Decoder(Union[(self.raw_ids, *others)])
        self._typed = msgspec.msgpack.Decoder(Union[(tok, *others)])
        self._exts = msgspec.msgpack.Decoder(list[Ext])
        self._encoder = msgspec.msgpack.Encoder()

    def decode(self, frame: bytes) -> Any:
        """The message; a batch's decode_ids read (IdRows, or the Ext of each row)."""
        try:
            msg = self._decoder.decode(frame)
            if type(msg) is self.raw_ids:
                tok = cast(TokenBatch, msg)
                rows = int64_rows(tok.decode_ids)
                tok.decode_ids = self._exts.decode(tok.decode_ids) if rows is None else rows
            return msg
        except msgspec.DecodeError:
            return self._typed.decode(frame)  # raises what the schema finds first, as if read in one go

    @staticmethod
    def unread_batch(frame: bytes, most: int) -> UnreadBatch | None:
        """The rids of a BatchTokenIDOutput frame that fails `decode`, or None when even
        they cannot be read (or are more than `most`). The frame is walked, not decoded:
        a field nested deeper than msgspec goes sinks no more than that field. rids and
        http_worker_ipcs are the first fields of every release's batch (its base class's)."""
        try:
            tag, rids, ipcs = msgpack_scan.items(frame, 0, 1024, take=3)
            if _tag.decode(frame[slice(*tag)]) != "BatchTokenIDOutput":
                return None
            if msgpack_scan.header(frame, rids[0])[2] > most:
                return None
            return UnreadBatch(_rids.decode(frame[slice(*rids)]), _ipcs.decode(frame[slice(*ipcs)]))
        except (msgpack_scan.Malformed, msgspec.DecodeError, ValueError):
            return None

    @staticmethod
    def ids(tok: TokenBatch) -> list[list[int]]:
        rows = tok.decode_ids
        return rows if type(rows) is IdRows else ids_of(rows)

    @staticmethod
    def completion_tokens(tok: TokenBatch) -> list[int]:
        return _ints.decode(tok.completion_tokens)

    def str_output(self, tok: TokenBatch, output_strs: list[str]) -> StrBatch:
        s = self.schema
        fields = {name: getattr(tok, name) for name in s.copied}
        fields.update(dict.fromkeys(s.nones), output_strs=output_strs)
        for name in ("routed_experts", "indexer_topk"):
            if name in s.computed:
                fields[name] = _b64_list(getattr(tok, name), tensor_b64)
        return self._str(**fields)

    def encode(self, out: StrBatch | EmbeddingBatch) -> bytes:
        return self._encoder.encode(out)

    def encode_str_output(self, tok: TokenBatch, output_strs: list[str]) -> bytes:
        return self.encode(self.str_output(tok, output_strs))


class PickleCodec:
    """The default form: SGLang's own objects, read by attribute (the names above)."""

    name = "pickle"

    def __init__(self, allow: frozenset[tuple[str, str]] = frozenset(), tensor_bytes: int = 64 << 20,
                 built: Schema | None = None) -> None:
        """`allow`: globals a frame may name beyond the inbound messages and what they
        hold; `tensor_bytes`: what the tensors of one answer may expand to (TensorBudget)."""
        self.tensor_bytes = tensor_bytes
        from sglang.srt.managers import io_struct

        from . import pickled

        self.schema = built or installed()
        self._out = io_struct.BatchStrOutput
        self.classes: dict[type, str] = {getattr(io_struct, n): n for n in _INBOUND}  # see MsgpackCodec
        self._id_rows = pickled.id_rows
        self.decode = pickled.loader(_INBOUND, allow)
        self.encode = pickled.dumps
        self._compact = pickled.compact

    @staticmethod
    def unread_batch(frame: bytes, most: int) -> None:
        """A pickle that does not load has no rids to read."""
        return None

    def ids(self, tok: TokenBatch) -> list[list[int]]:
        return self._id_rows(tok.decode_ids)

    @staticmethod
    def completion_tokens(tok: TokenBatch) -> list[int]:
        return tok.completion_tokens

    def str_output(self, tok: TokenBatch, output_strs: list[str]) -> StrBatch:
        s = self.schema
        fields = {name: getattr(tok, name) for name in s.copied}
        for name in ("time_stats", "output_ids"):
            if name in fields:
                fields[name] = self._compact(name, fields[name])
        fields.update(dict.fromkeys(s.nones), output_strs=output_strs)
        tensors = TensorBudget(self.tensor_bytes)
        for name in ("routed_experts", "indexer_topk"):
            if name in s.computed:
                fields[name] = _b64_list(getattr(tok, name), tensors.b64)
        return self._out(**fields)

    def encode_str_output(self, tok: TokenBatch, output_strs: list[str]) -> bytes:
        return self.encode(self.str_output(tok, output_strs))


def codec(use_pickle: bool | None = None, allow: frozenset[tuple[str, str]] = frozenset(),
          tensor_bytes: int = 64 << 20, built: Schema | None = None) -> MsgpackCodec | PickleCodec:
    """The codec of the running SGLang (its SGLANG_USE_PICKLE_IPC), or the one asked for;
    `allow`, `tensor_bytes`: see PickleCodec (a msgpack tensor's bytes are in the frame);
    `built`: the schema (the installed release's by default)."""
    if use_pickle is None:
        from sglang.srt.environ import envs

        use_pickle = bool(envs.SGLANG_USE_PICKLE_IPC.get())
    return PickleCodec(allow, tensor_bytes, built) if use_pickle else MsgpackCodec(built)


def kind(obj: Any) -> str:
    """The SGLang class name of a decoded frame, in either form."""
    return type(obj).__name__


def has_beam_search(tok: TokenBatch) -> bool:
    """Whether a BatchTokenIDOutput (either form) carries beam results, which SGLang's
    detokenizer decodes into beam_search_output and detokd does not."""
    beams = getattr(tok, "beam_search_output", None)
    if isinstance(beams, Raw):
        return bytes(beams) not in (b"\xc0", b"\x90")  # nil, empty array
    return beams is not None and len(beams) > 0


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
    fills: dict[str, str] = {}
    for kw in calls[0].keywords:
        if kw.arg is None:
            raise SchemaMismatch("DetokenizerManager.handle_batch_token_id_out builds BatchStrOutput with **kwargs")
        v = kw.value
        if isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and v.attr == kw.arg:
            fills[kw.arg] = "copy"
        elif isinstance(v, ast.Constant) and v.value is None:
            fills[kw.arg] = "none"
        else:
            fills[kw.arg] = "computed"
    return fills
