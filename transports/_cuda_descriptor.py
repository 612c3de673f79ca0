"""The cuda_ipc descriptor: a release-table token, device spans and the host part (or its
descriptor).

Handles, offsets and events travel as raw bytes and integers in msgspec Structs, never as
pickles. Every field is bounded, so a forged descriptor fails to decode rather than reach
CUDA with an absurd value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from transports._cuda_release_table import NAME_PATTERN
from transports._protocol import Descriptor, EdgeContext
from transports.inline import InlineDescriptor

__all__ = (
    "CudaIpcDescriptor",
    "DeviceRef",
    "DeviceSpan",
    "chunks_by_transport",
    "decode_descriptor",
    "encode_part",
    "host_edge",
)

_Size = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=2**31)]
_Handle = Annotated[bytes, msgspec.Meta(max_length=4096)]


class DeviceRef(msgspec.Struct, frozen=True, array_like=True):
    """A GPU that holds some of a payload's buffers, and the event to wait for on it."""

    uuid: Annotated[str, msgspec.Meta(max_length=128)]
    #: The producer's index of the GPU: for messages only, never used to open anything.
    index: _Count
    event: Annotated[bytes, msgspec.Meta(max_length=256)]


class DeviceSpan(msgspec.Struct, frozen=True, array_like=True):
    """Where one device buffer lies: an offset into an exported allocator segment."""

    index: _Count
    device: _Count
    handle: _Handle
    offset: _Size
    nbytes: _Size


class CudaIpcDescriptor(Descriptor, frozen=True, tag="cuda_ipc", array_like=True):
    """One payload: its host part's descriptor, its release-table token and device spans."""

    host: Annotated[str, msgspec.Meta(max_length=256)]
    pid: _Count
    table: Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
    slot: _Count
    generation: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
    nbytes: _Size
    #: The host-buffer transport's own descriptor, msgpack-encoded; empty when the host
    #: part travels in :attr:`host_inline` instead.
    host_part: bytes
    devices: tuple[DeviceRef, ...] = ()
    spans: tuple[DeviceSpan, ...] = ()
    #: A small host part (the header, empty placeholders, a few small CPU buffers) carried
    #: in the descriptor itself: no shm extent to write, read or release for it.
    host_inline: InlineDescriptor | None = None


_decoder = msgspec.msgpack.Decoder(CudaIpcDescriptor)
_encoder = msgspec.msgpack.Encoder()

#: Parse a cuda_ipc descriptor; raises msgspec's decode errors.
decode_descriptor = _decoder.decode
#: Encode the host transport's descriptor for :attr:`CudaIpcDescriptor.host_part`.
encode_part = _encoder.encode


def host_edge(edge: EdgeContext, options: Mapping[str, Any]) -> EdgeContext:
    """The edge context the host-buffer transport is opened with."""
    return EdgeContext(edge.edge, edge.host, dict(options), edge.inline_threshold, edge.bind_host)


def chunks_by_transport(
    device_chunks: int, chunks: int, host_name: str, inline_chunks: int = 0
) -> dict[str, int]:
    """Chunks by what carried them: ``cuda_ipc`` for device payloads; for host-only ones,
    ``inline`` where they travelled in the descriptor, else the host transport's name."""
    counts = {"cuda_ipc": device_chunks}
    if inline_chunks:
        counts["inline"] = inline_chunks
    if chunks - device_chunks - inline_chunks:
        counts[host_name] = chunks - device_chunks - inline_chunks
    return counts
