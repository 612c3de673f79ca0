"""One network receiver's connection to one producer: a DEALER driven from the event loop.

The socket's file descriptor is registered with ``loop.add_reader`` and drained until it
would block, because ZMQ signals it edge-triggered; after every send it is drained again,
since a send can consume that edge. What the receiver has to say (fetches, drops, acks) is
queued and leaves batched, once per loop turn, as one :class:`Control` message.

A monitor socket reports the connection's end, so that fetches from a producer that exited
fail at once rather than at their deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Final, Protocol

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from pipeline._encoded import DECODE_ERRORS
from pipeline._errors import TransportError
from pipeline._security import HANDSHAKE_FAILED, handshake_failure, process_keys, secure_client
from transports._network_inbound import DISCARD, PENDING, Inbound, ProtocolError
from transports._network_wire import MAX_SEGMENT, Control, Fetch, Part, Status

__all__ = ("Connection", "Handler")

#: Messages handled per wake-up, and bytes received, so that one busy producer cannot hold
#: the event loop (and the express connection's callbacks, above all) for long.
_BATCH: Final = 64
_BATCH_BYTES: Final = 2**20
#: Drops per control message, and the bytes of fetches in one (estimated): this keeps a
#: control message far below the size a producer accepts.
_PER_CONTROL: Final = 1024
_CONTROL_BYTES: Final = 2**20
#: Connection events after which a connection's fetches can never complete.
_LOST: Final = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED

_part_decoder = msgspec.msgpack.Decoder(Part)
_control_encoder = msgspec.msgpack.Encoder()


class Handler(Protocol):
    """What a connection reports to its receiver."""

    #: Acknowledge after this many bytes even in the middle of a batch.
    ack_bytes: int

    def completed(self, inbound: Inbound) -> None:
        """Every frame of ``inbound`` has arrived."""

    def refused(self, inbound: Inbound, status: int) -> None:
        """The producer answered the fetch of ``inbound`` with ``status`` and no frames."""

    def fail(self, inbound: Inbound, why: str, *, drop: bool) -> None:
        """``inbound`` cannot complete; ``drop`` asks the producer to forget it."""

    def connection_lost(self, conn: Connection, why: str, *, refused: bool = False) -> None:
        """The connection ended (``refused``: the producer refused its handshake, so it
        may well be alive); nothing pending on it will arrive."""

    def garbage(self, conn: Connection, why: str) -> None:
        """A message from the producer that is not one was dropped."""


class Connection:
    """A DEALER to one producer endpoint, the fetches pending on it, and its control queue.

    Raises:
        TransportError: ZMQ refused the endpoint.
    """

    __slots__ = (
        "_acked",
        "_acked_bytes",
        "_drain_scheduled",
        "_drops",
        "_fd",
        "_fetch_queue",
        "_flush_scheduled",
        "_handler",
        "_keys",
        "_loop",
        "_monitor",
        "_monitor_fd",
        "endpoint",
        "fetches",
        "next_xid",
        "sock",
    )

    def __init__(self, handler: Handler, endpoint: str) -> None:
        self._handler = handler
        self.endpoint = endpoint
        self._loop = asyncio.get_running_loop()
        self._keys = process_keys()
        sock: zmq.Socket[bytes] = secure_client(
            zmq.Context.instance().socket(zmq.DEALER), self._keys
        )
        try:
            sock.setsockopt(zmq.LINGER, 0)
            # HWM 0: ZMQ never drops; the producer's window bounds what is queued here.
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            # Frames above the largest segment are refused before they are allocated.
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_SEGMENT)
            sock.setsockopt(zmq.IPV6, 1)
            monitor = sock.get_monitor_socket(_LOST | HANDSHAKE_FAILED)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise TransportError(f"cannot open a socket to producer {endpoint}: {exc}") from exc
        try:
            sock.connect(endpoint)
            fd = sock.getsockopt(zmq.FD)
            monitor_fd = monitor.getsockopt(zmq.FD)
        except zmq.ZMQError as exc:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            raise TransportError(f"cannot connect to producer {endpoint}: {exc}") from exc
        assert isinstance(fd, int)
        assert isinstance(monitor_fd, int)
        self.sock = sock
        self._fd = fd
        self._monitor = monitor
        self._monitor_fd = monitor_fd
        #: Fetches sent on this connection and not yet complete, by transfer id.
        self.fetches: dict[int, Inbound] = {}
        self.next_xid = 0
        self._fetch_queue: list[Fetch] = []
        self._drops: list[bytes] = []
        self._acked = 0
        self._acked_bytes = 0
        self._flush_scheduled = False
        self._drain_scheduled = False
        self._loop.add_reader(fd, self._drain)
        self._loop.add_reader(monitor_fd, self._on_event)
        # Events may have queued before the reader was added, and the descriptor only
        # signals new ones.
        self._loop.call_soon(self._on_event)

    # -- sending --------------------------------------------------------------------------

    def fetch(self, request: Fetch) -> None:
        """Ask for a payload, within this loop turn."""
        self._fetch_queue.append(request)
        self._schedule_flush()

    def drop(self, token: bytes) -> None:
        """Tell the producer to forget a token, within this loop turn."""
        self._drops.append(token)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Send everything queued: fetches, drops and acks, batched."""
        self._flush_scheduled = False
        if self.sock.closed:
            return
        while self._fetch_queue or self._drops or self._acked:
            fetches: list[Fetch] = []
            budget = _CONTROL_BYTES
            for request in self._fetch_queue:
                budget -= 32 + 9 * len(request.sizes)
                if fetches and budget < 0:
                    break
                fetches.append(request)
            drops = self._drops[:_PER_CONTROL]
            raw = _control_encoder.encode(Control(fetches, drops, self._acked))
            try:
                self.sock.send(raw, zmq.NOBLOCK)
            except zmq.ZMQError:
                # Not expected with HWM 0 on a connecting socket; try again shortly rather
                # than lose an ack (the producer's window would shrink for good).
                self._loop.call_later(0.01, self._schedule_flush)
                break
            del self._fetch_queue[: len(fetches)], self._drops[: len(drops)]
            self._acked = 0
            self._acked_bytes = 0
        # Sending may have consumed the descriptor's edge-triggered readiness.
        self._schedule_drain()

    # -- receiving ------------------------------------------------------------------------

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled:
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_scheduled = False
        sock = self.sock
        if sock.closed:
            return
        ack_every = self._handler.ack_bytes
        received = 0
        try:
            for _ in range(_BATCH):
                if received >= _BATCH_BYTES:
                    # Let the other callbacks run: the express connection's, above all.
                    self._schedule_drain()
                    break
                try:
                    meta = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                size = self._on_message(meta)
                if size >= 0:
                    received += size
                    self._acked += 1
                    self._acked_bytes += size
                    if self._acked_bytes >= ack_every:
                        self.flush()  # Early, so the producer's window keeps moving.
            else:
                self._schedule_drain()
        except zmq.ZMQError:
            return  # Closed under us while closing.
        if self._acked:
            self.flush()

    def _on_message(self, meta: bytes) -> int:
        """Handle one producer message whose first frame was ``meta``.

        Returns:
            The size of the data frame consumed, or -1 if it carried none. Every data frame
            is acknowledged, even one that is discarded, so the producer's window closes.
        """
        sock = self.sock
        more = sock.getsockopt(zmq.RCVMORE)
        try:
            part: Part | None = _part_decoder.decode(meta)
        except DECODE_ERRORS:
            part = None
            self._handler.garbage(self, "a message whose metadata does not decode")
        inbound = None if part is None else self.fetches.get(part.xid)
        if not more:
            if inbound is not None and part is not None:
                self._handler.refused(inbound, part.status)
            return -1
        if inbound is None or part is None or part.status != Status.OK:
            size = sock.recv_into(DISCARD, flags=zmq.NOBLOCK)
        else:
            try:
                size = inbound.receive(part.index, sock)
            except ProtocolError as exc:
                size = 0
                self._handler.fail(inbound, f"protocol error: {exc}", drop=True)
            else:
                if inbound.complete:
                    del self.fetches[inbound.xid]
                    self._handler.completed(inbound)
        while sock.getsockopt(zmq.RCVMORE):
            # More than [meta, data]: a producer of another version. Skip the rest.
            sock.recv_into(DISCARD, flags=zmq.NOBLOCK)
            if inbound is not None and inbound.state == PENDING:
                self._handler.fail(inbound, "protocol error: extra frames", drop=True)
        return size

    def _on_event(self) -> None:
        monitor = self._monitor
        lost: str | None = None
        refusal: str | None = None
        while not monitor.closed:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.ZMQError:
                break  # zmq.Again: drained (or closed under us).
            kind = event["event"]
            if kind & HANDSHAKE_FAILED:
                # The producer's process is there, and refused us (or we it): what to
                # check is the keys, not whether it died (the disconnection that follows
                # would say so).
                refusal = handshake_failure(kind, self.endpoint, self._keys)
            elif kind == zmq.EVENT_DISCONNECTED:
                lost = "the connection closed (the producer exited or closed its end)"
            elif kind == zmq.EVENT_CONNECT_RETRIED:
                lost = "the connection was refused or failed (nothing listens there now)"
        if refusal is not None:
            self._handler.connection_lost(self, refusal, refused=True)
        elif lost is not None:
            self._handler.connection_lost(self, lost)

    def close(self, linger_ms: int = 0) -> None:
        """Stop watching and close the socket; messages still queued get ``linger_ms``
        milliseconds to leave (0: they are dropped)."""
        if self.sock.closed:
            return
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(self._fd)
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(self._monitor_fd)
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=linger_ms)
