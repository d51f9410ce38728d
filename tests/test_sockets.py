"""detokd.sockets: what `detokd serve` does with the ipc path it is told to bind.

Real `detokd serve` processes against real Unix sockets held by the test. The other
cases of the live-socket check (a path that is not a socket, one held by a ZMQ socket,
a stale one) are in tests/test_hardening.py.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from detokd.config import to_toml
from detokd.process import ipc_config


def test_an_input_path_whose_holder_never_accepts_is_refused_within_a_second_and_exit_2(tmp_path: Path) -> None:
    """A holder that listens and never accepts, its backlog full: a connect to it waits
    for ever, so a check without a deadline kept detokd at "starting" for good."""
    cfg = ipc_config(tmp_path)
    path = cfg.input[len("ipc://"):]
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    holder.bind(path)
    holder.listen(0)
    queued = []
    while True:  # fill the backlog: the next connect would wait for an accept
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.setblocking(False)
        try:
            c.connect(path)
        except BlockingIOError:
            c.close()
            break
        queued.append(c)
    config = tmp_path / "detokd.toml"
    config.write_text(to_toml(cfg))
    try:
        # The deadline is the test's, not detokd's: without the fix this run never ends.
        r = subprocess.run(
            [sys.executable, "-m", "detokd", "serve", "--config", str(config), "--metrics-port", "0"],
            capture_output=True, text=True, timeout=60,
        )
    except subprocess.TimeoutExpired:
        raise AssertionError("detokd still starting 60 s later: the check of the input path has no deadline") from None
    finally:
        for c in queued:
            c.close()
    naming = [line for line in r.stderr.splitlines() if path in line]  # beside it: the metrics port's line
    assert r.returncode == 2 and len(naming) == 1, r.stderr
    assert naming[0].startswith("detokd: error: input ") and f"{path} did not take a connect within 1 s" in naming[0], r.stderr
    assert Path(path).is_socket()  # the holder's socket is still there
    holder.close()
