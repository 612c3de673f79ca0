"""Closing, from anywhere, an object whose tasks and sockets live on one event loop.

The embedded :class:`~pipeline._api.Pipeline` and the remote client both start on the
running loop and keep tasks, futures and socket readers there. :class:`LoopBound` holds that
loop, refuses coroutines run on another one, and gives them one ``aclose`` that holds
however it is reached:

- callers at once share one close task, and all wait for it;
- a caller cancelled meanwhile leaves the close running (a cancelled close must do what
  cannot wait at once: the subclass's ``_close`` sees to that);
- from another loop, the close runs on the owner's loop if it still runs, or, if that loop
  has closed, what can be done without awaiting is done at once (``_close_now``).

:class:`LoopWatch` covers the close nobody calls: a loop that ends (``asyncio.run``
returning) with the object still open, in a process that lives on.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

__all__ = ("LoopBound", "LoopWatch", "interrupts_deferred")


class LoopBound:
    """A mix-in: call :meth:`_bind` in ``start``, :meth:`_check_here` in coroutines, and
    :meth:`_close_once` in ``aclose``; provide ``_close`` and ``_close_now``."""

    #: What error messages call the object ("pipeline", "remote pipeline").
    _what = "object"
    _loop: asyncio.AbstractEventLoop | None = None
    _closing: asyncio.Task[None] | None = None

    def _bind(self) -> None:
        """Belong to the running loop, with no close done or under way."""
        self._loop = asyncio.get_running_loop()
        self._closing = None

    def _check_here(self) -> None:
        """Refuse a coroutine running on another loop than the one :meth:`_bind` saw.

        Raises:
            RuntimeError: saying which, and what to do.
        """
        loop = self._loop
        if loop is None or asyncio.get_running_loop() is loop:
            return
        if loop.is_closed():
            raise RuntimeError(
                f"the event loop this {self._what} was started on has closed (its tasks "
                f"with it): call 'await aclose()' to release it, then start a new one in "
                "this loop"
            )
        raise RuntimeError(
            f"this {self._what} runs on another event loop: use it from the loop that "
            "started it (each loop needs one of its own)"
        )

    @property
    def _still_closing(self) -> bool:
        return self._closing is not None and not self._closing.done()

    async def _close_once(self) -> None:
        """Run the close (see the module docstring); nothing if never started.

        Raises:
            asyncio.CancelledError: this caller was cancelled (the close goes on).
        """
        loop = self._loop
        if loop is None:
            return
        if asyncio.get_running_loop() is not loop:
            if loop.is_running():
                there = asyncio.run_coroutine_threadsafe(self._close_once(), loop)
                await asyncio.wrap_future(there)
            else:
                self._close_now()
            return
        task = self._closing
        if task is None:
            task = self._closing = loop.create_task(self._close())
            # A KeyboardInterrupt (a second Ctrl-C) raised in the close leaves the loop with
            # it, and the task keeps it too: asyncio would print it again, as a traceback,
            # when the task is collected ("exception was never retrieved").
            task.add_done_callback(_retrieve)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and (current is None or not current.cancelling()):
                return  # the close was cancelled, not this caller: it did what it could
            raise

    async def _close(self) -> None:
        """Close on the owner's loop; if cancelled, release at once what it has not."""
        raise NotImplementedError

    def _close_now(self) -> None:
        """Release everything without awaiting: the owner's loop has closed."""
        raise NotImplementedError


class LoopWatch:
    """Calls ``on_closed(watch)`` once, from a thread of its own, if ``loop`` closes before
    :meth:`stop`; checks every ``interval`` seconds. The callback is handed the watch, to
    tell whether it still watches what it was started for.

    A loop that is merely held (a blocking call, a debugger's breakpoint) or stopped is not
    closed: only a closed loop can never run the object's tasks again.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        interval: float,
        on_closed: Callable[[LoopWatch], None],
    ) -> None:
        self._loop = loop
        # A thread's wait takes at most TIMEOUT_MAX (a heartbeat interval may be set longer).
        self._interval = min(interval, threading.TIMEOUT_MAX)
        self._on_closed = on_closed
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stagewire-loop-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            if self._loop.is_closed():
                if not self._stopped.is_set():
                    self._on_closed(self)
                return

    def stop(self) -> None:
        """Stop watching (the thread ends within ``interval``); idempotent."""
        self._stopped.set()


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT's handler back while the body runs, and run it afterwards.

    Cleanup that must finish (killing workers, unlinking the shared memory they leave) is
    not cut off half way by the KeyboardInterrupt that a second Ctrl-C raises (asyncio's
    handler, or Python's own), which would leave segments behind. Only in the main thread,
    the one that runs such handlers; elsewhere the body just runs.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[FrameType | None] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        came.append(frame)

    try:
        before = signal.signal(signal.SIGINT, hold)
    except (ValueError, OSError):  # no signals here
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
        if came:
            if callable(before):
                # (asyncio's loop handler is a no-op here: its loop hears of the signal
                # through its own wake-up descriptor, which the signal reached anyway.)
                before(signal.SIGINT, came[-1])
            elif before == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)
