"""The event-loop check behind skipped loop turns, and ``Context.checkpoint`` built on it:
a turn is taken when something else could run, and only then."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pipeline import Context
from pipeline._loop import loop_has_work, nothing_else_ready, step_now


def test_loop_has_work_sees_ready_callbacks_and_knows_no_other_loop() -> None:
    """A ready callback counts as work; an event loop of another kind always has work."""

    async def probe() -> tuple[bool, bool]:
        loop = asyncio.get_running_loop()
        idle = loop_has_work(loop)
        handle = loop.call_soon(lambda: None)
        busy = loop_has_work(loop)
        handle.cancel()
        return idle, busy

    assert asyncio.run(probe()) == (False, True)
    assert loop_has_work(object())  # type: ignore[arg-type]  # not an asyncio loop


def test_loop_has_work_sees_a_readable_socket_and_a_due_timer() -> None:
    async def probe() -> tuple[bool, bool, bool, bool]:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        try:
            loop.add_reader(a.fileno(), lambda: None)
            quiet = loop_has_work(loop)
            b.send(b"x")
            readable = loop_has_work(loop)
            loop.remove_reader(a.fileno())
        finally:
            a.close()
            b.close()
        timer = loop.call_at(loop.time() + 3600, lambda: None)
        later = loop_has_work(loop)
        timer.cancel()
        # Scheduled in the past: due now, though not yet moved to the ready queue. (Last:
        # a cancelled timer stays in the loop's heap for a while and still counts, which
        # costs at most one needless turn.)
        loop.call_at(loop.time() - 1, lambda: None)
        overdue = loop_has_work(loop)
        return quiet, readable, later, overdue

    assert asyncio.run(probe()) == (False, True, False, True)


async def test_checkpoint_takes_no_loop_turn_when_nothing_else_could_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    turns = 0
    sleep = asyncio.sleep

    async def counted(delay: float) -> None:
        nonlocal turns
        turns += 1
        await sleep(delay)

    ctx = Context("r", "stage", 0)
    monkeypatch.setattr(asyncio, "sleep", counted)
    for _ in range(100):
        await ctx.checkpoint()
    assert turns == 0


async def test_checkpoint_lets_another_request_run_between_calls() -> None:
    """Two handlers that only compute and checkpoint take turns, as before."""
    progress: list[str] = []

    async def handler(name: str) -> None:
        ctx = Context(name, "stage", 0)
        for _ in range(5):
            progress.append(name)
            await ctx.checkpoint()

    await asyncio.gather(handler("a"), handler("b"))
    # Interleaved, not one handler's five steps and then the other's.
    assert progress[:4] in (["a", "b", "a", "b"], ["b", "a", "b", "a"]), progress


async def test_checkpoint_raises_once_the_request_is_cancelled() -> None:
    ctx = Context("r", "stage", 0)
    await ctx.checkpoint()
    ctx.cancel()
    with pytest.raises(asyncio.CancelledError):
        await ctx.checkpoint()


def test_step_now_runs_a_new_task_to_its_first_wait_as_that_task() -> None:
    """The first step runs at once, as the task (current_task, its context); what follows
    its first wait runs as the loop schedules it; a caller that is a task steps nothing."""

    async def probe() -> list[object]:
        loop = asyncio.get_running_loop()
        seen: list[object] = []
        gate = loop.create_future()

        async def body() -> None:
            seen.append(asyncio.current_task())
            await gate
            seen.append("resumed")

        def from_a_callback() -> None:
            task = loop.create_task(body())
            step_now(loop, task)
            seen.append(task)  # after the step: the body's first part ran already

        loop.call_soon(from_a_callback)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert seen[0] is seen[1]  # the body ran as its own task, before step_now returned
        gate.set_result(None)
        await asyncio.sleep(0)
        assert seen[2] == "resumed"
        # Called from a running task, it leaves the step to the loop: one task cannot run
        # another's step inside its own.
        later: list[str] = []

        async def other() -> None:
            later.append("ran")

        inner = loop.create_task(other())
        step_now(loop, inner)
        assert later == []
        await inner
        assert later == ["ran"]
        return seen

    asyncio.run(probe())


def test_nothing_else_ready_ignores_cancelled_handles_and_the_one_named() -> None:
    async def probe() -> tuple[bool, bool, bool, bool]:
        loop = asyncio.get_running_loop()
        quiet = nothing_else_ready(loop)
        own = loop.call_soon(lambda: None)
        mine_only = nothing_else_ready(loop, but=own)
        other = loop.call_soon(lambda: None)
        busy = nothing_else_ready(loop, but=own)
        other.cancel()
        cancelled = nothing_else_ready(loop, but=own)
        own.cancel()
        return quiet, mine_only, busy, cancelled

    assert asyncio.run(probe()) == (True, True, False, True)
    assert not nothing_else_ready(object())  # type: ignore[arg-type]  # cannot tell
