"""The worker entry point: one process serving one replica of one stage.

``stagewire worker`` on a remote host and the local launcher of ``stagewire run`` and the
embedded :class:`~pipeline.Pipeline` all come here, so there is one code path::

    python -m pipeline._worker --master tcp://HOST:PORT --stage NAME [--replica K]

The worker binds its own ephemeral data port, registers with the master (retrying until
the master answers, so start order does not matter), sets its stage up, and serves until
told to shut down. If the master goes silent past twice the heartbeat timeout it exits
cleanly, unless a launcher whose process still lives started it (an embedded master's
loop may be held by its service for a while).
Told by a master that it is not counted as serving (declared dead while it could not beat,
or the master restarted since), a worker started by hand registers again, its stage still
set up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import math
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import structlog
import zmq

from pipeline import _collector
from pipeline._actor import StageActor
from pipeline._arguments import OneLineParser
from pipeline._config import PipelineSpec
from pipeline._cpu_idle import hold_cpu_idle
from pipeline._devices import check_device, visible_devices
from pipeline._encoded import DECODE_ERRORS
from pipeline._errors import (
    ConfigError,
    FailureInfo,
    TransportError,
    format_traceback,
    message_of,
)
from pipeline._exit_codes import (
    EXIT_INTERRUPTED,
    EXIT_MASTER_LOST,
    EXIT_REPLACED,
    EXIT_SETUP_FAILED,
)
from pipeline._host import (
    address_toward,
    host_identity,
    is_wildcard,
    split_endpoint,
    tcp_endpoint,
)
from pipeline._leftovers import sweep_after_deaths
from pipeline._local_link import LocalListener, local_links_enabled
from pipeline._logging import configure_logging, count_dropped
from pipeline._messages import (
    CLOSING,
    MAX_CONTROL_MESSAGE,
    Abort,
    Admit,
    Assignment,
    ControlToWorker,
    Drop,
    Failed,
    Gone,
    Peer,
    Peers,
    PeerTable,
    Ready,
    Register,
    SetupFailed,
    Shutdown,
    StatsReply,
    StatsRequest,
)
from pipeline._messages import (
    encode_message as _encode,
)
from pipeline._pulse import PAUSED_S, Pulse
from pipeline._scheduling import apply_scheduling
from pipeline._security import (
    process_keys,
    resolve_keys,
    secure_client,
    secure_server,
    set_process_keys,
    stop_guard,
)
from pipeline._signature import build_plan
from pipeline._sockets import (
    HandshakeWatch,
    Outbox,
    RefusedPeers,
    SocketReader,
    TooManyFrames,
    bind_ephemeral,
    for_endpoint,
    new_context,
)
from pipeline._stage import Stage
from pipeline._watchdog import Watchdog, end_now
from transports._liveness import local_pid, pid_namespace
from transports.inline import MAX_DATA_FRAME

__all__ = ("EXIT_MASTER_LOST", "EXIT_SETUP_FAILED", "main", "run_worker")


class Refused(Exception):
    """The master refused this worker's registration; the message says why.

    Attributes:
        retry_in: seconds after which registering again may succeed (the slot's holder
            may have died just now); 0 when it never will.
    """

    def __init__(self, reason: str, retry_in: float = 0.0) -> None:
        super().__init__(reason)
        self.retry_in = retry_in


class BindFailed(Exception):
    """The worker's data port cannot be bound at its ``--bind-host``."""


#: How many times a worker registers again for a slot whose holder was heard from lately.
SLOT_RETRIES = 3


#: When a worker registering with no answer first says so, and then how often, in seconds.
WAITING_NOTE_S = (2.0, 30.0)

log = structlog.get_logger("stagewire.worker")
_decode_control = msgspec.msgpack.Decoder(ControlToWorker).decode


def _die_with_parent(parent_pid: int, lifeline: int | None = None) -> None:
    """SIGTERM this process when its parent process ends.

    With ``lifeline`` (the read end of a pipe whose write end only the parent holds), a
    thread waits for its end of file, which comes however the parent ended. Without it,
    the kernel's parent-death signal stands in (Linux only); that comes when the parent's
    *thread* that started this process ends, which need not be the process.
    """
    if lifeline is not None:

        def watch() -> None:
            with contextlib.suppress(OSError):
                while os.read(lifeline, 1):
                    pass  # nothing is written to it: only its end of file counts
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, name="stagewire-lifeline", daemon=True).start()
    else:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:
        # The parent died before the watch began.
        raise SystemExit(EXIT_MASTER_LOST)


class _Reports:
    """What the heartbeat thread tells of a worker's requests (nothing before its actor)."""

    def __init__(self, worker: _Worker) -> None:
        self._worker = worker

    def inflight(self) -> int:
        actor = self._worker.actor
        return actor.inflight if actor is not None else 0

    def take_reports(self) -> tuple[list[str], list[tuple[str, str]]]:
        actor = self._worker.actor
        return actor.take_reports() if actor is not None else ([], [])

    def reports_left(self) -> int:
        actor = self._worker.actor
        return actor.reports_left() if actor is not None else 0

    def stalled(self) -> float:
        # Until it serves, a setup may hold the loop: that is startup_timeout's to bound.
        worker = self._worker
        if worker.actor is None or not worker.loop_tick:
            return 0.0
        return max(0.0, time.monotonic() - worker.loop_tick - worker.tick_every)


class _Worker:
    def __init__(
        self,
        master: str,
        stage: str,
        replica: int,
        bind_host: str,
        *,
        debug: bool = False,
        launched: bool = False,
    ) -> None:
        self.stage = stage
        #: Whether a failed setup is logged with its traceback.
        self.debug = debug
        #: Started by a local launcher, whose master reports a failed setup on one line (the
        #: worker's own log of it, on the same terminal, would say it twice).
        self.launched = launched
        #: The launcher's process (the master's), which a launched worker outlives by at
        #: most a SIGTERM (see ``_die_with_parent``); 0 when started by hand.
        self.parent = os.getppid() if launched else 0
        self.replica = replica
        #: The descriptor holding ``defaults.cpu_idle: poll`` in force, open until the end.
        self._cpu_idle_fd: int | None = None
        self.host = host_identity()
        self.zctx = new_context()
        self.master = master
        keys = process_keys()
        # Unique per process start, not only per pid: a restarted worker may get the same pid
        # (pid 1 in a container), and the master must not take it for the one before.
        # ZeroMQ caps an identity at 255 bytes; the stage's name is there only for reading.
        self.identity = f"{stage[:100]}/{replica}/{os.getpid()}/{secrets.token_hex(4)}".encode()
        self.control = secure_client(self.zctx.socket(zmq.DEALER), keys)
        #: Why the master refused this worker's handshake, once it has.
        self.refusal = ""
        self.control.setsockopt(zmq.IDENTITY, self.identity)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE)
        for_endpoint(self.control, master)
        #: Until the master answers: a handshake it refuses ends the worker at once.
        self._handshake = HandshakeWatch(self.control, master, keys, self._refused)
        self.control.connect(master)
        self.inbox = secure_server(self.zctx.socket(zmq.PULL), keys)
        self.inbox.setsockopt(zmq.RCVHWM, 0)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.setsockopt(zmq.MAXMSGSIZE, MAX_DATA_FRAME)
        try:
            self.endpoint = bind_ephemeral(self.inbox, tcp_endpoint(bind_host, 0))
        except zmq.ZMQError as exc:
            self._handshake.stop()
            self.inbox.close(linger=0)
            self.control.close(linger=0)
            self.zctx.term()
            raise BindFailed(exc.strerror or str(exc)) from exc
        # Connections ZMQ refused before any message (garbage bytes, another protocol,
        # wrong keys) are counted with the data port's garbage.
        self._refusals = RefusedPeers(self.inbox, self._refused_peer)
        self.outbox = Outbox(self.zctx, keys)
        #: Same-host peers send here instead of to ``inbox``; read once the actor exists.
        self.local: LocalListener | None = None
        if local_links_enabled():
            self.local = LocalListener(self._on_error, max_message=MAX_DATA_FRAME)
        self.peer_endpoints: set[str] = set()
        self.peers: PeerTable | None = None
        self.assignment: asyncio.Future[Assignment] | None = None
        self.actor: StageActor | None = None
        self.pulse: Pulse | None = None
        self.stop = asyncio.Event()
        #: Stopped by Ctrl-C (a worker started by hand).
        self.interrupted = False
        #: When the event loop last ran its periodic tick (``time.monotonic``; 0 before it
        #: serves), and how often it does: the heartbeat thread and the watchdog tell a
        #: held loop by it.
        self.loop_tick = 0.0
        self.tick_every = 1.0
        self._ticker: asyncio.TimerHandle | None = None
        #: Signals handled here while the replica serves (their default restored after).
        self.handled: list[signal.Signals] = []
        #: Whether a stop signal came (a plain attribute: set by a signal handler).
        self.signalled = False
        #: Armed by a signal to stop: ends the process if its loop never comes back.
        self.watchdog: Watchdog | None = None
        #: Told by the master that it does not count this worker as serving: it registers
        #: again (see :meth:`_rejoin`) unless it is stopping, or exits 4 if a launcher
        #: started it (``dropped``).
        self.rejoining = False
        self.dropped = False
        #: Told to stop because a newer worker took its slot: it exits 5, not restarted.
        self.replaced = False
        self.last_seen = time.monotonic()
        self.garbage = 0
        self.control_reader = SocketReader(self.control, self._on_control, self._on_error)
        self.data_reader: SocketReader | None = None

    def send_control(self, msg: Any) -> bool:
        """Send ``msg`` to the master; False when it was dropped: no master has been
        reachable for as long as a thousand messages took to pile up (a worker waiting
        for its master resends its registration every second)."""
        try:
            self.control.send(_encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.debug("control_message_dropped", stage=self.stage, message=type(msg).__name__)
            return False
        self.control_reader.kick()
        return True

    def _refused(self, reason: str) -> None:
        self.refusal = reason  # register() fails with it even if it had not started waiting
        if self.assignment is not None and not self.assignment.done():
            self.assignment.set_exception(Refused(reason))

    def _on_error(self, exc: BaseException, frames: list[bytes]) -> None:
        if isinstance(exc, TooManyFrames):  # a peer's garbage, not a failure here
            self.garbage = count_dropped(
                log, "garbage_dropped", self.garbage, stage=self.stage, why=str(exc)
            )
            return
        self.garbage += 1
        log.warning("message_failed", stage=self.stage, error=repr(exc))

    def _refused_peer(self, why: str) -> None:
        self.garbage = count_dropped(
            log, "garbage_dropped", self.garbage, stage=self.stage, socket="data", why=why
        )

    def _on_control(self, frames: list[bytes]) -> None:
        try:
            msg = _decode_control(frames[-1])
        except DECODE_ERRORS:
            self.garbage = count_dropped(
                log, "garbage_dropped", self.garbage, stage=self.stage, socket="control"
            )
            return
        self.last_seen = time.monotonic()
        actor = self.actor
        match msg:
            case Admit(request_id=rid, route=route, endpoints=endpoints) if actor is not None:
                actor.admit(rid, route, endpoints)
            case Abort(request_id=rid, reason=reason) if actor is not None:
                actor.abort(rid, reason)
            case Drop(request_id=rid) if actor is not None:
                actor.forget(rid)
            case Gone(request_id=rid, stage=stage) if actor is not None:
                actor.gone(rid, stage)
            case Peers(peers=peers):
                # Kept even while the stage is still in setup: the actor is built from the
                # latest table, not the one in the (older) Assignment.
                old, self.peers = self.peers, peers
                departed = self._forget_departed(peers)
                if actor is not None:
                    actor.set_peers(peers)
                    actor.readers_gone(departed)
                self._sweep_after(old, departed)
            case Assignment() if self.assignment is not None and not self.assignment.done():
                self._handshake.stop()
                # Its table is the latest until a Peers message that follows it.
                self.peers = msg.peers
                self.assignment.set_result(msg)
            case StatsRequest(token=token) if actor is not None:
                stats = actor.statistics()
                stats["garbage"] += self.garbage + (self.pulse.garbage if self.pulse else 0)
                stats["local_frames"] = 0
                # Sent to replicas gone from the peer table: dropped, not queued for ever.
                stats["dropped_sends"] = self.outbox.dropped
                if self.local is not None:
                    stats["garbage"] += self.local.garbage_count
                    stats["local_frames"] = self.local.frames
                self.send_control(StatsReply(self.stage, self.replica, token, stats))
            case Shutdown(reason=reason, retry_in=retry_in) if (
                retry_in > 0 and self.assignment is not None and not self.assignment.done()
            ):
                # Its slot's holder was heard from lately, but may have died just now (this
                # worker restarted in its place): register() tries again.
                self.assignment.set_exception(Refused(reason, retry_in))
            case Shutdown(reason=reason, unknown=unknown):
                assigned = self.assignment is not None and self.assignment.done()
                if unknown and assigned and not self.stop.is_set():
                    # Declared dead while it could not beat (stopped, frozen), or its master
                    # restarted: a worker started by hand registers again, its stage still
                    # set up; one a launcher started exits, for its master to start anew.
                    log.warning("dropped_by_master", stage=self.stage, reason=reason)
                    self.rejoining = not self.launched
                    self.dropped = self.launched
                elif assigned and not self.stop.is_set() and reason != CLOSING:
                    # Not the pipeline's end: say why this worker stops (it was replaced).
                    log.warning("stopped_by_master", stage=self.stage, reason=reason)
                    self.rejoining = False
                    self.replaced = True
                else:
                    self.rejoining = False
                self.stop.set()
                if self.assignment is not None and not self.assignment.done():
                    # Refused before it was assigned anything (a misplaced or unknown replica).
                    self.assignment.set_exception(Refused(reason))
            case _:
                pass

    def _forget_departed(self, peers: PeerTable) -> set[str]:
        """Drop the links to replicas missing from the master's new table; their endpoints.

        A socket to a dead replica's endpoint would hold its queued envelopes and retry
        the connection forever.
        """
        now = {p.endpoint for replicas in peers.values() for p in replicas.values()}
        departed = self.peer_endpoints - now
        for endpoint in departed:
            self.outbox.forget(endpoint)
        self.outbox.reachable(now)
        self.peer_endpoints = now
        for replicas in peers.values():
            for p in replicas.values():
                self._route(p)
        return departed

    def _reachable(self, client: Peer) -> Peer:
        """The master's data endpoint as this worker reaches it: a master bound to every
        interface (``--bind tcp://0.0.0.0:7600``) names the wildcard, which is no address
        to connect to; the host this worker reached the master at serves instead."""
        parts = split_endpoint(client.endpoint)
        master = split_endpoint(self.master)
        if parts is None or master is None or not is_wildcard(parts[0]):
            return client
        return msgspec.structs.replace(client, endpoint=tcp_endpoint(master[0], parts[1]))

    def _sweep_after(self, old: PeerTable | None, departed: set[str]) -> None:
        """Remove what the replicas of this host that left the table left in /dev/shm: a
        worker killed with ``kill -9`` cannot, and no launcher may be there to."""
        here = [
            local_pid(p.pid, p.pidns)
            for replicas in (old or {}).values()
            for p in replicas.values()
            if p.endpoint in departed and p.host == self.host
        ]
        if here:
            sweep_after_deaths(here)

    def _route(self, peer: Peer) -> None:
        """Send to a peer on this host over a same-host link, when both ends have one."""
        if self.local is not None and peer.local and peer.host == self.host:
            self.outbox.set_local(peer.endpoint, peer.local)

    async def register(self, timeout: float) -> Assignment:
        self.assignment = asyncio.get_running_loop().create_future()
        if self.refusal:
            self.assignment.set_exception(Refused(self.refusal))
        self.control_reader.start()
        register = Register(
            self.stage,
            self.replica,
            self.host,
            os.getpid(),
            self.endpoint,
            visible_devices(),
            local_endpoint=self.local.address if self.local is not None else "",
            pidns=pid_namespace(),
        )
        began = time.monotonic()
        deadline = began + timeout
        note = began + WAITING_NOTE_S[0]
        retries = SLOT_RETRIES
        while True:
            self.send_control(register)
            try:
                async with asyncio.timeout(1.0):
                    return await asyncio.shield(self.assignment)
            except Refused as exc:
                if not exc.retry_in or not retries or time.monotonic() + exc.retry_in > deadline:
                    raise
                retries -= 1
                log.info("slot_held", stage=self.stage, replica=self.replica, retry_in=exc.retry_in)
                self.assignment = asyncio.get_running_loop().create_future()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(exc.retry_in):
                        await self.stop.wait()
                if self.stop.is_set():
                    raise TimeoutError from None
            except TimeoutError:
                now = time.monotonic()
                if now > deadline:
                    raise
                if self.stop.is_set():
                    raise
                if now >= note:
                    # A worker started by hand says what it waits for, not nothing at all.
                    log.warning(
                        "waiting_for_master",
                        stage=self.stage,
                        replica=self.replica,
                        master=self.master,
                        waited_s=round(now - began),
                        gives_up_in_s=round(deadline - now) if deadline < math.inf else None,
                    )
                    note = now + WAITING_NOTE_S[1]

    def report_failure(self, info: FailureInfo) -> None:
        self.send_control(Failed(self.stage, self.replica, info))

    async def serve(self, connect_timeout: float) -> int:
        try:
            assignment = await self.register(connect_timeout)
        except TimeoutError:
            log.error("master_unreachable", stage=self.stage, timeout=connect_timeout)
            return EXIT_MASTER_LOST
        except Refused as exc:
            log.error("refused_by_master", stage=self.stage, replica=self.replica, reason=str(exc))
            return EXIT_SETUP_FAILED
        try:
            spec = PipelineSpec.from_dict(assignment.spec, source="<master>")
        except Exception as exc:
            return self._setup_failed(exc)
        # Beating from here on, through the setup too: the master then tells a replica in a
        # long setup (a model loading) from a dead one, and refuses a second worker for its
        # slot meanwhile.
        pulse = self.pulse = Pulse(
            self.zctx,
            self.master,
            self.identity,
            self.stage,
            self.replica,
            spec.defaults.heartbeat_interval,
            _Reports(self),
            spec.defaults.report_interval,
            # A launched worker ends with its master's process (its lifeline's end of file),
            # and waits while that lives; one started by hand judges it here too.
            master_timeout=2 * spec.defaults.heartbeat_timeout,
            on_master_lost=None if self.launched else self._master_lost_while_held,
        )
        pulse.start()
        try:
            return await self._serve(spec, assignment)
        finally:
            pulse.stop()

    async def _serve(self, spec: PipelineSpec, assignment: Assignment) -> int:
        """Set the stage up and serve it until told to stop; the exit code."""
        try:
            plan = build_plan(spec).stages[self.stage]
            # Before setup, so that the threads it starts (torch's) inherit the policy.
            apply_scheduling(plan.spec.scheduling)
            self._cpu_idle_fd = hold_cpu_idle(spec.defaults.cpu_idle)  # for the process's life
            check_device(plan.spec.device, self.stage)
            instance = plan.signature.cls(
                params=plan.params, name=self.stage, replica=self.replica, device=plan.spec.device
            )
            await instance.setup()
        # sys.exit() in a setup is its failure too ("model file not found"), said as such,
        # and so is a KeyboardInterrupt of its own in a launched worker (which ignores
        # Ctrl-C: its master stops it); one started by hand was interrupted.
        except (Exception, SystemExit) as exc:
            return self._setup_failed(exc)
        except KeyboardInterrupt as exc:
            if not self.launched:
                raise
            return self._setup_failed(exc)
        actor = StageActor(
            plan,
            instance,
            replica=self.replica,
            host=self.host,
            endpoint=self.endpoint,
            send=self.outbox.send,
            report_failure=self.report_failure,
            max_inflight=spec.defaults.max_inflight,
            outbox=self.outbox,
            token=assignment.token,
        )
        try:
            # An edge pinned to shm takes its segment now: a host without the room says so
            # at start-up, with the sizes, instead of failing requests mid-run.
            await actor.reserve()
        except TransportError as exc:
            await actor.aclose()
            await self._teardown(instance)
            return self._setup_failed(exc)
        peers = self.peers if self.peers is not None else assignment.peers
        self._forget_departed(peers)
        client = self._reachable(assignment.client)
        self._route(client)
        actor.set_peers(peers, client)
        self.actor = actor
        on_data = self.outbox.flushing_after(actor.on_data)
        self.data_reader = SocketReader(self.inbox, on_data, self._on_error)
        self.data_reader.start()
        if self.local is not None:
            self.local.start(on_data)
        # From here a SIGTERM (from the launcher, or at the parent's death) ends the worker in
        # order. Until now it kept its default action, so that a setup that hangs, or holds
        # the loop, cannot outlive the master. Python-level handlers, not the loop's: they
        # run even while a handler holds the loop, and arm the watchdog that ends a worker
        # whose loop never comes back.
        self.tick_every = spec.defaults.heartbeat_interval
        self._tick()
        self.watchdog = Watchdog(
            self.stage, self.replica, 2 * spec.defaults.heartbeat_timeout, self._loop_seen
        )
        self.watchdog.start()
        self._on_signal(signal.SIGTERM, self._terminate)
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            # Started by hand: Ctrl-C stops it in order too (one a launcher started ignores
            # it, and is stopped by its master).
            self._on_signal(signal.SIGINT, self._interrupt)
        # Start-up's objects (torch, the stage, its weights) are frozen out of every later
        # collection before the first request can arrive.
        _collector.settle()
        defaults = spec.defaults
        master_timeout = 2 * defaults.heartbeat_timeout
        log.info("stage_started", stage=self.stage, replica=self.replica, endpoint=self.endpoint)
        code: int | None = None
        while code is None:
            self.send_control(Ready(self.stage, self.replica))
            code = await self._watch_master(defaults.heartbeat_interval, master_timeout)
            if self.rejoining:
                code = await self._rejoin(spec, actor, master_timeout)
        await actor.aclose()
        await self._teardown(instance)
        if self.dropped:
            return EXIT_MASTER_LOST
        if self.replaced:
            return EXIT_REPLACED
        return EXIT_INTERRUPTED if self.interrupted else code

    async def _rejoin(self, spec: PipelineSpec, actor: StageActor, timeout: float) -> int | None:
        """Register again with a master that no longer counts this replica (it declared it
        dead while it could not beat, or it was restarted at its address), keeping the
        stage as it is set up: a model is not loaded again. None once it serves again; else
        the exit code (4: no master took it back in ``timeout`` seconds, another worker has
        its slot, or the master's pipeline is not the one this worker serves).

        Every request held here is dropped first: that master failed those bound to this
        replica, or never knew them.
        """
        self.rejoining = False
        self.stop.clear()
        actor.forget_all("its master stopped counting this replica, which registers again")
        try:
            assignment = await self.register(timeout)
        except TimeoutError:
            if self.stop.is_set():
                return 0
            log.error("master_lost", stage=self.stage, silent_for=timeout)
            return EXIT_MASTER_LOST
        except Refused as exc:
            log.error("rejoin_refused", stage=self.stage, replica=self.replica, reason=str(exc))
            return EXIT_MASTER_LOST
        try:
            served = PipelineSpec.from_dict(assignment.spec, source="<master>")
            # The same pipeline, wherever the master binds and however its keys were given
            # (the command line fills its ``master`` section: a wildcard for an address, a
            # path spelt otherwise, the keys by the environment).
            same = served.model_copy(update={"master": spec.master}) == spec
        except Exception:
            same = False
        if not same:
            log.error(
                "pipeline_changed",
                stage=self.stage,
                replica=self.replica,
                reason="the master serves another pipeline than this worker set up: start "
                "the worker anew",
            )
            return EXIT_MASTER_LOST
        assert self.peers is not None  # set with the Assignment
        departed = self._forget_departed(self.peers)
        client = self._reachable(assignment.client)
        self._route(client)
        actor.rejoined(assignment.token, self.peers, client)
        actor.readers_gone(departed)
        log.warning("rejoined", stage=self.stage, replica=self.replica, endpoint=self.endpoint)
        return None

    def _master_lost_while_held(self, silent: float) -> None:
        """From the heartbeat thread: the master has been silent, and a handler has held
        the event loop, for twice the heartbeat timeout. The loop cannot see the master go
        (it judges it between handlers), so the process ends here, exit code 4."""
        log.error(
            "master_lost",
            stage=self.stage,
            silent_for=round(silent, 1),
            reason="a handler holds the event loop: the worker ends without finishing it",
        )
        end_now(EXIT_MASTER_LOST)

    def _tick(self) -> None:
        """Note that the loop runs, every ``tick_every`` seconds while the worker lives."""
        self.loop_tick = time.monotonic()
        self._ticker = asyncio.get_running_loop().call_later(self.tick_every, self._tick)

    def _loop_seen(self) -> float:
        return self.loop_tick

    def stop_ticking(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None

    def _on_signal(self, sig: signal.Signals, stop: Callable[[], None]) -> None:
        """Have ``sig`` call ``stop`` on the loop, and arm the watchdog: at the first signal
        for a launched worker (its master's process may be gone, the kernel's signal at
        its death: nothing else would end it), at the second for one started by hand
        (whoever stops it, a person or a service manager, can insist; a slow model step
        must be let finish, not cut short twice the heartbeat timeout after a Ctrl-C)."""
        loop = asyncio.get_running_loop()
        watchdog = self.watchdog
        assert watchdog is not None

        def handler(signum: int, frame: object) -> None:
            # No lock taken here: a second signal runs this nested inside the first.
            if self.launched or self.signalled:
                watchdog.arm(128 + signum)  # the code the signal would have ended it with
            self.signalled = True
            if not loop.is_closed():
                loop.call_soon_threadsafe(stop)

        signal.signal(sig, handler)
        self.handled.append(sig)

    def _interrupt(self) -> None:
        self.interrupted = True
        self._terminate()

    def _terminate(self) -> None:
        self.rejoining = False
        self.stop.set()

    def _setup_failed(self, exc: BaseException) -> int:
        """Tell the master why this replica cannot serve; the exit code that says so."""
        message = f"{type(exc).__name__}: {message_of(exc)}"
        trace = format_traceback(exc)
        if self.debug:
            log.error("stage_setup_failed", stage=self.stage, error=message, traceback=trace)
        elif not self.launched:
            log.error("stage_setup_failed", stage=self.stage, error=message)
        self.send_control(SetupFailed(self.stage, self.replica, message, traceback=trace))
        return EXIT_SETUP_FAILED

    async def _teardown(self, instance: Stage) -> None:
        try:
            await instance.teardown()
        except Exception as exc:
            log.warning("stage_teardown_failed", stage=self.stage, error=repr(exc))

    async def _watch_master(self, interval: float, master_timeout: float) -> int:
        """Serve until told to stop (0), or until the master is lost (4).

        A master silent for ``master_timeout`` is lost, except to a launched worker while
        the launcher's process lives: a master embedded in a service beats from the
        service's event loop, and a loop held for a while (a blocking call, a debugger's
        breakpoint) must not cost the service its workers. Such a worker waits, warning
        once per silence, and exits with the process (its lifeline: see _die_with_parent).

        Silence while the process did not run (stopped, its VM frozen) does not count: its
        heartbeat thread tells that from a loop held by a handler (by the CPU time spent)
        as the process resumes, beats at once, and the master's silence is timed from then.
        """
        assert self.actor is not None
        noted = False  # whether the current silence was logged
        round_at = time.monotonic()
        deferred = False
        while not self.stop.is_set():
            now = time.monotonic()
            late, round_at = now - round_at > interval + PAUSED_S, now
            self.actor.sweep(now)
            # A late round may follow a pause, which the heartbeat thread notes as soon as
            # the process runs again: it is judged at the next round, never two running.
            deferred = late and not deferred
            if not deferred:
                pulse = self.pulse
                paused_at = pulse.paused_at if pulse is not None else 0.0
                if time.monotonic() - max(self.last_seen, paused_at) > master_timeout:
                    # The loop may just have been held by a long handler: read what the
                    # master sent meanwhile before concluding it is gone.
                    self.control_reader.drain_now()
                silent = time.monotonic() - max(self.last_seen, paused_at)
                if silent <= master_timeout:
                    if noted:
                        log.info("master_heard_again", stage=self.stage, replica=self.replica)
                        noted = False
                elif self.parent and os.getppid() == self.parent:
                    if not noted:
                        noted = True
                        log.warning(
                            "master_silent",
                            stage=self.stage,
                            replica=self.replica,
                            silent_for=round(silent, 1),
                            reason=f"its process (pid {self.parent}) lives, its event loop "
                            "held: waiting for it",
                        )
                else:
                    log.error("master_lost", stage=self.stage, silent_for=master_timeout)
                    return EXIT_MASTER_LOST
            try:
                async with asyncio.timeout(interval):
                    await self.stop.wait()
            except TimeoutError:
                pass
        return 0

    def close(self) -> None:
        self._handshake.stop()
        self.control_reader.stop()
        if self.data_reader is not None:
            self.data_reader.stop()
        self._refusals.stop()
        if self.local is not None:
            self.local.close()
        self.outbox.close()
        # A short linger lets the last control message (Goodbye, SetupFailed) leave; a dead
        # master costs at most this long at exit.
        self.control.close(linger=500)
        self.inbox.close(linger=0)
        stop_guard(self.zctx)
        self.zctx.term()


async def run_worker(
    master: str,
    stage: str,
    replica: int = 0,
    *,
    bind_host: str | None = None,
    connect_timeout: float = 300.0,
    debug: bool = False,
    launched: bool = False,
    bound_exit: bool = False,
) -> int:
    """Serve one replica of ``stage`` for the master at ``master``; returns an exit code.

    With ``bound_exit`` (the worker command, whose process ends with it), the process is
    ended a grace after its loop's last tick should its exit hang on a thread that never
    returns; a caller that goes on after it returns leaves it False.

    The data port binds ``bind_host``; by default this host's address toward the master.

    Raises:
        OSError: no ``bind_host`` given, and the master's host does not resolve.
        BindFailed: ``bind_host`` is not an address of this host.
    """
    worker = _Worker(
        master, stage, replica, bind_host or address_toward(master), debug=debug, launched=launched
    )
    code = 1  # an exception's, should the exit then hang
    try:
        code = await worker.serve(connect_timeout)
        return code
    finally:
        for sig in worker.handled:
            default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            signal.signal(sig, default)
        worker.stop_ticking()
        worker.close()
        if worker.watchdog is not None and bound_exit:
            # What is left of the process's exit is bounded too (see Watchdog.exiting).
            worker.watchdog.exiting(code)


def parser() -> OneLineParser:
    """The worker's command-line arguments (shared with ``stagewire worker``)."""
    p = OneLineParser(prog="stagewire worker", description=__doc__.split("\n")[0])
    p.add_argument("--master", required=True, help="the master's control endpoint")
    p.add_argument("--stage", required=True, help="the stage this worker serves")
    p.add_argument("--replica", type=int, default=0, help="the replica index (default 0)")
    p.add_argument(
        "--bind-host",
        default=None,
        metavar="ADDRESS",
        help="the address this host's peers reach its data port at "
        "(default: this host's address toward the master)",
    )
    p.add_argument(
        "--connect-timeout", type=float, default=300.0, help="seconds to reach the master"
    )
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--parent-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--headless",
        action="store_true",
        help="log JSON lines even on a terminal (for a log collector); otherwise they are "
        "rendered for reading when stderr is a terminal",
    )
    p.add_argument(
        "--debug",
        action="store_true",
        help="log at debug level (unless STAGEWIRE_LOG_LEVEL says otherwise), and a "
        "failed setup with its traceback",
    )
    p.add_argument(
        "--keys",
        metavar="DIR",
        default=None,
        help="the pipeline's CURVE key pair (stagewire keys DIR); default: $STAGEWIRE_KEYS",
    )
    return p


def master_endpoint_problem(endpoint: str) -> str | None:
    """What is wrong with ``endpoint`` as a master's address to connect to; None if nothing.

    It must be ``tcp://HOST:PORT`` (a host to reach, not a wildcard; a port from 1 to
    65535) or ``ipc://PATH``: ZeroMQ itself fails a malformed one with a traceback, or
    waits on it forever.
    """
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return None
    parts = split_endpoint(endpoint)
    if parts is None:
        return "is not a control endpoint (tcp://HOST:PORT)"
    host, port = parts
    if not host or is_wildcard(host):
        return "names no host to reach: give the master's address, such as tcp://10.0.0.5:7600"
    if not 0 < port < 65536:
        return f"has port {port}, outside 1-65535"
    return None


def main(argv: list[str] | None = None) -> int:
    """Run a worker from command-line arguments; returns the exit code."""
    # Off while the stage imports and sets up; on again, frozen, before it serves.
    _collector.pause()
    p = parser()
    args = p.parse(argv)
    problem = master_endpoint_problem(args.master)
    if problem is not None:
        p.error(f"--master {args.master!r} {problem}")
    if args.replica < 0:
        p.error(f"--replica must be 0 or more, not {args.replica}")
    if not args.connect_timeout > 0:  # NaN included: a deadline never reached
        p.error(
            f"--connect-timeout must be a positive number of seconds (inf: wait for ever), "
            f"not {args.connect_timeout:g}"
        )
    if args.bind_host is not None and is_wildcard(args.bind_host):
        p.error(
            f"--bind-host {args.bind_host!r} binds every interface, but peers are told the "
            "address bound: give one they reach this host at (or leave it out for this "
            "host's address toward the master)"
        )
    if args.bind_host is None:
        try:
            args.bind_host = address_toward(args.master)
        except OSError as exc:
            p.error(
                f"cannot tell this host's address toward the master {args.master!r} "
                f"({exc.strerror or exc}); pass --bind-host ADDRESS"
            )
    try:
        set_process_keys(resolve_keys(args.keys))
    except ConfigError as exc:
        p.error(str(exc))
    configure_logging(
        os.environ.get("STAGEWIRE_LOG_LEVEL") or ("debug" if args.debug else None),
        json=True if args.headless else None,
    )
    if args.parent_pid is not None:
        # A locally launched worker: the master handles Ctrl-C and shuts us down in order.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _die_with_parent(args.parent_pid, args.parent_fd)
    else:
        # Started by hand, perhaps on a host of its own, where no launcher sweeps: the shm
        # segments of this host's dead stagewire processes (a worker killed -9 before this
        # one) go now, not when some process next makes a segment, which a worker that only
        # reads never does.
        from transports.shm import sweep_dead_owners

        swept = sweep_dead_owners()
        if swept:
            log.info("shm_segments_swept", count=len(swept))
    work = run_worker(
        args.master,
        args.stage,
        args.replica,
        bind_host=args.bind_host,
        connect_timeout=args.connect_timeout,
        debug=args.debug,
        launched=args.parent_pid is not None,
        bound_exit=True,
    )
    try:
        profile_dir = os.environ.get("STAGEWIRE_PROFILE_DIR")
        if not profile_dir:
            return asyncio.run(work)
        # A developer's view of where a worker's time goes: one cProfile dump per replica.
        import cProfile

        with cProfile.Profile() as prof:
            code = asyncio.run(work)
        where = os.path.join(profile_dir, f"{args.stage}-{args.replica}-{os.getpid()}.prof")
        prof.dump_stats(where)
        return code
    except KeyboardInterrupt:
        # Ctrl-C before it served (it then stops in order, see _Worker._serve).
        with contextlib.suppress(OSError, ValueError):  # (a stderr whose reader has gone)
            sys.stderr.write("interrupted\n")
            sys.stderr.flush()
        return EXIT_INTERRUPTED
    except BindFailed as exc:
        p.error(f"--bind-host {args.bind_host!r} cannot be bound here ({exc})")


if __name__ == "__main__":
    sys.exit(main())
