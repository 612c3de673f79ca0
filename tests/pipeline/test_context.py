"""What a handler learns from its Context, in real worker processes."""

from __future__ import annotations

import asyncio
import json

import pytest

from pipeline import Pipeline, RequestAborted
from stages.text import Text
from tests.pipeline.conftest import spec, wait_for


async def test_a_handler_knows_its_request_stage_and_replica_and_logs_with_them(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """``ctx.request_id``, ``ctx.stage`` and ``ctx.replica`` name the request and the
    replica serving it, and ``ctx.log`` binds all three to every line (DESIGN section 9)."""
    async with Pipeline(spec({"who": {"impl": ":WhoAmI", "replicas": 2}}, [])) as pipe:
        seen: dict[str, tuple[str, int]] = {}
        for i in range(6):
            stream = pipe.stream(Text(f"hello {i}"))
            async for out in stream:
                request_id, stage, replica, cancelled = out.value.split("|")
                assert request_id == stream.request_id and cancelled == "False"
                seen[request_id] = (stage, int(replica))
        assert {stage for stage, _ in seen.values()} == {"who"}
        assert {replica for _, replica in seen.values()} == {0, 1}  # both served
    logged = [
        json.loads(line)
        for line in capfd.readouterr().err.splitlines()
        if line.startswith("{") and '"who_am_i"' in line
    ]
    assert {(r["request_id"], r["stage"], r["replica"]) for r in logged} == {
        (rid, stage, replica) for rid, (stage, replica) in seen.items()
    }


async def test_an_aborted_handlers_thread_sees_ctx_cancelled_and_stops() -> None:
    """Aborting a request cancels its handler's task, which cannot stop a CPU loop it runs
    in a thread; the loop stops because ``ctx.cancelled`` turns true."""
    async with Pipeline(spec({"who": ":WhoAmI"}, [])) as pipe:
        stream = pipe.stream(Text("spin"))
        waiting = asyncio.ensure_future(stream.__anext__())

        async def counter(name: str) -> int:
            stats = await pipe.statistics()
            return int(stats["replicas"][0]["counters"][name])

        async def spinning() -> bool:
            return await counter("spinning") == 1

        await wait_for(spinning, 10)  # the thread's loop runs
        assert stream.request_id is not None
        assert await pipe.abort(stream.request_id, "enough")
        with pytest.raises(RequestAborted, match="enough"):
            await asyncio.wait_for(waiting, 10)

        async def stopped() -> bool:
            return await counter("stopped") == 1

        await wait_for(stopped, 10)
