"""The consumer's end of the shm transport: maps producers' segments and reads in place."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import warnings
import weakref
from typing import Any

from pipeline._encoded import DECODE_ERRORS, Buffer, Encoded
from pipeline._errors import ProducerLost, TransportError
from pipeline._latency import LatencyRecorder
from transports._liveness import pid_namespace
from transports._protocol import (
    Descriptor,
    EdgeContext,
    TransportStatistics,
)
from transports._resource import AsyncResource
from transports._shm_arena import ALIGN, align_up
from transports._shm_descriptor import (
    DESCRIPTOR_DECODER,
    LOW32,
    ShmDescriptor,
    extent_size,
    statistics,
)
from transports._shm_segment import (
    SLOT_GEN,
    SLOT_LENGTH,
    SLOT_OFFSET,
    SLOT_READER,
    SLOT_RELEASED,
    Segment,
    attach_segment,
    segment_exists,
)

__all__ = ("ShmReceiver",)


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


class ShmReceiver(AsyncResource):
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

    def _error(self, message: str, kind: type[TransportError] = TransportError) -> TransportError:
        self.errors += 1
        return kind(f"shm receiver for edge {self._edge.edge!r}: {message}")

    def decode_descriptor(self, raw: bytes | memoryview) -> ShmDescriptor:
        """Parse and validate an shm descriptor.

        Raises:
            TransportError: ``raw`` is not a well-formed shm descriptor.
        """
        try:
            return DESCRIPTOR_DECODER.decode(raw)
        except DECODE_ERRORS as exc:
            raise self._error(f"bad shm descriptor: {exc}") from exc

    async def get(self, descriptor: Descriptor) -> Encoded:
        """The payload the descriptor names, as views into shared memory (or a copy).

        Raises:
            ProducerLost: the segment is gone (its producer died or closed it), so the
                payload is too.
            TransportError: the descriptor is not an shm one, names another host, a slot
                or range the segment does not have, or an extent that was released or
                reused (stale); or the receiver is closed.
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
                raise self._error(str(exc), type(exc)) from exc
        segment = attachment.segment
        if attachment.orphaned:
            # Dropped while this get waited to attach: its producer is gone.
            raise self._error(
                f"segment {d.segment} is gone: its producer closed it or died", ProducerLost
            )
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
                reader = (d.generation & LOW32) << 32 | os.getpid()
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
                array = _byte_array(segment.data[start:stop])
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
        need = extent_size(d.header_size, d.buffer_sizes)
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
        if self._release_pinned(d):
            return
        if self._closed:
            return
        attachment = self._attachments.get(d.segment)
        if attachment is None:
            try:
                attachment = await self._attach(d.segment)
            except TransportError:
                return  # A segment that is gone has nothing left to free.
            # A get of this very descriptor may have pinned it while the segment was
            # being attached: its views are live, so it goes back only when they die.
            if self._release_pinned(d):
                return
        segment = attachment.segment
        if d.slot < segment.slots and not segment.closed:
            base = Segment.slot_base(d.slot)
            words = segment.words
            if (
                words[base + SLOT_GEN] == d.generation
                and words[base + SLOT_OFFSET] == d.offset
                and words[base + SLOT_LENGTH] == extent_size(d.header_size, d.buffer_sizes)
            ):
                # Only the extent it names, as get checks: a forged descriptor of the slot
                # must not give back an extent that its genuine reader may still read.
                words[base + SLOT_RELEASED] = d.generation

    def _release_pinned(self, d: ShmDescriptor) -> bool:
        """Release ``d`` through its pin, if a get made one; whether it had one."""
        table = self._table
        with table.lock:
            pin = table.pins.get((d.segment, d.slot, d.generation))
            if pin is None:
                return False
            if not pin.released:
                pin.released = True
                if not pin.views:
                    table.give_back(pin)
            return True

    def pinned(self) -> int:
        """Extents got and not yet given back (unreleased, or with views still alive)."""
        return len(self._table.pins)

    def statistics(self) -> TransportStatistics:
        """Chunks and bytes got, errors, get latency in µs, and the extents still pinned."""
        return statistics(self.chunks, self.bytes, self.errors, self._latency, self.pinned())

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


def _byte_array(view: memoryview) -> Any:
    """A numpy array of bytes over ``view``, without a copy.

    numpy loads on the first payload read in place, not with the transport: every
    ``auto`` edge has an shm receiver, and a worker whose payloads never come by shm does
    not pay numpy's import (about a sixth of a worker's start-up) to have one.
    """
    import numpy as np

    return np.frombuffer(view, np.uint8)
