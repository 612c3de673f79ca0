"""Shared helpers for runtime tests: building specs and waiting on conditions."""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pipeline import Pipeline, PipelineSpec

SAMPLE = "tests.pipeline.sample_stages"


def spec(stages: dict[str, Any], edges: list[tuple[str, str]], **defaults: Any) -> PipelineSpec:
    """A spec from ``{name: impl or dict}`` and ``[(from, to)]``; ``:Cls`` means SAMPLE:Cls."""
    full = {}
    for name, value in stages.items():
        entry = {"impl": value} if isinstance(value, str) else dict(value)
        if entry["impl"].startswith(":"):
            entry["impl"] = SAMPLE + entry["impl"]
        full[name] = entry
    return PipelineSpec.from_dict(
        {
            "name": "test",
            "defaults": {"heartbeat_interval": "200ms", "heartbeat_timeout": "2s", **defaults},
            "stages": full,
            "edges": [{"from": a, "to": b} for a, b in edges],
        }
    )


async def wait_for(
    probe: Callable[[], Awaitable[bool] | bool], timeout: float = 10.0, interval: float = 0.05
) -> None:
    """Poll ``probe`` (a coroutine function, or a plain one) until it gives True, failing the
    test after ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        # The condition lives in other processes (their statistics) or in state no event
        # announces, so there is nothing to wait on: poll it, bounded by the timeout.
        while True:
            got = probe()
            if await got if inspect.isawaitable(got) else got:
                return
            await asyncio.sleep(interval)


async def workers_announced(err: Path, timeout: float = 30.0) -> str:
    """Wait until a master writing its stderr to ``err`` has printed the ``stagewire
    worker`` command of each replica; returns what it wrote."""

    def announced() -> bool:
        return "stagewire worker --master" in err.read_text(errors="replace")

    await wait_for(announced, timeout=timeout)
    return await asyncio.to_thread(err.read_text, errors="replace")


async def settled(pipe: Pipeline) -> bool:
    """True when no stage and no client holds any request state."""
    stats = await pipe.statistics()
    if stats["client"]["active"]:
        return False
    return all(r["active"] == 0 and r["open_windows"] == 0 for r in stats["replicas"])


def told(fifo: str | os.PathLike[str]) -> bool:
    """Let a stage waiting on ``fifo`` (its LINGER_FIFO) go on: write it a line if a stage
    has it open; False, writing nothing, while none has."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # no reader yet (or none any more: a failure before it read)
        return False
    try:
        os.write(fd, b"go\n")
    finally:
        os.close(fd)
    return True


def grid_module(dtype: str) -> str:
    """The source of a stage module that only a master's host has (the client cannot import
    its output type): ``Gridify`` answers a text of n characters with a Grid whose cells are
    ``torch.arange(2 * n, dtype=torch.<dtype>).reshape(n, 2)``."""
    return f"""\
import msgspec
import torch

from pipeline import Context, Stage
from stages.text import Text


class Grid(msgspec.Struct):
    label: str
    cells: torch.Tensor


class Gridify(Stage):
    async def process(self, text: Text, ctx: Context) -> Grid:
        n = len(text.value)
        return Grid(text.value, torch.arange(2 * n, dtype=torch.{dtype}).reshape(n, 2))
"""
