"""detokd.tokenizer: what Vocab caches about each real tokenizer at start-up."""

from __future__ import annotations

import json

import pytest
from conftest import ALL, vocab

from detokd.tokenizer import _decoder_json


@pytest.mark.parametrize("name", ALL)
def test_decoder_description_is_the_tokenizer_json_one(name: str) -> None:
    v = vocab(name)
    whole = json.loads(v.backend.to_str())["decoder"]
    assert v.decoder == whole
    assert v.decoder is not None and v.decoder_types()


class _NoState:
    """A decoder whose bindings give no pickle state: the whole JSON is parsed instead."""

    def __getstate__(self):
        raise TypeError("no state")


class _Backend:
    def __init__(self, real) -> None:
        self.decoder = _NoState()
        self.to_str = real.to_str


def test_decoder_description_falls_back_to_the_whole_json() -> None:
    real = vocab("mistral_v3").backend
    assert _decoder_json(_Backend(real)) == json.loads(real.to_str())["decoder"]
