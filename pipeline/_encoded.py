"""The encoded form of a payload: one msgpack header plus out-of-band buffers."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

__all__ = ("DECODE_ERRORS", "Buffer", "Encoded")

#: What msgspec raises for undecodable bytes. Invalid UTF-8 in a string surfaces as
#: UnicodeDecodeError rather than DecodeError, so every wire boundary catches both.
DECODE_ERRORS: tuple[type[Exception], ...] = (msgspec.DecodeError, UnicodeDecodeError)

#: A contiguous run of bytes: ``bytes``, ``bytearray`` or a ``memoryview`` of format ``B``.
Buffer = bytes | bytearray | memoryview


# Not frozen: a frozen dataclass sets fields through object.__setattr__, which doubled the
# cost of encoding a small payload.
@dataclass(slots=True)
class Encoded:
    """A payload ready for a transport.

    Attributes:
        header: msgpack bytes describing the payload; tensors and arrays appear in it
            only as references to ``buffers``.
        buffers: the raw bytes of every tensor and array, in reference order, never copied
            on encode when the source is contiguous.
    """

    header: bytes
    buffers: tuple[Buffer, ...] = ()
    _nbytes: int = -1

    @property
    def nbytes(self) -> int:
        """Total size of the header and all buffers, in bytes (computed once)."""
        if self._nbytes < 0:
            self._nbytes = len(self.header) + sum(memoryview(b).nbytes for b in self.buffers)
        return self._nbytes
