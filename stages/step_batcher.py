"""Decode steps of concurrent requests, run together: continuous batching for the decode stage.

Every request decoding in a replica asks :meth:`StepBatcher.step` for its next token. A
request decoding alone steps in place with :meth:`~stages.model.Decoder.step`, exactly as
:func:`stages.model.generate` does, and lets the event loop run only every few
milliseconds. When several decode at once, a step waits for the rest
of the loop turn, so that every request woken by the previous batch joins, and then up to
``max_batch`` of them run as one :meth:`~stages.model.Decoder.step_many`. That costs about
what two or three single steps cost (at this model's size a step is mostly per-operation
overhead, which the batch shares), and each request's tokens are bit-for-bit those of
single steps, so batching never changes an output.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import NamedTuple

from pipeline._loop import loop_has_work
from stages.model import Decoder, LayerKV

__all__ = ("YIELD_ALONE_S", "Step", "StepBatcher")

#: A request decoding alone lets the event loop run at least this often (seconds).
YIELD_ALONE_S = 0.005


class Step(NamedTuple):
    """What one request's step gave it."""

    #: The next greedy token.
    token: int
    #: How many requests' steps the model step that made it held (1: alone).
    batch: int
    #: How long that model step ran, in seconds (waiting for it not included).
    seconds: float


_Waiting = tuple[int, list[LayerKV], "asyncio.Future[Step]"]


class StepBatcher:
    """Batches the decode steps of the requests that decode at once in one replica.

    Args:
        decoder: the model whose steps run.
        max_batch: the most requests' steps run as one (1: never batch).
        yield_alone_s: a request decoding alone lets the event loop run at least this
            often (arrivals, aborts); 0 yields after every step.

    Attributes:
        steps: model steps run so far, batched or single.
        yields: loop turns a request decoding alone took (it takes one only when the
            loop has something to run).
        request_steps: requests' steps those held, in all (``steps`` when never batched).
        batches: batched steps run so far (steps of two requests or more).
        batched_steps: requests' steps those batches held, in all.
    """

    def __init__(
        self, decoder: Decoder, max_batch: int, yield_alone_s: float = YIELD_ALONE_S
    ) -> None:
        self._decoder = decoder
        self._max_batch = max_batch
        self._yield_alone_s = yield_alone_s
        self._decoding = 0
        self._waiting: list[_Waiting] = []
        self._scheduled = False
        self._yielded = 0.0
        self.steps = 0
        self.yields = 0
        self.request_steps = 0
        self.batches = 0
        self.batched_steps = 0

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        """Count a request as decoding while the block runs: steps batch only then."""
        self._decoding += 1
        try:
            yield
        finally:
            self._decoding -= 1

    async def step(self, token: int, cache: list[LayerKV]) -> Step:
        """Feed ``token``, extending ``cache`` in place.

        Returns:
            The next greedy token, how many requests' steps the model step that made it
            held (1 when alone), and how long that model step ran.

        Raises:
            ValueError: the cache already fills the context.
            asyncio.CancelledError: the request was cancelled meanwhile.
        """
        loop = asyncio.get_running_loop()
        if self._decoding <= 1 or self._max_batch <= 1:
            started = time.perf_counter()
            next_token = self._decoder.step(token, cache)
            ran = time.perf_counter() - started
            self.steps += 1
            self.request_steps += 1
            # Let the loop run (arrivals, aborts): after every step when others decode
            # too (they take turns), alone only every ``yield_alone_s``, and then only
            # when it has something to run. A loop turn right after a step costs 3-5% of
            # the step on a small VM (cold caches, a syscall), and a loop with nothing to
            # do gains nothing from it.
            if self._decoding > 1:
                await asyncio.sleep(0)
            elif started + ran - self._yielded >= self._yield_alone_s:
                if loop_has_work(loop):
                    self.yields += 1
                    await asyncio.sleep(0)
                self._yielded = time.perf_counter()
            return Step(next_token, 1, ran)
        future: asyncio.Future[Step] = loop.create_future()
        self._waiting.append((token, cache, future))
        if not self._scheduled:
            self._scheduled = True
            # Behind every task already woken: those about to ask join this batch.
            loop.call_soon(self._run)
        return await future

    def _run(self) -> None:
        """Run one batch of the waiting steps; the next batch waits for a loop turn."""
        waiting = [w for w in self._waiting if not w[2].done()]  # not cancelled meanwhile
        group, rest = waiting[: self._max_batch], waiting[self._max_batch :]
        self._waiting = rest
        self._scheduled = bool(rest)
        if rest:
            asyncio.get_running_loop().call_soon(self._run)
        if not group:
            return
        started = time.perf_counter()
        if len(group) == 1:
            token, cache, future = group[0]
            try:
                tokens = [self._decoder.step(token, cache)]
            except Exception as exc:
                future.set_exception(exc)
                return
        else:
            # A batched step extends the caches layer by layer: kept as they were, so that
            # a failed batch can run again request by request.
            before = [list(w[1]) for w in group]
            try:
                tokens = self._decoder.step_many([w[0] for w in group], [w[1] for w in group])
                self.batches += 1
                self.batched_steps += len(group)
            except Exception:
                # One request's bad cache must fail that request alone, not its batch-mates.
                for (_, cache, _), kept in zip(group, before, strict=True):
                    cache[:] = kept
                self._run_alone(group)
                return
        ran = time.perf_counter() - started
        self.steps += 1
        self.request_steps += len(group)
        for (_, _, future), next_token in zip(group, tokens, strict=True):
            future.set_result(Step(next_token, len(group), ran))

    def _run_alone(self, group: list[_Waiting]) -> None:
        """Each request's step on its own, after a batched step failed: each gets its token
        or its own error."""
        for token, cache, future in group:
            started = time.perf_counter()
            try:
                next_token = self._decoder.step(token, cache)
            except Exception as exc:
                future.set_exception(exc)
                continue
            self.steps += 1
            self.request_steps += 1
            future.set_result(Step(next_token, 1, time.perf_counter() - started))
