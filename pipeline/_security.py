"""CURVE: with a key pair configured, every ZeroMQ socket of a pipeline authenticates and
encrypts.

``stagewire keys DIR`` makes the pair. Every process of the pipeline (master, workers,
clients) is given the same directory (``--keys DIR``, ``master.keys`` in the YAML, or
``STAGEWIRE_KEYS``); a process without it, or with another pair, is refused at the
handshake. The pair is the pipeline's: binding sockets serve with its secret key,
connecting sockets present its public key as their own and prove they hold the secret, and
a ZAP handler in each process admits only that key. So a peer that merely learned the
public key cannot connect; one needs the secret file.

Same-host links between workers are Unix sockets, not ZeroMQ, and are not covered: on one
host, file permissions already say who may connect.
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
        ConfigError: a key pair is already there (``force`` replaces it), or the directory
            cannot be written.
    """
    if not zmq.has("curve"):
        raise ConfigError("this ZeroMQ build has no CURVE support; install pyzmq's wheel")
    path = Path(directory)
    secret_file = path / f"{_NAME}.key_secret"
    if secret_file.exists() and not force:
        raise ConfigError(f"{secret_file} already exists; pass --force to replace the key pair")
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
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
        ConfigError: no key pair there, the secret file is readable by others, or it is
            not a key file.
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
    """
    if keys is not None:
        _guard_for(sock.context, keys)
        sock.setsockopt(zmq.ZAP_DOMAIN, _DOMAIN)
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
    else:
        why = "the keys do not match"
    return (
        f"{endpoint} refused the connection: {why} ({mine}); give every process of the "
        f"pipeline the same --keys DIR (or {KEYS_ENV})"
    )


class _Guard(threading.Thread):
    """The ZAP handler of one context: admits CURVE peers that hold the pair's secret."""

    def __init__(self, ctx: zmq.Context[Any], keys: CurveKeys) -> None:
        super().__init__(name="stagewire-zap", daemon=True)
        self._public = z85.decode(keys.public)
        # Bound here, before any socket that needs it, so no handshake finds it missing.
        self._rep = ctx.socket(zmq.REP)
        self._rep.setsockopt(zmq.LINGER, 0)
        self._rep.bind(_ZAP_ENDPOINT)
        self._wake_in = ctx.socket(zmq.PAIR)
        self._wake_in.setsockopt(zmq.LINGER, 0)
        endpoint = f"inproc://stagewire-zap-stop-{id(self)}"
        self._wake_in.bind(endpoint)
        self._wake_out = ctx.socket(zmq.PAIR)
        self._wake_out.setsockopt(zmq.LINGER, 0)
        self._wake_out.connect(endpoint)
        self._lock = threading.Lock()
        self.admitted = 0
        self.refused = 0
        self._refused_from: set[bytes] = set()
        self.start()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._rep, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._wake_in in ready:
                    return
                if self._rep in ready:
                    self._answer(self._rep.recv_multipart())
        except zmq.ZMQError:
            return  # the context is going away
        finally:
            self._rep.close(0)
            self._wake_in.close(0)

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) < 6:
            return  # not a ZAP request; REP needs no answer to a malformed one it dropped
        version, request_id, _domain, address, _identity, mechanism = frames[:6]
        credentials = frames[6:]
        ok = mechanism == b"CURVE" and len(credentials) == 1 and credentials[0] == self._public
        if ok:
            self.admitted += 1
        else:
            self.refused += 1
            if address not in self._refused_from and len(self._refused_from) < 1024:
                self._refused_from.add(address)
                log.warning(
                    "peer_refused",
                    address=address.decode(errors="replace"),
                    reason="it does not hold this pipeline's CURVE key pair",
                )
        status = (b"200", b"OK") if ok else (b"400", b"not this pipeline's key pair")
        self._rep.send_multipart([version, request_id, *status, b"", b""])

    def stop(self) -> None:
        with self._lock:
            with contextlib.suppress(zmq.ZMQError):
                self._wake_out.send(b"")
            self.join(5.0)
            self._wake_out.close(0)


_guards: dict[int, tuple[zmq.Context[Any], _Guard]] = {}
_guards_lock = threading.Lock()


def _guard_for(ctx: zmq.Context[Any], keys: CurveKeys) -> _Guard:
    with _guards_lock:
        found = _guards.get(id(ctx))
        if found is not None and found[0] is ctx:
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
