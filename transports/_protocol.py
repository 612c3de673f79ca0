"""The Transport protocol: how one edge moves encoded payloads from producer to consumer.

A transport is a factory of two ends. The sending end lives in the producer process and the
receiving end in the consumer process::

    descriptor = await sender.put(key, encoded)     # producer side
    # ... the descriptor travels inside the chunk envelope ...
    encoded = await receiver.get(descriptor)        # consumer side
    ...                                             # use the payload
    await receiver.release(descriptor)              # free transport resources

The descriptor always travels in the envelope, so a receiver never guesses where data is.
Third-party transports implement these Protocols without importing any stagewire base
class, and prove themselves with :class:`pipeline.testing.TransportConformance`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import msgspec

if TYPE_CHECKING:
    from pipeline._encoded import Encoded
    from pipeline._keys import ChunkKey

__all__ = (
    "Descriptor",
    "EdgeContext",
    "Transport",
    "TransportCapabilities",
    "TransportReceiver",
    "TransportSender",
    "TransportStatistics",
)


class Descriptor(msgspec.Struct, frozen=True, tag_field="t"):
    """Base of the small tagged records that say where a payload is."""


@dataclass(frozen=True, slots=True)
class EdgeContext:
    """What a transport may know about the edge it serves.

    Attributes:
        edge: the edge's name, ``producer->consumer``.
        host: the host identity of the process opening this end.
        options: transport options from the edge's spec.
        inline_threshold: payloads at or below this size go inline under ``auto``.
        bind_host: the address this process's sockets bind to, for transports that serve
            payloads over the network.
    """

    edge: str
    host: str
    options: dict[str, Any] = field(default_factory=dict)
    inline_threshold: int = 64 * 1024
    bind_host: str = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class TransportCapabilities:
    """What the conformance suite may expect of a transport.

    Attributes:
        bounded: ``put`` can run out of capacity and then waits up to its deadline.
        detects_stale: ``get`` of a released descriptor raises :class:`TransportError`.
        host_local: descriptors name host-local resources and fail on other hosts.
        device_buffers: ``put`` accepts payloads whose tensors are still on a CUDA device
            (``Encoded.device_buffers``); without it the runtime copies them to host first.
        survives_producer: a payload that ``get`` returned stays whole and readable after
            its producer's process dies (a mapping the consumer holds, or bytes it fetched).
            The runtime then counts a producer done with a request once its consumers have
            got every payload, so that producer's death no longer fails the request.
    """

    bounded: bool = False
    detects_stale: bool = False
    host_local: bool = False
    device_buffers: bool = False
    survives_producer: bool = False


@dataclass(frozen=True, slots=True)
class TransportStatistics:
    """A snapshot of one transport end's counters.

    Attributes:
        held: payloads this end still holds resources for: put and not yet released, on
            a sender; fetched and not yet released, on a receiver. Zero once traffic stops.
    """

    transport: str
    chunks: int = 0
    bytes: int = 0
    fallbacks: int = 0
    errors: int = 0
    latency_p50_us: float = 0.0
    latency_p99_us: float = 0.0
    by_transport: dict[str, int] = field(default_factory=dict)
    held: int = 0


@runtime_checkable
class TransportSender(Protocol):
    """The producer's end of an edge's transport.

    Two methods are optional, for transports that hold a payload until its consumer
    reads it, so that a consumer that dies first does not keep it held for good:

    * ``note_reader(descriptor, endpoint, pid)``: called after each ``put`` with where the
      descriptor is sent: the consumer's data endpoint, and its pid when it runs on this
      host in this pid namespace (else 0).
    * ``readers_gone(endpoints)``: the consumers at these endpoints were declared dead;
      what is held for them may go (shm frees only what a dead process held; network
      drops what was sent to them).
    """

    async def put(
        self, key: ChunkKey, encoded: Encoded, *, timeout: float | None = None
    ) -> Descriptor:
        """Store ``encoded`` for ``key`` and return where to find it.

        Raises:
            TransportError: no capacity within ``timeout``, or the transport is closed.
        """
        ...

    def statistics(self) -> TransportStatistics:
        """Counters of this end."""
        ...

    async def aclose(self) -> None:
        """Release every resource; idempotent.

        Raises:
            Nothing: closing twice, or while others wait, is safe.
        """
        ...


@runtime_checkable
class TransportReceiver(Protocol):
    """The consumer's end of an edge's transport."""

    def decode_descriptor(self, raw: bytes | memoryview) -> Descriptor:
        """Parse a descriptor received in an envelope.

        Raises:
            TransportError: the bytes are not a descriptor of this transport.
        """
        ...

    async def get(self, descriptor: Descriptor) -> Encoded:
        """Materialise the payload a descriptor names, as zero-copy views where safe.

        Raises:
            TransportError: the descriptor is stale, forged, from another host, or the
                transport is closed.
        """
        ...

    async def release(self, descriptor: Descriptor) -> None:
        """Free what ``get`` pinned; idempotent per descriptor.

        Raises:
            Nothing: releasing an unknown or released descriptor does nothing.
        """
        ...

    def statistics(self) -> TransportStatistics:
        """Counters of this end."""
        ...

    async def aclose(self) -> None:
        """Release every resource; idempotent.

        Raises:
            Nothing: closing twice, or while others wait, is safe.
        """
        ...


@runtime_checkable
class Transport(Protocol):
    """A way of moving payloads along an edge; a factory of sending and receiving ends."""

    name: ClassVar[str]
    capabilities: ClassVar[TransportCapabilities]

    def open_sender(self, edge: EdgeContext) -> TransportSender:
        """Open the producer's end for ``edge``; close it with ``aclose``."""
        ...

    def open_receiver(self, edge: EdgeContext) -> TransportReceiver:
        """Open the consumer's end for ``edge``; close it with ``aclose``."""
        ...
