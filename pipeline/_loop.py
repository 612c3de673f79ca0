"""What the runtime asks of the event loop itself.

A loop turn is not free: on a small VM, one taken right after a long stretch of model code
costs about 0.1 ms (the loop's code and data are cold). Code that yields only so that
others may run (a decode step alone, a handler's :meth:`~pipeline.Context.checkpoint`)
first asks :func:`loop_has_work` and skips the turn when nothing else could run.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ("loop_has_work", "nothing_else_ready", "step_now")


def loop_has_work(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` has something to run now: a ready callback, a due timer, or a file
    descriptor ready (data arrived, a socket drained). True when it cannot tell.

    A loop turn taken right after a model step costs about 0.1 ms on a small VM (the
    loop's code and data are cold), while this check is one ``epoll_wait`` with no
    timeout. The events it sees are not consumed: the loop's selector is level-triggered,
    so its next turn sees them again. It reads the default (selector) loop's own state;
    for another loop (uvloop, say) it answers True, and the caller yields as before.
    """
    ready: Any = getattr(loop, "_ready", None)
    scheduled: Any = getattr(loop, "_scheduled", None)
    selector: Any = getattr(loop, "_selector", None)
    if ready is None or scheduled is None or selector is None:
        return True
    if ready:
        return True
    if scheduled and scheduled[0].when() <= loop.time():
        return True
    return bool(selector.select(0))


def step_now(loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any]) -> None:
    """Run the first step of ``task``, created just now, at once instead of next loop turn.

    What Python 3.12's eager tasks do: a handler that needs no waiting (a one-chunk
    request's, usually) runs to its end inside the callback that made it ready, and the
    loop turn it would have waited for (an ``epoll_wait`` and the loop's own code, cold in
    a stage that idled) is saved. The step runs as the task, with its context, as the loop
    would run it. It does nothing (the loop runs the step as usual) where that cannot be
    done safely: another loop than the default one, a task factory that scheduled
    something else, or a caller that is itself a running task.
    """
    ready: Any = getattr(loop, "_ready", None)
    if not ready or asyncio.current_task(loop) is not None:
        return
    handle = ready[-1]
    if getattr(getattr(handle, "_callback", None), "__self__", None) is not task:
        return
    ready.pop()
    handle._run()


def nothing_else_ready(loop: asyncio.AbstractEventLoop, but: asyncio.Handle | None = None) -> bool:
    """Whether ``loop`` has no callback queued to run but cancelled ones and ``but``.

    It reads the default (selector) loop's own queue; False for a loop it cannot read.
    """
    ready: Any = getattr(loop, "_ready", None)
    if ready is None:
        return False
    return all(handle is but or handle.cancelled() for handle in ready)
