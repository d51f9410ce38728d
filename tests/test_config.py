"""Config (detokd.config): the keys, what check() refuses, and the runtime objects made from them."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from detokd.config import Config, ConfigError, check, load
from detokd.core.detokenizer import Limits
from detokd.delivery import RegisterPolicy


def test_every_core_limit_is_a_key_with_the_cores_default():
    for f in dataclasses.fields(Limits):
        assert getattr(Config(), "max_" + f.name) == f.default, f.name


def test_limits_carries_each_key_to_its_field():
    values = {"max_" + f.name: 1000 + k for k, f in enumerate(dataclasses.fields(Limits))}
    limits = Config(**values).limits()
    assert {"max_" + f.name: getattr(limits, f.name) for f in dataclasses.fields(Limits)} == values


def test_the_register_policy_is_made_from_the_register_keys():
    cfg = Config(register_enabled=True, register_allow=["ipc:///run/w*"], register_replace=True, register_max=3)
    assert RegisterPolicy.of(cfg, curve=False) == RegisterPolicy(True, ("ipc:///run/w*",), True, 3, tcp_needs_curve=False)
    assert RegisterPolicy.of(cfg, curve=True).tcp_needs_curve
    plain = msgspec.structs.replace(cfg, curve_plaintext=["register"])
    assert not RegisterPolicy.of(plain, curve=True).tcp_needs_curve


@pytest.mark.parametrize(
    "settings, named",
    [
        ({"register_enabled": True}, "register_allow"),
        ({"curve_clients": ["/k.pub"]}, "curve_secret_key"),
        ({"workers": ["ipc:///tmp/w0"], "curve_secret_key": "/k", "curve_worker_keys": ["/a", "/b"]}, "2 keys for 1 workers"),
        ({"workers": ["tcp://127.0.0.1:5000"], "curve_secret_key": "/k"}, "curve_worker_keys[0]"),
    ],
)
def test_keys_that_only_make_sense_together_are_refused_naming_what_is_missing(settings, named):
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        check(Config(**settings))


def test_a_bad_value_is_refused_naming_the_key(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("max_states = -1\n")
    with pytest.raises(ConfigError, match="max_states"):
        load(str(f), {})
