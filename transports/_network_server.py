"""The network sender's server: a ROUTER that sends held payloads to receivers in turns.

A receiver's fetch starts a *transfer*. Transfers take turns, one frame each, so a payload
waits behind at most a frame or two of each larger one; a payload of one small frame is
sent as soon as it is fetched (it travels on the receiver's express connection). Each
receiver also has a *window*: at most ``window`` bytes sent to it and not yet acknowledged.
That keeps ZMQ's queues (and the kernel's) short, which is what makes taking turns matter,
and each acknowledgement proves ZMQ has finished reading a frame's block, so the block can
go back to the pool.

The socket is driven from the event loop by :class:`pipeline._sockets.SocketReader`; every
send happens while handling a receiver's message or a timer, and is followed by a re-check
for input, because a send can consume ZMQ's edge-triggered readiness.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
import zmq

from pipeline._encoded import DECODE_ERRORS, Buffer
from pipeline._errors import TransportError
from pipeline._latency import LatencyRecorder
from pipeline._logging import count_dropped
from pipeline._security import process_keys, secure_server
from pipeline._sockets import RefusedPeers, SocketReader
from transports._network_store import BlockPool, Capacity, Held
from transports._network_wire import Control, Fetch, NetworkOptions, Part, Status
from transports._protocol import EdgeContext

__all__ = ("Server",)

#: Control messages are small; anything larger is refused by ZMQ before it is allocated.
_MAX_CONTROL = 16 * 2**20
_WILDCARDS = frozenset({"*", "0.0.0.0", "::", "[::]", ""})
#: Abandoned receivers remembered for their late acks (the oldest are forgotten first).
_OWED_MEMORY = 1024

_log = structlog.get_logger("stagewire.transports.network")
_control_decoder = msgspec.msgpack.Decoder(Control)
_part_encoder = msgspec.msgpack.Encoder()


@dataclass(slots=True, eq=False)
class _Peer:
    """One receiver connected to this sender, by its ZMQ routing id."""

    ident: bytes
    #: Bytes sent and not yet acknowledged.
    inflight: int = 0
    #: One entry per data message sent, oldest first: its size and the block to reuse.
    unacked: deque[tuple[int, bytearray | None]] = field(default_factory=deque)
    #: When the receiver last showed it reads: an ack, or the first send into an empty window.
    progress: float = 0.0
    transfers: set[_Transfer] = field(default_factory=set)
    #: Set once a send to it failed or it stopped acknowledging; it is never served again.
    gone: bool = False


@dataclass(slots=True, eq=False)
class _Transfer:
    """One held payload on its way to one receiver."""

    held: Held
    peer: _Peer
    xid: int
    started: float
    next: int = 0
    done: bool = False


def _bind_address(bind_host: str) -> tuple[str, bool]:
    """The ZMQ address to bind on ``bind_host``, and whether it needs IPv6 enabled."""
    host = bind_host.strip()
    if host in _WILDCARDS:
        return "tcp://*:*", False
    if ":" in host and not host.startswith("["):
        return f"tcp://[{host}]:*", True
    return f"tcp://{host}:*", host.startswith("[")


def _advertised(endpoint: str, bind_host: str) -> str:
    """The endpoint receivers connect to: the bound one, with a wildcard replaced by our name."""
    if bind_host.strip() in _WILDCARDS:
        port = endpoint.rsplit(":", 1)[1]
        return f"tcp://{socket.gethostname()}:{port}"
    return endpoint


class Server:
    """Serves the payloads in ``held`` from a ROUTER bound on ``edge.bind_host``.

    Args:
        edge: the edge served.
        options: the transport's options (window, fetch_timeout).
        capacity: given back the bytes of each payload sent or dropped.
        pool: given back each block nothing reads any more.

    Raises:
        TransportError: the ROUTER cannot listen on the bind address.
    """

    def __init__(
        self, edge: EdgeContext, options: NetworkOptions, capacity: Capacity, pool: BlockPool
    ) -> None:
        self._edge = edge
        self._options = options
        self._capacity = capacity
        self._pool = pool
        #: Payloads waiting to be fetched or being sent, by token.
        self.held: dict[bytes, Held] = {}
        #: The transfer of each held payload that a receiver has fetched, by token.
        self._sending: dict[bytes, _Transfer] = {}
        self._peers: dict[bytes, _Peer] = {}
        #: Abandoned receivers, by routing id, and how many of the messages sent to them
        #: are still owed an ack. Their connection may live on: acks it sends late belong
        #: to those messages, not to what a new fetch on it is sent.
        self._owed: OrderedDict[bytes, int] = OrderedDict()
        self._ring: deque[_Transfer] = deque()
        self._stall_timer: asyncio.TimerHandle | None = None
        self._closed = False
        #: Bad messages received and receivers abandoned.
        self.errors = 0
        #: How long transfers took from fetch to last frame handed to ZMQ (µs).
        self.latency = LatencyRecorder()
        self._sock, self.endpoint = self._bind()
        self._reader = SocketReader(
            self._sock, self._on_message, self._on_bad_message, max_frames=2
        )
        self._reader.start()
        # Connections ZMQ refused before any message (garbage bytes, wrong keys) count too.
        try:
            self._refusals = RefusedPeers(self._sock, self._refused)
        except zmq.ZMQError as exc:  # out of descriptors, say
            self._reader.stop()
            self._sock.close(linger=0)
            raise TransportError(
                f"network sender for edge {self._edge.edge!r}: cannot watch its socket: {exc}"
            ) from exc

    def _bind(self) -> tuple[zmq.Socket[Any], str]:
        """Open and bind the ROUTER; the socket and the endpoint receivers connect to."""
        address, ipv6 = _bind_address(self._edge.bind_host)
        sock: zmq.Socket[bytes] = secure_server(
            zmq.Context.instance().socket(zmq.ROUTER), process_keys()
        )
        try:
            sock.setsockopt(zmq.LINGER, 0)
            # HWM 0: ZMQ never drops; the per-receiver window bounds what is queued.
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            # A send to a receiver that went away fails instead of vanishing, so its
            # transfers are abandoned rather than waiting for acks that never come.
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.MAXMSGSIZE, _MAX_CONTROL)
            sock.setsockopt(zmq.IPV6, int(ipv6))
            sock.bind(address)
            bound = sock.getsockopt(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise TransportError(
                f"network sender for edge {self._edge.edge!r}: cannot listen on {address} "
                f"(bind_host {self._edge.bind_host!r}): {exc}; "
                "set the process's bind address to an interface of this host"
            ) from exc
        assert isinstance(bound, bytes)
        return sock, _advertised(bound.decode(), self._edge.bind_host)

    def hold(self, held: Held) -> None:
        """Serve ``held`` to the first receiver that fetches its token."""
        self.held[held.token] = held

    def drop(self, held: Held) -> None:
        """Drop ``held`` (no receiver will fetch it), returning its unsent blocks."""
        self._drop(held)

    def drop_for(self, readers: set[str]) -> int:
        """Drop every payload sent to one of ``readers``, fetched or not; how many."""
        gone = [held for held in self.held.values() if held.reader in readers]
        for held in gone:
            self._drop(held)
        return len(gone)

    def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            raise ValueError(f"a control message of {len(frames)} frames")
        ident, raw = frames
        control = _control_decoder.decode(raw)
        peer = self._peers.get(ident)
        ack = control.ack
        if ack and ident in self._owed:
            owed = self._owed.pop(ident)
            if owed > ack:
                self._owed[ident] = owed - ack
            ack = max(0, ack - owed)
        if ack and peer is not None:
            self._acked(peer, ack)
        for token in control.drop:
            held = self.held.get(token)
            if held is not None:
                self._drop(held)
        for fetch in control.fetch:
            if peer is None:
                peer = self._peers[ident] = _Peer(ident)
            self._serve(peer, fetch)
        self._pump()
        if peer is not None and not peer.transfers and not peer.unacked:
            self._peers.pop(ident, None)
        # Sending may have consumed the socket's edge-triggered readiness.
        self._reader.kick()

    def _on_bad_message(self, exc: BaseException, frames: list[bytes]) -> None:
        # A receiver of another version, or a stray client: its message is ignored, counted
        # and logged now and then, rather than stopping the sender.
        if not isinstance(exc, (ValueError, *DECODE_ERRORS)):
            # A bug here, not a bad peer. Raising would stop the reader's drain and strand
            # queued messages behind ZMQ's edge-triggered descriptor, so it is logged.
            self.errors += 1
            _log.error("network_sender_failed", edge=self._edge.edge, exc_info=exc)
            return
        self.errors = count_dropped(
            _log, "network_message_dropped", self.errors, edge=self._edge.edge, error=str(exc)
        )

    def _refused(self, why: str) -> None:
        self.errors = count_dropped(
            _log, "network_message_dropped", self.errors, edge=self._edge.edge, error=why
        )

    def _acked(self, peer: _Peer, count: int) -> None:
        unacked = peer.unacked
        for _ in range(min(count, len(unacked))):
            size, block = unacked.popleft()
            peer.inflight -= size
            if block is not None:
                self._pool.give(block)
        peer.progress = time.monotonic()

    def _serve(self, peer: _Peer, fetch: Fetch) -> None:
        if peer.gone:
            return
        held = self.held.get(fetch.token)
        status = Status.OK
        if held is None:
            status = Status.UNKNOWN
        elif held.sending:
            status = Status.BUSY
        elif held.sizes != fetch.sizes:
            status = Status.MISMATCH
        if status != Status.OK or held is None:
            self._send(peer, fetch.xid, 0, status, None)
            return
        held.sending = True
        transfer = _Transfer(held, peer, fetch.xid, time.monotonic())
        peer.transfers.add(transfer)
        self._sending[held.token] = transfer
        if held.express:
            if self._send_frame(transfer):
                self._finish(transfer)
            return
        self._ring.append(transfer)

    def _pump(self) -> None:
        """Send one frame of each transfer in turn while their receivers' windows allow."""
        ring = self._ring
        window = self._options.window
        blocked = 0
        while ring and blocked < len(ring):
            transfer = ring.popleft()
            if transfer.done:
                continue
            peer = transfer.peer
            size = memoryview(transfer.held.frames[transfer.next]).nbytes
            if peer.inflight and peer.inflight + size > window:
                ring.append(transfer)
                blocked += 1
                continue
            blocked = 0
            if not self._send_frame(transfer):
                continue
            if transfer.next < len(transfer.held.frames):
                ring.append(transfer)
            else:
                self._finish(transfer)

    def _send_frame(self, transfer: _Transfer) -> bool:
        """Send the next frame of ``transfer``; ``False`` if its receiver has gone."""
        held = transfer.held
        index = transfer.next
        data = held.frames[index]
        if not self._send(transfer.peer, transfer.xid, index, Status.OK, data):
            return False
        peer = transfer.peer
        size = memoryview(data).nbytes
        if not peer.unacked:
            peer.progress = time.monotonic()
        # The block now belongs to the in-flight record: it returns to the pool on the ack.
        peer.unacked.append((size, held.blocks[index]))
        held.blocks[index] = None
        held.frames[index] = b""
        peer.inflight += size
        transfer.next = index + 1
        self._arm_stall_timer()
        return True

    def _send(self, peer: _Peer, xid: int, index: int, status: int, data: Buffer | None) -> bool:
        """Send one message to ``peer``; on failure abandon the peer and return ``False``."""
        meta = _part_encoder.encode(Part(xid, index, status))
        parts: list[Any] = [peer.ident, meta] if data is None else [peer.ident, meta, data]
        try:
            self._sock.send_multipart(parts, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            # EHOSTUNREACH: the receiver disconnected. Nothing else can fail with HWM 0.
            self._abandon(peer)
            return False
        return True

    def _finish(self, transfer: _Transfer) -> None:
        """The last frame is sent: forget the payload and free its capacity."""
        transfer.done = True
        transfer.peer.transfers.discard(transfer)
        held = transfer.held
        self._sending.pop(held.token, None)
        if self.held.pop(held.token, None) is not None:
            self._capacity.give(held.nbytes)
        self.latency.add((time.monotonic() - transfer.started) * 1e6)

    def _drop(self, held: Held) -> None:
        """Forget a payload a receiver will not fetch, returning its unsent blocks."""
        if self.held.pop(held.token, None) is None:
            return
        self._capacity.give(held.nbytes)
        for i, block in enumerate(held.blocks):
            if block is not None:
                self._pool.give(block)
                held.blocks[i] = None
        held.frames.clear()
        transfer = self._sending.pop(held.token, None)
        if transfer is not None:
            # Lazily removed from the ring; frames it already sent return on their acks.
            transfer.done = True
            transfer.peer.transfers.discard(transfer)

    def _abandon(self, peer: _Peer) -> None:
        """Give up on a receiver that went away or stopped reading.

        Its transfers can never complete (a fetch is served once), so their payloads are
        dropped. Blocks it has not acknowledged are left to the garbage collector: ZMQ may
        still be reading them.
        """
        self._peers.pop(peer.ident, None)
        self.errors += 1
        peer.gone = True
        if peer.unacked:
            self._owed[peer.ident] = self._owed.get(peer.ident, 0) + len(peer.unacked)
            while len(self._owed) > _OWED_MEMORY:
                self._owed.popitem(last=False)
        peer.unacked.clear()
        peer.inflight = 0
        for transfer in list(peer.transfers):
            transfer.done = True
            self._drop(transfer.held)
        peer.transfers.clear()

    def _arm_stall_timer(self) -> None:
        if self._stall_timer is None and not self._closed:
            loop = asyncio.get_running_loop()
            delay = self._options.fetch_timeout / 2
            self._stall_timer = loop.call_later(delay, self._check_stalls)

    def _check_stalls(self) -> None:
        """Abandon receivers that have not acknowledged anything for ``fetch_timeout``."""
        self._stall_timer = None
        limit = time.monotonic() - self._options.fetch_timeout
        waiting = False
        for peer in list(self._peers.values()):
            if not peer.unacked:
                continue
            if peer.progress < limit:
                self._abandon(peer)
            else:
                waiting = True
        if waiting:
            self._arm_stall_timer()
        self._pump()
        self._reader.kick()

    def close(self) -> None:
        """Close the socket (linger 0) and forget everything held."""
        if self._closed:
            return
        self._closed = True
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        self._reader.stop()
        self._refusals.stop()
        self._sock.close(linger=0)
        self.held.clear()
        self._sending.clear()
        self._peers.clear()
        self._ring.clear()
