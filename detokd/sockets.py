"""Sockets that strangers on the same machine or network cannot take over.

- The default ipc sockets live in a private folder (config.runtime_dir), created 0700
  and refused when someone else made it first.
- Binding an ipc:// input never removes what is there unless it is a stale socket:
  ZMQ's bind unlinks any file at the path, silently, which would take a live peer's
  socket or delete a file that is not detokd's.
- CURVE (ZMQ's public-key encryption and authentication) for tcp:// peers, with keys
  from files in zmq.auth's certificate format.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import stat
import struct
from dataclasses import dataclass, field

import zmq
import zmq.auth

from .config import ConfigError, runtime_dir

log = logging.getLogger("detokd.sockets")

PROBE_TIMEOUT = 1.0  # s a connect to an existing ipc path may take before it counts as held


# --- ipc ----------------------------------------------------------------------------------


def ipc_path(address: str) -> str | None:
    """The file an ipc:// address names (None: not ipc, or Linux's abstract namespace)."""
    if not address.startswith("ipc://"):
        return None
    path = address[len("ipc://") :]
    return None if path.startswith("@") else path


def ensure_private_dir(path: str) -> None:
    """Create `path` 0700, or accept it only as a directory of ours with mode 0700."""
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # mkdir's mode is cut by the umask
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot create the socket folder {path}: {exc.strerror}") from exc
    st = os.lstat(path)
    why = None
    if not stat.S_ISDIR(st.st_mode):
        why = "it is not a directory"
    elif st.st_uid != os.getuid():
        why = f"it is owned by uid {st.st_uid}, not by this user ({os.getuid()})"
    elif stat.S_IMODE(st.st_mode) != 0o700:
        why = f"its mode is {stat.S_IMODE(st.st_mode):04o}, not 0700"
    if why:
        raise ConfigError(f"socket folder {path} is not private: {why}; remove it or set the addresses explicitly")


def prepare_private(addresses: list[str | None]) -> None:
    """Make the private folder for those addresses that are in it (the defaults)."""
    private = runtime_dir()
    if any(p is not None and os.path.dirname(p) == private for p in map(ipc_path, filter(None, addresses))):
        ensure_private_dir(private)


def claim_ipc(address: str, what: str = "input") -> None:
    """Before binding `address`: refuse a path held by a live process (a connect to it
    succeeds, or waits past PROBE_TIMEOUT) or that is not a socket; remove a stale
    socket (its process is gone)."""
    path = ipc_path(address)
    if path is None:
        return
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"{what} {address}: cannot check {path}: {exc.strerror}") from exc
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"{what} {address}: {path} exists and is not a socket; not removing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # A holder whose backlog is full (it listens, never accepts) makes a blocking connect
    # wait for ever; a non-blocking one fails at once (EAGAIN) even if the holder accepts
    # a moment later. The kernel bounds the wait by the send timeout, then says EAGAIN.
    sec = int(PROBE_TIMEOUT)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("@ll", sec, int((PROBE_TIMEOUT - sec) * 1e6)))
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        pass  # nobody listens: stale
    except BlockingIOError:
        raise ConfigError(
            f"{what} {address}: {path} did not take a connect within {PROBE_TIMEOUT:g} s: a live process holds it "
            "and does not accept; not taking it over"
        ) from None
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise ConfigError(f"{what} {address}: cannot check {path}: {exc.strerror}") from exc
        return
    else:
        raise ConfigError(f"{what} {address} is held by another process (a connect to {path} succeeded); not taking it over")
    finally:
        probe.close()
    log.debug("removing stale socket %r", path)
    os.unlink(path)


# --- tcp exposure -------------------------------------------------------------------------


def is_loopback_tcp(address: str) -> bool | None:
    """True/False for a tcp:// address on/off loopback; None when not tcp."""
    if not address.startswith("tcp://"):
        return None
    host = address[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    host = host.split(";")[-1]  # "tcp://src;dst:port" binds dst
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # an interface name or "*": reachable from elsewhere


# --- CURVE --------------------------------------------------------------------------------


def load_public(path: str) -> bytes:
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read CURVE key {path}: {exc}") from exc
    return public


def load_pair(path: str) -> tuple[bytes, bytes]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read CURVE key {path}: {exc}") from exc
    if not secret:
        raise ConfigError(f"CURVE key {path} holds no secret key (use the .key_secret file)")
    return public, secret


@dataclass
class Curve:
    """detokd's key pair and the public keys of the peers it connects to."""

    public: bytes
    secret: bytes
    workers: dict[int, bytes] = field(default_factory=dict)
    feedback: bytes | None = None

    @classmethod
    def from_config(cls, cfg) -> Curve | None:
        if not cfg.curve_secret_key:
            return None
        if not zmq.has("curve"):
            raise ConfigError("curve_secret_key is set but this libzmq has no CURVE support")
        public, secret = load_pair(cfg.curve_secret_key)
        workers = {i: load_public(p) for i, p in enumerate(cfg.curve_worker_keys)}
        feedback = load_public(cfg.curve_feedback_key) if cfg.curve_feedback_key else None
        return cls(public, secret, workers, feedback)

    def serve(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def connect_to(self, sock: zmq.Socket, server_public: bytes) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = server_public


def start_authenticator(ctx: zmq.Context, clients: str | None):
    """ZAP handler of the input: only the public keys in folder `clients`, or any
    client that completes the CURVE handshake (it knows detokd's public key)."""
    from zmq.auth.thread import ThreadAuthenticator

    if clients is not None and not os.path.isdir(clients):
        raise ConfigError(f"curve_clients {clients} is not a folder of public keys")
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("detokd.auth"))
    auth.start()
    auth.configure_curve(domain="*", location=clients if clients is not None else zmq.auth.CURVE_ALLOW_ANY)
    return auth
