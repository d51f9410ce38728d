"""Which addresses a row may name as its HTTP worker (SGLang's --tokenizer-worker-num N > 1).

SGLang's scheduler stamps each row with the address of the HTTP worker (a TokenizerWorker)
whose request it is, and SGLang's own detokenizer connects any address a row names. The
detokenizer learns no list of them: each worker makes its own address when it starts
(`ipc://` + tempfile.NamedTemporaryFile(delete=False).name, in http_server's
init_multi_tokenizer and Engine._init_tokenizer_worker, 0.5.20 to 0.5.23), binds a PULL
socket there before it sends a request, and registers it with SGLang's router alone.
So detokd connects an address only if one of those workers could be there:

- an `ipc://` path in the temp folder this process shares with SGLang (it inherits
  SGLang's environment, so tempfile.gettempdir() is the folder SGLang's tempfile used),
  named as tempfile names a file: "tmp" and 8 of its characters;
- none of SGLang's own addresses (PortArgs), which are made the same way: text pushed to
  the router's address comes back through it, to the scheduler's reaches a scheduler;
- a socket of this user that something listens on: a made-up path does not exist, a
  worker that died leaves no listener, another user's socket is refused;
- at most `most` of them connected at once, twice tokenizer_worker_num: room for each
  worker's replacement to start while it still serves (uvicorn restarts a hung or dead
  worker, and SIGHUP replaces each one). When all are taken, the place of one whose
  worker stopped listening goes to the new address.

Each address is judged once, when a row first names it, and the verdict holds for its
later rows: a worker whose first rows were refused must never have a later row decoded
as the start of a request.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import socket
import stat
import tempfile
from dataclasses import dataclass, field
from typing import Any

# tempfile's names: its template "tmp" and 8 characters of _RandomNameSequence's alphabet.
TEMPFILE_NAME = re.compile(r"tmp[a-z0-9_]{8}")
IPC = "ipc://"


def sglangs_addresses(port_args: Any) -> frozenset[str]:
    """Every address in SGLang's PortArgs, in the dataclasses and tuples it holds too."""
    found: set[str] = set()

    def walk(value: Any, depth: int) -> None:
        if isinstance(value, str):
            found.add(value)
        elif isinstance(value, (list, tuple)) and depth:
            for item in value:
                walk(item, depth - 1)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type) and depth:
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name, None), depth - 1)

    walk(port_args, 3)
    return frozenset(a for a in found if "://" in a)


def listening(path: str) -> bool:
    """Whether something accepts connections on the unix socket at `path` (a connect that
    does not wait: a full backlog still counts as listening)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            code = probe.connect_ex(path)
        except OSError:  # a path the kernel refuses (too long for a unix address)
            return False
    return code in (0, errno.EAGAIN, errno.EINPROGRESS)


@dataclass(frozen=True)
class HttpWorkerAddresses:
    """The rule above, for one detokenizer process."""

    most: int  # HTTP workers connected at once
    own: frozenset[str] = frozenset()  # SGLang's own addresses (sglangs_addresses)
    folder: str = field(default_factory=tempfile.gettempdir)
    uid: int = field(default_factory=os.geteuid)

    def refusal(self, address: str) -> str | None:
        """Why a row may not name `address` as its HTTP worker, or None."""
        if address in self.own:
            return "it is one of SGLang's own addresses, not an HTTP worker's"
        prefix = f"{IPC}{self.folder}/"
        if not (address.startswith(prefix) and TEMPFILE_NAME.fullmatch(address, len(prefix))):
            return f"SGLang makes no HTTP worker address of that form (ipc://{self.folder}/tmpXXXXXXXX)"
        return self.gone(address)

    def gone(self, address: str) -> str | None:
        """Why no HTTP worker of this user listens at `address` (an ipc address), or None."""
        path = address[len(IPC):]
        try:
            st = os.lstat(path)
        except (OSError, ValueError):  # ValueError: a NUL in the path
            return "no such socket"
        if not stat.S_ISSOCK(st.st_mode):
            return "it is not a socket"
        if st.st_uid != self.uid:
            return "it is another user's socket"
        if not listening(path):
            return "nothing listens on it"
        return None
