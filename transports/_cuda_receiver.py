"""The cuda_ipc receiver: maps device buffers in place and tells the producer when it is done.

A payload is done once ``release`` was called *and* torch has freed every tensor over its
device bytes (tracked per payload by a pin that the DLPack deleters count down); only then
does the receiver write the payload's generation into the producer's release table.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from pipeline._encoded import DECODE_ERRORS, Encoded
from pipeline._errors import TransportError
from pipeline._latency import LatencyRecorder
from transports._cuda_descriptor import (
    CudaIpcDescriptor,
    chunks_by_transport,
    decode_descriptor,
    host_edge,
)
from transports._cuda_dlpack import wrap_memory
from transports._cuda_handles import OPENED, OPENED_EVENTS, local_device, require_cuda
from transports._cuda_release_table import ReleaseTable, SlotState
from transports._cuda_sender import LOCAL
from transports._liveness import pid_namespace
from transports._protocol import Descriptor, EdgeContext, Transport, TransportStatistics
from transports._resource import AsyncResource

__all__ = ("CudaIpcReceiver",)


class _Pin:
    """A payload this receiver got and has not finished with: release, then tensor deaths."""

    __slots__ = ("count", "devices", "generation", "key", "released", "slot", "table")

    def __init__(self, table: ReleaseTable, slot: int, generation: int) -> None:
        self.table = table
        self.slot = slot
        self.generation = generation
        self.key = (table.name, slot, generation)
        self.devices: tuple[int, ...] = ()
        self.count = 0
        self.released = False


class CudaIpcReceiver(AsyncResource):
    """Consumer end: maps device buffers in place, reads host buffers through shm."""

    def __init__(self, edge: EdgeContext, host: Transport, host_options: Mapping[str, Any]) -> None:
        self._edge = edge
        self._host = host.open_receiver(host_edge(edge, host_options))
        self._host_name = host.name
        self._tables: OrderedDict[str, ReleaseTable] = OrderedDict()
        self._pins: dict[tuple[str, int, int], _Pin] = {}
        # Re-entrant: a tensor can die, and so unpin, on this very thread inside a section.
        self._lock = threading.RLock()
        self._closed = False
        self._pid = os.getpid()
        self._namespace = pid_namespace()
        self._latency = LatencyRecorder()
        self.chunks = 0
        self.bytes = 0
        self.device_chunks = 0
        #: Host-only payloads that travelled in the descriptor.
        self.inline_chunks = 0
        self.errors = 0

    def _error(self, message: str) -> TransportError:
        self.errors += 1
        return TransportError(f"cuda_ipc receiver for edge {self._edge.edge!r}: {message}")

    def decode_descriptor(self, raw: bytes | memoryview) -> CudaIpcDescriptor:
        """Parse a cuda_ipc descriptor.

        Raises:
            TransportError: ``raw`` is not a cuda_ipc descriptor.
        """
        try:
            return decode_descriptor(raw)
        except DECODE_ERRORS as exc:
            raise self._error(f"bad descriptor: {exc}") from exc

    def _table(self, name: str) -> ReleaseTable:
        table = self._tables.get(name)
        if table is None:
            try:
                table = self._tables[name] = ReleaseTable.open(name)
            except TransportError as exc:
                raise self._error(str(exc)) from exc
            # Pins keep the tables they need; this only bounds what stays mapped for reuse.
            while len(self._tables) > 64:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(name)
        return table

    async def get(self, descriptor: Descriptor) -> Encoded:
        """Map the payload's device buffers and read its host part.

        Device buffers come back as flat uint8 tensors on this process's index of the
        producer's GPU, ordered after the producer's work on this thread's current stream.

        Raises:
            TransportError: the descriptor is not a cuda_ipc one, names another host, is
                stale or already released, CUDA is not available here for a payload with
                device buffers, a handle cannot be mapped, or the receiver is closed.
        """
        start = time.perf_counter()
        if self._closed:
            raise self._error("closed")
        if not isinstance(descriptor, CudaIpcDescriptor):
            raise self._error(f"got a {type(descriptor).__name__}, not a CudaIpcDescriptor")
        if descriptor.host != self._edge.host:
            raise self._error(
                f"the descriptor names host {descriptor.host!r}, but this is host "
                f"{self._edge.host!r}: CUDA IPC handles work within one host only"
            )
        table = self._table(descriptor.table)
        slot, generation = descriptor.slot, descriptor.generation
        try:
            state = table.state(slot, generation)
        except TransportError as exc:
            raise self._error(str(exc)) from exc
        key = (table.name, slot, generation)
        with self._lock:
            pin = self._pins.get(key)
            if pin is None and state is SlotState.LIVE:
                pin = self._pins[key] = _Pin(table, slot, generation)
        if state is not SlotState.LIVE or pin is None or pin.released:
            raise self._error(f"payload {generation} of slot {slot} is stale or already released")
        table.mark_reader(slot, generation, self._pid, self._namespace)
        inline = descriptor.host_inline
        host_descriptor: Descriptor | None = None
        if inline is not None:
            host_part = Encoded(inline.header, tuple(inline.buffers))
        else:
            host_descriptor = self._host.decode_descriptor(descriptor.host_part)
            host_part = await self._host.get(host_descriptor)
        if not descriptor.spans:
            encoded = host_part
            if inline is not None:
                self.inline_chunks += 1
        else:
            try:
                device_buffers = self._open(descriptor, pin, host_part)
            except BaseException as exc:
                if host_descriptor is not None:
                    await self._host.release(host_descriptor)
                if isinstance(exc, RuntimeError):
                    raise self._error(f"cannot map the payload's device buffers: {exc}") from exc
                raise
            encoded = Encoded(host_part.header, host_part.buffers, device_buffers=device_buffers)
            self.device_chunks += 1
        self.chunks += 1
        self.bytes += descriptor.nbytes
        self._latency.add((time.perf_counter() - start) * 1e6)
        return encoded

    def _open(self, descriptor: CudaIpcDescriptor, pin: _Pin, host_part: Encoded) -> dict[int, Any]:
        """Flat uint8 tensors over the payload's device buffers, by buffer index.

        Raises:
            TransportError: CUDA is not available, or the spans do not fit the payload.
            RuntimeError: CUDA could not open a handle or an event.
        """
        try:
            torch = require_cuda("get")
        except TransportError:
            self.errors += 1
            raise
        buffers, devices = host_part.buffers, descriptor.devices
        seen: set[int] = set()
        for span in descriptor.spans:
            if span.device >= len(devices) or span.index >= len(buffers) or span.index in seen:
                raise self._error(f"span {span} does not fit the payload")
            if memoryview(buffers[span.index]).nbytes or (span.nbytes and not span.handle):
                raise self._error(f"span {span} does not match its placeholder")
            seen.add(span.index)
        local = LOCAL.get(pin.key) if descriptor.pid == self._pid else None
        if local is not None:
            # Producer and consumer share this process, where CUDA refuses to open its own
            # handles: wait on the producer's events and share its tensors outright.
            flats, events = local
            for pooled in events:
                torch.cuda.current_stream(pooled.device).wait_event(pooled.event)
            return {span.index: flats[span.index] for span in descriptor.spans}
        indices = tuple(local_device(ref.uuid) for ref in devices)
        for ref, device in zip(devices, indices, strict=True):
            OPENED_EVENTS.wait(ref.event, device)
        pin.devices = indices
        unpin = functools.partial(self._unpin, pin)
        out: dict[int, Any] = {}
        for span in descriptor.spans:
            device = indices[span.device]
            if not span.nbytes:
                out[span.index] = torch.empty(0, dtype=torch.uint8, device=device)
                continue
            anchor = OPENED.open(span.handle, device)
            with self._lock:
                pin.count += 1
            out[span.index] = wrap_memory(
                anchor.base + span.offset, span.nbytes, device, keepalive=anchor, on_free=unpin
            )
        return out

    def _unpin(self, pin: _Pin) -> None:
        """torch freed one tensor over the payload (on whatever thread dropped it last)."""
        torch = sys.modules.get("torch")
        if torch is not None:
            # Work queued on this thread's stream may still read the bytes: let it finish
            # before the producer may hand them out again, as torch's own IPC deleter does.
            for device in pin.devices:
                # This runs inside a storage deleter, which must never raise: at worst the
                # sync is skipped (CUDA is shutting down) and the release goes ahead.
                with contextlib.suppress(Exception):
                    torch.cuda.current_stream(device).synchronize()
        with self._lock:
            pin.count -= 1
            done = pin.count == 0 and pin.released
            if done:
                self._pins.pop(pin.key, None)
        if done:
            pin.table.release(pin.slot, pin.generation)

    async def release(self, descriptor: Descriptor) -> None:
        """Finish with a payload: the producer reuses it once its tensors have died too.

        Raises:
            Nothing: a foreign, stale or repeated descriptor is ignored.
        """
        if not isinstance(descriptor, CudaIpcDescriptor) or descriptor.host != self._edge.host:
            return
        if descriptor.host_inline is None:
            with contextlib.suppress(TransportError):
                await self._host.release(self._host.decode_descriptor(descriptor.host_part))
        key = (descriptor.table, descriptor.slot, descriptor.generation)
        with self._lock:
            pin = self._pins.get(key)
            if pin is not None:
                if pin.released:
                    return
                pin.released = True
                if pin.count:
                    return
                del self._pins[key]
        table = pin.table if pin is not None else None
        if table is None:
            with contextlib.suppress(TransportError):
                table = self._table(descriptor.table)
        if table is not None:
            table.release(descriptor.slot, descriptor.generation)

    def statistics(self) -> TransportStatistics:
        """Chunks and bytes received, split into device payloads and host-only ones."""
        return TransportStatistics(
            "cuda_ipc",
            self.chunks,
            self.bytes,
            errors=self.errors,
            latency_p50_us=self._latency.percentile(50),
            latency_p99_us=self._latency.percentile(99),
            by_transport=chunks_by_transport(
                self.device_chunks, self.chunks, self._host_name, self.inline_chunks
            ),
        )

    async def aclose(self) -> None:
        """Release every payload got but not released (each frees once its tensors die).

        Raises:
            Nothing.
        """
        if self._closed:
            return
        self._closed = True
        with self._lock:
            finished = []
            for pin in list(self._pins.values()):
                pin.released = True
                if not pin.count:
                    finished.append(self._pins.pop(pin.key))
        for pin in finished:
            pin.table.release(pin.slot, pin.generation)
        self._tables.clear()
        with contextlib.suppress(TransportError):
            await self._host.aclose()
