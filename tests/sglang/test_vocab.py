"""detokd.sglang.vocab: in SGLang mode detokd decodes with the tokenizer SGLang's own
detokenizer loads, and refuses one whose tables or decode disagree with it."""

from __future__ import annotations

import pytest
from conftest import ALL, vocab
from models import model_folder

from detokd import zoo
from detokd.sglang.vocab import check, fingerprint_of, sglangs_tokenizer
from detokd.tokenizer import TokenizerError, of


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """SGLang's runtime context for a plain `--model-path DIR` launch of a family's model
    folder, as SGLang's detokenizer process publishes it; returns (server_args, folder)."""
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import prepare_server_args

    def make(name: str):
        d = model_folder(tmp_path_factory.mktemp("models"), name)
        server_args = prepare_server_args(["--model-path", str(d), "--device", "cpu"])
        publish(server_args, role="detokenizer")
        return server_args, d

    return make


@pytest.mark.parametrize("name", ALL)
def test_sglangs_tokenizer_of_every_family_passes_the_check(published, name):
    from sglang.srt.runtime_context import get_serving

    server_args, folder = published(name)
    assert server_args.tokenizer_path is None  # the bug's condition: only SGLang's context knows
    assert get_serving().tokenizer_path == str(folder)
    tokenizer = sglangs_tokenizer(server_args)
    v = of(tokenizer, str(folder))
    assert check(v, tokenizer) == fingerprint_of(v)
    # What detokd loads is what SGLang loaded, not the folder alone: SGLang's loader adds a
    # pad token to tokenizers without one (one more id than the folder's tokenizer has).
    assert v.size == len(tokenizer) >= vocab(name).size


def test_detokds_default_tokenizer_is_refused_for_another_models_tokenizer(published):
    server_args, _ = published("qwen2")
    with pytest.raises(TokenizerError, match="is not SGLang's"):
        check(vocab(zoo.DEFAULT), sglangs_tokenizer(server_args))
