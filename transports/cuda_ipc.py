"""The cuda_ipc transport: CUDA tensors move between processes of one host by IPC handle.

A payload's device buffers (:attr:`Encoded.device_buffers`) never leave the GPU. The
producer exports the caching-allocator segment that holds each one (once per storage, see
:mod:`transports._cuda_handles`), records an interprocess CUDA event on the producing
stream, and sends only ``(handle, offset, size, device UUID, event)``. The consumer maps
each segment once per process on its own index of that GPU, makes its current stream wait
for the event, and hands out flat uint8 tensors over the mapped bytes, which the codec
views as the payload's tensors. The header and any CPU tensors travel in the descriptor
itself while they are small (``inline_host``, 8 KiB by default, which a header and its
empty placeholders rarely exceed), else through the ``shm`` transport (a nested
descriptor); a payload with nothing on a device goes the same way.

Lifetime. The producer holds every buffer of a payload until the consumer is done with
it: the consumer has called ``release`` *and* torch has freed every tensor over the bytes
(the runtime releases right after decoding, while the stage still uses the tensors). The
consumer then writes the payload's generation into the producer's release table
(:mod:`transports._cuda_release_table`), which the producer reads on its next put or while
a put waits for room; no message is sent per chunk. ``capacity`` bounds the bytes held for
consumers: a put waits for room up to its deadline, then raises :class:`TransportFull`.
A sender closed while consumers still hold payloads keeps those buffers alive for as long
as its process lives (and up to ``linger`` seconds at exit), so a consumer never reads
memory that was handed out again.

Both ends in one process (tests, embedders) skip the IPC mapping, which CUDA forbids within
a process, and share the producer's tensors directly.

CUDA IPC needs processes that did not inherit CUDA through ``fork``: stagewire's workers
are fresh interpreters; embedders must use the ``spawn`` start method.

The pieces: :mod:`transports._cuda_descriptor` (the wire record),
:mod:`transports._cuda_sender` and :mod:`transports._cuda_receiver` (the two ends),
:mod:`transports._cuda_handles` (exporting and opening handles and events),
:mod:`transports._cuda_release_table` (the shared release words) and
:mod:`transports._cuda_dlpack` (tensors that report their own death).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pipeline._units import parse_byte_size
from transports._cuda_descriptor import CudaIpcDescriptor, DeviceRef, DeviceSpan
from transports._cuda_handles import check_start_method
from transports._cuda_receiver import CudaIpcReceiver
from transports._cuda_sender import CudaIpcSender
from transports._protocol import EdgeContext, Transport, TransportCapabilities
from transports._registry import create_transport

__all__ = (
    "DEFAULT_CAPACITY",
    "DEFAULT_SLOTS",
    "CudaIpcDescriptor",
    "CudaIpcReceiver",
    "CudaIpcSender",
    "CudaIpcTransport",
    "DeviceRef",
    "DeviceSpan",
)

#: Bytes a sender holds for its consumers at most, when the options name no capacity.
DEFAULT_CAPACITY = 4 * 2**30
#: Payloads a sender tracks at once, when the options name no number of slots.
DEFAULT_SLOTS = 4096
_DEFAULT_LINGER_S = 2.0
#: Host parts up to this many bytes travel inside the descriptor, not through shm.
DEFAULT_INLINE_HOST = 8 * 2**10


#: The shm arena of a cuda_ipc sender, when ``shm_options`` name no capacity: it carries
#: headers and the odd CPU tensor, while the bulk stays on the GPU.
DEFAULT_HOST_CAPACITY = 32 * 2**20


def _host_transport(options: Mapping[str, Any]) -> Transport:
    """The shm transport that carries host buffers (headers and CPU tensors)."""
    return create_transport("shm", {"capacity": DEFAULT_HOST_CAPACITY, **options})


class CudaIpcTransport:
    """CUDA tensors by IPC handle between processes of one host; host buffers via shm.

    Args:
        capacity: bytes a sender may hold for its consumers (an int or ``"4GiB"``).
        slots: payloads a sender may hold at once.
        shm_options: options of the shm transport that carries host buffers.
        linger: seconds a process waits at exit for consumers still reading payloads of
            its closed senders.
        inline_host: host parts (header and CPU buffers) of at most this many bytes travel
            inside the descriptor instead of through shm; 0 sends every one through shm.
    """

    name: ClassVar[str] = "cuda_ipc"
    capabilities: ClassVar[TransportCapabilities] = TransportCapabilities(
        bounded=True, detects_stale=True, host_local=True, device_buffers=True
    )

    def __init__(
        self,
        *,
        capacity: int | str = DEFAULT_CAPACITY,
        slots: int = DEFAULT_SLOTS,
        shm_options: Mapping[str, Any] | None = None,
        linger: float = _DEFAULT_LINGER_S,
        inline_host: int | str = DEFAULT_INLINE_HOST,
    ) -> None:
        # The registry turns TypeError into ConfigError, so every bad option raises one.
        try:
            self.capacity = parse_byte_size(capacity)
        except ValueError as exc:
            raise TypeError(f"capacity: {exc}") from None
        if self.capacity < 1:
            raise TypeError(f"capacity must be at least one byte, got {capacity!r}")
        try:
            self.inline_host = parse_byte_size(inline_host)
        except ValueError as exc:
            raise TypeError(f"inline_host: {exc}") from None
        if not isinstance(slots, int) or isinstance(slots, bool) or not 1 <= slots <= 2**20:
            raise TypeError(f"slots must be an int between 1 and {2**20}, got {slots!r}")
        if shm_options is not None and not isinstance(shm_options, Mapping):
            raise TypeError(f"shm_options must be a mapping, got {type(shm_options).__name__}")
        if not isinstance(linger, int | float) or isinstance(linger, bool) or linger < 0:
            raise TypeError(f"linger must be a non-negative number of seconds, got {linger!r}")
        self.slots = slots
        self.linger = float(linger)
        self.shm_options: dict[str, Any] = dict(shm_options or {})
        self.host = _host_transport(self.shm_options)

    def open_sender(self, edge: EdgeContext) -> CudaIpcSender:
        """Open the producer's end; its release table is created on the first put.

        Raises:
            TransportError: CUDA was inherited through ``fork`` (see the module docs).
        """
        check_start_method()
        return CudaIpcSender(
            edge,
            self.host,
            self.shm_options,
            capacity=self.capacity,
            slots=self.slots,
            linger=self.linger,
            inline_host=self.inline_host,
        )

    def open_receiver(self, edge: EdgeContext) -> CudaIpcReceiver:
        """Open the consumer's end.

        Raises:
            TransportError: CUDA was inherited through ``fork`` (see the module docs).
        """
        check_start_method()
        return CudaIpcReceiver(edge, self.host, self.shm_options)
