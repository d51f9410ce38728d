"""Config (detokd.config): the keys, what check() refuses, and the runtime objects made from them."""

from __future__ import annotations

import dataclasses
import math
import threading

import msgspec
import pytest
import zmq
from utils import config_ranges as ranges
from utils import deepseek

from detokd.config import Config, ConfigError, check, load
from detokd.core.detokenizer import Limits
from detokd.core.stats import Stats
from detokd.delivery import Delivery, RegisterPolicy
from detokd.process import ipc_config
from detokd.server import Server
from detokd.wire.native import NativeDialect


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


# --- ranges: every numeric key, enumerated from Config itself so a new key is covered


NUMERIC = sorted(ranges())
EXTREMES = [math.inf, -math.inf, math.nan, -1, 0, 2**31, 2**63]


def num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def starts(tmp_path, **settings) -> None:
    """A Server on these settings gets through start-up (every socket option set) and
    closes again; the tokenizer is the run's shared one, so this costs a codec build."""
    Server(ipc_config(tmp_path, **settings), NativeDialect.make, vocab=deepseek()).close()


def edges(key: str) -> list:
    """The ends of a key's range. A port's top end is left out: a fixed port may be taken
    on a shared machine, and 0 (any free port) already starts the metrics server."""
    t = ranges()[key]
    ends = [] if t.ge is None else [t.ge]  # a float above 0 has no least value
    return ends if key == "metrics_port" else [*ends, t.le]


def test_every_numeric_key_has_a_finite_range():
    assert NUMERIC and {k for k, t in ranges().items() if t.le is None or (t.ge is None and t.gt is None)} == set()


@pytest.mark.parametrize("value", EXTREMES, ids=repr)
@pytest.mark.parametrize("key", NUMERIC)
def test_a_numeric_key_takes_a_value_and_starts_or_refuses_it_naming_the_key_and_its_range(tmp_path, key, value):
    try:
        load(None, {key: value})
    except ConfigError as exc:
        t, message = ranges()[key], str(exc)
        low = t.ge if t.ge is not None else t.gt
        assert "\n" not in message and key in message, message
        assert f" {num(low)} " in message and f" {num(t.le)}" in message, message  # the range, both ends
        return
    starts(tmp_path, **{key: value})


@pytest.mark.parametrize("key", NUMERIC)
def test_the_ends_of_every_numeric_range_are_accepted_and_start(tmp_path, key):
    for value in edges(key):
        load(None, {key: value})
        starts(tmp_path, **{key: value})


@pytest.mark.parametrize("key, value", [("shutdown_grace_s", math.inf), ("send_hwm", 2**31), ("max_rows", 0)])
def test_a_config_made_in_code_is_range_checked_too(key, value):
    with pytest.raises(ConfigError, match=f"{key} must be"):
        check(Config(**{key: value}))


def test_a_socket_option_zmq_cannot_take_leaves_no_socket_open(tmp_path):
    """setsockopt raises OverflowError, not ZMQError: the sockets made so far are closed
    all the same, or the context's term() would wait for them forever. The traceback is
    kept, with the frames that hold the sockets, as while Server.__init__ cleans up."""
    ctx = zmq.Context()
    with pytest.raises(OverflowError) as failure:
        Delivery(
            ctx, [f"ipc://{tmp_path}/w.sock"], feedback=None, hwm=2**31,
            queue_bytes=0, linger_ms=0, stats=Stats(),
        )
    done = threading.Event()
    threading.Thread(target=lambda: (ctx.term(), done.set()), daemon=True).start()
    assert done.wait(30), "ctx.term() waits on a socket the failed start-up left open"
    assert failure.traceback  # alive until here


def test_every_key_is_read_from_its_variable_as_its_type():
    env = {
        "DETOKD_MAX_STATES": " 1_000 ", "DETOKD_HEALTH_TIMEOUT": "2.5", "DETOKD_REGISTER_ENABLED": "yes",
        "DETOKD_REGISTER_REPLACE": "0", "DETOKD_WORKERS": "ipc:///r/a.sock, ipc:///r/b.sock",
        "DETOKD_REGISTER_ALLOW": '["ipc:///r/*", "tcp://10.0.0.1:*"]', "DETOKD_LOG_LEVEL": "debug",
        "DETOKD_FEEDBACK": "", "DETOKD_METRICS_PORT": "9100",
    }
    cfg = load(None, {}, env)
    assert (cfg.max_states, cfg.health_timeout, cfg.register_enabled, cfg.register_replace) == (1000, 2.5, True, False)
    assert cfg.workers == ["ipc:///r/a.sock", "ipc:///r/b.sock"]
    assert cfg.register_allow == ["ipc:///r/*", "tcp://10.0.0.1:*"]
    assert (cfg.log_level, cfg.feedback, cfg.metrics_port) == ("debug", None, 9100)  # an empty variable is unset


def test_the_environment_is_read_only_when_given(monkeypatch):
    monkeypatch.setenv("DETOKD_MAX_STATES", "3")
    assert load(None, {}) == Config()  # SGLang mode and library callers: no DETOKD_<KEY> reaches them


def test_a_mistyped_variable_is_answered_with_the_one_it_resembles():
    with pytest.raises(ConfigError, match="environment DETOKD_MAX_STATE: no such key; did you mean DETOKD_MAX_STATES"):
        load(None, {}, {"DETOKD_MAX_STATE": "5"})
    others = {"DETOKD_SGLANG": "1", "DETOKD_SGLANG_ROUTER": "1", "DETOKD_ZOO_CACHE": "/z", "DETOKD_SOMETHING_ELSE": "1"}
    assert load(None, {}, others) == Config()  # detokd's other variables, and names far from any key, pass


def test_a_retired_key_starts_with_a_warning_where_an_unknown_one_is_refused(tmp_path, caplog):
    """A config copied from an older configs/default.toml sets `debug_ops`: an upgrade
    must not stop the deployment over it."""
    f = tmp_path / "c.toml"
    f.write_text("debug_ops = false\nmax_states = 10\n")
    with caplog.at_level("WARNING"):
        assert load(str(f), {}).max_states == 10
    assert [r.getMessage() for r in caplog.records if "debug_ops" in r.getMessage()] == [
        f"config {f}: `debug_ops` is no longer read (it only let tests stall the loop): remove it"
    ]
    f.write_text("debug_opz = false\n")
    with pytest.raises(ConfigError, match="unknown key `debug_opz`"):
        load(str(f), {})
