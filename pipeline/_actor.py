"""The stage actor: one replica of one stage, holding its requests, channels and handler.

Chunks are filed into a reorder buffer per (request, input edge) as they arrive. A
request's handler starts once the orchestrator admitted it and its first chunk is here,
under the replica's ``max_concurrency`` limit. The handler's outputs become chunks on the
outgoing edges; ahead of a request's first chunk to each downstream replica goes the
orchestrator's ``Admit``, relayed (see :meth:`StageActor._target`). Completion, failure
and abort all end in :meth:`StageActor.forget`, which releases everything held for the
request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import numbers
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import msgspec
import structlog

from pipeline._batching import Batcher
from pipeline._channel import (
    Inflow,
    InputChannel,
    OutputChannel,
    SendTarget,
    file_run,
    unreadable,
)
from pipeline._encoded import DECODE_ERRORS, Encoded
from pipeline._errors import (
    ChunkGap,
    EndOfChannel,
    FailureInfo,
    PayloadError,
    RequestAborted,
    StageUnavailable,
    TransportError,
    error_to_failure,
    message_of,
    wire_text,
)
from pipeline._keys import CLIENT
from pipeline._latency import LatencyRecorder
from pipeline._logging import count_dropped
from pipeline._loop import step_now
from pipeline._messages import (
    Abort,
    Admit,
    Chunks,
    Credit,
    Gone,
    Held,
    Peer,
    PeerTable,
    Spill,
    decode_batch,
    encode_message,
)
from pipeline._signature import StagePlan
from pipeline._sockets import MAX_FRAMES, Outbox, SendData
from pipeline._stage import NOT_READY, Context, Outputs, Stage, Stream
from transports._liveness import local_pid

__all__ = ("StageActor",)

log = structlog.get_logger("stagewire.actor")


#: How many finished request ids a replica remembers, to discard their late chunks.
FINISHED_MEMORY = 65536
#: Seconds a cancelled handler may go on before the replica logs that it ignores it.
CANCEL_GRACE_S = 5.0
#: How many requests not yet admitted a replica remembers unreadable chunks of (forged ones
#: name requests that never come; the oldest are forgotten first).
UNREADABLE_MEMORY = 1024
#: How many request reports (see :meth:`StageActor.take_reports`) a replica keeps for its
#: next heartbeat; later ones go untold past that (the master hears no heartbeat anyway).
REPORTS_MEMORY = 16384
#: The most of them one heartbeat tells.
REPORTS_PER_BEAT = 4096
#: In a report ``(request id, stage)``, the stage that says the request's handler ended
#: here; any other names the upstream stage all of whose payloads of the request are here.
ENDED = ""
#: A handler that computed this long for one chunk, with no batch leaving meanwhile, is
#: compute-bound: its chunks leave as they come (see :class:`_Pacer`).
EAGER_SEND_S = 100e-6
#: The longest a handler that never suspends holds its quickly made chunks before they
#: leave as one batch (see :class:`_Pacer`).
HOLD_S = 1e-3


def _own_cancel(stage: str) -> RuntimeError:
    """The error for a handler whose own await raised CancelledError."""
    return RuntimeError(
        f"stage {stage!r}: something the handler awaited was cancelled (CancelledError), "
        "though the request was not; cancel helper tasks only when the handler no longer "
        "awaits them"
    )


def _ended(request_id: str) -> RequestAborted:
    """What a handler that goes on after its request ended (it caught the cancellation)
    gets when it sends: nothing more leaves for that request."""
    return RequestAborted(request_id, "it ended; its handler went on after being cancelled")


def _let_go(exc: BaseException, kwargs: dict[str, Any]) -> None:
    """Drop what a handler that ``exc`` ended still refers to: its inputs, and the frames
    (with their locals) in the tracebacks of ``exc`` and of the errors it chains to (see
    :meth:`StageActor._run`). Call it once ``exc`` is reported.

    The tracebacks are cut rather than their frames cleared: a frame in them may belong to
    a coroutine still running elsewhere (one that caught the error and handed it on), and
    clearing a suspended coroutine's frame would close it.
    """
    kwargs.clear()
    seen: set[int] = set()
    err: BaseException | None = exc
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        err.__traceback__ = None
        err = err.__cause__ or err.__context__


class _Pacer:
    """Sends a compute-bound handler's chunks as they come, not when its loop turn ends.

    Chunks are batched per event-loop turn, and a turn lasts as long as a handler runs
    without awaiting anything that suspends. A handler that computes between its yields
    (a prefill layer, a decode step) would then send all its chunks at its end. So after
    each chunk: if producing it took longer than :data:`EAGER_SEND_S`, what is queued
    leaves now, since the next chunk will likely take as long. Streams of quick chunks
    still batch, for at most :data:`HOLD_S` while their handler does not suspend.

    Whether a batch left while the chunk was made does not matter: a chunk queued after
    an await (a transport's put, say) would otherwise wait for the whole next computation.
    """

    __slots__ = ("_flushed", "_last", "_outbox")

    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox
        self._last = self._flushed = time.perf_counter()

    def sent(self) -> None:
        """Note that a chunk was queued, and send it at once if the handler is slow."""
        now = time.perf_counter()
        if now - self._last > EAGER_SEND_S or now - self._flushed > HOLD_S:
            self._outbox.flush()  # nothing queued: nothing happens
            # The send's own time (a system call that wakes the reader, hundreds of
            # microseconds on a small VM) is not time spent making the next chunk: a chunk
            # made quickly right after this one (a stream's summary) joins the next batch.
            now = self._flushed = time.perf_counter()
        self._last = now


class _Request:
    __slots__ = (
        "admit",
        "created",
        "ctx",
        "endpoints",
        "inflows",
        "request_id",
        "route",
        "slot",
        "started",
        "targets",
        "task",
    )

    def __init__(self, request_id: str, inflows: dict[str, Inflow]) -> None:
        self.request_id = request_id
        #: Where each destination's chunks go, looked up once per request: a replica that
        #: moves fails the requests it held, so a request never needs a second lookup.
        self.targets: dict[str, SendTarget] = {}
        self.route: dict[str, int] | None = None
        #: The data endpoint of each replica of the route, as the orchestrator chose it.
        self.endpoints: dict[str, str] = {}
        #: The orchestrator's Admit, encoded once, for the downstream replicas.
        self.admit: bytes | None = None
        self.inflows = inflows
        self.task: asyncio.Task[None] | None = None
        self.ctx: Context | None = None
        self.started = False
        #: Its handler holds one of the replica's ``max_concurrency`` slots.
        self.slot = False
        self.created = time.monotonic()


class StageActor:
    """One replica of one stage inside its worker process."""

    def __init__(
        self,
        plan: StagePlan,
        instance: Stage,
        *,
        replica: int,
        host: str,
        endpoint: str,
        send: SendData,
        report_failure: Callable[[FailureInfo], None],
        max_inflight: int = 1024,
        outbox: Outbox | None = None,
        token: bytes = b"",
    ) -> None:
        self.plan = plan
        self.stage = plan.name
        self.replica = replica
        self.instance = instance
        self._report_failure = report_failure
        self._send_data = send
        #: Where ``send`` queues: a handler's stream loop flushes it when it computes slowly.
        self._outbox = outbox
        #: What the master's request messages on the data path must carry.
        self._token = token
        self._inputs_by_edge: dict[str, tuple[str, InputChannel]] = {
            e.name: (param, InputChannel(e, host=host, send=send))
            for param, e in plan.inputs.items()
        }
        #: The stage each input edge comes from: drained requests are reported per edge.
        self._sources = {edge: ch.plan.src for edge, (_, ch) in self._inputs_by_edge.items()}
        for edge, (_, channel) in self._inputs_by_edge.items():
            channel.on_got_all = functools.partial(self._got_all, edge)
        self._outputs: dict[str, OutputChannel] = {
            dst: OutputChannel(e, host=host, endpoint=endpoint, send=send)
            for dst, e in plan.outputs.items()
        }
        self._outputs_by_edge = {c.plan.name: c for c in self._outputs.values()}
        #: The only output of a stage that sends one value to one stage: its chunks take
        #: a path without coroutines when they can.
        self._only_output: tuple[str, OutputChannel] | None = None
        self._peers: PeerTable = {}
        self._client: Peer | None = None
        #: Each (stage, replica)'s SendTarget, the client's as (CLIENT, 0), built once per
        #: peer table.
        self._targets: dict[tuple[str, int], SendTarget] = {}
        self._requests: dict[str, _Request] = {}
        #: Handlers cancelled (their requests ended) that have not ended yet.
        self._cancelled: set[asyncio.Task[None]] = set()
        #: While a message is handled: the requests it made ready, whose handlers start
        #: once the whole message is filed.
        self._starting: list[_Request] | None = None
        self._finished: OrderedDict[str, None] = OrderedDict()
        #: Why requests not admitted here yet cannot complete: chunks of theirs that could
        #: not be read came first (see _on_run). They fail when admitted.
        self._unreadable: OrderedDict[str, TransportError] = OrderedDict()
        #: Stages that requests not admitted here yet go on without (see :meth:`gone`).
        self._gone: OrderedDict[str, set[str]] = OrderedDict()
        #: Set (and replaced) whenever the peer table changes or a request goes on without
        #: a stage: what a send waiting for a table naming its replica waits on.
        self._table_changed: asyncio.Event | None = None
        #: What the master learns with the next heartbeat, as (request id, stage): which
        #: requests ended here (:data:`ENDED`), and which have all the payloads of an
        #: upstream stage here (that stage; see take_reports).
        self._reports: deque[tuple[str, str]] = deque()
        self._sem = asyncio.Semaphore(plan.spec.max_concurrency)
        self._streaming_out = plan.signature.streaming_output
        self._stream_params = frozenset(i.name for i in plan.signature.inputs if i.streaming)
        #: The edges whose single chunk the handler needs before it can be called, and
        #: those read as streams: see ``_maybe_start``.
        self._single_edges = tuple(
            e.name for p, e in plan.inputs.items() if p not in self._stream_params
        )
        self._stream_edges = tuple(
            e.name for p, e in plan.inputs.items() if p in self._stream_params
        )
        self._per_dest = plan.signature.per_destination is not None
        if len(self._outputs) == 1 and not self._per_dest:
            self._only_output = next(iter(self._outputs.items()))
        self._batcher: Batcher | None = None
        if plan.signature.batched and plan.spec.max_batch_size > 1:
            # No more than max_concurrency requests are ever in the handler at once, nor
            # more than the pipeline admits (max_inflight): a batch waiting for more would
            # wait out max_wait_ms every time.
            self._batcher = Batcher(
                instance,
                min(plan.spec.max_batch_size, plan.spec.max_concurrency, max_inflight),
                plan.spec.max_wait_ms / 1000,
            )
        self._chunk_timeout = max(e.chunk_timeout for e in plan.inputs.values())
        #: How often a send held up on one output tells the consumers on the others that
        #: their chunks are held (see _send_holding): thrice within their chunk timeout.
        #: None with a single output, or no timeout.
        hold = min((e.chunk_timeout for e in plan.outputs.values()), default=math.inf) / 3
        self._hold_every = hold if len(plan.outputs) > 1 and math.isfinite(hold) else None
        self._max_requests = 2 * max_inflight
        self.latency = LatencyRecorder()
        #: The most chunks one (request, edge) ever held waiting: the window bounds it.
        self.peak_buffered = 0
        self.counts = dict.fromkeys(
            (
                "started",
                "completed",
                "failed",
                "aborted",
                "unread_ended",
                "garbage",
                "late",
                "duplicates",
                "held",
            ),
            0,
        )

    # ---- peers and control ---------------------------------------------------------------

    def set_peers(self, peers: PeerTable, client: Peer | None = None) -> None:
        """Learn where every replica (and the client) receives data.

        A replica that left the table, or is there with another endpoint (restarted), is
        gone for the requests routed to it: those this replica has sent nothing to it yet
        send it nothing (their chunks are dropped as unread, and no Admit goes to its
        successor). A request routed to the successor (its Admit names the successor's
        endpoint) is not one of them: should its data come before this table, its sends
        there wait for the table (see :meth:`_target`). The master fails each request that
        still needed the gone replica; the others go on without it.
        """
        old, self._peers = self._peers, peers
        self._targets = {}
        if client is not None:
            self._client = client
        gone = {
            (stage, k): peer.endpoint
            for stage, replicas in old.items()
            for k, peer in replicas.items()
            if (now := peers.get(stage, {}).get(k)) is None or now.endpoint != peer.endpoint
        }
        self._wake_table_waiters()
        if not gone:
            return
        for req in self._requests.values():
            if req.route is None:
                continue
            for dst in self._outputs:
                endpoint = gone.get((dst, req.route.get(dst, -1)))
                # Routed to that incarnation (not to its successor, should this table be
                # read late), and nothing sent to it yet.
                if (
                    endpoint is not None
                    and req.endpoints.get(dst, endpoint) == endpoint
                    and dst not in req.targets
                ):
                    req.targets[dst] = SendTarget(endpoint, "")
                    self._send_nothing(req, dst)

    def readers_gone(self, endpoints: set[str]) -> None:
        """Replicas that received data at ``endpoints`` are gone: let every output's
        transports take back what they hold for them, and send them nothing more. A
        handler whose every output's consumer is gone, or has stopped reading, ends."""
        if endpoints:
            for out in self._outputs.values():
                out.readers_gone(endpoints)
            for rid in list(self._requests):
                self._end_if_unread(rid)

    def _target(self, dst: str, req: _Request) -> SendTarget | None:
        """Where ``dst``'s chunks of ``req`` go; the first time, the Admit goes there too.

        The orchestrator sends its ``Admit`` (with the pipeline's token) to the source
        stages only, and every stage relays it to each downstream replica ahead of the
        request's first chunk there, in the same batch. A downstream stage then learns of
        a request exactly when its data starts to come, and no stage is woken for a
        request before it has work.

        None while the peer table here does not name the replica incarnation the request
        was routed to (see :meth:`_table_for`): the request came before the table naming
        a restarted replica (the master sends both at once, on different sockets), or it
        was routed to one that died since, which the master fails (Abort) or lets go on
        without it (:meth:`gone`). An endpoint alone cannot tell the two apart: a restarted
        replica may bind its predecessor's port again.

        Raises:
            StageUnavailable: the route names a replica this table never had.
        """
        target = req.targets.get(dst)
        if target is not None:
            return target
        route = req.route
        assert route is not None
        replica = 0 if dst == CLIENT else route[dst]
        target = self._targets.get((dst, replica))
        if target is None:
            peer = self._client if dst == CLIENT else self._peers.get(dst, {}).get(replica)
            if peer is not None:
                target = SendTarget(peer.endpoint, peer.host, local_pid(peer.pid, peer.pidns))
                self._targets[dst, replica] = target
        if dst != CLIENT:
            wanted = req.endpoints.get(dst)
            if wanted is not None and (target is None or target.endpoint != wanted):
                return None
        if target is None:
            raise StageUnavailable(
                dst,
                f"replica {replica} is not known to {self.stage!r}",
                request_id=req.request_id,
            )
        if dst != CLIENT:
            if req.admit is None:
                req.admit = encode_message(Admit(req.request_id, route, self._token, req.endpoints))
            self._send_data(target.endpoint, req.admit)
        req.targets[dst] = target
        return target

    async def _table_for(self, dst: str, req: _Request) -> SendTarget:
        """Where ``dst``'s chunks of ``req`` go, once the peer table names the replica the
        request was routed to, or the master says the request goes on without it (then
        nowhere): at most the edge's chunk timeout, as its consumer would wait for a chunk.

        Raises:
            StageUnavailable: no such table came in time.
            RequestAborted: the request ended meanwhile.
        """
        timeout = self._outputs[dst].plan.chunk_timeout
        deadline = time.monotonic() + timeout
        rid = req.request_id
        while True:
            if self._table_changed is None:
                self._table_changed = asyncio.Event()
            changed = self._table_changed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await changed.wait()
            if self._requests.get(rid) is not req:
                raise _ended(rid)
            target = self._target(dst, req)
            if target is not None:
                return target
            if time.monotonic() >= deadline:
                raise StageUnavailable(
                    dst,
                    f"{self.stage!r} was never told of the replica at "
                    f"{req.endpoints[dst]} that the request was routed to "
                    f"(waited {timeout:g}s for the master's peer table)",
                    request_id=rid,
                )

    def _wake_table_waiters(self) -> None:
        if self._table_changed is not None:
            self._table_changed.set()
            self._table_changed = None

    def admit(
        self, request_id: str, route: dict[str, int], endpoints: dict[str, str] | None = None
    ) -> None:
        """Expect ``request_id``, routed to ``route``'s replicas (at ``endpoints``, when
        known); its handler starts when its first chunk is here."""
        if request_id in self._finished:
            return
        req = self._request(request_id)
        req.route = route
        if endpoints:
            req.endpoints = endpoints
        if self._unreadable:
            failure = self._unreadable.pop(request_id, None)
            if failure is not None:
                self._fail(req, failure)
                return
        if self._gone:
            for dst in self._gone.pop(request_id, ()):
                self._send_nothing(req, dst)
        self._maybe_start(req)

    def gone(self, request_id: str, stage: str) -> None:
        """``request_id`` goes on without ``stage``'s replica on its route, which died once
        its consumers had what they read: send it nothing more (no Admit to a restarted
        successor either). Kept until the request is admitted here, if it is not yet."""
        if request_id in self._finished:
            return
        req = self._requests.get(request_id)
        if req is None or req.route is None:
            self._gone.setdefault(request_id, set()).add(stage)
            if len(self._gone) > UNREADABLE_MEMORY:
                self._gone.popitem(last=False)
            return
        self._send_nothing(req, stage)
        self._wake_table_waiters()
        self._end_if_unread(request_id)

    def _send_nothing(self, req: _Request, dst: str) -> None:
        """Drop what ``req`` still sends ``dst``, and do not open its way there."""
        out = self._outputs.get(dst)
        if out is None:
            return
        target = req.targets.get(dst)
        if target is None:
            target = req.targets[dst] = SendTarget("", "")
        out.stop_for(req.request_id, target.endpoint)

    def abort(self, request_id: str, reason: str) -> None:
        """Cancel a request's handler and release everything held for it."""
        req = self._requests.get(request_id)
        if req is not None:
            self.counts["aborted"] += 1
            self.forget(request_id, RequestAborted(request_id, reason))
        else:
            self._remember(request_id)

    def forget(self, request_id: str, exc: BaseException | None = None) -> None:
        """Drop every trace of a request: handler, buffers, credit windows."""
        req = self._requests.pop(request_id, None)
        self._remember(request_id)
        if self._unreadable:
            self._unreadable.pop(request_id, None)
        if self._gone:
            self._gone.pop(request_id, None)
        if req is None:
            return
        if req.ctx is not None:
            req.ctx.cancel()
        if req.task is not None and not req.task.done():
            req.task.cancel()
            self._watch_cancelled(req.task, request_id)
        for edge, inflow in req.inflows.items():
            if exc is None and not inflow.buffer.finished:
                # The handler returned before its input's end: its producer must not wait
                # for credit that will never come.
                self._inputs_by_edge[edge][1].stop_reading(request_id, inflow.sender)
            inflow.end(exc)
        why = message_of(exc) if exc else None
        for out in self._outputs.values():
            out.forget(request_id, why)

    def _watch_cancelled(self, task: asyncio.Task[None], request_id: str) -> None:
        """Count a cancelled handler until it ends (``cancelling`` in the statistics), and
        say so should it go on past CANCEL_GRACE_S: one that catches its cancellation and
        carries on holds a ``max_concurrency`` slot, unseen otherwise."""
        self._cancelled.add(task)
        task.add_done_callback(self._cancelled.discard)
        asyncio.get_running_loop().call_later(CANCEL_GRACE_S, self._still_running, task, request_id)

    def _still_running(self, task: asyncio.Task[None], request_id: str) -> None:
        if not task.done():
            log.warning(
                "handler_ignores_cancellation",
                stage=self.stage,
                request_id=request_id,
                after_s=CANCEL_GRACE_S,
                advice="a handler that catches asyncio.CancelledError must raise it again: "
                "until it ends, it holds a max_concurrency slot of this replica",
            )

    def _remember(self, request_id: str) -> None:
        self._finished[request_id] = None
        if len(self._finished) > FINISHED_MEMORY:
            self._finished.popitem(last=False)

    # ---- data ----------------------------------------------------------------------------

    def on_data(self, frames: list[bytes]) -> None:
        """Handle one message (a batch of envelopes); garbage is counted and dropped.

        The handlers it makes ready start once every envelope is filed, and run to their
        first wait at once rather than on the loop's next turn (see :func:`step_now`): a
        one-chunk request's handler usually completes here, and what it sends leaves when
        the message's reader flushes.
        """
        if len(frames) > MAX_FRAMES:
            self._garbage(len(frames))
            return
        starting: list[_Request] = []
        self._starting = starting
        try:
            self._on_frames(frames)
        finally:
            # Even if filing failed part-way: a request marked started must start.
            self._starting = None
            for req in starting:
                if self._requests.get(req.request_id) is req:  # not aborted in that message
                    self._start(req, eager=True)

    def _on_frames(self, frames: list[bytes]) -> None:
        for frame in frames:
            try:
                batch = decode_batch(frame)
            except DECODE_ERRORS:
                self._garbage(1)
                continue
            for msg in batch:
                if isinstance(msg, Chunks):
                    self._on_run(msg)
                elif isinstance(msg, Credit):
                    out = self._outputs_by_edge.get(msg.edge)
                    if out is not None:
                        out.on_credit(msg)
                        if msg.done:
                            self._end_if_unread(msg.request_id)
                elif isinstance(msg, Held):
                    self._on_held(msg)
                elif isinstance(msg, Spill):
                    entry = self._inputs_by_edge.get(msg.edge)
                    if entry is not None:
                        entry[1].spill(msg.transport)
                elif not self._token or msg.token != self._token:
                    self._garbage(1)  # a request message that is not the master's
                elif isinstance(msg, Admit):
                    self.admit(msg.request_id, msg.route, msg.endpoints)
                elif isinstance(msg, Abort):
                    self.abort(msg.request_id, msg.reason)
                elif isinstance(msg, Gone):
                    self.gone(msg.request_id, msg.stage)
                else:
                    self.forget(msg.request_id)

    def _end_if_unread(self, request_id: str) -> None:
        """End a handler whose every output's consumer has stopped reading it.

        What it would still make goes nowhere, so it stops now rather than at the request's
        Drop (up to a second later), and tells its own producers that it reads no more.
        A handler with an output that nobody has refused yet (or that it has not sent on
        yet) keeps running.
        """
        req = self._requests.get(request_id)
        if req is None or req.task is None or req.task.done():
            return
        if all(out.reader_stopped(request_id) for out in self._outputs.values()):
            self.counts["unread_ended"] += 1
            # Its inputs are needed no more, nor is this process by what it sent.
            self._note_ended(req)
            self.forget(request_id)

    def _garbage(self, n: int) -> None:
        counts = self.counts
        counts["garbage"] = count_dropped(
            log, "garbage_dropped", counts["garbage"], n, stage=self.stage
        )

    def _on_run(self, run: Chunks) -> None:
        entry = self._inputs_by_edge.get(run.edge)
        if entry is None:
            self._garbage(1)
            return
        _, channel = entry
        rid = run.request_id
        try:
            items = channel.admit(run)
        except Exception as exc:
            self._garbage(1)
            if isinstance(exc, TransportError):
                # Chunks of a request that cannot be read: it cannot complete. Failing it
                # now says why, where waiting would end in a ChunkGap.
                req = self._requests.get(rid)
                if req is not None and req.route is not None:
                    self._fail(req, unreadable(run, exc))
                elif rid not in self._finished:
                    # Not admitted yet (chunks may precede their Admit): it fails on Admit.
                    self._unreadable[rid] = unreadable(run, exc)
                    if len(self._unreadable) > UNREADABLE_MEMORY:
                        self._unreadable.popitem(last=False)
            return
        if rid in self._finished:
            self.counts["late"] += len(items)
            for item in items:
                channel.discard(item)
            if not run.final:
                # Sent before the producer heard that nothing more is read: say it again.
                channel.stop_reading(rid, run.sender)
            return
        if (
            rid not in self._requests
            and len(self._requests) >= self._max_requests
            and not self._evict_unadmitted()
        ):
            self._garbage(len(items))
            for item in items:
                channel.discard(item)
            return
        req = self._request(rid)
        inflow = req.inflows[run.edge]
        buf = inflow.buffer
        self.counts["duplicates"] += file_run(inflow, run, items)
        if run.transport in channel.needs_producer:
            inflow.fragile = True
        if buf.buffered > self.peak_buffered:
            self.peak_buffered = buf.buffered
        # (Runs of one producer arrive in order, but a final one may come before a gap in
        # the stream is filled: each run after it looks again.)
        if not inflow.told and buf.final_seq is not None and inflow.drained:
            self._tell_drained(rid, run.edge, inflow)
        self._maybe_start(req)

    def _got_all(self, edge: str, request_id: str) -> None:
        """A reader got the last payload of ``request_id`` to fetch on ``edge``, every chunk
        having arrived."""
        req = self._requests.get(request_id)
        if req is not None:
            inflow = req.inflows[edge]
            if not inflow.told and inflow.drained:
                self._tell_drained(request_id, edge, inflow)

    def _tell_drained(self, request_id: str, edge: str, inflow: Inflow) -> None:
        """Report that every payload of ``request_id`` on ``edge`` is here: each arrived
        inside its envelope, or was got from a transport whose payloads outlive their
        producer (or the handler ended, needing no more); unless one came by a transport
        whose payloads do not."""
        inflow.told = True
        src = self._sources[edge]
        # A payload that needs its producer even once got is never reported: its producer
        # stays bound to the request (and its death fails it) until the request ends.
        if src != CLIENT and not inflow.fragile and len(self._reports) < REPORTS_MEMORY:
            self._reports.append((request_id, src))

    def _evict_unadmitted(self) -> bool:
        """Make room by forgetting the oldest request whose chunks came but no Admit.

        Chunks may precede their Admit (data and control travel apart), but state must not
        grow without bound: past ``2 * max_inflight`` requests, the oldest never-admitted
        one goes, counted as garbage. It is forged or stale, or its Admit is overdue, so a
        flood of forged chunks cannot lock out the chunks of real requests that arrive just
        before their Admit. False when every held request is admitted.
        """
        for rid, req in self._requests.items():
            if req.route is None:
                self._garbage(1)
                self.forget(rid, RequestAborted(rid, "never admitted"))
                return True
        return False

    def _request(self, request_id: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            # A join's handler starts with its first input: the producers of the others may
            # still be busy with other requests, which is no gap in their streams.
            join = len(self._inputs_by_edge) > 1
            inflows = {
                edge: ch.open(request_id, time_first=not join)
                for edge, (_, ch) in self._inputs_by_edge.items()
            }
            req = self._requests[request_id] = _Request(request_id, inflows)
        return req

    def _maybe_start(self, req: _Request) -> None:
        """Start the handler of ``req`` once it can do something: every input read as one
        chunk has its chunk (or, with none such, a stream has begun).

        A handler waits for a slot (``max_concurrency``) as soon as it starts. A join that
        took one on its first input's chunk, to wait in it for another input, could wait
        for ever: that input's producer, busy with a request this stage has not begun,
        waits for this stage's credit for it, which needs the slot. The handler cannot be
        called without its single-chunk inputs, so it waits for them outside its slot; a
        wait for a stream's first chunk gives the slot up (``_next_in_turn``).
        """
        if req.started or req.route is None:
            return
        inflows = req.inflows
        for edge in self._single_edges:
            buffer = inflows[edge].buffer
            if not (buffer.buffered or buffer.delivered):
                return
        if not self._single_edges:
            for edge in self._stream_edges:
                buffer = inflows[edge].buffer
                if buffer.buffered or buffer.delivered:
                    break
            else:
                return
        req.started = True
        if self._starting is not None:
            self._starting.append(req)
        else:
            self._start(req, eager=False)

    def _start(self, req: _Request, *, eager: bool) -> None:
        req.ctx = Context(req.request_id, self.stage, self.replica)
        loop = asyncio.get_running_loop()
        task = req.task = loop.create_task(self._run(req, req.ctx))
        if eager:
            step_now(loop, task)

    # ---- the handler ---------------------------------------------------------------------

    async def _run(self, req: _Request, ctx: Context) -> None:
        rid = req.request_id
        await self._sem.acquire()
        req.slot = True
        try:
            t0 = time.perf_counter()
            self.counts["started"] += 1
            kwargs: dict[str, Any] = {}
            try:
                for param, edge in self.plan.inputs.items():
                    if param in self._stream_params:
                        channel = self._inputs_by_edge[edge.name][1]
                        inflow = req.inflows[edge.name]
                        kwargs[param] = Stream(
                            functools.partial(self._next_in_turn, req, channel, inflow),
                            functools.partial(channel.poll, inflow),
                        )
                    else:
                        # Usually here already and carried inline: read without a coroutine.
                        channel = self._inputs_by_edge[edge.name][1]
                        inflow = req.inflows[edge.name]
                        try:
                            value = channel.poll(inflow)
                            if value is NOT_READY:
                                value = await channel.next(inflow)
                        except EndOfChannel:
                            raise PayloadError(
                                f"{edge.src!r} sent no payload on edge {edge.name!r} to "
                                f"{self.stage!r}"
                            ) from None
                        kwargs[param] = value
                await self._produce(req, ctx, kwargs)
            except asyncio.CancelledError as exc:
                # The error that ends a handler keeps, through its traceback, the finished
                # frames and their locals, this one's included: payloads read in place (shm
                # tensors) among them, which their transport holds until they die. The error
                # is kept where it refers back to itself (the task keeps it and the request;
                # a request's buffers keep its failure, which the request's frames keep), so
                # only the cycle collector would free them, maybe long after in an idle
                # worker. So those locals go as the error leaves, once reported.
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    _let_go(exc, kwargs)
                    raise  # this request was cancelled: aborted, or the replica is closing
                # Something the handler awaited was cancelled, not the request. Unreported,
                # the request would never end.
                self._handler_failed(req, _own_cancel(self.stage))
                _let_go(exc, kwargs)
                return
            # SystemExit and KeyboardInterrupt too: raised by a handler (sys.exit() on a bad
            # input), they are its failure, not the worker's end, which would fail every
            # request of the replica and, a few times over, the stage for good. So is any
            # other BaseException (GeneratorExit, a library's own): unreported, it ended
            # the task and the request hung.
            except BaseException as exc:
                self._handler_failed(req, exc)
                _let_go(exc, kwargs)
                return
            self.counts["completed"] += 1
            self.latency.add((time.perf_counter() - t0) * 1e6)
            # Every output got its final chunk: nothing here is needed any more. Chunks
            # still coming (a handler may return before its stream ends) are late now, and
            # are released as they come.
            if self._requests.get(rid) is req:
                req.task = None
                self._note_ended(req)
                self.forget(rid)
        finally:
            if req.slot:
                req.slot = False
                self._sem.release()

    async def _next_in_turn(self, req: _Request, channel: InputChannel, inflow: Inflow) -> Any:
        """The next payload of a stream input of ``req``'s handler (``channel.next``), its
        slot given up while it waits for the stream's first chunk.

        A join that waits in its slot for a producer still busy with another request may
        wait for ever: that producer may itself wait for this stage's credit for a request
        the stage has not begun, which needs a slot. The handler takes a slot back once
        the chunk is here, before it reads it (a read cancelled meanwhile leaves the chunk
        for the next read), and also when the wait ends otherwise while the request lives
        (a timeout of the handler's own, a ``ChunkGap`` it catches): it goes on working.

        Only a read in the handler's own task gives the slot up. One in a task of its own
        (``asyncio.gather``, ``wait_for``) runs beside handler code that goes on working,
        and may outlive the handler: it waits as any read does.

        Raises:
            What ``InputChannel.next`` raises.
        """
        buffer = inflow.buffer
        if (
            req.slot
            and not (buffer.delivered or buffer.buffered)
            and inflow.held is None
            and inflow.fetching is None
            and asyncio.current_task() is req.task
        ):
            req.slot = False
            self._sem.release()
            try:
                await channel.arrival(inflow)
            except BaseException:
                if self._requests.get(req.request_id) is req:
                    # Still live (an abort forgets the request before it cancels): the
                    # handler goes on, and works in a slot.
                    await self._retake_slot(req)
                raise
            await self._retake_slot(req)
        return await channel.next(inflow)

    async def _retake_slot(self, req: _Request) -> None:
        """Take a slot back for ``req``'s handler, which goes on working. A cancellation of
        the handler's own (a timeout around its read) waits until the slot is taken, then
        goes on; one that ends the request (an abort forgets it first) does not wait."""
        cancelled: asyncio.CancelledError | None = None
        while True:
            try:
                await self._sem.acquire()
                break
            except asyncio.CancelledError as exc:
                if self._requests.get(req.request_id) is not req:
                    raise
                cancelled = exc
        req.slot = True
        if cancelled is not None:
            raise cancelled

    def _note_ended(self, req: _Request) -> None:
        """The handler of ``req`` ended: its inputs are no longer needed (read to their ends,
        or given up), and, unless it sent a payload that needs this process even once got
        (cuda_ipc), what it sent no longer needs this process once its consumers have it."""
        rid = req.request_id
        for edge, inflow in req.inflows.items():
            if not inflow.told:
                self._tell_drained(rid, edge, inflow)
        if not any(out.held_here(rid) for out in self._outputs.values()) and (
            len(self._reports) < REPORTS_MEMORY
        ):
            self._reports.append((rid, ENDED))

    def take_reports(self) -> tuple[list[str], list[tuple[str, str]]]:
        """Since the last call: the requests whose handler ended here (nothing it sent
        needs this process once got), and as (request id, upstream stage) those all of whose
        payloads from that stage are here: each arrived inside its envelope, or was got from
        a transport whose payloads outlive their producer (shm, network).

        The master counts a replica done with a request once it ended there and each stage
        it sends to has all of its payloads of the request: nothing of it is then needed
        from this process, in a socket's queue, a shared-memory segment or elsewhere. When
        the replica dies, each stage it sends to having all of them suffices, ended or not
        (what its handler would still send, nobody reads). Called from the heartbeat
        thread, the only one that takes from the queue.
        """
        reports = self._reports
        ended: list[str] = []
        drained: list[tuple[str, str]] = []
        for _ in range(min(len(reports), REPORTS_PER_BEAT)):
            report = reports.popleft()
            if report[1] == ENDED:
                ended.append(report[0])
            else:
                drained.append(report)
        return ended, drained

    def reports_left(self) -> int:
        """Reports queued for a later :meth:`take_reports` (called from the heartbeat
        thread)."""
        return len(self._reports)

    def _handler_failed(self, req: _Request, exc: BaseException) -> None:
        """Fail the request whose handler raised ``exc``."""
        if (
            isinstance(exc, ChunkGap)
            and req.request_id in self._requests
            # Not one its own code got from elsewhere (a pipeline it calls).
            and exc.request_id == req.request_id
            and exc.edge in self._inputs_by_edge
        ):
            exc = self._explain_gap(req, exc)
        req.task = None  # ending anyway: forget() must not cancel it
        self._fail(req, exc)

    def _fail(self, req: _Request, exc: BaseException) -> None:
        """Fail the request at the client (a StageError) and forget it here; nothing if it
        ended already (aborted, its handler having caught the cancellation)."""
        rid = req.request_id
        if rid not in self._requests:
            return
        self.counts["failed"] += 1
        try:
            self._report_failure(error_to_failure(exc, stage=self.stage, request_id=rid))
        except Exception as report_exc:  # the control socket refused it (the master is gone?)
            log.warning(
                "failure_unreported", stage=self.stage, request_id=rid, error=repr(report_exc)
            )
            # Or the report itself could not be encoded: the request must fail all the same,
            # or its client waits for ever. Its stand-in says only what is safe to send.
            if isinstance(report_exc, _UNENCODABLE):
                self._report_standin(rid, exc, report_exc)
        self.forget(rid, exc)

    def _report_standin(self, rid: str, exc: BaseException, report_exc: Exception) -> None:
        """Report a stand-in for the failure ``exc`` of ``rid``, whose own report could not
        be encoded (``report_exc``); nothing if that fails too."""
        standin = FailureInfo(
            "stage",
            f"{type(exc).__name__} (its report could not be sent: {type(report_exc).__name__})",
            rid,
            self.stage,
        )
        with contextlib.suppress(Exception):
            self._report_failure(standin)

    def _explain_gap(self, req: _Request, gap: ChunkGap) -> ChunkGap:
        """``gap``, saying so when another input of the request holds a full window unread.

        That input's producer then waits for credit, and if it also makes the missing
        chunk's input (two branches from one stage, met here), it never sends it: the
        handler reads one input to its end before the other. No timeout helps that.

        Or when this process holds shm payloads in place (zero-copy tensors still alive,
        the last chunk's in a loop variable say): the producer may wait for the room they
        pin in its arena.
        """
        edge = self._full_elsewhere(req, gap.edge)
        if edge is not None:
            advice = (
                f"meanwhile edge {edge!r} holds {req.inflows[edge].buffer.buffered} chunks "
                "the handler has not read, a full credit window, so its producer waits for "
                "credit; if that producer also feeds this edge, it never sends the "
                "missing chunk: read both inputs as they come (or raise "
                f"{edge!r}'s window past the stream's length)"
            )
        else:
            held = self._inputs_by_edge[gap.edge][1].held_in_place()
            if not held:
                return gap
            advice = (
                f"this process holds {held} payloads got by shm in place (zero-copy tensors "
                "still alive pin their extent; a loop variable keeps the last chunk while the "
                "next one is awaited), so the producer may be waiting for room in its arena: "
                "give the edge a shm `capacity` of two chunks per stream or `copy: true`, or "
                "drop the tensors sooner; else raise chunk_timeout if the upstream stage is slow"
            )
        return ChunkGap(gap.request_id, gap.edge, gap.seq, gap.timeout, advice=advice)

    async def _produce(self, req: _Request, ctx: Context, kwargs: dict[str, Any]) -> None:
        if self._batcher is not None:
            (value,) = kwargs.values()
            await self._emit(req, await self._batcher.submit(value, ctx), final=True)
            return
        process = self.instance.process  # type: ignore[attr-defined]  # user-defined
        if self._streaming_out:
            agen = process(**kwargs, ctx=ctx)
            single = self._only_output
            rid = req.request_id
            pacer = _Pacer(self._outbox) if self._outbox is not None else None
            try:
                if single is None:
                    async for value in agen:
                        await self._emit(req, value, final=False)
                        if pacer is not None:
                            pacer.sent()
                else:
                    # One output: encode and send each chunk without a coroutine when it
                    # needs no waiting, as a stream of small chunks usually does.
                    dst, out = single
                    encode, try_send = out.codec.encode, out.try_send
                    requests = self._requests
                    target = None
                    async for value in agen:
                        if requests.get(rid) is not req:
                            raise _ended(rid)
                        encoded = encode(value)
                        if target is None:
                            target = self._target(dst, req) or await self._table_for(dst, req)
                        if not try_send(rid, encoded, False, target):
                            await out.send(rid, encoded, False, target)
                        if pacer is not None:
                            pacer.sent()
            finally:
                await agen.aclose()
            await self._end(req)
        else:
            await self._emit(req, await process(**kwargs, ctx=ctx), final=True)

    async def _emit(self, req: _Request, value: Any, *, final: bool) -> None:
        assert req.route is not None
        rid = req.request_id
        if self._per_dest:
            if not isinstance(value, Outputs):
                raise PayloadError(
                    f"stage {self.stage!r} must return {self.plan.signature.output_type.__name__}"
                    f", got {type(value).__name__}"
                )
            for dst, out in self._outputs.items():
                part = getattr(value, dst)
                if part is not None:
                    try:
                        encoded_part = out.codec.encode(part)
                    except PayloadError as exc:
                        name = type(value).__name__
                        raise PayloadError(
                            f"field {dst!r} of {name} (the payload for stage {dst!r}): {exc}",
                            field=f"{dst}{(exc.field or '$')[1:]}",
                        ) from exc
                    await self._send(out, rid, encoded_part, final, req, dst)
                elif final:
                    await self._send(out, rid, None, True, req, dst)
            return
        encoded: Encoded | None = None
        for dst, out in self._outputs.items():
            if encoded is None:
                encoded = out.codec.encode(value)
            await self._send(out, rid, encoded, final, req, dst)

    async def _send(
        self,
        out: OutputChannel,
        rid: str,
        encoded: Encoded | None,
        final: bool,
        req: _Request,
        dst: str,
    ) -> None:
        if self._requests.get(rid) is not req:
            raise _ended(rid)
        target = self._target(dst, req) or await self._table_for(dst, req)
        if not out.try_send(rid, encoded, final, target):
            if self._hold_every is None:
                await out.send(rid, encoded, final, target)
            else:
                await self._send_holding(out, rid, encoded, final, target, req, dst)

    async def _send_holding(
        self,
        out: OutputChannel,
        rid: str,
        encoded: Encoded | None,
        final: bool,
        target: SendTarget,
        req: _Request,
        dst: str,
    ) -> None:
        """``out.send``, telling the request's other consumers while it waits (for credit
        from a slower consumer, or a request queued there) that their next chunks are held,
        not lost: their waits start over instead of failing the request with a ChunkGap."""
        every = self._hold_every
        assert every is not None
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle | None = None

        def tick() -> None:
            nonlocal handle
            self._tell_held(req, dst)
            handle = loop.call_later(every, tick)

        handle = loop.call_later(every, tick)
        try:
            await out.send(rid, encoded, final, target)
        finally:
            handle.cancel()

    def _on_held(self, msg: Held) -> None:
        """The producer of ``msg.edge`` is held up sending another of its outputs: the wait
        for its next chunk starts over (for at most ``HELD_LIMIT`` chunk timeouts in all:
        this handler may itself be what holds the producer up, see ``ReorderBuffer.alive``),
        and this stage's own consumers of the request, who wait for what that chunk would
        make, are told in turn: also while its handler has not started (nothing came on
        any input yet), when they wait for its first output."""
        req = self._requests.get(msg.request_id)
        inflow = req.inflows.get(msg.edge) if req is not None else None
        if req is None or inflow is None:
            return
        inflow.buffer.alive()
        if inflow.buffer.waiting or not req.started:
            self._tell_held(req, None)

    def _full_elsewhere(self, req: _Request, edge: str) -> str | None:
        """An input of ``req`` other than ``edge`` that holds a full window of chunks the
        handler has not read (its producer waits for credit), if there is one."""
        for other, inflow in req.inflows.items():
            if (
                other != edge
                and inflow.buffer.buffered >= self._inputs_by_edge[other][1].plan.window
            ):
                return other
        return None

    def _tell_held(self, req: _Request, held_by: str | None) -> None:
        """Send ``Held`` to the consumers of ``req`` on every output but ``held_by``."""
        rid = req.request_id
        if self._requests.get(rid) is not req or req.route is None:
            return
        for dst, out in self._outputs.items():
            # (The client waits on its sinks without a chunk timeout.)
            if dst in (held_by, CLIENT) or out.reader_stopped(rid):
                continue
            try:
                target = req.targets.get(dst) or self._target(dst, req)
            except StageUnavailable:
                continue  # its own send will say so
            if target is not None and target.endpoint:
                self._send_data(target.endpoint, encode_message(Held(rid, out.plan.name)))
                self.counts["held"] += 1

    async def _end(self, req: _Request) -> None:
        assert req.route is not None
        for dst, out in self._outputs.items():
            await self._send(out, req.request_id, None, True, req, dst)

    # ---- lifecycle -----------------------------------------------------------------------

    def sweep(self, now: float) -> int:
        """Forget requests whose chunks came but that were never admitted; how many."""
        stale = [
            rid
            for rid, req in self._requests.items()
            if req.route is None and now - req.created > self._chunk_timeout
        ]
        for rid in stale:
            self.forget(rid, RequestAborted(rid, "never admitted"))
        return len(stale)

    @property
    def inflight(self) -> int:
        """Requests this replica holds state for."""
        return len(self._requests)

    def statistics(self) -> dict[str, Any]:
        """Counters of the replica, its handler and its edges."""
        try:
            counters = {
                wire_text(str(k)): n
                for k, v in self.instance.statistics().items()
                if (n := _counter(v)) is not None
            }
        except Exception as exc:  # the stage's own code: report it, keep the replica's
            counters = {}
            log.warning("stage_statistics_failed", stage=self.stage, error=repr(exc))
        return {
            "stage": self.stage,
            "replica": self.replica,
            "active": len(self._requests),
            "cancelling": len(self._cancelled),
            "open_windows": sum(o.open_windows for o in self._outputs.values()),
            "peak_buffered": self.peak_buffered,
            **self.counts,
            "process_p50_us": self.latency.percentile(50),
            "process_p99_us": self.latency.percentile(99),
            "inputs": [ch.statistics() for _, ch in self._inputs_by_edge.values()],
            "outputs": [o.statistics() for o in self._outputs.values()],
            "counters": counters,
            "oldest": self._oldest(),
        }

    def _oldest(self) -> dict[str, Any] | None:
        """Where the longest-held request stands here: its age, whether its handler runs,
        and its position on each edge. A request held far longer than the others is stuck
        somewhere, and this says where."""
        if not self._requests:
            return None
        req = min(self._requests.values(), key=lambda r: r.created)
        task = req.task
        return {
            "request_id": req.request_id,
            "age_s": round(time.monotonic() - req.created, 3),
            "admitted": req.route is not None,
            "started": req.started,
            "slot": req.slot,
            "running": task is not None and not task.done(),
            "inputs": {edge: inflow.describe() for edge, inflow in req.inflows.items()},
            "outputs": {
                out.plan.name: out.describe(req.request_id) for out in self._outputs.values()
            },
        }

    async def reserve(self) -> None:
        """What the output edges' pinned transports need, taken before the first request.

        Raises:
            TransportError: some transport cannot have it (an shm segment larger than what
                /dev/shm has free, say), naming the edge and the sizes.
        """
        for out in self._outputs.values():
            await out.reserve()

    def forget_all(self, reason: str) -> None:
        """Abort every request held here, and drop what is to be reported of any."""
        for rid in list(self._requests):
            self.forget(rid, RequestAborted(rid, reason))
        self._reports.clear()
        self._unreadable.clear()
        self._gone.clear()

    def rejoined(self, token: bytes, peers: PeerTable, client: Peer) -> None:
        """Serve for the master this replica registered with again (see ``_worker``): its
        request messages carry ``token``, and its table and client are where data goes."""
        self._token = token
        self.set_peers(peers, client)

    async def aclose(self) -> None:
        """Abort every request and close every channel; idempotent."""
        self.forget_all("stage shutting down")
        if self._batcher is not None:
            await self._batcher.aclose()
        for out in self._outputs.values():
            await out.aclose()
        for _, ch in self._inputs_by_edge.values():
            await ch.aclose()


#: What encoding a message raises when a value in it has no encoding (a lone surrogate in
#: a text, an integer past 64 bits), as opposed to a socket that refused it.
_UNENCODABLE = (ValueError, TypeError, OverflowError, msgspec.EncodeError)


def _counter(value: object) -> int | float | None:
    """A stage's counter as its statistics carry it, or None to leave it out: numbers of
    any kind (numpy's too); an integer past 64 bits as a float (whole, it made the
    replica's figures unsendable, and the replica was reported as not answering)."""
    try:
        if isinstance(value, numbers.Integral):
            whole = int(value)
            return whole if -(2**63) <= whole < 2**64 else float(whole)
        if isinstance(value, numbers.Real):
            return float(value)
    except (OverflowError, ValueError, TypeError):
        pass
    return None
