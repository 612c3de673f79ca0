"""How this host's idle CPUs wait for the next message (the pipeline's ``cpu_idle``).

At concurrency 1 every stage idles while the others compute, and each hop wakes one. On a
virtual machine an idle vCPU halts, and waking it takes its host tens of microseconds
(``benchmarks/wake_cost.py``: a Unix-socket wake-up of 28 µs in ping-pong and 74 µs after
8 ms idle on the 2-vCPU VM this project is developed on, 4.6 and 22.5 µs with ``poll``).
``poll`` asks Linux for a zero CPU wake-up latency (a PM QoS request on
``/dev/cpu_dma_latency``, held while the file stays open): idle CPUs then spin instead of
halting. The request covers the whole host and ends with the process that holds it, even
one killed with ``kill -9``; nothing is left to undo.
"""

from __future__ import annotations

import os
import struct
from typing import Literal

import structlog

__all__ = ("PM_QOS_PATH", "CpuIdle", "hold_cpu_idle")

log = structlog.get_logger("stagewire.worker")

#: ``default``: idle CPUs enter whatever idle state the kernel picks (a vCPU halts);
#: ``poll``: they spin, so a message wakes a stage at once, at the cost of idle CPUs kept
#: busy (power, and a shared host's CPU time).
CpuIdle = Literal["default", "poll"]

#: The Linux PM QoS device: a process that writes a latency in microseconds there and keeps
#: the file open holds every CPU of the host to it.
PM_QOS_PATH = "/dev/cpu_dma_latency"


def hold_cpu_idle(policy: CpuIdle, path: str = PM_QOS_PATH) -> int | None:
    """Put ``policy`` in force for as long as this process lives.

    Returns:
        The descriptor that holds the request (leave it open; it closes with the process
        and with a forked child's, and no program it executes keeps it), or None:
        ``default`` needs none, and ``poll`` goes unheld where the platform has no such
        device or refuses it (no write access without root). A warning says so, and the
        worker serves anyway.
    """
    if policy == "default":
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as exc:
        log.warning(
            "cpu_idle_refused",
            policy=policy,
            device=path,
            error=exc.strerror or str(exc),
            hint="run the workers as root, or grant them write access to the device",
        )
        return None
    try:
        os.write(fd, struct.pack("=i", 0))  # microseconds: the shallowest state, polling
    except OSError as exc:
        os.close(fd)
        log.warning("cpu_idle_refused", policy=policy, device=path, error=str(exc))
        return None
    log.info("cpu_idle_held", policy=policy, device=path)
    return fd
