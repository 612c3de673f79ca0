"""The shm transport: the conformance suite, and what only a shared-memory arena must do.

Everything here runs on the real /dev/shm, and the tests about other processes start real
ones: producers and consumers in subprocesses, killed with SIGKILL where that is the point.
Every test checks that it left no segment of this process or its children behind.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import resource
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

import msgspec
import numpy as np
import pytest
import pytest_asyncio
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline._codec import codec_for
from pipeline._encoded import Encoded
from pipeline._errors import ProducerLost, TransportError, TransportFull
from pipeline._host import host_identity
from pipeline._keys import ChunkKey
from pipeline.testing import TransportConformance
from transports import EdgeContext, Transport
from transports._shm_arena import ALIGN, Arena
from transports._shm_descriptor import DESCRIPTOR_DECODER
from transports._shm_segment import PREFIX, SHM_DIR, free_space
from transports.shm import (
    DEFAULT_CAPACITY,
    ShmDescriptor,
    ShmReceiver,
    ShmSender,
    ShmTransport,
    list_segments,
    remove_segments_of,
    sweep_dead_owners,
)

T = TypeVar("T")
MiB = 2**20
ROOT = Path(__file__).resolve().parents[2]
EDGE = "a->b"
#: How long any single step may take before the test fails it as a hang.
STEP = 10.0

# A producer in another process: puts argv[1] payloads, prints each descriptor as hex,
# then "ready", and keeps its segment until its stdin closes.
PRODUCER = """
import asyncio, sys
import msgspec
from pipeline._encoded import Encoded
from pipeline._host import host_identity
from pipeline._keys import ChunkKey
from transports import EdgeContext
from transports.shm import ShmTransport

async def main():
    sender = ShmTransport(capacity="4MiB").open_sender(EdgeContext("a->b", host_identity()))
    async with sender:
        for i in range(int(sys.argv[1])):
            payload = Encoded(b"header %d" % i, (bytes([i]) * (1000 * (i + 1)), b"tail"))
            desc = await sender.put(ChunkKey("x", "a->b", i), payload, timeout=10)
            print(msgspec.msgpack.encode(desc).hex(), flush=True)
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.read)

asyncio.run(main())
"""

# A consumer in another process: gets the descriptor read from stdin, prints the size of
# its first buffer, and holds the extent (never releasing) until it is killed.
CONSUMER = """
import asyncio, sys
from pipeline._host import host_identity
from transports import EdgeContext
from transports.shm import ShmTransport

async def main():
    receiver = ShmTransport().open_receiver(EdgeContext("a->b", host_identity()))
    desc = receiver.decode_descriptor(bytes.fromhex(sys.stdin.readline()))
    got = await receiver.get(desc)
    print(len(got.buffers[0]), flush=True)
    await asyncio.to_thread(sys.stdin.read)

asyncio.run(main())
"""


class _Frame(msgspec.Struct):
    """A payload holding one tensor, as a stage would send."""

    tensor: torch.Tensor


def _pid_of(name: str) -> int:
    """The owner pid written in a segment name."""
    return int(name[len(PREFIX) :].split("-")[0])


def _touch(names: list[str]) -> None:
    """Create empty files under /dev/shm."""
    for name in names:
        Path(SHM_DIR, name).touch()


def _remove(names: list[str]) -> None:
    """Remove files under /dev/shm, if they exist."""
    for name in names:
        Path(SHM_DIR, name).unlink(missing_ok=True)


def _key(seq: int = 0) -> ChunkKey:
    """A chunk key on the test edge."""
    return ChunkKey("shm-test", EDGE, seq)


def _blob(index: int, size: int) -> Encoded:
    """A payload of one ``size``-byte buffer, distinct for every ``index``."""
    return Encoded(b"blob %d" % index, ((index % 251).to_bytes(1, "little") * size,))


async def _within(aw: Awaitable[T], seconds: float = STEP) -> T:
    """Await ``aw``, failing the test as a hang after ``seconds``."""
    try:
        async with asyncio.timeout(seconds):
            return await aw
    except TimeoutError:
        pytest.fail(f"a step did not finish within {seconds:g}s")


@pytest.fixture
def spawned() -> list[int]:
    """Pids of the subprocesses a test started, whose segments the leak check covers too."""
    return []


@pytest.fixture(autouse=True)
def no_segments_left(spawned: list[int]) -> Iterator[None]:
    """Fail a test that leaves a segment of this process or its children under /dev/shm."""

    def mine() -> set[str]:
        pids = {os.getpid(), *spawned}
        return {name for name in list_segments() if _pid_of(name) in pids}

    before = mine()
    yield
    if mine() - before:
        gc.collect()  # Views dropped by the test may still sit in reference cycles.
    leaked = mine() - before
    remove_segments_of(
        (_pid_of(name) for name in leaked), held_too=True
    )  # So one leak fails one test.
    assert not leaked, f"segments left behind: {sorted(leaked)}"


@asynccontextmanager
async def _ends(**options: object) -> AsyncIterator[tuple[ShmSender, ShmReceiver]]:
    """A sender and a receiver of one shm transport, both closed on exit."""
    transport = ShmTransport(**{"capacity": "4MiB", **options})
    edge = EdgeContext(EDGE, host_identity())
    async with transport.open_sender(edge) as sender, transport.open_receiver(edge) as receiver:
        yield sender, receiver


@pytest_asyncio.fixture
async def ends() -> AsyncIterator[tuple[ShmSender, ShmReceiver]]:
    """A zero-copy sender and receiver over a 4 MiB arena."""
    async with _ends() as pair:
        yield pair


class _Child:
    """A Python subprocess of this test run, read line by line with deadlines."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.pid = proc.pid

    async def line(self) -> str:
        """The next line it prints; fails the test if none comes within STEP seconds."""
        assert self.proc.stdout is not None
        raw = await _within(self.proc.stdout.readline())
        assert raw, f"child {self.pid} exited early with {await self.proc.wait()}"
        return raw.decode().strip()

    async def send(self, text: str) -> None:
        """Write a line to its stdin."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode() + b"\n")
        await self.proc.stdin.drain()

    async def finish(self) -> int:
        """Close its stdin and wait for it to exit; its exit status."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return await _within(self.proc.wait())

    async def kill(self) -> None:
        """SIGKILL it and reap it, so its pid no longer runs."""
        self.proc.kill()
        await _within(self.proc.wait())


@asynccontextmanager
async def _child(spawned: list[int], script: str, *args: str) -> AsyncIterator[_Child]:
    """Run ``script`` with ``python -c`` in the repository root; killed on exit if alive."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        *args,
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    spawned.append(proc.pid)
    child = _Child(proc)
    try:
        yield child
    finally:
        if proc.returncode is None:
            await child.kill()
        if proc.stdin is not None:
            proc.stdin.close()
        await proc.wait()


class TestShm(TransportConformance):
    """The shm transport, reading in place, passes the conformance suite."""

    @pytest.fixture
    def transport(self) -> Transport:
        """A zero-copy shm transport with a small arena, so the suite can fill it."""
        return ShmTransport(capacity="4MiB")


class TestShmCopy(TransportConformance):
    """The shm transport in copy-out mode passes the conformance suite."""

    @pytest.fixture
    def transport(self) -> Transport:
        """A copy-out shm transport with a small arena."""
        return ShmTransport(capacity=4 * MiB, copy=True)


def test_options() -> None:
    """Options are parsed and checked, and bad ones are TransportErrors that name them."""
    default = ShmTransport()
    assert (default.capacity, default.copy) == (DEFAULT_CAPACITY, False)
    assert (ShmTransport(capacity="8MiB", copy=True).capacity, default.name) == (8 * MiB, "shm")
    caps = ShmTransport.capabilities
    assert (caps.bounded, caps.detects_stale, caps.host_local) == (True, True, True)
    with pytest.raises(TransportError, match="'colour', 'size'"):
        ShmTransport(colour="blue", size=1)
    with pytest.raises(TransportError, match="capacity"):
        ShmTransport(capacity="lots")
    with pytest.raises(TransportError, match="at least 4096"):
        ShmTransport(capacity=100)
    with pytest.raises(TransportError, match="copy"):
        ShmTransport(copy="yes")


async def test_segment_is_created_lazily_reserved_and_named(
    ends: tuple[ShmSender, ShmReceiver],
) -> None:
    """A sender makes no segment until its first put, then one uniquely named segment whose
    whole size is reserved in /dev/shm."""
    sender, _ = ends
    mine = {n for n in list_segments() if _pid_of(n) == os.getpid()}
    unmade = sender.segment_name
    assert unmade is None
    assert {n for n in list_segments() if _pid_of(n) == os.getpid()} == mine
    await sender.put(_key(), _blob(1, 100), timeout=STEP)
    name = sender.segment_name
    assert name is not None
    assert name.startswith(f"{PREFIX}{os.getpid()}-")
    assert len(name.rsplit("-", 1)[1]) == 16
    assert {n for n in list_segments() if _pid_of(n) == os.getpid()} == mine | {name}
    stat = os.stat(os.path.join(SHM_DIR, name))
    assert stat.st_blocks * 512 >= 4 * MiB, "the arena was not reserved up front"
    assert stat.st_mode & 0o777 == 0o600


async def test_two_senders_have_distinct_segments() -> None:
    """Two senders of one edge in one process never share or collide on a segment name."""
    async with _ends() as (first, _), _ends() as (second, _):
        await first.put(_key(), _blob(1, 10), timeout=STEP)
        await second.put(_key(), _blob(2, 10), timeout=STEP)
        names = {first.segment_name, second.segment_name}
        assert len(names) == 2
        assert names <= set(list_segments())


async def test_mapping_is_prefaulted(ends: tuple[ShmSender, ShmReceiver]) -> None:
    """A put into never-touched arena pages takes no page faults: the mapping was pre-faulted."""
    sender, _ = ends
    await sender.put(_key(), _blob(0, 64), timeout=STEP)
    payload = _blob(1, 2 * MiB)  # 512 pages, built (and faulted in) before measuring.
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    await sender.put(_key(1), payload, timeout=STEP)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 64, f"a 2 MiB put into fresh arena pages took {faults} page faults"


async def test_no_head_of_line_blocking(ends: tuple[ShmSender, ShmReceiver]) -> None:
    """While the reader holds one extent, ten times the capacity flows through the rest."""
    sender, receiver = ends
    held_desc = await sender.put(_key(), _blob(7, MiB), timeout=STEP)
    held = await receiver.get(held_desc)
    for i in range(40):
        desc = await sender.put(_key(i + 1), _blob(i, MiB), timeout=1.0)
        got = await receiver.get(desc)
        assert bytes(got.buffers[0][:1]) * MiB == bytes(got.buffers[0]) == _blob(i, MiB).buffers[0]
        del got
        await receiver.release(desc)
    assert bytes(held.buffers[0]) == _blob(7, MiB).buffers[0]
    assert sender.occupancy().extents == 1
    del held
    await receiver.release(held_desc)
    assert sender.occupancy().extents == 0


async def test_stale_descriptor_after_reuse(ends: tuple[ShmSender, ShmReceiver]) -> None:
    """Once its slot is reused under a new generation, an old descriptor is refused as stale."""
    sender, receiver = ends
    old = await sender.put(_key(), _blob(1, 4096), timeout=STEP)
    await receiver.get(old)
    await receiver.release(old)
    new = await sender.put(_key(1), _blob(2, 4096), timeout=STEP)
    assert (new.slot, new.offset) == (old.slot, old.offset), "the freed extent was not reused"
    assert new.generation > old.generation
    with pytest.raises(TransportError, match="stale descriptor"):
        await _within(receiver.get(old))
    got = await receiver.get(new)
    assert bytes(got.buffers[0]) == _blob(2, 4096).buffers[0]
    del got
    await receiver.release(new)


async def test_forged_descriptors_are_refused(ends: tuple[ShmSender, ShmReceiver]) -> None:
    """Descriptors with a bad slot, range, generation, segment, name or host raise
    TransportError at once, and leave the real extent readable."""
    sender, receiver = ends
    desc = await sender.put(_key(), _blob(3, 10_000), timeout=STEP)
    replace = msgspec.structs.replace
    forged = {
        "out of range": replace(desc, slot=10**6),
        "not an extent": replace(desc, offset=4 * MiB - 64),
        "do not match": replace(desc, offset=desc.offset + 64 * 1024),
        "are not an extent": replace(desc, buffer_sizes=(2**40,)),
        "generation": replace(desc, generation=desc.generation + 1),
        "does not exist": replace(desc, segment=f"{PREFIX}{os.getpid()}-{'0' * 16}"),
        "names host 'elsewhere'": replace(desc, host="elsewhere"),
    }
    for fragment, bad in forged.items():
        with pytest.raises(TransportError, match=fragment):
            await _within(receiver.get(bad), 5.0)
    wire = msgspec.msgpack.encode(desc)
    fields = msgspec.msgpack.decode(wire)
    for index, value in [(2, "../../etc/passwd"), (2, "stagewire-shm-1-x"), (3, -1), (4, 0)]:
        raw = msgspec.msgpack.encode([*fields[:index], value, *fields[index + 1 :]])
        with pytest.raises(TransportError, match="bad shm descriptor"):
            receiver.decode_descriptor(raw)
    got = await receiver.get(receiver.decode_descriptor(wire))
    assert bytes(got.buffers[0]) == _blob(3, 10_000).buffers[0]
    assert receiver.statistics().errors == len(forged) + 4
    del got
    await receiver.release(desc)


async def test_zero_copy_tensor_pins_its_extent(ends: tuple[ShmSender, ShmReceiver]) -> None:
    """A tensor decoded in place keeps its extent from reuse after release, until the tensor
    (and every view of it) is collected."""
    sender, receiver = ends
    codec = codec_for(_Frame)
    want = torch.arange(MiB // 8, dtype=torch.int64)
    desc = await sender.put(_key(), codec.encode(_Frame(want.clone())), timeout=STEP)
    got = await receiver.get(desc)
    assert all(not memoryview(b).readonly for b in got.buffers)
    tensor = codec.decode(got).tensor
    # The tensor is the shared memory itself, not a copy of it.
    assert tensor.data_ptr() == np.frombuffer(got.buffers[0], np.uint8).ctypes.data
    del got
    await receiver.release(desc)
    for r in range(40):  # 10 MiB through a 4 MiB arena, with the tensor's extent held.
        churn = await sender.put(_key(r + 1), _blob(r, 256 * 1024), timeout=1.0)
        await receiver.release(churn)
    assert (receiver.pinned(), sender.occupancy().extents) == (1, 1)
    assert torch.equal(tensor, want), "the producer reused a pinned extent"
    part = tensor[10:20]  # A view alone keeps the extent pinned too.
    del tensor
    gc.collect()
    assert (receiver.pinned(), sender.occupancy().extents) == (1, 1)
    assert part.tolist() == list(range(10, 20))
    del part
    gc.collect()
    assert (receiver.pinned(), sender.occupancy().extents) == (0, 0)
    with pytest.raises(TransportError, match="stale"):
        await receiver.get(desc)


async def test_copy_mode_frees_the_extent_on_release() -> None:
    """In copy mode, get copies the payload out and release frees the extent at once."""
    async with _ends(copy=True) as (sender, receiver):
        codec = codec_for(_Frame)
        want = torch.arange(MiB // 8, dtype=torch.int64)
        desc = await sender.put(_key(), codec.encode(_Frame(want.clone())), timeout=STEP)
        got = await receiver.get(desc)
        assert all(isinstance(memoryview(b).obj, bytearray) for b in got.buffers)
        tensor = codec.decode(got).tensor
        del got
        await receiver.release(desc)
        assert (receiver.pinned(), sender.occupancy().extents) == (0, 0)
        for r in range(40):
            churn = await sender.put(_key(r + 1), _blob(r, 1024 * 1024), timeout=1.0)
            await receiver.release(churn)
        assert torch.equal(tensor, want)


async def test_release_without_get_frees_the_extent(ends: tuple[ShmSender, ShmReceiver]) -> None:
    """Releasing a descriptor that was never got (a duplicate or aborted chunk) frees it."""
    sender, receiver = ends
    desc = await sender.put(_key(), _blob(1, MiB), timeout=STEP)
    assert sender.occupancy().extents == 1
    await receiver.release(desc)
    await receiver.release(desc)
    assert (sender.occupancy().extents, receiver.pinned()) == (0, 0)
    with pytest.raises(TransportError, match="stale"):
        await receiver.get(desc)


async def test_release_racing_the_first_get_keeps_the_extent_while_read() -> None:
    """A release that starts while the first get of a segment not yet mapped is under way
    (a duplicate's release during the original's fetch) must not free the extent under the
    get's live view: the next put lands elsewhere. It used to write RELEASED directly."""
    async with _ends(capacity=8192) as (sender, receiver):
        d = await sender.put(ChunkKey("r", EDGE, 0), Encoded(b"h", (b"A" * 4000,)), timeout=STEP)
        got, _ = await asyncio.gather(receiver.get(d), receiver.release(d))
        live = np.frombuffer(got.buffers[0], np.uint8)
        assert receiver.pinned() == 1  # released, but pinned by the live view
        await sender.put(ChunkKey("r", EDGE, 1), Encoded(b"h", (b"B" * 4000,)), timeout=STEP)
        assert bytes(live[:4]) == b"AAAA"
        del got, live


async def test_exhaustion_fails_at_the_deadline(ends: tuple[ShmSender, ShmReceiver]) -> None:
    """A put into a full arena raises TransportFull at its deadline, naming the edge, the
    size, the capacity and what is held; it succeeds again after a release."""
    sender, receiver = ends
    held = [await sender.put(_key(i), _blob(i, MiB), timeout=STEP) for i in range(3)]
    start = time.monotonic()
    with pytest.raises(TransportFull) as info:
        await _within(sender.put(_key(3), _blob(3, MiB), timeout=0.3))
    elapsed = time.monotonic() - start
    assert 0.3 <= elapsed <= 0.8, f"gave up after {elapsed:.3f}s for a 0.3s deadline"
    message = str(info.value)
    for fragment in ("'a->b'", "1 MiB (1048640 bytes)", "4 MiB (4194304 bytes)", "3 unreleased"):
        assert fragment in message, f"{fragment!r} missing from: {message}"
    await receiver.release(held.pop())
    desc = await sender.put(_key(4), _blob(4, MiB), timeout=0.3)
    for d in [*held, desc]:
        await receiver.release(d)


async def test_queued_tally_follows_reading_and_releases(
    ends: tuple[ShmSender, ShmReceiver],
) -> None:
    """Extents counted as held for queued requests leave the count when their request is
    being read, or once released; a full arena's error says how much they hold."""
    sender, receiver = ends
    a = [await sender.put(_key(i), _blob(i, MiB), timeout=STEP) for i in range(2)]
    b = await sender.put(_key(2), _blob(2, MiB), timeout=STEP)
    for d in a:
        sender.hold_queued(d, "a")
    sender.hold_queued(b, "b")
    extent = sender.queued_bytes() // 3
    assert extent > MiB
    with pytest.raises(TransportFull, match="held for 2 requests whose consumer has not begun"):
        await _within(sender.put(_key(3), _blob(3, MiB), timeout=0.05))
    assert (sender.now_reading("a"), sender.now_reading("a")) == (True, False)
    assert sender.queued_bytes() == extent
    await receiver.release(b)
    assert sender.queued_bytes() == 0
    for d in a:
        await receiver.release(d)


async def test_put_without_deadline_wakes_on_close() -> None:
    """A put waiting with no deadline fails with TransportError as soon as the sender closes."""
    async with _ends() as (sender, receiver):
        held = [await sender.put(_key(i), _blob(i, MiB), timeout=STEP) for i in range(3)]
        blocked = asyncio.ensure_future(sender.put(_key(3), _blob(3, MiB), timeout=None))
        for _ in range(20):
            await asyncio.sleep(0)  # A scheduling point, so the put starts waiting.
        assert not blocked.done()
        await sender.aclose()
        with pytest.raises(TransportError, match="closed while waiting"):
            await _within(blocked, 1.0)
        for d in held:
            await receiver.release(d)


async def test_oversize_payload_fails_at_once(ends: tuple[ShmSender, ShmReceiver]) -> None:
    """A payload larger than the whole arena fails without waiting, as TransportFull (so an
    auto edge can send it another way), and creates no segment."""
    sender, _ = ends
    start = time.monotonic()
    with pytest.raises(TransportFull, match="exceeds the capacity"):
        await _within(sender.put(_key(), _blob(1, 5 * MiB), timeout=60), 5.0)
    assert time.monotonic() - start < 1.0
    assert sender.segment_name is None


async def test_a_payload_of_more_buffers_than_a_descriptor_lists_is_full_at_once(
    ends: tuple[ShmSender, ShmReceiver],
) -> None:
    """More tensors than a descriptor may list: every receiver refused its descriptor as
    garbage, failing the request at the consumer. Refused at put, as TransportFull, an auto
    edge sends it inline instead."""
    sender, _ = ends
    with pytest.raises(TransportFull, match="at most 65536: stack them"):
        await _within(sender.put(_key(), Encoded(b"h", (b"",) * (2**16 + 1)), timeout=60), 5.0)
    desc = await _within(sender.put(_key(), Encoded(b"h", (b"",) * 2**16), timeout=60), 5.0)
    assert len(DESCRIPTOR_DECODER.decode(msgspec.msgpack.encode(desc)).buffer_sizes) == 2**16


async def test_free_space_is_checked_before_creating() -> None:
    """Asking for more than /dev/shm has free is a TransportError naming both sizes and what
    to do, and leaves no segment behind."""
    before = set(list_segments())
    capacity = free_space() + 2**30
    async with _ends(capacity=capacity) as (sender, _):
        with pytest.raises(TransportFull) as info:
            await _within(sender.put(_key(), _blob(1, 10), timeout=1.0))
        assert sender.segment_name is None
    message = str(info.value)
    assert f"capacity {capacity / 2**30:.4g} GiB ({capacity} bytes)" in message, message
    assert "is free" in message
    assert "lower the transport's `capacity` option or enlarge /dev/shm" in message
    assert set(list_segments()) <= before


async def test_closed_or_removed_segment_is_refused(spawned: list[int]) -> None:
    """Descriptors of a segment its producer closed, or that was removed, are TransportErrors.
    A removed one (its producer killed, the segment swept) is ProducerLost, which the
    consumer's channel reports as the producer's stage being unavailable, as for network;
    it was a plain TransportError, which tells a dead producer from nothing."""
    async with _ends() as (sender, receiver):
        first = await sender.put(_key(), _blob(1, 100), timeout=STEP)
        second = await sender.put(_key(1), _blob(2, 100), timeout=STEP)
        await receiver.get(first)
        await receiver.release(first)
        await sender.aclose()
        with pytest.raises(TransportError, match="closed by its producer"):
            await receiver.get(second)
        assert receiver.pinned() == 0
    async with _ends() as (sender, receiver):
        desc = await sender.put(_key(), _blob(1, 100), timeout=STEP)
        assert remove_segments_of([os.getpid()], held_too=True) == [sender.segment_name]
        with pytest.raises(ProducerLost, match="does not exist"):
            await receiver.get(desc)


async def test_receiver_close_keeps_live_views_valid() -> None:
    """Closing (and dropping) a receiver whose views are still alive works; the views stay
    valid, and their extents are freed when they die, released or not."""
    transport = ShmTransport(capacity="4MiB")
    edge = EdgeContext(EDGE, host_identity())
    async with transport.open_sender(edge) as sender:
        receiver = transport.open_receiver(edge)
        descs = [await sender.put(_key(i), _blob(i, MiB), timeout=STEP) for i in range(2)]
        views = [(await receiver.get(d)).buffers[0] for d in descs]
        await receiver.release(descs[0])
        await receiver.aclose()
        await receiver.aclose()
        with pytest.raises(TransportError, match="closed"):
            await receiver.get(descs[0])
        del receiver
        gc.collect()
        assert [bytes(v) for v in views] == [_blob(i, MiB).buffers[0] for i in range(2)]
        assert sender.occupancy().extents == 2
        del views
        gc.collect()
        assert sender.occupancy().extents == 0


async def test_unclosed_sender_warns_and_removes_its_segment() -> None:
    """A sender dropped without aclose warns with a ResourceWarning and unlinks its segment."""
    sender = ShmTransport(capacity="1MiB").open_sender(EdgeContext(EDGE, host_identity()))
    await sender.put(_key(), _blob(1, 10), timeout=STEP)
    name = sender.segment_name
    with pytest.warns(ResourceWarning, match="never closed"):
        del sender
    assert name not in list_segments()


async def test_unclosed_receiver_warns_and_gives_back_its_extents() -> None:
    """A receiver dropped without aclose warns with a ResourceWarning and gives back what it
    got but never released."""
    transport = ShmTransport(capacity="1MiB")
    edge = EdgeContext(EDGE, host_identity())
    async with transport.open_sender(edge) as sender:
        receiver = transport.open_receiver(edge)
        desc = await sender.put(_key(), _blob(1, 1000), timeout=STEP)
        assert len((await receiver.get(desc)).buffers[0]) == 1000
        assert sender.occupancy().extents == 1
        with pytest.warns(ResourceWarning, match="never closed"):
            del receiver
        assert sender.occupancy().extents == 0


async def test_statistics(ends: tuple[ShmSender, ShmReceiver]) -> None:
    """Both ends count chunks, bytes, errors and latency under the name shm."""
    sender, receiver = ends
    for i in range(3):
        desc = await sender.put(_key(i), _blob(i, 1000), timeout=STEP)
        await receiver.get(desc)
        await receiver.release(desc)
    with pytest.raises(TransportError):
        await receiver.get(desc)
    out, inn = sender.statistics(), receiver.statistics()
    assert (out.transport, out.chunks, out.bytes, out.fallbacks) == ("shm", 3, 3 * 1006, 0)
    assert (inn.chunks, inn.bytes, inn.errors) == (3, 3 * 1006, 1)
    assert out.by_transport == inn.by_transport == {"shm": 3}
    assert 0 < out.latency_p50_us <= out.latency_p99_us


async def test_cross_process_round_trip(spawned: list[int]) -> None:
    """Payloads put by a producer process are read intact here, and the producer's segment
    is gone once it closes."""
    async with _ends() as (_, receiver), _child(spawned, PRODUCER, "5") as producer:
        descs = [receiver.decode_descriptor(bytes.fromhex(await producer.line())) for _ in range(5)]
        assert await producer.line() == "ready"
        theirs = {n for n in list_segments() if _pid_of(n) == producer.pid}
        assert {d.segment for d in descs} == theirs
        for i in reversed(range(5)):  # Out of order, as a reorder buffer may.
            desc = descs[i]
            got = await receiver.get(desc)
            assert got.header == b"header %d" % i
            assert [bytes(b) for b in got.buffers] == [bytes([i]) * (1000 * (i + 1)), b"tail"]
            del got
            await receiver.release(desc)
        assert await producer.finish() == 0
        assert not [n for n in list_segments() if _pid_of(n) == producer.pid]


async def test_sweep_removes_only_dead_owners(spawned: list[int]) -> None:
    """sweep_dead_owners unlinks the segment of a producer killed with SIGKILL, keeps a live
    one's, ignores foreign names; remove_segments_of removes a given pid's segments."""
    async with (
        _ends() as (local, _),
        _child(spawned, PRODUCER, "1") as alive,
        _child(spawned, PRODUCER, "1") as dead,
    ):
        await local.put(_key(), _blob(1, 10), timeout=STEP)  # A live segment of this process.
        segments = {}
        for child in (alive, dead):
            desc = msgspec.msgpack.decode(bytes.fromhex(await child.line()), type=ShmDescriptor)
            segments[child.pid] = desc.segment
            assert await child.line() == "ready"
        await dead.kill()
        assert segments[dead.pid] in list_segments(), "SIGKILL ran no cleanup: it must be swept"
        # Foreign names and an unfinished segment of a live process are left alone; an
        # unfinished segment of a dead pid is not.
        decoys = [f"{PREFIX}decoy-{'0' * 16}", f"{PREFIX}{os.getpid()}-{'1' * 16}x"]
        young_alive = f"{PREFIX}{os.getpid()}-{'2' * 16}"
        unfinished_dead = f"{PREFIX}{dead.pid}-{'3' * 16}"
        _touch([*decoys, young_alive, unfinished_dead])
        try:
            removed = sweep_dead_owners()
            assert segments[dead.pid] in removed
            assert unfinished_dead in removed
            kept = {segments[alive.pid], local.segment_name, young_alive, *decoys}
            assert not kept & set(removed)
            assert set(os.listdir(SHM_DIR)) >= {*decoys, young_alive}
        finally:
            _remove([*decoys, young_alive, unfinished_dead])
        assert remove_segments_of([alive.pid]) == []  # held by its live owner
        assert remove_segments_of([alive.pid], held_too=True) == [segments[alive.pid]]
        assert segments[alive.pid] not in list_segments()
        assert await alive.finish() == 0, "closing a sender whose segment was removed failed"


async def test_a_worker_started_by_hand_sweeps_dead_owners_at_once(spawned: list[int]) -> None:
    """A ``stagewire worker`` started by hand (no launcher on its host sweeps) removes the
    segment of a producer killed with SIGKILL as it starts, before it even reaches a master
    (here there is none: it exits 4), not at its first segment, which a worker that only
    reads never makes."""
    async with _child(spawned, PRODUCER, "1") as dead:
        desc = msgspec.msgpack.decode(bytes.fromhex(await dead.line()), type=ShmDescriptor)
        assert await dead.line() == "ready"
        await dead.kill()
    assert desc.segment in list_segments()
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pipeline", "worker", "--master", "tcp://127.0.0.1:9",
        "--stage", "consumer", "--connect-timeout", "1", cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    spawned.append(worker.pid)
    assert await _within(worker.wait()) == 4
    assert desc.segment not in list_segments()


async def test_dead_reader_does_not_pin_space(spawned: list[int]) -> None:
    """An extent held by a consumer killed with SIGKILL is reclaimed by a put waiting for room."""
    async with _ends() as (sender, _), _child(spawned, CONSUMER) as consumer:
        desc = await sender.put(_key(), _blob(1, 3 * MiB), timeout=STEP)
        await consumer.send(msgspec.msgpack.encode(desc).hex())
        assert await consumer.line() == str(3 * MiB)
        with pytest.raises(TransportFull):
            await sender.put(_key(1), _blob(2, 3 * MiB), timeout=0.2)
        await consumer.kill()
        start = time.monotonic()
        await _within(sender.put(_key(2), _blob(3, 3 * MiB), timeout=STEP))
        assert time.monotonic() - start < 1.0
        assert sender.occupancy().extents == 1


async def test_releasing_a_forged_descriptor_leaves_the_genuine_extent_held(
    ends: tuple[ShmSender, ShmReceiver],
) -> None:
    """A descriptor of a live slot and generation but another offset or size is refused by
    get, and its release gives nothing back: the genuine reader still reads its extent.
    (The release matched slot and generation only, and gave the extent back.)"""
    sender, receiver = ends
    genuine = await sender.put(_key(), _blob(1, 1000), timeout=STEP)
    forgeries = [
        msgspec.structs.replace(genuine, offset=genuine.offset + ALIGN),
        msgspec.structs.replace(genuine, buffer_sizes=(8,)),
    ]
    for forged in forgeries:
        with pytest.raises(TransportError, match="forged"):
            await receiver.get(forged)
        await receiver.release(forged)
    got = await receiver.get(genuine)
    assert bytes(got.buffers[0]) == bytes(_blob(1, 1000).buffers[0])
    del got
    await receiver.release(genuine)


async def test_an_extent_taken_back_from_a_dead_reader_refuses_its_old_descriptor(
    ends: tuple[ShmSender, ShmReceiver],
) -> None:
    """Extents sent to a process that died are taken back; their descriptors are stale
    from then on. (The slot kept its generation, so an old descriptor was accepted and read
    whatever payload came to lie at its offset since.)"""
    sender, receiver = ends
    gone = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await gone.wait()
    old = [await sender.put(_key(i), _blob(i, 1000), timeout=STEP) for i in range(2)]
    for desc in old:
        sender.note_reader(desc, "consumer", gone.pid)
    sender.readers_gone({"consumer"})
    new = await sender.put(_key(2), _blob(2, 1000), timeout=STEP)
    assert new.offset == old[0].offset  # the bytes the first old descriptor named
    for desc in old:
        with pytest.raises(TransportError, match="stale"):
            await receiver.get(desc)
    got = await receiver.get(new)
    assert bytes(got.buffers[0]) == bytes(_blob(2, 1000).buffers[0])
    del got
    await receiver.release(new)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 10**6)), max_size=80))
def test_arena_allocates_without_overlap_and_coalesces(
    ops: list[tuple[bool, int, int]],
) -> None:
    """Any sequence of allocations and frees in any order keeps extents disjoint, accounts
    every byte, coalesces free runs, and returns to one run once everything is freed."""
    capacity = 64 * ALIGN
    arena = Arena(capacity)
    held: dict[int, int] = {}
    for allocate, units, pick in ops:
        if allocate or not held:
            size = units * ALIGN
            offset = arena.allocate(size)
            if offset is None:
                assert arena.largest_free() < size
                continue
            assert offset % ALIGN == 0
            assert all(offset + size <= o or o + s <= offset for o, s in held.items())
            held[offset] = size
        else:
            offset = sorted(held)[pick % len(held)]
            arena.free(offset, held.pop(offset))
        runs = arena.runs()
        assert arena.free_bytes == capacity - sum(held.values()) == sum(s for _, s in runs)
        assert all(a + s < b for (a, s), (b, _) in itertools.pairwise(runs))
    for offset, size in list(held.items()):
        arena.free(offset, size)
    assert arena.runs() == [(0, capacity)]
    with pytest.raises(ValueError, match="freed twice"):
        arena.free(0, ALIGN)


async def test_device_buffers_are_staged_through_the_host(
    ends: tuple[ShmSender, ShmReceiver],
) -> None:
    """A payload whose buffers are still marked as on a device arrives with their bytes."""
    sender, receiver = ends
    flat = torch.arange(200, dtype=torch.uint8)
    encoded = Encoded(b"h", (b"", b"host"), device_buffers={0: flat})
    desc = await sender.put(_key(), encoded, timeout=STEP)
    got = await receiver.get(desc)
    assert [bytes(b) for b in got.buffers] == [bytes(range(200)), b"host"]
    del got
    await receiver.release(desc)


_CLOSED_AT_SHUTDOWN = """
import asyncio, os, sys
from pipeline._encoded import Encoded
from pipeline._host import host_identity
from pipeline._keys import ChunkKey
from transports import EdgeContext
from transports.shm import ShmTransport, list_segments

async def produce(sender):
    try:
        await sender.put(ChunkKey("r", "a->b", 0), Encoded(b"h", (b"x",)), timeout=30)
    finally:
        await sender.aclose()

async def main():
    sender = ShmTransport(capacity="512MiB").open_sender(EdgeContext("a->b", host_identity()))
    asyncio.ensure_future(produce(sender))
    # Return as soon as the segment is being made (reserving and pre-faulting 512 MiB
    # takes a while): the loop's shutdown then cancels the producer and the creation.
    while sender._creating is None:
        await asyncio.sleep(0)

asyncio.run(main())
print("LEFT", *[n for n in list_segments() if f"-{os.getpid()}-" in n])
"""


def test_a_segment_made_while_the_loop_shuts_down_is_removed_at_once() -> None:
    """A put whose segment is still being made when ``asyncio.run`` cancels every task,
    and whose sender closes in that cancellation, leaves no segment behind, not even until
    the process exits."""
    if free_space() < 2**30:
        pytest.skip("needs 1 GiB free in /dev/shm")
    done = subprocess.run(
        [sys.executable, "-c", _CLOSED_AT_SHUTDOWN],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["LEFT"], done.stdout


def _namespaced_producer(pid: int) -> subprocess.Popen[str] | None:
    """The PRODUCER script in a new user and pid namespace, started as that namespace's
    ``pid`` (another deployment sharing /dev/shm, as a container on the host's IPC
    namespace); None where namespaces cannot be made here."""
    # Not exec'd, and not the shell's last command (which a shell may exec): the shell is
    # the namespace's pid 1, and the producer the next pid after ``ns_last_pid``.
    inner = f'echo {pid - 1} > /proc/sys/kernel/ns_last_pid && "$0" -c "$1" 1; exit $?'
    try:
        return subprocess.Popen(
            ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc",
             "sh", "-c", inner, sys.executable, PRODUCER],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, cwd=ROOT,
        )  # fmt: skip
    except OSError:
        return None


def test_removing_an_exited_pids_segments_spares_a_live_one_of_another_namespace() -> None:
    """A launcher removing the segments of its worker of pid P, which exited, leaves alone
    the live segment of a process that has pid P in another pid namespace: its owner's
    lock keeps it. (It used to judge by the pid in the name alone.)"""
    with subprocess.Popen([sys.executable, "-c", "pass"]) as exited:
        exited.wait()
    other = _namespaced_producer(exited.pid)
    if other is None:
        pytest.skip("cannot start a process in new user and pid namespaces here")
    assert other.stdout is not None and other.stdin is not None
    try:
        desc_line = other.stdout.readline()
        if not desc_line or other.stdout.readline().strip() != "ready":
            pytest.skip("user or pid namespaces are not available here")
        desc = msgspec.msgpack.decode(bytes.fromhex(desc_line), type=ShmDescriptor)
        if _pid_of(desc.segment) != exited.pid:
            pytest.skip("the new namespace could not be given the pid wanted")
        assert remove_segments_of([exited.pid]) == []
        assert desc.segment in list_segments()
    finally:
        other.stdin.close()
        other.wait(10)
        other.stdout.close()
    assert desc.segment not in list_segments()  # its owner removed it as it closed
