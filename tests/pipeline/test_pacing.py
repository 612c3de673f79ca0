"""The pacer: a handler that computes between its chunks sends each one as it is made."""

from __future__ import annotations

import asyncio
import time

from pipeline._actor import EAGER_SEND_S, HOLD_S, _Pacer
from pipeline._sockets import Outbox


class _Captured(Outbox):
    """The real outbox, with each frame kept here instead of written to a socket."""

    def __init__(self) -> None:
        super().__init__(None)  # type: ignore[arg-type]  # no ZMQ context: nothing to connect
        self.frames: list[tuple[str, bytes]] = []

    def _transmit(self, endpoint: str, frame: bytes) -> None:
        self.frames.append((endpoint, frame))


def _compute(seconds: float) -> None:
    """Hold the thread, as a model layer does between two chunks."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


async def test_a_slowly_made_chunk_leaves_at_once() -> None:
    outbox = _Captured()
    pacer = _Pacer(outbox)
    _compute(3 * EAGER_SEND_S)
    outbox.send("peer", b"\x01")
    pacer.sent()
    assert len(outbox.frames) == 1


async def test_quickly_made_chunks_wait_for_the_batch() -> None:
    outbox = _Captured()
    pacer = _Pacer(outbox)
    outbox.send("peer", b"\x01")
    pacer.sent()
    outbox.send("peer", b"\x02")
    pacer.sent()
    assert outbox.frames == []
    outbox.flush()
    assert len(outbox.frames) == 1  # one batch of both


async def test_a_chunk_queued_after_a_batch_left_still_leaves_at_once() -> None:
    """A batch left while the chunk was made (the handler awaited a transport's put, say):
    the chunk, queued after it, must not wait through the next chunk's computation."""
    outbox = _Captured()
    pacer = _Pacer(outbox)
    _compute(3 * EAGER_SEND_S)
    outbox.send("peer", b"\x01")  # something else queued, and sent during an await
    outbox.flush()
    outbox.send("peer", b"\x02")  # then the chunk
    pacer.sent()
    assert len(outbox.frames) == 2


class _SlowWire(_Captured):
    """Each frame takes a while to leave, as a cold ``sendmsg`` that wakes its reader does."""

    def _transmit(self, endpoint: str, frame: bytes) -> None:
        _compute(3 * EAGER_SEND_S)
        super()._transmit(endpoint, frame)


async def test_a_quick_chunk_after_a_slow_send_joins_the_next_batch() -> None:
    """The last tokens of a stream, then at once its summary, then its end: the summary
    must not leave alone just because sending the tokens took long. (The send's own time
    counted as the summary's making, so each went out in a frame of its own.)"""
    outbox = _SlowWire()
    pacer = _Pacer(outbox)
    _compute(3 * EAGER_SEND_S)
    outbox.send("peer", b"\x01")  # the last tokens, slowly made: they leave at once
    pacer.sent()
    outbox.send("peer", b"\x02")  # the summary, made at once
    pacer.sent()
    assert len(outbox.frames) == 1
    outbox.send("peer", b"\x03")  # the stream's end
    outbox.flush()
    assert len(outbox.frames) == 2  # the summary and the end in one


async def test_quick_chunks_of_a_handler_that_never_suspends_leave_every_hold_period() -> None:
    """Chunks each made a little faster than the eager limit, by a handler that never
    awaits: they batch, but none waits past the hold period for the handler's end."""
    outbox = _Captured()
    pacer = _Pacer(outbox)
    start = time.perf_counter()
    sent = 0
    while time.perf_counter() - start < 5 * HOLD_S:
        _compute(EAGER_SEND_S / 2)
        outbox.send("peer", bytes([sent % 256]))
        pacer.sent()
        sent += 1
    assert 3 <= len(outbox.frames) < sent / 2  # batches, each within a hold period


async def test_a_message_reader_flushes_at_once_unless_it_woke_something() -> None:
    """After a message is handled, what it queued leaves at once when nothing else is
    ready to run; when it woke a task, the flush waits for that task, which may add to it."""
    outbox = _Captured()
    loop = asyncio.get_running_loop()
    woken: asyncio.Future[None] = loop.create_future()

    def handle_quietly(frames: list[bytes]) -> None:
        outbox.send("peer", frames[0])

    def handle_waking(frames: list[bytes]) -> None:
        outbox.send("peer", frames[0])
        woken.set_result(None)  # schedules the waiting task's step

    checked: asyncio.Future[tuple[int, int]] = loop.create_future()

    def read() -> None:  # a loop callback, as a socket reader is
        outbox.flushing_after(handle_quietly)([b"\x01"])
        at_once = len(outbox.frames)
        outbox.flushing_after(handle_waking)([b"\x02"])
        checked.set_result((at_once, len(outbox.frames)))

    async def waiter() -> None:
        await woken
        outbox.send("peer", b"\x03")  # joins the pending flush

    task = loop.create_task(waiter())
    await asyncio.sleep(0)  # the waiter now waits
    loop.call_soon(read)
    assert await asyncio.wait_for(checked, 5) == (1, 1)
    await asyncio.wait_for(task, 5)
    await asyncio.sleep(0)
    assert len(outbox.frames) == 2  # the second message's frame and the woken send, in one
