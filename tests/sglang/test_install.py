"""detokd installs beside SGLang with a plain `pip install` (no --no-deps) and changes
none of the packages SGLang's environment held: its pinned transformers, tokenizers,
torch and the rest stay as SGLang installed them."""

from __future__ import annotations

import os
from importlib.metadata import distributions, version
from pathlib import Path

import pytest


def before() -> dict[str, str]:
    """`pip freeze` of SGLang's environment before detokd went in (scripts/test-sglang.sh)."""
    path = os.environ.get("DETOKD_SGLANG_FREEZE")
    if not path:
        pytest.fail("DETOKD_SGLANG_FREEZE is unset: run the SGLang suite through scripts/test-sglang.sh")
    pins = {}
    for line in Path(path).read_text().splitlines():
        name, sep, ver = line.partition("==")
        if sep:
            pins[name.lower().replace("_", "-")] = ver
    return pins


def test_sglangs_pins_survive_a_plain_install_of_detokd():
    pins = before()
    for name in ("sglang", "transformers", "tokenizers", "torch"):
        assert name in pins, name
    now = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in distributions()}
    changed = {name: (was, now.get(name)) for name, was in pins.items() if now.get(name) != was}
    assert changed == {}


def test_detokd_is_installed_with_its_own_requirements_met():
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    for spec in requires("detokd"):
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        assert req.specifier.contains(version(req.name), prereleases=True), spec
