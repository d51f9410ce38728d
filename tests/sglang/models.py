"""The SGLang tests' model folders and plugin entry point: the rig's
(detokrig.sglang_frontend), with `plugin_path` as a fixture."""

from __future__ import annotations

from pathlib import Path

import pytest

from detokrig import ROOT  # noqa: F401  (re-exported for the tests)
from detokrig.sglang_frontend import entry_points, eos_of, model_folder, plugin_dist  # noqa: F401


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> Path:
    """A dist-info declaring this worktree's entry point (detokrig.sglang_frontend.plugin_dist)."""
    return plugin_dist(tmp_path_factory.mktemp("dist"))
