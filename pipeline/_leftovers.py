"""What dead stagewire processes leave in /dev/shm, and who removes it.

A process that exits in order removes its own shm segments; one killed (``kill -9``, the
OOM killer) cannot. Whoever learns of its death on its host removes what it left:
- the local launcher, for the workers it started, once each exits;
- every surviving stagewire process of the host (master or worker) as the master declares
  a replica dead: the segments whose owner no longer holds them (each owner holds a lock on
  its own, which the kernel drops at its death, so a live one is never touched), and the
  CUDA IPC files of the dead pid once it has exited;
- any process at start-up, for the segments of owners gone since.
"""

from __future__ import annotations

from collections.abc import Iterable

import structlog

from transports._liveness import pid_alive

__all__ = ("remove_leftovers_of", "sweep_after_deaths")

log = structlog.get_logger("stagewire.leftovers")


def remove_leftovers_of(pids: Iterable[int]) -> None:
    """Unlink the shm segments owned by ``pids``, which have all exited, and the files
    that CUDA IPC left in /dev/shm for them (for a parent that started them)."""
    from transports.shm import remove_segments_of

    pids = list(pids)
    removed = remove_segments_of(pids)
    if removed:
        log.info("shm_segments_removed", count=len(removed))
    _remove_cuda_files(pids)


def sweep_after_deaths(pids: Iterable[int]) -> None:
    """Stagewire processes of this host died (``pids`` as this process's pid namespace
    numbers them; 0 for one it cannot name): unlink every shm segment whose owner no
    longer holds it, and the CUDA IPC files of those pids that have exited.

    Raises:
        Nothing: a leftover that cannot be removed stays for the next sweep.
    """
    from transports.shm import sweep_dead_owners

    try:
        swept = sweep_dead_owners()
        if swept:
            log.info("shm_segments_swept", count=len(swept))
        _remove_cuda_files([pid for pid in pids if pid and not pid_alive(pid)])
    except OSError as exc:
        log.warning("leftovers_sweep_failed", error=repr(exc))


def _remove_cuda_files(pids: list[int]) -> None:
    from transports._cuda_files import remove_cuda_files_of

    if pids and (cuda := remove_cuda_files_of(pids)):
        log.info("cuda_ipc_files_removed", count=len(cuda))
