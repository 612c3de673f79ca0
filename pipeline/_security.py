"""CURVE: with a key pair configured, every ZeroMQ socket of a pipeline authenticates and
encrypts.

``stagewire keys DIR`` makes the pair. Every process of the pipeline (master, workers,
clients) is given the same directory (``--keys DIR``, ``master.keys`` in the YAML, or
``STAGEWIRE_KEYS``); a process without it, or with another pair, is refused at the
handshake. The pair is the pipeline's: binding sockets serve with its secret key,
connecting sockets present its public key as their own and prove they hold the secret, and
a ZAP handler in each process admits only that key. So a peer that merely learned the
public key cannot connect; one needs the secret file.

Same-host links between workers are Unix sockets, not ZeroMQ, and are not encrypted: they
never leave the host, and their listeners accept only processes of the same user (or root),
by the connecting process's credentials.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from pathlib import Path
from typing import Any, TypeVar

import structlog
import zmq
import zmq.auth
from zmq.utils import z85

from pipeline._errors import ConfigError

__all__ = (
    "HANDSHAKE_FAILED",
    "KEYS_ENV",
    "CurveKeys",
    "handshake_failure",
    "load_keys",
    "make_keys",
    "process_keys",
    "refused_count",
    "resolve_keys",
    "secure_client",
    "secure_server",
    "set_process_keys",
    "stop_guard",
)

log = structlog.get_logger("stagewire.security")

#: The environment variable naming the key directory (what ``--keys`` sets).
KEYS_ENV = "STAGEWIRE_KEYS"
_NAME = "stagewire"
_S = TypeVar("_S", bound="zmq.Socket[Any]")
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_DOMAIN = b"stagewire"


class CurveKeys:
    """The pipeline's key pair, as Z85 text, and the directory it came from."""

    __slots__ = ("directory", "public", "secret")

    def __init__(self, directory: Path, public: bytes, secret: bytes) -> None:
        self.directory = directory
        self.public = public
        self.secret = secret

    def __repr__(self) -> str:  # never the secret
        return f"CurveKeys({str(self.directory)!r}, public={self.public.decode()!r})"


def make_keys(directory: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Write a new key pair into ``directory`` (made if missing, readable by its owner only).

    Returns:
        The secret key file's path.

    Raises:
        ConfigError: a key pair is already there (``force`` replaces it), the directory
            cannot be written, or other users may write it.
    """
    if not os.fspath(directory):
        # Path("") is the current directory: an empty argument (an unset shell variable,
        # say) would scatter a key pair there.
        raise ConfigError("the key pair's directory is empty: name one, such as ./keys")
    if not zmq.has("curve"):
        raise ConfigError("this ZeroMQ build has no CURVE support; install pyzmq's wheel")
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{path} is a file, not a directory: name a directory for the key pair")
    secret_file = path / f"{_NAME}.key_secret"
    if secret_file.exists() and not force:
        raise ConfigError(f"{secret_file} already exists; pass --force to replace the key pair")
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        if path.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            # What others may write there they could replace (and it is not ours to narrow:
            # it may be a shared directory).
            raise ConfigError(
                f"{path} is writable by other users; make the key pair in a directory of "
                "your own (it is created readable by you only if missing)"
            )
        for old in (secret_file, path / f"{_NAME}.key"):
            old.unlink(missing_ok=True)
        # Created readable by the owner only from the start, not narrowed afterwards.
        umask = os.umask(0o077)
        try:
            _, written = zmq.auth.create_certificates(os.fspath(path), _NAME)
        finally:
            os.umask(umask)
    except OSError as exc:
        raise ConfigError(f"cannot write a key pair into {path}: {exc.strerror}") from None
    return Path(written)


def load_keys(directory: str | os.PathLike[str]) -> CurveKeys:
    """Read the key pair ``stagewire keys`` wrote into ``directory``.

    Raises:
        ConfigError: no key pair there, the secret file is readable by others, the file or
            the directory belongs to another user or others may write the directory, or
            it is not a key file.
    """
    path = Path(directory).expanduser().absolute()
    secret_file = path / f"{_NAME}.key_secret"
    try:
        mode = secret_file.stat().st_mode
    except OSError:
        raise ConfigError(
            f"no CURVE key pair in {path} ({secret_file.name} missing); make one with "
            f"'stagewire keys {path}' and give every process of the pipeline that directory"
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"{secret_file} is accessible by other users; run 'chmod 600 {secret_file}'"
        )
    _check_owned(secret_file)
    _check_owned(path)
    if path.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            f"{path} is writable by other users, who could replace the key pair; "
            f"run 'chmod go-w {path}'"
        )
    if not zmq.has("curve"):
        raise ConfigError("this ZeroMQ build has no CURVE support; install pyzmq's wheel")
    try:
        public, secret = zmq.auth.load_certificate(os.fspath(secret_file))
    except (OSError, ValueError, IndexError, KeyError) as exc:
        raise ConfigError(f"{secret_file} is not a CURVE key file: {exc}") from None
    if not public or not secret or len(public) != 40 or len(secret) != 40:
        raise ConfigError(f"{secret_file} is not a CURVE key file: no 40-character key pair")
    return CurveKeys(path, public, secret)


def resolve_keys(directory: str | os.PathLike[str] | None) -> CurveKeys | None:
    """The pair in ``directory``, or in ``STAGEWIRE_KEYS``'s when ``None``; ``None`` if
    neither names one.

    Raises:
        ConfigError: the directory holds no valid pair.
    """
    if directory is None:
        directory = os.environ.get(KEYS_ENV) or None
    return None if directory is None else load_keys(directory)


def _check_owned(path: Path) -> None:
    """Refuse key material another user owns (and so could have written)."""
    owner = path.stat().st_uid
    if owner not in (os.geteuid(), 0):
        raise ConfigError(
            f"{path} belongs to another user (uid {owner}); use a key directory of your own"
        )


_process_keys: CurveKeys | None = None


def set_process_keys(keys: CurveKeys | None) -> None:
    """The pair of this process's transports (a worker's, set once at its start)."""
    global _process_keys
    _process_keys = keys


def process_keys() -> CurveKeys | None:
    """The pair this process's transports secure their sockets with, if any."""
    return _process_keys


def secure_server(sock: _S, keys: CurveKeys | None) -> _S:
    """Make a socket that binds serve CURVE with ``keys`` (``None``: left as it is).

    Call before ``bind``. The socket's context gets a handler that admits only peers
    holding the pair's secret key.

    Raises:
        ConfigError: the socket's context already serves another pair.
    """
    if keys is not None:
        _guard_for(sock.context, keys)
        sock.setsockopt(zmq.ZAP_DOMAIN, _DOMAIN)
        # Without this a server whose handler is missing would admit every CURVE peer
        # that knows the public key; with it, it admits none.
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    return sock


def secure_client(sock: _S, keys: CurveKeys | None) -> _S:
    """Make a socket that connects present ``keys`` (``None``: left as it is).

    Call before ``connect``.
    """
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    return sock


#: Monitor events that say a connecting socket's handshake was refused.
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def handshake_failure(event: int, endpoint: str, keys: CurveKeys | None) -> str:
    """One line for a refused handshake with ``endpoint``, saying what to check."""
    mine = (
        f"this process uses the key pair of {keys.directory}"
        if keys is not None
        else "this process has no CURVE keys"
    )
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        why = "it does not accept this key pair"
    elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        why = "one side uses CURVE and the other does not"
    elif keys is None:
        # Also what a peer that speaks no ZMTP at all (another service) ends in.
        return (
            f"{endpoint} refused the connection: it demands CURVE keys, or it is no stagewire "
            f"process at all ({mine}); check the address, or give every process of the "
            f"pipeline the same --keys DIR (or {KEYS_ENV})"
        )
    else:
        why = "the keys do not match, or it is not a stagewire process"
    return (
        f"{endpoint} refused the connection: {why} ({mine}); give every process of the "
        f"pipeline the same --keys DIR (or {KEYS_ENV})"
    )


class _Guard(threading.Thread):
    """The ZAP handler of one context: admits CURVE peers that hold the pair's secret.

    It owns its one socket, so a context terminated without :func:`stop_guard` still
    terminates (the thread sees ETERM and closes it). Nothing but the stop request or the
    context's end ends its loop: the servers it guards also demand it
    (``ZAP_ENFORCE_DOMAIN``), so were it gone they would refuse every peer, never admit one.
    """

    _POLL_MS = 100

    def __init__(self, ctx: zmq.Context[Any], keys: CurveKeys) -> None:
        super().__init__(name="stagewire-zap", daemon=True)
        self.keys = keys
        self._public = z85.decode(keys.public)
        # Bound here, before any socket that needs it, so no handshake finds it missing.
        self._rep = ctx.socket(zmq.REP)
        self._rep.setsockopt(zmq.LINGER, 0)
        self._rep.bind(_ZAP_ENDPOINT)
        self._stopping = threading.Event()
        self.refused = 0
        self._refused_from: set[bytes] = set()
        self.start()

    def run(self) -> None:
        rep = self._rep
        try:
            while not self._stopping.is_set():
                try:
                    if not rep.poll(self._POLL_MS):
                        continue
                    frames = rep.recv_multipart()
                except zmq.ContextTerminated:
                    return
                except zmq.ZMQError as exc:
                    if exc.errno == zmq.ETERM:
                        return
                    log.error("zap_handler_error", error=repr(exc))
                    continue
                try:
                    reply = self._answer(frames)
                except Exception as exc:  # a refusal, never a dead handler
                    log.error("zap_handler_error", error=repr(exc))
                    reply = [*_head(frames), b"500", b"handler error", b"", b""]
                try:
                    rep.send_multipart(reply)
                except zmq.ZMQError as exc:
                    if exc.errno == zmq.ETERM:
                        return
                    log.error("zap_handler_error", error=repr(exc))
        finally:
            rep.close(0)

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        """The reply to one ZAP request: 200 for the pair's holders, 400 for anyone else."""
        if len(frames) < 6:
            # libzmq never sends this; REP must still answer it to take the next request.
            return [*_head(frames), b"400", b"malformed request", b"", b""]
        version, request_id, _domain, address, _identity, mechanism = frames[:6]
        credentials = frames[6:]
        ok = mechanism == b"CURVE" and len(credentials) == 1 and credentials[0] == self._public
        if not ok:
            self.refused += 1
            if address not in self._refused_from and len(self._refused_from) < 1024:
                self._refused_from.add(address)
                with contextlib.suppress(Exception):  # a broken log stream must not stop us
                    log.warning(
                        "peer_refused",
                        address=address.decode(errors="replace"),
                        reason="it does not hold this pipeline's CURVE key pair",
                    )
        status = [b"200", b"OK"] if ok else [b"400", b"not this pipeline's key pair"]
        return [version, request_id, *status, b"", b""]

    def stop(self) -> None:
        self._stopping.set()
        self.join(5.0)


def _head(frames: list[bytes]) -> list[bytes]:
    """A ZAP request's version and request id, for its reply (empty where missing)."""
    return [*frames[:2], b"", b""][:2]


_guards: dict[int, tuple[zmq.Context[Any], _Guard]] = {}
_guards_lock = threading.Lock()


def _guard_for(ctx: zmq.Context[Any], keys: CurveKeys) -> _Guard:
    """``ctx``'s handler, started for ``keys`` if it has none.

    Raises:
        ConfigError: ``ctx`` already guards another pair (one context, one pair).
    """
    with _guards_lock:
        found = _guards.get(id(ctx))
        if found is not None and found[0] is ctx:
            if found[1].keys.public != keys.public:
                raise ConfigError(
                    f"this ZeroMQ context already serves the key pair of "
                    f"{found[1].keys.directory}; one process serves one pair, not also the "
                    f"one in {keys.directory}"
                )
            return found[1]
        guard = _Guard(ctx, keys)
        _guards[id(ctx)] = (ctx, guard)
        return guard


def stop_guard(ctx: zmq.Context[Any]) -> None:
    """Stop ``ctx``'s ZAP handler, if it has one; call before terminating the context."""
    with _guards_lock:
        found = _guards.pop(id(ctx), None)
    if found is not None:
        found[1].stop()


def refused_count() -> int:
    """Peers refused at the handshake by this process's handlers, so far."""
    with _guards_lock:
        return sum(guard.refused for _, guard in _guards.values())
