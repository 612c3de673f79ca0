"""What a network sender holds: payloads frozen into frames, the capacity they take, and the
pooled blocks their copies live in.

``put`` returns before any consumer asks for the payload, and the producer may then reuse or
change its tensors (the zero-copy send race in LESSONS). So every piece that could change
is copied at ``put`` into a block that only this sender can write; ``bytes`` pieces cannot
change and are sent by reference. Blocks come from a pool of warm pages, since touching fresh
pages is several times slower than copying into reused ones, and a block returns to the pool
only when nothing can still read it: it was never handed to ZMQ, or the receiver
acknowledged the message that carried it (so ZMQ had finished writing it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from pipeline._encoded import Buffer, Encoded
from pipeline._errors import TransportError, TransportFull
from transports._network_wire import ALIGN, PACK, FramePlan

__all__ = ("BlockPool", "Capacity", "Held", "freeze", "piece_views")

_ZEROS = bytes(ALIGN)
#: ``freeze`` pauses after copying this much, so a put blocks the event loop only briefly.
_COPY_STEP = 2**20


class BlockPool:
    """Reusable ``bytearray`` blocks in power-of-two size classes up to the segment size.

    Args:
        keep: the most bytes of idle blocks kept for reuse; blocks returned beyond it are
            left to the garbage collector.
        segment: the largest block.
    """

    __slots__ = ("_free", "_keep", "_kept", "_segment")

    def __init__(self, keep: int, segment: int) -> None:
        self._keep = keep
        self._segment = segment
        self._kept = 0
        self._free: dict[int, list[bytearray]] = {}

    def _size_class(self, n: int) -> int:
        return min(self._segment, 1 << max(n - 1, 1).bit_length())

    def take(self, n: int) -> bytearray:
        """A block of at least ``n`` bytes (``n`` is at most the segment size)."""
        size = self._size_class(n)
        free = self._free.get(size)
        if free:
            self._kept -= size
            return free.pop()
        return bytearray(size)

    def give(self, block: bytearray) -> None:
        """Return a block that nothing reads any more."""
        size = len(block)
        if self._kept + size <= self._keep and size == self._size_class(size):
            self._free.setdefault(size, []).append(block)
            self._kept += size

    @property
    def kept(self) -> int:
        """Bytes of idle blocks held for reuse."""
        return self._kept

    def clear(self) -> None:
        """Drop every idle block."""
        self._free.clear()
        self._kept = 0


@dataclass(slots=True, eq=False)
class Held:
    """A payload a sender holds under a token until it is sent or dropped.

    Attributes:
        frames: the payload's frames, in plan order, ready to send.
        blocks: the pool block behind each frame, or ``None`` for a frame that is not in a
            block or whose block was handed to ZMQ (it is then owned by the in-flight record).
        express: it is one small frame, sent as soon as it is fetched.
        sending: a receiver fetched it; a second fetch is refused.
        reader: where it was sent (the consumer's data endpoint), once the runtime said.
        begun: how many puts its sender had begun before this one (see
            ``NetworkSender.readers_gone``).
    """

    token: bytes
    sizes: list[int]
    nbytes: int
    frames: list[Buffer]
    blocks: list[bytearray | None]
    express: bool
    sending: bool = False
    reader: str = ""
    begun: int = 0


def piece_views(encoded: Encoded, *, copy: bool) -> list[tuple[memoryview, bool]]:
    """Every piece of ``encoded`` as a flat byte view, and whether it must be copied: its
    bytes can change and ``copy`` is set."""
    out: list[tuple[memoryview, bool]] = []
    for piece in (encoded.header, *encoded.buffers):
        if isinstance(piece, bytes):
            out.append((memoryview(piece), False))
            continue
        view = memoryview(piece)
        if not view.c_contiguous:
            # A copy of a strided view is ours alone, so it can no longer change.
            out.append((memoryview(view.tobytes()), False))
            continue
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        out.append((view, copy and not (view.readonly and isinstance(view.obj, bytes))))
    return out


def freeze(
    pieces: list[tuple[memoryview, bool]],
    plan: list[FramePlan],
    pool: BlockPool,
    frames: list[Buffer],
    blocks: list[bytearray | None],
) -> Iterator[None]:
    """Build the frames of ``plan`` from ``pieces`` into ``frames``, copying what must be.

    A generator that pauses between the megabytes it copies, so that the caller can let
    the event loop run during the copy of a large payload instead of blocking it throughout.
    ``blocks`` receives, for each frame, the pool block it lives in, or ``None``.
    """
    copied = False
    for frame in plan:
        if frame.kind == PACK:
            if len(frame.members) == 1 and not pieces[frame.members[0][0]][1]:
                # A lone piece that cannot change (typically the header) needs no copy.
                frames.append(pieces[frame.members[0][0]][0])
                blocks.append(None)
                continue
            parts: list[Buffer] = []
            pos = 0
            for piece, offset in frame.members:
                if offset > pos:
                    parts.append(_ZEROS[: offset - pos])
                view = pieces[piece][0]
                parts.append(view)
                pos = offset + view.nbytes
            # One join is one allocation and one copy per piece, and the result is immutable.
            frames.append(b"".join(parts))
            blocks.append(None)
            continue
        view, copy = pieces[frame.piece]
        src = view[frame.offset : frame.offset + frame.length]
        if not copy:
            frames.append(src)
            blocks.append(None)
            continue
        block = pool.take(frame.length)
        dst = memoryview(block)[: frame.length]
        for start in range(0, frame.length, _COPY_STEP):
            if copied:
                yield
            end = start + _COPY_STEP
            dst[start:end] = src[start:end]
            copied = True
        frames.append(dst)
        blocks.append(block)


def _granted(waiter: asyncio.Future[None]) -> bool:
    return waiter.done() and not waiter.cancelled() and waiter.exception() is None


class Capacity:
    """Bytes a sender may hold, handed out to waiting puts in arrival order.

    Strict arrival order keeps a large put from starving behind a stream of small ones.
    """

    __slots__ = ("_closed", "_waiters", "limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._closed: TransportError | None = None

    async def take(self, n: int, timeout: float | None, what: str) -> None:
        """Wait until ``n`` bytes are free, then hold them.

        Raises:
            TransportFull: not enough was freed within ``timeout`` seconds.
            TransportError: the sender closed while this waited.
        """
        if self._closed is not None:
            raise self._closed
        if not self._waiters and self.used + n <= self.limit:
            self.used += n
            return
        waiter = asyncio.get_running_loop().create_future()
        entry = (n, waiter)
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(timeout):
                await waiter
        except TimeoutError:
            if _granted(waiter):
                return  # Granted just as the deadline passed: keep it.
            raise TransportFull(
                f"{what}: no room for {n} bytes within {timeout:g}s: {self.used} of "
                f"{self.limit} bytes are held unfetched; consumers must fetch or release "
                "payloads, or raise the transport's capacity"
            ) from None
        except BaseException:
            if _granted(waiter):
                self.give(n)  # Granted, then cancelled before it could be used.
            raise
        finally:
            if not _granted(waiter):
                # Cancelling the task cancelled the waiter too, so it may be done yet still
                # queued; and it may have been what kept smaller puts behind it waiting.
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)
                self._grant()

    def give(self, n: int) -> None:
        """Free ``n`` bytes and wake the puts that now fit."""
        self.used -= n
        self._grant()

    def _grant(self) -> None:
        waiters = self._waiters
        while waiters:
            n, waiter = waiters[0]
            if waiter.done():
                waiters.popleft()  # Cancelled; its put cleans up after itself.
                continue
            if self.used + n > self.limit:
                return
            waiters.popleft()
            self.used += n
            waiter.set_result(None)

    def close(self, error: TransportError) -> None:
        """Fail every waiting put, and every later one, with ``error``."""
        self._closed = error
        while self._waiters:
            _, waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(error)
