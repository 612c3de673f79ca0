"""The producer's end of the shm transport: puts payloads into its own segment's arena."""

from __future__ import annotations

import asyncio
import contextlib
import time
import warnings
from collections.abc import Callable, Collection

from pipeline._encoded import Encoded, to_host
from pipeline._errors import TransportError, TransportFull
from pipeline._keys import ChunkKey
from pipeline._latency import LatencyRecorder
from pipeline._units import format_size
from transports._liveness import pid_alive
from transports._protocol import (
    EdgeContext,
    TransportStatistics,
)
from transports._resource import AsyncResource
from transports._shm_arena import Arena, align_up
from transports._shm_descriptor import (
    LOW32,
    MAX_BUFFERS,
    ShmDescriptor,
    ShmOccupancy,
    byte_view,
    extent_size,
    slots_for,
    statistics,
)
from transports._shm_segment import (
    SLOT_GEN,
    SLOT_LENGTH,
    SLOT_OFFSET,
    SLOT_READER,
    SLOT_RELEASED,
    OwnedSegment,
    Segment,
    create_segment,
)

__all__ = ("ShmSender",)

# A waiting put polls the consumers' release words: the first look comes soon, since
# consumers release quickly, and the gap doubles up to a cap, so a long wait costs little
# CPU and still notices free space within 10 ms.
_POLL_FIRST_S = 0.0002
_POLL_MAX_S = 0.01
# With this few extents held, every put first reclaims what was released, so a steady
# stream reuses the same warm extents; with more, only a put that finds no room scans.
_EAGER_RECLAIM = 64
# While a put waits for room, the consumers are asked again this often to copy out what
# they hold unread (see ShmSender.on_short): what they hold changes as chunks arrive.
_SHORT_REPEAT_S = 0.05


class ShmSender(AsyncResource):
    """Producer end: copies each payload into an extent of its own segment's arena.

    Besides the transport protocol, it keeps count of the arena bytes held for *queued*
    requests (:meth:`hold_queued`, :meth:`now_reading`, :meth:`queued_bytes`): those whose
    consumer has not begun reading them. The runtime bounds that count, so that payloads
    nobody reads yet never take the room that the requests being read need.
    """

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
        "_queued",
        "_queued_bytes",
        "_queued_slots",
        "_readers",
        "_segment",
        "_slot_count",
        "_wake",
        "bytes",
        "chunks",
        "errors",
        "on_short",
    )

    def __init__(self, edge: EdgeContext, capacity: int) -> None:
        self._edge = edge
        self._capacity = capacity
        self._slot_count = slots_for(capacity)
        self._segment: OwnedSegment | None = None
        self._creating: asyncio.Future[OwnedSegment] | None = None
        self._closed = False
        self._wake = asyncio.Event()  # Set on close, to wake puts waiting for room.
        self._arena = Arena(capacity)
        self._free_slots = list(range(self._slot_count - 1, -1, -1))
        # slot -> (generation, offset, extent size) of every extent not yet reclaimed.
        self._held: dict[int, tuple[int, int, int]] = {}
        # slot -> the process its payload was sent to, where the runtime said (note_reader).
        self._readers: dict[int, int] = {}
        # Extents held for queued requests: slot -> (request id, extent size), each request's
        # slots, and their bytes in all.
        self._queued_slots: dict[int, tuple[str, int]] = {}
        self._queued: dict[str, list[int]] = {}
        self._queued_bytes = 0
        self._generation = 0
        self._latency = LatencyRecorder(1024)
        self.chunks = 0
        self.bytes = 0
        self.errors = 0
        #: Called, without arguments, when a put finds no room, and again every
        #: ``_SHORT_REPEAT_S`` while it waits for some. The runtime sets it to ask the
        #: consumers to copy out, and release, the payloads they hold unread (see
        #: ``InputChannel.spill``). It must not raise.
        self.on_short: Callable[[], None] | None = None

    @property
    def capacity(self) -> int:
        """The arena's size in bytes, which every payload held for a consumer shares."""
        return self._capacity

    @property
    def segment_name(self) -> str | None:
        """The name of this sender's segment under /dev/shm, once the first put made it."""
        return None if self._segment is None else self._segment.name

    async def reserve(self) -> None:
        """Create the segment now rather than at the first put: an edge pinned to shm takes
        its space at start-up, where a host that lacks it is told the sizes.

        Raises:
            TransportFull: /dev/shm lacks the space (needed and free sizes named), or the
                segment cannot be created.
        """
        await self._open()

    def _error(self, message: str, kind: type[TransportError] = TransportError) -> TransportError:
        self.errors += 1
        return kind(f"shm sender for edge {self._edge.edge!r}: {message}")

    async def put(
        self, key: ChunkKey, encoded: Encoded, *, timeout: float | None = None
    ) -> ShmDescriptor:
        """Copy ``encoded`` into a free extent, waiting up to ``timeout`` for room.

        Raises:
            TransportFull: no room freed up within ``timeout`` (None waits for ever), or
                there will never be room: the payload exceeds the whole capacity, has more
                than MAX_BUFFERS buffers, or /dev/shm lacks the space for the segment (each
                at once, without waiting).
                ``auto`` edges fall back to another transport on it.
            TransportError: the sender is closed (also while waiting).
        """
        started = time.perf_counter_ns()
        if self._closed:
            raise self._error("is closed")
        if encoded.device_buffers:
            # The runtime stages device buffers through the host for transports that cannot
            # take them; a caller that did not gets the same treatment here.
            encoded = to_host(encoded)
        header = encoded.header
        if len(encoded.buffers) > MAX_BUFFERS:
            # Its descriptor would be refused by every receiver.
            raise self._error(
                f"{key}: a payload of {len(encoded.buffers)} tensors and arrays; one sent by "
                f"shm holds at most {MAX_BUFFERS}: stack them into fewer, or send it another "
                "way",
                TransportFull,
            )
        views = [byte_view(b) for b in encoded.buffers]
        sizes = tuple(v.nbytes for v in views)
        need = extent_size(len(header), sizes)
        if need > self._capacity:
            raise self._error(
                f"{key}: a payload of {format_size(encoded.nbytes)} needs {format_size(need)}, "
                f"which exceeds the capacity of {format_size(self._capacity)}: raise the "
                "`capacity` option or send payloads this large another way",
                TransportFull,
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
        self._readers.pop(slot, None)
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
            # An executor future, not a task: the loop's shutdown cancels every task, and a
            # cancelled creation would drop the segment its thread goes on to make.
            creating = self._creating = asyncio.get_running_loop().run_in_executor(
                None, create_segment, self._capacity, self._slot_count
            )
            creating.add_done_callback(self._created)
        try:
            # Shielded: a cancelled put must not abandon a segment half made.
            segment = await asyncio.shield(creating)
        except (TransportError, OSError) as exc:
            raise self._error(f"cannot create its segment: {exc}", TransportFull) from exc
        if self._closed:
            raise self._error("is closed")
        # Adopted here as well as in the done callback: a put that finds the creation
        # already finished gets here before that callback has run.
        if self._segment is None:
            self._segment = segment
        return self._segment

    def _created(self, creating: asyncio.Future[OwnedSegment]) -> None:
        """Adopt a newly created segment, or destroy it if the sender closed meanwhile."""
        if creating.cancelled() or creating.exception() is not None:
            self._creating = None  # The next put tries again.
            return
        segment = creating.result()
        if self._closed:
            segment.destroy()
        elif self._segment is None:
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

    def note_reader(self, descriptor: ShmDescriptor, endpoint: str, pid: int) -> None:
        """Say where ``descriptor`` was sent: process ``pid`` on this host (0: unknown;
        the endpoint is not needed here).

        If that process dies before it starts reading, the extent is taken back like one
        whose reader died while reading; without this, only the latter can be.
        """
        held = self._held.get(descriptor.slot)
        if pid and held is not None and held[0] == descriptor.generation:
            self._readers[descriptor.slot] = pid

    def hold_queued(self, descriptor: ShmDescriptor, request_id: str) -> None:
        """Count the extent ``descriptor`` names as held for ``request_id``, a request whose
        consumer has not begun reading it, until the extent is released or
        :meth:`now_reading` is told of the request."""
        slot = descriptor.slot
        held = self._held.get(slot)
        if held is None or held[0] != descriptor.generation or slot in self._queued_slots:
            return
        size = held[2]
        self._queued_slots[slot] = (request_id, size)
        self._queued.setdefault(request_id, []).append(slot)
        self._queued_bytes += size

    def now_reading(self, request_id: str) -> bool:
        """The consumer of ``request_id`` has begun reading it: its extents no longer count as
        queued. Whether any did."""
        slots = self._queued.pop(request_id, None)
        if slots is None:
            return False
        queued = self._queued_slots
        for slot in slots:
            self._queued_bytes -= queued.pop(slot)[1]
        return True

    def queued_bytes(self) -> int:
        """Arena bytes held for queued requests (see :meth:`hold_queued`), after taking back
        the extents released so far."""
        if self._queued_bytes:
            self._reclaim()
        return self._queued_bytes

    def queued_requests(self) -> Collection[str]:
        """The requests whose extents count as queued (as of the last :meth:`queued_bytes`)."""
        return self._queued.keys()

    def _unqueue(self, slot: int) -> None:
        """Stop counting a reclaimed extent as held for a queued request."""
        request_id, size = self._queued_slots.pop(slot)
        self._queued_bytes -= size
        slots = self._queued[request_id]
        slots.remove(slot)
        if not slots:
            del self._queued[request_id]

    def readers_gone(self, endpoints: set[str]) -> None:
        """Consumers were declared dead: take back what dead processes held or were sent.

        Only a process that is really gone loses its extents: one declared dead but still
        running (hung, cut off) may still read them in place.
        """
        self._reclaim(dead_readers=True)

    def _reclaim(self, *, dead_readers: bool = False) -> None:
        """Take back extents their consumer released, and if asked those whose reader died
        (while reading, or before it began: see :meth:`note_reader`)."""
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
                pid = reader & LOW32
                if not (pid and reader >> 32 == generation & LOW32):
                    # Not being read: judge by the process it was sent to, if known. Only
                    # that process ever gets the descriptor, so once it is dead nobody
                    # will read the extent.
                    pid = self._readers.get(slot, 0)
                if pid:
                    if pid not in alive:
                        alive[pid] = pid_alive(pid)
                    if not alive[pid]:
                        done.append(slot)
        readers = self._readers
        queued = self._queued_slots
        for slot in done:
            _, offset, size = self._held.pop(slot)
            # No generation: a descriptor of what the slot held is stale from now on, also
            # one whose reader died before releasing it (generations start at 1).
            words[Segment.slot_base(slot) + SLOT_GEN] = 0
            readers.pop(slot, None)
            if slot in queued:
                self._unqueue(slot)
            self._arena.free(offset, size)
            self._free_slots.append(slot)

    async def _wait_for_room(
        self, key: ChunkKey, need: int, timeout: float | None
    ) -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        delay = _POLL_FIRST_S
        asked: float | None = None
        while True:
            if self._closed:
                raise self._error(f"{key}: closed while waiting for room")
            self._reclaim(dead_readers=True)
            if (place := self._take(need)) is not None:
                return place
            now = loop.time()
            if self.on_short is not None and (asked is None or now - asked >= _SHORT_REPEAT_S):
                # Asked even by a put that cannot wait (timeout 0): the next ones find room.
                asked = now
                self.on_short()
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
        why = (
            "The consumer is slow or does not release its descriptors: raise `capacity` or "
            "release sooner"
        )
        got, got_bytes = self._got_unreleased()
        if got:
            # Read in place: a tensor the consumer still holds pins its extent until it
            # dies, as a loop variable holding the last chunk does while the next is awaited.
            why = (
                f"{format_size(got_bytes)} of it is in {got} extents the consumer has got "
                "whose tensors it still holds (zero-copy views pin their extent until they "
                "die; a loop variable keeps the last chunk while the next one is awaited): "
                "`capacity` must hold two chunks of each stream read so, or give the edge "
                "`copy: true`, or drop the tensors sooner"
            )
        queued = ""
        if self._queued_bytes:
            # Their consumer reads them only once the requests ahead of them end: a faster
            # consumer does not help there, a larger arena (or fewer requests at once) does.
            queued = (
                f"; {format_size(self._queued_bytes)} of it is held for {len(self._queued)} "
                "requests whose consumer has not begun reading them (queued behind others); "
                "their first chunks are not held back for a consumer that joins several "
                "inputs, so `capacity` must then also hold a first chunk of each request the "
                "producer runs at once"
            )
        return self._error(
            f"{key}: no room for {format_size(need)} within {timeout:g}s; of the arena's "
            f"{format_size(self._capacity)}, {format_size(held)} is held by {len(self._held)} "
            f"unreleased extents (largest free run {format_size(self._arena.largest_free())}, "
            f"{len(self._free_slots)} of {self._slot_count} slots free){queued}. {why}",
            TransportFull,
        )

    def _got_unreleased(self) -> tuple[int, int]:
        """How many held extents, and how many bytes, their consumer has begun reading
        (it marks them as it gets them) but not released."""
        segment = self._segment
        if segment is None:
            return 0, 0
        words = segment.words
        count = nbytes = 0
        for slot, (generation, _, size) in self._held.items():
            reader = words[Segment.slot_base(slot) + SLOT_READER]
            if reader & LOW32 and reader >> 32 == generation & LOW32:
                count += 1
                nbytes += size
        return count, nbytes

    def occupancy(self) -> ShmOccupancy:
        """What the arena holds now, after taking back every extent released so far or
        whose reader died."""
        self._reclaim(dead_readers=True)
        held = sum(size for _, _, size in self._held.values())
        return ShmOccupancy(len(self._held), held, self._capacity, self._arena.largest_free())

    def statistics(self) -> TransportStatistics:
        """Chunks and bytes put, errors, put latency (waiting included) in µs, and the
        extents still held after taking back every one released so far or whose reader
        died."""
        if not self._closed:
            self._reclaim(dead_readers=True)
        return statistics(self.chunks, self.bytes, self.errors, self._latency, len(self._held))

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
        self._readers.clear()
        self._queued_slots.clear()
        self._queued.clear()
        self._queued_bytes = 0

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
