"""Whether a process is alive, and which pid namespace this one is in.

Shared-memory transports record the pids of the processes holding their resources, and
reclaim what a dead one held; pids mean something only within one pid namespace.
"""

from __future__ import annotations

import os

__all__ = ("local_pid", "pid_alive", "pid_namespace")

_pidns: tuple[int, int] | None = None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs in this pid namespace (a zombie does not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # It exists, under another user.
    # os.kill finds zombies too, but a zombie has exited and holds no mapping.
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    # The command name is parenthesised and may hold spaces: the state follows the last ")".
    return stat.rpartition(b")")[2].split()[:1] != [b"Z"]


def pid_namespace() -> int:
    """An identifier of this process's pid namespace (0 when it cannot be read)."""
    global _pidns
    pid = os.getpid()
    if _pidns is None or _pidns[0] != pid:
        try:
            ns = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            ns = 0
        _pidns = (pid, ns)
    return _pidns[1]


def local_pid(pid: int, pidns: int) -> int:
    """``pid`` if it names a process in this pid namespace (``pidns``, from its owner's
    :func:`pid_namespace`), else 0: a pid from another namespace means another process."""
    return pid if pidns and pidns == pid_namespace() else 0
