"""Tests for the cuda_ipc transport.

The conformance suite and the host-path tests run everywhere: payloads with nothing on a
GPU travel the host path, with the same release table, capacity and staleness rules as
device payloads. Tests that move CUDA tensors carry the ``gpu`` marker and skip cleanly
without a CUDA device. Cross-process tests drive a consumer in a process of its own
(:mod:`tests.transports.cuda_ipc_peer`).

The micro-benchmark is ``python -m tests.transports.cuda_ipc_peer bench`` on a GPU machine
(hop latency per size, 1 MiB to 1 GiB; the target is flat in size, 1 GiB at most 200 µs);
``test_hop_latency_is_flat_in_size`` runs a short version of it.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import pytest_asyncio
import torch

import transports._cuda_release_table as release_table
from pipeline import ConfigError, Pipeline, PipelineSpec, StageUnavailable, TransportError
from pipeline._codec import codec_for
from pipeline._encoded import Encoded
from pipeline._errors import TransportFull
from pipeline._host import host_identity
from pipeline._keys import ChunkKey
from pipeline.testing import TransportConformance, TransportRecipe
from stages.text import Text
from tests.pipeline.conftest import wait_for
from tests.transports.cuda_ipc_peer import ROOT, Peer, Tensors, descriptor_line, fingerprint
from transports import EdgeContext, Transport, create_transport
from transports._cuda_dlpack import live_wrappers, wrap_memory
from transports._cuda_files import cuda_files_of
from transports._cuda_handles import EXPORTS, check_start_method, require_cuda
from transports._cuda_release_table import ReleaseTable, SlotState, sweep_dead_tables
from transports.cuda_ipc import (
    CudaIpcReceiver,
    CudaIpcSender,
    CudaIpcTransport,
    DeviceRef,
    DeviceSpan,
)

CUDA = torch.cuda.is_available()
EDGE = "a->b"
MiB = 2**20


def _key(seq: int, request: str = "r") -> ChunkKey:
    return ChunkKey(request, EDGE, seq)


def _my_tables() -> list[str]:
    """The release tables this process owns now."""
    prefix = f"stagewire-cudaipc-{os.getpid()}-"
    return sorted(p.name for p in release_table._DIR.iterdir() if p.name.startswith(prefix))


@pytest.fixture
def edge() -> EdgeContext:
    """The edge both ends are opened for, on this host."""
    return EdgeContext(EDGE, host_identity())


@pytest_asyncio.fixture
async def ends(edge: EdgeContext) -> AsyncIterator[tuple[CudaIpcSender, CudaIpcReceiver]]:
    """A sender with 4 MiB of capacity and a receiver, closed afterwards."""
    transport = CudaIpcTransport(capacity=4 * MiB)
    async with transport.open_sender(edge) as sender, transport.open_receiver(edge) as receiver:
        yield sender, receiver


class TestCudaIpc(TransportConformance):
    """The cuda_ipc transport passes the conformance suite (its payloads take the host path)."""

    @pytest.fixture
    def transport(self) -> Transport:
        """The transport by name, as the runtime makes it, with room for a few MiB."""
        return CudaIpcTransport(capacity=4 * MiB)

    @pytest.fixture
    def transport_recipe(self) -> TransportRecipe:
        """The same transport by name, for the producer the suite spawns."""
        return TransportRecipe("cuda_ipc", {"capacity": 4 * MiB})


# ---- the host path and the guards, on any machine ----------------------------------------


async def test_cpu_payload_round_trips_via_the_host_path(
    ends: tuple[CudaIpcSender, CudaIpcReceiver],
) -> None:
    """A payload of CPU tensors carries no device spans, arrives intact, and is counted as
    a host-path chunk on both ends."""
    sender, receiver = ends
    payload = Tensors([torch.arange(10, dtype=torch.float32), torch.ones(3, 4).t()])
    encoded = codec_for(Tensors).encode(payload)
    descriptor = await sender.put(_key(0), encoded, timeout=5)
    assert descriptor.spans == () and descriptor.devices == ()
    got = codec_for(Tensors).decode(await receiver.get(descriptor))
    await receiver.release(descriptor)
    for want, tensor in zip(payload.tensors, got.tensors, strict=True):
        assert torch.equal(want, tensor)
    # Small enough to travel in the descriptor: no shm extent written for it.
    assert descriptor.host_inline is not None and descriptor.host_part == b""
    assert sender.statistics().by_transport == {"cuda_ipc": 0, "inline": 1}
    assert receiver.statistics().by_transport == {"cuda_ipc": 0, "inline": 1}
    assert sender.held == (0, 0)


@pytest.mark.parametrize("inline_host", [0, 1000, "8KiB"])
async def test_host_parts_over_the_inline_limit_go_through_shm(
    edge: EdgeContext, inline_host: int | str
) -> None:
    """A host part of at most ``inline_host`` bytes travels in the descriptor, a larger
    one through shm (every one with 0); both arrive intact and are released."""
    transport = CudaIpcTransport(capacity=4 * MiB, inline_host=inline_host)
    limit = transport.inline_host
    codec = codec_for(Tensors)
    async with transport.open_sender(edge) as sender, transport.open_receiver(edge) as receiver:
        for i, n in enumerate((4, 200, 2000, 100_000)):
            payload = Tensors([torch.arange(n, dtype=torch.float64)])
            encoded = codec.encode(payload)
            raw = msgspec.msgpack.encode(await sender.put(_key(i), encoded, timeout=5))
            descriptor = receiver.decode_descriptor(raw)
            inline = encoded.nbytes <= limit
            assert (descriptor.host_inline is not None) is inline, (n, limit)
            assert (descriptor.host_part == b"") is inline
            got = codec.decode(await receiver.get(descriptor))
            assert torch.equal(got.tensors[0], payload.tensors[0])
            await receiver.release(descriptor)
        stats = sender.statistics()
        host = sender._host_name
        inlined = {0: 0, 1000: 1, 8192: 2}[limit]
        want = {"cuda_ipc": 0, "inline": inlined, host: 4 - inlined}
        assert stats.by_transport == {k: v for k, v in want.items() if v or k == "cuda_ipc"}
        assert receiver.statistics().by_transport == stats.by_transport
        assert sender.held == (0, 0)


async def test_release_frees_capacity_without_a_message(
    ends: tuple[CudaIpcSender, CudaIpcReceiver],
) -> None:
    """The producer learns of a release from the table alone: held bytes drop to zero."""
    sender, receiver = ends
    descriptors = [
        await sender.put(_key(i), Encoded(b"h", (bytes(MiB),)), timeout=5) for i in range(3)
    ]
    assert sender.held[0] == 3
    for descriptor in descriptors:
        await receiver.get(descriptor)
        await receiver.release(descriptor)
    assert sender.held == (0, 0)


async def test_oversized_payload_fails_at_once(ends: tuple[CudaIpcSender, CudaIpcReceiver]) -> None:
    """A payload larger than the whole capacity is TransportFull without waiting."""
    sender, _ = ends
    with pytest.raises(TransportFull, match="exceed the capacity"):
        await asyncio.wait_for(sender.put(_key(0), Encoded(bytes(5 * MiB)), timeout=60), 5)


async def test_receiver_close_releases_what_it_got(edge: EdgeContext) -> None:
    """Payloads got but never released are given back when the receiver closes."""
    transport = CudaIpcTransport(capacity=4 * MiB)
    async with transport.open_sender(edge) as sender:
        receiver = transport.open_receiver(edge)
        descriptor = await sender.put(_key(0), Encoded(b"x", (bytes(1000),)), timeout=5)
        await receiver.get(descriptor)
        assert sender.held[0] == 1
        await receiver.aclose()
        assert sender.held == (0, 0)


async def test_sender_close_removes_its_table(edge: EdgeContext) -> None:
    """The release table exists from the first put and is gone once the sender closes,
    unreleased host payloads or not."""
    before = _my_tables()
    sender = CudaIpcTransport(capacity=MiB).open_sender(edge)
    assert _my_tables() == before, "an unused sender must not create a table"
    await sender.put(_key(0), Encoded(b"x"), timeout=5)
    assert len(_my_tables()) == len(before) + 1
    await sender.aclose()
    assert _my_tables() == before


async def test_dead_reader_is_reclaimed(edge: EdgeContext) -> None:
    """A put waiting for room reclaims the payload of a consumer process that read it and
    died without releasing."""
    transport = CudaIpcTransport(capacity=MiB)
    peer = Peer("die")
    try:
        async with transport.open_sender(edge) as sender:
            payload = Tensors([torch.zeros(MiB // 2, dtype=torch.uint8)])
            descriptor = await sender.put(_key(0), codec_for(Tensors).encode(payload), timeout=5)
            reply = await asyncio.to_thread(peer.send, descriptor_line(descriptor))
            assert reply["tensors"][0]["shape"] == [MiB // 2]
            assert await asyncio.to_thread(peer.close) == 0
            second = codec_for(Tensors).encode(payload)
            await sender.put(_key(1), second, timeout=5)
            assert sender.reclaimed == 1
    finally:
        peer.close()


def _exited_pid() -> int:
    """The pid of a process that has come and gone."""
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(child.stdout)


async def test_payload_sent_to_a_consumer_dead_before_reading_is_let_go(
    edge: EdgeContext,
) -> None:
    """A payload whose consumer died before opening it is let go, with its host part,
    once consumers are declared gone; one sent to a live process is kept."""
    transport = CudaIpcTransport(capacity=MiB)
    async with transport.open_sender(edge) as sender:
        # Over the inline limit, so each host part takes an shm extent.
        to_dead = await sender.put(_key(0), Encoded(b"h", (bytes(20_000),)), timeout=5)
        to_live = await sender.put(_key(1), Encoded(b"h", (bytes(20_000),)), timeout=5)
        sender.note_reader(to_dead, "tcp://127.0.0.1:1", _exited_pid())
        sender.note_reader(to_live, "tcp://127.0.0.1:2", os.getpid())
        assert sender.held[0] == 2
        sender.readers_gone({"tcp://127.0.0.1:1"})
        assert sender.held[0] == 1 and sender.reclaimed == 1
        host = sender._host.statistics()
        assert host.held == 1, host  # the host part of the dead one's payload went too


@pytest.mark.skipif(CUDA, reason="checks the message of a process without CUDA")
async def test_device_put_without_cuda_is_a_clear_error(
    ends: tuple[CudaIpcSender, CudaIpcReceiver],
) -> None:
    """A put of a payload with device buffers, where CUDA is missing, says so."""
    sender, _ = ends
    fake = Encoded(b"h", (b"",), device_buffers={0: torch.zeros(8, dtype=torch.uint8)})
    with pytest.raises(TransportError, match="CUDA is not available"):
        await sender.put(_key(0), fake, timeout=5)
    assert sender.held == (0, 0)
    assert sender.statistics().errors == 1


@pytest.mark.skipif(CUDA, reason="checks the message of a process without CUDA")
async def test_device_get_without_cuda_is_a_clear_error(
    ends: tuple[CudaIpcSender, CudaIpcReceiver],
) -> None:
    """A descriptor with device spans, got where CUDA is missing, is a TransportError saying
    so, and releasing it afterwards still frees the payload."""
    sender, receiver = ends
    descriptor = await sender.put(_key(0), Encoded(b"h", (b"",)), timeout=5)
    device = DeviceRef("GPU-00000000-0000-0000-0000-000000000000", 0, bytes(64))
    forged = msgspec.structs.replace(
        descriptor, devices=(device,), spans=(DeviceSpan(0, 0, bytes(66), 0, 8),)
    )
    with pytest.raises(TransportError, match="CUDA is not available"):
        await receiver.get(receiver.decode_descriptor(msgspec.msgpack.encode(forged)))
    await receiver.release(forged)
    assert sender.held == (0, 0)


@pytest.mark.skipif(CUDA, reason="checks the message of a process without CUDA")
def test_require_cuda_guard() -> None:
    """The guard every device operation passes names the operation and the missing CUDA."""
    with pytest.raises(TransportError, match=r"cuda_ipc put: CUDA is not available"):
        require_cuda("put")


def test_transport_constructs_without_cuda() -> None:
    """Building the transport and both ends needs no GPU, so configs validate anywhere,
    and touches no CUDA state."""
    transport = create_transport("transports.cuda_ipc:CudaIpcTransport", {"capacity": "64MiB"})
    assert isinstance(transport, CudaIpcTransport)
    assert transport.capacity == 64 * MiB
    assert transport.capabilities.device_buffers and transport.capabilities.host_local
    # In a fresh interpreter: in this one an earlier test may have initialised CUDA.
    code = textwrap.dedent(
        """
        import torch
        from pipeline._host import host_identity
        from transports import EdgeContext, create_transport
        transport = create_transport("cuda_ipc", {"capacity": "64MiB"})
        transport.open_sender(EdgeContext("a->b", host_identity()))
        transport.open_receiver(EdgeContext("a->b", host_identity()))
        print("INITIALISED", torch.cuda.is_initialized())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "INITIALISED False" in done.stdout.splitlines()


@pytest.mark.parametrize(
    "options",
    [
        {"capacity": "lots"},
        {"capacity": 0},
        {"slots": 0},
        {"slots": True},
        {"linger": -1},
        {"inline_host": -1},
        {"inline_host": "small"},
    ],
    ids=[
        "capacity-text",
        "capacity-zero",
        "slots-zero",
        "slots-bool",
        "linger",
        "inline-host-negative",
        "inline-host-text",
    ],
)
def test_bad_options_are_config_errors(options: dict[str, Any]) -> None:
    """Every bad option is a ConfigError naming the transport."""
    with pytest.raises(ConfigError, match="cuda_ipc"):
        create_transport("transports.cuda_ipc:CudaIpcTransport", options)


def test_fork_after_cuda_is_refused(monkeypatch: pytest.MonkeyPatch, edge: EdgeContext) -> None:
    """Opening an end in a child forked from a CUDA parent is a TransportError pointing at
    spawn; a parent with CUDA and the fork start method is not refused."""
    transport = CudaIpcTransport()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(multiprocessing, "get_start_method", lambda allow_none=False: "fork")
    transport.open_sender(edge)
    check_start_method()
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    for open_end in (transport.open_sender, transport.open_receiver):
        with pytest.raises(TransportError, match="spawn"):
            open_end(edge)


async def test_stale_and_foreign_tokens(ends: tuple[CudaIpcSender, CudaIpcReceiver]) -> None:
    """A token of a slot reused, a generation never issued, or a table that does not exist
    is refused."""
    sender, receiver = ends
    descriptor = await sender.put(_key(0), Encoded(b"x"), timeout=5)
    never = msgspec.structs.replace(descriptor, generation=descriptor.generation + 1000)
    nowhere = msgspec.structs.replace(descriptor, table="stagewire-cudaipc-1-0000000000000000")
    outside = msgspec.structs.replace(descriptor, slot=10**6)
    for bad in (never, nowhere, outside):
        with pytest.raises(TransportError):
            await receiver.get(bad)
        await receiver.release(bad)
    assert sender.held[0] == 1
    await receiver.release(descriptor)
    assert sender.held[0] == 0


@pytest.fixture
def host_memory_for_cuda(monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """Stand host memory in for the consumer's CUDA mapping, so the receiver's device path
    (pins, DLPack deleters, release) runs without a GPU; returns the "mapped segment"."""
    import transports._cuda_receiver as receiver_module

    segment = torch.arange(64, dtype=torch.uint8)

    class Anchor:
        storage = segment
        base = segment.data_ptr()

    class Opened:
        def open(self, handle: bytes, device: int) -> Anchor:
            return Anchor()

    class Events:
        def wait(self, handle: bytes, device: int) -> None:
            pass

    def wrap(pointer: int, nbytes: int, device: int | None, **kw: Any) -> Any:
        return wrap_memory(pointer, nbytes, None, **kw)

    monkeypatch.setattr(receiver_module, "require_cuda", lambda what: torch)
    monkeypatch.setattr(receiver_module, "local_device", lambda uuid: 0)
    monkeypatch.setattr(receiver_module, "OPENED", Opened())
    monkeypatch.setattr(receiver_module, "OPENED_EVENTS", Events())
    monkeypatch.setattr(receiver_module, "wrap_memory", wrap)
    return segment


@pytest.mark.parametrize("order", ["release first", "tensors die first"])
async def test_device_payload_is_done_after_release_and_tensor_death(
    host_memory_for_cuda: torch.Tensor, ends: tuple[CudaIpcSender, CudaIpcReceiver], order: str
) -> None:
    """(CUDA mapping stood in by host memory.) A device payload decodes in place over the
    mapped bytes, and goes back to the producer only once it is released *and* every tensor
    over it has died, in either order."""
    sender, receiver = ends
    want = torch.arange(8, 24, dtype=torch.uint8)
    encoded = codec_for(Tensors).encode(Tensors([want]))
    descriptor = await sender.put(_key(0), Encoded(encoded.header, (b"",)), timeout=5)
    device = DeviceRef("GPU-stand-in", 0, bytes(64))
    remote = msgspec.structs.replace(
        descriptor, pid=0, devices=(device,), spans=(DeviceSpan(0, 0, b"segment", 8, 16),)
    )
    got = await receiver.get(remote)
    value = codec_for(Tensors).decode(got)
    del got
    assert torch.equal(value.tensors[0], want)
    assert value.tensors[0].data_ptr() == host_memory_for_cuda.data_ptr() + 8
    assert receiver.statistics().by_transport["cuda_ipc"] == 1
    if order == "release first":
        await receiver.release(remote)
        assert sender.held[0] == 1, "released while a tensor still reads the bytes"
        with pytest.raises(TransportError, match="already released"):
            await receiver.get(remote)
        del value
    else:
        del value
        assert sender.held[0] == 1, "a payload not yet released was handed back"
        await receiver.release(remote)
    assert sender.held == (0, 0)


# ---- the release table and the DLPack wrapper, on any machine ----------------------------


def test_release_table_lifecycle() -> None:
    """A slot is live once issued, released only for its own generation, and stale after
    reuse; readers are recorded; a closed table is unlinked."""
    owner = ReleaseTable.create(4)
    try:
        reader = ReleaseTable.open(owner.name)
        assert reader.slots == 4 and not reader.owner
        assert reader.state(1, 1) is SlotState.STALE
        owner.issue(1, 7)
        assert reader.state(1, 7) is SlotState.LIVE
        assert not reader.release(1, 6), "another generation's release must not count"
        assert not owner.is_released(1, 7)
        reader.mark_reader(1, 7, 4242, 9)
        assert owner.reader(1) == (4242, 9)
        assert reader.release(1, 7)
        assert owner.is_released(1, 7) and reader.state(1, 7) is SlotState.RELEASED
        owner.issue(1, 8)
        assert reader.state(1, 7) is SlotState.STALE and owner.reader(1) == (0, 0)
        with pytest.raises(TransportError, match="outside"):
            reader.state(4, 1)
    finally:
        owner.close()
    with pytest.raises(TransportError, match="gone"):
        ReleaseTable.open(owner.name)
    # A reader's mapping outlives the name: a late release still lands harmlessly.
    assert reader.release(1, 8)
    reader.close()
    assert not reader.release(1, 8), "a closed table ignores releases"


@pytest.mark.parametrize("name", ["../etc/passwd", "stagewire-cudaipc-1-zz", "", "x" * 300])
def test_release_table_refuses_bad_names(name: str) -> None:
    """A name that is not a release table's cannot be opened, whatever it points at."""
    with pytest.raises(TransportError, match="not a cuda_ipc release table name"):
        ReleaseTable.open(name)


def test_dead_owners_tables_are_swept() -> None:
    """A table left by a process that died is unlinked; a live owner's is kept."""
    dead = release_table._DIR / f"stagewire-cudaipc-{_exited_pid()}-{'0' * 16}"
    dead.write_bytes(bytes(64))
    live = ReleaseTable.create(1)
    try:
        removed = sweep_dead_tables()
        assert dead.name in removed and not dead.exists()
        assert live.name not in removed
    finally:
        live.close()
        dead.unlink(missing_ok=True)


def test_wrapped_memory_calls_back_once_when_freed() -> None:
    """A tensor over foreign memory shares it without a copy, keeps its owner alive, and
    calls back exactly once, after the last view of it dies."""
    source = torch.arange(64, dtype=torch.uint8)
    freed: list[int] = []
    before = live_wrappers()
    tensor = wrap_memory(
        source.data_ptr() + 8, 16, None, keepalive=source, on_free=lambda: freed.append(1)
    )
    assert tensor.dtype == torch.uint8 and tensor.shape == (16,)
    assert tensor.data_ptr() == source.data_ptr() + 8
    view = tensor.view(torch.int32)[1:]
    del tensor
    gc.collect()
    assert freed == [] and live_wrappers() == before + 1
    assert view.tolist() == torch.arange(12, 24, dtype=torch.uint8).view(torch.int32).tolist()
    del view
    assert freed == [1] and live_wrappers() == before


def test_wrapped_memory_failure_still_calls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """When torch refuses the capsule, the callback has run before the error surfaces and
    nothing stays registered."""
    import torch.utils.dlpack

    def refuse(capsule: object) -> None:
        raise RuntimeError("refused")

    monkeypatch.setattr(torch.utils.dlpack, "from_dlpack", refuse)
    source = torch.zeros(16, dtype=torch.uint8)
    freed: list[int] = []
    before = live_wrappers()
    with pytest.raises(RuntimeError, match="refused"):
        wrap_memory(source.data_ptr(), 16, None, keepalive=source, on_free=lambda: freed.append(1))
    assert freed == [1] and live_wrappers() == before


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")],
        ),
    ],
)
async def test_payloads_held_for_a_killed_consumer_are_taken_back(device: str) -> None:
    """A consumer killed -9 while holding one payload and sent three it never opened leaves
    the producer's cuda_ipc end holding nothing once the master declares it dead: device
    buffers on a GPU, the shm host part on the CPU."""
    stages = "tests.transports.edge_stages"
    spec = PipelineSpec.from_dict(
        {
            "name": "device-kill",
            "defaults": {"heartbeat_interval": "200ms", "heartbeat_timeout": "2s"},
            "stages": {
                "flood": {
                    "impl": f"{stages}:TensorFlood",
                    "params": {"count": 4, "device": device},
                },
                # One handler, asleep holding its first piece: the other three wait unread.
                "drain": {
                    "impl": f"{stages}:TensorDrain",
                    "params": {"delay": 60},
                    "max_concurrency": 1,
                },
            },
            "edges": [{"from": "flood", "to": "drain", "transport": "cuda_ipc"}],
        }
    )

    async def counters() -> dict[str, int]:
        stats = await pipe.statistics()
        flood = next(r for r in stats["replicas"] if r["stage"] == "flood")
        return flood["outputs"][0]["transports"]["cuda_ipc"]  # type: ignore[no-any-return]

    pids: set[int] = set()
    async with Pipeline(spec) as pipe:
        pids.update(pipe.worker_pids.values())
        task = asyncio.ensure_future(pipe.submit(Text("go")))
        seen: dict[str, int] = {}

        async def all_put() -> bool:
            seen.update(await counters())
            return seen["chunks"] == 4

        await wait_for(all_put, timeout=30)
        # The three never opened are held; so is the first on a GPU, where the consumer's
        # tensor is the producer's memory (on the CPU its bytes were copied out of shm).
        assert seen["held"] >= 3, seen
        os.kill(pipe.worker_pids[("drain", 0)], signal.SIGKILL)
        with pytest.raises(StageUnavailable):
            await task

        async def taken_back() -> bool:
            return (await counters())["held"] == 0

        await wait_for(taken_back, timeout=30)
        pids.update(pipe.worker_pids.values())
    # On a GPU the driver and torch made files in /dev/shm for both workers (the consumer
    # killed -9, the producer stopped): none is left.
    assert cuda_files_of(pids) == []


# ---- CUDA tensors: gpu-marked, skipped without a device -----------------------------------


def _cuda_cases() -> list[torch.Tensor]:
    """CUDA tensors of several dtypes and layouts, each with distinct contents."""
    gen = torch.Generator(device="cuda").manual_seed(1234)
    raw = torch.randint(0, 256, (3 * MiB,), dtype=torch.uint8, device="cuda", generator=gen)
    return [
        raw[: 4 * 1000].view(torch.float32).reshape(10, 100),
        raw[MiB : MiB + 2 * 4096].view(torch.bfloat16).reshape(64, 64).t(),
        raw[: 8 * 7].view(torch.int64)[1:],
        (raw[:30] % 2).bool().reshape(5, 6),
        raw[:64].view(torch.complex64),
        torch.empty(0, 3, device="cuda"),
        raw[2 * MiB :],
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
async def test_cuda_round_trip_in_one_process(ends: tuple[CudaIpcSender, CudaIpcReceiver]) -> None:
    """CUDA tensors sent within one process arrive on their device, equal, sharing the
    producer's memory, and the payload is counted as a cuda_ipc chunk."""
    sender, receiver = ends
    cases = _cuda_cases()
    encoded = codec_for(Tensors).encode(Tensors(cases))
    assert encoded.has_device_buffers
    descriptor = await sender.put(_key(0), encoded, timeout=5)
    assert descriptor.spans and len(descriptor.devices) == 1
    got = codec_for(Tensors).decode(await receiver.get(descriptor))
    await receiver.release(descriptor)
    for want, tensor in zip(cases, got.tensors, strict=True):
        assert tensor.device == want.device
        assert fingerprint(tensor) == fingerprint(want)
    assert got.tensors[-1].data_ptr() == cases[-1].data_ptr(), "a contiguous tensor was copied"
    assert sender.statistics().by_transport["cuda_ipc"] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
async def test_cuda_round_trip_across_processes(edge: EdgeContext) -> None:
    """CUDA tensors reach a consumer process intact on its GPU, and once it has released
    them and dropped its tensors, the producer holds nothing."""
    transport = CudaIpcTransport(capacity=64 * MiB)
    peer = Peer("consume")
    try:
        async with transport.open_sender(edge) as sender:
            for round_ in range(3):
                cases = _cuda_cases()
                encoded = codec_for(Tensors).encode(Tensors(cases))
                descriptor = await sender.put(_key(round_), encoded, timeout=5)
                reply = await asyncio.to_thread(peer.send, descriptor_line(descriptor))
                assert reply["pid"] != os.getpid()
                assert reply["tensors"] == [fingerprint(t) for t in cases]
            await wait_for(lambda: _now(sender.held == (0, 0)))
            assert sender.statistics().by_transport == {"cuda_ipc": 3}
    finally:
        assert peer.close() == 0, peer.stderr()
    assert cuda_files_of([peer.process.pid]) == []


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_a_process_that_shared_gpu_memory_leaves_no_file_at_a_clean_exit() -> None:
    """While it runs, a producer has the driver's and torch's files in /dev/shm; after a
    clean exit neither is left (the driver's own is removed by stagewire's exit hook), and
    torch does not warn of shared tensors outliving it, although the exported tensor was
    held in a cycle frozen out of the collector, as a worker's stage holds its tensors."""
    code = textwrap.dedent(
        """
        import asyncio, gc, os, torch
        from pipeline._codec import codec_for
        from pipeline._host import host_identity
        from pipeline._keys import ChunkKey
        from tests.transports.cuda_ipc_peer import Tensors
        from transports._cuda_files import cuda_files_of
        from transports._protocol import EdgeContext
        from transports.cuda_ipc import CudaIpcTransport

        class Stage:
            pass

        async def main():
            stage = Stage()
            stage.me, stage.t = stage, torch.ones(1 << 20, dtype=torch.uint8, device="cuda")
            sender = CudaIpcTransport(linger=0).open_sender(EdgeContext("a->b", host_identity()))
            payload = codec_for(Tensors).encode(Tensors([stage.t]))
            await sender.put(ChunkKey("r", "a->b", 0), payload, timeout=5)
            await sender.aclose()  # Nobody read it: let go at exit.

        asyncio.run(main())
        gc.freeze()
        print("FILES", os.getpid(), *cuda_files_of([os.getpid()]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    # Only the marked line: the sender's own warning about the unread payload is logged too.
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("FILES "))
    pid, *files = line.split()[1:]
    assert sorted(f.split(".")[0].split("_")[0] for f in files) == ["cuda", "torch"], files
    assert cuda_files_of([int(pid)]) == []
    assert "terminated before all shared CUDA tensors released" not in done.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
async def test_producer_keeps_storage_until_consumer_is_done(edge: EdgeContext) -> None:
    """The producer's own tensor can die right after put, and its memory be churned, yet
    the consumer reads the original bytes; the producer lets go only after the consumer
    has released and dropped its tensors."""
    transport = CudaIpcTransport(capacity=256 * MiB)
    peer = Peer("hold")
    try:
        async with transport.open_sender(edge) as sender:
            tensor = torch.arange(4 * MiB, dtype=torch.int32, device="cuda")
            want = fingerprint(tensor)
            descriptor = await sender.put(
                _key(0), codec_for(Tensors).encode(Tensors([tensor])), timeout=5
            )
            del tensor
            torch.cuda.empty_cache()
            churn = [torch.full((4 * MiB,), -1, dtype=torch.int32, device="cuda") for _ in range(8)]
            torch.cuda.synchronize()
            reply = await asyncio.to_thread(peer.send, descriptor_line(descriptor))
            assert reply["tensors"] == [want]
            # The peer has released the payload but still holds its tensors: nothing is freed.
            assert sender.held[0] == 1
            assert (await asyncio.to_thread(peer.send, b"drop\n")) == {"dropped": True}
            await wait_for(lambda: _now(sender.held == (0, 0)))
            del churn
    finally:
        assert peer.close() == 0, peer.stderr()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
async def test_handles_are_exported_and_opened_once_per_storage(edge: EdgeContext) -> None:
    """Two tensors over one storage cost one export; the consumer maps their segment once."""
    transport = CudaIpcTransport(capacity=64 * MiB)
    peer = Peer("consume")
    try:
        async with transport.open_sender(edge) as sender:
            big = torch.arange(2 * MiB, dtype=torch.uint8, device="cuda")
            exports = EXPORTS.exports
            replies = []
            for i, part in enumerate((big[:MiB], big[MiB:])):
                descriptor = await sender.put(
                    _key(i), codec_for(Tensors).encode(Tensors([part])), timeout=5
                )
                replies.append(await asyncio.to_thread(peer.send, descriptor_line(descriptor)))
            assert EXPORTS.exports == exports + 1
            assert [r["opens"] for r in replies] == [1, 1]
            assert [r["tensors"][0]["sha256"] for r in replies] == [
                fingerprint(big[:MiB])["sha256"],
                fingerprint(big[MiB:])["sha256"],
            ]
    finally:
        assert peer.close() == 0, peer.stderr()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
async def test_stale_device_token(ends: tuple[CudaIpcSender, CudaIpcReceiver]) -> None:
    """A device payload's descriptor is refused once released, and after its slot is reused."""
    sender, receiver = ends
    encoded = codec_for(Tensors).encode(Tensors([torch.ones(16, device="cuda")]))
    descriptor = await sender.put(_key(0), encoded, timeout=5)
    await receiver.get(descriptor)
    await receiver.release(descriptor)
    with pytest.raises(TransportError, match="stale or already released"):
        await receiver.get(descriptor)
    for i in range(1, 20):
        churn = await sender.put(_key(i), encoded, timeout=5)
        await receiver.release(churn)
    with pytest.raises(TransportError, match="stale"):
        await receiver.get(descriptor)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
async def test_device_payload_on_another_host(edge: EdgeContext) -> None:
    """A device payload's descriptor used on another host is a TransportError naming hosts."""
    transport = CudaIpcTransport(capacity=MiB)
    async with transport.open_sender(edge) as sender:
        encoded = codec_for(Tensors).encode(Tensors([torch.ones(16, device="cuda")]))
        descriptor = await sender.put(_key(0), encoded, timeout=5)
        elsewhere = EdgeContext(EDGE, f"{edge.host}-elsewhere")
        async with transport.open_receiver(elsewhere) as remote:
            with pytest.raises(TransportError, match="host"):
                await remote.get(descriptor)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
async def test_hop_latency_is_flat_in_size() -> None:
    """Moving 256 MiB costs about what moving 1 MiB does: no copy of the data is made."""
    from tests.transports.cuda_ipc_peer import benchmark

    results = await benchmark(sizes=(MiB, 256 * MiB), rounds=20)
    small, large = results[MiB]["hop_us"], results[256 * MiB]["hop_us"]
    print(f"cuda_ipc hop: 1 MiB {small:.1f} µs, 256 MiB {large:.1f} µs")
    assert large < max(5 * small, small + 500), f"hop latency grows with size: {results}"


async def _now(value: bool) -> bool:
    """``value``, as the awaitable probe that ``wait_for`` polls."""
    return value
