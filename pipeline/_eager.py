"""Start a task's first step at once, as Python 3.12's eager tasks do.

A stage's handler runs in a task. Created from the callback that read its chunk, the task
would take its first step only in the event loop's next turn: one more pass of the loop
(a system call, and the loop's code run cold in a process that idled through a request)
before the handler starts, and another before what it sent leaves. Measured in the
reference pipeline, 0.27 ms from filing a chunk to its handler's start, in each stage.

:func:`start_now` runs the step that ``create_task`` queued right away instead, through
the same handle, so the task's context, its ``current_task()`` and its cancellation are
exactly those of its normal first step; only the moment changes, as with
``asyncio.eager_task_factory``. A handler that does not suspend completes within the
caller; one that does continues as any task.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ("start_now",)


def start_now(loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any]) -> bool:
    """Run ``task``'s first step now, if it was the last callback queued on ``loop``;
    whether it ran.

    Call it right after ``loop.create_task``, from a callback (not from inside a task:
    one task cannot step inside another, so it does nothing there). It also does nothing
    on a loop without the default loop's ready queue (uvloop, say): the step then runs in
    the next turn, as it always would.
    """
    ready: Any = getattr(loop, "_ready", None)
    if not ready or asyncio.current_task(loop) is not None:
        return False
    handle = ready[-1]
    if getattr(getattr(handle, "_callback", None), "__self__", None) is not task:
        return False  # something else was queued after it (another thread's callback)
    # Taken out wherever it is now (another thread may have queued a callback behind it
    # meanwhile), leaving every other callback in its order.
    ready.remove(handle)
    handle._run()
    return True
