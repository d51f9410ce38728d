"""systemd's notify protocol (detokd.readiness): what a real `detokd serve` sends on
NOTIFY_SOCKET, and the unit docs/deploy.md gives, which relies on it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from detokd.config import to_toml
from detokd.process import ipc_config

REPO = Path(__file__).resolve().parents[1]


def datagrams(sock: socket.socket, proc: subprocess.Popen, until: bytes, timeout: float = 120.0) -> list[bytes]:
    """Every notify datagram up to and including the one that has `until`; fails if the
    process exits or `timeout` s pass first."""
    got: list[bytes] = []
    sock.settimeout(timeout)
    while True:
        try:
            message = sock.recv(4096)
        except TimeoutError:
            raise AssertionError(f"no {until!r} within {timeout} s (exit {proc.poll()}); got {got}") from None
        got.append(message)
        if until in message.split(b"\n"):
            return got


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_serve_says_ready_then_stopping_on_the_notify_socket(tmp_path, sig):
    path = tmp_path / "notify.sock"
    config = tmp_path / "c.toml"
    config.write_text(to_toml(ipc_config(tmp_path)))
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        proc = subprocess.Popen(
            [sys.executable, "-m", "detokd", "serve", "--config", str(config)],
            env={**os.environ, "NOTIFY_SOCKET": str(path)}, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        try:
            assert b"STOPPING=1" not in b"\n".join(datagrams(sock, proc, b"READY=1"))
            proc.send_signal(sig)
            datagrams(sock, proc, b"STOPPING=1")
            assert proc.wait(60) == 0, proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stderr.close()


def unit(name: str) -> dict[str, str]:
    """The [Service] settings of a unit file docs/deploy.md spells out."""
    docs = (REPO / "docs" / "deploy.md").read_text()
    block = re.search(rf"```ini\n# /etc/systemd/system/{re.escape(name)}\n(.*?)```", docs, re.S).group(1)
    service = block.split("[Service]", 1)[1].split("\n[", 1)[0]
    return dict(line.split("=", 1) for line in service.splitlines() if "=" in line and not line.startswith(("#", " ")))


def test_the_documented_unit_waits_for_ready_and_hears_the_main_process():
    """Type=exec called a shard started before its tokenizer was loaded and its sockets
    bound; Type=notify waits for the READY=1 detokd sends. The unit execs detokd from
    sh, so the main process is detokd itself."""
    settings = unit("detokd@.service")
    assert settings["Type"] == "notify"
    assert settings.get("NotifyAccess", "main") == "main"
    assert "exec /usr/local/bin/detokd serve" in settings["ExecStart"]
