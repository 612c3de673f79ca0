"""The pacer: a handler that computes between its chunks sends each one as it is made."""

from __future__ import annotations

import time

from pipeline._actor import EAGER_SEND_S, _Pacer
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
