"""The encoded form of a payload: one msgpack header plus out-of-band buffers.

A buffer normally holds host bytes. A payload encoded from CUDA tensors keeps each such
tensor's bytes on its device instead (:attr:`Encoded.device_buffers`), so a transport that
can move device memory (``cuda_ipc``) never stages them through the host; every other
transport receives the payload after :func:`to_host` has copied them out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NoReturn

import msgspec

__all__ = ("DECODE_ERRORS", "NO_DEVICE_BUFFERS", "Buffer", "Encoded", "to_host")

#: What msgspec raises for undecodable bytes. Invalid UTF-8 in a string surfaces as
#: UnicodeDecodeError rather than DecodeError, and a header nested past the interpreter's
#: recursion limit as RecursionError, so every wire boundary catches all three.
DECODE_ERRORS: tuple[type[Exception], ...] = (
    msgspec.DecodeError,
    UnicodeDecodeError,
    RecursionError,
)

#: A contiguous run of bytes: ``bytes``, ``bytearray`` or a ``memoryview`` of format ``B``.
Buffer = bytes | bytearray | memoryview


class _NoDeviceBuffers(dict[int, Any]):
    """The empty ``device_buffers`` that every host-only payload shares; it cannot change.

    A dict subclass rather than a fresh dict per payload: a default factory added about
    100 ns to every ``Encoded``, and truth-testing a dict stays a C-level length check.
    """

    __slots__ = ()

    def _frozen(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError("a host-only payload's device_buffers cannot be changed")

    # Every mutator refuses.
    __setitem__ = __delitem__ = _frozen
    clear = pop = popitem = setdefault = update = __ior__ = _frozen
    # dataclasses refuse an unhashable default; identity is all a constant needs.
    __hash__ = object.__hash__  # type: ignore[assignment]  # dict sets __hash__ to None


#: The shared, immutable empty mapping of a payload with nothing on a device.
NO_DEVICE_BUFFERS: dict[int, Any] = _NoDeviceBuffers()


# Not frozen: a frozen dataclass sets fields through object.__setattr__, which doubled the
# cost of encoding a small payload.
@dataclass(slots=True)
class Encoded:
    """A payload ready for a transport.

    Attributes:
        header: msgpack bytes describing the payload; tensors and arrays appear in it
            only as references to ``buffers``.
        buffers: the raw bytes of every tensor and array, in reference order, never copied
            on encode when the source is contiguous. A buffer whose bytes stay on a device
            is an empty placeholder (``b""``) here.
        device_buffers: buffer index to a flat, contiguous 1-D ``torch.uint8`` CUDA tensor
            holding that buffer's bytes on the device they were encoded on; empty for a
            host-only payload. Only transports with ``capabilities.device_buffers`` see a
            payload with any; the runtime applies :func:`to_host` for the others.
    """

    header: bytes
    buffers: tuple[Buffer, ...] = ()
    _nbytes: int = -1
    device_buffers: dict[int, Any] = field(default=NO_DEVICE_BUFFERS, kw_only=True)

    @property
    def nbytes(self) -> int:
        """Total size of the header and all buffers, device buffers included (computed once)."""
        if self._nbytes < 0:
            size = len(self.header)
            if self.buffers:
                size += sum(memoryview(b).nbytes for b in self.buffers)
            if self.device_buffers:
                size += sum(int(t.nbytes) for t in self.device_buffers.values())
            self._nbytes = size
        return self._nbytes

    @property
    def has_device_buffers(self) -> bool:
        """Whether any buffer's bytes are still on a device."""
        return bool(self.device_buffers)


def to_host(encoded: Encoded) -> Encoded:
    """``encoded`` with every device buffer copied to host memory; itself if none is on one.

    Each device buffer costs one device-to-host copy, into a fresh CPU tensor that the
    returned buffer views (writable, so decoding shares it rather than copying again).
    The header is unchanged: its references still name the CUDA device, so decoding on the
    far side moves each tensor back to that device, as for any host-borne CUDA tensor.

    Raises:
        RuntimeError: the copy failed (torch's own error, e.g. a CUDA fault).
    """
    device_buffers = encoded.device_buffers
    if not device_buffers:
        return encoded
    buffers = list(encoded.buffers)
    for index, flat in device_buffers.items():
        # .cpu() on a CUDA tensor is one synchronous copy into pageable memory, ordered
        # after the work already queued on the current stream that produced the bytes.
        buffers[index] = memoryview(flat.cpu().numpy())
    return Encoded(encoded.header, tuple(buffers))
