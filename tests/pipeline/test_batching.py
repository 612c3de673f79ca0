"""Batching (``process_batch``): what a batch holds and waits for, and how an abort or a bad
``process_batch`` touches only the requests it should."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from pipeline import (
    ChunkGap,
    ConfigError,
    Context,
    Pipeline,
    PipelineSpec,
    RequestAborted,
    StageError,
)
from pipeline._batching import Batcher
from pipeline._reorder import HELD_LIMIT
from pipeline._signature import build_plan
from stages.text import Text
from tests.pipeline.conftest import settled, spec, wait_for


async def test_a_request_aborted_in_a_running_batch_fails_only_itself(tmp_path: Path) -> None:
    """``ctx.checkpoint()`` of the aborted request stops process_batch; the batch runs again
    without it and its batch-mates complete. (They failed with a StageError before.)"""
    marker = tmp_path / "step"
    stage = {
        "impl": ":SteppedBatch",
        "max_batch_size": 3,
        "max_wait_ms": 20_000,  # the batch closes on its third item
        "env": {"STEP_MARKER": str(marker)},
    }
    async with Pipeline(spec({"b": stage}, [])) as pipe:
        held = pipe.stream(Text("hold"))
        first = asyncio.ensure_future(held.__anext__())
        others = [asyncio.ensure_future(pipe.submit(Text(t))) for t in ("a", "b")]
        await wait_for(lambda: marker.exists() and marker.read_text() == "running 3", 10)
        assert held.request_id is not None
        assert await pipe.abort(held.request_id, "not wanted")
        with pytest.raises(RequestAborted, match="not wanted"):
            await asyncio.wait_for(first, 10)
        assert await asyncio.wait_for(asyncio.gather(*others), 10) == [Text("A#2"), Text("B#2")]
        await wait_for(lambda: settled(pipe))


async def test_a_batch_closes_when_every_request_the_replica_admits_is_in_it() -> None:
    """max_batch_size above max_concurrency: no more items can come than max_concurrency,
    so the batch closes then instead of waiting out max_wait_ms (a minute here)."""
    stage = {"impl": ":Batched", "max_batch_size": 32, "max_wait_ms": 60_000, "max_concurrency": 4}
    async with Pipeline(spec({"b": stage}, [])) as pipe:
        async with asyncio.timeout(20):
            outs = await asyncio.gather(*(pipe.submit(Text(f"t{i}")) for i in range(4)))
    assert outs == [Text(f"T{i}#4") for i in range(4)]


async def test_a_batch_closes_when_every_request_the_pipeline_admits_is_in_it() -> None:
    """max_batch_size above the pipeline's max_inflight: no more requests can reach the
    stage than the pipeline admits, so the batch closes then; it used to wait out
    max_wait_ms (a minute here) every time."""
    stage = {"impl": ":Batched", "max_batch_size": 32, "max_wait_ms": 60_000}
    async with Pipeline(spec({"b": stage}, [], max_inflight=2)) as pipe:
        async with asyncio.timeout(20):
            outs = await asyncio.gather(*(pipe.submit(Text(f"t{i}")) for i in range(4)))
    assert outs == [Text(f"T{i}#2") for i in range(4)]


class _Echoes:
    async def process_batch(self, items: list[Any], ctxs: list[Context]) -> list[Any]:
        return items


def _entry(value: Any, arrived: float, *, abandoned: bool = False) -> tuple[Any, ...]:
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    if abandoned:
        fut.cancel()
    return (value, Context("r", "s", 0), fut, arrived)


async def test_max_wait_counts_from_the_first_items_arrival() -> None:
    """An item that waited behind a running batch longer than max_wait goes at once in the
    next one: the wait counts from its arrival, not from when the batcher reaches it."""
    batcher = Batcher(_Echoes(), 8, 60.0)  # type: ignore[arg-type]  # has process_batch
    now = asyncio.get_running_loop().time()
    batcher._queue.put_nowait(_entry("late", now - 61))  # type: ignore[arg-type]
    batch = await asyncio.wait_for(batcher._collect(), 5)
    assert [e[0] for e in batch] == ["late"]


async def test_items_abandoned_while_queued_take_no_place_in_a_batch() -> None:
    batcher = Batcher(_Echoes(), 4, 60.0)  # type: ignore[arg-type]  # has process_batch
    now = asyncio.get_running_loop().time()
    entries = [_entry(f"gone{i}", now, abandoned=True) for i in range(3)]
    entries += [_entry(f"live{i}", now) for i in range(4)]
    for entry in entries:
        batcher._queue.put_nowait(entry)  # type: ignore[arg-type]
    batch = await asyncio.wait_for(batcher._collect(), 5)
    assert [e[0] for e in batch] == [f"live{i}" for i in range(4)]


def test_a_process_batch_that_is_not_async_is_refused_at_build() -> None:
    with pytest.raises(ConfigError, match="must be 'async def process_batch"):
        build_plan(spec({"b": {"impl": ":SyncBatch", "max_batch_size": 4}}, []))


def test_max_batch_size_on_a_stage_without_process_batch_is_refused_at_build() -> None:
    with pytest.raises(ConfigError, match="defines no process_batch") as info:
        build_plan(spec({"e": {"impl": ":Echo", "max_batch_size": 4}}, []))
    assert info.value.path == "stages.e.max_batch_size"


async def test_a_process_batch_that_returns_no_list_fails_its_requests_clearly() -> None:
    stage = {"impl": ":GeneratorBatch", "max_batch_size": 4, "max_wait_ms": 5}
    async with Pipeline(spec({"b": stage}, [])) as pipe:
        with pytest.raises(StageError, match="must return a list with one output per input"):
            await asyncio.wait_for(pipe.submit(Text("x")), 10)


async def test_a_handler_that_goes_on_after_its_abort_sends_nothing_more() -> None:
    """A handler that swallows its cancellation and returns a value anyway is stopped at its
    send: nothing leaves for the ended request and no credit window is opened again for it.
    (Its window stayed open for good, and the value left.)"""
    s = spec({"tokens": ":Tokens", "s": ":SwallowsCancel"}, [("tokens", "s")])
    async with Pipeline(s) as pipe:
        stream = pipe.stream(Text("a stall"))
        waiting = asyncio.ensure_future(stream.__anext__())

        async def started() -> bool:
            stats = await pipe.statistics()
            return [r["started"] for r in stats["replicas"] if r["stage"] == "s"] == [1]

        await wait_for(started, 10)
        assert stream.request_id is not None
        assert await pipe.abort(stream.request_id, "enough")
        with pytest.raises(RequestAborted):
            await asyncio.wait_for(waiting, 10)
        await wait_for(lambda: settled(pipe), 5)


async def test_a_join_that_starves_one_input_says_so_when_the_other_gaps() -> None:
    """Two branches of one producer met by a join that reads one to its end first: past a
    window, the producer waits for credit on the unread one and never sends the next chunk
    of the other. The join's ChunkGap says which input holds a full window unread. (The
    branches' own timeouts are long here, so that the join's wait is the one that ends.)"""
    data = spec(
        {"fan": ":ToBothSides", "left": ":Relay", "right": ":Relay", "join": ":LeftThenRight"},
        [("fan", "left"), ("fan", "right"), ("left", "join"), ("right", "join")],
        window=8,
        chunk_timeout="1s",
    ).to_dict()
    for edge in data["edges"]:
        if edge["from"] == "fan":
            edge["chunk_timeout"] = "60s"
    async with Pipeline(PipelineSpec.from_dict(data)) as pipe:
        assert await asyncio.wait_for(pipe.submit(Text("4")), 10) == Text("4/4")
        with pytest.raises(ChunkGap, match=r"'right->join' holds \d+ chunks the handler has"):
            await asyncio.wait_for(pipe.submit(Text("200")), 20)


async def test_a_join_waiting_for_a_first_chunk_that_never_comes_gaps_rather_than_hangs() -> None:
    """One producer streams to the right branch alone while the join reads its left input
    first: the join waits for left's first chunk (untimed: a producer may start late), the
    producer waits for the join's credit on the right. The left relay, whose handler never
    started, passed on nothing, and the join waited for ever. The producer's Held notices
    now reach the join through it, and the wait ends after HELD_LIMIT chunk timeouts."""
    s = spec(
        {"fan": ":ToRightOnly", "left": ":Relay", "right": ":Relay", "join": ":LeftThenRight"},
        [("fan", "left"), ("fan", "right"), ("left", "join"), ("right", "join")],
        window=4,
        chunk_timeout="1s",
    )
    async with Pipeline(s) as pipe:
        assert await asyncio.wait_for(pipe.submit(Text("2")), 10) == Text("0/2")
        with pytest.raises(ChunkGap, match="chunk 0 on edge 'left->join' did not arrive"):
            await asyncio.wait_for(pipe.submit(Text("50")), 5 + HELD_LIMIT)


async def test_a_join_that_holds_up_its_own_producer_gaps_rather_than_hangs() -> None:
    """left streams to right (a relay) and to the join, which reads left's stream to its
    end first: right waits for the join's credit, left for right's, and the join for left.
    Told by left that its chunks were held (left waits on right), the join waited on for
    ever. A wait that such notices extend now ends after HELD_LIMIT chunk timeouts all the
    same, and its ChunkGap says which input holds a full window unread."""
    s = spec(
        {"left": ":Tokens", "right": ":Relay", "join": ":LeftThenRight"},
        [("left", "right"), ("left", "join"), ("right", "join")],
        window=4,
        chunk_timeout="1s",
    )
    async with Pipeline(s) as pipe:
        assert await asyncio.wait_for(pipe.submit(Text("a b")), 10) == Text("2/2")
        words = " ".join(f"w{i}" for i in range(50))
        with pytest.raises(ChunkGap, match=r"'right->join' holds \d+ chunks the handler has"):
            await asyncio.wait_for(pipe.submit(Text(words)), 5 + HELD_LIMIT)
