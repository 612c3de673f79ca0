"""Same-host links: framing over real Unix sockets, fallbacks, and their use by a pipeline."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import subprocess
import sys

import pytest
import zmq

from pipeline import Pipeline
from pipeline import _sockets as sockets_module
from pipeline._local_link import LocalLink, LocalListener
from pipeline._sockets import Outbox, new_context
from stages.text import Text
from tests.pipeline.conftest import spec, wait_for
from transports.inline import MAX_DATA_FRAME, MAX_DATA_MESSAGE


class _Collect:
    """A listener's callbacks: every frame received, and every error raised on one."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.errors: list[BaseException] = []
        self.arrived = asyncio.Event()

    def on_message(self, frames: list[bytes]) -> None:
        self.frames.extend(bytes(f) for f in frames)
        self.arrived.set()

    def on_error(self, exc: BaseException, frames: list[bytes]) -> None:
        self.errors.append(exc)

    async def until(self, n: int) -> None:
        async with asyncio.timeout(10):
            while len(self.frames) < n:
                self.arrived.clear()
                await self.arrived.wait()


@pytest.fixture
async def listener() -> tuple[LocalListener, _Collect]:
    got = _Collect()
    lst = LocalListener(got.on_error, max_message=64 << 20)
    lst.start(got.on_message)
    yield lst, got
    lst.close()


async def test_frames_arrive_whole_and_in_order(listener: tuple[LocalListener, _Collect]) -> None:
    lst, got = listener
    link = LocalLink(lst.address)
    # Small frames, an empty one, and large ones that overrun the socket buffer, so partial
    # writes queue and the reader takes the large-frame path.
    frames = [os.urandom(n) for n in (1, 0, 100, 70_000, 3 << 20, 5, 9 << 20, 2)]
    for frame in frames:
        assert link.send(frame)
    await got.until(len(frames))
    assert got.frames == frames
    assert lst.frames == len(frames)
    link.close()


async def test_one_frame_split_across_many_writes(listener: tuple[LocalListener, _Collect]) -> None:
    """A frame written a few bytes at a time (as a slow kernel might deliver it) still parses."""
    lst, got = listener
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect("\0" + lst.address)
    body = b"stagewire" * 50
    wire = struct.pack("!I", len(body)) + body + struct.pack("!I", 3) + b"end"
    try:
        for i in range(0, len(wire), 7):
            raw.send(wire[i : i + 7])
            # A scheduling point, not a wait: the listener reads each piece on its own.
            await asyncio.sleep(0)
        await got.until(2)
    finally:
        raw.close()
    assert got.frames == [body, b"end"]


_SEND_AS = """
import os, socket, struct, sys
uid = int(sys.argv[2])
if uid != os.geteuid():
    os.setgid(uid)
    os.setuid(uid)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\\0" + sys.argv[1])
try:
    s.sendall(struct.pack("!I", 5) + b"hello")
    s.recv(1)  # until the listener closes the link, or the test ends
except (BrokenPipeError, ConnectionResetError):
    pass  # closed on us, before our frame was sent or with it unread
"""


def _send_as(address: str, uid: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", _SEND_AS, address, str(uid)])


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to connect as another user")
async def test_a_process_of_another_user_is_refused(
    listener: tuple[LocalListener, _Collect],
) -> None:
    """The abstract socket has no file permissions: the listener checks who connects. A
    process of another user (nobody) is refused and counted; this user's frame arrives."""
    lst, got = listener
    other = _send_as(lst.address, 65534)
    try:
        await wait_for(lambda: lst.refused == 1)
        assert await asyncio.to_thread(other.wait, 10) == 0  # its link was closed on it
    finally:
        if other.poll() is None:
            other.kill()
        other.wait()
    mine = _send_as(lst.address, os.geteuid())
    try:
        await got.until(1)
        assert got.frames == [b"hello"] and lst.refused == 1
    finally:
        mine.kill()
        mine.wait()


async def test_an_oversized_frame_drops_the_link_and_is_counted() -> None:
    got = _Collect()
    lst = LocalListener(got.on_error, max_message=1000)
    lst.start(got.on_message)
    try:
        link = LocalLink(lst.address)
        assert link.send(b"x" * 10)
        assert link.send(b"y" * 5000)
        await got.until(1)

        async def dropped() -> bool:
            return lst.garbage_count == 1

        await wait_for(dropped)
        assert got.frames == [b"x" * 10]
        # The next link works as before.
        fresh = LocalLink(lst.address)
        assert fresh.send(b"ok")
        await got.until(2)
        assert got.frames[-1] == b"ok"
        fresh.close()
        link.close()
    finally:
        lst.close()


async def test_a_link_to_a_closed_listener_breaks_and_says_so() -> None:
    got = _Collect()
    lst = LocalListener(got.on_error, max_message=1 << 20)
    lst.start(got.on_message)
    link = LocalLink(lst.address)
    lst.close()
    with pytest.raises(OSError):
        LocalLink(lst.address)  # nothing listens there any more

    async def broken() -> bool:
        link.send(b"z" * 65536)
        return link.broken

    await wait_for(broken)
    assert not link.send(b"after")


async def test_outbox_falls_back_to_zmq_when_no_link_opens() -> None:
    """An endpoint whose same-host address has no listener is reached over ZMQ instead."""
    ctx = new_context()
    import zmq

    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    outbox = Outbox(ctx)
    try:
        outbox.set_local(endpoint, "stagewire-nobody-listens-here")
        outbox.send(endpoint, b"\xc0")
        outbox.flush()
        assert pull.poll(5000)
        assert pull.recv() == b"\x91\xc0"  # a one-envelope batch
    finally:
        outbox.close()
        pull.close()
        ctx.term()


async def test_an_outbox_drops_what_is_sent_to_a_forgotten_endpoint() -> None:
    """A consumer may go on crediting a producer that died (the request no longer needed
    it): once forgotten, its endpoint gets no new socket, which would reconnect for ever,
    until a peer table names it again."""
    ctx = new_context()
    import zmq

    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    outbox = Outbox(ctx)
    try:
        outbox.forget(endpoint)
        outbox.send(endpoint, b"\xc0")
        outbox.flush()
        assert outbox.dropped == 1 and not pull.poll(200)
        assert endpoint not in outbox._socks
        outbox.reachable([endpoint])
        outbox.send(endpoint, b"\xc0")
        outbox.flush()
        assert pull.poll(5000) and pull.recv() == b"\x91\xc0"
    finally:
        outbox.close()
        pull.close()
        ctx.term()


async def test_an_outbox_never_sends_a_message_larger_than_a_receiver_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch larger than MAX_DATA_MESSAGE (a receiver drops its link with all it queued)
    leaves as several within it; an envelope larger than that alone is dropped, counted
    and logged."""
    monkeypatch.setattr(sockets_module, "MAX_DATA_MESSAGE", 1000)
    ctx = new_context()
    import zmq

    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    outbox = Outbox(ctx)
    small = [bytes([0xC4, 200]) + bytes([k]) * 200 for k in range(5)]  # bin 8 of 200 bytes
    try:
        for envelope in (*small[:3], b"\xc5" + bytes(2000), *small[3:]):
            outbox.send(endpoint, envelope)
        outbox.flush()
        frames = []
        while len(frames) < 2 and pull.poll(5000):
            frames.append(pull.recv())
        assert frames == [b"\x94" + b"".join(small[:4]), b"\x91" + small[4]]
        assert outbox.oversize == 1
        assert all(len(f) <= 1000 for f in frames) and not pull.poll(100)
    finally:
        outbox.close()
        pull.close()
        ctx.term()


async def test_a_local_pipeline_moves_its_data_over_local_links() -> None:
    s = spec({"first": ":Echo", "second": ":Echo"}, [("first", "second")])
    async with Pipeline(s) as pipe:
        for i in range(20):
            assert await pipe.submit(Text(f"r{i}")) == Text(f"r{i}")
        stats = await pipe.statistics()
        # Receivers take more than any message sent (see test_curve's headroom test).
        master = pipe._master_or_fail()
        assert master.inbox.getsockopt(zmq.MAXMSGSIZE) == MAX_DATA_FRAME > MAX_DATA_MESSAGE
        assert master.local is not None and master.local.max_message == MAX_DATA_FRAME
    # Every worker received its input over a link, and so did the client its outputs.
    assert all(r["local_frames"] > 0 for r in stats["replicas"]), stats["replicas"]
    assert stats["local_frames"] > 0
    # Nothing went to a replica gone from the peer table.
    assert [r["dropped_sends"] for r in stats["replicas"]] == [0, 0]
    assert stats["dropped_sends"] == 0


async def test_links_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGEWIRE_LOCAL_LINKS", "0")  # inherited by the spawned workers
    s = spec({"first": ":Echo", "second": ":Echo"}, [("first", "second")])
    async with Pipeline(s) as pipe:
        for i in range(5):
            assert await pipe.submit(Text(f"r{i}")) == Text(f"r{i}")
        stats = await pipe.statistics()
    assert [r["local_frames"] for r in stats["replicas"]] == [0, 0]
    assert stats["local_frames"] == 0
