"""What README.md, docs/, the CLI and the environment say of the config keys agrees with
Config itself: every key documented, no stale one, each default as it is."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import msgspec
import msgspec.inspect as mi
import pytest

from detokd import cli
from detokd.cli import build_parser
from detokd.config import CONFIG_ENV, Config, env_name, field_types, from_env, to_toml
from detokd.config import flags as config_flags

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


# --- every key documented once, under the names the CLI and the environment give it

SERVE_ONLY = {"help", "config", "shards", "supervisor_port", "shard_index"}  # serve's flags that are no key
SIZES = {"MiB": 1 << 20, "KiB": 1 << 10}


def readme_keys() -> dict[str, tuple[str, str]]:
    """README's config key table: key -> (flag column, default column)."""
    text = (REPO / "README.md").read_text()
    table = text.split("### Config keys", 1)[1].split("\n### ", 1)[0]
    rows = [[c.strip() for c in line.strip("| ").split("|")] for line in table.splitlines() if line.startswith("| `")]
    return {cells[0].strip("`"): (cells[1], cells[2]) for cells in rows}


def readme_default(text: str) -> object:
    """A default as the table writes it: unset, `word`, 8.0, 64 MiB, false, `[]`."""
    text = text.strip("`")
    if text == "unset":
        return None
    if m := re.fullmatch(r"(\d+) (MiB|KiB)", text):
        return int(m.group(1)) * SIZES[m.group(2)]
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def test_the_readme_table_has_every_key_and_no_other():
    assert set(readme_keys()) == set(Config.__struct_fields__)


@pytest.mark.parametrize("key", Config.__struct_fields__)
def test_the_readme_states_each_keys_default(key):
    default = readme_keys()[key][1]
    if "<dir>" not in default:  # the ipc defaults depend on the machine (`detokd config`)
        assert readme_default(default) == getattr(Config(), key), default


def serve_flags() -> dict[str, str]:
    """`detokd serve`'s flags that set a key: key -> flag."""
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # argparse keeps its subparsers here
    return {a.dest: max(a.option_strings, key=len) for a in serve._actions if a.dest not in SERVE_ONLY}


def test_every_flag_is_a_keys_as_config_declares_it_and_the_readme_names_it():
    declared = {key: f.name for key, f in config_flags().items()}
    flags = serve_flags()
    assert flags == declared
    assert set(cli._overrides(build_parser().parse_args(["serve"]))) == set(declared)
    assert {key: cli.flag(key) for key in flags} == flags
    documented = {key: f for key, (f, _) in readme_keys().items() if f}
    assert {key: f.split()[0].strip("`") for key, f in documented.items()} == declared


def test_a_choice_flag_takes_the_keys_values_and_a_number_flag_a_number():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    actions = {a.dest: a for a in serve._actions}
    for key, t in field_types().items():
        if key in config_flags():
            want = list(t.values) if isinstance(t, mi.LiteralType) else None
            assert sorted(actions[key].choices or []) == sorted(want or []), key
            assert (actions[key].type is int) == isinstance(t, mi.IntType), key


def sample() -> Config:
    """A Config with every optional key set, so each has a value to send through the environment."""
    return msgspec.structs.replace(
        Config(), feedback="ipc:///r/fb.sock", metrics_port=9100, curve_secret_key="/k/d.key_secret",
        curve_clients="/k/clients", curve_feedback_key="/k/s.key", max_rss_mb=4096,
    )


@pytest.mark.parametrize("key", Config.__struct_fields__)
def test_every_key_has_a_variable_that_sets_it(key):
    value = getattr(sample(), key)
    assert value is not None, f"give {key} a value in sample()"
    line = next(line for line in to_toml(sample()).splitlines() if line.startswith(f"{key} = "))
    text = line.split(" = ", 1)[1]
    if isinstance(value, str):
        text = json.loads(text)  # the variable holds the text itself, unquoted
    name = env_name(key)
    assert name != CONFIG_ENV and not name.startswith("DETOKD_SGLANG")  # the names detokd already reads
    assert from_env({name: text}) == {key: value}
