"""Credit windows: a slow consumer slows its producer, and memory stays flat."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from pipeline import Pipeline
from pipeline._channel import LONE_WINDOWS
from stages.text import Text
from tests.pipeline.conftest import spec, wait_for

CHUNK = 256 * 1024
COUNT = 600  # 150 MiB in all, far more than the window could hold


def _rss(pid: int) -> int:
    """Private resident memory of a process, in bytes.

    Anonymous memory is what queues grow into (ZMQ's buffers, Python objects). Shared
    memory mapped from an shm arena is left out: it is bounded by the arena's capacity,
    reserved and touched once up front, whatever the traffic.
    """
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


async def test_slow_sink_holds_fast_source_memory_flat() -> None:
    """150 MiB streamed into a slow sink never holds more than its windows of chunks
    anywhere (a request alone on its edge gets LONE_WINDOWS of them)."""
    window = 8
    s = spec(
        {
            "flood": {"impl": ":Flood", "params": {"count": COUNT, "size": CHUNK}},
            "drain": {"impl": ":Drain", "params": {"delay": 0.003}},
        },
        [("flood", "drain")],
        window=window,
        # Inline: the chunks travel through the sockets, where only credits bound them.
        transport="inline",
    )
    async with Pipeline(s) as pipe:
        pids = pipe.worker_pids
        base = {k: _rss(pid) for k, pid in pids.items()}
        peak = dict(base)
        task = asyncio.ensure_future(pipe.submit(Text("go")))
        while not task.done():
            for k, pid in pids.items():
                peak[k] = max(peak[k], _rss(pid))
            await asyncio.wait([task], timeout=0.02)
        assert await task == Text(str(COUNT))
        stats = await pipe.statistics()
    growth = {k[0]: (peak[k] - base[k]) / 2**20 for k in pids}
    print("RSS growth MiB:", growth)
    drain = next(r for r in stats["replicas"] if r["stage"] == "drain")
    assert drain["peak_buffered"] <= LONE_WINDOWS * window
    # Without credits the producer would queue ~150 MiB in ZMQ and the consumer would buffer
    # it; with them each side holds a few windows of 256 KiB chunks plus allocator slack.
    assert growth["flood"] < 40, growth
    assert growth["drain"] < 40, growth


@pytest.mark.parametrize(
    ("window_bytes", "most_buffered"),
    [
        # Buffered items: the chunks the bytes allow, plus the stream's end (no payload).
        pytest.param(1024 * 1024, 4 + 1, id="four-chunks-of-bytes"),
        # Each chunk is larger than the byte window: it still goes, one at a time.
        pytest.param(100 * 1024, 1 + 1, id="chunk-over-the-window"),
    ],
)
async def test_byte_window_bounds_large_chunks_before_the_chunk_window(
    window_bytes: int, most_buffered: int
) -> None:
    """With a wide chunk window, the byte window is what holds the slow sink's buffer."""
    count = 120
    s = spec(
        {
            "flood": {"impl": ":Flood", "params": {"count": count, "size": CHUNK}},
            "drain": {"impl": ":Drain", "params": {"delay": 0.002}},
        },
        [("flood", "drain")],
        window=256,
        window_bytes=window_bytes,
        transport="inline",
    )
    async with Pipeline(s) as pipe:
        assert await pipe.submit(Text("go")) == Text(str(count))
        stats = await pipe.statistics()
    drain = next(r for r in stats["replicas"] if r["stage"] == "drain")
    # 256 chunks of 256 KiB would be allowed by the chunk window alone.
    assert 1 <= drain["peak_buffered"] <= most_buffered, drain["peak_buffered"]


async def _arena_empty(pipe: Pipeline) -> bool:
    """Whether the producers' shm arenas hold no extent."""
    stats = await pipe.statistics()
    return not any(
        out["transports"].get("shm", {}).get("held", 0)
        for replica in stats["replicas"]
        for out in replica["outputs"]
    )


@pytest.mark.parametrize(
    ("count", "requests", "capacity"),
    [
        # Each request's byte window (64 MiB by default) could fill this arena alone.
        pytest.param(40, 3, "16MiB", id="windows"),
        # Each queued request's first chunk took the arena regardless of the queued share:
        # 12 first chunks of 1 MiB did not fit in 8 MiB (its queued share is 2 MiB), and
        # the running request's next put found no room. A consumer with one input cannot
        # start a request before its first chunk, so that chunk waits for the share too.
        pytest.param(6, 12, "8MiB", id="first-chunks"),
    ],
)
async def test_queued_requests_leave_the_shm_arena_to_the_running_one(
    count: int, requests: int, capacity: str
) -> None:
    """Requests queued behind a consumer's max_concurrency hold only a share of the
    producer's shm arena, so the running request's stream keeps finding room: every
    request completes, none falls back, and the arena is empty after."""
    s = spec(
        {
            "flood": {
                "impl": ":Flood",
                "params": {"count": count, "size": 1024 * 1024},
                "max_concurrency": requests,
            },
            "drain": {"impl": ":Drain", "params": {"delay": 0.002}, "max_concurrency": 1},
        },
        [("flood", "drain")],
        # With no fallback, a put that finds no room within 3 s fails its request.
        transport={"kind": "shm", "options": {"capacity": capacity}, "full_timeout": 3},
    )
    async with Pipeline(s) as pipe:
        results = await asyncio.gather(
            *(pipe.submit(Text(str(i))) for i in range(requests)), return_exceptions=True
        )
        assert results == [Text(str(count))] * requests
        stats = await pipe.statistics()
        (out,) = next(r for r in stats["replicas"] if r["stage"] == "flood")["outputs"]
        assert (out["used"], out["fallbacks"]) == ({"shm": count * requests}, 0)
        # The queued requests were held back at their share, rather than filling the arena.
        assert out["queued_waits"] > 0, out
        await wait_for(lambda: _arena_empty(pipe))


async def test_queued_requests_whose_producer_is_done_with_them_still_hold_back_first_chunks() -> (
    None
):
    """A producer forgets a request once its handler ends: a queued request of one chunk
    left no window behind, though its payload still held the queued share. The next first
    chunk for that consumer replica found no queued request ahead and went, and queued
    first chunks filled the arena under the running stream (TransportFull)."""
    s = spec(
        {
            "flood": {
                "impl": ":FloodN", "params": {"size": 1024 * 1024}, "max_concurrency": 32,
            },
            "drain": {"impl": ":Drain", "params": {"delay": 0.05}, "max_concurrency": 1},
        },
        [("flood", "drain")],
        transport={"kind": "shm", "options": {"capacity": "8MiB"}, "full_timeout": 3},
    )  # fmt: skip
    async with Pipeline(s) as pipe:
        long = asyncio.ensure_future(pipe.submit(Text("60")))

        async def running() -> bool:
            stats = await pipe.statistics()
            return any(r["started"] for r in stats["replicas"] if r["stage"] == "drain")

        await wait_for(running)
        singles = [asyncio.ensure_future(pipe.submit(Text("1"))) for _ in range(12)]
        results = await asyncio.gather(long, *singles, return_exceptions=True)
        assert results == [Text("60"), *[Text("1")] * 12], results
        stats = await pipe.statistics()
        (out,) = next(r for r in stats["replicas"] if r["stage"] == "flood")["outputs"]
        assert out["fallbacks"] == 0 and out["queued_waits"] > 0, out


async def test_a_request_for_an_idle_replica_does_not_wait_behind_another_replicas_queue(
    tmp_path: Path,
) -> None:
    """The queued share is the producer's, across its consumer's replicas. A first chunk
    for a replica with nothing queued waited while another replica's queued requests held
    the share: behind that replica's running request, for as long as it ran (for good, its
    handler stuck). It waits only behind its own replica's queue now."""
    s = spec(
        {
            "wrap": {"impl": ":Wraps", "max_concurrency": 8},
            "work": {"impl": ":Unwraps", "replicas": 2, "max_concurrency": 1},
        },
        [("wrap", "work")],
        # One 3 MiB first chunk fills the 2 MiB queued share of this 8 MiB arena.
        transport={"kind": "shm", "options": {"capacity": "8MiB"}, "full_timeout": 60},
    )
    fifos = {name: tmp_path / name for name in ("a", "b")}
    for fifo in fifos.values():
        os.mkfifo(fifo)
    async with Pipeline(s) as pipe:
        views = pipe._master_here().orch.replicas["work"]

        def replica_of(request_id: str) -> int:
            (k,) = [k for k, v in views.items() if request_id in v.requests]
            return k

        async def held(name: str) -> tuple[asyncio.Task[Text], int]:
            stream = pipe.stream(Text(f"hold:{fifos[name]}"))
            rid = await stream.start()
            return asyncio.ensure_future(anext(stream)), replica_of(rid)

        # Each replica runs a held request; a third request queues behind one of them,
        # its first chunk in the arena, counted in the queued share.
        first, at_first = await held("a")
        second, at_second = await held("b")
        assert {at_first, at_second} == {0, 1}
        await wait_for(lambda: all(Path(f"{f}.taken").exists() for f in fifos.values()))
        queued = pipe.stream(Text("queued"))
        at_queued = replica_of(await queued.start())

        async def in_the_arena() -> bool:
            stats = await pipe.statistics()
            (out,) = next(r for r in stats["replicas"] if r["stage"] == "wrap")["outputs"]
            return bool(out["transports"]["shm"]["held"])

        await wait_for(in_the_arena)
        # The other replica's request ends: that replica is idle, the queue stays.
        other = "a" if at_first != at_queued else "b"
        with fifos[other].open("w") as f:
            f.write("go\n")
        await (first if other == "a" else second)
        async with asyncio.timeout(20):
            answer = await pipe.submit(Text("fast"))
        assert answer == Text(f"fast@{1 - at_queued}")
        with fifos["b" if other == "a" else "a"].open("w") as f:
            f.write("go\n")
        assert await anext(queued) == Text(f"queued@{at_queued}")
        await (second if other == "a" else first)
