"""How the installed SGLang release's detokenizer behaves where releases differ, detected
from that release's own code rather than from a table of versions.

- The stop-token trim (DetokenizerManager.trim_matched_stop): 0.5.20 and older test
  `if not matched`, so a matched stop token of id 0 (or an empty stop string) trims
  nothing; 0.5.21 and newer test `if matched is None`. Read from its source.
- Tool-call closing tokens it never trims: 0.5.23 keeps the parser's closers
  (sglang.srt.parser.response_template.tool_close_token_ids), which older releases do not
  have; every release keeps gpt-oss's <|call|>. Read from the trim's source; the module
  is imported only where the trim uses it.
- With several HTTP workers, how one batch becomes each worker's messages: 0.5.23's
  detokenizer sends each worker one sub-batch (_send_output_to_tokenizer_workers, unless
  SGLANG_BATCH_TOKENIZER_OUTPUTS is off), older ones one message per row
  (_handle_output_by_index). Read from its multi-HTTP-worker loop's source.

`detect()` imports every SGLang module and symbol detokd's process uses for these, so
a release that lacks one fails here, before detokd tells SGLang it serves.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any, Callable

from .schema import SchemaMismatch
from .types import RoutedBatch

# The releases .ci/run proves detokd on (the differential and plugin tests): whether a
# release was tested cannot be read from its code, so this one table is kept by hand.
WINDOW = ("0.5.20", "0.5.21", "0.5.22", "0.5.23")
GPT_OSS_CALL = 200012  # <|call|>: a stop token SGLang keeps with the gpt-oss tool parser

# Split: (a BatchStrOutput or BatchEmbeddingOutput, the positions of one worker's rows)
# -> [(a message, the positions it holds)], as the release's detokenizer splits.
Split = Callable[[RoutedBatch, list[int]], list[tuple[RoutedBatch, list[int]]]]


@dataclass(frozen=True)
class Release:
    version: str
    falsy_no_match: bool  # `if not matched`: a matched 0 or "" trims nothing
    tool_closers: Callable[[str, Any], Any] | None  # tool_close_token_ids(parser, tokenizer), where trims use it
    gpt_oss_call: bool  # <|call|> is kept with the gpt-oss parser
    split: Split
    split_name: str  # "by worker" or "per row", for the log

    @property
    def tested(self) -> bool:
        return self.version in WINDOW


def _source(fn: Any) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(fn)))


def _names(tree: ast.AST) -> set[str]:
    """Every name and attribute a function's source mentions."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
    return out


def trim_rule(tree: ast.AST) -> bool:
    """Whether trim_matched_stop's test of `matched` is `not matched` (True) or
    `matched is None` (False); SchemaMismatch for any other."""
    for n in ast.walk(tree):
        if not isinstance(n, ast.If):
            continue
        t = n.test
        if isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not) and isinstance(t.operand, ast.Name) \
                and t.operand.id == "matched":
            return True
        if isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "matched" \
                and [type(o) for o in t.ops] == [ast.Is] and isinstance(t.comparators[0], ast.Constant) \
                and t.comparators[0].value is None:
            return False
    raise SchemaMismatch("DetokenizerManager.trim_matched_stop: no `if not matched` or `if matched is None` test")


def _tool_closers(trim: ast.AST) -> Callable | None:
    if "tool_close_token_ids" not in _names(trim):
        return None
    try:
        from sglang.srt.parser.response_template import tool_close_token_ids
    except ImportError as e:
        raise SchemaMismatch(f"SGLang's trim keeps tool-call closers, but {e}") from e
    return tool_close_token_ids


def private(module: Any, name: str, arity: int) -> Callable:
    """A private function of SGLang's that detokd calls with `arity` positional arguments,
    looked up here, at start-up: a release that removes or reshapes it fails detect()
    naming it, instead of an AttributeError or TypeError in the middle of serving."""
    found = getattr(module, name, None)
    if not callable(found):
        raise SchemaMismatch(f"{module.__name__} has no {name}, which detokd calls")
    try:
        inspect.signature(found).bind(*range(arity))
    except (TypeError, ValueError) as e:
        raise SchemaMismatch(f"{module.__name__}.{name} does not take the {arity} arguments detokd passes: {e}") from e
    return found


def _splitter() -> tuple[Split, str]:
    """The release's own split of a batch for one HTTP worker, from its helpers."""
    from sglang.srt.managers import multi_tokenizer_mixin as mt

    by_index = private(mt, "_handle_output_by_index", 2)
    loop = _names(_source(mt.MultiHttpWorkerDetokenizerMixin.multi_http_worker_event_loop))

    def per_row(full: RoutedBatch, indices: list[int]) -> list[tuple[RoutedBatch, list[int]]]:
        return [(by_index(full, i), [i]) for i in indices]

    if "_send_output_to_tokenizer_workers" not in loop:
        if "_handle_output_by_index" not in loop:
            raise SchemaMismatch(
                "SGLang's multi-HTTP-worker detokenizer loop splits batches in a way detokd does not know")
        return per_row, "per row"
    by_indices = private(mt, "_handle_output_by_indices", 2)
    cannot = getattr(mt, "_CannotSplitBatch", None)
    if not (isinstance(cannot, type) and issubclass(cannot, Exception)):
        raise SchemaMismatch(f"{mt.__name__} has no exception _CannotSplitBatch, which detokd catches")
    from sglang.srt.environ import envs

    batched = getattr(envs, "SGLANG_BATCH_TOKENIZER_OUTPUTS", None)
    if batched is not None and not batched.get():
        return per_row, "per row (SGLANG_BATCH_TOKENIZER_OUTPUTS off)"

    def by_worker(full: RoutedBatch, indices: list[int]) -> list[tuple[RoutedBatch, list[int]]]:
        try:
            sub = by_indices(full, indices)
        except cannot:  # a field that cannot be split: one message per row, as SGLang falls back
            return per_row(full, indices)
        ipcs = full.http_worker_ipcs
        sub.http_worker_ipcs = None if ipcs is None else [ipcs[i] for i in indices]
        return [(sub, indices)]

    return by_worker, "by worker"


def detect() -> Release:
    """The installed release's behaviour, or SchemaMismatch naming what detokd cannot
    find in it (every SGLang symbol this needs is imported here)."""
    import sglang
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager

    trim = _source(DetokenizerManager.trim_matched_stop)
    constants = {n.value for n in ast.walk(trim) if isinstance(n, ast.Constant)}
    split, split_name = _splitter()
    return Release(
        version=sglang.__version__,
        falsy_no_match=trim_rule(trim),
        tool_closers=_tool_closers(trim),
        gpt_oss_call=GPT_OSS_CALL in constants,
        split=split,
        split_name=split_name,
    )
