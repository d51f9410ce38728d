"""Every setting in one place: the Config Struct, TOML loading, the environment
(DETOKD_<KEY>), and CLI overrides.

The Struct is the schema: its field types carry every range, msgspec rejects unknown
keys, wrong types and values out of range, and load() words each refusal as one line
naming the key, where its value came from and what the key takes. No setting is
validated by hand.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import tomllib
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Literal

import msgspec
import msgspec.inspect as mi
from msgspec import Meta

from . import logs, zoo
from .core.detokenizer import Limits

# A ZMQ endpoint detokd can bind or connect.
Address = Annotated[str, Meta(pattern=r"^(tcp|ipc|inproc)://.+")]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]

# Every numeric key's range, in one place: Config's fields take only these types, and
# check() and the error messages read the ranges back from them. Ints that reach
# setsockopt fit its C types (SNDHWM and LINGER are C ints, MAXMSGSIZE an int64); a
# duration is finite and at most a day (a timer's timeout must fit the platform's time_t).
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
DAY_S = 86400.0
# A count or a size of at least one: caps on what one peer's frame may make detokd hold
# (docs/protocol.md, "too_large"), live states, megabytes.
Cap = Annotated[int, Meta(ge=1, le=INT64_MAX)]
Size = Annotated[int, Meta(ge=0, le=INT64_MAX)]
Port = Annotated[int, Meta(ge=0, le=65535)]
PromptTail = Annotated[int, Meta(ge=0, le=4096)]
Hwm = Annotated[int, Meta(ge=1, le=INT32_MAX)]
Millis = Annotated[int, Meta(ge=0, le=INT32_MAX)]
Seconds = Annotated[float, Meta(gt=0, le=DAY_S)]
# A socket that may stay in plaintext while CURVE is on (curve_plaintext).
PlaintextSocket = Annotated[str, Meta(pattern=r"^(worker\.(0|[1-9][0-9]*)|feedback|register)$")]


@dataclasses.dataclass(frozen=True)
class Flag:
    """A key's `detokd serve` flag, declared on its field (`flag(...)`) and read back by
    flags(): the CLI builds its arguments, its overrides and each shard's command line
    from these, so a key with a flag is written once, here."""

    name: str  # --max-states; a list key's flag is repeated, once per item
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None  # a choice key's values, from its Literal
    type: Callable[[str], object] = str  # int for an integer key; else the text itself
    repeat: bool = False  # a list key: the flag once per item
    switch: bool = False  # a bool key: the flag alone sets it true


def flag(help: str, metavar: str | None = None, name: str | None = None) -> Meta:
    """The Meta that gives a key a flag: `--<key>` with dashes unless `name` says."""
    return Meta(extra={"flag": (name, help, metavar)})


def runtime_dir() -> str:
    """The private folder of the default ipc sockets: $XDG_RUNTIME_DIR/detokd (a per-user
    tmpfs the session manager made 0700), else /tmp/detokd-<uid>. A fixed /tmp path
    could be created first by anyone on the machine (detokd.sockets checks the folder)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isabs(base):
        return os.path.join(base, "detokd")
    return f"/tmp/detokd-{os.getuid()}"


def default_address(name: str) -> str:
    return f"ipc://{runtime_dir()}/{name}.sock"


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # Address detokd binds its PULL socket on; schedulers PUSH-connect to it.
    input: Annotated[
        Address, flag("address to bind the PULL socket for schedulers (tcp://, ipc://)", "ADDR")
    ] = msgspec.field(default_factory=lambda: default_address("input"))
    # Worker w receives its requests' text at workers[w] (it binds, detokd connects).
    workers: Annotated[
        list[Address], Meta(min_length=1), flag("a worker's address; repeat for workers 0, 1, ...", "ADDR", "--worker")
    ] = msgspec.field(
        default_factory=lambda: [default_address("worker-0")]
    )
    # Where the scheduler listens for `stopped` messages; none when unset.
    feedback: Annotated[Address | None, flag("the scheduler's address for `stopped` messages", "ADDR")] = None
    # A folder with tokenizer.json, a tokenizer.json file, or a packaged name.
    tokenizer: Annotated[
        str, flag(f"tokenizer folder, tokenizer.json, or packaged name; default {zoo.DEFAULT}", "SPEC")
    ] = zoo.DEFAULT
    # Live request states at most; the oldest is evicted (its worker told) beyond.
    max_states: Annotated[Cap, flag("live request states at most (oldest evicted beyond)", "N")] = 65536
    # Prompt ids used as context for the first characters. 8 covers every family's
    # need (a leading space, a character cut across the prompt boundary is at most
    # 4 byte tokens) with room to spare, and costs one decode of 8 ids per request.
    max_prompt_tail: Annotated[PromptTail, flag("prompt ids used as context for the first characters", "N")] = 8
    log_level: Annotated[LogLevel, flag("the least severe records logged")] = "info"
    # "text": a line per record, its time zoned; "json": one JSON object a line, for a
    # log shipper (docs/deploy.md, "Logs").
    log_format: Annotated[Literal["text", "json"], flag("text lines, or one JSON object a line")] = "text"
    # /health and /metrics on this port (127.0.0.1 unless metrics_host says); off when unset.
    metrics_port: Annotated[
        Port | None, flag("serve /livez, /readyz, /health and /metrics on this port", "PORT")
    ] = None
    metrics_host: str = "127.0.0.1"
    # /health turns 503 once the loop has not turned for this long.
    health_timeout: Seconds = 5.0
    # A worker's queue: ZMQ's, of send_hwm messages, and behind it a backlog of at most
    # send_queue_bytes; a message that finds both full is lost and its requests fail
    # ("worker_stalled"). ZMQ counts messages only, so the bytes are bounded here.
    send_hwm: Hwm = 16
    send_queue_bytes: Size = 64 * 1024 * 1024
    # How long shutdown waits for queued messages to leave, in milliseconds.
    linger_ms: Millis = 2000
    # "auto": the fastest exact codec for the tokenizer; "window": always the generic one.
    codec: Literal["auto", "window"] = "auto"
    # While a character is split across ids, the text before it: "char" sends every whole
    # character at once; "word" sends it as SGLang's detokenizer does, up to its last
    # space or a CJK ideograph (SGLang mode's setting: an engine stop string whose start
    # the engine missed beside a split character then leaks no further than with SGLang).
    release: Literal["char", "word"] = "char"
    # After the first SIGTERM/SIGINT/SIGHUP the process ends within this many seconds, whatever
    # the loop is doing (below a container runtime's 10 s before SIGKILL).
    shutdown_grace_s: Seconds = 8.0
    # Serve from a forked decoding process, started again within a second when it dies
    # (an OOM kill, a bug): the process that loaded the tokenizer supervises it
    # (docs/deploy.md, "Restarts"). Shards are always restarted by their supervisor.
    restart: Annotated[bool, flag("serve from a decoding process that is restarted when it dies")] = False

    # --- `register` (docs/protocol.md): off unless enabled; then only addresses matching
    # one of register_allow (fnmatch globs), at most register_max workers added at run
    # time, and no existing worker moved unless register_replace.
    register_enabled: bool = False
    register_allow: list[str] = []
    register_replace: bool = False
    register_max: Size = 16

    # --- CURVE (docs/security.md): key files as zmq.auth.create_certificates writes them.
    # detokd's own key pair (the .key_secret file): the input becomes a CURVE server.
    curve_secret_key: str | None = None
    # A folder of client public keys (.key files) allowed on the input; unset: any
    # client that knows detokd's public key.
    curve_clients: str | None = None
    # Worker w's public key file (same order as workers): detokd connects to it with CURVE.
    curve_worker_keys: list[str] = []
    # The scheduler's feedback socket's public key file.
    curve_feedback_key: str | None = None
    # With CURVE on, every tcp socket uses it or detokd does not start; these are the
    # deliberate exceptions, each logged at start: "worker.<w>", "feedback", and
    # "register" (tcp workers added by `register`, whose key no message can bring).
    curve_plaintext: list[PlaintextSocket] = []

    # --- memory caps on what peers send (docs/protocol.md "too_large")
    # Bigger inbound messages are never read: ZMQ drops the sender's connection.
    max_frame_bytes: Cap = 64 * 1024 * 1024
    # A tokens frame with more rows is dropped whole (a counted bad frame).
    # (The numbers are the core's own defaults, detokd.core.detokenizer.Limits.)
    max_rows: Cap = Limits.rows
    # One frame's work: its ids (an id is a byte or more on the wire, its text up to a
    # long token's), and the stop-string characters of the automata its starts build
    # (a stop list seen before costs nothing). A row past either gets "too_large".
    max_frame_ids: Cap = Limits.frame_ids
    max_frame_stop_chars: Cap = Limits.frame_stop_chars
    # Per row: ids, rid characters, meta bytes; per start: prompt_tail ids as sent,
    # stop strings and their total characters. Beyond, the request gets "too_large".
    max_row_ids: Cap = Limits.row_ids
    max_rid_len: Cap = Limits.rid_len
    max_meta_bytes: Cap = Limits.meta_bytes
    max_wire_prompt_tail: Cap = Limits.wire_prompt_tail
    max_stop_strings: Cap = Limits.stop_strings
    max_stop_chars: Cap = Limits.stop_chars
    # Bytes of stop automata alive at once (cached, or held by live requests): a start
    # with a new stop list beyond it gets "overloaded" (unused cached ones go first).
    max_stop_bytes: Cap = Limits.stop_bytes
    # Bytes of text a stream=false request holds until its finishing row (its strs as
    # Python stores them, 1-4 bytes a character, and ~57 a row); beyond, "too_large".
    max_held_text_bytes: Cap = Limits.held_text_bytes
    # Above this resident size new requests are refused ("overloaded"), and so is a live
    # request's held text that grows (stream=false); off when unset.
    max_rss_mb: Cap | None = None

    def limits(self) -> Limits:
        """The core's caps: each Limits field from its key, max_<field>."""
        return Limits(**{f.name: getattr(self, "max_" + f.name) for f in dataclasses.fields(Limits)})


class ConfigError(ValueError):
    """A config that cannot be used; its message is the one line the user sees."""


ENV_PREFIX = "DETOKD_"  # DETOKD_<KEY> sets a key; DETOKD_CONFIG names the TOML file
CONFIG_ENV = "DETOKD_CONFIG"
TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
# detokd's variables that set no key (prefixes): never taken for a mistyped key's.
OTHER_ENV = (CONFIG_ENV, "DETOKD_SGLANG", "DETOKD_ZOO_CACHE")


def env_name(key: str) -> str:
    return ENV_PREFIX + key.upper()


def load(
    path: str | None, overrides: dict, env: Mapping[str, str] | None = None, flag: Callable[[str], str] | None = None,
) -> Config:
    """The file's keys, then `env`'s DETOKD_<KEY> variables (with `env`, DETOKD_CONFIG
    names the file when `path` does not), then the `overrides` that are not None; an
    error names where its value came from: the file, the variable, or `flag(key)`."""
    where = "settings"
    if path is None and env is not None and env.get(CONFIG_ENV):
        path, where = env[CONFIG_ENV], f"config {env[CONFIG_ENV]} ({CONFIG_ENV})"
    elif path is not None:
        where = f"config {path}"
    raw = _read(path, where)
    _refuse_unknown(raw, where)
    origin = dict.fromkeys(raw, where)
    for key, value in (from_env(env) if env is not None else {}).items():
        raw[key], origin[key] = value, f"environment {env_name(key)}"
    for key, value in overrides.items():
        if value is not None:
            raw[key], origin[key] = value, flag(key) if flag else where
    try:
        cfg = msgspec.convert(raw, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(exc, raw, origin, where)) from exc
    check(cfg, where)
    return cfg


def _read(path: str | None, where: str) -> dict:
    if path is None:
        return {}
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read {where}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where} is not valid TOML: {exc}") from exc


def from_env(env: Mapping[str, str]) -> dict[str, object]:
    """Every key a DETOKD_<KEY> variable sets, parsed by the key's type (an empty
    variable is unset); msgspec then checks the values as it checks a file's."""
    _refuse_mistyped(env)
    out = {}
    for key, t in field_types().items():
        text = env.get(env_name(key), "").strip()
        if text:
            out[key] = _parse_env(key, t, text)
    return out


def _refuse_mistyped(env: Mapping[str, str]) -> None:
    """A DETOKD_ variable a letter or two from a key's: a typo, which would otherwise be
    ignored in silence. Names far from every key may be another program's, and pass."""
    names = [env_name(key) for key in field_types()]
    for name in env:
        if name.startswith(ENV_PREFIX) and name not in names and not name.startswith(OTHER_ENV):
            close = difflib.get_close_matches(name, names, n=1, cutoff=0.85)
            if close:
                raise ConfigError(f"environment {name}: no such key; did you mean {close[0]}?")


def _parse_env(key: str, t: mi.Type, text: str) -> object:
    """A variable's text as the key's type: true/false (1/0, yes/no, on/off), a number,
    a list as a TOML array or comma-separated, else the text itself."""
    name = env_name(key)
    if isinstance(t, mi.BoolType):
        if text.lower() in TRUE + FALSE:
            return text.lower() in TRUE
        raise ConfigError(f"environment {name}: {key} must be true or false, not {text!r}")
    if isinstance(t, (mi.IntType, mi.FloatType)):
        try:
            return int(text) if isinstance(t, mi.IntType) else float(text)
        except ValueError:
            raise ConfigError(f"environment {name}: {key} must be {expected(key)}, not {text!r}") from None
    if isinstance(t, mi.ListType):
        if not text.startswith("["):
            return [item.strip() for item in text.split(",") if item.strip()]
        try:
            return tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"environment {name}: {key} is not a TOML array: {exc}") from None
    return text


# Keys detokd read once and reads no more: a file that still sets one (copied from an
# older configs/default.toml) starts, with a warning, rather than failing an upgrade.
RETIRED = {"debug_ops": "it only let tests stall the loop"}


def _drop_retired(raw: dict, where: str) -> None:
    for key in RETIRED.keys() & raw.keys():
        del raw[key]
        logs.get(__name__).warning("%s: `%s` is no longer read (%s): remove it", where, key, RETIRED[key])


def _refuse_unknown(raw: dict, where: str) -> None:
    """An unknown key, with the known one it most resembles: a typo is the usual cause."""
    _drop_retired(raw, where)
    for key in raw:
        if key not in field_types():
            close = difflib.get_close_matches(key, field_types(), n=1)
            hint = f"; did you mean `{close[0]}`?" if close else " (`detokd config` prints every key)"
            raise ConfigError(f"{where}: unknown key `{key}`{hint}")


def _fields() -> tuple[mi.Field, ...]:
    """Config's fields as msgspec.inspect sees them."""
    info = mi.type_info(Config)
    if not isinstance(info, mi.StructType):
        raise TypeError(f"Config inspects as {type(info).__name__}, not a Struct")
    return info.fields


@functools.cache
def field_types() -> dict[str, mi.Type]:
    """Each key's type as msgspec sees it, an optional one's without its None."""
    out = {}
    for f in _fields():
        t = f.type.type if isinstance(f.type, mi.Metadata) else f.type
        if isinstance(t, mi.UnionType):
            t = next(u for u in t.types if not isinstance(u, mi.NoneType))
        out[f.name] = t
    return out


@functools.cache
def flags() -> dict[str, Flag]:
    """The keys that have a `detokd serve` flag, in Config's order, each with its flag."""
    out = {}
    for f in _fields():
        extra = f.type.extra if isinstance(f.type, mi.Metadata) else None
        if not extra or "flag" not in extra:
            continue
        name, help, metavar = extra["flag"]
        t = field_types()[f.name]
        out[f.name] = Flag(
            name or "--" + f.name.replace("_", "-"), help, metavar,
            choices=_literal_values(f.name) if isinstance(t, mi.LiteralType) else None,
            type=int if isinstance(t, mi.IntType) else str,
            repeat=isinstance(t, mi.ListType),
            switch=isinstance(t, mi.BoolType),
        )
    return out


def _literal_values(key: str) -> tuple[str, ...]:
    """A choice key's values in the order written (msgspec.inspect sorts them)."""
    hint = typing.get_type_hints(Config, include_extras=True)[key]
    while typing.get_origin(hint) is Annotated:
        hint = typing.get_args(hint)[0]
    return typing.get_args(hint)


@functools.cache
def numeric_keys() -> dict[str, mi.IntType | mi.FloatType]:
    return {k: t for k, t in field_types().items() if isinstance(t, (mi.IntType, mi.FloatType))}


def expected(key: str) -> str | None:
    """What a numeric key (from its Meta) or a choice takes, in words; None for other keys."""
    t = field_types().get(key)
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(map(repr, t.values))
    if isinstance(t, mi.IntType):
        return f"an integer from {t.ge} to {t.le}"
    if isinstance(t, mi.FloatType):
        low = f"from {t.ge:g}" if t.ge is not None else f"above {t.gt:g}"
        return f"a finite number {low} and at most {t.le:g}"
    return None


def in_range(key: str, value: object) -> bool:
    """Whether a numeric key's value is within its Meta (None: an optional key unset)."""
    t = numeric_keys()[key]
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return value is None
    if isinstance(t, mi.IntType) and not isinstance(value, int):
        return False
    if t.ge is not None and not value >= t.ge or t.gt is not None and not value > t.gt:
        return False  # written so that a NaN fails too
    return t.le is None or value <= t.le


def _explain(exc: msgspec.ValidationError, raw: dict, origin: dict, where: str) -> str:
    """One line for a value msgspec refused, naming where it came from: for a numeric
    key its range, for a choice its values."""
    m = re.search(r"at `\$\.(\w+)", str(exc))
    key = m.group(1) if m else None
    if key is None:
        return f"{where}: {exc}"
    if (want := expected(key)) is not None:
        return f"{origin.get(key, where)}: {key} must be {want}, not {raw.get(key)!r}"
    return f"{origin.get(key, where)}: {exc}"


def check(cfg: Config, where: str = "settings") -> None:
    """The ranges of a Config made in code (load's msgspec.convert checks a file's), and
    what msgspec cannot check: keys that only make sense together."""
    for key in numeric_keys():
        if not in_range(key, value := getattr(cfg, key)):
            raise ConfigError(f"{where}: {key} must be {expected(key)}, not {value!r}")
    if cfg.register_enabled and not cfg.register_allow:
        raise ConfigError(f"{where}: register_enabled needs register_allow (address patterns a register may name)")
    if (cfg.curve_worker_keys or cfg.curve_feedback_key or cfg.curve_clients) and not cfg.curve_secret_key:
        raise ConfigError(f"{where}: curve keys need curve_secret_key (detokd's own key pair)")
    if len(cfg.curve_worker_keys) > len(cfg.workers):
        raise ConfigError(
            f"{where}: curve_worker_keys has {len(cfg.curve_worker_keys)} keys for {len(cfg.workers)} workers"
        )
    if cfg.curve_secret_key:
        for name, address, key_file in _curve_sockets(cfg):
            if address.startswith("tcp://") and not key_file and name not in cfg.curve_plaintext:
                setting = "curve_feedback_key" if name == "feedback" else f"curve_worker_keys[{name[len('worker.'):]}]"
                raise ConfigError(
                    f"{where}: {name.replace('.', ' ')} ({address}) is tcp and has no CURVE key while curve_secret_key "
                    f"is set: set {setting}, or list \"{name}\" in curve_plaintext to connect it in plaintext"
                )
        for name in cfg.curve_plaintext:
            if name.startswith("worker.") and int(name[len("worker.") :]) >= len(cfg.workers):
                raise ConfigError(f"{where}: curve_plaintext names {name}, but there are {len(cfg.workers)} workers")


def _curve_sockets(cfg: Config) -> list[tuple[str, str, str | None]]:
    """(name, address, key file) of every socket detokd connects as a CURVE client."""
    keys = cfg.curve_worker_keys
    out = [(f"worker.{w}", a, keys[w] if w < len(keys) else None) for w, a in enumerate(cfg.workers)]
    if cfg.feedback:
        out.append(("feedback", cfg.feedback, cfg.curve_feedback_key))
    return out


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
