"""The SGLang tests' side of the replay harness (detokrig.sglang_replay): requests with
flags, stops, aborts and the payloads a model adds, the scheduler's other messages, SGLang's prompt context, a
comparable view of a message field, what a TokenizerManager accumulates, and the
outputs cut into each detokenizer's stream."""

from __future__ import annotations

import dataclasses
import pickle
from array import array
from typing import Any, Iterable, Literal, Sequence

import msgspec

from detokrig.sglang_replay import (
    Encoding,
    Scripted,
    SglangDetokenizerUnderTest,
    _accumulator,
    append_output_logprobs,
    ipc_encoding,
    route,
)


class Request(Scripted, frozen=True, kw_only=True):
    """A request with what else a scheduler's request carries: sampling flags, a finish
    other than by length, and steps with fake, deterministic passthrough payloads of the
    right shapes, which a detokenizer must forward untouched."""

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    # matched_token: the last output id is the stop token; matched_str: `stop_str` ends
    # the generated text; abort: FINISH_ABORT(abort_message).
    finish: Literal["length", "matched_token", "matched_str", "abort"] = "length"
    stop_str: str | None = None
    abort_message: str | None = None
    logprobs: bool = False
    hidden_states: bool = False
    routed_experts: bool = False
    indexer_topk: bool = False
    customized_info: bool = False
    cached_tokens: int = 0

    def sampling(self) -> dict:
        return dict(skip_special_tokens=self.skip_special_tokens, no_stop_trim=self.no_stop_trim,
                    spaces_between_special_tokens=self.spaces_between_special_tokens,
                    stop=[self.stop_str] if self.stop_str else None)

    def finish_reason(self) -> Any:
        from sglang.srt.managers import schedule_batch as sb

        if self.finish == "length":
            return super().finish_reason()
        if self.finish == "matched_token":
            return sb.FINISH_MATCHED_TOKEN(matched=self.output_ids[-1])
        if self.finish == "matched_str":
            if not self.stop_str:
                raise ValueError(f"{self.rid}: matched_str needs stop_str")
            return sb.FINISH_MATCHED_STR(matched=self.stop_str)
        return sb.FINISH_ABORT(message=self.abort_message)

    def req_kwargs(self) -> dict:
        return dict(return_logprob=self.logprobs, top_logprobs_num=2 if self.logprobs else 0,
                    return_hidden_states=self.hidden_states, return_routed_experts=self.routed_experts,
                    return_indexer_topk=self.indexer_topk)

    def started(self, req: Any) -> None:
        req.cached_tokens = self.cached_tokens
        if self.logprobs:
            n = len(self.prompt_ids)
            lp = req.logprob
            lp.input_token_logprobs_val = [None] + [-(i + 1) / 16 for i in range(n - 1)]
            lp.input_token_logprobs_idx = list(self.prompt_ids)
            lp.input_top_logprobs_val = [None] + [[-0.5, -1.5] for _ in range(n - 1)]
            lp.input_top_logprobs_idx = [None] + [[t, 0] for t in self.prompt_ids[1:]]
            lp.input_token_ids_logprobs_val = [None] * n
            lp.input_token_ids_logprobs_idx = [None] * n
            for name in ("val", "idx"):
                for kind in ("token", "top", "token_ids"):
                    setattr(lp, f"output_{kind}_logprobs_{name}", [])
        if self.customized_info:
            req.customized_info = {"probe": []}

    def stepped(self, req: Any, base: int) -> None:
        import torch

        if self.logprobs:
            append_output_logprobs(req.logprob, req.output_ids[base:], base)
        for pos in range(base, len(req.output_ids)):
            if self.hidden_states:
                req.hidden_states.append([pos + 0.25, -pos - 0.5, 1.0])
            if self.customized_info:
                req.customized_info["probe"].append(f"{self.rid}:{pos}")
        total = len(self.prompt_ids) + len(req.output_ids)
        if self.routed_experts:
            req.routed_experts = torch.arange(total * 2 * 2, dtype=torch.int32).reshape(total, 2, 2)
        if self.indexer_topk:
            req.indexer_topk = torch.arange(total * 3, dtype=torch.int32).reshape(total, 3) * 7


class Accumulated(msgspec.Struct, kw_only=True):
    """What a TokenizerManager assembles for one request lifetime."""

    rid: str
    text: str = ""
    finished_reason: dict | None = None
    output_ids: list[int] = msgspec.field(default_factory=list)


def accumulate(outputs: Iterable[Any]) -> dict[str, list[Accumulated]]:
    """Per rid, its lifetimes in order (a finished rid that appears again starts anew)."""
    result: dict[str, list[Accumulated]] = {}
    for out in outputs:
        if type(out).__name__ != "BatchStrOutput":
            continue
        for i, rid in enumerate(out.rids):
            lives = result.setdefault(rid, [])
            if not lives or lives[-1].finished_reason is not None:
                lives.append(Accumulated(rid=rid))
            acc = lives[-1]
            acc.text += out.output_strs[i]
            if out.output_ids is not None and i < len(out.output_ids):
                acc.output_ids.extend(out.output_ids[i])
            acc.finished_reason = out.finished_reasons[i]
    return result


def health_check_batch(*, encoding: Encoding) -> Any:
    """An idle batch: what the scheduler streams with nothing to report (to_payload with
    is_idle_batch=True), the shape the health check's empty output comes from."""
    with ipc_encoding(encoding):
        return _accumulator([]).to_payload(dp_rank=0, is_idle_batch=True)


def embedding_batch(
    rids: Sequence[str],
    *,
    encoding: Encoding,
    http_worker_ipcs: Sequence[str | None] = (None,),
    workers: Sequence[int] | None = None,
    dims: int = 4,
) -> Any:
    """A BatchEmbeddingOutput shaped as OutputStreamer._stream_output_embedding builds it."""
    import torch
    from sglang.srt.managers.io_struct import BatchEmbeddingOutput, wrap_as_pickle

    workers = list(workers) if workers is not None else [0] * len(rids)
    n = len(rids)
    with ipc_encoding(encoding):
        return BatchEmbeddingOutput(
            rids=list(rids),
            http_worker_ipcs=[http_worker_ipcs[w] for w in workers],
            time_stats=wrap_as_pickle([None] * n),
            finished_reasons=[{"type": "length", "length": 1} for _ in rids],
            embeddings=[[(i + 1) / (j + 2) for j in range(dims)] for i in range(n)],
            prompt_tokens=[3 + i for i in range(n)],
            cached_tokens=[0] * n,
            cached_tokens_details=[None] * n,
            placeholder_tokens_idx=None,
            placeholder_tokens_val=None,
            retraction_counts=[0] * n,
            pooled_hidden_states=[torch.full((dims,), float(i)) for i in range(n)],
        )


def prompt_context(messages: Iterable[Any]) -> dict[str, list[int]]:
    """Per rid, the ids SGLang decodes before the output: the first row's
    decode_ids[:read_offset] (the last <= 5 prompt ids, INIT_INCREMENTAL_DETOKENIZATION_OFFSET)."""
    ctx: dict[str, list[int]] = {}
    live: set[str] = set()
    for m in messages:
        if type(m).__name__ != "BatchTokenIDOutput":
            continue
        for i, rid in enumerate(m.rids):
            if rid not in live:
                ctx.setdefault(rid, list(m.decode_ids[i][: m.read_offsets[i]]))
                live.add(rid)
            if m.finished_reasons[i] is not None:
                live.discard(rid)
    return ctx


def plain(obj: Any) -> Any:
    """A comparable, encoding-neutral view of a message field (arrays and tensors as
    (dtype, shape, bytes), structs and dataclasses as dicts of their fields)."""
    import numpy as np
    import torch

    if isinstance(obj, (str, int, float, bool, type(None), bytes)):
        return obj
    if isinstance(obj, array):
        return list(obj)
    if isinstance(obj, torch.Tensor):
        return ("tensor", str(obj.dtype), tuple(obj.shape), obj.cpu().contiguous().numpy().tobytes())
    if isinstance(obj, np.ndarray):
        return ("ndarray", obj.dtype.str, obj.shape, obj.tobytes())
    if isinstance(obj, (list, tuple)):
        return [plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, msgspec.Struct):
        return {"__type__": type(obj).__name__, **{f: plain(getattr(obj, f)) for f in obj.__struct_fields__}}
    if dataclasses.is_dataclass(obj):
        # Compare what crosses a process boundary: SchedulerReqTimeStats ships only its
        # __getstate__ subset. A received copy cannot be pickled again (it lacks the
        # dropped attributes), so it is taken as it is.
        try:
            obj = pickle.loads(pickle.dumps(obj))
        except Exception:
            pass
        # Tracing / metrics handles have no value semantics; their type is what matters.
        fields = {k: plain(v) if _is_value(v) else type(v).__name__ for k, v in sorted(vars(obj).items())}
        return {"__type__": type(obj).__name__, **fields}
    return type(obj).__name__


def _is_value(v: Any) -> bool:
    import numpy as np
    import torch

    return isinstance(v, (str, int, float, bool, type(None), bytes, list, tuple, dict, array, torch.Tensor, np.ndarray))


def streams(proc: SglangDetokenizerUnderTest, received: list[list[Any]]) -> list[list[Any]]:
    """`received` cut into streams whose order is the detokenizers' own: per receiver,
    one per detokenizer (the one SGLang's router gives the message's rows), then the
    messages with no rows, which the router sends to every detokenizer. With one
    detokenizer, `received` itself."""
    if proc.detokenizers == 1:
        return received
    out = []
    for got in received:
        cut: list[list[Any]] = [[] for _ in range(proc.detokenizers + 1)]
        for msg in got:
            rids = getattr(msg, "rids", None) or []
            ipcs = getattr(msg, "http_worker_ipcs", None) or [None] * len(rids)
            picked = {route(ipc, rid, proc.detokenizers) for ipc, rid in zip(ipcs, rids, strict=True)}
            if len(picked) > 1:
                raise AssertionError(f"one output holds rows of detokenizers {sorted(picked)}: {list(msg.rids)}")
            cut[picked.pop() if picked else -1].append(msg)
        out.extend(cut)
    return out
