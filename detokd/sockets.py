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
import inspect
import ipaddress
import os
import re
import socket
import stat
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.auth

from . import logs
from .config import ConfigError, runtime_dir

log = logs.get(__name__)

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
        raise ConfigError(
            f"{what} {address} is held by another process (a connect to {path} succeeded); not taking it over")
    finally:
        probe.close()
    log.debug("removing stale socket %r", path)
    os.unlink(path)


def ipc_folder_problem(address: str) -> tuple[str, bool] | None:
    """Whether a stranger on this machine could take an ipc path: (why, fatal), or None.

    In a folder every user may write, anyone can bind the path before its owner, or
    (without the sticky bit) remove the owner's socket and bind their own: a worker's
    text then goes to them. So a world-writable folder on the way without the sticky
    bit is fatal; with it (/tmp), an existing path must be this user's, and a path
    not there yet could still be bound first by anyone (not fatal: it is said; a
    `register` of it is refused, since a worker registers once it has bound).

    The socket lives where the path resolves, so a path through a symlink is checked
    both as named (the folders that hold the links) and as resolved (the folders that
    hold the socket).
    """
    path = ipc_path(address)
    if path is None:
        return None
    path = os.path.abspath(path)
    named = _path_problem(path)
    real = os.path.realpath(path)
    if real == path or (named is not None and named[1]):
        return named
    resolved = _path_problem(real)
    if resolved is None or (named is not None and not resolved[1]):
        return named
    why, fatal = resolved
    return f"{path} resolves to {real}, and {why}", fatal


def _path_problem(path: str) -> tuple[str, bool] | None:
    """ipc_folder_problem of one absolute path, its folders as os.stat sees them."""
    folder = os.path.dirname(path)
    d = folder
    while True:
        try:
            st = os.stat(d)
        except OSError:
            st = None  # not there (yet): bind or connect says what it makes of that
        if st is not None and st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            return f"{d} is writable by every user and not sticky: anyone could replace the socket", True
        if d == "/":
            break
        d = os.path.dirname(d)
    try:
        st = os.stat(folder)
    except OSError:
        return None
    if not st.st_mode & stat.S_IWOTH:
        return None
    try:
        owner = os.lstat(path).st_uid
    except FileNotFoundError:
        return f"{folder} is writable by every user: another user could bind {path} first", False
    if owner != os.getuid():
        return f"{path} in {folder}, which every user can write, belongs to uid {owner}, not to this user " \
            f"({os.getuid()})", True
    return None  # ours, and the sticky bit keeps it ours while it is there


# What to do about an ipc path in a folder others can write; detokd as SGLang's detokenizer
# says where SGLang puts its addresses instead (detokd.sglang.process).
IPC_ADVICE = "use a folder only trusted users can write (docs/security.md)"


def check_ipc_folders(named: list[tuple[str, str | None]], fatal: bool = True) -> None:
    """At start, for each (what, address): refuse (exit 2) a path a stranger could take,
    warn of one a stranger could bind first. With `fatal` false both are warnings: for
    addresses detokd did not choose (SGLang's), where refusing would serve no one better."""
    for what, address in named:
        problem = ipc_folder_problem(address) if address else None
        if problem is None:
            continue
        why, takeable = problem
        if takeable and fatal:
            raise ConfigError(f"{what} {address}: {why}; {IPC_ADVICE}")
        log.warning("%s %s: %s; %s", what, address, why, IPC_ADVICE)


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


# --- addresses a peer names ---------------------------------------------------------------

_PORT = re.compile(r"[1-9][0-9]{0,4}")


def register_address_problem(address: str) -> str | None:
    """Why a peer's `register` address is not plain enough to match against
    register_allow, or None. Only `tcp://IP:port` and `ipc:///absolute/path` pass.

    fnmatch sees a string, ZMQ an endpoint: `tcp://127.0.0.1:0;127.0.0.2:5` matches
    `tcp://127.0.0.1:*` but ZMQ connects from 127.0.0.1 to 127.0.0.2; a `*` also
    spans dots and slashes, so `tcp://10.0.0.*:*` matches the name
    `10.0.0.1.evil.example` and `ipc:///run/engine/*` the path
    `/run/engine/../../tmp/x`. So the address must be the one canonical spelling of a
    single destination: an IP literal (no names, no `%interface`), a port, or a
    normalised absolute path; then the glob decides.
    """
    if any(c < " " or c == "\x7f" for c in address) or ";" in address:
        return "it holds ';' (a source address) or a control character"
    if address.startswith("ipc://"):
        path = address[len("ipc://") :]
        if not path.startswith("/") or path.startswith("//") or os.path.normpath(path) != path:
            return "an ipc address must be a normalised absolute path (no '.', '..', '//', abstract '@')"
        return None
    if not address.startswith("tcp://"):
        return "only tcp:// and ipc:// addresses can be registered"
    host, sep, port = address[len("tcp://") :].rpartition(":")
    if not sep or not _PORT.fullmatch(port) or int(port) > 65535:
        return "a tcp address needs a port 1-65535"
    bracketed = host.startswith("[") and host.endswith("]")
    bare = host[1:-1] if bracketed else host
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        return "a tcp host must be an IP address (a name could resolve anywhere; no interface names)"
    if bracketed != (ip.version == 6) or getattr(ip, "scope_id", None) or str(ip) != bare:
        return "a tcp host must be an IP address in its canonical form (IPv6 in brackets, no %scope)"
    return None


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
        workers = {i: load_public(p) for i, p in enumerate(cfg.curve_worker_keys) if p}  # "": an ipc worker's place
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


class HandshakeWatch:
    """Handshakes a CURVE input fails before its authenticator is asked (a client that
    does not speak CURVE, or does not know detokd's public key): read from the
    socket's monitor on a thread of its own, each one `refused()` and logged."""

    FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL

    def __init__(self, sock: zmq.Socket, refused: Callable[[], None]) -> None:
        self.monitor = sock.get_monitor_socket(self.FAILED)  # used by the thread alone from here on
        self.refused = refused
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="detokd-handshakes", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        try:
            while not self.stopping:
                if not self.monitor.poll(100):
                    continue
                event = recv_monitor_message(self.monitor)
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    break
                self.refused()
                log_auth.warning("CURVE handshake failed (event %d): the client does not speak CURVE with detokd's key",
                                 event["event"])
        except zmq.ZMQError:
            pass
        finally:
            self.monitor.close(linger=0)  # here, so the context can end

    def stop(self) -> None:
        self.stopping = True
        self.thread.join(2)


log_auth = logs.get("detokd.auth")  # security events under a name of their own, which operators filter on


# The private pyzmq method detokd's authenticator overrides to see each ZAP verdict, and
# the arguments it is called with.
ZAP_REPLY = "_send_zap_reply"
_ZAP_REPLY_PARAMS = ["self", "request_id", "status_code", "status_text", "user_id"]


def check_zap_reply() -> None:
    """ConfigError unless this pyzmq's Authenticator answers every ZAP request through
    `_send_zap_reply(request_id, status_code, status_text, user_id)`, which detokd's
    authenticator overrides to count and log refusals: a pyzmq that renames or reshapes
    it fails start-up naming it, instead of refusals going uncounted or a TypeError at
    the first one."""
    from zmq.auth.base import Authenticator

    where = f"pyzmq {zmq.__version__}: zmq.auth.base.Authenticator"
    reply = getattr(Authenticator, ZAP_REPLY, None)
    if not callable(reply):
        raise ConfigError(f"{where} has no {ZAP_REPLY}, through which detokd counts CURVE refusals")
    params = list(inspect.signature(reply).parameters)
    if params != _ZAP_REPLY_PARAMS:
        raise ConfigError(f"{where}.{ZAP_REPLY} takes {params}, not the {_ZAP_REPLY_PARAMS} detokd overrides")
    if ZAP_REPLY not in inspect.getsource(Authenticator.handle_zap_message):
        raise ConfigError(f"{where}.handle_zap_message does not answer through {ZAP_REPLY}, which detokd overrides")


def start_authenticator(ctx: zmq.Context, clients: str | None, refused: Callable[[], None] = lambda: None,
                        watch: zmq.Socket | None = None):
    """ZAP handler of the input: only the public keys in folder `clients`, or any
    client that completes the CURVE handshake (it knows detokd's public key).
    `refused()` is called, and a warning logged, for each handshake it turns away,
    and for each that fails on socket `watch` (the input) before it is asked."""
    from zmq.auth.thread import ThreadAuthenticator

    check_zap_reply()

    class Authenticator(ThreadAuthenticator):
        watcher: HandshakeWatch | None = None

        def _send_zap_reply(self, request_id, status_code, status_text, user_id="anonymous"):
            if status_code != b"200":  # pyzmq logs its refusals at debug only
                refused()
                self.log.warning("CURVE client refused: %s", status_text.decode("ascii", "replace"))
            super()._send_zap_reply(request_id, status_code, status_text, user_id)

        def stop(self) -> None:
            if self.watcher is not None:
                self.watcher.stop()
            super().stop()

    if clients is not None and not os.path.isdir(clients):
        raise ConfigError(f"curve_clients {clients} is not a folder of public keys")
    auth = Authenticator(ctx, log=log_auth)
    auth.start()
    if watch is not None:
        auth.watcher = HandshakeWatch(watch, refused)
    auth.configure_curve(domain="*", location=clients if clients is not None else zmq.auth.CURVE_ALLOW_ANY)
    return auth
