"""The command line: help, and one clear line with exit code 2 for a bad config."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tomllib

import msgspec
import pytest
from utils import config_ranges, logged, wait_until

from detokd.cli import MAX_SHARDS
from detokd.config import Config, load
from detokd.process import DetokdProcess, ipc_config

DETOKD = [sys.executable, "-m", "detokd"]


def run(*args, timeout=120, env=None):
    """`detokd ARGS`; `env` adds to the inherited environment."""
    env = {**os.environ, **(env or {})}
    return subprocess.run([*DETOKD, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("cmd", [[], ["serve"], ["demo"], ["tokenizer"], ["config"]])
def test_help_describes_every_command(cmd):
    r = run(*cmd, "--help")
    assert r.returncode == 0
    assert "usage: detokd" in r.stdout


def test_serve_help_lists_every_override():
    out = run("serve", "--help").stdout
    for flag in ("--config", "--input", "--worker", "--feedback", "--tokenizer", "--max-states", "--max-prompt-tail", "--log-level", "--metrics-port", "--shards"):
        assert flag in out


def one_line_error(r, *needles):
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0]


def test_unknown_key(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('input = "ipc:///tmp/x.sock"\nbogus = 1\n')
    one_line_error(run("serve", "--config", str(f)), "bogus")


def test_wrong_type(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('max_states = "many"\n')
    one_line_error(run("serve", "--config", str(f)), "max_states")


def test_not_toml(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("this is = = not toml\n")
    one_line_error(run("serve", "--config", str(f)), "TOML")


def test_missing_config_file(tmp_path):
    one_line_error(run("serve", "--config", str(tmp_path / "nope.toml")), "nope.toml")


def test_unreadable_tokenizer(tmp_path):
    one_line_error(run("serve", "--tokenizer", str(tmp_path / "missing")), "missing")
    (tmp_path / "empty").mkdir()
    one_line_error(run("serve", "--tokenizer", str(tmp_path / "empty")), "tokenizer.json")
    (tmp_path / "bad.json").write_text("{not json")
    one_line_error(run("serve", "--tokenizer", str(tmp_path / "bad.json")), "bad.json")


def test_address_in_use(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run("serve", "--input", f"tcp://127.0.0.1:{port}", "--worker", f"ipc://{tmp_path}/w.sock")
    one_line_error(r, f"tcp://127.0.0.1:{port}")


def test_bad_address_flag():
    one_line_error(run("serve", "--input", "localhost:5555"), "input")


def test_default_config_file_matches_the_built_in_defaults():
    assert load("configs/default.toml", {}) == Config()


def test_two_worker_example_config_loads():
    cfg = load("configs/two-workers.toml", {})
    assert len(cfg.workers) == 2


def test_flags_override_the_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('max_states = 10\nworkers = ["ipc:///tmp/a.sock"]\n')
    cfg = load(str(f), {"max_states": 20, "workers": ["ipc:///tmp/b.sock", "ipc:///tmp/c.sock"]})
    assert (cfg.max_states, cfg.workers) == (20, ["ipc:///tmp/b.sock", "ipc:///tmp/c.sock"])


def test_config_command_prints_loadable_toml(tmp_path):
    r = run("config")
    assert r.returncode == 0
    f = tmp_path / "printed.toml"
    f.write_text(r.stdout)
    assert load(str(f), {}) == Config()


def test_tokenizer_command_verifies_the_packaged_default():
    r = run("tokenizer", "deepseek", "--trials", "50")
    assert r.returncode == 0, r.stderr
    assert "codec      bytes" in r.stdout and "self-check ok" in r.stdout


def test_demo_streams_and_checks_every_stream():
    r = run("demo", "--streams", "4", "--steps", "60", "--quiet", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all 4 streams match the reference decode exactly" in r.stdout


@pytest.mark.parametrize(
    "line, key",
    [
        ("shutdown_grace_s = inf", "shutdown_grace_s"),
        ("health_timeout = nan", "health_timeout"),
        ("linger_ms = 2147483648", "linger_ms"),
        ("send_hwm = 2147483648", "send_hwm"),
        ("max_frame_bytes = 9223372036854775807\nmax_rows = -1", "max_rows"),
    ],
)
def test_a_number_out_of_its_range_exits_2_naming_the_key_and_the_range(tmp_path, line, key):
    """These started (inf, nan) or hung in start-up (a socket option ZMQ cannot take)."""
    f = tmp_path / "c.toml"
    f.write_text(f'input = "ipc://{tmp_path}/in.sock"\nworkers = ["ipc://{tmp_path}/w.sock"]\n{line}\n')
    t = config_ranges()[key]
    one_line_error(run("serve", "--config", str(f), timeout=60), key, f"{t.le:g}" if isinstance(t.le, float) else str(t.le))


def test_the_top_of_every_numeric_range_serves_and_stops_cleanly(tmp_path):
    """The largest value of every numeric key at once (the grace timer, the socket
    options, the caps): detokd gets ready, and SIGTERM still ends it with 0."""
    tops = {k: t.le for k, t in config_ranges().items() if k != "metrics_port"}  # a fixed port may be taken
    with DetokdProcess(ipc_config(tmp_path, **tops), folder=tmp_path) as d:
        assert d.stop() == 0, d.log()


def test_a_mistyped_key_is_answered_with_the_key_it_resembles(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("max_state = 10\n")
    one_line_error(run("serve", "--config", str(f)), "unknown key `max_state`", "did you mean `max_states`?")


@pytest.mark.parametrize(
    "key, values", [("log_level", ["debug", "info", "warning", "error", "critical"]), ("release", ["char", "word"])]
)
def test_a_choice_outside_its_values_lists_the_values(tmp_path, key, values):
    f = tmp_path / "c.toml"
    f.write_text(f'{key} = "verbose"\n')
    one_line_error(run("serve", "--config", str(f)), key, "'verbose'", *(repr(v) for v in values))


# --- the environment: DETOKD_<KEY>, DETOKD_CONFIG; flag > environment > file > default


def printed(r) -> Config:
    """The config `detokd config` printed."""
    assert r.returncode == 0, r.stderr
    return msgspec.convert(tomllib.loads(r.stdout), Config)


def test_the_environment_overrides_the_file_which_overrides_the_defaults(tmp_path):
    (tmp_path / "a.toml").write_text('max_states = 10\nlog_level = "debug"\n')
    (tmp_path / "b.toml").write_text("max_states = 30\n")
    env = {"DETOKD_CONFIG": str(tmp_path / "a.toml"), "DETOKD_SEND_HWM": "20"}
    cfg = printed(run("config", env=env))
    assert (cfg.max_states, cfg.log_level, cfg.send_hwm, cfg.linger_ms) == (10, "debug", 20, Config().linger_ms)
    assert printed(run("config", "-c", str(tmp_path / "b.toml"), env=env)).max_states == 30  # -c beats DETOKD_CONFIG


def test_serve_reads_DETOKD_CONFIG(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("max_states = 0\n")
    one_line_error(run("serve", env={"DETOKD_CONFIG": str(f)}), str(f), "DETOKD_CONFIG", "max_states")


@pytest.mark.parametrize(
    "variable, value",
    [("DETOKD_SEND_HWM", "lots"), ("DETOKD_SEND_HWM", "2147483648"), ("DETOKD_REGISTER_ENABLED", "maybe"),
     ("DETOKD_LOG_LEVEL", "loud"), ("DETOKD_WORKERS", "localhost:5555"), ("DETOKD_MAX_STATE", "5")],
)
def test_a_bad_environment_value_exits_2_naming_the_variable(tmp_path, variable, value):
    one_line_error(run("serve", "--input", f"ipc://{tmp_path}/in.sock", env={variable: value}), f"environment {variable}:")


@pytest.mark.parametrize("flag", [False, True])
def test_serve_binds_the_flags_input_over_the_environments_over_the_files(tmp_path, flag):
    """The one setting a running detokd shows in its log: the input it bound."""
    address = {w: f"ipc://{tmp_path}/{w}.sock" for w in ("file", "env", "flag")}
    cfg = msgspec.structs.replace(ipc_config(tmp_path), input=address["file"])
    args = ["--input", address["flag"]] if flag else []
    with DetokdProcess(cfg, folder=tmp_path, args=args, env={"DETOKD_INPUT": address["env"]}) as d:
        logged(d, f"serving: input {address['flag' if flag else 'env']}")  # written a moment after READY


# --- --shards and the stop signals


@pytest.mark.parametrize("n", ["0", "-1"])
def test_no_shards_is_refused(tmp_path, n):
    """--shards 0 or -1 is refused, not taken for unset (one server)."""
    one_line_error(run("serve", "--input", f"ipc://{tmp_path}/in.sock", "--shards", n, timeout=60), "--shards", n)


# `python -m detokd ARGS` with an audit hook that writes a line to the file argv[1] for
# each process the interpreter starts, however it starts it.
SPAWNS_LOGGED = r"""
import runpy, sys
spawns = open(sys.argv.pop(1), "a", buffering=1)
STARTS = {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system"}
sys.addaudithook(lambda event, args: event in STARTS and spawns.write(f"{event} {args[:2]!r}\n"))
runpy.run_module("detokd", run_name="__main__", alter_sys=True)
"""


def serve_until_it_starts_a_process(tmp_path, *args) -> tuple[str, subprocess.CompletedProcess]:
    """`detokd serve ARGS` until it exits or starts a process (then it is stopped at
    once): (the processes it started, one a line; how it ended). Its output goes to
    files: a shard it started would hold a pipe open."""
    from detokrig.children import stop_proc

    spawns, out, err = (tmp_path / name for name in ("spawns", "stdout", "stderr"))
    spawns.write_text("")
    with open(out, "w") as o, open(err, "w") as e:
        p = subprocess.Popen([sys.executable, "-c", SPAWNS_LOGGED, str(spawns), "serve", *args],
                             stdout=o, stderr=e, text=True, start_new_session=True)
    try:
        wait_until(lambda: p.poll() is not None or spawns.read_text(), 60, "detokd to exit or start a process")
    finally:
        stop_proc(p)
    return spawns.read_text(), subprocess.CompletedProcess(p.args, p.returncode, out.read_text(), err.read_text())


def test_more_shards_than_the_bound_exit_2_before_any_process_is_started(tmp_path):
    """--shards 1000000 started shard after shard (12 within 2 s) until the host ran
    out of memory. Beyond MAX_SHARDS: one line, exit 2, and not one process started."""
    for n in (MAX_SHARDS + 1, 1_000_000):
        started, r = serve_until_it_starts_a_process(tmp_path, "--input", f"ipc://{tmp_path}/in.sock", "--shards", str(n))
        assert started == "", f"--shards {n}: {started.count(chr(10))} processes started, the first: {started[:300]}"
        one_line_error(r, f"--shards must be 1 to {MAX_SHARDS}, not {n}")


def test_a_shard_start_is_seen_by_the_hook_that_sees_none_above(tmp_path):
    """The control of the test above: `--shards 2` starts a shard, and the hook says so."""
    started, _ = serve_until_it_starts_a_process(tmp_path, "--input", f"ipc://{tmp_path}/in.sock", "--shards", "2")
    assert started.startswith("subprocess.Popen") and "'--shard-index', '0'" in started, started


@pytest.mark.parametrize("shards", [1, 2])
def test_sighup_is_a_drained_stop_that_exits_0_and_is_logged(tmp_path, shards):
    """SIGHUP's default killed detokd at once, unlogged; under --shards the supervisor
    died of it and left its shards to PR_SET_PDEATHSIG."""
    with DetokdProcess(ipc_config(tmp_path), folder=tmp_path, args=["--shards", str(shards)]) as d:
        assert d.stop(sig=signal.SIGHUP) == 0, d.log()
    log = d.log()
    if shards > 1:
        assert "got SIGHUP: stopping 2 shards" in log, log
    assert log.count("SIGHUP: input ") == shards, log  # each shard's drained stop, named


def test_the_demo_piped_writes_whole_lines_and_figures_that_agree():
    """Piped (not a terminal), the demo writes whole lines: stream 0's text line by
    line (`demo-0 | `, exactly the reference decode), progress lines between them.
    The figures agree: the summary's rate is its tokens over its seconds, the last
    progress line counts every token, no progress rate is a first frame's burst (it
    stays near the pacing), the pacing is labelled as the engine's offer, and
    detokd's CPU per token is its CPU seconds over the tokens its metrics counted."""
    import re

    from detokd.demo import _streams
    from detokd.tokenizer import load as load_tokenizer

    streams, steps = 4, 120
    r = run("demo", "--streams", str(streams), "--steps", str(steps), timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert out.endswith("\n")
    lines = out.splitlines()
    v = load_tokenizer("deepseek")
    tail, outs = _streams(v, streams, steps)
    want = v.reference(tail, outs[0]).split("\n")
    if want[-1] == "":
        want.pop()
    assert [line[len("demo-0 | "):] for line in lines if line.startswith("demo-0 | ")] == want
    progress = [line for line in lines if line.startswith("[")]
    assert progress and all(re.fullmatch(r"\[\d+ of 4 streams finished · [\d,]+ tokens in [\d.]+ s( · [\d,]+ tokens/s delivered)?\]", p) for p in progress), progress
    total = streams * steps
    summary = re.search(r"^4 streams, ([\d,]+) tokens in ([\d.]+) s: ([\d,]+) tokens/s delivered$", out, re.M)
    tokens, seconds, rate = int(summary.group(1).replace(",", "")), float(summary.group(2)), int(summary.group(3).replace(",", ""))
    assert tokens == total
    assert abs(rate - tokens / seconds) <= 0.01 * rate + 1
    assert re.search(r"^pacing: the synthetic engine offers 4 streams x 50 steps/s = 200 tokens/s$", out, re.M)
    last = re.search(r"([\d,]+) tokens in", progress[-1])
    assert int(last.group(1).replace(",", "")) == total
    live = [int(m.replace(",", "")) for p in progress for m in re.findall(r"([\d,]+) tokens/s delivered", p)]
    assert live and all(x <= 200 * 1.5 for x in live), live  # a paced run cannot deliver far above the pace
    cpu = re.search(r"^detokd: ([\d,]+) tokens decoded in ([\d.]+) s of its CPU = ([\d.]+) us of CPU per token", out, re.M)
    decoded, cpu_s, per_token = int(cpu.group(1).replace(",", "")), float(cpu.group(2)), float(cpu.group(3))
    assert decoded == total  # detokd's own count agrees with what the worker got
    assert abs(per_token - cpu_s / decoded * 1e6) <= 0.06 + 0.001 * per_token
