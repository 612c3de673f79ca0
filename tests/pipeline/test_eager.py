"""start_now: a task's first step runs inside the callback that created it, as the task's
own step (its current task, its context), and only when that is safe."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
from typing import Any

from pipeline._eager import start_now

where: contextvars.ContextVar[str] = contextvars.ContextVar("where", default="outside")


async def _record(seen: list[Any], wait: asyncio.Future[None] | None = None) -> str:
    seen.append(asyncio.current_task())
    where.set("inside the task")
    if wait is not None:
        await wait
        seen.append("resumed")
    return "done"


async def test_a_task_that_does_not_suspend_completes_inside_the_callback() -> None:
    loop = asyncio.get_running_loop()
    seen: list[Any] = []
    result: dict[str, Any] = {}

    def callback() -> None:
        task = loop.create_task(_record(seen))
        result["ran"] = start_now(loop, task)
        result["done"] = task.done()
        result["task"] = task
        result["where"] = where.get()

    loop.call_soon(callback)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    task = result["task"]
    assert result["ran"] and result["done"], result
    assert seen == [task]  # it ran as itself: asyncio.current_task() was the task
    assert task.result() == "done"
    assert result["where"] == "outside"  # its context is its own, as any task's


async def test_a_task_that_suspends_goes_on_as_any_task() -> None:
    loop = asyncio.get_running_loop()
    seen: list[Any] = []
    gate: asyncio.Future[None] = loop.create_future()
    holder: dict[str, Any] = {}

    def callback() -> None:
        holder["task"] = task = loop.create_task(_record(seen, gate))
        holder["ran"] = start_now(loop, task)
        holder["len_after"] = len(seen)

    loop.call_soon(callback)
    await asyncio.sleep(0)
    task = holder["task"]
    assert holder["ran"] and holder["len_after"] == 1 and not task.done()
    gate.set_result(None)
    assert await task == "done"
    assert seen == [task, "resumed"]


async def test_a_task_that_suspends_can_be_cancelled() -> None:
    loop = asyncio.get_running_loop()
    gate: asyncio.Future[None] = loop.create_future()
    holder: dict[str, Any] = {}

    def callback() -> None:
        holder["task"] = task = loop.create_task(_record([], gate))
        start_now(loop, task)

    loop.call_soon(callback)
    await asyncio.sleep(0)
    task = holder["task"]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()


async def test_nothing_happens_inside_a_task_or_behind_another_callback() -> None:
    """From inside a task (one task cannot step inside another), or when another callback
    was queued after the task, the step waits for the loop's next turn as usual."""
    loop = asyncio.get_running_loop()
    seen: list[Any] = []
    inside = loop.create_task(_record(seen))
    assert not start_now(loop, inside) and not inside.done()
    await inside

    holder: dict[str, Any] = {}

    def callback() -> None:
        holder["task"] = task = loop.create_task(_record(seen))
        loop.call_soon(lambda: None)
        holder["ran"] = start_now(loop, task)
        holder["done"] = task.done()

    loop.call_soon(callback)
    await asyncio.sleep(0)
    assert holder == {"task": holder["task"], "ran": False, "done": False}
    assert await holder["task"] == "done"  # it still runs, a turn later


def test_another_kind_of_loop_is_left_alone() -> None:
    class Other:
        pass

    assert not start_now(Other(), None)  # type: ignore[arg-type]  # not an asyncio loop


async def test_a_stage_handler_starts_inside_the_callback_that_filed_its_input() -> None:
    """Through the real actors and orchestrator (the in-process chain of the benchmark),
    every relay's handler runs inside the ``on_data`` call that filed its chunk, and the
    request still comes back whole."""
    from benchmarks.bench_stages import Blob
    from benchmarks.hops import LATENCY_CHAIN
    from benchmarks.inproc_chain import build, one_request

    orch, actors = await build(LATENCY_CHAIN)
    inside: list[bool] = []
    try:
        for actor in actors:
            original = actor.instance.process  # type: ignore[attr-defined]

            async def process(x: Blob, ctx: Any, original: Any = original) -> Blob:
                inside.append(any(f.function == "on_data" for f in inspect.stack(0)))
                return await original(x, ctx)  # type: ignore[no-any-return]

            actor.instance.process = process  # type: ignore[attr-defined]
        for _ in range(3):
            await one_request(orch, Blob(b"x" * 64))
    finally:
        await orch.aclose()
        for actor in actors:
            await actor.aclose()
    assert inside == [True] * (3 * len(actors)), inside
