"""The end of a worker that was told to stop but cannot: its event loop is held for good.

A worker stops in order on its event loop when a SIGTERM comes (from its launcher, or from
the kernel at its parent's death) or a Ctrl-C. A handler that holds the loop and never
gives it back (a model step caught in a loop, a read that never returns) keeps that from
ever happening, and the worker outlived its master: killed with ``kill -9``, the master
took the launcher with it, and nothing was left to send the SIGKILL that follows.

The signal's handler arms a :class:`Watchdog`. If the worker has not ended in order within
its grace, the watchdog's thread removes what the process would remove at a clean exit
(its shm segments, its CUDA IPC files) and ends the process at once.
"""

from __future__ import annotations

import os
import sys
import threading

import structlog

__all__ = ("EXIT_STOP_OVERDUE", "Watchdog")

log = structlog.get_logger("stagewire.worker")

#: A worker ended by its watchdog exits as a SIGTERM would have ended it.
EXIT_STOP_OVERDUE = 143


class Watchdog:
    """Ends this process ``grace`` seconds after :meth:`arm`, unless :meth:`disarm` comes
    first. Both are safe to call from a signal handler and from any thread."""

    def __init__(self, stage: str, replica: int, grace: float) -> None:
        self._stage = stage
        self._replica = replica
        self._grace = grace
        self._timer: threading.Timer | None = None
        self._disarmed = False
        self._lock = threading.Lock()

    @property
    def armed(self) -> bool:
        """Whether a stop is under way and being watched."""
        return self._timer is not None and not self._disarmed

    def arm(self) -> None:
        """Start the countdown; a second call keeps the first one's."""
        with self._lock:
            if self._timer is not None or self._disarmed:
                return
            timer = self._timer = threading.Timer(self._grace, self._fire)
            timer.name = "stagewire-watchdog"
            timer.daemon = True
            timer.start()

    def disarm(self) -> None:
        """The worker ended in order (or is about to): never fire."""
        with self._lock:
            self._disarmed = True
            if self._timer is not None:
                self._timer.cancel()

    def _fire(self) -> None:
        with self._lock:
            if self._disarmed:
                return
        log.error(
            "stop_overdue",
            stage=self._stage,
            replica=self._replica,
            grace=self._grace,
            reason="a handler holds the event loop; the worker ends without finishing it",
        )
        remove_own_leftovers()
        sys.stderr.flush()
        os._exit(EXIT_STOP_OVERDUE)


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
