"""The outputs of one request to a remote master, as :meth:`RemotePipeline.stream` gives them.

:class:`RemotePipeline` files each answer of the master (``Started``, ``Output``,
``Finished``) in its request's :class:`Call`, in order; :class:`RemoteResponseStream` reads
them, decodes each output and raises each failure as the embedded API does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

from pipeline._errors import (
    MASTER_STAGE,
    ConfigError,
    MasterUnavailable,
    PayloadError,
    PipelineError,
    RequestAborted,
    TransportError,
    failure_to_error,
)
from pipeline._messages import Finished, Output, Started, Submit

if TYPE_CHECKING:
    from pipeline._remote import RemotePipeline

__all__ = ("Call", "RemoteResponseStream", "error_of")


def error_of(fin: Finished, endpoint: str) -> PipelineError:
    """The exception a failed request's ``Finished`` describes, as the embedded API raises it;
    a failure of the master itself (at ``endpoint``) is a :class:`MasterUnavailable`."""
    failure = fin.failure
    if failure is not None:
        if failure.kind == "unavailable" and failure.stage == MASTER_STAGE:
            return MasterUnavailable(
                endpoint, failure.message, request_id=failure.request_id or None
            )
        return failure_to_error(failure)
    simple: dict[str, type[PipelineError]] = {
        "PipelineError": PipelineError,
        "ConfigError": ConfigError,
        "PayloadError": PayloadError,
        "TransportError": TransportError,
    }
    kind = simple.get(fin.kind)
    if kind is not None:
        return kind(fin.error)
    if fin.kind == "RequestAborted":
        return RequestAborted("(unknown)", fin.error)
    return PipelineError(f"{fin.kind}: {fin.error}")


def output_size(msg: Output) -> int:
    """The payload bytes of one output message, as both ends of the link count them."""
    return len(msg.value) + sum(len(b) for b in msg.buffers)


@dataclass(slots=True, eq=False)
class Call:
    """One request in flight: the master's answers, waiting to be read in order."""

    token: int
    #: Loop time the request was sent: it may wait ``timeout`` from then for a first word.
    #: While it is held, the time it was made: it may wait ``timeout`` for a master.
    sent_at: float
    #: Loop time past which the client gives up on it (the pipeline's request_timeout).
    deadline: float | None
    queue: asyncio.Queue[Started | Output | Finished | PipelineError] = field(
        default_factory=asyncio.Queue
    )
    request_id: str | None = None
    #: Its Submit, while it waits unsent for a master to welcome the client again.
    held: Submit | None = None
    #: Outputs read by the client so far, and how many the master may send in all.
    read: int = 0
    granted: int = 0
    #: Payload bytes read since the last grant.
    read_bytes: int = 0


class RemoteResponseStream:
    """The outputs of one remote request, in order; leaving early aborts it everywhere.

    Use as ``async for chunk in pipe.stream(x)``, or as an async context manager to read
    :attr:`request_id` before the first chunk.
    """

    def __init__(self, pipe: RemotePipeline, value: Any) -> None:
        self._pipe = pipe
        self._value = value
        self._call: Call | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: The master ended the request (completed or failed), or it was given up here.
        self._ended = False
        #: An answer taken from the queue by ``start`` that the iteration must see first.
        self._held: Started | Output | Finished | PipelineError | None = None

    def __del__(self) -> None:
        # Dropped unfinished (a ``break`` out of ``async for``): nothing else would end the
        # request, which holds a slot and state in every stage of the master's pipeline.
        if self._ended or self._call is None or self._loop is None or self._loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            self._loop.call_soon_threadsafe(
                self._pipe._give_up, self._call, "abandoned by the client"
            )

    @property
    def request_id(self) -> str | None:
        """The request's id at the master, once it has started there."""
        return self._call.request_id if self._call else None

    def _submit(self) -> Call:
        if self._call is None:
            self._loop = asyncio.get_running_loop()
            self._call = self._pipe._submit(self._value)
        return self._call

    async def start(self) -> str:
        """Submit the request now and wait until the master has admitted it; returns its id.

        Raises:
            PayloadError: the input does not match the source stage's type, or is too large
                for one message to the master.
            StageUnavailable: a stage had no ready replica for ``replica_wait``.
            MasterUnavailable: the master did not answer within ``timeout``, stopped, or is
                not serving yet (starting); or the request could not be sent.
            RequestAborted: the request was aborted, or the client closed.
            RequestTimeout: the request passed its deadline before it was admitted.
            PipelineError: the master answered out of turn (a request it had not admitted).
            RuntimeError: the client is not connected.
        """
        call = self._submit()
        while call.request_id is None:
            try:
                item = await call.queue.get()
            except BaseException:
                await self.aclose()
                raise
            if isinstance(item, Started):
                continue  # its id is recorded already
            # The request ended before it was admitted (a bad input, no replica): the
            # iteration raises its error.
            self._held = item
            with contextlib.suppress(StopAsyncIteration):
                await self.__anext__()
            await self.aclose()
            raise PipelineError(
                f"the master at {self._pipe.endpoint} answered a request it had not admitted"
            )
        return call.request_id

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        """The next output chunk.

        Raises:
            StopAsyncIteration: every sink sent its final chunk.
            StageError: a stage raised for this request.
            StageUnavailable: a replica bound to this request died.
            MasterUnavailable: the master stopped answering, stopped, restarted or is not
                serving yet; or the request could not be sent.
            ChunkGap: a chunk went missing past ``chunk_timeout``.
            PayloadError: a payload did not match its declared type.
            RequestTimeout: the request passed its deadline.
            RequestAborted: the request was aborted, or the client closed.
        """
        if self._ended:
            raise StopAsyncIteration
        call = self._submit()
        try:
            while True:
                item, self._held = self._held, None
                if item is None:
                    item = await call.queue.get()
                if isinstance(item, Started):
                    continue
                if isinstance(item, Output):
                    self._pipe._read_one(call, output_size(item))
                    return self._pipe._decode_output(item)
                self._ended = True
                if isinstance(item, PipelineError):
                    raise item
                if not item.kind:
                    raise StopAsyncIteration
                raise error_of(item, self._pipe.endpoint)
        except StopAsyncIteration:
            raise
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """Abort the request at the master if it has not ended; idempotent.

        Raises:
            Nothing: aborting an ended request does nothing.
        """
        if not self._ended and self._call is not None:
            self._pipe._give_up(self._call, "cancelled by the client")
        self._ended = True

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
