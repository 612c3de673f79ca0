"""Shared helpers for runtime tests: building specs and waiting on conditions."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from pipeline import Pipeline, PipelineSpec

SAMPLE = "tests.pipeline.sample_stages"


def spec(stages: dict[str, Any], edges: list[tuple[str, str]], **defaults: Any) -> PipelineSpec:
    """A spec from ``{name: impl or dict}`` and ``[(from, to)]``, impls relative to SAMPLE."""
    full = {}
    for name, value in stages.items():
        entry = {"impl": value} if isinstance(value, str) else dict(value)
        if ":" in entry["impl"] and "." not in entry["impl"].split(":")[0]:
            entry["impl"] = f"{SAMPLE}:{entry['impl'].split(':')[1]}"
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
    probe: Callable[[], Awaitable[bool]], timeout: float = 10.0, interval: float = 0.05
) -> None:
    """Poll ``probe`` until it returns True, failing the test after ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        while not await probe():
            await asyncio.sleep(interval)


async def settled(pipe: Pipeline) -> bool:
    """True when no stage and no client holds any request state."""
    stats = await pipe.statistics()
    if stats["client"]["active"]:
        return False
    return all(r["active"] == 0 and r["open_windows"] == 0 for r in stats["replicas"])
