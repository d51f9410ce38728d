"""What the tests of detokd.sglang's IPC share: SGLang batches and decode_ids rows, SGLang's own encoder and detokenizer, a hostile pickle."""

from __future__ import annotations

import pickle
import warnings
from array import array

import numpy as np
import pytest
import torch
from hypothesis import strategies as st

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from sglang.srt.managers import io_struct
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager, LimitedCapacityDict
    from sglang.srt.utils.weight_versions import WeightVersionSpan
    try:
        from sglang.srt.sampling.sampling_mask import SamplingMaskChunk
    except ImportError:  # 0.5.20 sends a sampling mask as lists, beside output_token_sampling_logprobs
        SamplingMaskChunk = None

from conftest import vocab

from detokd.sglang import id_rows


def encode_str_output(codec, tok, output_strs: list[str]) -> bytes:
    """The BatchStrOutput answering `tok` with these texts, as a codec encodes it."""
    return codec.encode(codec.str_output(tok, output_strs))


def sglang_detokenizer(tokenizer) -> DetokenizerManager:
    """SGLang's real DetokenizerManager, without the sockets and server args of __init__."""
    m = object.__new__(DetokenizerManager)
    m.tokenizer = tokenizer
    m.vocab_size = len(tokenizer)
    m.decode_status = LimitedCapacityDict(capacity=1 << 10)
    m.disable_tokenizer_batch_decode = False
    m.is_tool_call_parser_gpt_oss = False
    m.tool_close_token_ids = frozenset()
    return m


def sampling_mask(n: int) -> list:
    if SamplingMaskChunk is None:
        return [[[3, 4]]] + [[]] * (n - 1)
    return [
        SamplingMaskChunk(
            lengths=np.array([2], dtype=np.int32),
            token_ids=np.array([3, 4], dtype=np.int32),
            logprobs=np.array([-0.5, -1.0], dtype=np.float32),
        )
    ] + [None] * (n - 1)


def token_batch(tok, texts: list[str], finished: list, step: int) -> io_struct.BatchTokenIDOutput:
    """A BatchTokenIDOutput with every kind of field the scheduler fills filled (those the
    installed release has)."""
    n = len(texts)
    ids = [array("q", tok.encode(t, add_special_tokens=False)) for t in texts]
    fields = dict(
        rids=[f"r{i}" for i in range(n)],
        http_worker_ipcs=[None] * n,
        finished_reasons=finished,
        decoded_texts=[""] * n,
        decode_ids=ids,
        read_offsets=[0] * n,
        output_ids=[array("q", x) for x in ids],
        skip_special_tokens=[i % 2 == 0 for i in range(n)],
        spaces_between_special_tokens=[True] * n,
        no_stop_trim=[i == 1 for i in range(n)],
        prompt_tokens=[7 + i for i in range(n)],
        reasoning_tokens=[0] * n,
        completion_tokens=[len(x) for x in ids],
        cached_tokens=[i for i in range(n)],
        input_token_logprobs_val=[[-0.5, None]] * n,
        input_token_logprobs_idx=[[3, 4]] * n,
        output_token_logprobs_val=[[-0.25 * step]] * n,
        output_token_logprobs_idx=[[5]] * n,
        input_top_logprobs_val=[[[-0.1, -2.0]]] * n,
        input_top_logprobs_idx=[[[1, 2]]] * n,
        output_top_logprobs_val=[None] * n,
        output_top_logprobs_idx=[None] * n,
        input_token_ids_logprobs_val=None,
        input_token_ids_logprobs_idx=None,
        output_token_ids_logprobs_val=[[[-1.5]]] * n,
        output_token_ids_logprobs_idx=[[[9]]] * n,
        output_token_entropy_val=[0.125] * n,
        output_token_sampling_mask=sampling_mask(n),
        output_token_sampling_logprobs=[[[-0.5, -1.0]]] + [[]] * (n - 1),
        output_hidden_states=[[[0.5, 1.5]]] + [None] * (n - 1),
        routed_experts=[torch.arange(12, dtype=torch.int32).reshape(2, 3, 2)] + [None] * (n - 1),
        indexer_topk=[None] * (n - 1) + [torch.tensor([[7, -1]], dtype=torch.int64)],
        placeholder_tokens_idx=[[0]] * n,
        placeholder_tokens_val=[[4]] * n,
        retraction_counts=[0] * n,
        weight_versions=[[WeightVersionSpan(version="v1", start=0, end=3)]] * n,
        token_steps=[[step]] * n,
        customized_info=io_struct.PickleWrapper(pickle.dumps({"k": [1, 2]})),
        cached_tokens_details=[{"device": 1, "source": "host"}] * n,
        dp_ranks=[0] * n,
        time_stats=io_struct.PickleWrapper(pickle.dumps([{"t": 1.25}] * n)),
        image_tokens=[0] * n,
        spec_correct_drafts_histogram=[[1, 0]] * n,
        input_top_logprobs_val_flat=[np.ones((1, 2), dtype=np.float32)] + [None] * (n - 1),
        input_top_logprobs_idx_flat=[np.zeros((1, 2), dtype=np.int32)] + [None] * (n - 1),
        input_top_logprobs_flat_null_prefix=[1] + [None] * (n - 1),
    )
    has = set(io_struct.BatchTokenIDOutput.__struct_fields__)
    return io_struct.BatchTokenIDOutput(**{k: v for k, v in fields.items() if k in has})


# Shared from here, not from a tests/sglang/conftest.py: one there would replace
# tests/conftest.py as the module `conftest` these tests import vocab from.
@pytest.fixture(scope="module")
def tok():
    return vocab("qwen2").hf


def sglang_wire(obj) -> bytes:
    """The bytes SGLang's msgpack sock_send puts on the socket."""
    return io_struct.msgpack_encode(obj)


def assert_bounds(ids: list[list[int]]) -> None:
    """Rows read as IdRows carry the least and greatest of their ids (lo > hi: none)."""
    if type(ids) is id_rows.IdRows:
        every = [i for row in ids for i in row]
        assert (ids.lo, ids.hi) == ((min(every), max(every)) if every else (0, -1))


# Runs of rows: (ids per row, rows, typecode); a decode step is one long run of one id,
# a start breaks it for a row, speculative decoding's rows differ row by row.
ROW_RUNS = st.lists(st.tuples(st.sampled_from([0, 1, 2, 3, 8, 31, 32, 600]),
                              st.one_of(st.integers(1, 40), st.sampled_from([255, 256, 257, 1100])),
                              st.sampled_from(["q", "q", "q", "l", "i"])), max_size=30)


def arrays_of(runs: list[tuple[int, int, str]], value: int) -> list[array]:
    """The rows of `runs`, their ids spread around `value` (within int64)."""
    ids = []
    for r, (length, repeat, typecode) in enumerate(runs):
        item = min(2**63 - 1, max(-(2**63) + 600, value + r * 7919 - 40000)) if typecode != "i" else value % 2**31
        ids += [array(typecode, [item - j for j in range(length)]) for _ in range(repeat)]
    return ids


class Calls:
    """Pickles as a call of `func(*args)`: what a hostile frame holds."""

    def __init__(self, func, *args) -> None:
        self.reduced = (func, args)

    def __reduce__(self):
        return self.reduced
