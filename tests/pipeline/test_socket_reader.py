"""The reader that drains a ZeroMQ socket into its callbacks, over a real socket pair."""

from __future__ import annotations

import zmq

from pipeline._sockets import SocketReader, TooManyFrames, new_context
from tests.pipeline.conftest import wait_for


async def test_a_message_of_too_many_frames_is_dropped_uncopied_and_the_next_one_read() -> None:
    """``MAXMSGSIZE`` caps each frame, not a message: a message of more frames than the
    reader takes is dropped (its frames past the limit never copied into Python, where
    they all used to be) and reported, and the reader goes on with the next message."""
    ctx = new_context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        got: list[list[bytes]] = []
        errors: list[tuple[BaseException, list[bytes]]] = []
        reader = SocketReader(
            pull, got.append, lambda exc, frames: errors.append((exc, frames)), max_frames=2
        )
        reader.start()
        push.send_multipart([b"a" * 1000, b"b", *[b"c" * 100_000] * 50])
        push.send_multipart([b"x", b"y"])
        await wait_for(lambda: got, timeout=10)
        assert got == [[b"x", b"y"]]
        ((exc, frames),) = errors
        assert isinstance(exc, TooManyFrames)
        assert "a message of 52 frames, where at most 2 are taken" in str(exc)
        assert frames == [b"a" * 1000, b"b"]
        reader.stop()
    finally:
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()
