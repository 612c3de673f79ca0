"""The cuda_ipc sender: exports device buffers, sends host buffers on, holds both until done.

Every payload takes a slot of the sender's release table (created on the first put) and
holds ``nbytes`` of the capacity until the consumer releases it there, or has read it and
died. A sender closed while consumers still hold device payloads hands them to a
process-wide list of orphans: one that a consumer has read stays alive until that consumer
releases it or dies, one nobody has read is dropped after ``linger`` seconds, and at exit
the process waits up to ``linger`` seconds for them, since CUDA frees a process's memory
under any consumer still reading it (vLLM #6025). Orphans are swept by every later put of
any sender in the process.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from pipeline._encoded import Encoded
from pipeline._errors import TransportError, TransportFull
from pipeline._keys import ChunkKey
from pipeline._latency import LatencyRecorder
from transports._cuda_descriptor import (
    CudaIpcDescriptor,
    DeviceRef,
    DeviceSpan,
    chunks_by_transport,
    encode_part,
    host_edge,
)
from transports._cuda_handles import EXPORTS, EventPool, PooledEvent, device_uuid, require_cuda
from transports._cuda_release_table import ReleaseTable
from transports._liveness import pid_alive, pid_namespace
from transports._protocol import Descriptor, EdgeContext, Transport, TransportStatistics
from transports._resource import AsyncResource
from transports.inline import InlineDescriptor

__all__ = ("LOCAL", "CudaIpcSender")

# A put that finds no room polls the release table: the first look comes soon and the gap
# doubles to a cap, so a long wait costs little CPU and still sees a release within 10 ms.
_POLL_FIRST_S = 0.0002
_POLL_MAX_S = 0.01
# While payloads are held, the sender also sweeps on a timer, so memory goes back to the
# allocator even when no further put comes.
_SWEEP_EVERY_S = 0.05
# How often a waiting put checks whether the readers of held payloads are still alive.
_REAP_EVERY_S = 0.1

_log = structlog.get_logger(__name__)

#: Device buffers (and events) of live payloads, by token, for a consumer in this very
#: process: CUDA refuses to open a process's own IPC handles, so it shares them directly.
LOCAL: dict[tuple[str, int, int], tuple[dict[int, Any], tuple[PooledEvent, ...]]] = {}


@dataclass(slots=True)
class _Held:
    """What a sender keeps alive for one payload until its consumer is done."""

    generation: int
    nbytes: int
    buffers: dict[int, Any]
    events: tuple[PooledEvent, ...]
    #: The host part's descriptor in the host transport (None: it travelled inline).
    host_descriptor: Descriptor | None = None
    #: The process it was sent to, where the runtime said (0: unknown).
    reader: int = 0


@dataclass(slots=True)
class _Orphans:
    """Device payloads of a closed sender that consumers have not finished with yet."""

    table: ReleaseTable
    held: dict[int, _Held]
    deadline: float = 0.0


_orphans: list[_Orphans] = []


def _reader_died(table: ReleaseTable, slot: int, namespace: int) -> bool:
    """Whether the process that read ``slot`` has died (judged only in our pid namespace)."""
    pid, ns = table.reader(slot)
    return pid != 0 and ns in (0, namespace) and not pid_alive(pid)


def _done_with(table: ReleaseTable, slot: int, held: _Held, namespace: int) -> bool:
    """Whether the consumer released the payload, or read it and has since died."""
    return table.is_released(slot, held.generation) or _reader_died(table, slot, namespace)


def _sweep_orphans() -> None:
    """Let go of orphaned payloads whose consumers are done, and of those nobody read
    within their sender's linger; close the tables left empty."""
    namespace = pid_namespace()
    now = time.monotonic()
    for orphans in list(_orphans):
        table = orphans.table
        for slot, held in list(orphans.held.items()):
            unread = table.reader(slot)[0] == 0
            if _done_with(table, slot, held, namespace) or (unread and now >= orphans.deadline):
                del orphans.held[slot]
                LOCAL.pop((table.name, slot, held.generation), None)
        if not orphans.held:
            table.close()
            _orphans.remove(orphans)


@atexit.register
def _linger_at_exit() -> None:
    """At exit, give consumers still reading a closed sender's payloads a moment to finish,
    then free the exported storages nothing refers to any more.

    CUDA frees a process's memory when it exits, under any consumer still using it
    (vLLM #6025); this waits up to each sender's ``linger`` for its payloads.

    torch checks at its own exit, after every Python hook, whether a storage it exported
    is still alive; if one is, it warns that the producer terminated before its shared
    tensors were released and keeps its reference-count file. A worker's objects are
    frozen out of the collector (and a stage's cycles hold its tensors), so they would
    still be alive then: an unfreeze and a collection free them first. What module
    globals still hold stays, and is rightly warned about.
    """
    while _orphans:
        _sweep_orphans()
        if all(o.deadline <= time.monotonic() for o in _orphans):
            break
        time.sleep(0.01)
    if EXPORTS.exports:
        gc.unfreeze()
        gc.collect()


class CudaIpcSender(AsyncResource):
    """Producer end: exports device buffers, sends host buffers inline or through shm,
    holds both."""

    def __init__(
        self,
        edge: EdgeContext,
        host: Transport,
        host_options: Mapping[str, Any],
        *,
        capacity: int,
        slots: int,
        linger: float,
        inline_host: int = 0,
    ) -> None:
        self._edge = edge
        self._capacity = capacity
        self._inline_host = inline_host
        self._slots = slots
        self._linger = linger
        self._host = host.open_sender(host_edge(edge, host_options))
        self._host_name = host.name
        self._table: ReleaseTable | None = None
        self._free_slots: list[int] = []
        self._generation = 0
        self._held: dict[int, _Held] = {}
        self._held_bytes = 0
        self._closed = False
        self._closing = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._events: EventPool | None = None
        self._namespace = pid_namespace()
        self._latency = LatencyRecorder()
        self.chunks = 0
        self.bytes = 0
        self.device_chunks = 0
        #: Host-only payloads that travelled in the descriptor.
        self.inline_chunks = 0
        self.fallbacks = 0
        self.errors = 0
        self.reclaimed = 0

    def _error(self, message: str) -> TransportError:
        self.errors += 1
        return TransportError(f"cuda_ipc sender for edge {self._edge.edge!r}: {message}")

    def _full(self, message: str) -> TransportFull:
        self.errors += 1
        return TransportFull(f"cuda_ipc sender for edge {self._edge.edge!r}: {message}")

    async def put(
        self, key: ChunkKey, encoded: Encoded, *, timeout: float | None = None
    ) -> CudaIpcDescriptor:
        """Hand ``encoded`` to the consumer: device buffers by IPC handle, the host part in
        the descriptor when small, else via shm.

        Raises:
            TransportFull: the payload exceeds the capacity, or no room was released
                within ``timeout``.
            TransportError: CUDA is not available here for a payload with device buffers,
                a buffer could not be exported, the host transport failed, or the sender
                is closed.
        """
        start = time.perf_counter()
        if self._closed:
            raise self._error("closed")
        size = encoded.nbytes
        if size > self._capacity:
            raise self._full(f"{key}: {size} bytes exceed the capacity of {self._capacity}")
        device_buffers = encoded.device_buffers
        if device_buffers:
            try:
                require_cuda("put")
            except TransportError:
                self.errors += 1
                raise
        table = self._table if self._table is not None else self._open_table()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        await self._reserve(key, size, deadline, timeout)
        slot = self._free_slots.pop()
        self._generation += 1
        generation = self._generation
        buffers: dict[int, Any] = {}
        events: tuple[PooledEvent, ...] = ()
        devices: tuple[DeviceRef, ...] = ()
        spans: tuple[DeviceSpan, ...] = ()
        host_descriptor: Descriptor | None = None
        inline: InlineDescriptor | None = None
        try:
            host_part = encoded
            if device_buffers:
                buffers, devices, spans, events = self._export(device_buffers)
                host_part = Encoded(encoded.header, encoded.buffers)
            if host_part.nbytes <= self._inline_host:
                # Copied now, like the inline transport: the descriptor is sent later.
                host_buffers = [bytes(b) for b in host_part.buffers]
                inline = InlineDescriptor(bytes(host_part.header), host_buffers)
            else:
                remaining = None if deadline is None else max(0.0, deadline - loop.time())
                host_descriptor = await self._host.put(key, host_part, timeout=remaining)
        except BaseException as exc:
            self._unreserve(slot, size, events)
            if isinstance(exc, RuntimeError):
                # CUDA and torch errors (an export the allocator refused, a CUDA fault).
                raise self._error(f"{key}: cannot share its device buffers: {exc}") from exc
            raise
        if self._closing.is_set():
            # aclose ran while the host transport stored the host part: its table may be
            # gone, and nothing may be held past close but what consumers already have.
            self._unreserve(slot, size, events)
            raise self._error(f"{key}: closed while the payload was being stored")
        table.issue(slot, generation)
        self._held[slot] = _Held(generation, size, buffers, events, host_descriptor)
        if buffers:
            LOCAL[(table.name, slot, generation)] = (buffers, events)
            self.device_chunks += 1
        elif inline is not None:
            self.inline_chunks += 1
        self.chunks += 1
        self.bytes += size
        self._arm_timer(loop)
        self._latency.add((time.perf_counter() - start) * 1e6)
        return CudaIpcDescriptor(
            self._edge.host,
            os.getpid(),
            table.name,
            slot,
            generation,
            size,
            b"" if host_descriptor is None else encode_part(host_descriptor),
            devices,
            spans,
            inline,
        )

    def _unreserve(self, slot: int, size: int, events: tuple[PooledEvent, ...]) -> None:
        """Give back what a put took before it failed."""
        self._free_slots.append(slot)
        self._held_bytes -= size
        if self._events is not None:
            for pooled in events:
                self._events.give_back(pooled)

    def _open_table(self) -> ReleaseTable:
        """Create the release table on the first put, so an unused end leaves no file."""
        table = self._table = ReleaseTable.create(self._slots)
        self._free_slots = list(range(self._slots - 1, -1, -1))
        return table

    def _export(
        self, device_buffers: Mapping[int, Any]
    ) -> tuple[
        dict[int, Any], tuple[DeviceRef, ...], tuple[DeviceSpan, ...], tuple[PooledEvent, ...]
    ]:
        """Export every device buffer and record one event per GPU after the last of them.

        Raises:
            TransportError: a buffer is not a flat contiguous uint8 CUDA tensor.
            RuntimeError: CUDA refused an export, even of a copy.
        """
        torch = sys.modules["torch"]
        held: dict[int, Any] = {}
        placed: list[tuple[int, int, bytes, int, int]] = []
        for index, flat in device_buffers.items():
            if not (
                flat.is_cuda
                and flat.dtype == torch.uint8
                and flat.dim() == 1
                and flat.is_contiguous()
            ):
                raise self._error(
                    f"device buffer {index} is not a flat contiguous uint8 CUDA tensor"
                )
            device = int(flat.device.index)
            nbytes = int(flat.numel())
            if nbytes == 0:
                held[index] = flat
                placed.append((index, device, b"", 0, 0))
                continue
            try:
                handle, offset = EXPORTS.export(flat)
            except RuntimeError:
                # Memory this process's caching allocator does not own cannot be exported:
                # a tensor received over cuda_ipc (torch refuses to re-share those) or
                # foreign memory. One device-to-device copy makes it ours.
                flat = flat.clone()
                handle, offset = EXPORTS.export(flat)
                self.fallbacks += 1
            held[index] = flat
            placed.append((index, device, handle, offset, nbytes))
        # The events go after every copy above, so the consumer's wait covers those too.
        events = self._events if self._events is not None else EventPool()
        self._events = events
        order: dict[int, int] = {}
        devices: list[DeviceRef] = []
        recorded: list[PooledEvent] = []
        for _, device, _, _, _ in placed:
            if device not in order:
                pooled = events.record(device)
                order[device] = len(devices)
                devices.append(DeviceRef(device_uuid(device), device, pooled.handle))
                recorded.append(pooled)
        spans = tuple(
            DeviceSpan(index, order[device], handle, offset, nbytes)
            for index, device, handle, offset, nbytes in placed
        )
        return held, tuple(devices), spans, tuple(recorded)

    async def _reserve(
        self, key: ChunkKey, size: int, deadline: float | None, timeout: float | None
    ) -> None:
        """Wait until ``size`` more bytes and a slot are free, then take them.

        Raises:
            TransportFull: nothing was released in time.
            TransportError: the sender closed meanwhile.
        """
        loop = asyncio.get_running_loop()
        delay = _POLL_FIRST_S
        next_reap = 0.0
        while True:
            if self._closed:
                raise self._error(f"{key}: closed while waiting for room")
            self._sweep()
            if self._held_bytes + size <= self._capacity and self._free_slots:
                self._held_bytes += size
                return
            now = loop.time()
            if now >= next_reap:
                next_reap = now + _REAP_EVERY_S
                if self._reap_dead_readers():
                    continue
            if deadline is not None and now >= deadline:
                raise self._full(
                    f"{key}: no room for {size} bytes within {timeout:g}s: consumers hold "
                    f"{len(self._held)} payloads, {self._held_bytes} of {self._capacity} bytes"
                )
            wait = delay if deadline is None else min(delay, deadline - now)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._closing.wait()
            delay = min(delay * 2, _POLL_MAX_S)

    def _free(self, slot: int, held: _Held) -> None:
        del self._held[slot]
        self._held_bytes -= held.nbytes
        self._free_slots.append(slot)
        if held.buffers and self._table is not None:
            LOCAL.pop((self._table.name, slot, held.generation), None)
        if self._events is not None:
            for pooled in held.events:
                self._events.give_back(pooled)

    def _sweep(self) -> None:
        """Let go of every payload its consumer has released."""
        if _orphans:
            _sweep_orphans()
        table = self._table
        if table is None or not self._held:
            return
        for slot, held in list(self._held.items()):
            if table.is_released(slot, held.generation):
                self._free(slot, held)

    def _reap_dead_readers(self) -> bool:
        """Reclaim payloads whose reader has died, or whose consumer (see
        :meth:`note_reader`) died before reading them; whether any was."""
        table = self._table
        if table is None:
            return False
        reaped = False
        alive: dict[int, bool] = {}
        for slot, held in list(self._held.items()):
            dead = _reader_died(table, slot, self._namespace)
            if not dead and held.reader and table.reader(slot)[0] == 0:
                if held.reader not in alive:
                    alive[held.reader] = pid_alive(held.reader)
                dead = not alive[held.reader]
            if dead:
                self._free(slot, held)
                self.reclaimed += 1
                reaped = True
        return reaped

    def note_reader(self, descriptor: CudaIpcDescriptor, endpoint: str, pid: int) -> None:
        """Say where ``descriptor`` was sent: process ``pid`` on this host (0: unknown).

        If that process dies before it opens the payload, the payload (device buffers and
        host part) is let go like one whose reader died; without this it stays held.
        """
        held = self._held.get(descriptor.slot)
        if held is None or held.generation != descriptor.generation:
            return
        held.reader = pid
        note = getattr(self._host, "note_reader", None)
        if note is not None and held.host_descriptor is not None:
            note(held.host_descriptor, endpoint, pid)

    def readers_gone(self, endpoints: set[str]) -> None:
        """Consumers were declared dead: let go of what dead processes held or were sent
        (one declared dead but still running keeps what it may be using)."""
        self._reap_dead_readers()
        gone = getattr(self._host, "readers_gone", None)
        if gone is not None:
            gone(endpoints)

    def _arm_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is None and self._held:
            self._timer = loop.call_later(_SWEEP_EVERY_S, self._on_timer, loop)

    def _on_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        if not self._closed:
            self._sweep()
            self._arm_timer(loop)

    @property
    def held(self) -> tuple[int, int]:
        """The payloads and bytes consumers hold now (released ones are let go first)."""
        self._sweep()
        return len(self._held), self._held_bytes

    def statistics(self) -> TransportStatistics:
        """Chunks and bytes sent, split into device payloads and host-only ones, and the
        payloads held now (released ones are let go first)."""
        return TransportStatistics(
            "cuda_ipc",
            self.chunks,
            self.bytes,
            fallbacks=self.fallbacks,
            errors=self.errors,
            latency_p50_us=self._latency.percentile(50),
            latency_p99_us=self._latency.percentile(99),
            by_transport=chunks_by_transport(
                self.device_chunks, self.chunks, self._host_name, self.inline_chunks
            ),
            held=self.held[0],
        )

    async def aclose(self) -> None:
        """Fail waiting puts and close the host transport; idempotent.

        Device buffers that consumers still hold stay alive while this process lives (and
        up to ``linger`` seconds at exit); nothing else is kept.

        Raises:
            Nothing.
        """
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        table = self._table
        if table is not None:
            self._sweep()
            held = {slot: h for slot, h in self._held.items() if h.buffers}
            self._held.clear()
            table.unlink()
            if held:
                _log.warning(
                    "cuda_ipc_sender_closed_with_unreleased_payloads",
                    edge=self._edge.edge,
                    payloads=len(held),
                    bytes=sum(h.nbytes for h in held.values()),
                )
                _orphans.append(_Orphans(table, held, time.monotonic() + self._linger))
            else:
                table.close()
        with contextlib.suppress(TransportError):
            await self._host.aclose()
