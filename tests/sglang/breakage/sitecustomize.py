"""Test-only: breaks one thing in detokd's SGLang process alone, as a release lacking it
would (tests/sglang/test_fallback.py puts this folder first on PYTHONPATH).

DETOKD_TEST_BREAK:
  module:NAME          importing SGLang's module NAME raises ModuleNotFoundError
  symbol:MODULE:NAME   SGLang's MODULE has no NAME
  field:CLASS:NAME     io_struct's CLASS has one field more, NAME, which SGLang's detokenizer
                       leaves to its default
  vocab:               detokd's id -> token table differs from SGLang's tokenizer in one token

Applied once detokd.sglang.process is imported in a process multiprocessing spawned:
detokd's detokenizer process. SGLang's other processes, and its own detokenizer, keep
SGLang as it is.
"""

import importlib.abc
import importlib.util
import os
import sys

SPEC = os.environ.get("DETOKD_TEST_BREAK", "")
WATCH = "detokd.sglang.process"


class _Missing(importlib.abc.MetaPathFinder):
    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, fullname, path, target=None):
        if fullname == self.name:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def _break() -> None:
    kind, _, what = SPEC.partition(":")
    if kind == "module":
        sys.modules.pop(what, None)
        sys.meta_path.insert(0, _Missing(what))
    elif kind == "symbol":
        module, _, name = what.partition(":")
        delattr(importlib.import_module(module), name)
    elif kind == "field":
        from typing import List, Optional

        import msgspec
        from sglang.srt.managers import io_struct

        cls, _, name = what.partition(":")
        base = getattr(io_struct, cls)
        setattr(io_struct, cls, msgspec.defstruct(cls, [(name, Optional[List[str]], None)], bases=(base,),
                                                  kw_only=True, module=io_struct.__name__))
    elif kind == "vocab":
        from detokd.sglang import vocab

        def altered(v):
            return vocab.fingerprint(v.size, v.hf.all_special_ids, ["<altered>", *list(v.tokens)[1:]])

        vocab.fingerprint_of = altered
    else:
        raise ValueError(f"DETOKD_TEST_BREAK={SPEC!r}")


class _Watch(importlib.abc.MetaPathFinder):
    """Runs _break() right after detokd.sglang.process executes."""

    def find_spec(self, fullname, path, target=None):
        if fullname != WATCH:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _break()

        spec.loader.exec_module = exec_module
        return spec


if SPEC and "--multiprocessing-fork" in sys.argv:
    sys.meta_path.insert(0, _Watch())
