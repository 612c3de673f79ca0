"""A worker's heartbeat, sent from its own thread.

A stage may hold the event loop for seconds (a large prefill on the CPU, a model load).
Heartbeats sent from the loop would stop meanwhile and the master would declare a healthy
replica dead, so they come from a thread with its own ZMQ socket instead. The socket's
identity is the control socket's plus ``/hb``, which the master accepts for that replica.

The same thread answers the master's :class:`ReportAsk` at once. When a replica dies, the
master asks its consumers for what they have not yet reported before it fails the
replica's requests, and a consumer whose loop a long handler holds must still answer.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
import zmq

from pipeline._messages import Heartbeat, ReportAsk
from pipeline._messages import encode_message as _encode
from pipeline._security import process_keys, secure_client
from pipeline._sockets import for_endpoint

__all__ = ("Pulse", "Reporter", "pulse_identity")

_decode_from_master = msgspec.msgpack.Decoder(ReportAsk | Heartbeat).decode
#: Messages read per wake-up at most; any more wait for the next (the master sends one
#: ask per death).
_MAX_ASKS = 64
#: Reports a worker keeps while its beats cannot leave, at most, of each kind.
_UNSENT_KEPT = 4096
#: A wait that returns this many seconds later than asked, the process having spent less
#: than half that late time on the CPU, means the process did not run meanwhile (stopped
#: by SIGSTOP, its VM frozen, or starved): silence across that gap says nothing of the
#: master, which gets a whole ``master_timeout`` from then to answer.
PAUSED_S = 1.0


def pulse_identity(control_identity: bytes) -> bytes:
    """The identity of the heartbeat socket belonging to a control socket."""
    return control_identity + b"/hb"


class Reporter(Protocol):
    """What a beat tells; each method is called from the heartbeat thread, so each must be
    safe to call from there while the event loop runs."""

    def inflight(self) -> int:
        """Requests the replica holds."""
        ...

    def take_reports(self) -> tuple[list[str], list[tuple[str, str]]]:
        """Requests ended, and (request, upstream stage) pairs drained, since the last call
        (a bounded number per call)."""
        ...

    def reports_left(self) -> int:
        """Reports still queued after the last :meth:`take_reports`."""
        ...

    def stalled(self) -> float:
        """For how many seconds the event loop has not run (0 while it runs)."""
        ...


class Pulse:
    """Sends ``Heartbeat`` every ``interval`` seconds until stopped, with what the
    ``reporter`` tells of requests within ``report_every`` seconds, and at once when the
    master asks (:class:`ReportAsk`, read by this thread itself, so a replica whose loop is
    held by a long handler still answers)."""

    def __init__(
        self,
        zctx: zmq.Context[Any],
        master: str,
        identity: bytes,
        stage: str,
        replica: int,
        interval: float,
        reporter: Reporter,
        report_every: float,
        *,
        master_timeout: float = 0.0,
        on_master_lost: Callable[[float], None] | None = None,
    ) -> None:
        self._zctx = zctx
        self._master = master
        self._identity = pulse_identity(identity)
        self._stage = stage
        self._replica = replica
        self._interval = interval
        self._reporter = reporter
        self._report_every = report_every
        self._stopped = threading.Event()
        # stop() writes here, waking the thread out of its poll.
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="stagewire-pulse", daemon=True)
        #: Messages read on this thread's socket that were not the master's, dropped.
        self.garbage = 0
        #: Called (from this thread, with the seconds of silence) once the master has been
        #: silent here, and the event loop held, for ``master_timeout``: the loop cannot
        #: judge the master while a handler holds it (None: never; see _Worker).
        self._on_master_lost = on_master_lost
        self._master_timeout = master_timeout
        #: When the master was last heard on this thread's socket (its beats come here too).
        self.master_seen = time.monotonic()
        #: When this thread last found the process had not run for a while (0: never): the
        #: master's silence across that gap does not count (see PAUSED_S).
        self.paused_at = 0.0

    def start(self) -> None:
        """Start beating."""
        self._thread.start()

    def _run(self) -> None:
        sock = secure_client(self._zctx.socket(zmq.DEALER), process_keys())
        sock.setsockopt(zmq.IDENTITY, self._identity)
        sock.setsockopt(zmq.LINGER, 0)
        # Heartbeats must not pile up while the master is unreachable: keep only a few.
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.setsockopt(zmq.MAXMSGSIZE, 1024)
        for_endpoint(sock, self._master).connect(self._master)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        reporter = self._reporter
        report_ms = self._report_every * 1000
        due = 0.0  # when the next beat is due even with nothing to report
        asked = 0  # the latest ask not yet answered
        # Reports taken whose beat could not leave (the master unreachable, a few beats
        # queued already): they go with the next beat that does.
        ended: list[str] = []
        drained: list[tuple[str, str]] = []
        try:
            while not self._stopped.is_set():
                # Reading an int another thread updates is safe under the GIL; a stale value
                # only delays the master's view of the load by one beat.
                more_ended, more_drained = reporter.take_reports()
                ended += more_ended
                drained += more_drained
                left = reporter.reports_left()
                now = time.monotonic()
                answer = asked if not left else 0
                if ended or drained or now >= due or answer:
                    beat = Heartbeat(
                        self._stage,
                        self._replica,
                        reporter.inflight(),
                        tuple(ended),
                        tuple(drained),
                        answer,
                        reporter.stalled(),
                    )
                    try:
                        sock.send(_encode(beat), zmq.NOBLOCK)
                    except zmq.Again:
                        # Kept for the next beat, the oldest dropped past the bound: a lost
                        # report fails no request that needs it, only one that could go on.
                        del ended[:-_UNSENT_KEPT], drained[:-_UNSENT_KEPT]
                        left = 0  # taking the rest would only pile them up: wait a beat
                    else:
                        ended, drained = [], []
                        if answer:
                            asked = 0
                    due = now + self._interval
                if left:
                    continue  # more to tell at once
                # Up to the next beat's due time, rounded up: a poll that returned just
                # before it would send nothing, and wait a whole interval more.
                wait_ms = math.ceil(min(max(due - time.monotonic(), 0.0) * 1000, report_ms))
                waited_from, cpu_from = time.monotonic(), time.process_time()
                if poller.poll(wait_ms):
                    asked = self._read_asks(sock) or asked
                woke = time.monotonic()
                late = woke - waited_from - wait_ms / 1000
                if late > PAUSED_S and time.process_time() - cpu_from < late / 2:
                    # The process did not run meanwhile (a busy one, whose handler holds
                    # the interpreter lock, burns CPU): beat at once, and time the master's
                    # silence from now.
                    self.paused_at = self.master_seen = max(self.master_seen, woke)
                    due = 0.0
                    continue
                self._judge_master(reporter)
        finally:
            sock.close(linger=0)

    def _judge_master(self, reporter: Reporter) -> None:
        """Tell ``on_master_lost`` if the master and the event loop have both been silent
        for ``master_timeout``: a worker whose handler holds its loop for good would
        otherwise outlive a master killed -9 for ever."""
        if self._on_master_lost is None:
            return
        silent = time.monotonic() - self.master_seen
        if silent > self._master_timeout and reporter.stalled() > self._master_timeout:
            self._on_master_lost(silent)

    def _read_asks(self, sock: zmq.Socket[Any]) -> int:
        """The token of the latest ask waiting on ``sock`` (0: none); the master's beats
        say it lives; garbage is counted."""
        token = 0
        for _ in range(_MAX_ASKS):
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                msg = _decode_from_master(frame)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.garbage += 1
                continue
            self.master_seen = time.monotonic()
            if isinstance(msg, ReportAsk):
                token = msg.token
        return token

    def stop(self) -> None:
        """Stop beating and wait for the thread; idempotent."""
        self._stopped.set()
        if self._wake_w >= 0:
            with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
                os.write(self._wake_w, b"x")
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if not self._thread.is_alive() and self._wake_w >= 0:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1
