"""The shm descriptor, and the layout arithmetic both ends of the shm transport share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import msgspec

from pipeline._encoded import Buffer
from pipeline._latency import LatencyRecorder
from transports._protocol import (
    Descriptor,
    TransportStatistics,
)
from transports._shm_arena import ALIGN, align_up
from transports._shm_segment import (
    NAME_PATTERN,
)

__all__ = (
    "DESCRIPTOR_DECODER",
    "LOW32",
    "ShmDescriptor",
    "ShmOccupancy",
    "byte_view",
    "extent_size",
    "slots_for",
    "statistics",
)

#: The low 32 bits of a slot word: a reader's pid, or the part of a generation stored with it.
LOW32 = 0xFFFFFFFF

_Size = Annotated[int, msgspec.Meta(ge=0, le=2**62)]


#: The most buffers (tensors and arrays) one payload may have: its descriptor lists each.
MAX_BUFFERS = 2**16


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
    buffer_sizes: Annotated[tuple[_Size, ...], msgspec.Meta(max_length=MAX_BUFFERS)]


DESCRIPTOR_DECODER = msgspec.msgpack.Decoder(ShmDescriptor)


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


def byte_view(buf: Buffer) -> memoryview:
    """``buf`` as a flat, contiguous view of bytes."""
    view = memoryview(buf)
    if view.format == "B" and view.ndim == 1 and view.c_contiguous:
        return view
    return view.cast("B") if view.c_contiguous else memoryview(view.tobytes())


def extent_size(header_size: int, buffer_sizes: tuple[int, ...]) -> int:
    """The bytes an extent needs: the header, then every buffer, each 64-byte aligned."""
    return max(ALIGN, align_up(header_size) + sum(align_up(n) for n in buffer_sizes))


def slots_for(capacity: int) -> int:
    """Slot-table size: one slot per 4 KiB of arena, within [64, 16384]."""
    return max(64, min(capacity // 4096, 16384))


def statistics(
    chunks: int, nbytes: int, errors: int, latency: LatencyRecorder, held: int
) -> TransportStatistics:
    """The counters either end of the shm transport reports, as one frozen snapshot."""
    return TransportStatistics(
        "shm",
        chunks,
        nbytes,
        errors=errors,
        latency_p50_us=latency.percentile(50),
        latency_p99_us=latency.percentile(99),
        by_transport={"shm": chunks},
        held=held,
    )
