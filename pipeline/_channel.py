"""Typed channels: the two ends of one edge inside the stage processes.

:class:`OutputChannel` (producer side) numbers each request's chunks, waits for credit,
puts the payload through the edge's transport and sends the envelope. :class:`InputChannel`
(consumer side) fetches and decodes payloads from descriptors and returns credit.

Flow control is a window per (request, edge): a producer may run at most ``window`` chunks
and ``window_bytes`` payload bytes ahead of what the consumer's handler has taken (a chunk
larger than ``window_bytes`` still goes, alone). Windows are per request, so a request
whose consumer has not started yet never starves another request's stream, and memory
held for an edge is bounded by a window per admitted request. The consumer returns credit
every half window of chunks, and at once when the producer says its byte window is full.

A transport with a fixed capacity shared by the whole edge (the shm arena) needs one more
bound. A consumer may hold several requests at once and run only some of them (its
``max_concurrency``): the others are *queued*, and nothing reads their payloads until a
running request ends. Had each queued request its whole window, their payloads could fill
the arena, and a running request's next put would wait for room that only its own end
could free: it would fail (``TransportFull``) or fall back. So the payloads that requests
not yet being read hold in such a transport share at most :data:`QUEUED_SHARE` of its
capacity (and one byte window), across the edge; past it, such a request sends nothing
more until its consumer begins reading it. A consumer with this one input starts no
request before its first chunk, so a first chunk waits for the share too, while its own
consumer replica has requests queued ahead of it: those have their first chunks there and
run when their turn comes, and one replica's queue (its handler stuck, say) holds up no
other replica's requests. Sends held back go in the order they began waiting, ahead of
sends that have not waited, so a steady stream of newcomers cannot starve one. A join's
first chunk goes regardless: its handler may have started on another input and wait for
this one. On such edges the consumer returns
credit at once for the first chunk it takes, which is how the producer learns that a
request is being read.

A request being read can stop being read too: its client reads no more, or its handler
waits to send on. Its window of chunks then waits in the consumer's reorder buffer, each
holding its extent, and a few such requests could hold the whole arena. So a producer
whose put finds no room sends :class:`~pipeline._messages.Spill` to the consumers it
sent payloads to, and each copies what requests whose readers stopped (nothing taken for
:data:`SPILL_STALL_S`) hold in the arena into its own memory and releases it
(:meth:`InputChannel.spill`): the stopped requests keep their windows, as they would by
network, and the room comes back to those being read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import msgspec
import structlog

from pipeline._codec import codec_for
from pipeline._encoded import DECODE_ERRORS, Encoded, to_host
from pipeline._errors import (
    EndOfChannel,
    PayloadError,
    ProducerLost,
    RequestAborted,
    StageUnavailable,
    TransportError,
    TransportFull,
)
from pipeline._host import split_endpoint
from pipeline._keys import ChunkKey
from pipeline._latency import LatencyRecorder
from pipeline._messages import NO_DESCRIPTOR, Chunks, ChunksOut, Credit, Spill, encode_message
from pipeline._reorder import ReorderBuffer
from pipeline._signature import EdgePlan
from pipeline._sockets import SendData
from pipeline._stage import NOT_READY
from transports._protocol import Descriptor, EdgeContext, TransportReceiver, TransportSender
from transports._registry import create_transport, resolve_transport
from transports.auto import AutoPolicy
from transports.inline import MAX_INLINE, InlineReceiver, InlineSender

log = structlog.get_logger("stagewire.channel")

__all__ = (
    "COPIED",
    "LONE_WINDOWS",
    "QUEUED_SHARE",
    "Copied",
    "Inflow",
    "InputChannel",
    "Item",
    "OutputChannel",
    "QueueAwareSender",
    "SendTarget",
    "file_run",
    "unreadable",
)


_nothing_decoder = msgspec.msgpack.Decoder(list[None])
_raw_list_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])

#: Most chunks one run (one :class:`Chunks` envelope) carries.
MAX_RUN = 256

#: A request alone on its edge at the consumer may run this many windows ahead. With
#: nobody to share the consumer with, the window bounds only its memory (and the byte
#: window still applies); a wider one lets the producer send, and the consumer credit, in
#: bursts this many times longer, with that many times fewer wake-ups on both sides. With
#: two requests or more on the edge each gets one window, so none runs far ahead of the
#: others.
LONE_WINDOWS = 4

#: The part of a shared transport capacity (the shm arena) that the payloads of requests
#: not yet being read may hold together (a join's first chunks on top). A quarter: with
#: the default arena (128 MiB) a request being read still has its whole byte window (64
#: MiB), with room left for a join's first chunks.
QUEUED_SHARE = 0.25
#: How often a send held back by the queued share looks again: the share also drops when
#: a consumer releases a queued payload unread (its request aborted), which wakes no one.
QUEUED_RECHECK_S = 0.05
#: A request whose reader took nothing for this long (seconds) counts as stopped when its
#: producer runs out of room: what it holds is copied out (see InputChannel.spill).
SPILL_STALL_S = 0.1
#: Past this many requests noted as queued on an edge, those no longer queued are pruned.
QUEUED_READERS_PRUNE = 1024
#: How long a closing input channel waits at most for the releases under way (seconds):
#: each takes a write to shared memory or a message, unless its transport is stuck.
RELEASES_WAIT_S = 5.0


@runtime_checkable
class QueueAwareSender(TransportSender, Protocol):
    """A sending end whose capacity is shared by the whole edge, and which counts what it
    holds for requests whose consumer has not begun reading them (see the module
    docstring). :class:`transports.shm.ShmSender` is one; another transport whose
    capabilities say ``bounded`` gets the same protection by implementing these four
    members."""

    @property
    def capacity(self) -> int:
        """The shared capacity, in bytes."""
        ...

    def hold_queued(self, descriptor: Any, request_id: str) -> None:
        """Count the payload ``descriptor`` names as held for a queued request."""
        ...

    def now_reading(self, request_id: str) -> bool:
        """Stop counting the payloads of ``request_id``; whether any were counted."""
        ...

    def queued_bytes(self) -> int:
        """Bytes held for queued requests now."""
        ...


def _bounded(name: str) -> bool:
    """Whether transport ``name`` can run out of capacity (its ``bounded`` capability)."""
    return bool(getattr(getattr(resolve_transport(name), "capabilities", None), "bounded", False))


def _bind_host(endpoint: str) -> str:
    """The address of a ``tcp://HOST:PORT`` endpoint; loopback for anything else."""
    split = split_endpoint(endpoint)
    return "127.0.0.1" if split is None else split[0]


@dataclass(frozen=True, slots=True)
class SendTarget:
    """The consumer replica of one request on one edge."""

    endpoint: str
    host: str
    #: Its process id on its host (0: unknown or not ours to check): a transport holding
    #: a payload for it can take the payload back if that process dies before reading it.
    pid: int = 0


#: A received chunk as filed in a reorder buffer: ``(transport, descriptor, sender)``, where
#: ``descriptor`` is None for a chunk without payload and ``sender`` is where credit goes.
#: A plain tuple: one is made per chunk, and a class instance cost several times more.
Item = tuple[str, Descriptor | None, str]


#: The transport name of an item whose payload was copied out of its transport into this
#: process's memory (see :meth:`InputChannel.spill`); no transport can be named so.
COPIED = "(copied)"


class Copied(Descriptor, frozen=True, tag="copied"):
    """A payload copied out of its transport, in place of the descriptor that named it. It
    never travels: it lives in a consumer's reorder buffer until its handler takes it."""

    encoded: Encoded


def _decode_nothing(raw: msgspec.Raw) -> Sequence[Descriptor | None]:
    """The descriptors of a run that names no transport: every one must be nil."""
    try:
        return _nothing_decoder.decode(raw)
    except DECODE_ERRORS as exc:
        raise TransportError(f"a chunk naming no transport has a descriptor: {exc}") from exc


def _one_by_one(recv: TransportReceiver) -> Callable[[msgspec.Raw], Sequence[Descriptor | None]]:
    """Parse a descriptor array element by element, for a transport with no array parser."""

    def decode(raw: msgspec.Raw) -> list[Descriptor | None]:
        try:
            elements = _raw_list_decoder.decode(raw)
        except DECODE_ERRORS as exc:
            raise TransportError(f"malformed descriptor array: {exc}") from exc
        decoded: list[Descriptor | None] = []
        try:
            for e in elements:
                decoded.append(None if e == NO_DESCRIPTOR else recv.decode_descriptor(e))
        except Exception:
            # The run is dropped whole: what its valid descriptors name (a prefetch under
            # way, a payload held for us) is released, not held for ever.
            for d in decoded:
                if d is not None:
                    _release_later(recv, d)
            raise
        return decoded

    return decode


def needing_producer(names: Sequence[str]) -> frozenset[str]:
    """Those of transports ``names`` whose payloads need their producer's process even
    once got (they do not declare ``survives_producer``: cuda_ipc, plug-ins by default)."""
    return frozenset(
        n
        for n in names
        if not getattr(resolve_transport(n).capabilities, "survives_producer", False)
    )


def file_run(inflow: Inflow, run: Chunks, items: list[Item]) -> int:
    """Offer a run's items to the inflow's buffer under their seqs; how many it refused."""
    buffer = inflow.buffer
    seq = run.first
    inflow.sender = run.sender
    fetched = bool(run.transport) and run.transport != "inline"
    if run.credit:
        # The producer waits for credit once this run's last chunk is taken.
        asked = seq + len(items)
        if asked > inflow.asked:
            inflow.asked = asked
            inflow.credit_due = min(inflow.credit_due, asked)
    last = seq + len(items) - 1
    final = run.final
    refused = 0
    for item in items:
        if not buffer.offer(seq, item, final and seq == last):
            refused += 1
        elif fetched and item[1] is not None:
            inflow.unfetched += 1
        seq += 1
    return refused


def unreadable(run: Chunks, exc: Exception) -> TransportError:
    """The error of a request whose run of chunks ``admit`` refused with ``exc``."""
    return TransportError(
        f"edge {run.edge!r}: chunks {run.first}.. from {run.sender or '?'} cannot be read: {exc}"
    )


def _outcome_dropped(task: asyncio.Task[Any]) -> None:
    """Retrieve a finished task's outcome that nobody awaits, so asyncio does not log it."""
    if not task.cancelled():
        task.exception()


class Inflow:
    """One request's position on one input edge: its reorder buffer and credit marks."""

    __slots__ = (
        "_on_end",
        "asked",
        "buffer",
        "credit_due",
        "fetching",
        "fragile",
        "held",
        "sender",
        "stall",
        "taken",
        "told",
        "unfetched",
    )

    def __init__(
        self,
        buffer: ReorderBuffer[Item],
        first_credit: int,
        on_end: Callable[[], None] | None = None,
    ) -> None:
        self.buffer = buffer
        #: Called once, when the inflow ends.
        self._on_end = on_end
        self.taken = 0
        #: Where the producer takes credit (known from its first run).
        self.sender = ""
        #: Credit goes back once this many chunks are taken.
        self.credit_due = first_credit
        #: The producer waits for credit once this many are taken (its byte window is full).
        self.asked = 0
        #: The next chunk, taken from the buffer by ``poll`` but left for ``next`` to fetch.
        self.held: tuple[Item, bool] | None = None
        #: The next chunk's fetch, still running after the read that started it was
        #: cancelled (a handler's own timeout): the next read takes its payload.
        self.fetching: tuple[asyncio.Task[Any], Item, bool] | None = None
        #: Chunks filed whose payloads are still to be got from a transport (not inside
        #: their envelopes): buffered, held, or being fetched.
        self.unfetched = 0
        #: The owner has reported this inflow drained (a mark of the owner's own).
        self.told = False
        #: A payload came by a transport that needs its producer even once got (see
        #: :func:`needing_producer`): however drained, the producer stays needed.
        self.fragile = False
        #: ``taken`` when last looked at by :meth:`stalled`, and since when it was so.
        self.stall: tuple[int, float] | None = None

    def stalled(self, now: float, least: float) -> bool:
        """Whether the reader took nothing for ``least`` seconds, as far as looks at
        ``now`` and before can tell (the first look starts the count)."""
        stall = self.stall
        if stall is None or stall[0] != self.taken:
            stall = self.stall = (self.taken, now)
        return now - stall[1] >= least

    @property
    def drained(self) -> bool:
        """Whether this process has all of the request's payloads on this edge: every chunk
        arrived, and those carried by a transport were got. (The stream's end marker, which
        carries none, need not have been read.)"""
        return self.unfetched == 0 and self.buffer.complete

    def describe(self) -> dict[str, Any]:
        """Where this request stands on the edge, for a report of a request that seems stuck."""
        buf = self.buffer
        return {
            "next_seq": buf.expected,
            "buffered": buf.buffered,
            "final_seq": buf.final_seq,
            "waiting": buf.waiting,
            "taken": self.taken,
            "unfetched": self.unfetched,
            "fetching": self.fetching is not None,
            "credit_due": self.credit_due,
            "sender": self.sender,
        }

    def reading(self, item: Item) -> bool:
        """Whether ``item`` is the chunk the reader has taken and not yet finished with."""
        held, fetching = self.held, self.fetching
        return (held is not None and held[0] == item) or (
            fetching is not None and fetching[1] == item
        )

    def end(self, exc: BaseException | None = None) -> None:
        """Release everything held: fail a waiting reader with ``exc``, or end its stream.

        Raises:
            Exception: the first error releasing an item raised, once all were released.
        """
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end()
        held, self.held = self.held, None
        fetching, self.fetching = self.fetching, None
        if fetching is not None:
            # Left to finish: the fetch releases its payload as it ends (cancelled before
            # its first step it would not), and its outcome is nobody's now.
            fetching[0].add_done_callback(_outcome_dropped)
        if exc is not None:
            self.buffer.abort(exc)
        else:
            self.buffer.close()
        if held is not None:
            self.buffer.discard(held[0])


class _Run:
    """Chunks of one request queued on one edge for the same batch; encoded as it leaves.

    The outbox calls :meth:`seal` when the batch leaves, once per run, so a stream of small
    chunks pays one envelope encode per batch instead of one per chunk.
    """

    __slots__ = (
        "credit",
        "descriptors",
        "final",
        "first",
        "nbytes",
        "owner",
        "request_id",
        "sealed",
        "sent_ns",
        "transport",
    )

    def __init__(self, owner: OutputChannel, request_id: str, first: int, transport: str) -> None:
        self.owner = owner
        self.request_id = request_id
        self.first = first
        self.transport = transport
        self.descriptors: list[Descriptor | None] = []
        #: The bytes of its chunks' payloads: at most MAX_INLINE, so that its envelope fits
        #: in a data message however its payloads travel.
        self.nbytes = 0
        self.final = False
        self.sealed = False
        self.credit = False
        self.sent_ns = time.monotonic_ns()

    def seal(self) -> bytes:
        """The run's envelope, encoded; nothing can join the run after this."""
        self.sealed = True
        owner = self.owner
        return encode_message(
            ChunksOut(
                self.request_id,
                owner.plan.name,
                self.first,
                self.final,
                self.transport,
                self.descriptors,
                owner.endpoint,
                owner.host,
                self.sent_ns,
                self.credit,
            )
        )


class _Window:
    __slots__ = (
        "acked",
        "allowed",
        "done",
        "held",
        "in_flight",
        "next_seq",
        "reader",
        "reading",
        "run",
        "sizes",
        "waiter",
    )

    def __init__(self, window: int, reading: bool) -> None:
        self.next_seq = 0
        #: The consumer read all it will of this request: later chunks are dropped here.
        self.done = False
        #: The consumer has begun reading this request (its first credit came), or the edge
        #: has no capacity shared with queued requests to protect.
        self.reading = reading
        self.allowed = window
        #: Chunks below this were taken by the consumer (its latest credit).
        self.acked = 0
        #: Payload bytes of chunks ``acked .. next_seq - 1``, each, and in all.
        self.sizes: deque[int] = deque()
        self.in_flight = 0
        self.waiter: asyncio.Future[None] | None = None
        #: The run the next chunk may join, until the outbox seals it.
        self.run: _Run | None = None
        #: A chunk went by a transport whose payload needs this process even after its
        #: consumer got it (see ``TransportCapabilities.survives_producer``).
        self.held = False
        #: The consumer's data endpoint.
        self.reader = ""

    def ended(self) -> bool:
        """Whether the consumer reads no more of the request (``done``, read afresh: a
        method, so that a type checker does not carry what it knew across an await)."""
        return self.done


class OutputChannel:
    """The producer's end of one edge.

    Attributes:
        codec: the codec of the edge's payload type.
        endpoint: where this end receives credit.
        host: the host identity of this end.
    """

    def __init__(
        self,
        plan: EdgePlan,
        *,
        host: str,
        endpoint: str,
        send: SendData,
    ) -> None:
        self.plan = plan
        self.host = host
        self.endpoint = endpoint
        self.codec = codec_for(plan.payload_type)
        self._send = send
        self._windows: dict[str, _Window] = {}
        self._window_bytes = plan.window_bytes
        ctx = EdgeContext(
            plan.name,
            host,
            plan.transport.options,
            plan.inline_threshold,
            bind_host=_bind_host(endpoint),
        )
        self._transports = edge = plan.transports
        # Built once: choosing happens per chunk, and only the peer's host varies.
        self._local_policy = AutoPolicy(plan.inline_threshold, same_host=True)
        self._remote_policy = AutoPolicy(plan.inline_threshold, same_host=False)
        self._senders: dict[str, TransportSender] = {
            name: create_transport(name, edge.options[name]).open_sender(ctx) for name in edge.names
        }
        self._fixed = None if edge.auto else self._senders[edge.kind]
        # Optional: where a transport holds payloads until read, whom each was sent to.
        self._note_reader: dict[str, Callable[[Any, str, int], None] | None] = {
            name: getattr(sender, "note_reader", None) for name, sender in self._senders.items()
        }
        inline = self._senders.get("inline")
        self._inline = inline if isinstance(inline, InlineSender) else None
        # Statistics name what carried each chunk by the transport's own name, so a plug-in
        # given by import path shows up as, say, "rdma".
        self._names = {n: str(getattr(resolve_transport(n), "name", n)) for n in edge.names}
        # Transports that take tensors still on a GPU; the others get host copies.
        self._on_device = frozenset(
            n
            for n in edge.names
            if getattr(resolve_transport(n).capabilities, "device_buffers", False)
        )
        # Transports whose payloads need this process even once their consumer got them
        # (cuda_ipc's imported memory): a request that sent by one is never done here early.
        self._needs_producer = needing_producer(edge.names)
        self.chunks = 0
        self.bytes = 0
        self.fallbacks = 0
        #: Chunks dropped here because their consumer had stopped reading the stream.
        self.unread = 0
        #: Sends that waited because queued requests held their share of the capacity.
        self.queued_waits = 0
        self._used = dict.fromkeys(edge.names, 0)
        # The transport whose capacity queued requests may fill, if any, and their share of it.
        # Only a bounded one: the consumer credits a request's first chunk at once only on a
        # bounded edge, and a request held back here waits for that credit.
        self._shared: QueueAwareSender | None = next(
            (
                s
                for n, s in self._senders.items()
                if isinstance(s, QueueAwareSender) and _bounded(n)
            ),
            None,
        )
        self._queued_share = 0
        #: The shared transport's name, and the consumer endpoints it holds payloads for:
        #: asked to copy them out when it runs out of room (see :meth:`_short_of_room`).
        self._shared_name = ""
        self._shared_readers: set[str] = set()
        #: How often the shared transport ran out of room and the consumers were asked.
        self.spill_asks = 0
        if self._shared is not None:
            share = int(self._shared.capacity * QUEUED_SHARE)
            self._queued_share = max(1, min(self._window_bytes, share))
            self._shared_name = next(n for n, s in self._senders.items() if s is self._shared)
            if hasattr(self._shared, "on_short"):
                self._shared.on_short = self._short_of_room
        #: Bytes of queued requests' puts into the shared transport still under way: not yet
        #: counted there, but already promised.
        self._queued_putting = 0
        #: Windows whose send waits for the queued share to drop, in the order they began
        #: waiting, each with whether its chunk is the request's first: when the share has
        #: room they go in that order, ahead of any send that has not waited.
        self._queued_waiting: dict[_Window, bool] = {}
        #: The consumer replica (its endpoint) of each request with payloads counted as
        #: queued in the shared transport; pruned as the transport stops counting them.
        self._queued_readers: dict[str, str] = {}
        #: The same for the queued requests' puts under way (not yet counted there).
        self._putting_for: dict[ChunkKey, str] = {}

    def _window(self, request_id: str, reader: str) -> _Window:
        win = self._windows.get(request_id)
        if win is None:
            win = self._windows[request_id] = _Window(self.plan.window, self._shared is None)
            # Known before any put: readers_gone must find a send still putting its first
            # chunk (shm waiting for room) as well as one waiting for credit.
            win.reader = reader
        return win

    def stop_for(self, request_id: str, reader: str) -> None:
        """Send nothing more of ``request_id`` on this edge: its consumer, at ``reader``,
        is gone (the request goes on without it). Its sends are dropped as unread."""
        win = self._window(request_id, reader)
        if not win.done:
            win.done = True
            if win.waiter is not None and not win.waiter.done():
                win.waiter.set_result(None)

    async def reserve(self) -> None:
        """Take now what the edge's pinned transport would take at its first put (shm: its
        segment), so that a host without the room fails at start-up, not mid-run. An edge on
        ``auto``, or with a fallback, takes nothing here, or only warns: its payloads go
        elsewhere while a transport lacks room.

        Raises:
            TransportError: the pinned transport, with no fallback, cannot have what it needs.
        """
        reserve = getattr(self._fixed, "reserve", None)
        if reserve is None:
            return
        try:
            await reserve()
        except TransportError as exc:
            if self._transports.fallback is None:
                raise
            log.warning(
                "transport_unavailable",
                edge=self.plan.name,
                error=str(exc),
                fallback=self._transports.fallback,
            )

    def try_send(
        self, request_id: str, encoded: Encoded | None, final: bool, target: SendTarget
    ) -> bool:
        """Send one chunk at once if nothing needs waiting for, as :meth:`send` would.

        That is when the request has credit left and the payload goes inline (or there is
        none): the common case of a stream of small chunks, which then costs no coroutine.

        Returns:
            True when the chunk was sent; False when it was not touched, and :meth:`send`
            must send it.

        Raises:
            TransportError: the inline sender is closed.
        """
        win = self._windows.get(request_id)
        if win is None:
            win = self._window(request_id, target.endpoint)
        if win.done:
            self.unread += 1
            return True
        seq = win.next_seq
        if seq >= win.allowed:
            return False
        if encoded is None:
            win.next_seq = seq + 1
            self._queue(win, request_id, seq, "", None, True, target.endpoint, 0)
            return True
        if (
            encoded.device_buffers
            or win.in_flight >= self._window_bytes
            or encoded.nbytes > MAX_INLINE
        ):
            return False
        inline = self._inline
        if inline is None:
            return False
        if self._fixed is inline:
            name = "inline"
        else:
            name, sender = self._choose(encoded, target)
            if sender is not inline:
                return False
        descriptor = inline.wrap(encoded)
        win.next_seq = seq + 1
        nbytes = encoded.nbytes
        self.bytes += nbytes
        self._used[name] += 1
        self._queue(win, request_id, seq, name, descriptor, final, target.endpoint, nbytes)
        return True

    async def send(
        self, request_id: str, encoded: Encoded | None, final: bool, target: SendTarget
    ) -> None:
        """Send one chunk of ``request_id``, waiting for credit first.

        ``encoded`` of ``None`` sends a payload-less final chunk: the end of a stream.

        Raises:
            RequestAborted: the request was aborted while waiting for credit.
            TransportError: the transport could not store the payload.
        """
        win = self._window(request_id, target.endpoint)
        # A chunk without payload holds no bytes: only the chunk window applies to it.
        cap = self._window_bytes if encoded is not None else 1 << 62
        while not win.done and (win.next_seq >= win.allowed or win.in_flight >= cap):
            win.waiter = asyncio.get_running_loop().create_future()
            try:
                await win.waiter
            finally:
                win.waiter = None
        if win.done:
            self.unread += 1
            return
        if encoded is None:
            seq = win.next_seq
            win.next_seq += 1
            self._queue(win, request_id, seq, "", None, True, target.endpoint, 0)
            return
        name, sender = self._choose(encoded, target)
        queued = False
        if sender is self._shared and not win.reading:
            first = not win.next_seq
            if (
                not (first and self.plan.joined)
                and not self._may_go(win, first)
                and not await self._wait_queued(win, first)
            ):
                self.unread += 1
                return
            queued = True
        seq = win.next_seq
        win.next_seq += 1
        if encoded.device_buffers and name not in self._on_device:
            encoded = to_host(encoded)
        descriptor: Descriptor
        try:
            if isinstance(sender, InlineSender):
                descriptor = sender.wrap(encoded)
            elif queued:
                descriptor = await self._put_queued(request_id, win, seq, encoded)
            else:
                key = ChunkKey(request_id, self.plan.name, seq)
                descriptor = await sender.put(key, encoded, timeout=self._transports.full_timeout)
        except TransportFull:
            name = self._transports.fallback or ""
            if not name:
                raise
            if win.ended():
                # Its consumer went (or stopped reading) while the put waited for room: a
                # fallback put begun now would hold a payload nobody fetches.
                self.unread += 1
                return
            self.fallbacks += 1
            if encoded.device_buffers and name not in self._on_device:
                encoded = to_host(encoded)
            key = ChunkKey(request_id, self.plan.name, seq)
            descriptor = await self._senders[name].put(
                key, encoded, timeout=self.plan.chunk_timeout
            )
        note = self._note_reader[name]
        if note is not None:
            note(descriptor, target.endpoint, target.pid if target.host == self.host else 0)
        if name == self._shared_name:
            self._shared_readers.add(target.endpoint)
        self._count(name, encoded)
        self._queue(win, request_id, seq, name, descriptor, final, target.endpoint, encoded.nbytes)

    def _short_of_room(self) -> None:
        """The shared transport has no room for a put: ask every consumer it holds
        payloads for to copy out, and release, those of requests whose readers stopped
        (:meth:`InputChannel.spill`). Such a request (its client reads no more, its
        handler waits to send elsewhere) then holds its window of chunks in its consumer's
        memory, as it would by network, not in the room every request shares."""
        self.spill_asks += 1
        message = encode_message(Spill(self.plan.name, self._shared_name))
        for endpoint in self._shared_readers:
            self._send(endpoint, message)

    def _queued_full(self) -> bool:
        """Whether queued requests hold their whole share of the shared transport."""
        assert self._shared is not None
        return self._shared.queued_bytes() + self._queued_putting >= self._queued_share

    def _holds_back(self, win: _Window, first: bool) -> bool:
        """Whether a chunk of ``win`` (its request not being read) waits for the queued
        share: a first chunk only while its own consumer replica has requests queued
        ahead of it (another replica's queue is not its turn to wait for)."""
        if not self._queued_full():
            return False
        if not first:
            return True
        # Its requests queued at that replica: their windows may be gone (a producer
        # forgets a request once its handler ends), their payloads still queued there.
        if not self._prune_queued_readers():
            return True  # a transport that cannot say whose payloads are queued
        reader = win.reader
        return reader in self._queued_readers.values() or reader in self._putting_for.values()

    def _may_go(self, win: _Window, first: bool) -> bool:
        """Whether a chunk of ``win`` (its request not being read) may go into the shared
        transport now: it is not held back, and no send that began waiting before it may
        go (that one goes first, woken here, or a stream of newcomers could take every
        moment the share has room, and starve it: a request held back for minutes)."""
        if self._holds_back(win, first):
            return False
        return not self._wake_first_in_line(before=win)

    def _wake_first_in_line(self, before: _Window | None = None) -> bool:
        """Wake the send that waits longest in the queued share's line, ahead of ``before``,
        and may go now; False when there is none. Those on the way whose request ended or
        is being read are woken too, to leave the line."""
        for other, other_first in self._queued_waiting.items():
            if other is before:
                return False
            if other.done or other.reading:
                if other.waiter is not None:
                    _wake(other.waiter)
                continue
            if self._holds_back(other, other_first):
                continue
            if other.waiter is not None:
                _wake(other.waiter)
            return True
        return False

    def _prune_queued_readers(self) -> bool:
        """Forget the readers of requests whose payloads no longer count as queued (read,
        released, taken back); False when the shared transport cannot say which do."""
        queued = getattr(self._shared, "queued_requests", None)
        if queued is None:
            return False
        self._shared.queued_bytes()  # type: ignore[union-attr]  # takes back what was released
        held = queued()
        readers = self._queued_readers
        for request_id in [r for r in readers if r not in held]:
            del readers[request_id]
        return True

    async def _wait_queued(self, win: _Window, first: bool = False) -> bool:
        """Wait until the request of ``win`` is being read, or queued requests hold less
        than their share of the shared transport (for a ``first`` chunk: or its consumer
        replica has no request queued), or its consumer stops reading it.

        Returns:
            False when its consumer stopped reading it: the chunk is not to be sent.

        Raises:
            RequestAborted: the request was aborted meanwhile.
        """
        self.queued_waits += 1
        self._queued_waiting[win] = first
        try:
            loop = asyncio.get_running_loop()
            while not win.done and not win.reading and not self._may_go(win, first):
                waiter = win.waiter = loop.create_future()
                recheck = loop.call_later(QUEUED_RECHECK_S, _wake, waiter)
                try:
                    await waiter
                finally:
                    recheck.cancel()
                    win.waiter = None
        finally:
            self._queued_waiting.pop(win, None)
            # The next in line that may go now (the share still has room) goes.
            self._wake_first_in_line()
        return not win.done

    async def _put_queued(
        self, request_id: str, win: _Window, seq: int, encoded: Encoded
    ) -> Descriptor:
        """Put a chunk of a request not yet being read into the shared transport, counting it
        as the queued requests' until its consumer begins reading.

        Raises:
            TransportFull: no room came within the edge's ``full_timeout``.
            TransportError: the transport could not store the payload.
        """
        shared = self._shared
        assert shared is not None
        key = ChunkKey(request_id, self.plan.name, seq)
        nbytes = encoded.nbytes
        self._queued_putting += nbytes
        putting = self._putting_for[key] = win.reader
        try:
            descriptor = await shared.put(key, encoded, timeout=self._transports.full_timeout)
        finally:
            self._queued_putting -= nbytes
            if self._putting_for.get(key) == putting:
                del self._putting_for[key]
        if not win.reading:
            shared.hold_queued(descriptor, request_id)
            if hasattr(shared, "queued_requests"):  # else never pruned: not noted
                self._queued_readers[request_id] = win.reader
            if len(self._queued_readers) > QUEUED_READERS_PRUNE:
                # Requests aborted before their consumer began reading leave entries that
                # only a full share would otherwise prune.
                self._prune_queued_readers()
        return descriptor

    def _now_reading(self, request_id: str, win: _Window | None) -> None:
        """The consumer has begun reading ``request_id``: its payloads leave the queued share,
        and sends waiting for that share look again."""
        if win is not None:
            win.reading = True
        self._queued_readers.pop(request_id, None)
        shared = self._shared
        if shared is not None and shared.now_reading(request_id):
            for other in list(self._queued_waiting):
                if other.waiter is not None and not other.waiter.done():
                    other.waiter.set_result(None)

    def _count(self, name: str, encoded: Encoded) -> None:
        self.bytes += encoded.nbytes
        self._used[name] += 1

    def _queue(
        self,
        win: _Window,
        request_id: str,
        seq: int,
        name: str,
        descriptor: Descriptor | None,
        final: bool,
        endpoint: str,
        nbytes: int,
    ) -> None:
        """Add chunk ``seq`` to the request's open run, or start a run and queue it."""
        self.chunks += 1
        if name in self._needs_producer:
            win.held = True
        win.sizes.append(nbytes)
        win.in_flight += nbytes
        run = win.run
        if (
            run is None
            or run.sealed
            # A chunk without payload (the end of a stream) joins a run of any transport.
            or (descriptor is not None and run.transport != name)
            or run.first + len(run.descriptors) != seq
            or len(run.descriptors) >= MAX_RUN
            or run.nbytes + nbytes > MAX_INLINE
        ):
            run = win.run = _Run(self, request_id, seq, name)
            self._send(endpoint, run)
        run.nbytes += nbytes
        run.descriptors.append(descriptor)
        run.final = final
        if win.in_flight >= self._window_bytes and not final:
            # The next chunk will wait for credit: ask for it as soon as this one is taken.
            run.credit = True

    def _choose(self, encoded: Encoded, target: SendTarget) -> tuple[str, TransportSender]:
        if self._fixed is not None:
            return self._transports.kind, self._fixed
        policy = self._local_policy if target.host == self.host else self._remote_policy
        name, fell_back = policy.choose(encoded.nbytes, has_cuda=encoded.has_device_buffers)
        if fell_back:
            self.fallbacks += 1
        return name, self._senders[name]

    def on_credit(self, credit: Credit) -> None:
        """Apply credit from the consumer: chunks below ``upto`` were taken."""
        win = self._windows.get(credit.request_id)
        if win is None or not win.reading:
            # Its consumer has begun reading it (its handler took a chunk), or has stopped:
            # either way its payloads are no queued request's now. The producer may have
            # sent its last chunk already, and forgotten its window.
            self._now_reading(credit.request_id, win)
        if win is None:
            return
        if credit.done:
            # The consumer stopped reading: nothing more goes, and no send waits for credit.
            win.done = True
            if win.waiter is not None and not win.waiter.done():
                win.waiter.set_result(None)
            return
        if credit.upto <= win.acked:
            return
        # Never past what was queued: a chunk whose put is still under way has a seq but no
        # size yet, and a forged credit may claim anything.
        upto = min(credit.upto, win.acked + len(win.sizes))
        sizes = win.sizes
        freed = 0
        for _ in range(upto - win.acked):
            freed += sizes.popleft()
        win.acked = upto
        win.in_flight -= freed
        # The consumer's grant, within bounds: a forged credit cannot open the window wider.
        window = self.plan.window
        if credit.window > 0:
            window = min(credit.window, LONE_WINDOWS * window)
        win.allowed = upto + window
        if win.waiter is not None and not win.waiter.done():
            win.waiter.set_result(None)

    def readers_gone(self, endpoints: set[str]) -> None:
        """Consumers at ``endpoints`` are gone: the transports may take back what they hold
        for them (an optional transport method; see ``note_reader`` in :meth:`send`), and
        their requests' windows close as if each had stopped reading. A request that needed
        one fails by the master's word; one that goes on (its consumer had passed on all
        it needed) must not leave a send waiting for credit from the dead consumer."""
        for sender in self._senders.values():
            gone = getattr(sender, "readers_gone", None)
            if gone is not None:
                gone(endpoints)
        self._shared_readers -= endpoints
        for request_id, win in list(self._windows.items()):
            if win.reader in endpoints:
                self.stop_for(request_id, win.reader)

    def held_here(self, request_id: str) -> bool:
        """Whether a chunk of ``request_id`` went by a transport whose payload needs this
        process even after its consumer got it (cuda_ipc), so that only this process's own
        end may free it."""
        win = self._windows.get(request_id)
        return win is not None and win.held

    def reader_stopped(self, request_id: str) -> bool:
        """Whether the consumer of ``request_id`` on this edge said it reads no more."""
        win = self._windows.get(request_id)
        return win is not None and win.done

    def forget(self, request_id: str, reason: str | None = None) -> None:
        """Drop a request's window, failing a sender that waits on it.

        What it holds in a shared transport still counts as queued until its consumer
        reads or releases it: its consumer may not have begun reading it.
        """
        win = self._windows.pop(request_id, None)
        if win is not None and win.waiter is not None and not win.waiter.done():
            win.waiter.set_exception(RequestAborted(request_id, reason or "finished"))

    @property
    def open_windows(self) -> int:
        """Requests with credit state on this edge."""
        return len(self._windows)

    @property
    def used(self) -> dict[str, int]:
        """Chunks carried so far by each transport that carried any, by its own name."""
        used: dict[str, int] = {}
        for name, count in self._used.items():
            if count:
                shown = self._names[name]
                used[shown] = used.get(shown, 0) + count
        return used

    def describe(self, request_id: str) -> dict[str, Any] | None:
        """Where ``request_id`` stands on this edge (None: no send of it begun, or it was
        forgotten), for a report of a request that seems stuck. A send waits either for
        its consumer's credit or, its request not being read yet, in the queued share's
        line."""
        win = self._windows.get(request_id)
        if win is None:
            return None
        waits = win.waiter is not None and not win.waiter.done()
        queued = win in self._queued_waiting
        return {
            "next_seq": win.next_seq,
            "acked": win.acked,
            "allowed": win.allowed,
            "in_flight": win.in_flight,
            "reading": win.reading,
            "done": win.done,
            "waiting_credit": waits and not queued,
            "waiting_queued": queued,
            "reader": win.reader,
        }

    def statistics(self) -> dict[str, Any]:
        """Counters for this edge's producer side."""
        return {
            "edge": self.plan.name,
            "chunks": self.chunks,
            "bytes": self.bytes,
            "fallbacks": self.fallbacks,
            "unread": self.unread,
            "queued_waits": self.queued_waits,
            "spill_asks": self.spill_asks,
            "transport": self._transports.kind,
            "used": self.used,
            "transports": {
                name: dataclasses.asdict(sender.statistics())
                for name, sender in self._senders.items()
            },
        }

    async def aclose(self) -> None:
        """Close every transport end; idempotent."""
        for request_id in list(self._windows):
            self.forget(request_id, "channel closed")
        for sender in self._senders.values():
            await sender.aclose()


class InputChannel:
    """The consumer's end of one edge."""

    def __init__(
        self,
        plan: EdgePlan,
        *,
        host: str,
        send: SendData,
        device: str | None = None,
    ) -> None:
        self.plan = plan
        self._host = host
        self._send = send
        codec = codec_for(plan.payload_type)
        #: Decodes land every tensor on ``device``, when given (the embedded client's).
        self._codec = codec if device is None else codec.onto(device)
        self._ctx = EdgeContext(plan.name, host, plan.transport.options, plan.inline_threshold)
        self._transports = plan.transports
        #: Transports whose payloads need their producer even once got (see Inflow.fragile).
        self.needs_producer = needing_producer(plan.transports.names)
        self._receivers: dict[str, TransportReceiver] = {}
        self._decoders: dict[str, Callable[[msgspec.Raw], Sequence[Descriptor | None]]] = {}
        #: The inline receiver once opened: its payloads are read without a coroutine.
        self._inline: InlineReceiver | None = None
        self._credit_step = max(1, plan.window // 2)
        # On an edge whose transport may run out of room, the first chunk taken is credited
        # at once: it tells the producer that the request is being read, not queued (see the
        # module docstring).
        #: Transports of this edge that can run out of room: their payloads are copied out
        #: when the producer asks (see :meth:`spill`).
        self._bounded = frozenset(n for n in plan.transports.names if _bounded(n))
        self._first_credit = 1 if self._bounded else self._credit_step
        #: Requests open on this edge here: one alone gets :data:`LONE_WINDOWS` windows.
        self._inflows: set[Inflow] = set()
        #: The copying out under way, the transports asked for, and whether the producer
        #: asked again meanwhile.
        self._spilling: asyncio.Task[None] | None = None
        self._spill_names: set[str] = set()
        self._spill_again = False
        #: Payloads copied out of their transport at the producer's request, and bytes.
        self.spilled = 0
        self.spilled_bytes = 0
        self.hop = LatencyRecorder()
        self.chunks = 0
        #: Called with a request's id when its reader has got the last payload to fetch from
        #: a transport on this edge, every chunk having arrived (see :attr:`Inflow.drained`).
        self.on_got_all: Callable[[str], None] | None = None

    def held_in_place(self) -> int:
        """How many payloads got by shm this process still holds in place: extents pinned
        by live zero-copy tensors (or not yet released), which the producer cannot reuse."""
        pinned = getattr(self._receivers.get("shm"), "pinned", None)
        return int(pinned()) if pinned is not None else 0

    def receiver(self, name: str) -> TransportReceiver:
        """The receiving end of transport ``name`` on this edge, opened on first use.

        Raises:
            TransportError: this edge does not carry payloads by ``name``.
        """
        recv = self._receivers.get(name)
        if recv is None:
            if name not in self._transports.names:
                raise TransportError(
                    f"edge {self.plan.name!r} does not use transport {name!r} "
                    f"(allowed: {', '.join(self._transports.names)})"
                )
            options = self._transports.options[name]
            recv = create_transport(name, options).open_receiver(self._ctx)
            self._receivers[name] = recv
            if isinstance(recv, InlineReceiver):
                self._inline = recv
        return recv

    def admit(self, run: Chunks) -> list[Item]:
        """Parse a run's descriptors and note its hop latency.

        Raises:
            TransportError: a descriptor is not valid for its transport.
        """
        if run.host == self._host:
            self.hop.add((time.monotonic_ns() - run.sent_ns) / 1000)
        name, sender = run.transport, run.sender
        descriptors = self._decoder(name)(run.descriptors)
        self.chunks += len(descriptors)
        return [(name, d, sender) if d is not None else ("", None, sender) for d in descriptors]

    def _decoder(self, name: str) -> Callable[[msgspec.Raw], Sequence[Descriptor | None]]:
        """What parses a run's descriptor array for transport ``name`` (opened on first use).

        Raises:
            TransportError: this edge does not carry payloads by ``name``.
        """
        decode = self._decoders.get(name)
        if decode is None:
            if not name:
                decode = _decode_nothing
            else:
                recv = self.receiver(name)
                many = getattr(recv, "decode_descriptors", None)
                decode = many if many is not None else _one_by_one(recv)
            self._decoders[name] = decode
        return decode

    def open(
        self, request_id: str, *, chunk_timeout: float | None = None, time_first: bool = True
    ) -> Inflow:
        """Start receiving ``request_id`` on this edge (``time_first``: see ReorderBuffer)."""
        timeout = self.plan.chunk_timeout if chunk_timeout is None else chunk_timeout
        inflow: Inflow

        def discard(item: Item) -> None:
            # A repeat of the chunk this request's reader has taken and not yet finished
            # names the payload the reader is fetching: its release would fail that fetch
            # and lose the chunk. The fetch's own release covers both.
            if not inflow.reading(item):
                self.discard(item)

        inflow = Inflow(
            ReorderBuffer(
                request_id,
                self.plan.name,
                chunk_timeout=timeout,
                on_discard=discard,
                time_first=time_first,
            ),
            self._first_credit,
            lambda: self._inflows.discard(inflow),
        )
        self._inflows.add(inflow)
        return inflow

    def poll(self, inflow: Inflow) -> Any:
        """The next payload if it needs no waiting, else :data:`NOT_READY`.

        It needs none when its chunk is buffered and carried inline: a busy stream of small
        chunks is read this way without a coroutine. It raises what :meth:`next` raises.
        """
        if inflow.fetching is not None or inflow.held is not None:
            return NOT_READY  # a chunk before the buffered ones is being fetched, or taken
        got = inflow.buffer.get_nowait()
        if got is None:
            return NOT_READY
        (name, descriptor, _), final = got
        inline = self._inline
        if descriptor is None or name != "inline" or inline is None:
            if descriptor is None or name == COPIED:
                return self._deliver(inflow, got[0], final)
            inflow.held = got  # a transport to fetch from: next() awaits it
            return NOT_READY
        try:
            return inline.read(descriptor, self._codec)  # type: ignore[arg-type]
        finally:
            # Taken even when it does not decode: a handler that reads on past the error
            # must not find its producer waiting for credit for that chunk.
            self._took(inflow, got[0], final)

    async def next(self, inflow: Inflow) -> Any:
        """The next payload of a request on this edge, in order, returning credit as it goes.

        Raises:
            EndOfChannel: the stream has ended.
            ChunkGap: the next chunk did not arrive within the chunk timeout.
            PayloadError: a chunk without payload came before the end, or did not decode.
            TransportError: the payload could not be fetched.
            RequestAborted: the request was aborted.
        """
        if inflow.fetching is not None:
            return await self._fetched(inflow)
        got = inflow.held
        if got is not None:
            inflow.held = None
        else:
            got = inflow.buffer.get_nowait()
            if got is None:
                got = await inflow.buffer.get()
        item, final = got
        if item[1] is not None and (item[0] != "inline" or self._inline is None):
            if item[0] == COPIED:
                return self._deliver(inflow, item, final)
            fetching = self.fetch(item, inflow.buffer.request_id)
            inflow.fetching = (asyncio.ensure_future(fetching), item, final)
            return await self._fetched(inflow)
        return self._deliver(inflow, item, final)

    async def arrival(self, inflow: Inflow) -> None:
        """Wait until the next chunk of a request on this edge is here, and take it for the
        next read (:meth:`next`), which returns it. Cancelling the wait loses nothing.

        Raises:
            EndOfChannel: the stream has ended.
            ChunkGap: the chunk did not arrive within the chunk timeout.
            RequestAborted: the request was aborted.
        """
        if inflow.held is None and inflow.fetching is None:
            got = inflow.buffer.get_nowait()
            inflow.held = got if got is not None else await inflow.buffer.get()

    async def _fetched(self, inflow: Inflow) -> Any:
        """The payload of the fetch under way, returning credit.

        A read cancelled meanwhile (a handler reading with its own timeout) leaves the
        fetch running and in place, so the next read returns that chunk: none is lost.
        """
        assert inflow.fetching is not None
        fetching = inflow.fetching
        task, item, final = fetching
        try:
            value = await asyncio.shield(task)
        except asyncio.CancelledError:
            raise  # the read was cancelled: the fetch goes on, for the next read
        except BaseException:
            if inflow.fetching is fetching:
                inflow.fetching = None
                # Taken, though it could not be fetched or decoded: a handler that reads on
                # past the error must not find its producer waiting for its credit.
                self._took(inflow, item, final)
            raise
        if inflow.fetching is not fetching:
            # The request ended meanwhile (Inflow.end): the reader gets its end, not a
            # chunk of a request that is over.
            inflow.buffer.get_nowait()  # raises EndOfChannel, or the abort's error
            raise EndOfChannel(inflow.buffer.request_id)
        inflow.fetching = None
        self._took(inflow, item, final)
        return value

    def _took(self, inflow: Inflow, item: Item, final: bool) -> None:
        """Count a chunk the reader has taken (its payload read, or failed), returning
        credit when it is due, and telling when every payload of the request is here."""
        inflow.taken += 1
        if item[0] != "inline" and item[1] is not None and item[0] != COPIED:
            inflow.unfetched -= 1
            if not inflow.unfetched and self.on_got_all is not None and inflow.buffer.complete:
                self.on_got_all(inflow.buffer.request_id)
        if not final and inflow.taken >= inflow.credit_due:
            self._credit(inflow, item[2])

    def _deliver(self, inflow: Inflow, item: Item, final: bool) -> Any:
        """An inline or copied item's payload (or the end of the stream), returning credit."""
        descriptor = item[1]
        if descriptor is None and final:
            raise EndOfChannel
        try:
            if descriptor is None:
                raise PayloadError(
                    f"chunk without payload on edge {self.plan.name!r} before its end"
                )
            if isinstance(descriptor, Copied):
                return self._codec.decode(descriptor.encoded)
            assert self._inline is not None
            return self._inline.read(descriptor, self._codec)  # type: ignore[arg-type]
        finally:
            # Taken even when it does not decode (see poll).
            self._took(inflow, item, final)

    def _credit(self, inflow: Inflow, sender: str) -> None:
        """Tell ``sender`` that every chunk taken so far may be replaced by new ones, and how
        far past them it may now go: a request alone on this edge gets several windows."""
        window = self.plan.window * (LONE_WINDOWS if len(self._inflows) == 1 else 1)
        credit = Credit(inflow.buffer.request_id, self.plan.name, inflow.taken, window=window)
        self._send(sender, encode_message(credit))
        taken = inflow.taken
        due = taken + max(1, window // 2)
        # A credit the producer asked for further on still goes when that chunk is taken.
        inflow.credit_due = inflow.asked if taken < inflow.asked < due else due

    def stop_reading(self, request_id: str, sender: str) -> None:
        """Tell the producer at ``sender`` that ``request_id``'s handler here has finished
        without reading this edge to its end: it sends nothing more, and waits for no
        credit (it would wait forever, and hold up its other outputs meanwhile)."""
        if sender:
            self._send(sender, encode_message(Credit(request_id, self.plan.name, 0, True)))

    async def fetch(self, item: Item, request_id: str | None = None) -> Any:
        """Materialise and decode an item's payload, then release the transport's hold.

        Raises:
            StageUnavailable: the producer's process holding the payload is gone.
            TransportError: the payload could not be fetched.
            PayloadError: the payload does not match the edge's type.
        """
        name, descriptor, _ = item
        assert descriptor is not None
        recv = self.receiver(name)
        try:
            encoded = await recv.get(descriptor)
            return self._codec.decode(encoded)
        except ProducerLost as exc:
            # The request was in flight on a replica that died: the same error as when the
            # master notices the death first.
            raise StageUnavailable(
                self.plan.src,
                f"its replica holding a payload of edge {self.plan.name!r} is gone ({exc})",
                request_id=request_id,
            ) from exc
        finally:
            await recv.release(descriptor)

    def spill(self, transport: str) -> None:
        """Copy the payloads this process holds in ``transport`` (the producer's shm arena,
        out of room: its :class:`Spill`) for requests whose readers have stopped into its
        own memory, and release them.

        A request's chunks wait in its reorder buffer until its handler takes them. One
        whose reader stopped (its client reads no more, its handler waits to send on) kept
        its window of extents, and a few such requests could hold the whole arena,
        starving those being read. A reader counts as stopped when it took nothing in
        :data:`SPILL_STALL_S` between two asks (a producer still short asks again every
        few tens of milliseconds): one that reads on, however slowly, frees its extents
        itself, and copying them would only cost memory and time. Copied out, a stopped
        request's chunks take this process's memory instead, as by network; its window
        bounds them all the same, since credit goes back only as chunks are taken.
        Requests not yet being read (queued behind ``max_concurrency``) stay in the
        arena: the queued share bounds them there. The copying runs in a task, and yields
        between payloads. Chunks being fetched, payloads of another transport, and
        extents pinned by tensors read in place stay where they are.
        """
        if transport not in self._bounded or transport not in self._receivers:
            return
        self._spill_names.add(transport)
        if self._spilling is not None and not self._spilling.done():
            self._spill_again = True
            return
        task = self._spilling = asyncio.get_running_loop().create_task(self._spill())
        _background.add(task)
        task.add_done_callback(_background.discard)

    async def _spill(self) -> None:
        loop = asyncio.get_running_loop()
        again = True
        while again:
            self._spill_again = False
            names = frozenset(self._spill_names)
            self._spill_names.clear()
            now = loop.time()
            for inflow in list(self._inflows):
                if inflow.taken and inflow.stalled(now, SPILL_STALL_S):
                    await self._spill_one(inflow, names)
            again = self._spill_again

    async def _spill_one(self, inflow: Inflow, names: frozenset[str]) -> None:
        """Copy out what ``inflow``'s buffer holds in transports ``names`` (see spill)."""
        buffer = inflow.buffer
        for seq, item in buffer.items():
            name, descriptor, sender = item
            if descriptor is None or name not in names:
                continue
            copied = await self._copy_out(name, descriptor)
            await asyncio.sleep(0)  # a copy of many payloads must not hold the loop
            if copied is None or not buffer.swap(seq, item, (COPIED, copied, sender)):
                # Taken meanwhile (its fetch releases it), or its request ended (it was
                # released as it was dropped): the copy is not needed.
                continue
            await self._receivers[name].release(descriptor)
            self.spilled += 1
            self.spilled_bytes += copied.encoded.nbytes
            inflow.unfetched -= 1
            if not inflow.unfetched and self.on_got_all is not None and buffer.complete:
                self.on_got_all(buffer.request_id)

    async def _copy_out(self, name: str, descriptor: Descriptor) -> Copied | None:
        """The payload ``descriptor`` names, copied into this process's memory; None when
        it cannot be got (a stale descriptor, a producer gone: its reader finds out), or
        holds device memory (only host bytes are copied)."""
        recv = self._receivers[name]
        try:
            got = await recv.get(descriptor)
        except Exception:  # its reader meets the error itself, as it fetches the payload
            return None
        if got.device_buffers:
            return None
        buffers = tuple(memoryview(bytearray(b)) if len(b) else b"" for b in got.buffers)
        return Copied(Encoded(bytes(got.header), buffers))

    def discard(self, item: Item) -> None:
        """Release an item that will never be consumed (duplicate, aborted, late)."""
        name, descriptor, _ = item
        if descriptor is None:
            return
        recv = self._receivers.get(name)
        if recv is not None:
            _release_later(recv, descriptor)

    def statistics(self) -> dict[str, Any]:
        """Counters for this edge's consumer side."""
        return {
            "edge": self.plan.name,
            "chunks": self.chunks,
            "hop_p50_us": self.hop.percentile(50),
            "hop_p99_us": self.hop.percentile(99),
            "spilled": self.spilled,
            "spilled_bytes": self.spilled_bytes,
            "open": len(self._inflows),
        }

    async def aclose(self) -> None:
        """Close every transport end, once the releases under way have finished (those of
        requests just ended: a closed end would ignore them, and the producer hold their
        payloads); idempotent."""
        loop = asyncio.get_running_loop()
        # Those of this loop only (another pipeline may run on another thread's loop).
        pending = [t for t in list(_background) if not t.done() and t.get_loop() is loop]
        if pending:
            await asyncio.wait(pending, timeout=RELEASES_WAIT_S)
        for recv in self._receivers.values():
            await recv.aclose()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


_background: set[asyncio.Task[None]] = set()


def _release_later(recv: TransportReceiver, descriptor: Descriptor) -> None:
    """Release ``descriptor`` in a task of its own (the caller cannot wait for it)."""
    task = asyncio.get_running_loop().create_task(recv.release(descriptor))
    _background.add(task)
    task.add_done_callback(_background.discard)
