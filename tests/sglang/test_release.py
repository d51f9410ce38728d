"""What detokd detects of the installed release's behaviour, held to that release's own
DetokenizerManager (its trim, its split helpers) rather than to a table of versions."""

from __future__ import annotations

import ast
import textwrap
from types import SimpleNamespace

import pytest
import sglang
from messages import sglang_detokenizer
from messages import tok as tok  # a fixture, re-exported

from detokd.sglang import release
from detokd.sglang.dialect import SglangDialect
from detokd.sglang.schema import SchemaMismatch


def test_the_installed_release_is_detected_and_in_the_tested_window():
    rel = release.detect()
    assert rel.version == sglang.__version__
    assert rel.tested, f"SGLang {rel.version} is not one of {release.WINDOW}: run the suite on a release of the window"


# (matched, ids, no_stop_trim): a stop token of id 0 and an empty stop string are where
# `if not matched` (0.5.20) and `if matched is None` (0.5.21+) part.
TRIMS = [(0, [5, 6, 0], False), (7, [5, 6, 7], False), (7, [5, 6, 7], True), (None, [5, 6], False), ("", [5, 6], False)]


@pytest.mark.parametrize("matched,ids,no_stop_trim", TRIMS)
def test_detokd_trims_a_stop_token_exactly_where_the_installed_detokenizer_does(tok, matched, ids, no_stop_trim):
    reason = {"type": "stop", "matched": matched}
    theirs = sglang_detokenizer(tok).trim_matched_stop(list(ids), reason, no_stop_trim)
    rel = release.detect()
    dialect = SimpleNamespace(falsy_no_match=rel.falsy_no_match, keep_stop_ids=frozenset())
    finish, trim = SglangDialect._finish(dialect, reason, list(ids), no_stop_trim)
    assert (ids[:-1] if trim else ids) == theirs
    if isinstance(matched, str):  # the stop string: trimmed by the core, when SGLang trims it
        assert finish.matched == (matched if matched or not rel.falsy_no_match else None)


def rule(source: str) -> bool:
    return release.trim_rule(ast.parse(textwrap.dedent(source)))


def test_the_trim_rule_is_read_from_the_test_of_matched():
    assert rule("def f(matched):\n    if not matched:\n        return 1\n") is True
    assert rule("def f(matched):\n    if matched is None:\n        return 1\n") is False
    with pytest.raises(SchemaMismatch, match="trim_matched_stop"):
        rule("def f(matched):\n    if matched == -1:\n        return 1\n")


def test_the_split_is_the_one_the_installed_multi_worker_loop_uses():
    """0.5.23's loop sends each HTTP worker one sub-batch; older ones one message per row."""
    import inspect

    from sglang.srt.managers import multi_tokenizer_mixin as mt

    loop = inspect.getsource(mt.MultiHttpWorkerDetokenizerMixin.multi_http_worker_event_loop)
    rel = release.detect()
    assert rel.split_name == ("by worker" if "_send_output_to_tokenizer_workers" in loop else "per row")


def test_tool_call_closers_are_kept_only_where_the_release_keeps_them():
    import inspect

    from sglang.srt.managers.detokenizer_manager import DetokenizerManager

    uses = "tool_close_token_ids" in inspect.getsource(DetokenizerManager.trim_matched_stop)
    assert (release.detect().tool_closers is not None) is uses


def test_a_release_outside_the_window_is_served_with_a_warning_that_it_is_untested(monkeypatch, caplog):
    """Outside the tested window the structural check decides; passed, detokd serves and
    SGLang's log says the release is untested."""
    import logging

    from detokd.sglang import plugin

    monkeypatch.setattr(release, "WINDOW", ("0.0.1",))
    monkeypatch.setattr(plugin, "_announced", False)
    with caplog.at_level(logging.INFO, logger="sglang.srt.plugins"):
        plugin._announce(1, 1)
    (record,) = [r for r in caplog.records if "replaced SGLang's detokenizer" in r.getMessage()]
    assert record.levelname == "WARNING" and "untested" in record.getMessage()
    assert f"SGLang {sglang.__version__}" in record.getMessage()


def test_under_require_a_fallback_is_a_launch_failure_of_one_line(monkeypatch, caplog):
    from detokd.sglang import plugin

    monkeypatch.setenv("DETOKD_SGLANG", "require")
    assert plugin.enabled() and plugin.required()
    with pytest.raises(SystemExit) as exit_:
        plugin.keep_sglangs("SchemaMismatch: a reason")
    message = str(exit_.value)
    assert "\n" not in message and f"SGLang {sglang.__version__}" in message and "a reason" in message
    monkeypatch.setenv("DETOKD_SGLANG", "1")
    plugin.keep_sglangs("SchemaMismatch: a reason")  # a warning, not an exit
    assert [r.levelname for r in caplog.records if "keeping SGLang's own" in r.getMessage()] == ["WARNING"]


def _split_helper() -> str:
    """The private helper of multi_tokenizer_mixin the installed release's split calls."""
    import inspect

    from sglang.srt.managers import multi_tokenizer_mixin as mt

    loop = inspect.getsource(mt.MultiHttpWorkerDetokenizerMixin.multi_http_worker_event_loop)
    return "_handle_output_by_indices" if "_send_output_to_tokenizer_workers" in loop else "_handle_output_by_index"


def test_the_private_split_helpers_detokd_calls_are_there_and_take_what_it_passes():
    """An upgrade that removes or reshapes them fails here and at start-up (detect), not mid-batch."""
    from sglang.srt.managers import multi_tokenizer_mixin as mt

    for name in ("_handle_output_by_index", _split_helper()):
        assert release.private(mt, name, 2) is getattr(mt, name)


@pytest.mark.parametrize("change", ["removed", "reshaped"])
def test_a_release_without_the_private_split_helper_fails_detection_naming_it(monkeypatch, change):
    from sglang.srt.managers import multi_tokenizer_mixin as mt

    name = _split_helper()
    if change == "removed":
        monkeypatch.delattr(mt, name)
    else:
        monkeypatch.setattr(mt, name, lambda output: output)
    with pytest.raises(SchemaMismatch, match=name):
        release.detect()
