"""Processes from tests: children of a pid, whether a pid still runs, and ``stagewire``
commands started (and, whatever happens, killed) by a test."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def wait_exited(pids: Iterable[int], timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for every process of ``pids`` to exit (each through a
    pidfd, which becomes readable at its exit); whether all did."""
    poller = select.poll()
    fds = []
    try:
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue  # gone already
            fds.append(fd)
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout
        left = len(fds)
        while left and (remaining := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(int(remaining * 1000) + 1):
                poller.unregister(fd)
                left -= 1
        return left == 0
    finally:
        for fd in fds:
            os.close(fd)


def free_port() -> int:
    """A TCP port on the loopback address that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_stagewire(
    *args: str,
    err: Path | None = None,
    out: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """``python -m pipeline ARGS`` from the repository root in its own session, left
    running; stderr (and stdout) to files, ``env`` the whole environment (default: ours)."""
    with (err or Path(os.devnull)).open("wb") as e, (out or Path(os.devnull)).open("wb") as o:
        return subprocess.Popen(
            [sys.executable, "-m", "pipeline", *args],
            stdin=subprocess.DEVNULL,
            stdout=o,
            stderr=e,
            cwd=ROOT,
            start_new_session=True,
            env=dict(os.environ if env is None else env),
        )


def kill_all(procs: Iterable[subprocess.Popen[bytes]]) -> None:
    """What a test started and left running: none may outlive it (killed by pid, reaped)."""
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait()
