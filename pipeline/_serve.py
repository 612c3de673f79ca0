"""A master that serves remote clients: ``stagewire master`` answers ``stagewire submit``.

A client sends :class:`~pipeline._messages.Submit` (the source's input as JSON) to the
master's control endpoint; the master runs the request as an embedded client would
(:meth:`Pipeline.stream`) and answers with an :class:`~pipeline._messages.Output` per
output chunk, as it arrives, then :class:`~pipeline._messages.Finished`. A
:class:`~pipeline._messages.Cancel` aborts the request in every stage. Outputs travel as
JSON, tensors and arrays summarised by dtype and shape: a remote client reads results,
it does not receive tensors (no pickle anywhere).
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import structlog

from pipeline._api import Pipeline, SinkOutput
from pipeline._errors import PayloadError, PipelineError
from pipeline._messages import Cancel, Finished, Output, Submit

__all__ = ("ClientServer", "to_json")

log = structlog.get_logger("stagewire.serve")


def _json_default(obj: Any) -> Any:
    """Summarise what JSON cannot hold (tensors, arrays, bytes) instead of failing."""
    shape = getattr(obj, "shape", None)
    if shape is not None:
        return {"dtype": str(getattr(obj, "dtype", "?")), "shape": list(shape)}
    if isinstance(obj, bytes | bytearray | memoryview):
        return {"bytes": len(obj)}
    raise NotImplementedError(type(obj).__name__)


#: An output as JSON bytes, tensors and arrays summarised.
to_json = msgspec.json.Encoder(enc_hook=_json_default).encode


class ClientServer:
    """Runs remote clients' requests on a started pipeline with one source stage.

    Attributes:
        served: requests that completed.
        failed: requests that failed (bad input included), or were cancelled as the
            master stopped.
        cancelled: requests their clients cancelled.
    """

    def __init__(self, pipe: Pipeline) -> None:
        self._pipe = pipe
        self._master = pipe._master_or_fail()
        sources = pipe.plan.sources
        self._source_type = (
            next(iter(pipe.plan.stages[sources[0]].inputs.values())).payload_type
            if len(sources) == 1
            else None
        )
        self._sinks = pipe.plan.sinks
        self._tasks: dict[tuple[bytes, int], asyncio.Task[None]] = {}
        #: Requests whose client sent Cancel (a task's own cancellation says not who).
        self._by_client: set[tuple[bytes, int]] = set()
        self.served = 0
        self.failed = 0
        self.cancelled = 0

    def install(self) -> None:
        """Take the master's client messages from now on."""
        self._master.on_client = self._on_client

    def _on_client(self, identity: bytes, msg: Submit | Cancel) -> None:
        key = (identity, msg.token)
        if isinstance(msg, Cancel):
            task = self._tasks.get(key)
            if task is not None:
                self._by_client.add(key)
                task.cancel()
            return
        if key in self._tasks:
            return  # a resend of a request already running
        task = asyncio.get_running_loop().create_task(self._serve(identity, msg))
        self._tasks[key] = task
        task.add_done_callback(lambda _: self._tasks.pop(key, None))

    async def _serve(self, identity: bytes, msg: Submit) -> None:
        send = self._master.send_client
        try:
            if self._source_type is None:
                raise PayloadError(
                    f"submit takes one input, but this pipeline has several sources: "
                    f"{self._pipe.plan.sources}"
                )
            try:
                value = msgspec.json.decode(msg.input, type=self._source_type)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                name = getattr(self._source_type, "__name__", str(self._source_type))
                raise PayloadError(f"the input is not a valid {name}: {exc}") from None
            async with self._pipe.stream(value) as stream:
                async for chunk in stream:
                    if isinstance(chunk, SinkOutput):
                        send(identity, Output(msg.token, chunk.stage, to_json(chunk.value)))
                    else:
                        send(identity, Output(msg.token, self._sinks[0], to_json(chunk)))
        except asyncio.CancelledError:
            if (identity, msg.token) in self._by_client:
                self._by_client.discard((identity, msg.token))
                self.cancelled += 1
                why = "cancelled by the client"
            else:
                self.failed += 1
                why = "the master stopped"
            send(identity, Finished(msg.token, "RequestAborted", why))
            raise
        except PipelineError as exc:
            self.failed += 1
            send(identity, Finished(msg.token, type(exc).__name__, str(exc)))
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
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
