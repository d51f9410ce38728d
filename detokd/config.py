"""Every setting in one place: the Config Struct, TOML loading, and CLI overrides.

The Struct is the schema: msgspec rejects unknown keys and wrong types with a
message that names the key, so no setting is validated by hand.
"""

from __future__ import annotations

import tomllib
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from . import zoo

# A ZMQ endpoint detokd can bind or connect.
Address = Annotated[str, Meta(pattern=r"^(tcp|ipc|inproc)://.+")]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # Address detokd binds its PULL socket on; schedulers PUSH-connect to it.
    input: Address = "ipc:///tmp/detokd-input.sock"
    # Worker w receives its requests' text at workers[w] (it binds, detokd connects).
    workers: Annotated[list[Address], Meta(min_length=1)] = msgspec.field(
        default_factory=lambda: ["ipc:///tmp/detokd-worker-0.sock"]
    )
    # Where the scheduler listens for `stopped` messages; none when unset.
    feedback: Address | None = None
    # A folder with tokenizer.json, a tokenizer.json file, or a packaged name.
    tokenizer: str = zoo.DEFAULT
    # Live request states at most; the oldest is evicted (its worker told) beyond.
    max_states: Annotated[int, Meta(ge=1)] = 65536
    # Prompt ids used as context for the first characters. 8 covers every family's
    # need (a leading space, a character cut across the prompt boundary is at most
    # 4 byte tokens) with room to spare, and costs one decode of 8 ids per request.
    max_prompt_tail: Annotated[int, Meta(ge=0, le=4096)] = 8
    log_level: LogLevel = "info"
    # /health and /metrics on this port (127.0.0.1 unless metrics_host says); off when unset.
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] | None = None
    metrics_host: str = "127.0.0.1"
    # /health turns 503 once the loop has not turned for this long.
    health_timeout: Annotated[float, Meta(gt=0)] = 5.0
    # Messages queued per worker before that worker counts as stalled.
    send_hwm: Annotated[int, Meta(ge=1)] = 10000
    # How long shutdown waits for queued messages to leave, in milliseconds.
    linger_ms: Annotated[int, Meta(ge=0)] = 2000
    # "auto": the fastest exact codec for the tokenizer; "window": always the generic one.
    codec: Literal["auto", "window"] = "auto"
    # Enables the control op "debug_stall:<seconds>" that blocks the loop (tests only).
    debug_ops: bool = False


class ConfigError(ValueError):
    """A config that cannot be used; its message is the one line the user sees."""


def load(path: str | None, overrides: dict) -> Config:
    raw: dict = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config {path} is not valid TOML: {exc}") from exc
    raw.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return msgspec.convert(raw, Config)
    except msgspec.ValidationError as exc:
        where = f"config {path}" if path else "settings"
        raise ConfigError(f"{where}: {exc}") from exc


def to_toml(cfg: Config) -> str:
    lines = []
    for key, value in msgspec.structs.asdict(cfg).items():
        if value is None:
            lines.append(f"# {key} =")
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return msgspec.json.encode(v).decode()
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)
