"""A remote client's connection to its master: one ZMQ DEALER, watched, renewed when ZMQ
gives it up.

ZMQ reconnects a DEALER by itself after an ordinary drop (the master stopped, restarted or
became unreachable), but never after a protocol error: a refused handshake (one side uses
CURVE and the other does not) or a message past the socket's ``MAXMSGSIZE`` ends the
connection for good, and every send after it fails. :class:`MasterLink` tells the two apart
by the socket's monitor events (ZMQ schedules a retry right after an ordinary drop, and
none after a protocol error), and :meth:`MasterLink.reopen` replaces a socket given up with
a fresh one, so that the client serves again once the master is fixed.

Both ends send ZMTP heartbeats. The client drops a connection to a master that stays
silent (a partition, a frozen host: no TCP close ever comes) after twice its ``timeout``,
and then reconnects; the master drops a silent client's (see ``Master``), and cancels its
requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from typing import Any

import structlog
import zmq
from zmq.utils.monitor import parse_monitor_message

from pipeline._errors import ConfigError
from pipeline._messages import MAX_CONTROL_MESSAGE, FromClient, encode_message
from pipeline._security import HANDSHAKE_FAILED, CurveKeys, secure_client
from pipeline._sockets import HandshakeJudge, SocketReader, for_endpoint, set_heartbeats

__all__ = ("REOPEN_GRACE_S", "MasterLink")

log = structlog.get_logger("stagewire.remote")

#: A drop that ZMQ has not scheduled a retry for within this long is for good: the socket
#: is reopened. (It schedules one within microseconds of an ordinary drop.)
REOPEN_GRACE_S = 0.25

#: Numbers the monitor endpoints: pyzmq's default name (after the socket's descriptor)
#: comes back when a socket is replaced, while the old monitor may still hold it, and the
#: new one then reports nothing.
_monitors = itertools.count(1)

_EVENTS = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | HANDSHAKE_FAILED
)


def _client_socket(
    ctx: zmq.Context[Any], keys: CurveKeys | None, timeout: float
) -> zmq.Socket[Any]:
    """A DEALER for a master's control endpoint, presenting ``keys`` if any; not yet
    connected (see :func:`_connect`)."""
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    try:
        secure_client(sock, keys)
        sock.setsockopt(zmq.LINGER, 0)
        # Requests and cancels queue while the master is unreachable and leave once it is
        # back (or are dropped at close); they are never dropped for a full queue.
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE)
        # A ping every quarter of ``timeout`` (at most 2 s); the connection goes when the
        # master stays silent twice that (the client fails its requests after ``timeout``
        # of silence itself: a master that thaws in between keeps the connection).
        set_heartbeats(sock, min(2.0, timeout / 4), 2 * timeout, timeout)
    except BaseException:
        # A socket left open would hold the context's term() for ever.
        sock.close(linger=0)
        raise
    return sock


def _connect(sock: zmq.Socket[Any], endpoint: str) -> None:
    """Connect ``sock`` to ``endpoint``.

    Raises:
        ConfigError: ``endpoint`` is not a ZMQ endpoint.
    """
    try:
        for_endpoint(sock, endpoint).connect(endpoint)
    except zmq.ZMQError as exc:
        raise ConfigError(
            f"cannot connect to {endpoint!r}: {exc.strerror}; give the master's control "
            "endpoint, such as tcp://10.0.0.5:7600"
        ) from exc


class MasterLink:
    """A DEALER to a master's control ``endpoint``, and the monitor that watches it.

    ``on_message`` gets each message's frames, ``on_dropped`` is told when the connection
    drops, and ``on_refused`` (with a one-line reason) when the master refuses the
    handshake, once until one succeeds again.

    Attributes:
        connected: a handshake succeeded and the connection has not dropped since.
        refused: why the master refused the handshake, if it did since the last one that
            succeeded; empty otherwise.
        reopened: how many times the socket was replaced after ZMQ gave it up.
    """

    def __init__(
        self,
        endpoint: str,
        keys: CurveKeys | None,
        timeout: float,
        *,
        on_message: Callable[[list[bytes]], None],
        on_error: Callable[[BaseException, list[bytes]], None],
        on_dropped: Callable[[], None],
        on_refused: Callable[[str], None],
    ) -> None:
        self.endpoint = endpoint
        self._keys = keys
        self._timeout = timeout
        self._on_message = on_message
        self._on_error = on_error
        self._on_dropped = on_dropped
        self._on_refused = on_refused
        self._judge = HandshakeJudge(endpoint, keys)
        self._ctx: zmq.Context[Any] | None = None
        self._sock: zmq.Socket[Any] | None = None
        self._reader: SocketReader | None = None
        self._monitor: zmq.Socket[Any] | None = None
        self._monitor_reader: SocketReader | None = None
        self.connected = False
        self.refused = ""
        self.reopened = 0
        #: ZMQ will not reconnect the socket (a protocol error), or a send on it failed.
        self._given_up = False
        #: Loop time the connection dropped, until ZMQ schedules its retry.
        self._dropped_at: float | None = None
        #: Why the last send failed.
        self._send_error = ""
        #: Reopened since the last handshake that succeeded (logged once in a row).
        self._reopen_streak = 0

    @property
    def opened(self) -> bool:
        """Whether :meth:`open` has been called (closed since, or not)."""
        return self._ctx is not None

    def open(self) -> None:
        """Connect a fresh socket, watched from the running loop.

        Raises:
            ConfigError: the endpoint is not a ZMQ endpoint.
            zmq.ZMQError: no socket can be made (the process is out of descriptors).
        """
        if self._ctx is None:
            self._ctx = zmq.Context()
        sock = _client_socket(self._ctx, self._keys, self._timeout)
        self._sock = sock
        self._reader = SocketReader(sock, self._on_message, self._on_error)
        self._reader.start()
        # Watched before it connects: on loopback the handshake can finish at once, and an
        # event before the monitor exists is lost (the client would never greet the master).
        address = f"inproc://stagewire-remote-{id(self):x}-{next(_monitors)}"
        self._monitor = sock.get_monitor_socket(_EVENTS, address)
        self._monitor_reader = SocketReader(self._monitor, self._on_event, self._on_error)
        self._monitor_reader.start()
        _connect(sock, self.endpoint)

    def send(self, msg: FromClient) -> bool:
        """Queue ``msg`` for the master (never blocks: no high-water mark); False if the
        socket refused it, which gives the socket up (:meth:`reopen` replaces it)."""
        sock = self._sock
        if sock is None:
            self._send_error = "the client has no socket open"
            return False
        try:
            sock.send(encode_message(msg), zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            self._given_up = True
            self._send_error = exc.strerror
            return False
        if self._reader is not None:
            self._reader.kick()  # the socket's descriptor is edge-triggered
        return True

    def why_down(self) -> str:
        """Why messages cannot reach the master, as far as this client knows."""
        if self.refused:
            return self.refused
        return (
            f"this client's connection to it ended ({self._send_error or 'closed by ZMQ'}, "
            "as after a message too large for it); the client reconnects within a second"
        )

    def _on_event(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)["event"]
        refused = self._judge.refusal(event)
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected = True
            self.refused = ""
            self._dropped_at = None
            self._reopen_streak = 0
        elif event == zmq.EVENT_CONNECT_RETRIED:
            self._dropped_at = None  # ZMQ reconnects by itself
        elif refused is not None:
            if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                self._given_up = True  # ZMQ never retries after a protocol error
            if not self.refused:
                self.refused = refused
                self._on_refused(refused)
        elif event == zmq.EVENT_DISCONNECTED:
            self.connected = False
            self._dropped_at = asyncio.get_running_loop().time()
            self._on_dropped()

    def needs_reopen(self, now: float) -> bool:
        """Whether ZMQ has given the socket up (it will not reconnect it by itself)."""
        if self._sock is None or self._given_up:
            return True
        return self._dropped_at is not None and now - self._dropped_at >= REOPEN_GRACE_S

    def reopen(self) -> bool:
        """Replace the socket with a fresh one, connecting anew; False if that failed (the
        next call tries again)."""
        why = self.why_down()
        self._close_socket(linger=0)
        self.connected = False
        self._given_up = False
        self._dropped_at = None
        self._send_error = ""
        try:
            self.open()
        except (zmq.ZMQError, ConfigError) as exc:
            self._close_socket(linger=0)
            log.error("remote_reconnect_failed", endpoint=self.endpoint, error=str(exc))
            return False
        self.reopened += 1
        if not self._reopen_streak:
            log.warning("remote_connection_renewed", endpoint=self.endpoint, reason=why)
        self._reopen_streak += 1
        return True

    def _close_socket(self, linger: int) -> None:
        for reader in (self._reader, self._monitor_reader):
            if reader is not None:
                reader.stop()
        self._reader = self._monitor_reader = None
        sock, self._sock = self._sock, None
        monitor, self._monitor = self._monitor, None
        if sock is not None:
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=linger)

    def close(self, linger: int) -> None:
        """Close the socket, letting what it still holds leave for ``linger`` ms; the
        context is terminated by :meth:`aclose`."""
        self._close_socket(linger)

    def close_now(self) -> None:
        """Close the socket and terminate the context without awaiting (for a client whose
        event loop has closed, or whose close was cancelled); idempotent.

        Raises:
            Nothing.
        """
        with contextlib.suppress(Exception):  # a reader on a closed loop
            self._close_socket(linger=0)
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.destroy(linger=0)

    async def aclose(self) -> None:
        """Close the socket (at once) and terminate the context; idempotent.

        Raises:
            Nothing.
        """
        self._close_socket(linger=0)
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            # Terminating waits for what a socket closed with a linger still sends.
            await asyncio.to_thread(ctx.term)
