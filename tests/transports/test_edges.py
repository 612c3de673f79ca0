"""Edges carried by real transports between worker processes: ordering across a transport
mix, host identity, and shared memory left behind by killed workers.

The first tests pin the inline-chunk bug of vllm-omni (its PR #1643): when small chunks
travel inline and large ones through shared memory, the consumer must still see every
chunk exactly once and in order, whatever carried it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from pipeline import (
    ChunkGap,
    ConfigError,
    Pipeline,
    PipelineError,
    PipelineSpec,
    StageError,
    StageUnavailable,
    TransportError,
)
from stages.text import Text
from tests.pipeline.conftest import settled, wait_for
from tests.procs import kill_all, start_stagewire
from transports._shm_segment import free_space
from transports.inline import MAX_INLINE
from transports.shm import list_segments

pytestmark = pytest.mark.asyncio(loop_scope="module")

STAGES = "tests.transports.edge_stages"
#: Chunks per request, alternating 512 B (inline) and 16 KiB (shm) under a 4 KiB threshold.
CHUNKS = 8
SIZES = [512, 16 * 1024]
REQUESTS = 500


def _spec(
    *,
    transport: Any = "auto",
    producers: int = 1,
    producer_env: dict[str, str] | None = None,
    consumer_env: dict[str, str] | None = None,
    sizes: list[int] | None = None,
    delay: float = 0.0,
    **defaults: Any,
) -> PipelineSpec:
    """source (Alternate) -> sink (Verify) with the given edge transport."""
    return PipelineSpec.from_dict(
        {
            "name": "edges",
            "defaults": {
                "heartbeat_interval": "200ms",
                "heartbeat_timeout": "2s",
                "inline_threshold": "4KiB",
                **defaults,
            },
            "stages": {
                "source": {
                    "impl": f"{STAGES}:Alternate",
                    "replicas": producers,
                    "params": {"count": CHUNKS, "sizes": sizes or SIZES},
                    "env": producer_env or {},
                },
                "sink": {
                    "impl": f"{STAGES}:Verify",
                    "params": {"delay": delay},
                    "env": consumer_env or {},
                },
            },
            "edges": [{"from": "source", "to": "sink", "transport": transport}],
        }
    )


def _expected(count: int = CHUNKS, sizes: list[int] | None = None) -> Text:
    sizes = sizes or SIZES
    return Text(f"{count}:{sum(sizes[i % len(sizes)] for i in range(count))}")


async def _used(pipe: Pipeline, edge: str = "source->sink") -> tuple[dict[str, int], list[int]]:
    """Chunks per transport on ``edge``, summed over producer replicas, and each's requests."""
    stats = await pipe.statistics()
    used: dict[str, int] = {}
    served: list[int] = []
    for replica in stats["replicas"]:
        for out in replica["outputs"]:
            if out["edge"] == edge:
                served.append(replica["completed"])
                for name, n in out["used"].items():
                    used[name] = used.get(name, 0) + n
    return used, served


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=[1, 2], ids=["1x1", "2x1"])
async def mixed(request: pytest.FixtureRequest) -> AsyncIterator[Pipeline]:
    """An auto edge whose chunks alternate between inline and shm, with 1 or 2 producers."""
    async with Pipeline(_spec(producers=request.param)) as pipe:
        yield pipe


async def test_alternating_transports_keep_order(mixed: Pipeline) -> None:
    """500 concurrent requests whose chunks alternate inline and shm each arrive whole and
    in order, and the edge really used both transports."""
    results = await asyncio.gather(*(mixed.submit(Text("")) for _ in range(REQUESTS)))
    assert results == [_expected()] * REQUESTS
    used, served = await _used(mixed)
    assert used.get("inline", 0) >= REQUESTS * CHUNKS // 2, used
    assert used.get("shm", 0) >= REQUESTS * CHUNKS // 2, used
    # With two producer replicas both must have fed the one consumer.
    assert all(n > 0 for n in served), f"a producer replica served nothing: {served}"
    await wait_for(lambda: settled(mixed))


async def test_shm_extents_are_all_released(mixed: Pipeline) -> None:
    """After a burst of streams, no extent of any producer's arena is still held."""
    await asyncio.gather(*(mixed.submit(Text("")) for _ in range(50)))
    stats = await mixed.statistics()
    for replica in stats["replicas"]:
        for out in replica["outputs"]:
            shm = out["transports"].get("shm")
            if shm is not None:
                assert shm["held"] == 0, f"{replica['stage']} still holds {shm}"


async def _drained(stream: AsyncIterator[Text]) -> list[Text]:
    return [out async for out in stream]


async def _shm_held(pipe: Pipeline) -> int:
    """Extents every shm sender of the pipeline still holds."""
    stats = await pipe.statistics()
    return sum(
        out["transports"].get("shm", {}).get("held", 0)
        for replica in stats["replicas"]
        for out in replica["outputs"]
    )


async def _none_held(pipe: Pipeline) -> bool:
    return await _shm_held(pipe) == 0


@pytest.mark.parametrize("end", ["aborted", "failed"])
async def test_an_extent_read_in_place_by_an_ended_handler_comes_back_at_once(end: str) -> None:
    """A handler that holds a piece it read in place (a view of an shm extent) when its
    request is aborted, or when it raises, lets go of it with the request: the producer's
    extent comes back at once. (The handler's frames, and so the view, stayed in a
    reference cycle through the error that ended them, which only the consumer's garbage
    collector would free, and an idle worker may not run it for a long time.)"""
    data: dict[str, Any] = _spec(transport="shm", sizes=[16 * 1024]).to_dict()
    data["stages"]["sink"].update(impl=f"{STAGES}:Keep", params={"fail": end == "failed"})
    async with Pipeline(PipelineSpec.from_dict(data)) as pipe:
        for _ in range(3):
            stream = pipe.stream(Text("2"))
            if end == "aborted":
                async for out in stream:
                    assert out == Text("kept 0")
                    break
                assert await _shm_held(pipe) >= 1  # the kept piece, at least
                await stream.aclose()
            else:
                with pytest.raises(StageError, match="failed holding piece 0"):
                    await _drained(stream)
            await wait_for(lambda: _none_held(pipe), timeout=10)
        await wait_for(lambda: settled(pipe))


async def test_an_extent_read_in_place_as_a_single_input_of_a_failed_handler_comes_back() -> None:
    """The same for a piece that came as a single input (not a stream), which the runtime
    holds for the handler: a handler that raises lets go of it at once."""
    data: dict[str, Any] = _spec(transport="shm").to_dict()
    data["stages"]["source"].update(impl=f"{STAGES}:OnePiece", params={})
    data["stages"]["sink"].update(impl=f"{STAGES}:FailOnPiece", params={})
    async with Pipeline(PipelineSpec.from_dict(data)) as pipe:
        for _ in range(3):
            with pytest.raises(StageError, match="failed holding piece 0"):
                await pipe.submit(Text("x"))
            await wait_for(lambda: _none_held(pipe), timeout=10)


@pytest.mark.parametrize("fail", [False, True], ids=["served", "failed"])
async def test_extents_read_in_place_by_a_batch_come_back_with_it(fail: bool) -> None:
    """Pieces read in place and handled by ``process_batch`` are let go once their batch
    is done, served or failed: an idle batched replica holds no extent. (The batching
    loop kept its last batch until the next one came.)"""
    data: dict[str, Any] = _spec(transport="shm").to_dict()
    data["stages"]["source"].update(impl=f"{STAGES}:OnePiece", params={})
    data["stages"]["sink"].update(
        impl=f"{STAGES}:MeasurePieces",
        params={"fail": fail},
        max_batch_size=4,
        max_wait_ms=5,
    )
    async with Pipeline(PipelineSpec.from_dict(data)) as pipe:
        for _ in range(3):
            if fail:
                with pytest.raises(StageError, match="failed holding 1 pieces"):
                    await pipe.submit(Text("x"))
            else:
                assert await pipe.submit(Text("x")) == Text(str(16 * 1024))
            await wait_for(lambda: _none_held(pipe), timeout=10)


def _beyond_free_shm(**edge: Any) -> PipelineSpec:
    """The source -> sink edge pinned to shm with an arena larger than /dev/shm has free."""
    data: dict[str, Any] = _spec().to_dict()
    capacity = free_space() + 2**30
    data["edges"][0]["transport"] = {"kind": "shm", "options": {"capacity": capacity}, **edge}
    return PipelineSpec.from_dict(data)


async def test_an_edge_pinned_to_shm_that_dev_shm_cannot_hold_fails_start_up() -> None:
    """DESIGN's row "/dev/shm too small": a clear error at start-up naming the needed and
    free sizes (the segment used to be made at the first put, so each request failed
    mid-run with TransportFull), and nothing left in /dev/shm."""
    before = set(list_segments())
    with pytest.raises(PipelineError, match=r"needs .+ of /dev/shm .+ but only .+ is free"):
        async with Pipeline(_beyond_free_shm()):
            pass
    assert set(list_segments()) <= before


async def test_with_a_fallback_an_edge_that_dev_shm_cannot_hold_starts_and_goes_by_it() -> None:
    """With a fallback configured, the same edge starts (a warning names the sizes) and its
    payloads take the fallback."""
    async with Pipeline(_beyond_free_shm(fallback="inline")) as pipe:
        assert await pipe.submit(Text("")) == _expected()
        used, _ = await _used(pipe)
        assert used == {"inline": CHUNKS}, used


async def test_pinned_shm_between_hosts_is_a_config_error() -> None:
    """An edge pinned to shm whose ends are on different hosts fails start-up, naming it."""
    spec = _spec(
        transport="shm",
        producer_env={"STAGEWIRE_HOST_ID": "host-a"},
        consumer_env={"STAGEWIRE_HOST_ID": "host-b"},
    )
    with pytest.raises(ConfigError, match=r"'source->sink' is pinned to transport 'shm'"):
        async with Pipeline(spec):
            pass


async def test_auto_between_hosts_goes_by_network() -> None:
    """Between different host identities, auto sends large payloads by network, not shm."""
    spec = _spec(
        producer_env={"STAGEWIRE_HOST_ID": "host-a"},
        consumer_env={"STAGEWIRE_HOST_ID": "host-b"},
    )
    async with Pipeline(spec) as pipe:
        results = await asyncio.gather(*(pipe.submit(Text("")) for _ in range(20)))
        assert results == [_expected()] * 20
        used, _ = await _used(pipe)
    assert set(used) == {"inline", "network"}, used
    assert used["network"] == 20 * CHUNKS // 2


async def test_a_consumer_finding_its_producer_gone_has_the_master_declare_it_at_once(
    tmp_path: Path,
) -> None:
    """A producer killed -9 while its consumer still has a payload of it to fetch: the fetch
    finds it gone and fails the request with StageUnavailable naming the producer's stage,
    and the master, told so, finds the process exited and declares the replica dead at once,
    long before its heartbeat timeout (no launcher watches these workers: they are started
    by hand), so that no new request is bound to it meanwhile."""
    data: dict[str, Any] = _spec(sizes=[8 << 20], heartbeat_timeout="60s").to_dict()
    # The second piece's fetch needs acks from the sink's loop, which its first piece's
    # compute holds: so it is still at the producer when the producer dies.
    data["edges"][0]["transport"] = {
        "kind": "network",
        "options": {"window": "1MiB", "segment_size": "1MiB"},
    }
    mark = tmp_path / "computing"
    sent = tmp_path / "second sent"
    data["stages"]["sink"]["params"] = {"block": 1.5, "mark": str(mark)}
    # The second piece leaves only once the sink computes: its fetch cannot have begun.
    data["stages"]["source"]["params"] |= {"second_after": str(mark), "second_sent": str(sent)}
    spec = PipelineSpec.from_dict(data)
    pipe = Pipeline(spec)
    starting = asyncio.ensure_future(pipe.start(launch=False))
    procs = []
    try:
        await wait_for(lambda: pipe._master is not None and bool(pipe._master.endpoint), 30)
        for stage in ("source", "sink"):
            procs.append(start_stagewire("worker", "--master", pipe.master_endpoint,
                                         "--stage", stage, "--headless"))  # fmt: skip
        await asyncio.wait_for(starting, 60)
        master = pipe._master
        assert master is not None
        request = asyncio.ensure_future(pipe.submit(Text("2")))
        # The kill lands inside the sink's 1.5 s of compute on piece 0, which it marks as
        # it starts: its loop can answer nothing then, and piece 1, sent since, waits at
        # the producer.
        await wait_for(sent.exists, 30, interval=0.01)
        t0 = time.monotonic()
        procs[0].kill()
        with pytest.raises(StageUnavailable, match="'source' unavailable"):
            await asyncio.wait_for(request, 30)
        assert not master.replicas[("source", 0)].alive
        assert time.monotonic() - t0 < 10  # the heartbeat timeout is 60 s
    finally:
        if not starting.done():
            starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        kill_all(procs)
        await pipe.aclose()


def _ours(pids: list[int]) -> list[str]:
    """Segments owned by any of ``pids``."""
    return [s for s in list_segments() if any(f"-{pid}-" in s for pid in pids)]


@pytest.mark.parametrize("victim", ["source", "sink"])
async def test_kill_9_leaves_no_segment(victim: str) -> None:
    """kill -9 of a producer or consumer mid-stream leaves no shm segment once the pipeline
    is closed, and fails only the requests it held."""
    before = set(list_segments())
    big = [256 * 1024, 512 * 1024]
    spec = _spec(transport="shm", sizes=big, delay=0.01)
    pids: list[int] = []
    async with Pipeline(spec) as pipe:
        pids = list(pipe.worker_pids.values())
        streams = [asyncio.ensure_future(pipe.submit(Text("200"))) for _ in range(4)]
        # Wait until the stream is in flight: the producer's segment exists.
        await wait_for(lambda: _have(_ours(pids)), timeout=20)
        os.kill(pipe.worker_pids[(victim, 0)], signal.SIGKILL)
        outcomes = await asyncio.gather(*streams, return_exceptions=True)
        assert all(isinstance(o, StageUnavailable) for o in outcomes), outcomes
        pids += list(pipe.worker_pids.values())
    assert _ours(pids) == []
    assert set(list_segments()) <= before


async def _have(found: list[str]) -> bool:
    return bool(found)


async def test_auto_falls_back_when_shm_cannot_take_a_payload() -> None:
    """On auto, a payload larger than the shm arena goes inline instead, counted as a
    fallback, and the stream still arrives whole and in order."""
    sizes = [512, 96 * 1024]
    spec = _spec(transport={"kind": "auto", "options": {"shm": {"capacity": "64KiB"}}}, sizes=sizes)
    async with Pipeline(spec) as pipe:
        results = await asyncio.gather(*(pipe.submit(Text("")) for _ in range(10)))
        assert results == [_expected(sizes=sizes)] * 10
        stats = await pipe.statistics()
    (out,) = [o for r in stats["replicas"] for o in r["outputs"] if o["edge"] == "source->sink"]
    assert out["used"] == {"inline": 10 * CHUNKS}, out["used"]
    assert out["fallbacks"] == 10 * CHUNKS // 2


async def test_a_network_edge_falls_back_for_a_payload_over_its_capacity() -> None:
    """A network edge given a ``fallback`` sends a payload larger than its whole capacity by
    the fallback, as shm does: the network sender refused it with a plain TransportError,
    which no fallback takes, and the request failed."""
    sizes = [512, 96 * 1024]
    spec = _spec(
        transport={"kind": "network", "options": {"capacity": "64KiB"}, "fallback": "shm"},
        sizes=sizes,
    )
    async with Pipeline(spec) as pipe:
        results = await asyncio.gather(*(pipe.submit(Text("")) for _ in range(4)))
        assert results == [_expected(sizes=sizes)] * 4
        stats = await pipe.statistics()
    (out,) = [o for r in stats["replicas"] for o in r["outputs"] if o["edge"] == "source->sink"]
    assert out["used"] == {"network": 4 * CHUNKS // 2, "shm": 4 * CHUNKS // 2}, out["used"]
    assert out["fallbacks"] == 4 * CHUNKS // 2


async def test_a_payload_no_data_message_can_carry_fails_its_request_saying_so() -> None:
    """On auto, a payload larger than the shm arena and than an inline envelope carries (a
    data message takes at most 1 GiB) fails its request at once with a TransportError
    naming the sizes and what to send it by. It used to go inline into a message larger
    than the consumer takes, whose link then dropped it with every envelope queued on it,
    and the request hung. The edge serves on."""
    sizes = [512, MAX_INLINE + 1]
    spec = _spec(
        transport={"kind": "auto", "options": {"shm": {"capacity": "64KiB"}}},
        sizes=sizes,
        request_timeout="30s",
    )
    async with Pipeline(spec) as pipe:
        with pytest.raises(TransportError, match="an inline envelope carries") as info:
            await pipe.submit(Text("2"))
        assert "by shm" in str(info.value) and "network" in str(info.value), info.value
        assert await pipe.submit(Text("1")) == _expected(1, sizes)


@pytest.mark.parametrize(
    ("tells", "error", "timeouts"),
    [
        ("consumer", ChunkGap, ({"full_timeout": "30s"}, "2s")),
        ("producer", TransportError, ({"full_timeout": "1s"}, "30s")),
    ],
)
async def test_a_stream_read_in_place_past_half_the_arena_fails_saying_what_pins_it(
    tells: str, error: type[Exception], timeouts: tuple[dict[str, str], str]
) -> None:
    """Chunks of 3 MiB through a 4 MiB shm arena, read by a plain ``async for`` whose loop
    variable keeps the last chunk's zero-copy array while the next is awaited: the next
    finds no room, and the request fails, by the consumer's ChunkGap or the producer's
    TransportFull, whichever end's timeout is shorter. Either says what pins the arena
    and what to do (they blamed a slow upstream, or descriptors left unreleased); with
    ``copy: true`` the same stream passes."""
    sizes = [3 * 2**20]
    put, chunk_timeout = timeouts
    for copy in (False, True):
        shm = {"kind": "shm", "options": {"capacity": "4MiB", "copy": copy}, **put}
        async with Pipeline(_spec(transport=shm, sizes=sizes, chunk_timeout=chunk_timeout)) as p:
            if copy:
                assert await p.submit(Text("3")) == _expected(3, sizes)
                continue
            with pytest.raises(error) as info:
                await p.submit(Text("3"))
            message = str(info.value)
            assert "copy: true" in message and "two chunks" in message, (tells, message)


async def test_auto_sends_nothing_inline_past_what_an_envelope_carries() -> None:
    """An ``inline_threshold`` above what an inline envelope carries (the config takes any
    size) does not send larger payloads inline: they go by shm on one host, network across
    two. auto chose inline for them, and the chunk failed with TransportFull (its fallback
    on auto is inline again), counted as a fallback that carried nothing."""
    from transports.auto import AutoPolicy
    from transports.inline import MAX_INLINE

    for same_host, beyond in [(True, "shm"), (False, "network")]:
        policy = AutoPolicy(2 * MAX_INLINE, same_host=same_host)
        assert policy.choose(MAX_INLINE) == ("inline", False)
        assert policy.choose(MAX_INLINE + 1) == (beyond, False)
