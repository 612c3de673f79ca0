"""A payload on its way into a network receiver: frames received into their final places.

Frames land where they stay: ``PACK`` and ``WHOLE`` frames are kept as the zero-copy,
writable ZMQ frames they arrived in, and ``SLICE`` frames are received straight into one
aligned buffer per piece (``recv_into``). The codec shares writable buffers instead of
copying them, so a payload is copied once on the receiving side, and only where it was
sliced.

Nothing the producer sends is trusted: each frame must be the one the plan expects next,
with exactly the planned size, or the payload fails with a protocol error.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import zmq

from pipeline._encoded import Buffer, Encoded
from pipeline._errors import TransportError
from transports._network_wire import ALIGN, PACK, SLICE, FramePlan, NetworkDescriptor

if TYPE_CHECKING:
    from transports._network_connection import Connection

__all__ = ("DISCARD", "DONE", "FAILED", "PENDING", "Inbound", "ProtocolError")

#: States of an inbound payload.
PENDING: Final = 0
DONE: Final = 1
FAILED: Final = 2

#: ``recv_into`` this to skip a frame without keeping it.
DISCARD: Final = bytearray()


class ProtocolError(Exception):
    """A producer sent a frame its plan does not allow."""


def _aligned(n: int) -> memoryview:
    """``n`` writable bytes at an ``ALIGN``-byte boundary, not zeroed (it is overwritten).

    numpy loads on the first sliced payload, not with the transport: a worker whose
    payloads never come sliced over the network does not pay its import at start-up.
    """
    import numpy as np

    raw = np.empty(n + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + n].data


@dataclass(slots=True, eq=False)
class Inbound:
    """One payload being fetched, or fetched and not yet taken by ``get``.

    Attributes:
        pieces: each piece received so far (header first); a sliced piece's buffer exists
            from its first slice on.
        next: the index in ``plan`` of the frame due next.
        progress: when a frame of it last arrived (``time.monotonic``), for its deadline.
        refused: the producer refused it (unknown token, other sizes, sent already).
        dropped: failing, it told the producer to drop the token.
        taken: ``get`` has returned it (or its error) once; a second ``get`` is stale.
    """

    desc: NetworkDescriptor
    conn: Connection
    xid: int
    sizes: list[int]
    plan: list[FramePlan]
    started: float
    progress: float
    pieces: list[Buffer | None]
    state: int = PENDING
    next: int = 0
    error: TransportError | None = None
    result: Encoded | None = None
    refused: bool = False
    #: The producer was told to drop its token (when this fetch failed).
    dropped: bool = False
    taken: bool = False
    waiters: list[asyncio.Future[None]] = field(default_factory=list)

    def receive(self, index: int, sock: zmq.Socket[Any]) -> int:
        """Receive frame ``index`` from ``sock`` into its place.

        Returns:
            The frame's size.

        Raises:
            ProtocolError: the frame is not the one due next, or has the wrong size (it is
                consumed either way).
        """
        if index != self.next:
            sock.recv_into(DISCARD, flags=zmq.NOBLOCK)
            raise ProtocolError(f"frame {index} arrived where frame {self.next} was due")
        spec = self.plan[index]
        pieces = self.pieces
        if spec.kind == SLICE:
            target = pieces[spec.piece]
            if target is None:
                target = pieces[spec.piece] = _aligned(self.sizes[spec.piece])
            view = memoryview(target)[spec.offset : spec.offset + spec.length]
            # recv_into truncates a longer frame and reports its full size: never overruns.
            size = sock.recv_into(view, flags=zmq.NOBLOCK)
        else:
            data = sock.recv(zmq.NOBLOCK, copy=False).buffer
            size = data.nbytes
            if size == spec.length:
                if spec.kind == PACK:
                    sizes = self.sizes
                    for piece, offset in spec.members:
                        pieces[piece] = data[offset : offset + sizes[piece]]
                else:
                    pieces[spec.piece] = data
        if size != spec.length:
            raise ProtocolError(f"frame {index} holds {size} bytes; the plan says {spec.length}")
        self.next = index + 1
        self.progress = time.monotonic()
        return size

    @property
    def complete(self) -> bool:
        """Every frame has arrived."""
        return self.next == len(self.plan)

    def assemble(self) -> Encoded:
        """The payload, once every frame has arrived; the pieces belong to it from now on."""
        header, *buffers = self.pieces
        assert header is not None
        self.pieces = []
        return Encoded(bytes(header), tuple(b if b is not None else b"" for b in buffers))
