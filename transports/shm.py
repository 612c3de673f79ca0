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

from typing import ClassVar

from pipeline._errors import TransportError
from pipeline._units import parse_byte_size
from transports._protocol import (
    EdgeContext,
    TransportCapabilities,
)
from transports._shm_arena import align_up
from transports._shm_descriptor import ShmDescriptor, ShmOccupancy
from transports._shm_receiver import ShmReceiver
from transports._shm_segment import list_segments, remove_segments_of, sweep_dead_owners
from transports._shm_sender import ShmSender

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
DEFAULT_CAPACITY = 128 * 2**20
_MIN_CAPACITY = 4096
_OPTIONS = ("capacity", "copy")


class ShmTransport:
    """Payloads through a shared-memory arena per producer, on one host.

    Args:
        capacity: the arena size of each sender, in bytes or as a size string
            (``"128MiB"``, the default). Its segment reserves this much of /dev/shm up front.
        copy: copy payloads out on ``get`` instead of handing out views into shared memory.

    Raises:
        TransportError: an unknown option or an invalid value.
    """

    name: ClassVar[str] = "shm"
    capabilities: ClassVar[TransportCapabilities] = TransportCapabilities(
        bounded=True, detects_stale=True, host_local=True, survives_producer=True
    )

    def __init__(self, **options: object) -> None:
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise TransportError(
                f"the shm transport has no option {', '.join(map(repr, unknown))}; it takes "
                '`capacity` (bytes, such as 134217728 or "128MiB") and `copy` (true or false)'
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
