"""ZMQ sockets driven straight from the event loop.

``zmq.asyncio`` wraps every receive in a future, which costs about twice a raw wake-up on
small messages. Instead each socket's file descriptor is registered with
``loop.add_reader`` and drained synchronously into a callback until it would block. ZMQ's
descriptor is edge-triggered, so after every send on a two-way socket the socket is
re-checked for pending input.

Data sockets use a high-water mark of 0: ZMQ never silently drops, and memory is bounded by
stagewire's own credit windows instead. Inbound messages are capped in size.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import structlog
import zmq

from pipeline._local_link import LocalLink
from pipeline._loop import nothing_else_ready
from pipeline._messages import encode_batch
from pipeline._security import HANDSHAKE_FAILED, CurveKeys, handshake_failure, secure_client
from transports.inline import MAX_DATA_MESSAGE

__all__ = (
    "HandshakeJudge",
    "HandshakeWatch",
    "Outbox",
    "RefusedPeers",
    "Sealable",
    "SendData",
    "SocketReader",
    "TooManyFrames",
    "bind_ephemeral",
    "new_context",
    "set_heartbeats",
)

log = structlog.get_logger("stagewire.sockets")

#: Envelopes per batch a sender joins into one frame; frames per message a reader accepts.
MAX_FRAMES = 256
#: The most bytes a batch's array header takes (see encode_batch).
_BATCH_HEAD = 5
#: How many forgotten endpoints an outbox remembers, to drop what is still sent to them.
MAX_GONE = 4096


class Sealable(Protocol):
    """An envelope encoded only when its batch leaves, so it can grow until then."""

    def seal(self) -> bytes:
        """The envelope's bytes; called once, as its batch leaves."""
        ...


#: Queues one envelope for a data endpoint: ``Outbox.send``, or a stand-in in tests.
SendData = Callable[[str, "bytes | Sealable"], None]


class _Context(zmq.Context[Any]):
    """A context that keeps its open sockets, so that its finaliser closes every one.

    Dropped unclosed (a pipeline nobody closed), a context and its sockets become garbage
    together, and the collector clears weak references before it runs finalisers: pyzmq's
    own finaliser then found none of the sockets left to close, and waited for them for
    ever, freezing whatever collection ran it.
    """

    #: Declared: pyzmq takes any other attribute set on a context for a socket option.
    _open: set[zmq.Socket[Any]]

    def __init__(self) -> None:
        super().__init__()
        self._open = set()

    def _add_socket(self, socket: Any) -> None:
        super()._add_socket(socket)
        self._open.add(socket)

    def _rm_socket(self, socket: Any) -> None:
        super()._rm_socket(socket)
        opened = getattr(self, "_open", None)  # None while the interpreter tears down
        if opened is not None:
            opened.discard(socket)

    def __del__(self) -> None:
        if not self.closed:
            for socket in list(getattr(self, "_open", ())):
                with contextlib.suppress(Exception):
                    socket.close(linger=0)
        super().__del__()


def new_context() -> zmq.Context[Any]:
    """A ZMQ context for one process; the caller terminates it (should it not, collecting
    it closes its sockets and terminates it, without waiting)."""
    return _Context()


def for_endpoint(sock: zmq.Socket[Any], endpoint: str) -> zmq.Socket[Any]:
    """Let ``sock`` use ``endpoint``: an IPv6 one (``tcp://[::1]:PORT``) needs IPv6 on.

    Only then: an IPv6 socket bound to an IPv4 address reports it IPv4-mapped.
    """
    if endpoint.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    return sock


def bind_ephemeral(sock: zmq.Socket[Any], address: str) -> str:
    """Bind ``sock`` to ``address``, where a TCP port of 0 means any free port.

    Returns:
        The endpoint actually bound, with the chosen port.
    """
    if address.startswith("tcp://") and address.endswith(":0"):
        address = address[:-2] + ":*"
    for_endpoint(sock, address).bind(address)
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return endpoint.decode()


#: ZMQ's bounds on heartbeat options, in ms: ``HEARTBEAT_TTL`` travels in deciseconds in 16
#: bits (and its receiver scales it to ms in 16 bits too), the others are C ints.
_MAX_TTL_MS = 60_000
_MAX_MS = 2**31 - 1


def set_heartbeats(sock: zmq.Socket[Any], interval: float, timeout: float, ttl: float) -> None:
    """Turn on ZMTP heartbeats on ``sock`` (before it binds or connects): a PING every
    ``interval`` seconds, a connection dropped when nothing comes ``timeout`` after one
    (a peer cut off without a TCP close: a partition, a frozen host), and its peers asked
    to drop it when they hear nothing for ``ttl`` (at most a minute)."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, _ms(interval, 100, _MAX_MS))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _ms(timeout, 200, _MAX_MS))
    sock.setsockopt(zmq.HEARTBEAT_TTL, _ms(ttl, 100, _MAX_TTL_MS))


def _ms(seconds: float, least: int, most: int) -> int:
    """``seconds`` in whole milliseconds, within [least, most] (infinity: ``most``)."""
    return most if seconds * 1000 >= most else max(least, round(seconds * 1000))


class TooManyFrames(ValueError):
    """A message had more frames than its socket's reader takes (it was dropped unread)."""


class SocketReader:
    """Drains one socket into ``on_message`` whenever it becomes readable.

    ``on_message`` receives the list of frames as ``bytes``; it must not block, and any
    exception it raises is passed to ``on_error`` so one bad message never stops the reader.
    A message of more than ``max_frames`` frames is dropped as it is read, past that many
    copied out of ZeroMQ (``on_error`` gets a :class:`TooManyFrames` and the first ones):
    ``MAXMSGSIZE`` caps each frame, not a message. (ZeroMQ itself has the whole message
    before it delivers its first frame; only CURVE keeps a hostile peer out.)
    """

    __slots__ = (
        "_loop",
        "_max_frames",
        "_on_error",
        "_on_message",
        "_registered",
        "_scheduled",
        "sock",
    )

    def __init__(
        self,
        sock: zmq.Socket[Any],
        on_message: Callable[[list[bytes]], None],
        on_error: Callable[[BaseException, list[bytes]], None],
        *,
        max_frames: int = MAX_FRAMES + 1,
    ) -> None:
        self.sock = sock
        self._on_message = on_message
        self._on_error = on_error
        self._max_frames = max_frames
        self._loop = asyncio.get_running_loop()
        self._registered = False
        self._scheduled = False

    def start(self) -> None:
        """Watch the socket; input already queued is drained at once."""
        self._loop.add_reader(self._fd(), self._drain)
        self._registered = True
        self.kick()

    def _fd(self) -> int:
        fd = self.sock.getsockopt(zmq.FD)
        assert isinstance(fd, int)
        return fd

    def kick(self) -> None:
        """Re-check for input soon: call after sending on a two-way socket."""
        if not self._scheduled and self._registered:
            self._scheduled = True
            self._loop.call_soon(self._drain)

    def drain_now(self) -> None:
        """Handle whatever input is queued right now."""
        self._drain()

    def _drain(self) -> None:
        self._scheduled = False
        sock = self.sock
        # A bounded batch per wake-up keeps one busy socket from starving the loop.
        for _ in range(256):
            try:
                frames, count = self._recv(sock)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return  # closed under us during shutdown
            try:
                if count > len(frames):
                    raise TooManyFrames(
                        f"a message of {count} frames, where at most {self._max_frames} are taken"
                    )
                self._on_message(frames)
            except Exception as exc:
                # A failing error handler must not stop the reader either: ZMQ's descriptor
                # is edge-triggered, so input left queued now would never wake us again.
                with contextlib.suppress(Exception):
                    self._on_error(exc, frames)
        self.kick()

    def _recv(self, sock: zmq.Socket[Any]) -> tuple[list[bytes], int]:
        """The next message's first ``max_frames`` frames, and how many it had (the frames
        past those are read and dropped, never copied out of ZeroMQ).

        Raises:
            zmq.Again: no message is waiting.
            zmq.ZMQError: the socket closed.
        """
        frames = [sock.recv(zmq.NOBLOCK)]
        count, limit = 1, self._max_frames
        while sock.getsockopt(zmq.RCVMORE):
            count += 1
            if count <= limit:
                frames.append(sock.recv())
            else:
                sock.recv(copy=False)
        return frames, count

    def stop(self) -> None:
        """Stop watching the socket (it stays open)."""
        if self._registered:
            self._registered = False
            with contextlib.suppress(zmq.ZMQError, ValueError, OSError):
                self._loop.remove_reader(self._fd())


class HandshakeJudge:
    """Reads a connecting socket's handshake events (:data:`HANDSHAKE_FAILED`) and says
    when they amount to a refusal: CURVE keys that do not match, or none on one side.

    A refusal without detail (what a wrong server key gives, but also a peer going away
    mid-handshake) counts only once it repeats.
    """

    _VAGUE_LIMIT = 3

    def __init__(self, endpoint: str, keys: CurveKeys | None) -> None:
        self._endpoint = endpoint
        self._keys = keys
        self._vague = 0

    def refusal(self, event: int) -> str | None:
        """A one-line reason once ``event`` (with those before it) means refused, else None.

        A handshake that succeeds forgets the vague failures before it.
        """
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._vague = 0
            return None
        if not event & HANDSHAKE_FAILED:
            return None
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self._vague += 1
            if self._vague < self._VAGUE_LIMIT:
                return None
        return handshake_failure(event, self._endpoint, self._keys)


class _Monitor:
    """Calls ``on_event`` with each of ``events`` (``zmq.EVENT_*`` flags) on ``sock``, read on
    the event loop, until :meth:`stop`."""

    def __init__(self, sock: zmq.Socket[Any], events: int, on_event: Callable[[int], None]) -> None:
        self._sock = sock
        self._on_event = on_event
        # Read by a plain socket of the same context, even when ``sock`` is a ``zmq.asyncio``
        # one (whose receives would return futures). Made by that context, not by a shadow
        # of it, so that the context closes it too: a context whose owner was dropped unclosed
        # waited for it for ever in its finaliser, freezing a garbage collection.
        address = f"inproc://stagewire-monitor-{id(self):x}"
        sock.monitor(address, events)
        self._mon: zmq.Socket[Any] | None = sock.context.socket(zmq.PAIR, socket_class=zmq.Socket)
        self._mon.setsockopt(zmq.LINGER, 0)
        self._mon.connect(address)
        self._reader = SocketReader(self._mon, self._read, lambda exc, frames: None)
        self._reader.start()

    def _read(self, frames: list[bytes]) -> None:
        from zmq.utils.monitor import parse_monitor_message

        self._on_event(parse_monitor_message(frames)["event"])

    def stop(self) -> None:
        """Stop watching; idempotent."""
        mon, self._mon = self._mon, None
        if mon is None:
            return
        self._reader.stop()
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        mon.close(0)


class HandshakeWatch:
    """Tells ``on_refused`` once, with a one-line reason, if the peer a connecting socket
    reaches refuses its handshake (see :class:`HandshakeJudge`).

    Without it such a socket retries in silence and its messages wait forever. The watch
    ends at the first handshake that succeeds, or at :meth:`stop`.
    """

    def __init__(
        self,
        sock: zmq.Socket[Any],
        endpoint: str,
        keys: CurveKeys | None,
        on_refused: Callable[[str], None],
    ) -> None:
        self._judge = HandshakeJudge(endpoint, keys)
        self._on_refused = on_refused
        self._monitor = _Monitor(
            sock, HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED, self._on_event
        )

    def _on_event(self, event: int) -> None:
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.stop()
            return
        reason = self._judge.refusal(event)
        if reason is not None:
            self.stop()
            self._on_refused(reason)

    def stop(self) -> None:
        """Stop watching; idempotent."""
        self._monitor.stop()


#: Why a bound socket refused a connection, by handshake event.
_REFUSED: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "a peer whose CURVE keys are not the pipeline's",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "a peer that broke the ZMQ protocol, or that uses "
    "CURVE where this socket does not (or the reverse)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "a connection that sent bytes that are no ZMQ "
    "handshake, or closed before finishing one",
}


class RefusedPeers:
    """Tells ``on_refused``, with a short reason, of each connection a bound socket refused
    at the handshake: garbage bytes, another protocol, a peer without the pipeline's keys.

    ZMQ drops those connections itself, before any message; this is how they are counted
    and logged with the garbage the socket's messages held. Watches until :meth:`stop`.
    """

    def __init__(self, sock: zmq.Socket[Any], on_refused: Callable[[str], None]) -> None:
        self._on_refused = on_refused
        #: A CURVE server: a peer with other keys fails its handshake before any check
        #: that could say so, as a protocol error or with no detail.
        self._curve = bool(sock.getsockopt(zmq.CURVE_SERVER))
        self._monitor = _Monitor(sock, HANDSHAKE_FAILED, self._on_event)

    def _on_event(self, event: int) -> None:
        why = _REFUSED.get(event, "a refused handshake")
        if self._curve and event != zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            why = f"a peer without the pipeline's CURVE key pair, or {why}"
        self._on_refused(why)

    def stop(self) -> None:
        """Stop watching; idempotent."""
        self._monitor.stop()


class Outbox:
    """One PUSH socket per peer endpoint, connected lazily, with envelopes batched.

    ``send`` only queues; once per event-loop turn every peer's queued envelopes leave as
    one frame holding a msgpack array of them (see ``encode_batch``), so both ends pay one
    system call and one decode per batch. A stream of small chunks then pays the socket's wake-up
    and system-call costs once per batch instead of once per chunk, and a single chunk
    waits at most one loop turn.

    A process that has just read a frame flushes through :meth:`flushing_after`: at once
    when the frame woke nothing, else with :meth:`flush_soon`, so that what the tasks it
    woke send in the next loop turn leaves at the end of that same turn.
    """

    __slots__ = (
        "_ctx",
        "_gone",
        "_handle",
        "_keys",
        "_links",
        "_local",
        "_loop",
        "_pending",
        "_socks",
        "dropped",
        "oversize",
    )

    def __init__(self, ctx: zmq.Context[Any], keys: CurveKeys | None = None) -> None:
        self._ctx = ctx
        self._keys = keys
        self._socks: dict[str, zmq.Socket[Any]] = {}
        self._pending: dict[str, list[bytes | Sealable]] = {}
        #: The flush to come, once one is due.
        self._handle: asyncio.Handle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Same-host link addresses by endpoint, and the links opened to them.
        self._local: dict[str, str] = {}
        self._links: dict[str, LocalLink] = {}
        #: Endpoints forgotten as gone: what is sent there is dropped, not queued on a socket
        #: that would reconnect for ever (a consumer still crediting a producer that died).
        self._gone: OrderedDict[str, None] = OrderedDict()
        #: Envelopes dropped so.
        self.dropped = 0
        #: Envelopes dropped for being larger than a data message (none are made).
        self.oversize = 0

    def set_local(self, endpoint: str, address: str) -> None:
        """Send to ``endpoint`` over a same-host link to ``address`` from now on."""
        if self._local.get(endpoint) != address:
            self._close_link(endpoint)
            self._local[endpoint] = address

    def _link(self, endpoint: str) -> LocalLink | None:
        """The open link to ``endpoint``, opening it on first use; None: use ZMQ."""
        link = self._links.get(endpoint)
        if link is not None and not link.broken:
            return link
        address = self._local.get(endpoint)
        if address is None:
            return None
        try:
            link = self._links[endpoint] = LocalLink(address)
        except OSError as exc:
            # Nothing listens there (the peer died, or lives in another network namespace):
            # ZMQ reaches it from now on.
            del self._local[endpoint]
            self._links.pop(endpoint, None)
            log.info("local_link_unavailable", endpoint=endpoint, error=repr(exc))
            return None
        return link

    def _close_link(self, endpoint: str) -> None:
        link = self._links.pop(endpoint, None)
        if link is not None:
            link.close()

    def _socket(self, endpoint: str) -> zmq.Socket[Any]:
        sock = self._socks.get(endpoint)
        if sock is None:
            sock = secure_client(self._ctx.socket(zmq.PUSH), self._keys)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            for_endpoint(sock, endpoint).connect(endpoint)
            self._socks[endpoint] = sock
        return sock

    def send(self, endpoint: str, envelope: bytes | Sealable) -> None:
        """Queue one envelope for ``endpoint``; it leaves within this loop turn.

        A :class:`Sealable` envelope is encoded as it leaves, so what joins it until then
        (the next chunks of a run) leaves with it.
        """
        if self._gone and endpoint in self._gone:
            self.dropped += 1
            return
        queued = self._pending.get(endpoint)
        if queued is None:
            self._pending[endpoint] = [envelope]
        else:
            queued.append(envelope)
        if self._handle is None:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            self._handle = self._loop.call_soon(self.flush)

    def flush_soon(self) -> None:
        """Flush after every callback queued so far on the loop: the ones just woken.

        Call it after handling a received frame. The handlers that frame woke run in the
        next loop turn, and the flush now follows them in that turn. A flush due earlier is
        moved behind them.
        """
        if self._handle is not None:
            self._handle.cancel()
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_soon(self.flush)

    def flushing_after(
        self, on_message: Callable[[list[bytes]], None]
    ) -> Callable[[list[bytes]], None]:
        """``on_message`` followed by a flush: at once when nothing else is ready to run
        (the handlers it started have run to their ends or waits), else :meth:`flush_soon`,
        behind the tasks it woke. What a data reader should call."""

        def handle(frames: list[bytes]) -> None:
            on_message(frames)
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            if nothing_else_ready(loop, but=self._handle):
                # The handlers the message started ran to their ends or waits already, and
                # nothing they woke runs this turn: what they sent leaves now, not a turn later.
                self.flush()
            else:
                self.flush_soon()

        return handle

    def flush(self) -> None:
        """Send everything queued, one multi-frame message per peer (HWM 0: never blocks)."""
        if self._handle is not None:
            self._handle.cancel()  # called directly, or by this very handle: either way, done
            self._handle = None
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        for endpoint, queued in pending.items():
            envelopes = [e if isinstance(e, bytes) else e.seal() for e in queued]
            for i in range(0, len(envelopes), MAX_FRAMES):
                batch = envelopes[i : i + MAX_FRAMES]
                frame = encode_batch(batch)
                if len(frame) <= MAX_DATA_MESSAGE:
                    self._transmit(endpoint, frame)
                else:
                    self._transmit_within_limit(endpoint, batch)

    def _transmit_within_limit(self, endpoint: str, envelopes: list[bytes]) -> None:
        """Send ``envelopes`` in batches of at most MAX_DATA_MESSAGE bytes, which a receiver
        takes (a larger one drops its link, and every envelope queued on it). An envelope
        larger than that alone is dropped, counted in ``oversize`` and logged: the runtime
        makes none (see MAX_INLINE)."""
        batch: list[bytes] = []
        size = _BATCH_HEAD
        for envelope in envelopes:
            n = len(envelope)
            if n + _BATCH_HEAD > MAX_DATA_MESSAGE:
                self.oversize += 1
                log.error(
                    "data_message_too_large", endpoint=endpoint, size=n, limit=MAX_DATA_MESSAGE
                )
                continue
            if size + n > MAX_DATA_MESSAGE:
                self._transmit(endpoint, encode_batch(batch))
                batch, size = [], _BATCH_HEAD
            batch.append(envelope)
            size += n
        if batch:
            self._transmit(endpoint, encode_batch(batch))

    def _transmit(self, endpoint: str, frame: bytes) -> None:
        if self._local:
            link = self._link(endpoint)
            if link is not None and link.send(frame):
                return
        self._socket(endpoint).send(frame, zmq.NOBLOCK, copy=False)

    def forget(self, endpoint: str) -> None:
        """Close the socket to an endpoint that went away, dropping what was queued for it,
        and what is sent to it from now on, until :meth:`reachable` names it again."""
        self._gone[endpoint] = None
        if len(self._gone) > MAX_GONE:
            self._gone.popitem(last=False)
        self._pending.pop(endpoint, None)
        self._local.pop(endpoint, None)
        self._close_link(endpoint)
        sock = self._socks.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    def reachable(self, endpoints: Iterable[str]) -> None:
        """``endpoints`` (a new peer table's) may be sent to again, if they were forgotten."""
        if self._gone:
            for endpoint in endpoints:
                self._gone.pop(endpoint, None)

    def close(self) -> None:
        """Close every socket; idempotent."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._pending.clear()
        self._local.clear()
        for link in self._links.values():
            link.close()
        self._links.clear()
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()
