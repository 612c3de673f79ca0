"""The shm transport: a variable-length shared-memory arena per producer, read in place.

Each sender owns one segment under ``/dev/shm`` (see :mod:`transports._shm_segment`),
created on its first put. A put copies the payload once into an extent of the segment's
arena (see :mod:`transports._shm_arena`) and returns an :class:`ShmDescriptor` naming the
host, segment, slot, generation and layout. The descriptor travels in the chunk envelope;
the consumer maps the segment once and reads the extent where it lies.

An extent's lifetime is tracked in its slot of the segment's slot table:

- the producer stamps the slot with a new generation on every put; generations are never
  reset, so a stale descriptor can never alias newer data;
- the consumer writes its pid when it reads the extent, and the generation it is done with
  when it releases it; the producer reclaims released extents lazily, on a later put,
  without any message;
- a put that finds no room polls those words with a short backoff until its deadline, and
  meanwhile also reclaims extents whose reader has died.

Reads are zero-copy by default: ``get`` returns writable views into the mapping, which the
codec turns into tensors sharing that memory. Such an extent is given back only once the
descriptor is released *and* every view of it has been garbage-collected, so a decoded
tensor never sees its bytes reused under it. With ``copy=True`` the payload is copied out
instead and the extent is free as soon as it is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Annotated, ClassVar, Self

import msgspec
import numpy as np

from pipeline._encoded import DECODE_ERRORS, Buffer, Encoded, to_host
from pipeline._errors import TransportError, TransportFull
from pipeline._keys import ChunkKey
from pipeline._latency import LatencyRecorder
from pipeline._units import parse_byte_size
from transports._protocol import (
    Descriptor,
    EdgeContext,
    TransportCapabilities,
    TransportStatistics,
)
from transports._shm_arena import ALIGN, Arena, align_up
from transports._shm_segment import (
    NAME_PATTERN,
    SLOT_GEN,
    SLOT_LENGTH,
    SLOT_OFFSET,
    SLOT_READER,
    SLOT_RELEASED,
    OwnedSegment,
    Segment,
    attach_segment,
    create_segment,
    format_size,
    list_segments,
    pid_alive,
    pid_namespace,
    remove_segments_of,
    segment_exists,
    sweep_dead_owners,
)

__all__ = (
    "DEFAULT_CAPACITY",
    "ShmDescriptor",
    "ShmOccupancy",
    "ShmReceiver",
    "ShmSender",
    "ShmTransport",
    "list_segments",
    "remove_segments_of",
    "sweep_dead_owners",
)

#: The arena size of a sender when the edge's options name none.
DEFAULT_CAPACITY = 256 * 2**20
_MIN_CAPACITY = 4096
_OPTIONS = ("capacity", "copy")
# A waiting put polls the consumers' release words: the first look comes soon, since
# consumers release quickly, and the gap doubles up to a cap, so a long wait costs little
# CPU and still notices free space within 10 ms.
_POLL_FIRST_S = 0.0002
_POLL_MAX_S = 0.01
# With this few extents held, every put first reclaims what was released, so a steady
# stream reuses the same warm extents; with more, only a put that finds no room scans.
_EAGER_RECLAIM = 64
_LOW32 = 0xFFFFFFFF

_Size = Annotated[int, msgspec.Meta(ge=0, le=2**62)]


class ShmDescriptor(Descriptor, frozen=True, tag="shm", array_like=True):
    """Where one payload lies: a segment's extent, and how to cut it into header and buffers.

    Attributes:
        host: the host identity of the producer; the segment exists only there.
        segment: the segment's file name under /dev/shm.
        slot: the extent's slot in the segment's slot table.
        generation: the slot's generation when the payload was put; a mismatch is stale.
        offset: the extent's offset in the segment's data area.
        header_size: the length of the header, which starts at ``offset``.
        buffer_sizes: the length of each buffer; each starts on a 64-byte boundary after
            the header.
    """

    host: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    segment: Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
    slot: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
    generation: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
    offset: _Size
    header_size: _Size
    buffer_sizes: Annotated[tuple[_Size, ...], msgspec.Meta(max_length=2**16)]


_decoder = msgspec.msgpack.Decoder(ShmDescriptor)


@dataclass(frozen=True, slots=True)
class ShmOccupancy:
    """How much of a sender's arena is held by extents not yet given back.

    Attributes:
        extents: extents put and not yet reclaimed.
        bytes: bytes those extents occupy, padding included.
        capacity: the arena's size.
        largest_free: the largest payload extent that fits right now.
    """

    extents: int
    bytes: int
    capacity: int
    largest_free: int


def _byte_view(buf: Buffer) -> memoryview:
    """``buf`` as a flat, contiguous view of bytes."""
    view = memoryview(buf)
    if view.format == "B" and view.ndim == 1 and view.c_contiguous:
        return view
    return view.cast("B") if view.c_contiguous else memoryview(view.tobytes())


def _extent_size(header_size: int, buffer_sizes: tuple[int, ...]) -> int:
    """The bytes an extent needs: the header, then every buffer, each 64-byte aligned."""
    return max(ALIGN, align_up(header_size) + sum(align_up(n) for n in buffer_sizes))


def _slots_for(capacity: int) -> int:
    """Slot-table size: one slot per 4 KiB of arena, within [64, 16384]."""
    return max(64, min(capacity // 4096, 16384))


class ShmSender:
    """Producer end: copies each payload into an extent of its own segment's arena."""

    __slots__ = (
        "_arena",
        "_capacity",
        "_closed",
        "_creating",
        "_edge",
        "_free_slots",
        "_generation",
        "_held",
        "_latency",
        "_segment",
        "_slot_count",
        "_wake",
        "bytes",
        "chunks",
        "errors",
    )

    def __init__(self, edge: EdgeContext, capacity: int) -> None:
        self._edge = edge
        self._capacity = capacity
        self._slot_count = _slots_for(capacity)
        self._segment: OwnedSegment | None = None
        self._creating: asyncio.Future[OwnedSegment] | None = None
        self._closed = False
        self._wake = asyncio.Event()  # Set on close, to wake puts waiting for room.
        self._arena = Arena(capacity)
        self._free_slots = list(range(self._slot_count - 1, -1, -1))
        # slot -> (generation, offset, extent size) of every extent not yet reclaimed.
        self._held: dict[int, tuple[int, int, int]] = {}
        self._generation = 0
        self._latency = LatencyRecorder(1024)
        self.chunks = 0
        self.bytes = 0
        self.errors = 0

    @property
    def segment_name(self) -> str | None:
        """The name of this sender's segment under /dev/shm, once the first put made it."""
        return None if self._segment is None else self._segment.name

    def _error(self, message: str, kind: type[TransportError] = TransportError) -> TransportError:
        self.errors += 1
        return kind(f"shm sender for edge {self._edge.edge!r}: {message}")

    async def put(
        self, key: ChunkKey, encoded: Encoded, *, timeout: float | None = None
    ) -> ShmDescriptor:
        """Copy ``encoded`` into a free extent, waiting up to ``timeout`` for room.

        Raises:
            TransportFull: no room freed up within ``timeout`` (None waits for ever).
            TransportError: the payload exceeds the whole capacity (at once, without
                waiting), /dev/shm lacks the space for the segment, or the sender is
                closed (also while waiting).
        """
        started = time.perf_counter_ns()
        if self._closed:
            raise self._error("is closed")
        if encoded.device_buffers:
            # The runtime stages device buffers through the host for transports that cannot
            # take them; a caller that did not gets the same treatment here.
            encoded = to_host(encoded)
        header = encoded.header
        views = [_byte_view(b) for b in encoded.buffers]
        sizes = tuple(v.nbytes for v in views)
        need = _extent_size(len(header), sizes)
        if need > self._capacity:
            raise self._error(
                f"{key}: a payload of {format_size(encoded.nbytes)} needs {format_size(need)}, "
                f"which exceeds the capacity of {format_size(self._capacity)}: raise the "
                "`capacity` option or send payloads this large another way"
            )
        segment = self._segment or await self._open()
        place = self._allocate(need)
        if place is None:
            place = await self._wait_for_room(key, need, timeout)
        slot, offset = place
        # The only copy of the payload: memoryview slice assignment is a memcpy.
        data = segment.data
        data[offset : offset + len(header)] = header
        pos = offset + align_up(len(header))
        for view, n in zip(views, sizes, strict=True):
            if n:
                data[pos : pos + n] = view
            pos += align_up(n)
        self._generation += 1
        generation = self._generation
        base = Segment.slot_base(slot)
        words = segment.words
        words[base + SLOT_OFFSET] = offset
        words[base + SLOT_LENGTH] = need
        # Last, so a reader that sees this generation also sees where its extent is.
        words[base + SLOT_GEN] = generation
        self._held[slot] = (generation, offset, need)
        self.chunks += 1
        self.bytes += encoded.nbytes
        self._latency.add((time.perf_counter_ns() - started) / 1000)
        return ShmDescriptor(
            self._edge.host, segment.name, slot, generation, offset, len(header), sizes
        )

    async def _open(self) -> OwnedSegment:
        """The segment, created (in a worker thread: reserving and pre-faulting take a while)
        by the first put that needs it; concurrent puts share the one creation."""
        creating = self._creating
        if creating is None:
            work = asyncio.to_thread(create_segment, self._capacity, self._slot_count)
            creating = self._creating = asyncio.ensure_future(work)
            creating.add_done_callback(self._created)
        try:
            # Shielded: a cancelled put must not abandon a segment half made.
            await asyncio.shield(creating)
        except (TransportError, OSError) as exc:
            raise self._error(f"cannot create its segment: {exc}") from exc
        if self._closed or self._segment is None:
            raise self._error("is closed")
        return self._segment

    def _created(self, creating: asyncio.Future[OwnedSegment]) -> None:
        """Adopt a newly created segment, or destroy it if the sender closed meanwhile."""
        if creating.cancelled() or creating.exception() is not None:
            self._creating = None  # The next put tries again.
            return
        segment = creating.result()
        if self._closed:
            segment.destroy()
        else:
            self._segment = segment

    def _take(self, need: int) -> tuple[int, int] | None:
        """A free slot and ``need`` bytes of arena, or None."""
        if not self._free_slots:
            return None
        offset = self._arena.allocate(need)
        if offset is None:
            return None
        return self._free_slots.pop(), offset

    def _allocate(self, need: int) -> tuple[int, int] | None:
        if len(self._held) > _EAGER_RECLAIM and (place := self._take(need)) is not None:
            return place
        self._reclaim()
        return self._take(need)

    def _reclaim(self, *, dead_readers: bool = False) -> None:
        """Take back extents their consumer released (or, if asked, whose reader died)."""
        segment = self._segment
        if segment is None or not self._held:
            return
        words = segment.words
        done = []
        alive: dict[int, bool] = {}
        for slot, (generation, _, _) in self._held.items():
            base = Segment.slot_base(slot)
            if words[base + SLOT_RELEASED] == generation:
                done.append(slot)
            elif dead_readers:
                reader = words[base + SLOT_READER]
                pid = reader & _LOW32
                if pid and reader >> 32 == generation & _LOW32:
                    if pid not in alive:
                        alive[pid] = pid_alive(pid)
                    if not alive[pid]:
                        done.append(slot)
        for slot in done:
            _, offset, size = self._held.pop(slot)
            self._arena.free(offset, size)
            self._free_slots.append(slot)

    async def _wait_for_room(
        self, key: ChunkKey, need: int, timeout: float | None
    ) -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        delay = _POLL_FIRST_S
        while True:
            if self._closed:
                raise self._error(f"{key}: closed while waiting for room")
            self._reclaim(dead_readers=True)
            if (place := self._take(need)) is not None:
                return place
            now = loop.time()
            if deadline is not None and now >= deadline:
                raise self._full(key, need, timeout)
            # Consumers in other processes cannot wake us; close can.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(
                    delay if deadline is None else min(delay, deadline - now)
                ):
                    await self._wake.wait()
            delay = min(delay * 2, _POLL_MAX_S)

    def _full(self, key: ChunkKey, need: int, timeout: float | None) -> TransportError:
        held = sum(size for _, _, size in self._held.values())
        return self._error(
            f"{key}: no room for {format_size(need)} within {timeout:g}s; of the arena's "
            f"{format_size(self._capacity)}, {format_size(held)} is held by {len(self._held)} "
            f"unreleased extents (largest free run {format_size(self._arena.largest_free())}, "
            f"{len(self._free_slots)} of {self._slot_count} slots free). The consumer is slow "
            "or does not release its descriptors: raise `capacity` or release sooner",
            TransportFull,
        )

    def occupancy(self) -> ShmOccupancy:
        """What the arena holds now, after taking back every extent released so far."""
        self._reclaim()
        held = sum(size for _, _, size in self._held.values())
        return ShmOccupancy(len(self._held), held, self._capacity, self._arena.largest_free())

    def statistics(self) -> TransportStatistics:
        """Chunks and bytes put, errors, put latency (waiting included) in µs, and the
        extents still held after taking back every one released so far."""
        lat = self._latency
        if not self._closed:
            self._reclaim()
        return TransportStatistics(
            "shm",
            self.chunks,
            self.bytes,
            errors=self.errors,
            latency_p50_us=lat.percentile(50),
            latency_p99_us=lat.percentile(99),
            by_transport={"shm": self.chunks},
            held=len(self._held),
        )

    async def aclose(self) -> None:
        """Fail waiting puts, then unlink and unmap the segment; idempotent.

        Consumers that mapped the segment keep reading what they already hold.

        Raises:
            Nothing: closing twice, or while puts wait, is safe.
        """
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        creating = self._creating
        if creating is not None and not creating.done():
            # Its done callback destroys the segment, now that we are closed.
            await asyncio.wait([creating])
        segment, self._segment = self._segment, None
        if segment is not None:
            segment.destroy()
        self._held.clear()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        segment = getattr(self, "_segment", None)
        if segment is not None:
            # Removed before warning: with warnings as errors, warn() raises.
            segment.destroy()
            warnings.warn(
                f"shm sender for edge {self._edge.edge!r} was never closed; its segment "
                f"{segment.name} was removed. Use `async with` or call aclose().",
                ResourceWarning,
                stacklevel=1,
            )


class _Attachment:
    """A segment this receiver mapped, and how many of its extents it pins."""

    __slots__ = ("orphaned", "pins", "same_pidns", "segment")

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.pins = 0
        # The producer can tell a dead reader by its pid only within its own pid namespace.
        self.same_pidns = segment.owner_pidns == pid_namespace()
        # Dropped by the receiver (closed, or its producer closed): unmap with the last pin.
        self.orphaned = False


class _Pin:
    """One extent got by this receiver and not yet given back to its producer."""

    __slots__ = ("attachment", "generation", "key", "released", "slot", "views")

    def __init__(self, attachment: _Attachment, slot: int, generation: int) -> None:
        self.attachment = attachment
        self.slot = slot
        self.generation = generation
        self.key = (attachment.segment.name, slot, generation)
        self.released = False
        # Arrays under the views handed out that are still alive: the extent is given back
        # once ``released`` is set and this is zero.
        self.views = 0


class _PinTable:
    """The pins of one receiver. Views die wherever the garbage collector runs, so their
    callbacks may come from any thread: everything here runs under ``lock``."""

    __slots__ = ("lock", "pins")

    def __init__(self) -> None:
        # Re-entrant: a collection triggered while the lock is held may run a callback.
        self.lock = threading.RLock()
        self.pins: dict[tuple[str, int, int], _Pin] = {}

    def view_dead(self, pin: _Pin) -> None:
        with self.lock:
            pin.views -= 1
            if pin.released and not pin.views:
                self.give_back(pin)

    def give_back(self, pin: _Pin) -> None:
        """Tell the producer the extent is free, and unmap an orphaned segment with it."""
        with self.lock:
            if self.pins.pop(pin.key, None) is None:
                return
            attachment = pin.attachment
            segment = attachment.segment
            if not segment.closed:
                segment.words[Segment.slot_base(pin.slot) + SLOT_RELEASED] = pin.generation
            attachment.pins -= 1
            if attachment.orphaned and attachment.pins == 0:
                segment.close()


class ShmReceiver:
    """Consumer end: maps producers' segments and reads extents in place (or copies them)."""

    __slots__ = (
        "_attach_lock",
        "_attachments",
        "_closed",
        "_copy",
        "_edge",
        "_latency",
        "_table",
        "bytes",
        "chunks",
        "errors",
    )

    def __init__(self, edge: EdgeContext, *, copy: bool) -> None:
        self._edge = edge
        self._copy = copy
        self._attachments: dict[str, _Attachment] = {}
        self._attach_lock = asyncio.Lock()
        self._table = _PinTable()
        self._closed = False
        self._latency = LatencyRecorder(1024)
        self.chunks = 0
        self.bytes = 0
        self.errors = 0

    def _error(self, message: str) -> TransportError:
        self.errors += 1
        return TransportError(f"shm receiver for edge {self._edge.edge!r}: {message}")

    def decode_descriptor(self, raw: bytes | memoryview) -> ShmDescriptor:
        """Parse and validate an shm descriptor.

        Raises:
            TransportError: ``raw`` is not a well-formed shm descriptor.
        """
        try:
            return _decoder.decode(raw)
        except DECODE_ERRORS as exc:
            raise self._error(f"bad shm descriptor: {exc}") from exc

    async def get(self, descriptor: Descriptor) -> Encoded:
        """The payload the descriptor names, as views into shared memory (or a copy).

        Raises:
            TransportError: the descriptor is not an shm one, names another host, a segment
                that is gone, a slot or range the segment does not have, or an extent that
                was released or reused (stale); or the receiver is closed.
        """
        started = time.perf_counter_ns()
        if self._closed:
            raise self._error("is closed")
        if not isinstance(descriptor, ShmDescriptor):
            raise self._error(f"got a {type(descriptor).__name__}, not an ShmDescriptor")
        d = descriptor
        if d.host != self._edge.host:
            raise self._error(
                f"the descriptor names host {d.host!r}, but this process is on host "
                f"{self._edge.host!r}: shm only works within one host; use the network "
                "transport, or auto, between hosts"
            )
        attachment = self._attachments.get(d.segment)
        if attachment is None:
            try:
                attachment = await self._attach(d.segment)
            except TransportError as exc:
                raise self._error(str(exc)) from exc
        segment = attachment.segment
        if attachment.orphaned:
            # Dropped while this get waited to attach: its producer is gone.
            raise self._error(f"segment {d.segment} is gone: its producer closed it or died")
        if segment.closed_by_owner():
            self._orphan(attachment)
            raise self._error(f"stale descriptor: segment {d.segment} was closed by its producer")
        need = self._check(d, segment)
        start = d.offset + align_up(d.header_size)
        stop = d.offset + need
        table = self._table
        with table.lock:
            pin = table.pins.get((d.segment, d.slot, d.generation))
            if pin is not None and pin.released:
                raise self._error(f"stale descriptor: extent {d.slot} was released already")
            if pin is None:
                pin = _Pin(attachment, d.slot, d.generation)
                table.pins[pin.key] = pin
                attachment.pins += 1
            if attachment.same_pidns:
                # The producer may reclaim the extent if this process dies before releasing.
                reader = (d.generation & _LOW32) << 32 | os.getpid()
                segment.words[Segment.slot_base(d.slot) + SLOT_READER] = reader
            header = bytes(segment.data[d.offset : d.offset + d.header_size])
            region: memoryview | None = None
            if self._copy:
                region = memoryview(bytearray(segment.data[start:stop]))
            elif any(d.buffer_sizes):
                # ndarrays, unlike memoryviews, take weak references: the views handed out
                # keep this array alive, and its death tells us the extent is unused. A
                # finalizer, unlike a bare weak reference, stays registered even if this
                # receiver is dropped first, so the extent is still given back.
                array = np.frombuffer(segment.data[start:stop], np.uint8)
                weakref.finalize(array, table.view_dead, pin).atexit = False
                pin.views += 1
                region = array.data
        buffers: list[Buffer] = []
        pos = 0
        for n in d.buffer_sizes:
            buffers.append(region[pos : pos + n] if region is not None and n else b"")
            pos += align_up(n)
        self.chunks += 1
        self.bytes += d.header_size + sum(d.buffer_sizes)
        self._latency.add((time.perf_counter_ns() - started) / 1000)
        return Encoded(header, tuple(buffers))

    def _check(self, d: ShmDescriptor, segment: Segment) -> int:
        """The extent size ``d`` implies, once ``d`` is shown to name a live extent."""
        if d.slot >= segment.slots:
            raise self._error(
                f"forged descriptor: slot {d.slot} is out of range; segment {d.segment} "
                f"has {segment.slots} slots"
            )
        need = _extent_size(d.header_size, d.buffer_sizes)
        if d.offset % ALIGN or d.offset + need > segment.capacity:
            raise self._error(
                f"forged descriptor: {need} bytes at offset {d.offset} are not an extent of "
                f"segment {d.segment}, whose arena holds {segment.capacity} bytes"
            )
        words = segment.words
        base = Segment.slot_base(d.slot)
        current = words[base + SLOT_GEN]
        if current != d.generation or words[base + SLOT_RELEASED] == d.generation:
            raise self._error(
                f"stale descriptor: extent reused or released (slot {d.slot} of segment "
                f"{d.segment} is at generation {current}, the descriptor has {d.generation}); "
                "a descriptor can be read only until it is released"
            )
        if words[base + SLOT_OFFSET] != d.offset or words[base + SLOT_LENGTH] != need:
            raise self._error(
                f"forged descriptor: offset {d.offset} and size {need} do not match slot "
                f"{d.slot} of segment {d.segment}"
            )
        return need

    async def _attach(self, name: str) -> _Attachment:
        """Map segment ``name`` (in a worker thread: pre-faulting a mapping takes a while).

        Raises:
            TransportError: the segment is gone or invalid, or the receiver closed.
        """
        async with self._attach_lock:
            attachment = self._attachments.get(name)
            if attachment is not None:
                return attachment
            # A new producer is a good moment to let go of segments whose producers left.
            for other in list(self._attachments.values()):
                if other.segment.closed_by_owner() or not segment_exists(other.segment.name):
                    self._orphan(other)
            segment = await asyncio.to_thread(attach_segment, name)
            if self._closed:
                segment.close()
                raise TransportError("the receiver is closed")
            attachment = self._attachments[name] = _Attachment(segment)
            return attachment

    def _orphan(self, attachment: _Attachment) -> None:
        """Stop using a segment; it is unmapped once nothing of it is pinned."""
        with self._table.lock:
            self._attachments.pop(attachment.segment.name, None)
            attachment.orphaned = True
            if attachment.pins == 0:
                attachment.segment.close()

    async def release(self, descriptor: Descriptor) -> None:
        """Give the extent back: at once, or when the last view from ``get`` dies.

        A descriptor that was never got (a duplicate, or a chunk of an aborted request) is
        given back directly, if it still names a live extent.

        Raises:
            Nothing: foreign, unknown, stale or released descriptors are ignored.
        """
        if not isinstance(descriptor, ShmDescriptor) or descriptor.host != self._edge.host:
            return
        d = descriptor
        table = self._table
        with table.lock:
            pin = table.pins.get((d.segment, d.slot, d.generation))
            if pin is not None:
                if not pin.released:
                    pin.released = True
                    if not pin.views:
                        table.give_back(pin)
                return
        if self._closed:
            return
        attachment = self._attachments.get(d.segment)
        if attachment is None:
            try:
                attachment = await self._attach(d.segment)
            except TransportError:
                return  # A segment that is gone has nothing left to free.
        segment = attachment.segment
        if d.slot < segment.slots and not segment.closed:
            base = Segment.slot_base(d.slot)
            if segment.words[base + SLOT_GEN] == d.generation:
                segment.words[base + SLOT_RELEASED] = d.generation

    def pinned(self) -> int:
        """Extents got and not yet given back (unreleased, or with views still alive)."""
        return len(self._table.pins)

    def statistics(self) -> TransportStatistics:
        """Chunks and bytes got, errors, and get latency in µs."""
        lat = self._latency
        return TransportStatistics(
            "shm",
            self.chunks,
            self.bytes,
            errors=self.errors,
            latency_p50_us=lat.percentile(50),
            latency_p99_us=lat.percentile(99),
            by_transport={"shm": self.chunks},
        )

    def _close_now(self) -> None:
        table = self._table
        with table.lock:
            self._closed = True
            attachments = list(self._attachments.values())
            self._attachments.clear()
            for attachment in attachments:
                attachment.orphaned = True
            # The consumer is going away: whatever it got is given back, at once or as
            # soon as the views it still holds die.
            for pin in list(table.pins.values()):
                pin.released = True
                if not pin.views:
                    table.give_back(pin)
            for attachment in attachments:
                if attachment.pins == 0:
                    # Unmaps now, or, if views are still exported, when they are collected.
                    attachment.segment.close()

    async def aclose(self) -> None:
        """Give back every extent still held and drop the mappings; idempotent.

        Views from ``get`` that are still alive stay valid: their extents are given back,
        and their mappings unmapped, when they are garbage-collected.

        Raises:
            Nothing: closing twice is safe.
        """
        if not self._closed:
            self._close_now()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        if getattr(self, "_closed", True) or not (self._attachments or self._table.pins):
            return
        # Closed before warning: with warnings as errors, warn() raises.
        self._close_now()
        warnings.warn(
            f"shm receiver for edge {self._edge.edge!r} was never closed, and was closed "
            "now. Use `async with` or call aclose().",
            ResourceWarning,
            stacklevel=1,
        )


class ShmTransport:
    """Payloads through a shared-memory arena per producer, on one host.

    Args:
        capacity: the arena size of each sender, in bytes or as a size string
            (``"256MiB"``). Its segment reserves this much of /dev/shm up front.
        copy: copy payloads out on ``get`` instead of handing out views into shared memory.

    Raises:
        TransportError: an unknown option or an invalid value.
    """

    name: ClassVar[str] = "shm"
    capabilities: ClassVar[TransportCapabilities] = TransportCapabilities(
        bounded=True, detects_stale=True, host_local=True
    )

    def __init__(self, **options: object) -> None:
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise TransportError(
                f"the shm transport has no option {', '.join(map(repr, unknown))}; it takes "
                '`capacity` (bytes, such as 268435456 or "256MiB") and `copy` (true or false)'
            )
        raw = options.get("capacity", DEFAULT_CAPACITY)
        try:
            capacity = parse_byte_size(raw)
        except ValueError as exc:
            raise TransportError(f"shm option `capacity`: {exc}") from exc
        if capacity < _MIN_CAPACITY:
            raise TransportError(
                f"shm option `capacity` is {capacity} bytes; it must be at least {_MIN_CAPACITY}"
            )
        copy = options.get("copy", False)
        if not isinstance(copy, bool):
            raise TransportError(f"shm option `copy` must be true or false, not {copy!r}")
        self.capacity = align_up(capacity)
        self.copy = copy

    def open_sender(self, edge: EdgeContext) -> ShmSender:
        """Open the producer's end; its segment is created by its first put."""
        return ShmSender(edge, self.capacity)

    def open_receiver(self, edge: EdgeContext) -> ShmReceiver:
        """Open the consumer's end."""
        return ShmReceiver(edge, copy=self.copy)
