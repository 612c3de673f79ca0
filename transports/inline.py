"""The inline transport: the payload travels inside the envelope itself.

It has no capacity to run out of and holds no resources, so ``release`` is a no-op and a
descriptor can be read any number of times. ``auto`` picks it for small payloads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Final, TypeVar

import msgspec

from pipeline._encoded import DECODE_ERRORS, Encoded
from pipeline._errors import TransportError, TransportFull
from pipeline._keys import ChunkKey
from pipeline._units import format_size
from transports._protocol import (
    Descriptor,
    EdgeContext,
    TransportCapabilities,
    TransportStatistics,
)
from transports._resource import AsyncResource

if TYPE_CHECKING:
    from pipeline._codec import PayloadCodec

__all__ = (
    "MAX_DATA_FRAME",
    "MAX_DATA_MESSAGE",
    "MAX_INLINE",
    "InlineDescriptor",
    "InlineReceiver",
    "InlineSender",
    "InlineTransport",
)

#: The largest data message a replica or the master takes: one batch of envelopes, on a
#: same-host link or a ZMQ socket. A larger one cannot come from a peer of this version, so
#: its link is dropped as garbage; the runtime never sends one.
MAX_DATA_MESSAGE: Final = 1 << 30
#: The largest payload an inline envelope carries: what leaves its envelope room within
#: MAX_DATA_MESSAGE.
MAX_INLINE: Final = MAX_DATA_MESSAGE - (1 << 20)
#: What a receiving socket takes beyond MAX_DATA_MESSAGE: ZMQ checks its limit against the
#: frame on the wire, which CURVE's encryption makes a few dozen bytes longer, so that a
#: message the runtime sends is never one its receiver refuses.
WIRE_HEADROOM: Final = 1 << 16
#: The largest data frame a replica or the master receives.
MAX_DATA_FRAME: Final = MAX_DATA_MESSAGE + WIRE_HEADROOM

T = TypeVar("T")


class InlineDescriptor(Descriptor, frozen=True, tag="inline", array_like=True):
    """The whole payload: its header and every out-of-band buffer."""

    header: bytes
    buffers: list[bytes]


_decoder = msgspec.msgpack.Decoder(InlineDescriptor)
_many_decoder = msgspec.msgpack.Decoder(list[InlineDescriptor | None])


class _InlineEnd(AsyncResource):
    """What both inline ends share: counters, closing, and the context-manager protocol."""

    __slots__ = ("_closed", "_edge", "bytes", "chunks")
    _role = "end"

    def __init__(self, edge: EdgeContext) -> None:
        self._edge = edge
        self._closed = False
        self.chunks = 0
        self.bytes = 0

    def _closed_error(self) -> TransportError:
        return TransportError(f"inline {self._role} for edge {self._edge.edge!r} is closed")

    def statistics(self) -> TransportStatistics:
        """Chunks and bytes moved so far."""
        return TransportStatistics(
            "inline", self.chunks, self.bytes, by_transport={"inline": self.chunks}
        )

    async def aclose(self) -> None:
        """Mark this end closed; idempotent.

        Raises:
            Nothing.
        """
        self._closed = True


class InlineSender(_InlineEnd):
    """Producer end: copies the payload into a descriptor."""

    __slots__ = ()
    _role = "sender"

    async def put(
        self, key: ChunkKey, encoded: Encoded, *, timeout: float | None = None
    ) -> InlineDescriptor:
        """Wrap ``encoded`` in a descriptor; never waits.

        Raises:
            TransportFull: the payload is larger than :data:`MAX_INLINE`.
            TransportError: the sender is closed.
        """
        return self.wrap(encoded)

    def wrap(self, encoded: Encoded) -> InlineDescriptor:
        """What :meth:`put` returns, without a coroutine: the runtime sends small chunks so.

        Raises:
            TransportFull: the payload is larger than :data:`MAX_INLINE` (the edge's
                fallback, if any, takes it).
            TransportError: the sender is closed.
        """
        if self._closed:
            raise self._closed_error()
        if encoded.nbytes > MAX_INLINE:
            raise TransportFull(
                f"edge {self._edge.edge!r}: a payload of {format_size(encoded.nbytes)} is over "
                f"the {format_size(MAX_INLINE)} an inline envelope carries: send such payloads "
                "by shm (with a capacity above their size) or network, or as smaller chunks"
            )
        self.chunks += 1
        self.bytes += encoded.nbytes
        buffers = encoded.buffers
        # Copied now: the envelope is encoded later, and the producer may reuse its tensor.
        return InlineDescriptor(encoded.header, [bytes(b) for b in buffers] if buffers else [])


class InlineReceiver(_InlineEnd):
    """Consumer end: the descriptor already holds the payload."""

    __slots__ = ()
    _role = "receiver"

    def decode_descriptor(self, raw: bytes | memoryview) -> InlineDescriptor:
        """Parse an inline descriptor.

        Raises:
            TransportError: ``raw`` is not an inline descriptor.
        """
        try:
            return _decoder.decode(raw)
        except DECODE_ERRORS as exc:
            raise TransportError(f"edge {self._edge.edge!r}: bad inline descriptor: {exc}") from exc

    def decode_descriptors(self, raw: bytes | memoryview) -> list[InlineDescriptor | None]:
        """Parse a msgpack array of inline descriptors (nil for a chunk without payload).

        The runtime reads a run of chunks' descriptors so, with one decode.

        Raises:
            TransportError: ``raw`` is not such an array.
        """
        try:
            return _many_decoder.decode(raw)
        except DECODE_ERRORS as exc:
            raise TransportError(
                f"edge {self._edge.edge!r}: bad inline descriptors: {exc}"
            ) from exc

    async def get(self, descriptor: Descriptor) -> Encoded:
        """Return the payload the descriptor carries.

        Raises:
            TransportError: the descriptor is not an inline one, or the receiver is closed.
        """
        return self.take(descriptor)

    def take(self, descriptor: Descriptor) -> Encoded:
        """What :meth:`get` returns, without a coroutine: an inline payload never waits,
        and the runtime reads small streamed chunks this way.

        Raises:
            TransportError: the descriptor is not an inline one, or the receiver is closed.
        """
        if not isinstance(descriptor, InlineDescriptor):
            raise TransportError(
                f"edge {self._edge.edge!r}: inline receiver got a {type(descriptor).__name__}"
            )
        if self._closed:
            raise self._closed_error()
        header, buffers = descriptor.header, descriptor.buffers
        nbytes = len(header) + sum(map(len, buffers)) if buffers else len(header)
        self.chunks += 1
        self.bytes += nbytes
        return Encoded(header, tuple(buffers), nbytes)

    def read(self, descriptor: InlineDescriptor, codec: PayloadCodec[T]) -> T:
        """The payload a descriptor carries, decoded by ``codec``: :meth:`take` and decode
        in one step, without an intermediate :class:`Encoded` when it has no buffers.

        Raises:
            TransportError: the receiver is closed.
            PayloadError: the payload does not decode as ``codec``'s type.
        """
        if self._closed:
            raise self._closed_error()
        if descriptor.buffers:
            return codec.decode(self.take(descriptor))
        header = descriptor.header
        self.chunks += 1
        self.bytes += len(header)
        return codec.decode_header(header)

    async def release(self, descriptor: Descriptor) -> None:
        """Nothing to free: the payload lived in the envelope.

        Raises:
            Nothing.
        """


class InlineTransport:
    """Payloads inside the envelope: no copies beyond the envelope's own, no resources."""

    name: ClassVar[str] = "inline"
    capabilities: ClassVar[TransportCapabilities] = TransportCapabilities(survives_producer=True)

    def __init__(self, **options: object) -> None:
        if options:
            raise TransportError(f"the inline transport takes no options, got {sorted(options)}")

    def open_sender(self, edge: EdgeContext) -> InlineSender:
        """Open the producer's end."""
        return InlineSender(edge)

    def open_receiver(self, edge: EdgeContext) -> InlineReceiver:
        """Open the consumer's end."""
        return InlineReceiver(edge)
