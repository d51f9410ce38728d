"""What README.md and docs/ say of the config keys agrees with Config itself."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from detokd.config import Config

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
UNITS = {"": 1, "s": 1, "ms": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
# A key in backquotes, then in parentheses the number the text quotes for it: "(8 s)",
# "(64 MiB)", "(65,536, oldest evicted)".
QUOTED = re.compile(r"`([a-z_]+)` \(([0-9][0-9,]*(?:\.[0-9]+)?)(?: ?(KiB|MiB|GiB|ms|s)\b)?")


def quoted_defaults() -> list[tuple[str, str, float]]:
    """(where, key, number) for every default a doc quotes next to a Config key."""
    keys = set(Config.__struct_fields__)
    out = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for key, number, unit in QUOTED.findall(line):
                if key in keys:
                    out.append((f"{doc.name}:{n}", key, float(number.replace(",", "")) * UNITS[unit]))
    return out


@pytest.mark.parametrize("where, key, quoted", quoted_defaults(), ids=lambda v: v if isinstance(v, str) else None)
def test_a_default_the_docs_quote_is_the_configs(where, key, quoted):
    assert quoted == getattr(Config(), key), f"{where} quotes {key} as {quoted:g}, its default is {getattr(Config(), key)}"


def test_the_docs_quote_the_shutdown_grace():
    assert any(key == "shutdown_grace_s" for _, key, _ in quoted_defaults())
