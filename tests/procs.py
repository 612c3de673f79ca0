"""Looking at processes from tests: children of a pid, and whether a pid still runs."""

from __future__ import annotations

from pathlib import Path


def _stat_fields(pid: int | str) -> list[str]:
    # The command name in /proc/PID/stat is parenthesised and may hold spaces: split after it.
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def children(pid: int) -> list[int]:
    """Pids whose parent is ``pid``."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int(_stat_fields(entry.name)[1]) == pid:
                kids.append(int(entry.name))
        except OSError:
            continue
    return kids


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        return _stat_fields(pid)[0] != "Z"
    except OSError:
        return False
