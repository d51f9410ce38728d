"""Telling a supervisor how far start-up has got: systemd's notify protocol.

When the environment names a NOTIFY_SOCKET (systemd's Type=notify services, and
detokd.process for tests, scripts and the demo), detokd sends READY=1 once the
tokenizer is loaded and every socket is bound, and STOPPING=1 when it begins to
shut down. Without one this does nothing; /health says the same ("starting", then
"ok") to supervisors that probe over HTTP.
"""

from __future__ import annotations

import os
import socket


def notify(state: str) -> bool:
    """Send one notify datagram; False when no supervisor listens."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):  # the abstract namespace
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(state.encode(), path)
    except OSError:
        return False
    return True
