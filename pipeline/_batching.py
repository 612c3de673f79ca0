"""Dynamic batching: requests that are ready together go through ``process_batch`` at once.

A batch closes when it holds ``max_batch_size`` items or ``max_wait`` seconds after its first
item arrived, whichever comes first. A replica admits at most ``max_concurrency`` requests at
once, so a batch never waits for more than that many items. A request cancelled while queued
is left out and takes no place in a batch. When ``process_batch`` raises CancelledError for
a request aborted meanwhile (``ctx.checkpoint()``), the batch runs again without it: the
others are not failed for it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pipeline._stage import Context, Stage

__all__ = ("Batcher",)

#: One queued input: its value, its request's context, the future of its output, and the
#: loop time it arrived at.
_Entry = tuple[Any, Context, "asyncio.Future[Any]", float]

_OWN_CANCEL = (
    "something process_batch awaited was cancelled (CancelledError), though the batch was "
    "not; cancel helper tasks only when the handler no longer awaits them"
)


class Batcher:
    """Collects single inputs from concurrent requests and runs them as batches."""

    def __init__(self, instance: Stage, max_batch_size: int, max_wait: float) -> None:
        self._process_batch = instance.process_batch  # type: ignore[attr-defined]  # checked
        self._max = max_batch_size
        self._wait = max_wait
        self._queue: asyncio.Queue[_Entry] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.batches = 0
        self.items = 0

    async def submit(self, value: Any, ctx: Context) -> Any:
        """Queue one input and wait for its output.

        Raises:
            Exception: whatever ``process_batch`` raised for the batch holding this input.
        """
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._loop())
        fut: asyncio.Future[Any] = loop.create_future()
        self._queue.put_nowait((value, ctx, fut, loop.time()))
        return await fut

    async def _collect(self) -> list[_Entry]:
        """The next batch: items not yet abandoned, from the first one's arrival on."""
        queue = self._queue
        first = await queue.get()
        while first[2].done():  # abandoned while queued: no place in a batch, no wait
            first = await queue.get()
        batch = [first]
        loop = asyncio.get_running_loop()
        deadline = first[3] + self._wait
        while len(batch) < self._max:
            if queue.empty():
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    async with asyncio.timeout(remaining):
                        entry = await queue.get()
                except TimeoutError:
                    break
            else:
                entry = queue.get_nowait()
            if not entry[2].done():
                batch.append(entry)
        return [entry for entry in batch if not entry[2].done()]

    async def _loop(self) -> None:
        while True:
            # No batch stays bound here while the next one is awaited: its inputs (payloads
            # read in place, whose transport holds them until they die) go with it.
            await self._run(await self._collect())

    async def _run(self, batch: list[_Entry]) -> None:
        """Run one batch and settle its requests' futures."""
        while batch:
            self.batches += 1
            self.items += len(batch)
            try:
                results = await self._process_batch([b[0] for b in batch], [b[1] for b in batch])
                if not isinstance(results, list | tuple):
                    raise TypeError(
                        "process_batch must return a list with one output per input, not "
                        f"{type(results).__name__}"
                    )
                if len(results) != len(batch):
                    raise ValueError(
                        f"process_batch returned {len(results)} outputs for {len(batch)} inputs"
                    )
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise  # the batcher is closing, and the replica cancels its requests
                if any(e[1].cancelled for e in batch):
                    # A request aborted meanwhile stopped the batch (ctx.checkpoint()): the
                    # others run again without it.
                    batch = [e for e in batch if not e[1].cancelled and not e[2].done()]
                    continue
                # Something process_batch awaited was cancelled, not the batcher: only this
                # batch fails, the next one runs.
                self._fail(batch, RuntimeError(_OWN_CANCEL))
                return
            # As a handler's (see StageActor._run): the batch's failure, not the worker's end
            # (any BaseException: one uncaught ended the batcher, and every request with it).
            except BaseException as exc:
                self._fail(batch, exc)
                return
            for (_, _, fut, _), result in zip(batch, results, strict=True):
                if not fut.done():
                    fut.set_result(result)
            return

    @staticmethod
    def _fail(batch: list[_Entry], exc: BaseException) -> None:
        for _, _, fut, _ in batch:
            if not fut.done():
                fut.set_exception(exc)

    async def aclose(self) -> None:
        """Stop batching; idempotent."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
