"""Dynamic batching: requests that are ready together go through ``process_batch`` at once.

A batch closes when it holds ``max_batch_size`` items or ``max_wait`` seconds after its first
item arrived, whichever comes first. A request cancelled while queued is left out.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pipeline._stage import Context, Stage

__all__ = ("Batcher",)

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
        self._queue: asyncio.Queue[tuple[Any, Context, asyncio.Future[Any]]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.batches = 0
        self.items = 0

    async def submit(self, value: Any, ctx: Context) -> Any:
        """Queue one input and wait for its output.

        Raises:
            Exception: whatever ``process_batch`` raised for the batch holding this input.
        """
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((value, ctx, fut))
        return await fut

    async def _collect(self) -> list[tuple[Any, Context, asyncio.Future[Any]]]:
        batch = [await self._queue.get()]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._wait
        while len(batch) < self._max:
            remaining = deadline - loop.time()
            if remaining <= 0:
                while len(batch) < self._max and not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                break
            try:
                async with asyncio.timeout(remaining):
                    batch.append(await self._queue.get())
            except TimeoutError:
                break
        return [entry for entry in batch if not entry[2].done()]

    async def _loop(self) -> None:
        while True:
            # No batch stays bound here while the next one is awaited: its inputs (payloads
            # read in place, whose transport holds them until they die) go with it.
            await self._run(await self._collect())

    async def _run(self, batch: list[tuple[Any, Context, asyncio.Future[Any]]]) -> None:
        """Run one batch and settle its requests' futures."""
        if not batch:
            return
        self.batches += 1
        self.items += len(batch)
        try:
            results = await self._process_batch([b[0] for b in batch], [b[1] for b in batch])
            if len(results) != len(batch):
                raise ValueError(
                    f"process_batch returned {len(results)} outputs for {len(batch)} inputs"
                )
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # the batcher is closing, and the replica cancels its requests
            # Something process_batch awaited was cancelled, not the batcher: only this
            # batch fails, the next one runs.
            self._fail(batch, RuntimeError(_OWN_CANCEL))
            return
        except Exception as exc:
            self._fail(batch, exc)
            return
        for (_, _, fut), result in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(result)

    @staticmethod
    def _fail(batch: list[tuple[Any, Context, asyncio.Future[Any]]], exc: Exception) -> None:
        for _, _, fut in batch:
            if not fut.done():
                fut.set_exception(exc)

    async def aclose(self) -> None:
        """Stop batching; idempotent."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
