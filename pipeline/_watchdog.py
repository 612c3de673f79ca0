"""The end of a worker that was told to stop but cannot: its event loop is held for good.

A worker stops in order on its event loop when a SIGTERM comes (from its launcher, or from
the kernel at its parent's death) or a Ctrl-C. A handler that holds the loop and never
gives it back (a model step caught in a loop, a read that never returns) keeps that from
ever happening, and the worker outlived its master: killed with ``kill -9``, the master
took the launcher with it, and nothing was left to send the SIGKILL that follows.

The signal's handler (a hand-started worker's at a second signal: the first lets a slow
model step finish) arms a :class:`Watchdog`, whose thread then ends the process once the
loop has not run for the grace period since (or once the stop as a whole has taken much
longer than that, its loop free but a teardown awaiting for ever), after removing what the
process would remove at a clean exit (its shm segments, its CUDA IPC files).

Arming takes no lock, so that a second signal, whose handler Python runs nested inside the
first one's, cannot wait on the first (two SIGTERMs at once: the launcher's, and the
kernel's at the parent's death).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

import structlog

__all__ = ("EXIT_STOP_OVERDUE", "STOP_LIMIT_GRACES", "Watchdog", "end_now")

log = structlog.get_logger("stagewire.worker")

#: A worker ended by its watchdog exits as a SIGTERM would have ended it.
EXIT_STOP_OVERDUE = 143
#: A stop whose loop runs may take this many grace periods in all (a slow teardown).
STOP_LIMIT_GRACES = 6


class Watchdog:
    """Once armed, ends this process when ``loop_seen()`` (when the event loop last ran,
    on ``time.monotonic``) is ``grace`` seconds old and older than the arming, or
    ``STOP_LIMIT_GRACES`` graces after the arming. :meth:`arm` is safe to call from a
    signal handler, nested or not."""

    def __init__(
        self, stage: str, replica: int, grace: float, loop_seen: Callable[[], float]
    ) -> None:
        self._stage = stage
        self._replica = replica
        self._grace = grace
        self._loop_seen = loop_seen
        #: When the first stop signal came (0: none yet). A plain attribute: a signal
        #: handler sets it without a lock.
        self._armed_at = 0.0
        #: The exit code to end with: the worker's own once it is exiting.
        self._code = EXIT_STOP_OVERDUE
        self._exiting = False
        self._idle = threading.Event()  # never set: what the thread waits on between looks
        self._thread = threading.Thread(target=self._watch, name="stagewire-watchdog", daemon=True)

    def start(self) -> None:
        """Start watching (idle until armed)."""
        self._thread.start()

    def arm(self, code: int | None = None) -> None:
        """A stop was asked for: start the countdown (a later call keeps the first's), to
        end with ``code`` (default: as a SIGTERM would) unless the worker is exiting."""
        if not self._armed_at:
            if code is not None and not self._exiting:
                self._code = code
            self._armed_at = time.monotonic()

    def exiting(self, code: int) -> None:
        """The worker is done and its process exits (with ``code``): bound that too. The
        loop's close joins its default executor's threads, and the interpreter its own; a
        handler's thread that never returns would hold either for ever. Its loop no longer
        ticks, so this ends the process a grace after the loop's last tick."""
        self._code = code
        self._exiting = True
        self.arm()

    def _watch(self) -> None:
        poll = min(0.25, self._grace / 4)
        while not self._idle.wait(poll):
            armed = self._armed_at
            if not armed:
                continue
            now = time.monotonic()
            held = now - max(armed, self._loop_seen()) > self._grace
            if held or now - armed > STOP_LIMIT_GRACES * self._grace:
                self._fire(held)

    def _fire(self, held: bool) -> None:
        log.error(
            "stop_overdue",
            stage=self._stage,
            replica=self._replica,
            grace=self._grace,
            reason=(
                "its exit waits on a thread that does not end (a handler's, in an executor)"
                if self._exiting
                else "a handler holds the event loop"
                if held
                else f"the stop took over {STOP_LIMIT_GRACES * self._grace:g}s"
            )
            + "; the worker ends without finishing it",
        )
        end_now(self._code)


def end_now(code: int) -> None:
    """End this process with ``code`` at once, removing its leftovers first (from any
    thread: its event loop may be held for good)."""
    remove_own_leftovers()
    sys.stderr.flush()
    os._exit(code)


def remove_own_leftovers() -> None:
    """Remove what this process's exit hooks would have removed from /dev/shm.

    Raises:
        Nothing: a file that cannot be removed is left for the next sweep of dead owners.
    """
    from transports._cuda_files import _remove_own_driver_files
    from transports._shm_segment import _unlink_owned_at_exit

    for remove in (_unlink_owned_at_exit, _remove_own_driver_files):
        try:
            remove()
        except Exception as exc:
            log.warning("leftovers_not_removed", error=repr(exc))
