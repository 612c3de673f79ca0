"""A master that serves remote clients: ``stagewire submit`` and :meth:`Pipeline.connect`.

A client sends :class:`~pipeline._messages.Submit` (the source's input) to the master's
control endpoint; the master runs the request as an embedded client would
(:meth:`Pipeline.stream`) and answers with an :class:`~pipeline._messages.Output` per
output chunk, as it arrives, then :class:`~pipeline._messages.Finished`. A
:class:`~pipeline._messages.Cancel` aborts the request in every stage.

The input and every output are encoded by the payload codec, tensors and arrays as
out-of-band buffers carried in the same message, so the client
(:class:`~pipeline.RemotePipeline`, which ``stagewire submit`` uses too) gets typed values
(Structs holding tensors). A client first says :class:`~pipeline._messages.Hello` and is
answered :class:`~pipeline._messages.Welcome` (the pipeline's sources, sinks and payload
types, by import path), and it learns each request's id
(:class:`~pipeline._messages.Started`).

Nothing is ever pickled; a payload too large for one control message fails its request
with a :class:`PayloadError` instead of being dropped.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from typing import Any, cast

import structlog

from pipeline._api import Pipeline, SinkOutput
from pipeline._codec import PayloadCodec, codec_for
from pipeline._encoded import Encoded, to_host
from pipeline._errors import (
    MASTER_STAGE,
    FailureInfo,
    PayloadError,
    PipelineError,
    describe_failure,
)
from pipeline._keys import CLIENT
from pipeline._messages import (
    REMOTE_WINDOW_BYTES,
    WIRE_CODEC,
    Alive,
    Cancel,
    Finished,
    FromClient,
    Grant,
    Hello,
    Output,
    Started,
    StatsAnswer,
    StatsAsk,
    Submit,
    Welcome,
    check_client_payload,
)
from pipeline._remote_stream import output_size
from pipeline._type_paths import type_path

__all__ = ("CLIENT_CHECK_S", "ClientServer")

#: How often the master checks that the clients with requests in flight are still there.
CLIENT_CHECK_S = 2.0

log = structlog.get_logger("stagewire.serve")


class _Sent:
    """The sizes of one request's outputs sent to its client and perhaps not yet read.

    A grant of ``allowed`` means the client had read at least ``allowed - window`` (it
    grants a window past what it read)."""

    __slots__ = ("acked", "bytes", "sizes", "window")

    def __init__(self, window: int) -> None:
        self.window = window
        self.sizes: deque[int] = deque()
        #: Outputs known read (those before ``sizes``), and the bytes of ``sizes``.
        self.acked = 0
        self.bytes = 0

    def sent(self, nbytes: int) -> None:
        self.sizes.append(nbytes)
        self.bytes += nbytes

    def full(self, allowed: int) -> bool:
        """Whether the bytes out, past what the client has read, fill the byte window
        (one output always goes)."""
        read = allowed - self.window
        while self.acked < read and self.sizes:
            self.bytes -= self.sizes.popleft()
            self.acked += 1
        return bool(self.sizes) and self.bytes >= REMOTE_WINDOW_BYTES


class ClientServer:
    """Runs remote clients' requests on a started pipeline with one source stage.

    Attributes:
        served: requests that completed.
        failed: requests that failed (bad input included), or were cancelled as the
            master stopped.
        cancelled: requests their clients cancelled.
        abandoned: requests cancelled because their client went away without a word
            (killed, or its connection lost): noticed at the next output sent to it, or
            within :data:`CLIENT_CHECK_S` by an :class:`Alive` that cannot be delivered.
    """

    def __init__(self, pipe: Pipeline) -> None:
        self._pipe = pipe
        self._master = pipe._master_or_fail()
        plan = pipe.plan
        sources = plan.sources
        self._source_type = (
            next(iter(plan.stages[sources[0]].inputs.values())).payload_type
            if len(sources) == 1
            else None
        )
        self._sinks = plan.sinks
        sink_types = {sink: plan.stages[sink].outputs[CLIENT].payload_type for sink in self._sinks}
        self._codecs: dict[str, PayloadCodec[Any]] = {
            sink: codec_for(tp) for sink, tp in sink_types.items()
        }
        self._welcome = Welcome(
            pipe.spec.name,
            list(sources),
            list(self._sinks),
            type_path(self._source_type),
            {sink: type_path(tp) for sink, tp in sink_types.items()},
            os.urandom(8).hex(),
            pipe.spec.defaults.request_timeout or 0.0,
        )
        self._tasks: dict[tuple[bytes, int], asyncio.Task[None]] = {}
        #: Requests whose client sent Cancel (a task's own cancellation says not who).
        self._by_client: set[tuple[bytes, int]] = set()
        #: Requests whose client is no longer connected.
        self._gone: set[tuple[bytes, int]] = set()
        #: Outputs each flow-controlled request may send in all, as its client granted.
        self._allowed: dict[tuple[bytes, int], int] = {}
        #: The sizes of each windowed request's outputs the client may not have read.
        self._windows: dict[tuple[bytes, int], _Sent] = {}
        #: Set when a client grants more; cleared by the request that waits on it.
        self._more: dict[tuple[bytes, int], asyncio.Event] = {}
        self._checker: asyncio.Task[None] | None = None
        #: Statistics being gathered for clients (from every replica: a moment).
        self._asked: set[asyncio.Task[None]] = set()
        #: Requests whose task has begun to run (one cancelled before cannot count itself).
        self._entered: set[tuple[bytes, int]] = set()
        self.served = 0
        self.failed = 0
        self.cancelled = 0
        self.abandoned = 0

    def install(self) -> None:
        """Take the master's client messages from now on."""
        self._master.on_client = self._on_client
        self._checker = asyncio.get_running_loop().create_task(self._check_clients())

    async def _check_clients(self) -> None:
        """Every :data:`CLIENT_CHECK_S`, find the clients with requests in flight that went
        away: a request that sends nothing for a while (a stalled stage, a long prefill)
        would otherwise run on for a client nobody is."""
        while True:
            await asyncio.sleep(CLIENT_CHECK_S)
            for identity in {identity for identity, _ in self._tasks}:
                if not self._master.send_client(identity, Alive()):
                    self._client_gone(identity)

    def _client_gone(self, identity: bytes) -> None:
        """Cancel every request of a client that is no longer connected."""
        keys = [key for key in self._tasks if key[0] == identity and key not in self._gone]
        if not keys:
            return
        log.warning("client_gone", requests=len(keys), identity=identity.hex())
        for key in keys:
            self._gone.add(key)
            self._tasks[key].cancel()

    def _on_client(self, identity: bytes, msg: FromClient) -> None:
        if isinstance(msg, Hello):
            self._master.send_client(identity, self._welcome)
            return
        if isinstance(msg, StatsAsk):
            asking = asyncio.get_running_loop().create_task(self._answer_stats(identity, msg))
            self._asked.add(asking)
            asking.add_done_callback(self._asked.discard)
            return
        key = (identity, msg.token)
        if isinstance(msg, Grant):
            if key in self._allowed:
                self._allowed[key] = max(self._allowed[key], msg.allowed)
                self._more[key].set()
            return
        if isinstance(msg, Cancel):
            task = self._tasks.get(key)
            if task is not None:
                self._by_client.add(key)
                if key not in self._entered:
                    # Cancelled before its first step (the Cancel came in the same read as
                    # its Submit): _serve never runs to count it.
                    self.cancelled += 1
                task.cancel()
            return
        if key in self._tasks:
            return  # a resend of a request already running
        if msg.window > 0:
            self._allowed[key] = msg.window
            self._windows[key] = _Sent(msg.window)
            self._more[key] = asyncio.Event()
        task = asyncio.get_running_loop().create_task(self._serve(identity, msg))
        self._tasks[key] = task
        task.add_done_callback(lambda _: self._forget(key))

    def _forget(self, key: tuple[bytes, int]) -> None:
        self._tasks.pop(key, None)
        self._allowed.pop(key, None)
        self._windows.pop(key, None)
        self._more.pop(key, None)
        self._gone.discard(key)
        self._by_client.discard(key)
        self._entered.discard(key)

    def _input(self, msg: Submit) -> Any:
        """The request's input, decoded as the source stage's type.

        Raises:
            PayloadError: it does not match that type, or the wire form is unknown.
        """
        tp = self._source_type
        if tp is None:
            raise PayloadError(
                f"submit takes one input, but this pipeline has several sources: "
                f"{self._pipe.plan.sources}"
            )
        if msg.wire != WIRE_CODEC:
            raise PayloadError(
                f"unknown wire form {msg.wire!r}: this master takes {WIRE_CODEC!r}; "
                "upgrade it or the client to the same stagewire"
            )
        return codec_for(tp).decode(Encoded(msg.input, tuple(msg.buffers)))

    def _output(self, token: int, sink: str, value: Any) -> Output:
        """One output chunk, encoded by the sink's codec.

        Raises:
            PayloadError: it cannot be encoded, or it is too large for one control message.
        """
        encoded = to_host(self._codecs[sink].encode(value))
        check_client_payload(encoded, f"an output of stage {sink!r}")
        # msgspec writes any buffer (a memoryview of a tensor's memory, here) as bytes,
        # which is what the field's bytearray decodes from.
        return Output(token, sink, encoded.header, cast("list[bytearray]", list(encoded.buffers)))

    async def _answer_stats(self, identity: bytes, msg: StatsAsk) -> None:
        stats = await self._pipe.statistics()
        self._master.send_client(identity, StatsAnswer(msg.token, stats))

    async def _credit(self, key: tuple[bytes, int], sent: int) -> None:
        """Wait until the request's client has granted more than ``sent`` outputs, and, of
        those it may not have read yet, fewer than :data:`REMOTE_WINDOW_BYTES` bytes are
        out (at once for a request without a window)."""
        while True:
            allowed = self._allowed.get(key)
            if allowed is None:
                return
            window = self._windows[key]
            if sent < allowed and not window.full(allowed):
                return
            more = self._more[key]
            more.clear()
            await more.wait()

    async def _serve(self, identity: bytes, msg: Submit) -> None:
        key = (identity, msg.token)
        self._entered.add(key)
        request_id = ""

        def send(identity: bytes, answer: Output | Started | Finished) -> None:
            delivered = self._master.send_client(identity, answer)
            if not delivered and not isinstance(answer, Finished):
                self._client_gone(identity)

        try:
            value = self._input(msg)
            async with self._pipe.stream(value) as stream:
                request_id = stream.request_id or ""
                send(identity, Started(msg.token, request_id))
                sent = 0
                async for chunk in stream:
                    # A client that reads slowly holds the request here, and so, through
                    # the pipeline's own windows, its stages: nothing piles up for it.
                    await self._credit(key, sent)
                    if isinstance(chunk, SinkOutput):
                        output = self._output(msg.token, chunk.stage, chunk.value)
                    else:
                        output = self._output(msg.token, self._sinks[0], chunk)
                    window = self._windows.get(key)
                    if window is not None:
                        window.sent(output_size(output))
                    send(identity, output)
                    sent += 1
        except asyncio.CancelledError:
            if (identity, msg.token) in self._gone:
                self._gone.discard((identity, msg.token))
                self.abandoned += 1
                raise  # nobody to tell
            if (identity, msg.token) in self._by_client:
                self._by_client.discard((identity, msg.token))
                self.cancelled += 1
                why = "cancelled by the client"
                failure = FailureInfo("aborted", why, request_id or "(not started)")
                send(identity, Finished(msg.token, "RequestAborted", why, failure))
                raise
            # The master stops (or its request task was cancelled with it): the client gets
            # what a master killed gives, MasterUnavailable, which it rebuilds from the stage.
            self.failed += 1
            why = (
                "the master stopped while the request was in flight; submit it again once it serves"
            )
            failure = FailureInfo("unavailable", why, request_id, MASTER_STAGE)
            send(identity, Finished(msg.token, "MasterUnavailable", why, failure))
            raise
        except PipelineError as exc:
            self.failed += 1
            send(identity, Finished(msg.token, type(exc).__name__, str(exc), describe_failure(exc)))
            return
        except Exception as exc:  # a bug here must still answer the client, not strand it
            self.failed += 1
            log.exception("submission_failed", token=msg.token)
            send(identity, Finished(msg.token, type(exc).__name__, f"the master failed: {exc}"))
            return
        self.served += 1
        send(identity, Finished(msg.token))

    async def aclose(self) -> None:
        """Cancel the requests still running (their clients are told) and stop taking new
        ones.

        Raises:
            Nothing.
        """
        self._master.on_client = None
        if self._checker is not None:
            self._checker.cancel()
            await asyncio.gather(self._checker, return_exceptions=True)
        tasks = [*self._tasks.values(), *self._asked]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
