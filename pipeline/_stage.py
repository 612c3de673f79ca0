"""What a user writes: a :class:`Stage` subclass with one ``process`` method.

``process`` takes one parameter per input and a :class:`Context`:

- a plain annotation ``T`` receives exactly one chunk;
- ``Stream[T]`` receives ordered chunks while upstream still produces them;
- with several inputs, each parameter is named after its upstream stage.

It returns one value (a single final chunk) or is an async generator (a stream). To send
different payloads to different downstream stages, return or yield an :class:`Outputs`
subclass whose fields are named after those stages; a field left ``None`` sends nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, ClassVar, Generic, TypeVar

import msgspec
import structlog
from pydantic import BaseModel

from pipeline._errors import EndOfChannel
from pipeline._loop import loop_has_work

__all__ = ("NOT_READY", "Context", "Outputs", "Stage", "Stream")

T = TypeVar("T")


#: What a Stream's ``poll`` returns when the next chunk needs waiting for.
NOT_READY: Any = object()


class Stream(Generic[T]):
    """Ordered chunks of one input, consumed while upstream is still producing.

    Iterate it once with ``async for``; iteration ends after the final chunk.
    """

    __slots__ = ("_next", "_poll")

    def __init__(
        self, next_item: Callable[[], Awaitable[T]], poll: Callable[[], Any] | None = None
    ) -> None:
        self._next = next_item
        #: Returns the next chunk's payload when it needs no waiting, else NOT_READY.
        self._poll = poll

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        """The next chunk's payload.

        Raises:
            StopAsyncIteration: the final chunk has been consumed.
            ChunkGap: the next chunk did not arrive within the edge's chunk timeout.
            PayloadError: the chunk did not match the declared type.
            TransportError: the chunk's payload could not be fetched.
        """
        try:
            if self._poll is not None:
                value = self._poll()
                if value is not NOT_READY:
                    return value  # type: ignore[no-any-return]  # the edge's payload type
            return await self._next()
        except EndOfChannel:
            raise StopAsyncIteration from None


class Outputs(msgspec.Struct, kw_only=True):
    """Base for per-destination outputs: one field per downstream stage, named after it.

    Example::

        class PreprocessOut(Outputs):
            encode: Pixels | None = None
            prefill: TokenIds | None = None
    """


class Context:
    """Per-request facts and services handed to ``process``.

    Attributes:
        request_id: the request being processed.
        stage: this stage's name.
        replica: this replica's index.
        log: a structlog logger bound to request_id, stage and replica.
    """

    __slots__ = ("_cancelled", "_log", "replica", "request_id", "stage")

    def __init__(self, request_id: str, stage: str, replica: int) -> None:
        self.request_id = request_id
        self.stage = stage
        self.replica = replica
        self._cancelled = False
        self._log: Any = None

    @property
    def log(self) -> Any:
        """A structlog logger bound to request_id, stage and replica (made on first use)."""
        # Binding costs more than the rest of a request's bookkeeping, and most handlers
        # never log, so it happens only when asked for.
        if self._log is None:
            self._log = structlog.get_logger("stagewire.stage").bind(
                request_id=self.request_id, stage=self.stage, replica=self.replica
            )
        return self._log

    @property
    def cancelled(self) -> bool:
        """Whether the request was aborted; long CPU loops may poll it."""
        return self._cancelled

    def cancel(self) -> None:
        """Mark the request cancelled (the runtime also cancels the handler's task)."""
        self._cancelled = True

    async def checkpoint(self) -> None:
        """Let the event loop run whatever is waiting (other requests, an abort), raising if
        the request was cancelled. A handler calls it between long stretches of work.

        The loop turn is taken only when the loop has something to run: with nothing
        waiting it would only cost time (see :func:`pipeline._loop.loop_has_work`).

        Raises:
            asyncio.CancelledError: the request was aborted.
        """
        if self._cancelled:
            raise asyncio.CancelledError
        if loop_has_work(asyncio.get_running_loop()):
            await asyncio.sleep(0)


class Stage:
    """Base of every stage. Subclasses define ``async def process(self, x, ctx)``.

    Attributes:
        Params: an optional pydantic model validating the spec's ``params``.
        params: the validated params (an instance of ``Params``), or ``None``.
        name: the stage's name in the pipeline.
        replica: this replica's index.
        device: the device from the stage's spec (``cpu``, ``cuda:0``, ...).
    """

    Params: ClassVar[type[BaseModel] | None] = None

    def __init__(self, *, params: Any, name: str, replica: int, device: str) -> None:
        self.params = params
        self.name = name
        self.replica = replica
        self.device = device
        self.log: Any = structlog.get_logger("stagewire.stage").bind(stage=name, replica=replica)

    async def setup(self) -> None:
        """Run once per process before any request, e.g. to load a model.

        Raises:
            Exception: anything raised here fails the pipeline's start with its message.
        """

    async def teardown(self) -> None:
        """Run once per process at shutdown.

        Raises:
            Exception: anything raised here is logged; shutdown goes on.
        """

    def statistics(self) -> Mapping[str, int | float]:
        """The stage's own counters, shown in ``stagewire run``'s table and in
        ``Pipeline.statistics()`` under ``counters``; none by default.

        It is called from the event loop whenever statistics are asked for, so it must be
        cheap and must not block.
        """
        return {}
