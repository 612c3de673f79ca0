"""The /dev/shm files that CUDA IPC leaves behind a process, and removing them.

Two kinds of file appear in /dev/shm for a process that shares GPU memory, neither created
by stagewire itself:

- ``cuda.shm.<uid>.<pid in hex>.<n>``: made by the CUDA driver for a process that uses
  interprocess events or memory handles. The driver never removes it, not even at a clean
  exit, so every producer and consumer process would leave one.
- ``torch_<pid>_<random>_<n>``: torch's reference-count file, made when a storage is first
  exported. torch removes it at a clean exit, but not after ``kill -9``.

Both names carry the pid, so a parent that started a process removes its files once the
process has exited (:func:`remove_cuda_files_of`), and a process removes its own driver
files as it exits (once :func:`note_cuda_ipc_used` has marked it). Only files of the exact
patterns, of the given pids and owned by this user are touched; a process still mapping
one keeps its mapping.
"""

from __future__ import annotations

import atexit
import os
import re
from collections.abc import Iterable

__all__ = ("cuda_files_of", "note_cuda_ipc_used", "remove_cuda_files_of")

SHM_DIR = "/dev/shm"
_DRIVER_RE = re.compile(r"cuda\.shm\.[0-9]+\.([0-9a-f]+)\.[0-9]+")
_TORCH_RE = re.compile(r"torch_([0-9]+)_[0-9]+_[0-9]+")


def _pid_of(name: str) -> int:
    """The pid a file of either kind belongs to, or 0 for any other name."""
    if match := _DRIVER_RE.fullmatch(name):
        return int(match.group(1), 16)
    if match := _TORCH_RE.fullmatch(name):
        return int(match.group(1))
    return 0


def cuda_files_of(pids: Iterable[int]) -> list[str]:
    """The names of the CUDA IPC files in /dev/shm of ``pids`` that this user owns."""
    wanted = {int(pid) for pid in pids}
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    uid = os.getuid()
    found = []
    for name in names:
        if _pid_of(name) not in wanted:
            continue
        try:
            if os.stat(os.path.join(SHM_DIR, name), follow_symlinks=False).st_uid == uid:
                found.append(name)
        except FileNotFoundError:
            continue
    return sorted(found)


def _started_at(pid: int) -> float | None:
    """When the live process ``pid`` started, in seconds since the epoch; None if no
    process has that pid (or this is not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open("/proc/stat", "rb") as f:
            boot = next(int(ln.split()[1]) for ln in f if ln.startswith(b"btime "))
    except (OSError, StopIteration, ValueError):
        return None
    # Field 22, counted after the command name, which may hold spaces and parentheses.
    ticks = int(stat[stat.rindex(b")") + 2 :].split()[19])
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def remove_cuda_files_of(pids: Iterable[int]) -> list[str]:
    """Unlink the CUDA IPC files of ``pids``, which must all have exited; the names removed.

    For a parent that started those processes (by pid, as with shm segments). A pid may
    have been reused since its process exited: a file made after the live process now
    holding that pid started is that process's, and is left alone.
    """
    removed = []
    started: dict[int, float | None] = {}
    for name in cuda_files_of(pids):
        path = os.path.join(SHM_DIR, name)
        pid = _pid_of(name)
        if pid not in started:
            started[pid] = _started_at(pid)
        try:
            since = started[pid]
            # Whole seconds of boot time: a second's margin keeps a new process's file.
            if since is not None and os.stat(path, follow_symlinks=False).st_ctime >= since - 1:
                continue
            os.unlink(path)
        except FileNotFoundError:
            continue
        removed.append(name)
    return removed


#: The pid of the process that used CUDA IPC (a forked child has another, so it never
#: removes its parent's file).
_used_in = 0


def note_cuda_ipc_used() -> None:
    """Mark this process as a CUDA IPC user: it removes its CUDA driver file as it exits.

    The hook was registered when this module was imported, before the cuda_ipc sender's
    own exit hook, so it runs after that one has let consumers finish reading; those that
    opened this process's handles and events keep them mapped.
    """
    global _used_in
    _used_in = os.getpid()


@atexit.register
def _remove_own_driver_files() -> None:
    # Only the driver's file: torch removes its own at a clean exit, and would fail
    # noisily at shutdown if it found that file gone.
    pid = os.getpid()
    if _used_in != pid:
        return
    for name in cuda_files_of([pid]):
        if _DRIVER_RE.fullmatch(name):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                continue
