"""The reorder buffer: one per (request, edge), releasing chunks strictly in seq order.

Chunks reach a receiving stage out of order (mixed transports, fan-in, retries) and
possibly more than once. :class:`ReorderBuffer` files them by seq and hands them to a
single consumer as 0, 1, 2, ... exactly once, ending at the chunk marked final. A seq that
does not arrive within ``chunk_timeout`` of the consumer starting to wait raises
:class:`ChunkGap` instead of hanging. Every chunk the buffer refuses or drops is passed to
``on_discard`` so that the caller can release the descriptor it carries.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Generic, TypeVar

from ._errors import ChunkGap, EndOfChannel, RequestAborted

__all__ = ("HELD_LIMIT", "ReorderBuffer")

#: How many chunk timeouts a wait may last in all while its producer says it is held up
#: elsewhere (see ReorderBuffer.alive).
HELD_LIMIT = 10

T = TypeVar("T")


class ReorderBuffer(Generic[T]):
    """Releases the chunks of one (request, edge) in seq order, each exactly once.

    Any number of producers may call :meth:`offer` (it never blocks), but only one task
    may wait in :meth:`get` at a time; a second concurrent ``get()`` raises RuntimeError.

    Args:
        request_id: the request the chunks belong to.
        edge: the edge they travel on.
        chunk_timeout: seconds a waiting ``get()`` allows the next seq before raising
            :class:`ChunkGap`; ``math.inf`` disables the deadline.
        on_discard: called with every item the buffer refuses or drops without
            delivering it. It should not raise.
        time_first: whether a wait for seq 0, with nothing offered yet, is timed too.
            False where the consumer starts before its producer may have begun (one input
            of a join, whose producer can be busy with other requests): such a wait is
            timed only once a later seq arrives, and is bounded otherwise by the request's
            own end (its deadline, a failure upstream, an abort).
    """

    __slots__ = (
        "_began",
        "_chunks",
        "_closed",
        "_deadline",
        "_delivered",
        "_duplicates",
        "_edge",
        "_exc",
        "_expected",
        "_expired",
        "_final_seq",
        "_finished",
        "_held",
        "_invalid",
        "_late",
        "_max_seq",
        "_on_discard",
        "_request_id",
        "_time_first",
        "_timeout",
        "_timer",
        "_untimed",
        "_waiter",
    )

    def __init__(
        self,
        request_id: str,
        edge: str,
        *,
        chunk_timeout: float,
        on_discard: Callable[[T], None] | None = None,
        time_first: bool = True,
    ) -> None:
        if not chunk_timeout > 0:  # Also rejects NaN.
            raise ValueError(f"chunk_timeout must be positive, got {chunk_timeout!r}")
        self._request_id = request_id
        self._edge = edge
        self._timeout = chunk_timeout
        self._on_discard = on_discard
        self._time_first = time_first
        #: A get() waits for seq 0 untimed (``time_first`` False, nothing offered yet).
        self._untimed = False
        self._chunks: dict[int, tuple[T, bool]] = {}
        self._waiter: asyncio.Future[None] | None = None
        self._expired = False
        self._deadline = 0.0
        #: When the waiting get()'s timed wait began, and whether ``alive`` extended it.
        self._began = 0.0
        self._held = False
        self._timer: asyncio.TimerHandle | None = None
        self._exc: BaseException | None = None
        self._closed = False
        self._finished = False
        self._final_seq: int | None = None
        self._expected = self._max_seq = self._delivered = 0
        self._duplicates = self._invalid = self._late = 0

    @property
    def request_id(self) -> str:
        """The request the chunks belong to."""
        return self._request_id

    @property
    def edge(self) -> str:
        """The edge the chunks travel on."""
        return self._edge

    @property
    def expected(self) -> int:
        """The next seq to deliver."""
        return self._expected

    @property
    def buffered(self) -> int:
        """How many chunks are held, not yet delivered."""
        return len(self._chunks)

    @property
    def delivered(self) -> int:
        """How many chunks were handed to the consumer."""
        return self._delivered

    @property
    def duplicates(self) -> int:
        """How many offers repeated a seq already buffered or delivered."""
        return self._duplicates

    @property
    def invalid(self) -> int:
        """How many offers had a negative seq, a seq past the final one or a conflicting final."""
        return self._invalid

    @property
    def late(self) -> int:
        """How many offers came after the buffer was closed or aborted."""
        return self._late

    @property
    def finished(self) -> bool:
        """Whether the final chunk has been delivered."""
        return self._finished

    @property
    def complete(self) -> bool:
        """Whether every chunk up to the final one has arrived (delivered or held)."""
        return self._final_seq is not None and self._expected + len(self._chunks) > self._final_seq

    @property
    def final_seq(self) -> int | None:
        """The seq of the final chunk, once it has arrived."""
        return self._final_seq

    @property
    def waiting(self) -> bool:
        """Whether a ``get()`` is waiting for the next chunk."""
        return self._waiter is not None

    def offer(self, seq: int, item: T, final: bool) -> bool:
        """File chunk ``seq``; False (and ``on_discard(item)``) when it is refused.

        A repeat of a chunk still buffered that carries an equal item (the same envelope
        delivered twice) is refused without ``on_discard``: the item names what the
        buffered one does, so releasing it would free the original's payload before it is
        read. The original's own release covers both.
        """
        if self._closed:
            self._late += 1
        elif seq < 0:
            self._invalid += 1
        elif seq in self._chunks:
            self._duplicates += 1
            if self._chunks[seq][0] == item:
                return False
        elif seq < self._expected:
            self._duplicates += 1
        elif (self._final_seq is not None and seq > self._final_seq) or (
            # A final claim below a seq already held contradicts that chunk, so it is refused.
            final and (self._final_seq is not None or seq < self._max_seq)
        ):
            self._invalid += 1
        else:
            self._chunks[seq] = (item, final)
            if final:
                self._final_seq = seq
            if seq > self._max_seq:
                self._max_seq = seq
            waiter = self._waiter
            if waiter is not None:
                if seq == self._expected:
                    if not waiter.done():
                        waiter.set_result(None)
                elif self._untimed:
                    self._arm(waiter.get_loop())  # a later seq came first: a real gap now
            return True
        if self._on_discard is not None:
            self._on_discard(item)
        return False

    def get_nowait(self) -> tuple[T, bool] | None:
        """The next in-order ``(item, final)`` if it has arrived, else None.

        Raises:
            EndOfChannel: the final chunk was delivered, or the buffer was closed.
            BaseException: the exception given to :meth:`abort`.
        """
        if self._closed or self._finished:
            raise self._ended_error()
        return self._take()

    def items(self) -> list[tuple[int, T]]:
        """The chunks held, not yet delivered, as ``(seq, item)``: a snapshot."""
        return [(seq, entry[0]) for seq, entry in self._chunks.items()]

    def swap(self, seq: int, old: T, new: T) -> bool:
        """Hold ``new`` in place of chunk ``seq``'s item, if that is still ``old`` (the
        same object); False when it is not: delivered, or dropped as the buffer ended."""
        entry = self._chunks.get(seq)
        if entry is None or entry[0] is not old:
            return False
        self._chunks[seq] = (new, entry[1])
        return True

    def discard(self, item: T) -> None:
        """Hand an item taken from this buffer but never consumed to ``on_discard``."""
        if self._on_discard is not None:
            self._on_discard(item)

    async def get(self) -> tuple[T, bool]:
        """Wait for and return the next in-order ``(item, final)``.

        Cancelling a waiting ``get()`` loses nothing: a chunk stays buffered until the
        call that returns it.

        Raises:
            EndOfChannel: the final chunk was delivered, or the buffer was closed.
            ChunkGap: the next seq did not arrive within ``chunk_timeout`` of this call
                starting to wait (with ``time_first`` False and nothing offered yet: of a
                later seq arriving). The buffer stays usable; the caller usually aborts.
            RuntimeError: another task is already waiting in ``get()``.
            BaseException: the exception given to :meth:`abort` (RequestAborted by default).
        """
        self._raise_if_ended()
        entry = self._take()
        if entry is not None:
            return entry
        if self._waiter is not None:
            raise RuntimeError(f"another task is already waiting on {self._edge!r}")
        loop = asyncio.get_running_loop()
        # This wait happens once per chunk on a streaming edge, so it arms no timer of its
        # own: it moves the deadline, and one timer per buffer, re-armed lazily when it
        # fires early, enforces it. A timer per wait cost more than the rest of the wait.
        self._expired = False
        if self._time_first or self._expected or self._chunks:
            self._arm(loop)
        else:
            self._untimed = True
        try:
            while not (self._closed or self._finished):
                self._waiter = loop.create_future()
                await self._waiter
                # The chunk may have landed in the same loop iteration as the deadline fired.
                entry = self._take()
                if entry is not None:
                    return entry
                if self._expired and not (self._closed or self._finished):
                    if self._held:
                        raise ChunkGap(
                            self._request_id,
                            self._edge,
                            self._expected,
                            self._timeout,
                            advice=f"its producer said it was held up sending elsewhere, for "
                            f"{HELD_LIMIT} chunk timeouts in all: a consumer of another of "
                            "its outputs reads nothing (a client that stopped reading, or a "
                            "join that reads one input to its end first)",
                        )
                    raise ChunkGap(self._request_id, self._edge, self._expected, self._timeout)
        finally:
            self._waiter = None
            self._untimed = False
        raise self._ended_error()

    def alive(self) -> None:
        """The producer is alive, held up elsewhere (see ``Held``): a waiting ``get()``'s
        deadline starts over, ``chunk_timeout`` from now, up to :data:`HELD_LIMIT` chunk
        timeouts from the wait's start. Past that the wait ends in a ChunkGap all the same,
        saying so: what holds the producer up may be this very consumer (a join reading
        another input to its end first), and a wait without end would hang the request.

        A wait for a first chunk that was not timed (``time_first`` False) is timed from
        now on: the producer has begun the request, and is stuck."""
        waiter = self._waiter
        if waiter is None or math.isinf(self._timeout):
            return
        if self._untimed:
            self._arm(waiter.get_loop())
        limit = self._began + HELD_LIMIT * self._timeout
        if self._deadline < limit:
            self._deadline = min(waiter.get_loop().time() + self._timeout, limit)
            self._held = True

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the waiting get()'s deadline: ``chunk_timeout`` from now."""
        self._untimed = False
        self._held = False
        if not math.isinf(self._timeout):
            self._began = loop.time()
            self._deadline = self._began + self._timeout
            if self._timer is None:
                self._timer = loop.call_at(self._deadline, self._expire)

    def _expire(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done() or self._untimed:
            return  # nobody waits, or untimed; the next wait (or a later seq) arms it again
        loop = waiter.get_loop()
        if loop.time() < self._deadline:
            self._timer = loop.call_at(self._deadline, self._expire)
            return
        self._expired = True
        waiter.set_result(None)

    def abort(self, exc: BaseException | None = None) -> int:
        """Drop every buffered chunk and fail the consumer with ``exc``.

        Args:
            exc: what ``get()`` raises from now on; RequestAborted by default.

        Returns:
            How many buffered chunks were discarded; 0 if already closed or aborted.

        Raises:
            Exception: the first error ``on_discard`` raised, once every item was released.
        """
        if self._closed:
            return 0
        self._exc = exc if exc is not None else RequestAborted(self._request_id, "aborted")
        return self._end()

    def close(self) -> int:
        """Drop every buffered chunk and end the stream; ``get()`` then raises EndOfChannel.

        Returns:
            How many buffered chunks were discarded; 0 if already closed or aborted.

        Raises:
            Exception: the first error ``on_discard`` raised, once every item was released.
        """
        return 0 if self._closed else self._end()

    def _end(self) -> int:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        items = [item for item, _ in self._chunks.values()]
        self._chunks.clear()
        if self._on_discard is not None:
            # Release every item even if one release fails, then report the first failure.
            first: Exception | None = None
            for item in items:
                try:
                    self._on_discard(item)
                except Exception as e:
                    first = e if first is None else first
            if first is not None:
                raise first
        return len(items)

    def _take(self) -> tuple[T, bool] | None:
        entry = self._chunks.pop(self._expected, None)
        if entry is not None:
            self._expected += 1
            self._delivered += 1
            if entry[1]:
                self._finished = True
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
        return entry

    def _raise_if_ended(self) -> None:
        if self._closed or self._finished:
            raise self._ended_error()

    def _ended_error(self) -> BaseException:
        if self._exc is not None:
            return self._exc
        return EndOfChannel(f"{self._request_id}/{self._edge}")
