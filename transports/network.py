"""The network transport: payload buffers travel as zero-copy ZMQ frames over TCP.

It works between any two hosts, so ``auto`` uses it when the ends share none. The producer
holds each payload and the consumer pulls it::

    descriptor = await sender.put(key, encoded)   # held under a random token
    # ... the descriptor (endpoint, token, sizes) travels in the chunk envelope ...
    encoded = await receiver.get(descriptor)       # fetched from the producer's endpoint
    await receiver.release(descriptor)             # dropped there if never fetched

- **Head of line.** A payload of at most 256 KiB is *express*: packed into one frame, it is
  fetched over a connection of its own and sent the moment it is asked for, so it never
  queues behind a large payload. Larger payloads take turns on a bulk connection, one frame
  each, with at most ``window`` bytes (32 MiB) unacknowledged per consumer, so one waits
  behind at most a couple of frames of another.
- **Copies.** Buffers up to ``segment_size`` (16 MiB) travel as whole frames and arrive
  without a copy; larger ones travel in 1 MiB slices and are reassembled with one copy.
  What arrives is writable, so the codec shares it instead of copying. ``put`` copies every
  piece that could change afterwards (tensors, bytearrays) into pooled blocks, so the
  producer may reuse its tensors as soon as ``put`` returns; ``bytes`` pieces are sent by
  reference. ``copy_on_put: false`` sends tensors by reference too, for producers that
  never modify a payload after putting it (small pieces are still packed together, a
  copy, unless one travels alone in its frame).
- **Bounds.** A sender holds at most ``capacity`` bytes (1 GiB) unfetched; ``put`` waits for
  room up to its deadline, then raises :class:`TransportFull`, and a payload larger than the
  whole capacity fails at once. A ``get`` fails, naming the endpoint, at once if the
  producer's connection drops or is refused, and after ``fetch_timeout`` seconds (30) with
  no data otherwise. Frames must match the plan the descriptor's sizes imply, and ZMQ
  refuses any frame larger than the largest segment before allocating it.
- **Staleness.** A token is served once. Fetching it again, or after ``release``, is a
  :class:`TransportError` ("stale descriptor") at the consumer, and at the producer too.

Options (numbers, or strings with units such as ``"256MiB"`` and ``"5s"``): ``capacity``,
``fetch_timeout``, ``segment_size``, ``window`` and ``copy_on_put``.
"""

from __future__ import annotations

from typing import ClassVar

from transports._network_receiver import NetworkReceiver
from transports._network_sender import NetworkSender
from transports._network_wire import NetworkDescriptor, NetworkOptions
from transports._protocol import EdgeContext, TransportCapabilities

__all__ = (
    "NetworkDescriptor",
    "NetworkOptions",
    "NetworkReceiver",
    "NetworkSender",
    "NetworkTransport",
)


class NetworkTransport:
    """Payloads fetched over TCP from the producer, in frames that take turns.

    Args:
        capacity: bytes one sender holds unfetched (int or size string; default 1 GiB).
        fetch_timeout: seconds a get may receive nothing before it fails (default 30).
        segment_size: the largest frame, and so the largest buffer that arrives without a
            copy; larger buffers go in 1 MiB slices (default 16 MiB; 64 KiB to 64 MiB).
        window: bytes in flight to one consumer before the producer waits for its
            acknowledgement (default 32 MiB; at least one segment).
        copy_on_put: copy tensors and other mutable buffers at ``put`` (default true).
            False sends them by reference too (small pieces are still packed together,
            a copy, unless one travels alone in its frame): faster, but the producer must
            then never modify a payload after putting it.

    Raises:
        ConfigError: an option is malformed or out of range.
    """

    name: ClassVar[str] = "network"
    capabilities: ClassVar[TransportCapabilities] = TransportCapabilities(
        bounded=True, detects_stale=True, host_local=False, survives_producer=True
    )

    def __init__(
        self,
        *,
        capacity: object = "1GiB",
        fetch_timeout: object = 30.0,
        segment_size: object = "16MiB",
        window: object = "32MiB",
        copy_on_put: object = True,
    ) -> None:
        self.options = NetworkOptions.parse(
            capacity, fetch_timeout, segment_size, window, copy_on_put
        )

    def open_sender(self, edge: EdgeContext) -> NetworkSender:
        """Open the producer's end; it listens on ``edge.bind_host`` from its first put."""
        return NetworkSender(edge, self.options)

    def open_receiver(self, edge: EdgeContext) -> NetworkReceiver:
        """Open the consumer's end; it connects to producers as descriptors name them."""
        return NetworkReceiver(edge, self.options)
