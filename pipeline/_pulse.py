"""A worker's heartbeat, sent from its own thread.

A stage may hold the event loop for seconds (a large prefill on the CPU, a model load).
Heartbeats sent from the loop would stop meanwhile and the master would declare a healthy
replica dead, so they come from a thread with its own ZMQ socket instead. The socket's
identity is the control socket's plus ``/hb``, which the master accepts for that replica.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from pipeline._messages import Heartbeat
from pipeline._messages import encode_message as _encode
from pipeline._security import process_keys, secure_client
from pipeline._sockets import for_endpoint

__all__ = ("Pulse", "pulse_identity")

#: How soon what a worker has to report of its requests goes, in seconds (with a beat of
#: its own, when the heartbeat interval is longer): a request its producer is done with
#: outlives the producer's death only once the master knows.
REPORT_EVERY_S = 0.1


def pulse_identity(control_identity: bytes) -> bytes:
    """The identity of the heartbeat socket belonging to a control socket."""
    return control_identity + b"/hb"


class Pulse:
    """Sends ``Heartbeat`` every ``interval`` seconds until stopped, with what ``reports``
    tells of requests (taken from the loop's thread: it must be safe to call from this
    one)."""

    def __init__(
        self,
        zctx: zmq.Context[Any],
        master: str,
        identity: bytes,
        stage: str,
        replica: int,
        interval: float,
        inflight: Callable[[], int],
        reports: Callable[[], tuple[list[str], list[tuple[str, str]]]] | None = None,
    ) -> None:
        self._zctx = zctx
        self._master = master
        self._identity = pulse_identity(identity)
        self._stage = stage
        self._replica = replica
        self._interval = interval
        self._inflight = inflight
        self._reports = reports
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stagewire-pulse", daemon=True)

    def start(self) -> None:
        """Start beating."""
        self._thread.start()

    def _run(self) -> None:
        sock = secure_client(self._zctx.socket(zmq.DEALER), process_keys())
        sock.setsockopt(zmq.IDENTITY, self._identity)
        sock.setsockopt(zmq.LINGER, 0)
        # Heartbeats must not pile up while the master is unreachable: keep only a few.
        sock.setsockopt(zmq.SNDHWM, 4)
        for_endpoint(sock, self._master).connect(self._master)
        due = 0.0  # when the next beat is due even with nothing to report
        try:
            while not self._stopped.is_set():
                # Reading an int another thread updates is safe under the GIL; a stale value
                # only delays the master's view of the load by one beat.
                ended, drained = self._reports() if self._reports is not None else ((), ())
                now = time.monotonic()
                if ended or drained or now >= due:
                    beat = Heartbeat(
                        self._stage, self._replica, self._inflight(), tuple(ended), tuple(drained)
                    )
                    with contextlib.suppress(zmq.Again):
                        sock.send(_encode(beat), zmq.NOBLOCK)
                    due = now + self._interval
                self._stopped.wait(min(self._interval, REPORT_EVERY_S))
        finally:
            sock.close(linger=0)

    def stop(self) -> None:
        """Stop beating and wait for the thread; idempotent."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
