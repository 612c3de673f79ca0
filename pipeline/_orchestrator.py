"""The orchestrator: owns every request from submission to completion, failure or abort.

It assigns request ids, picks one replica per stage (least loaded, then round robin) and
keeps that choice for the life of the request, admits the request at the source replicas
(which relay the ``Admit`` downstream ahead of the request's first chunks), sends the
input to the sources, and reads the sinks' chunks back in key order. It sees admission,
completion, failure and abort, never each chunk between stages.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

from pipeline._channel import (
    Inflow,
    InputChannel,
    OutputChannel,
    SendTarget,
    file_run,
    unreadable,
)
from pipeline._codec import codec_for
from pipeline._encoded import DECODE_ERRORS
from pipeline._errors import (
    EndOfChannel,
    PayloadError,
    PipelineError,
    RequestAborted,
    RequestTimeout,
    StageUnavailable,
    TransportError,
    wire_text,
)
from pipeline._keys import CLIENT
from pipeline._messages import (
    Abort,
    Admit,
    Chunks,
    Credit,
    DataMessage,
    Drop,
    Gone,
    decode_batch,
)
from pipeline._signature import PipelinePlan
from pipeline._sockets import MAX_FRAMES, SendData

__all__ = (
    "DROP_BATCH",
    "DROP_DELAY_S",
    "ClientRequest",
    "InDoubt",
    "Orchestrator",
    "ReplicaView",
)

#: How long the ``Drop`` of a completed request waits, to leave with the others due. A
#: stage forgets a request itself once its handler has ended, and a consumer that returns
#: before its stream's end tells its producer so at once; the Drop is the backstop for
#: whatever is still held, so it need not wake every stage after every request. At low load
#: a wave of Drops woke every worker (and the master) about once per request, in the middle
#: of the next request's decoding; once a second it costs nothing measurable.
DROP_DELAY_S = 1.0

#: A wave of Drops leaves at once, without waiting for its timer, once this many are due.
DROP_BATCH = 1024


def _consume_outcome(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


class ReplicaView:
    """What the orchestrator needs to know of one replica."""

    __slots__ = (
        "endpoint",
        "given_up",
        "host",
        "pid",
        "ready",
        "replica",
        "requests",
        "stage",
        "stalled",
        "why",
    )

    def __init__(self, stage: str, replica: int, endpoint: str, host: str, pid: int = 0) -> None:
        self.stage = stage
        self.replica = replica
        self.endpoint = endpoint
        self.host = host
        self.pid = pid
        self.ready = False
        #: Dead, and its launcher will not restart it: nobody waits for it.
        self.given_up = False
        #: Its event loop has been held past the heartbeat timeout (a handler that does not
        #: give it back): new requests go to another ready replica while one is there.
        self.stalled = False
        self.requests: set[str] = set()
        #: Why its slot was last declared dead ("" once a worker in it is ready).
        self.why = ""


class InDoubt:
    """The requests a dead replica held that may not need it any more: judged once the
    consumers it sends to (``asks``, as (stage, replica)) have told what they have."""

    __slots__ = ("asks", "failed", "replica", "requests", "stage", "view", "why")

    def __init__(self, stage: str, replica: int, why: str) -> None:
        self.stage = stage
        self.replica = replica
        self.why = why
        self.view: ReplicaView | None = None
        self.requests: list[str] = []
        self.asks: set[tuple[str, int]] = set()
        #: Requests failed for the replica's death so far.
        self.failed = 0


class ClientRequest:
    """One request as the client side sees it."""

    __slots__ = ("drained", "ended", "error", "inflows", "pending", "request_id", "route", "timer")

    def __init__(self, request_id: str, route: dict[str, int]) -> None:
        self.request_id = request_id
        self.route = route
        self.inflows: dict[str, Inflow] = {}
        self.pending: dict[str, asyncio.Task[Any]] = {}
        self.error: BaseException | None = None
        self.timer: asyncio.TimerHandle | None = None
        #: The stages where the request's handler ended, and the edges, as (from, to), all of
        #: whose payloads of it reached their consumer: what tells when a replica is done
        #: with it (see Orchestrator.stage_reported).
        self.ended: set[str] = set()
        self.drained: set[tuple[str, str]] = set()


class Orchestrator:
    """Plans, admits and tracks requests; the client end of every source and sink edge."""

    def __init__(
        self,
        plan: PipelinePlan,
        *,
        host: str,
        endpoint: str,
        send_data: SendData,
        send_control: Callable[[str, int, Any], None],
        token: bytes = b"",
        device: str | None = None,
    ) -> None:
        self.plan = plan
        self._token = token
        self._send_control = send_control
        defaults = plan.spec.defaults
        self._timeout = defaults.request_timeout
        self._replica_wait = min(defaults.replica_wait, defaults.request_timeout or math.inf)
        #: Resolved when a replica becomes ready, or the pipeline closes: what requests
        #: waiting for a stage with no ready replica wait on.
        self._readiness: asyncio.Future[None] | None = None
        self._slots = asyncio.Semaphore(defaults.max_inflight)
        self._closing = False
        self._ids = itertools.count()
        self._prefix = f"{os.getpid():x}{os.urandom(3).hex()}"
        #: Round-robin among equally loaded replicas, counted per stage: one counter for
        #: all stages moved on by the number of stages per request, and with that a
        #: multiple of a stage's replicas, every sequential request went to one replica.
        self._rr = {s: itertools.count() for s in plan.stages}
        self.replicas: dict[str, dict[int, ReplicaView]] = {s: {} for s in plan.stages}
        self.requests: dict[str, ClientRequest] = {}
        self._to_sources = {
            src: OutputChannel(
                next(iter(plan.stages[src].inputs.values())),
                host=host,
                endpoint=endpoint,
                send=send_data,
            )
            for src in plan.sources
        }
        self._input_types = {
            src: next(iter(plan.stages[src].inputs.values())).payload_type for src in plan.sources
        }
        #: The edges, as (from, to), each stage sends by (none for a sink, which sends to
        #: the client).
        self._downstream = {
            name: () if CLIENT in st.outputs else tuple((name, dst) for dst in st.outputs)
            for name, st in plan.stages.items()
        }
        #: The edges, as (from, to), each stage is sent by (none from the client).
        self._upstream = {
            name: tuple((e.src, name) for e in st.inputs.values() if e.src != CLIENT)
            for name, st in plan.stages.items()
        }
        self._from_sinks = {
            sink: InputChannel(
                plan.stages[sink].outputs[CLIENT], host=host, send=send_data, device=device
            )
            for sink in plan.sinks
        }
        self._by_edge = {ch.plan.name: ch for ch in self._from_sinks.values()}
        #: Whether outputs come from more than one sink (the client then learns which).
        self.several_sinks = len(self._from_sinks) > 1
        self._src_by_edge = {ch.plan.name: ch for ch in self._to_sources.values()}
        self.counts = dict.fromkeys(
            ("submitted", "completed", "failed", "aborted", "garbage", "waited"), 0
        )
        #: The most requests ever admitted at once (bounded by max_inflight).
        self.peak_active = 0
        #: Completed requests to drop, by replica, until the drop timer fires.
        self._drops: dict[tuple[str, int], list[str]] = {}
        self._drop_timer: asyncio.TimerHandle | None = None
        #: Completed requests whose Drops are due.
        self._drops_due = 0

    # ---- planning ------------------------------------------------------------------------

    def _choose(self, stage: str) -> ReplicaView:
        live = [r for r in self.replicas[stage].values() if r.ready]
        if not live:
            raise StageUnavailable(stage, "no replica is ready")
        # A replica whose loop a handler holds would take a request it cannot start, and,
        # its stuck request aborted, look the least loaded of all.
        live = [r for r in live if not r.stalled] or live
        least = min(len(r.requests) for r in live)
        candidates = [r for r in live if len(r.requests) == least]
        return candidates[next(self._rr[stage]) % len(candidates)]

    async def _choose_all(self, until: float | None = None) -> dict[str, ReplicaView]:
        """One replica per stage, waiting up to ``replica_wait`` for a stage with none ready,
        and never past ``until`` (the request's deadline, on the loop's clock).

        Raises:
            StageUnavailable: a stage had no ready replica for the whole wait.
            RequestTimeout: the request's deadline came first.
            RequestAborted: the pipeline closed meanwhile.
        """
        deadline: float | None = None
        loop = asyncio.get_running_loop()
        while True:
            if self._closing:
                raise RequestAborted("(not admitted)", "pipeline closing")
            try:
                return {stage: self._choose(stage) for stage in self.plan.stages}
            except StageUnavailable as exc:
                if deadline is None:
                    began = loop.time()
                    deadline = began + self._replica_wait
                    if until is not None:
                        deadline = min(deadline, until)
                    if self._replica_wait > 0:
                        self.counts["waited"] += 1
                if all(r.given_up for r in self.replicas[exc.stage].values()):
                    raise StageUnavailable(
                        exc.stage,
                        "no replica is ready, and none is being restarted" + self._whys(exc.stage),
                    ) from None
                left = deadline - loop.time()
                if left <= 0:
                    wait = round(deadline - began, 3)
                    if self._replica_wait <= 0:
                        raise
                    if until is not None and deadline == until and self._timeout is not None:
                        # The request's own deadline ended the wait, not replica_wait.
                        raise RequestTimeout(
                            "(not admitted)",
                            self._timeout,
                            detail=f"stage {exc.stage!r} had no ready replica for {wait:g}s",
                        ) from None
                    waited = f"no replica is ready after waiting {wait:g}s"
                    raise StageUnavailable(exc.stage, waited + self._whys(exc.stage)) from None
            if self._readiness is None or self._readiness.done():
                self._readiness = loop.create_future()
            # Shielded: one waiter's timeout must not cancel what the others wait on. Not
            # wait_for, which on Python 3.11 loses a cancel that lands as the wait ends.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await asyncio.shield(self._readiness)

    def _whys(self, stage: str) -> str:
        """Why the replicas of ``stage`` that are not ready went, as `` (...)`` ("" if none
        was declared dead)."""
        whys = [f"replica {r.replica} {r.why}" for r in self.replicas[stage].values() if r.why]
        return f" ({'; '.join(whys)})" if whys else ""

    def replica_ready(self, stage: str, replica: int) -> None:
        """Mark a replica ready; requests waiting for its stage try again."""
        view = self.replicas[stage][replica]
        view.ready = True
        view.why = ""
        self._wake_waiters()

    def replica_given_up(self, stage: str, replica: int) -> None:
        """A dead replica will not be restarted: requests stop waiting for it."""
        view = self.replicas[stage].get(replica)
        if view is not None:
            view.given_up = True
            self._wake_waiters()

    def _wake_waiters(self) -> None:
        if self._readiness is not None and not self._readiness.done():
            self._readiness.set_result(None)

    async def start(self, inputs: dict[str, Any]) -> ClientRequest:
        """Admit a request and deliver its input to every source stage.

        Raises:
            PayloadError: an input does not match its source stage's declared type.
            StageUnavailable: some stage had no ready replica for ``replica_wait``.
            RequestTimeout: the request's deadline passed while it waited for admission
                (``max_inflight`` requests were in flight all along), or for a ready
                replica of some stage.
            RequestAborted: the pipeline closed while the request waited.
        """
        loop = asyncio.get_running_loop()
        # The deadline counts from here: the time a request waits to be admitted is part
        # of the whole request that ``request_timeout`` bounds.
        deadline = None if self._timeout is None else loop.time() + self._timeout
        if set(inputs) != set(self._to_sources):
            raise PayloadError(f"inputs must be given for sources {sorted(self._to_sources)}")
        encoded = {}
        for src, value in inputs.items():
            tp = self._input_types[src]
            if isinstance(tp, type) and not isinstance(value, tp):
                raise PayloadError(
                    f"input for stage {src!r} must be {tp.__name__}, got {type(value).__name__}"
                )
            encoded[src] = codec_for(tp).encode(value)
        try:
            async with asyncio.timeout_at(deadline):
                await self._slots.acquire()
        except TimeoutError:
            assert self._timeout is not None
            raise RequestTimeout("(not admitted)", self._timeout) from None
        if self._closing:
            # Waited for a slot while the pipeline closed: the slot freed is a closing one.
            self._slots.release()
            raise RequestAborted("(not admitted)", "pipeline closing")
        try:
            chosen = await self._choose_all(deadline)
        except BaseException:
            self._slots.release()
            raise
        rid = f"{self._prefix}-{next(self._ids)}"
        route = {stage: r.replica for stage, r in chosen.items()}
        req = ClientRequest(rid, route)
        for sink, ch in self._from_sinks.items():
            # The client waits on sinks without a chunk timeout: a sink's first chunk may
            # follow the whole pipeline's work. Gaps are detected by the stages themselves,
            # dead replicas by the master, and a stuck request by its request_timeout.
            req.inflows[sink] = ch.open(rid, chunk_timeout=math.inf)
        self.requests[rid] = req
        self.counts["submitted"] += 1
        self.peak_active = max(self.peak_active, len(self.requests))
        admit = Admit(rid, route, self._token, {stage: r.endpoint for stage, r in chosen.items()})
        for stage, r in chosen.items():
            r.requests.add(rid)
            if stage in self._to_sources:
                self._send_control(stage, r.replica, admit)
        if deadline is not None:
            assert self._timeout is not None
            req.timer = loop.call_at(deadline, self.fail, rid, RequestTimeout(rid, self._timeout))
        try:
            for src, enc in encoded.items():
                r = chosen[src]
                target = SendTarget(r.endpoint, r.host, r.pid)
                await self._to_sources[src].send(rid, enc, True, target)
        except BaseException as exc:
            # Admitted everywhere but never fed: abort it, or every stage holds it forever.
            reason = (
                "cancelled while submitting"
                if isinstance(exc, asyncio.CancelledError)
                else str(exc)
            )
            self.abort(rid, reason)
            raise
        return req

    # ---- outputs -------------------------------------------------------------------------

    async def next_output(self, req: ClientRequest) -> tuple[str, Any]:
        """The next sink output of ``req`` as ``(sink, payload)``, in order per sink.

        Raises:
            EndOfChannel: every sink has sent its final chunk; the request is complete.
            PipelineError: the request failed, timed out or was aborted.
        """
        while True:
            if req.error is not None:
                # Ended while the client was between two reads: no read task may start now
                # (nobody would retrieve the error it ends with).
                raise req.error
            # A sink whose task already took its final chunk is still open until the value
            # in that task has been handed to the client.
            open_sinks = [
                s for s, f in req.inflows.items() if not f.buffer.finished or s in req.pending
            ]
            if not open_sinks:
                self.complete(req.request_id)
                raise EndOfChannel
            if len(open_sinks) == 1 and not req.pending:
                # One sink: read it directly, with no task per chunk.
                (sink,) = open_sinks
                try:
                    value = await self._from_sinks[sink].next(req.inflows[sink])
                except EndOfChannel:
                    continue
                except PipelineError as exc:
                    raise (req.error or exc) from None
                self._complete_if_read(req)
                return sink, value
            for sink in open_sinks:
                if sink not in req.pending:
                    req.pending[sink] = asyncio.ensure_future(
                        self._from_sinks[sink].next(req.inflows[sink])
                    )
            done, _ = await asyncio.wait(
                [req.pending[s] for s in open_sinks], return_when=asyncio.FIRST_COMPLETED
            )
            for sink in open_sinks:
                task = req.pending[sink]
                if task not in done:
                    continue
                del req.pending[sink]
                if task.cancelled():
                    raise req.error or RequestAborted(req.request_id, "cancelled")
                try:
                    value = task.result()
                except EndOfChannel:
                    continue
                except PipelineError as exc:
                    for other in req.pending.values():
                        other.add_done_callback(_consume_outcome)
                    raise (req.error or exc) from None
                self._complete_if_read(req)
                return sink, value

    def _complete_if_read(self, req: ClientRequest) -> None:
        """Complete ``req`` once the client holds every sink's final chunk.

        At once, not on the client's next read: a client that stops reading after the last
        output (a ``break`` on the final chunk) must not keep the request's slot and its
        state in every stage.
        """
        if not req.pending and all(f.buffer.finished for f in req.inflows.values()):
            self.complete(req.request_id)

    def abandon(self, rid: str) -> None:
        """The client dropped ``rid``'s output stream unread to its end: complete it if
        every output has arrived (a ``break`` on the last chunk, the end of the stream
        just behind it), else abort it."""
        req = self.requests.get(rid)
        if req is None:
            return
        if not req.pending and all(f.buffer.complete for f in req.inflows.values()):
            self.complete(rid)
            return
        self.abort(rid, "abandoned by the client (its output stream was dropped unfinished)")

    # ---- endings -------------------------------------------------------------------------

    def _finish(self, rid: str, exc: BaseException | None) -> ClientRequest | None:
        req = self.requests.pop(rid, None)
        if req is None:
            return None
        self._slots.release()
        if req.timer is not None:
            req.timer.cancel()
        for task in req.pending.values():
            # Aborting the buffers below wakes these with the request's error; nobody may
            # await them any more, so retrieve the outcome to keep asyncio quiet.
            task.add_done_callback(_consume_outcome)
        for inflow in req.inflows.values():
            inflow.end(exc)
        for ch in self._to_sources.values():
            ch.forget(rid)
        for stage, k in req.route.items():
            view = self.replicas[stage].get(k)
            if view is not None:
                view.requests.discard(rid)
        return req

    def complete(self, rid: str) -> None:
        """Every sink finished: every stage on the route forgets the request.

        The stages' Drops leave together within :data:`DROP_DELAY_S`.
        """
        req = self._finish(rid, None)
        if req is not None:
            self.counts["completed"] += 1
            for stage, k in req.route.items():
                self._drops.setdefault((stage, k), []).append(rid)
            self._drops_due += 1
            if self._drops_due >= DROP_BATCH:
                self.send_drops()
            elif self._drop_timer is None:
                loop = asyncio.get_running_loop()
                self._drop_timer = loop.call_later(DROP_DELAY_S, self.send_drops)

    def send_drops(self) -> None:
        """Send the Drops due now (the outbox batches them into one frame per replica)."""
        if self._drop_timer is not None:
            self._drop_timer.cancel()
            self._drop_timer = None
        drops, self._drops = self._drops, {}
        self._drops_due = 0
        for (stage, k), rids in drops.items():
            for rid in rids:
                self._send_control(stage, k, Drop(rid, self._token))

    def fail(self, rid: str, exc: PipelineError, *, outcome: str = "failed") -> None:
        """Fail a request at the client and abort it in every stage.

        ``outcome`` is the counter it ends in: ``failed``, or ``aborted`` for a cancel.
        """
        req = self.requests.get(rid)
        if req is None:
            return
        req.error = exc
        self._finish(rid, exc)
        self.counts[outcome] += 1
        abort = Abort(rid, wire_text(str(exc)), self._token)
        for stage, k in req.route.items():
            self._send_control(stage, k, abort)

    def abort(self, rid: str, reason: str) -> bool:
        """Cancel a request everywhere; False if it had already ended."""
        if rid not in self.requests:
            return False
        self.fail(rid, RequestAborted(rid, reason), outcome="aborted")
        return True

    def stage_reported(
        self, stage: str, ended: Sequence[str], drained: Sequence[tuple[str, str]]
    ) -> None:
        """A replica of ``stage`` tells (in its heartbeat) which requests ended there, and
        as (request id, upstream stage) which have all their payloads from that stage there
        (see ``StageActor.take_reports``).

        A replica is done with a request once the request ended there and each stage it
        sends to has all of its payloads of the request: nothing it sent is still needed
        from its process (a socket's queue or a shared-memory segment included). Should it
        die then, the request goes on; it no longer counts toward the replica's load either.
        A sink is never done early: the client's own reading ends the request.
        """
        requests = self.requests
        for rid, src in drained:
            req = requests.get(rid)
            if req is not None and src in self._downstream:
                req.drained.add((src, stage))
                self._release_if_done(req, src)
        for rid in ended:
            req = requests.get(rid)
            if req is not None:
                req.ended.add(stage)
                self._release_if_done(req, stage)

    def _release_if_done(self, req: ClientRequest, stage: str) -> None:
        downstream = self._downstream[stage]
        if stage in req.ended and downstream and req.drained.issuperset(downstream):
            view = self.replicas[stage].get(req.route[stage])
            if view is not None:
                view.requests.discard(req.request_id)

    def replica_lost(self, stage: str, replica: int, why: str) -> InDoubt:
        """A replica died: fail at once the requests that surely still needed it, and
        return those that may not have, for :meth:`judge` once their consumers have told
        what they have.

        Those it is known to be done with (see :meth:`stage_reported`) go on: a replica
        killed while a long decode runs downstream fails no request whose inputs decode
        already has. The rest are in doubt: its consumers' latest reports may not have
        come yet (they go every ``report_interval``); the requests of a sink, which the
        client reads, never are.
        """
        doubt = InDoubt(stage, replica, why)
        view = self.replicas[stage].get(replica)
        if view is None:
            return doubt
        view.ready = False
        view.why = why
        doubt.view = view
        downstream = self._downstream[stage]
        for rid in list(view.requests):
            req = self.requests.get(rid)
            if req is None:
                view.requests.discard(rid)
                continue
            missing = [edge[1] for edge in downstream if edge not in req.drained]
            if not downstream:
                self._lost(doubt, rid)
            elif missing:
                doubt.requests.append(rid)
                doubt.asks.update((dst, req.route[dst]) for dst in missing)
            else:
                # Every consumer has every payload of it: whatever the dead handler still
                # did, nothing it sent is needed from its process.
                view.requests.discard(rid)
                self._kept(req, stage)
        return doubt

    def judge(self, doubt: InDoubt) -> int:
        """Fail the requests in ``doubt`` that a consumer of the dead replica has not got
        every payload of (as reported by now); how many of the others go on (those that
        ended meanwhile are neither)."""
        downstream = self._downstream[doubt.stage]
        kept = 0
        for rid in doubt.requests:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.drained.issuperset(downstream):
                kept += 1
                if doubt.view is not None:
                    doubt.view.requests.discard(rid)
                self._kept(req, doubt.stage)
            else:
                self._lost(doubt, rid)
        return kept

    def _kept(self, req: ClientRequest, stage: str) -> None:
        """``req`` goes on without ``stage``, whose replica on its route died: what its
        producers send it is needed no more. Each is told so, sending nothing more, and
        counts as done with the request once it ended there (its death then fails it no
        more)."""
        rid = req.request_id
        for edge in self._upstream[stage]:
            up = edge[0]
            req.drained.add(edge)
            self._send_control(up, req.route[up], Gone(rid, stage, self._token))
            self._release_if_done(req, up)

    def _lost(self, doubt: InDoubt, rid: str) -> None:
        why = f"replica {doubt.replica} {doubt.why}"
        self.fail(rid, StageUnavailable(doubt.stage, why, request_id=rid))
        doubt.failed += 1

    # ---- data ----------------------------------------------------------------------------

    def on_data(self, frames: list[bytes]) -> None:
        """Handle one message (a batch of envelopes); garbage is counted and dropped."""
        if len(frames) > MAX_FRAMES:
            self.counts["garbage"] += len(frames)
            return
        for frame in frames:
            try:
                batch = decode_batch(frame)
            except DECODE_ERRORS:
                self.counts["garbage"] += 1
                continue
            for msg in batch:
                self._on_message(msg)

    def _on_message(self, msg: DataMessage) -> None:
        if isinstance(msg, Credit):
            out = self._src_by_edge.get(msg.edge)
            if out is not None:
                out.on_credit(msg)
            return
        if not isinstance(msg, Chunks):
            self.counts["garbage"] += 1  # request messages go to stages, never to the client
            return
        ch = self._by_edge.get(msg.edge)
        if ch is None:
            self.counts["garbage"] += 1
            return
        try:
            items = ch.admit(msg)
        except PipelineError as exc:
            self.counts["garbage"] += 1
            if isinstance(exc, TransportError) and msg.request_id in self.requests:
                # Outputs of a request that cannot be read: it cannot complete (see
                # StageActor._on_run).
                self.fail(msg.request_id, unreadable(msg, exc))
            return
        req = self.requests.get(msg.request_id)
        if req is None:
            for item in items:
                ch.discard(item)
            return
        file_run(req.inflows[ch.plan.src], msg, items)
        if req.timer is not None and all(f.buffer.complete for f in req.inflows.values()):
            # Every sink's final output is here: the request is done, however slowly its
            # client reads on, and its deadline must not throw away what it holds.
            req.timer.cancel()
            req.timer = None

    def readers_gone(self, endpoints: set[str]) -> None:
        """Source replicas at ``endpoints`` are gone: take back what is held for them."""
        for out in self._to_sources.values():
            out.readers_gone(endpoints)

    def statistics(self) -> dict[str, Any]:
        """The client side's counters and edges."""
        return {
            **self.counts,
            "active": len(self.requests),
            "peak_active": self.peak_active,
            "inputs": [ch.statistics() for ch in self._from_sinks.values()],
            "outputs": [ch.statistics() for ch in self._to_sources.values()],
            "oldest": self._oldest(),
        }

    def _oldest(self) -> dict[str, Any] | None:
        """Where the longest-active request stands at the client (requests are kept in the
        order they were admitted): its route, the stages that reported its end, and its
        position on each sink edge."""
        req = next(iter(self.requests.values()), None)
        if req is None:
            return None
        return {
            "request_id": req.request_id,
            "route": req.route,
            "ended": sorted(req.ended),
            "sinks": {src: inflow.describe() for src, inflow in req.inflows.items()},
        }

    async def aclose(self) -> None:
        """Abort every request and close every channel; idempotent."""
        self._closing = True
        self._wake_waiters()
        for rid in list(self.requests):
            self.abort(rid, "pipeline closing")
        self.send_drops()
        for out in self._to_sources.values():
            await out.aclose()
        for inp in self._from_sinks.values():
            await inp.aclose()
