"""detokd.wire.dialect: both dialects are what the loop asks for, method by method."""

from __future__ import annotations

import inspect

import pytest

from detokd.sglang.dialect import SglangDialect
from detokd.wire.dialect import Dialect
from detokd.wire.native import NativeDialect

METHODS = [name for name, value in vars(Dialect).items() if inspect.isfunction(value) and not name.startswith("__")]


def test_the_protocol_is_handle_and_the_stall_policy():
    assert sorted(METHODS) == ["encode_loose", "handle", "stalled"]


@pytest.mark.parametrize("dialect", [NativeDialect, SglangDialect])
def test_each_dialect_implements_every_method_with_its_parameters(dialect):
    assert isinstance(dialect.name, str)
    for name in METHODS:
        want = [p for p in inspect.signature(getattr(Dialect, name)).parameters if p != "self"]
        got = [p for p in inspect.signature(getattr(dialect, name)).parameters if p != "self"]
        assert got == want, (dialect.__name__, name)
