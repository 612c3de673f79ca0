"""The master: control plane, replica registry, heartbeats and the orchestrator.

Its control socket is a ZMQ ROUTER. Workers register (``Register`` → ``Assignment``),
heartbeat, report readiness and failures, and answer statistics requests. A replica is
declared dead after a heartbeat timeout or, for local workers, the moment its process
exits; only the requests bound to it fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
import zmq

from pipeline._encoded import DECODE_ERRORS
from pipeline._errors import (
    MASTER_STAGE,
    ConfigError,
    FailureInfo,
    PipelineError,
    StageUnavailable,
    failure_to_error,
)
from pipeline._host import host_identity
from pipeline._keys import CLIENT
from pipeline._leftovers import sweep_after_deaths
from pipeline._local_link import LocalListener, local_links_enabled
from pipeline._logging import count_dropped
from pipeline._messages import (
    CLOSING,
    MAX_CONTROL_MESSAGE,
    STATS_WAIT_S,
    Abort,
    Admit,
    Assignment,
    ControlToClient,
    ControlToMaster,
    Drop,
    Failed,
    Finished,
    FromClient,
    Gone,
    Heartbeat,
    Hello,
    Peer,
    Peers,
    PeerTable,
    Ready,
    Register,
    ReportAsk,
    SetupFailed,
    Shutdown,
    StatsReply,
    StatsRequest,
    Submit,
)
from pipeline._messages import (
    encode_message as _encode,
)
from pipeline._orchestrator import InDoubt, Orchestrator, ReplicaView
from pipeline._pulse import pulse_identity
from pipeline._security import CurveKeys, secure_server, stop_guard
from pipeline._signature import EdgePlan, PipelinePlan
from pipeline._sockets import (
    Outbox,
    RefusedPeers,
    SocketReader,
    TooManyFrames,
    bind_ephemeral,
    new_context,
    set_heartbeats,
)
from transports._liveness import local_pid, pid_alive, pid_namespace
from transports._registry import AUTO, resolve_transport
from transports.inline import MAX_DATA_FRAME

__all__ = ("Master",)

log = structlog.get_logger("stagewire.master")

#: A replica heard from within this many heartbeat intervals is alive: a second worker
#: registering for its slot is refused rather than let displace it.
LIVE_WITHIN_BEATS = 2
#: How long a dead replica's requests in doubt wait at most for its consumers to tell what
#: they have (a consumer answers from its heartbeat thread, within milliseconds).
ASK_WAIT_S = 0.5
_decode = msgspec.msgpack.Decoder(ControlToMaster).decode


@dataclass(slots=True)
class _Replica:
    stage: str
    replica: int
    identity: bytes
    host: str
    pid: int
    endpoint: str
    last_seen: float
    ready: bool = False
    alive: bool = True
    inflight: int = 0
    local: str = ""
    pidns: int = 0
    #: Why it was declared dead, once it was.
    why: str = ""
    #: When it registered (``time.monotonic``): its setup is bounded by ``startup_timeout``
    #: from then, a replica restarted while the pipeline serves included.
    registered: float = 0.0


@dataclass(slots=True)
class _Ask:
    """Consumers asked for their reports about a dead replica's requests in doubt."""

    doubt: InDoubt
    #: The (stage, replica) pairs yet to answer.
    waiting: set[tuple[str, int]]
    timer: asyncio.TimerHandle


@dataclass(slots=True)
class _Startup:
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    error: str | None = None
    #: What start-up raises with ``error``: a placement that breaks the config is a
    #: ConfigError, anything else a PipelineError.
    error_type: type[PipelineError] = PipelineError
    #: The traceback of a stage's failed setup, as its worker formatted it.
    traceback: str = ""

    def fail(self, error: str, error_type: type[PipelineError] = PipelineError) -> None:
        """Fail start-up with ``error``, unless it is over or has already failed."""
        if not self.ready.is_set() and self.error is None:
            self.error, self.error_type = error, error_type
            self.ready.set()


def _host_local_edges(plan: PipelinePlan) -> dict[str, list[tuple[EdgePlan, str]]]:
    """Each stage's edges pinned to a host-local transport, with the stage at the other end."""
    found: dict[str, list[tuple[EdgePlan, str]]] = {}
    for stage in plan.stages.values():
        for edge in stage.outputs.values():
            kind = edge.transport.kind
            if edge.dst == CLIENT or kind == AUTO:
                continue
            if resolve_transport(kind).capabilities.host_local:
                found.setdefault(edge.src, []).append((edge, edge.dst))
                found.setdefault(edge.dst, []).append((edge, edge.src))
    return found


class Master:
    """The control plane of one pipeline, with its orchestrator."""

    def __init__(
        self,
        plan: PipelinePlan,
        *,
        bind: str | None = None,
        keys: CurveKeys | None = None,
        serves_clients: bool = False,
        device: str | None = None,
    ) -> None:
        self.plan = plan
        #: Where the outputs' tensors land at this master's own client (None: where sent from).
        self._device = device
        #: The pipeline's CURVE pair: every socket here authenticates and encrypts with it.
        self.keys = keys
        self.spec = plan.spec
        self._bind = bind or plan.spec.master.bind
        self.host = host_identity()
        #: Carried by the request messages the master sends on the data path.
        self.token = os.urandom(16)
        self.zctx = new_context()
        self.router = secure_server(self.zctx.socket(zmq.ROUTER), keys)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE)
        # A send to a peer no longer connected fails instead of vanishing: that is how the
        # client server learns that a remote client went away (its requests are cancelled).
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # No high-water mark: at the default of 1000 queued messages a peer's next ones are
        # dropped without a word, and a remote client's outputs (``stagewire submit``) are
        # data that must not be. A peer that goes away takes its queue with it.
        self.router.setsockopt(zmq.SNDHWM, 0)
        # ZMTP heartbeats: a peer cut off without a TCP close (a partition, a frozen host)
        # would otherwise stay connected for ever, and a remote client's requests run on for
        # nobody (a send into such a connection never fails). Its connection goes after
        # twice the heartbeat timeout of silence, when a worker gives up a silent master
        # too; the client server's next Alive to it then fails, and its requests are
        # cancelled. (A client's own HEARTBEAT_TTL is no substitute: ZMQ arms it only on
        # a PING, so a request sent just before the cut disarms it.)
        silence = 2 * plan.spec.defaults.heartbeat_timeout
        set_heartbeats(self.router, plan.spec.defaults.heartbeat_interval, silence, silence)
        self.inbox = secure_server(self.zctx.socket(zmq.PULL), keys)
        self.inbox.setsockopt(zmq.RCVHWM, 0)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.setsockopt(zmq.MAXMSGSIZE, MAX_DATA_FRAME)
        self.outbox = Outbox(self.zctx, keys)
        #: Same-host workers send the client's data here instead of to ``inbox``.
        self.local: LocalListener | None = None
        self.endpoint = ""
        self.data_endpoint = ""
        self.replicas: dict[tuple[str, int], _Replica] = {}
        #: Control identities of workers told that this master does not count them.
        self._told: OrderedDict[bytes, None] = OrderedDict()
        self.expected = {
            (stage, k) for stage, s in plan.spec.stages.items() for k in range(s.replicas)
        }
        self.startup = _Startup()
        self._host_local_edges = _host_local_edges(plan)
        self.garbage = 0
        self._tokens = itertools.count(1)
        #: Asks of consumers about dead replicas' requests, by token.
        self._asks: dict[int, _Ask] = {}
        self._stats: dict[int, tuple[asyncio.Future[None], list[dict[str, Any]], int]] = {}
        #: Told ``(stage, replica, pid)`` when a replica on this host is declared dead for
        #: silence while its process may still run (hung, or stopped): whoever started it
        #: can end it, so that its slot is restarted.
        self.on_silent: Callable[[str, int, int], object] | None = None
        #: Told (stage, replica, local pid) when a replica of this host becomes ready.
        self.on_ready: Callable[[str, int, int], object] | None = None
        self._readers: list[SocketReader] = []
        self._refusals: list[RefusedPeers] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.orchestrator: Orchestrator | None = None
        #: Handles remote clients' messages (``stagewire master``); None refuses them,
        #: unless ``serves_clients``: then a Hello waits for it (unanswered; clients ask
        #: again) and a Submit is answered MasterUnavailable.
        self.on_client: Callable[[bytes, FromClient], None] | None = None
        self.serves_clients = serves_clients
        self._closed = False
        #: Every socket is closed (by ``aclose`` or ``close_now``).
        self._released = False

    @property
    def orch(self) -> Orchestrator:
        """The orchestrator (available after :meth:`start`)."""
        assert self.orchestrator is not None, "master not started"
        return self.orchestrator

    async def start(self) -> None:
        """Bind the control and client data sockets and start heartbeating.

        Raises:
            PipelineError: the bind address is unusable (in use, not local).
        """
        try:
            self.endpoint = bind_ephemeral(self.router, self._bind)
            if self.endpoint.startswith("ipc://"):
                data_bind = self.endpoint + ".data"
            else:
                data_bind = self.endpoint.rsplit(":", 1)[0] + ":0"
            self.data_endpoint = bind_ephemeral(self.inbox, data_bind)
        except zmq.ZMQError as exc:
            raise PipelineError(
                f"the master cannot bind {self._bind!r}: {exc.strerror}; "
                "set master.bind to a free address of this host"
            ) from exc
        self.orchestrator = Orchestrator(
            self.plan,
            host=self.host,
            endpoint=self.data_endpoint,
            send_data=self.outbox.send,
            send_control=self.send_to,
            token=self.token,
            device=self._device,
        )
        self._control_reader = SocketReader(
            self.router, self._on_control, self._on_error, max_frames=2
        )
        on_data = self.outbox.flushing_after(self.orch.on_data)
        if local_links_enabled():
            self.local = LocalListener(self._on_error, max_message=MAX_DATA_FRAME)
            self.local.start(on_data)
        self._readers = [self._control_reader, SocketReader(self.inbox, on_data, self._on_error)]
        for reader in self._readers:
            reader.start()
        # Connections ZMQ refused before any message (garbage bytes, another protocol,
        # wrong keys) are counted with the garbage too. Each kept as made: a monitor left
        # open (the next one failing) would hold the context's termination for ever.
        for sock in (self.router, self.inbox):
            self._refusals.append(RefusedPeers(sock, self._dropped))
        self._tasks.append(asyncio.get_running_loop().create_task(self._heartbeat()))
        log.info("master_started", endpoint=self.endpoint, pipeline=self.spec.name)

    # ---- sending -------------------------------------------------------------------------

    def _send(self, identity: bytes, msg: Any) -> bool:
        """Send on the control socket; False if the peer is not connected (any more)."""
        try:
            self.router.send_multipart([identity, _encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            return False  # the peer vanished; heartbeats (or the client server) notice
        self._control_reader.kick()
        return True

    def send_client(self, identity: bytes, msg: ControlToClient) -> bool:
        """Answer a remote client on the control socket; False if it is gone (dropped)."""
        return self._send(identity, msg)

    def send_to(self, stage: str, replica: int, msg: Any) -> None:
        """Send a message to one replica, if it is registered and alive.

        A request's ``Admit``, ``Abort``, ``Drop`` and ``Gone`` go on the data path: in the
        same batch as (and ahead of) the request's input, so a source never holds input
        waiting for its Admit. Everything else goes on the control socket.
        """
        rep = self.replicas.get((stage, replica))
        if rep is not None and rep.alive:
            if isinstance(msg, Admit | Abort | Drop | Gone):
                self.outbox.send(rep.endpoint, _encode(msg))
            else:
                self._send(rep.identity, msg)

    def _peer_table(self) -> PeerTable:
        table: PeerTable = {stage: {} for stage in self.spec.stages}
        for rep in self.replicas.values():
            if rep.alive:
                table[rep.stage][rep.replica] = Peer(
                    rep.endpoint, rep.host, rep.local, rep.pid, rep.pidns
                )
        return table

    # ---- receiving -----------------------------------------------------------------------

    def _on_error(self, exc: BaseException, frames: list[bytes]) -> None:
        if isinstance(exc, TooManyFrames):  # a peer's garbage, not a failure here
            self._dropped(str(exc))
            return
        self.garbage += 1
        log.warning("message_failed", error=repr(exc))

    def _dropped(self, why: str) -> None:
        """Count a control message that is not one, or not for us (logged now and then)."""
        self.garbage = count_dropped(log, "garbage_dropped", self.garbage, why=why)

    def _on_control(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self._dropped(f"{len(frames)} frames")
            return
        identity, body = frames
        try:
            msg = _decode(body)
        except DECODE_ERRORS:
            self._dropped("not a control message")
            return
        if isinstance(msg, Register):
            self._register(identity, msg)
            return
        if isinstance(msg, FromClient):
            if self.on_client is not None:
                self.on_client(identity, msg)
            elif self.serves_clients and isinstance(msg, Submit):
                # Not serving yet (its workers not all ready) or any more (stopping). A
                # client's Hello waits unanswered (it asks again until its timeout), but a
                # request is answered: its client, whose connection came back before it
                # learnt that this is a new master, would otherwise wait on it for ever.
                why = (
                    "it is not serving (it is starting, waiting for its workers, or "
                    "stopping); submit again once it serves"
                )
                failure = FailureInfo("unavailable", why, stage=MASTER_STAGE)
                self._send(identity, Finished(msg.token, "MasterUnavailable", why, failure))
            elif not self.serves_clients and isinstance(msg, Submit | Hello):
                # A batch run never serves clients: it says so at once.
                self._send(
                    identity,
                    Finished(
                        msg.token,
                        "PipelineError",
                        "this master takes no submissions: it runs a batch of its own "
                        "(`stagewire run`); submit to one started with `stagewire master`",
                    ),
                )
            return
        rep = self.replicas.get((msg.stage, msg.replica))
        if rep is None or (
            rep.identity != identity
            # A worker's heartbeats come from its own thread's socket (see _pulse.py).
            and not (isinstance(msg, Heartbeat) and identity == pulse_identity(rep.identity))
        ):
            self._dropped(f"{type(msg).__name__} from no registered replica")
            if rep is None and isinstance(msg, Heartbeat):
                # A worker of the master this one replaced (restarted at its address).
                self._tell_unknown(identity, msg, "does not know it (it started since)")
            elif rep is not None and isinstance(msg, Heartbeat):
                # A worker declared dead (stopped, frozen) whose slot another took meanwhile:
                # told, it tries to register again and hears who holds the slot, instead of
                # beating on unheard until it gives the master up.
                why = f"gave its slot to another worker (pid {rep.pid} on {rep.host})"
                self._tell_unknown(identity, msg, why)
            return
        if not rep.alive and not isinstance(msg, SetupFailed):
            # Declared dead: what it still sends (a Ready, a heartbeat) must not revive it in
            # the orchestrator's view; a worker that is back registers anew. Its setup
            # error still counts: it says why start-up failed better than its exit code.
            self._dropped(f"{type(msg).__name__} from a replica declared dead")
            if isinstance(msg, Heartbeat) and rep.why:
                self._tell_unknown(identity, msg, f"declared it dead: it {rep.why}")
            return
        rep.last_seen = time.monotonic()
        match msg:
            case Heartbeat(inflight=inflight, ended=ended, drained=drained, answers=answers):
                rep.inflight = inflight
                self._note_stalled(rep, msg.stalled)
                if ended or drained:
                    self.orch.stage_reported(rep.stage, ended, drained)
                if answers:
                    # Asks reach a worker in the order sent, and its answer to one covers
                    # every earlier one: all were read by the time it took its reports.
                    key = (rep.stage, rep.replica)
                    for token in [t for t in self._asks if t <= answers]:
                        self._answered(token, key)
            case Ready():
                rep.ready = True
                self.orch.replica_ready(rep.stage, rep.replica)
                log.info("replica_ready", stage=rep.stage, replica=rep.replica, pid=rep.pid)
                pid = self._pid_here(rep)
                if pid and self.on_ready is not None:
                    self.on_ready(rep.stage, rep.replica, pid)
                if all(k in self.replicas and self.replicas[k].ready for k in self.expected):
                    self.startup.ready.set()
            case SetupFailed(message=message, traceback=trace):
                if self.startup.ready.is_set():
                    # A restart's setup failed (start-up's fails the start, which says why):
                    # the replica is dead now, not when its registration times out, and a
                    # request that waits for its stage in vain is told why.
                    log.error(
                        "stage_setup_failed", stage=msg.stage, replica=msg.replica, error=message
                    )
                    self.replica_lost(msg.stage, msg.replica, f"failed its setup: {message}")
                self.startup.error = f"stage {msg.stage!r} replica {msg.replica}: {message}"
                self.startup.traceback = trace
                self.startup.ready.set()
            case Failed(info=info):
                if info.kind == "unavailable" and info.stage != msg.stage:
                    # A consumer found the producer holding its payload gone. Where that
                    # process is on this host its death is declared now, before the failure
                    # reaches the client: a request made in answer must not be bound to it.
                    self._declare_exited(info.stage)
                self.orch.fail(info.request_id, failure_to_error(info))
            case StatsReply(token=token, stats=stats):
                entry = self._stats.get(token)
                if entry is not None:
                    fut, replies, wanted = entry
                    replies.append(stats)
                    if len(replies) >= wanted and not fut.done():
                        fut.set_result(None)

    def _tell_unknown(self, identity: bytes, beat: Heartbeat, why: str) -> None:
        """Tell a worker still beating that this master does not count it as serving (once
        per registration), instead of letting it beat on unheard until it gives the master
        up: one started by hand registers again, its stage still set up, and one a launcher
        started exits (code 4, logging why). Its control socket's identity is its heartbeat
        socket's, less the suffix."""
        control = identity.removesuffix(pulse_identity(b""))
        if control in self._told:
            return
        reason = f"the master {why}; its stage {beat.stage!r} replica {beat.replica} is not served"
        # Its control socket may not have reconnected yet (a restarted master hears the
        # heartbeat thread's first): the next beat tries again.
        if not self._send(control, Shutdown(reason, unknown=True)):
            return
        self._told[control] = None
        if len(self._told) > 1024:
            self._told.popitem(last=False)
        log.warning("unknown_worker_told", stage=beat.stage, replica=beat.replica, why=why)

    def _register(self, identity: bytes, msg: Register) -> None:
        key = (msg.stage, msg.replica)
        if msg.stage not in self.spec.stages or key not in self.expected:
            log.warning("unknown_replica_refused", stage=msg.stage, replica=msg.replica)
            # Told, so that it exits saying why instead of registering until it gives up.
            self._send(
                identity,
                Shutdown(
                    f"pipeline {self.spec.name!r} has no replica {msg.replica} of a stage "
                    f"{msg.stage!r} (its stages: {', '.join(self.spec.stages)})"
                ),
            )
            return
        old = self.replicas.get(key)
        if old is not None and old.identity == identity and old.alive:
            # A resend (the worker heard nothing yet): the same answer again.
            self._send(identity, self._assignment(msg.stage, msg.replica))
            return
        misplaced = self._misplaced(msg.stage, msg.replica, msg.host)
        if misplaced is not None:
            log.error("replica_refused", stage=msg.stage, replica=msg.replica, reason=misplaced)
            self._send(identity, Shutdown(misplaced))
            self.startup.fail(misplaced, ConfigError)
            return
        if old is not None and old.alive:
            duplicate = self._duplicate(old, msg)
            if duplicate is not None:
                refusal, retry_in = duplicate
                log.warning(
                    "duplicate_replica_refused",
                    stage=msg.stage,
                    replica=msg.replica,
                    pid=msg.pid,
                    host=msg.host,
                    holder=old.pid,
                    holder_host=old.host,
                )
                self._send(identity, Shutdown(refusal, retry_in=retry_in))
                return
            # Its process is gone (a new one has its host and pid), or it has gone quiet:
            # the newcomer takes the slot, and the old one, should it still run, is told.
            why = f"was replaced by a new registration (pid {msg.pid} on host {msg.host!r})"
            self._send(old.identity, Shutdown(f"stage {msg.stage!r} replica {msg.replica} {why}"))
            self.replica_lost(msg.stage, msg.replica, why)
        self.replicas[key] = _Replica(
            msg.stage,
            msg.replica,
            identity,
            msg.host,
            msg.pid,
            msg.data_endpoint,
            time.monotonic(),
            local=msg.local_endpoint,
            pidns=msg.pidns,
            registered=time.monotonic(),
        )
        # Should it be dropped again some day (see _tell_unknown), it is told again.
        self._told.pop(identity, None)
        self.outbox.reachable((msg.data_endpoint,))
        if self.local is not None and msg.local_endpoint and msg.host == self.host:
            self.outbox.set_local(msg.data_endpoint, msg.local_endpoint)
        view = ReplicaView(
            msg.stage, msg.replica, msg.data_endpoint, msg.host, local_pid(msg.pid, msg.pidns)
        )
        before = self.orch.replicas[msg.stage].get(msg.replica)
        if before is not None:
            view.why = before.why  # why the slot last went, until this worker is ready
        self.orch.replicas[msg.stage][msg.replica] = view
        log.info(
            "replica_registered",
            stage=msg.stage,
            replica=msg.replica,
            pid=msg.pid,
            host=msg.host,
            devices=msg.devices,
        )
        self._send(identity, self._assignment(msg.stage, msg.replica))
        self._broadcast_peers(but=identity)

    def _note_stalled(self, rep: _Replica, stalled: float) -> None:
        """Note whether ``rep``'s event loop has been held past the heartbeat timeout."""
        view = self.orch.replicas[rep.stage].get(rep.replica)
        if view is None:
            return
        now = stalled > self.spec.defaults.heartbeat_timeout
        if now != view.stalled:
            view.stalled = now
            if now:
                log.warning(
                    "replica_stalled",
                    stage=rep.stage,
                    replica=rep.replica,
                    held_for=round(stalled, 1),
                    reason="a handler holds its event loop; new requests go to other replicas",
                )
            else:
                log.info("replica_unstalled", stage=rep.stage, replica=rep.replica)

    def _duplicate(self, old: _Replica, msg: Register) -> tuple[str, float] | None:
        """Why a registration for a live replica's slot is refused, if it is, and in how
        many seconds the holder would count as quiet: the process holding the slot was
        heard from within two heartbeats, and is not the newcomer's predecessor (a process
        of the same host, pid namespace and pid must have ended), nor a process of this
        host that has exited (one killed and restarted at once).
        """
        if old.host == msg.host and old.pid == msg.pid and old.pidns == msg.pidns:
            return None
        if old.host == self.host:
            pid = local_pid(old.pid, old.pidns)
            if pid and not pid_alive(pid):
                return None
        silent = time.monotonic() - old.last_seen
        live_for = LIVE_WITHIN_BEATS * self.spec.defaults.heartbeat_interval
        if silent > live_for:
            return None
        reason = (
            f"stage {msg.stage!r} replica {msg.replica} is already served, by pid {old.pid} on "
            f"host {old.host!r} (heard from {silent:.1f}s ago); stop that worker first, or "
            "start this one with another --replica"
        )
        return reason, live_for - silent + self.spec.defaults.heartbeat_interval / 4

    def _broadcast_peers(self, but: bytes = b"") -> None:
        """Send the peer table to every live replica (but ``but``, which has it)."""
        peers = Peers(self._peer_table())
        for other in self.replicas.values():
            if other.alive and other.identity != but:
                self._send(other.identity, peers)

    def _misplaced(self, stage: str, replica: int, host: str) -> str | None:
        """Why a replica on ``host`` breaks an edge pinned to a host-local transport, if it does.

        shm and cuda_ipc descriptors name memory on one host, so every producer replica of
        such an edge must share a host with every consumer replica.
        """
        for edge, other_stage in self._host_local_edges.get(stage, ()):
            for other in self.replicas.values():
                if other.stage == other_stage and other.alive and other.host != host:
                    return (
                        f"edge {edge.name!r} is pinned to transport {edge.transport.kind!r}, "
                        f"which works within one host, but {stage!r} replica {replica} is on "
                        f"host {host!r} and {other_stage!r} replica {other.replica} on host "
                        f"{other.host!r}; place both stages on one host, or use 'network' "
                        "or 'auto' for this edge"
                    )
        return None

    def _assignment(self, stage: str, replica: int) -> Assignment:
        return Assignment(
            self.spec.to_dict(),
            stage,
            replica,
            Peer(
                self.data_endpoint,
                self.host,
                self.local.address if self.local else "",
                os.getpid(),
                pid_namespace(),
            ),
            self._peer_table(),
            self.token,
        )

    # ---- liveness ------------------------------------------------------------------------

    def _pid_here(self, rep: _Replica) -> int:
        """``rep``'s pid as this process sees it; 0 when it runs on another host or in
        another pid namespace."""
        return local_pid(rep.pid, rep.pidns) if rep.host == self.host else 0

    def _held_by(self, rep: _Replica, pid: int) -> bool:
        """Whether this host's process ``pid`` is the worker registered as ``rep``."""
        here = self._pid_here(rep)
        if here:
            return here == pid
        # Neither process could read its pid namespace: the raw pid is all there is.
        return rep.host == self.host and not rep.pidns and not pid_namespace() and rep.pid == pid

    def held_by_another(self, stage: str, replica: int, pid: int) -> bool:
        """Whether a live replica other than this host's process ``pid`` holds the slot."""
        rep = self.replicas.get((stage, replica))
        return rep is not None and rep.alive and not self._held_by(rep, pid)

    def replica_lost(self, stage: str, replica: int, why: str, pid: int = 0) -> None:
        """Declare a replica dead and fail only the requests bound to it.

        With ``pid`` (a local process that exited), only if that process holds the slot: a
        worker registered since in its place is not the one that died.
        """
        rep = self.replicas.get((stage, replica))
        if rep is not None and rep.alive and pid and not self._held_by(rep, pid):
            log.info("stale_exit_ignored", stage=stage, replica=replica, pid=pid, holder=rep.pid)
            return
        if rep is None or not rep.alive:
            if rep is None:
                # It died before it registered: start-up fails now, not at its timeout.
                self.startup.fail(f"stage {stage!r} replica {replica} {why} during start-up")
            return
        rep.alive = False
        rep.ready = False
        rep.why = why
        self.outbox.forget(rep.endpoint)
        # A consumer asked about an earlier death will not answer now.
        for token, ask in list(self._asks.items()):
            if (stage, replica) in ask.waiting:
                self._answered(token, (stage, replica))
        doubt = self.orch.replica_lost(stage, replica, why)
        self.orch.readers_gone({rep.endpoint})
        # The others drop their links to it and what their transports hold for it; those
        # on its host remove what it left in /dev/shm, as does this process on its own.
        self._broadcast_peers()
        if rep.host == self.host:
            sweep_after_deaths([self._pid_here(rep)])
        log.warning(
            "replica_dead",
            stage=stage,
            replica=replica,
            why=why,
            failed=doubt.failed,
            in_doubt=len(doubt.requests),
        )
        self.startup.fail(f"stage {stage!r} replica {replica} {why} during start-up")
        if doubt.requests:
            self._ask_consumers(doubt)

    def _ask_consumers(self, doubt: InDoubt) -> None:
        """Ask the consumers of a dead replica's requests in doubt for the reports they
        have not sent yet; judge the requests once every one has answered, or after
        :data:`ASK_WAIT_S`.

        A request whose every consumer of the replica already has every payload from it
        goes on; waiting for the consumers' next periodic reports instead would fail every
        request shorter than ``report_interval``.
        """
        token = next(self._tokens)
        waiting = set()
        if not self._closed:
            ask = ReportAsk(token)
            for key in doubt.asks:
                rep = self.replicas.get(key)
                if rep is not None and rep.alive and self._send(pulse_identity(rep.identity), ask):
                    waiting.add(key)
        if not waiting:
            self._judge(doubt)
            return
        timer = asyncio.get_running_loop().call_later(ASK_WAIT_S, self._answered, token, None)
        self._asks[token] = _Ask(doubt, waiting, timer)

    def _answered(self, token: int, replica: tuple[str, int] | None) -> None:
        """``replica`` answered ask ``token`` (None: its time is up)."""
        ask = self._asks.get(token)
        if ask is None:
            return
        if replica is not None:
            ask.waiting.discard(replica)
            if ask.waiting:
                return
        del self._asks[token]
        ask.timer.cancel()
        self._judge(ask.doubt)

    def _judge(self, doubt: InDoubt) -> None:
        before = doubt.failed
        kept = self.orch.judge(doubt)
        log.warning(
            "requests_in_doubt_judged",
            stage=doubt.stage,
            replica=doubt.replica,
            went_on=kept,
            failed=doubt.failed - before,
        )

    def _declare_exited(self, stage: str) -> None:
        """Declare dead every replica of ``stage`` on this host whose process has exited
        (its launcher, or its heartbeats, would say so a moment later)."""
        for rep in list(self.replicas.values()):
            if rep.stage != stage or not rep.alive:
                continue
            pid = self._pid_here(rep)  # 0 on another host
            if pid and not pid_alive(pid):
                self.replica_lost(stage, rep.replica, "exited")

    async def _heartbeat(self) -> None:
        interval = self.spec.defaults.heartbeat_interval
        timeout = self.spec.defaults.heartbeat_timeout
        setup_limit = self.spec.defaults.startup_timeout
        while True:
            await asyncio.sleep(interval)
            # If the loop was held, heartbeats may sit unread in the socket: read them before
            # judging anyone dead.
            self._control_reader.drain_now()
            now = time.monotonic()
            for rep in list(self.replicas.values()):
                if not rep.alive:
                    continue
                # A replica still importing and setting up its stage may hold the CPU for
                # longer than a heartbeat (loading a model); it is bounded by startup_timeout
                # and, when local, by its process exiting, so only ready ones are timed here.
                # Past start-up (which fails on its own timeout), a restarted replica whose
                # setup outlasts startup_timeout is dead too: it held its slot for good,
                # neither restarted nor given up, and each request waited replica_wait.
                why = ""
                if rep.ready and now - rep.last_seen > timeout:
                    why = f"missed heartbeats for {timeout:g}s"
                elif (
                    not rep.ready
                    and self.startup.ready.is_set()
                    and now - rep.registered > setup_limit
                ):
                    why = f"was not ready {setup_limit:g}s (startup_timeout) after registering"
                if why:
                    self.replica_lost(rep.stage, rep.replica, why)
                    pid = self._pid_here(rep)
                    if pid and self.on_silent is not None:
                        self.on_silent(rep.stage, rep.replica, pid)
                else:
                    beat = Heartbeat("@master", 0)
                    self._send(rep.identity, beat)
                    # And to its heartbeat thread, which judges the master when a handler
                    # holds the worker's loop (see Pulse._judge_master).
                    self._send(pulse_identity(rep.identity), beat)

    async def wait_ready(self, timeout: float) -> None:
        """Wait until every expected replica is ready.

        Raises:
            StageUnavailable: some replica did not become ready in time (named), or died.
            PipelineError: a stage failed to load or set up (its message included).
        """
        try:
            async with asyncio.timeout(timeout):
                await self.startup.ready.wait()
        except TimeoutError:
            missing = self.waiting_for()
            raise StageUnavailable(
                missing[0].split("[")[0],
                f"not ready after {timeout:g}s; waiting for {', '.join(missing)}",
            ) from None
        if self.startup.error is not None:
            error = self.startup.error_type(f"pipeline failed to start: {self.startup.error}")
            error.traceback = self.startup.traceback
            raise error

    def waiting_for(self) -> list[str]:
        """Replicas expected but not yet ready, as ``stage[k]``."""
        return sorted(
            f"{s}[{k}]"
            for s, k in self.expected
            if not ((s, k) in self.replicas and self.replicas[(s, k)].ready)
        )

    async def collect_statistics(self, timeout: float = STATS_WAIT_S) -> list[dict[str, Any]]:
        """Ask every live replica for its statistics; those answering within ``timeout``.

        Raises:
            Nothing: silent replicas are left out.
        """
        live = [r for r in self.replicas.values() if r.alive and r.ready]
        token = next(self._tokens)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        replies: list[dict[str, Any]] = []
        self._stats[token] = (fut, replies, len(live))
        for rep in live:
            self._send(rep.identity, StatsRequest(token))
        try:
            if live:
                async with asyncio.timeout(timeout):
                    await fut
        except TimeoutError:
            pass
        finally:
            del self._stats[token]
        return sorted(replies, key=lambda s: (s["stage"], s["replica"]))

    def close_now(self) -> None:
        """Close every socket without awaiting anything: for a master whose event loop has
        closed (its tasks died with it), or whose ``aclose`` was interrupted; idempotent.

        Raises:
            Nothing.
        """
        self._closed = True
        self._drop_asks()
        if self._released:
            return
        self._released = True
        with contextlib.suppress(RuntimeError):
            # Its waiter (a start still waiting) may belong to a loop that has closed.
            self.startup.fail("the pipeline was closed while it started")
        if self.local is not None:
            with contextlib.suppress(Exception):  # its loop is closed: only sockets to close
                self.local.close()
        with contextlib.suppress(Exception):
            # Its links to the workers' same-host listeners too: nothing else would close
            # them (the workers' ends go with the workers, and no loop turn reads that).
            self.outbox.close()
        stop_guard(self.zctx)
        self.zctx.destroy(linger=0)
        self._unlink_ipc()

    def _drop_asks(self) -> None:
        """Forget the asks still waiting: the requests in doubt end with the pipeline."""
        for ask in self._asks.values():
            ask.timer.cancel()
        self._asks.clear()

    def _unlink_ipc(self) -> None:
        for endpoint in (self.endpoint, self.data_endpoint):
            path = endpoint.removeprefix("ipc://")
            # ZMQ leaves a bound ipc socket's file behind. An abstract address (``@NAME``)
            # has none: a file of that name in the working directory is someone else's.
            if endpoint.startswith("ipc://") and not path.startswith("@"):
                with contextlib.suppress(OSError):
                    os.unlink(path)

    async def aclose(self) -> None:
        """Tell every worker to shut down and close the sockets; idempotent.

        Raises:
            Nothing.
        """
        if self._closed:
            return
        self._closed = True
        self._drop_asks()
        # A start still waiting for its replicas ends now, saying why.
        self.startup.fail("the pipeline was closed while it started")
        for rep in self.replicas.values():
            if rep.alive:
                self._send(rep.identity, Shutdown(CLOSING))
        if self.orchestrator is not None:
            await self.orchestrator.aclose()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for reader in self._readers:
            reader.stop()
        for refusals in self._refusals:
            refusals.stop()
        if self.local is not None:
            self.local.close()
        self.outbox.close()
        self.router.close(linger=500)
        self.inbox.close(linger=0)
        stop_guard(self.zctx)
        self.zctx.term()
        self._released = True
        self._unlink_ipc()
