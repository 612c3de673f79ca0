"""The embedding API: ``async with Pipeline(spec) as pipe: await pipe.submit(x)``.

An embedded pipeline runs the master in the caller's event loop and starts one local
worker process per stage replica, through the same entry point as ``stagewire worker``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import structlog

from pipeline._codec import resolve_device
from pipeline._config import PipelineSpec
from pipeline._document import YamlDocument
from pipeline._errors import ConfigError, EndOfChannel, PayloadError, RequestAborted
from pipeline._host import on_this_host
from pipeline._launcher import LocalLauncher
from pipeline._lifecycle import LoopBound, LoopWatch
from pipeline._logging import configure_logging
from pipeline._master import Master
from pipeline._orchestrator import ClientRequest
from pipeline._security import resolve_keys
from pipeline._signature import PipelinePlan, build_plan
from pipeline._yaml import read_yaml_file

if TYPE_CHECKING:
    from pipeline._remote import RemotePipeline

__all__ = ("Pipeline", "ResponseStream", "SinkOutput")

log = structlog.get_logger("stagewire.pipeline")


class SinkOutput:
    """One output chunk of a pipeline with several sinks: which sink, and its payload."""

    __slots__ = ("stage", "value")

    def __init__(self, stage: str, value: Any) -> None:
        self.stage = stage
        self.value = value

    def __repr__(self) -> str:
        return f"SinkOutput({self.stage!r}, {self.value!r})"


#: How long a stream dropped unfinished waits for the rest of its request before aborting
#: it (see ResponseStream.__del__).
ABANDON_GRACE_S = 0.05


def _admitted(starting: asyncio.Future[ClientRequest]) -> bool:
    """Whether ``starting`` (an ``Orchestrator.start``) admitted its request."""
    return starting.done() and not starting.cancelled() and starting.exception() is None


class ResponseStream:
    """The outputs of one request, in order; leaving early aborts the request everywhere.

    Use as ``async for chunk in pipe.stream(x)``, or as an async context manager to read
    :attr:`request_id` before the first chunk.
    """

    def __init__(self, pipe: Pipeline, inputs: dict[str, Any]) -> None:
        self._pipe = pipe
        self._inputs = inputs
        self._req: ClientRequest | None = None
        self._starting: asyncio.Future[ClientRequest] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done = False
        #: A task is in ``__anext__``: a second one at once is refused.
        self._reading = False

    def __del__(self) -> None:
        # Dropped unfinished (a ``break`` out of ``async for``, or never read to the end):
        # nothing else would end the request, which holds a slot and state in every stage.
        if self._done or self._req is None or self._loop is None:
            return
        master = self._pipe._master
        if master is None or self._loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            # A moment's grace: left right after its last chunk, the end of the stream (a
            # message of its own when the stage flushed that chunk at once) is on its way,
            # and the request is complete, not abandoned.
            self._loop.call_soon_threadsafe(
                self._loop.call_later, ABANDON_GRACE_S, master.orch.abandon, self._req.request_id
            )

    @property
    def request_id(self) -> str | None:
        """The request's id once started."""
        return self._req.request_id if self._req else None

    async def start(self) -> str:
        """Submit the request now; returns its id.

        Raises:
            PayloadError: the input does not match the source stage's type.
            StageUnavailable: a stage had no ready replica for ``replica_wait``.
            RequestTimeout: the request's deadline passed while it waited for admission.
            RequestAborted: the pipeline or the stream closed while the request waited for
                admission, or another caller of ``start`` on this stream was cancelled
                meanwhile (which withdraws it).
            TransportError: the input could not be sent to its source stage.
            RuntimeError: the pipeline is not running, or runs on another event loop.
        """
        if self._req is None:
            if self._done:
                # Closed before it started: it never will (nothing would end it).
                raise RequestAborted("(not started)", "the stream was closed")
            if self._starting is None:
                # One submission, however many callers (start() while iterating begins):
                # a second would be a request nobody reads, held in every stage for ever.
                self._loop = asyncio.get_running_loop()
                self._starting = asyncio.ensure_future(
                    self._pipe._master_here().orch.start(self._inputs)
                )
            starting = self._starting
            try:
                # Not shielded: a caller cancelled while the request waits for admission
                # withdraws it, as before (any other caller then sees the cancellation).
                req = await starting
            except BaseException:
                if self._req is None and _admitted(starting):
                    # Admitted in the turn this caller was cancelled in: kept, so that
                    # closing or dropping the stream ends it (it would hold its slot and
                    # its state in every stage for ever).
                    self._req = starting.result()
                elif starting.done() and self._starting is starting:
                    self._starting = None  # a later start() tries again
                task = asyncio.current_task()
                if starting.cancelled() and not (task and task.cancelling()):
                    # Not this caller's cancellation: aclose(), or another caller's, withdrew
                    # the request (a bare CancelledError would end this caller's task as if
                    # it had been cancelled, silently inside a TaskGroup).
                    why = (
                        "the stream was closed"
                        if self._closed()
                        else "another caller of start() on this stream was cancelled while "
                        "the request waited for admission, which withdrew it"
                    )
                    raise RequestAborted("(not started)", why) from None
                raise
            if self._req is None:
                self._req = req
        return self._req.request_id

    def _closed(self) -> bool:
        """Whether the stream was closed (read anew: an await may have passed)."""
        return self._done

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        """The next output chunk.

        Raises:
            StopAsyncIteration: every sink sent its final chunk.
            StageError: a stage raised for this request.
            StageUnavailable: a replica bound to this request died.
            ChunkGap: a chunk went missing past ``chunk_timeout``.
            PayloadError: a payload did not match its declared type.
            RequestTimeout: the request passed its deadline.
            RequestAborted: the request was aborted, or the pipeline closed.
            RuntimeError: the pipeline is not running, or runs on another event loop; or
                another task is reading this stream now (the request goes on).
        """
        if self._done:
            raise StopAsyncIteration
        if self._reading:
            # Each chunk goes to one reader: two at once would split the stream between
            # them (and used to fail the request with a bare KeyError).
            raise RuntimeError(
                "another task is reading this stream: read a request's stream from one "
                "task at a time (share its chunks from there if several need them)"
            )
        self._reading = True
        try:
            return await self._next()
        finally:
            self._reading = False

    async def _next(self) -> Any:
        if self._req is None:
            await self.start()
            assert self._req is not None
        if self._pipe._master is None:
            # Closed since the request started: it was aborted with everything in flight.
            self._done = True
            raise RequestAborted(self._req.request_id, "the pipeline was closed")
        orch = self._pipe._master_here().orch
        try:
            sink, value = await orch.next_output(self._req)
        except EndOfChannel:
            self._done = True
            raise StopAsyncIteration from None
        except BaseException:
            self._done = True
            await self.aclose()
            raise
        if orch.several_sinks:
            return SinkOutput(sink, value)
        return value

    async def aclose(self) -> None:
        """Abort the request if it has not finished; idempotent.

        Raises:
            Nothing: aborting a finished request does nothing.
        """
        self._done = True
        starting = self._starting
        if self._req is None and starting is not None:
            if _admitted(starting):
                self._req = starting.result()
            else:
                starting.cancel()  # still waiting for admission: it never starts
        if self._req is not None and self._pipe._master is not None:
            self._pipe._master.orch.abort(self._req.request_id, "cancelled by client")

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Pipeline(LoopBound):
    """A running pipeline: an embedded master plus one worker process per replica."""

    _what = "pipeline"

    def __init__(
        self,
        spec: PipelineSpec | Mapping[str, Any],
        *,
        device: str | None = None,
        source: str | None = None,
        _document: YamlDocument | None = None,
    ):
        """Check the spec and every edge's types; starts nothing.

        Args:
            spec: the pipeline, as a :class:`PipelineSpec` or the mapping a YAML file holds.
            device: where the outputs' tensors land, as ``torch.load``'s ``map_location``
                (``"cpu"``, ``"cuda:1"``; see :meth:`connect`). Default: the device each
                was sent from.
            source: the file ``spec`` was read from, named in errors.

        Raises:
            ConfigError: the spec is invalid, an edge's types do not match, or ``device``
                names no device this process can use.
        """
        self.spec = spec if isinstance(spec, PipelineSpec) else PipelineSpec.from_dict(spec)
        self.plan: PipelinePlan = build_plan(self.spec, source=source, document=_document)
        #: Where the outputs' tensors land (None: the device each was sent from).
        self.device = None if device is None else resolve_device(device)
        self._master: Master | None = None
        self._launcher: LocalLauncher | None = None
        #: Closes the pipeline should its loop close with it open (see _abandoned).
        self._watch: LoopWatch | None = None
        #: Serialises _close_now: the watch's thread and another loop's aclose may both call.
        self._now_lock = threading.Lock()
        #: Whether the latest start completed: workers then get a grace period on close.
        self._ready = False
        #: Whether a close began since the latest start.
        self._closed = False
        #: Whether remote clients will be served (``stagewire master``): until then their
        #: messages wait unanswered instead of being refused.
        self._serves_clients = False
        #: Where the launched workers' stdout goes, as a descriptor (None: this process's
        #: stdout). ``stagewire run`` sends it to stderr: its stdout is the outputs'.
        self._worker_stdout: int | None = None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], *, device: str | None = None) -> Pipeline:
        """Load, validate and type-check a YAML pipeline; starts nothing. ``device``: as
        for :class:`Pipeline`.

        Raises:
            ConfigError: naming the file, field and line; or ``device`` names no device
                this process can use.
        """
        document = read_yaml_file(path)
        # The document goes along so that errors found building the plan name their line.
        spec = PipelineSpec.from_document(document)
        if spec.master.keys is not None:
            # A key pair that is not there is the file's error, named where it is written.
            try:
                resolve_keys(spec.master.keys)
            except ConfigError as exc:
                raise ConfigError(
                    exc.message,
                    file=os.fspath(path),
                    path="master.keys",
                    line=document.line_of(("master", "keys"), key=True),
                ) from None
        return cls(spec, device=device, source=os.fspath(path), _document=document)

    @classmethod
    def connect(
        cls,
        endpoint: str,
        *,
        timeout: float = 10.0,
        keys: str | os.PathLike[str] | None = None,
        device: str | None = None,
    ) -> RemotePipeline:
        """A client of the pipeline a remote master serves (``stagewire master``), with this
        class's calls; connects on ``async with`` (or ``start``).

        Args:
            endpoint: the master's control endpoint, such as ``tcp://10.0.0.5:7600``.
            timeout: seconds to wait for the master's answer, on connecting and whenever it
                goes quiet while requests are in flight.
            keys: the directory of the pipeline's CURVE key pair (``stagewire keys``), for a
                master that runs with one; default: ``STAGEWIRE_KEYS``, if set. A master
                that refuses the handshake fails ``start`` at once with MasterUnavailable.
            device: where output tensors land, as ``torch.load``'s ``map_location``:
                ``"cpu"`` on a host without the GPU the sinks' tensors were made on,
                ``"cuda:1"`` for another GPU of this one. Each tensor sent from another
                device is rebuilt there from its bytes. Default: the device it was sent from.

        Raises:
            ConfigError: ``timeout`` is not positive, ``keys`` names no valid key pair, or
                ``device`` names no device this process can use (checked here, before
                connecting).
        """
        # Imported here: the remote client builds on this module (SinkOutput).
        from pipeline._remote import RemotePipeline

        return RemotePipeline(endpoint, timeout=timeout, keys=keys, device=device)

    def _master_or_fail(self) -> Master:
        master = self._master
        if master is None:
            if self._closed:
                raise RuntimeError(
                    "the pipeline is closed (or closing): start it again with "
                    "'async with pipe', or build a new Pipeline"
                )
            raise RuntimeError("the pipeline is not running: use 'async with Pipeline(...)'")
        return master

    def _master_here(self) -> Master:
        """The master, for a coroutine: refused on another event loop than the one the
        pipeline was started on, which its master's tasks and sockets belong to."""
        self._check_here()  # first: a pipeline whose loop closed was closed with it
        return self._master_or_fail()

    @property
    def master_endpoint(self) -> str:
        """The control endpoint workers register with."""
        return self._master_or_fail().endpoint

    @property
    def worker_pids(self) -> dict[tuple[str, int], int]:
        """Pids of the local worker processes still running, by (stage, replica)."""
        return self._launcher.pids if self._launcher else {}

    def waiting_for(self) -> list[str]:
        """The replicas expected but not yet ready, as ``stage[k]`` (empty once started)."""
        return self._master_or_fail().waiting_for()

    @property
    def data_endpoints(self) -> dict[tuple[str, int], str]:
        """Where each registered replica receives data, by (stage, replica)."""
        master = self._master_or_fail()
        return {key: rep.endpoint for key, rep in master.replicas.items() if rep.alive}

    async def start(
        self, *, launch: bool = True, on_listening: Callable[[str], None] | None = None
    ) -> None:
        """Start the master and (unless ``launch`` is false) every local worker.

        Args:
            launch: start every replica here; when false, the workers are started elsewhere
                (``stagewire worker --master ENDPOINT --stage NAME``, on this host or
                others) and this waits for them to register.
            on_listening: called with the master's control endpoint as soon as it is bound,
                before waiting for any worker (to tell external workers where to connect).

        Raises:
            ConfigError: ``master.keys`` (or ``STAGEWIRE_KEYS``) names no valid key pair.
            StageUnavailable: replicas did not become ready within ``startup_timeout``.
            PipelineError: a stage failed to import or set up, or the master cannot bind.
            RuntimeError: the pipeline is already running, or still closing.
        """
        if self._still_closing:
            raise RuntimeError("the pipeline is still closing: await 'pipe.aclose()' first")
        if self._master is not None or self._launcher is not None:
            raise RuntimeError(
                "the pipeline is already running: enter 'async with pipe' once, or close it "
                "before starting it again"
            )
        if not structlog.is_configured():
            configure_logging()
        self._bind()
        self._ready = self._closed = False
        keys = resolve_keys(self.spec.master.keys)
        master = self._master = Master(
            self.plan, keys=keys, serves_clients=self._serves_clients, device=self.device
        )
        self._watch = LoopWatch(
            asyncio.get_running_loop(), self.spec.defaults.heartbeat_interval, self._abandoned
        )
        try:
            await master.start()
            if on_listening is not None:
                on_listening(master.endpoint)
        except BaseException:
            await self.aclose()  # its sockets and context, bound or not
            raise
        launcher = None
        if launch:

            def lost(stage: str, replica: int, code: int, pid: int) -> None:
                if self._master is master:  # not once it is closing
                    master.replica_lost(stage, replica, f"exited with code {code}", pid)

            def given_up(stage: str, replica: int) -> None:
                if self._master is master:
                    master.orch.replica_given_up(stage, replica)

            def held_by_another(stage: str, replica: int, pid: int) -> bool:
                return self._master is master and master.held_by_another(stage, replica, pid)

            # Workers launched here reach a master bound to every interface at loopback
            # (the wildcard is no address to connect to).
            self._launcher = launcher = LocalLauncher(
                self.spec,
                on_this_host(master.endpoint),
                lost,
                on_given_up=given_up,
                held_by_another=held_by_another,
                keys=keys,
                worker_stdout=self._worker_stdout,
            )
            # A worker declared dead for silence is ended, so that its slot is restarted.
            master.on_silent = launcher.kill_hung
            master.on_ready = launcher.became_ready
        try:
            if launcher is not None:
                await launcher.start_all()
            # Raises PipelineError if the pipeline is closed meanwhile.
            await master.wait_ready(self.spec.defaults.startup_timeout)
            if launcher is not None:
                launcher.supervise = True
            self._ready = True
        except BaseException:
            await self.aclose()
            raise

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _inputs(self, value: Any) -> dict[str, Any]:
        sources = self.plan.sources
        if len(sources) == 1:
            return {sources[0]: value}
        if not isinstance(value, Mapping) or set(value) != set(sources):
            raise PayloadError(f"this pipeline has several sources; pass a dict keyed {sources}")
        return dict(value)

    def stream(self, value: Any) -> ResponseStream:
        """Submit ``value`` and iterate over every sink chunk, in order."""
        return ResponseStream(self, self._inputs(value))

    async def submit(self, value: Any) -> Any:
        """Submit ``value`` and return the final sink output (a dict per sink if several).

        Raises:
            StageError: a stage raised for this request.
            StageUnavailable: a replica bound to this request died, or a stage had no
                ready replica for ``replica_wait``.
            ChunkGap: a chunk went missing past ``chunk_timeout``.
            PayloadError: the input or a payload did not match its declared type.
            RequestTimeout: the request passed its deadline.
            RequestAborted: the request was aborted.
            RuntimeError: the pipeline is not running, or runs on another event loop.
        """
        last: dict[str, Any] = {}
        stream = self.stream(value)
        try:
            async for chunk in stream:
                if isinstance(chunk, SinkOutput):
                    last[chunk.stage] = chunk.value
                else:
                    last[self.plan.sinks[0]] = chunk
        finally:
            await stream.aclose()
        if len(self.plan.sinks) == 1:
            return last.get(self.plan.sinks[0])
        return last

    async def abort(self, request_id: str, reason: str = "aborted by client") -> bool:
        """Cancel a request in every stage; False if it had already ended.

        Raises:
            RuntimeError: the pipeline is not running, or runs on another event loop.
        """
        return self._master_here().orch.abort(request_id, reason)

    async def statistics(self) -> dict[str, Any]:
        """Counters of the client side and of every replica (asks each worker).

        Replicas that do not answer within a few seconds (or are not ready: restarting,
        say) are left out of ``replicas``, and named in ``unanswered`` (``"stage[k]"``), so
        that figures summed over the replicas are not taken for the whole pipeline's.

        Raises:
            RuntimeError: the pipeline is not running, or runs on another event loop.
        """
        master = self._master_here()
        replicas = await master.collect_statistics()
        answered = {(r["stage"], r["replica"]) for r in replicas}
        return {
            "client": master.orch.statistics(),
            "replicas": replicas,
            "unanswered": [f"{s}[{k}]" for s, k in sorted(master.expected - answered)],
            "garbage": master.garbage + (master.local.garbage_count if master.local else 0),
            "local_frames": master.local.frames if master.local else 0,
            "dropped_sends": master.outbox.dropped,
        }

    async def aclose(self) -> None:
        """Shut every worker down and stop the master; idempotent.

        Workers get a grace period (none if the pipeline never finished starting), then
        SIGTERM, then SIGKILL. Callers at once all wait for the one close. A caller cancelled
        meanwhile leaves the close running; cancelled itself, it kills the workers at once.
        From another event loop it closes the pipeline on its own loop, or, if that loop
        has closed, kills the workers and closes the sockets at once.

        Raises:
            Nothing: errors while stopping are logged, not raised.
        """
        await self._close_once()

    async def _close(self) -> None:
        self._closed = True
        self._stop_watch()
        master, self._master = self._master, None
        launcher = self._launcher
        cancelled = False
        if launcher is not None:
            # Before the master tells the workers to stop: their exits are no crashes.
            launcher.begin_close()
        try:
            if master is not None:
                try:
                    await master.aclose()
                except Exception as exc:
                    log.warning("master_close_failed", error=repr(exc))
                    master.close_now()
                except BaseException:
                    master.close_now()  # cancelled (the loop is ending): close what is left
                    cancelled = True
                    raise
        finally:
            if launcher is not None:
                try:
                    if cancelled:
                        # Its one cancellation went to the master's close: waiting out the
                        # workers' grace now would outlast the loop's end.
                        launcher.kill_now()
                    else:
                        await launcher.aclose(grace=5.0 if self._ready else 0.0)
                except BaseException:
                    launcher.kill_now()  # cancelled (the loop is ending): do not wait
                    raise
                finally:
                    self._launcher = None

    def _close_now(self) -> None:
        """Close a pipeline whose event loop has closed: nothing can be awaited there."""
        with self._now_lock:
            self._close_now_locked()

    def _close_now_locked(self) -> None:
        self._closed = True
        self._stop_watch()
        master, self._master = self._master, None
        launcher, self._launcher = self._launcher, None
        if launcher is not None:
            launcher.kill_now(loop_closed=True)
        if master is not None:
            master.close_now()

    def _stop_watch(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop()

    def _abandoned(self, watch: LoopWatch) -> None:
        """The loop the pipeline started on closed with the pipeline open (``asyncio.run``
        returned without ``aclose``): nothing there will stop its workers, which wait for a
        silent master while this process lives, so they are stopped now (from the watch's
        thread). Nothing if ``watch`` no longer watches this pipeline: it was closed, and
        perhaps started again on another loop, meanwhile."""
        with self._now_lock:
            if self._watch is not watch:
                return
            log.warning(
                "pipeline_abandoned",
                pipeline=self.spec.name,
                reason="the event loop it started on closed before it was closed: its "
                "workers are stopped; use 'async with' or 'await pipe.aclose()'",
            )
            try:
                self._close_now_locked()
            except Exception as exc:  # a thread's error would go unseen: logged instead
                log.error("pipeline_abandon_failed", pipeline=self.spec.name, error=repr(exc))
