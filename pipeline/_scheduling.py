"""The CPU scheduling policy of a worker process (a stage's ``scheduling`` setting).

A stage's worker mostly sleeps until a message wakes it. Under Linux's default policy the
woken process preempts whatever runs on the CPU it is woken on, and the kernel of a small
VM wakes it on the CPU of the process that sent the message: a decode loop that streams a
chunk, or a prefill that sends a KV layer and computes the next, is preempted by the
process it just woke, and by every other worker whose timer fires on its CPU.
``SCHED_BATCH`` keeps the woken worker from preempting: it runs on an idle CPU, or when
the running process's turn ends. ``benchmarks/vlm.py`` measures what that is worth.
"""

from __future__ import annotations

import os
from typing import Literal

import structlog

__all__ = ("Scheduling", "apply_scheduling")

log = structlog.get_logger("stagewire.worker")

#: ``normal``: the policy the process started with (Linux: SCHED_OTHER unless inherited);
#: ``batch``: SCHED_BATCH, woken without preempting.
Scheduling = Literal["normal", "batch"]


def apply_scheduling(policy: Scheduling) -> bool:
    """Put every thread of this process under ``policy``; threads started later inherit it.

    Returns:
        Whether the policy is in force: ``normal`` always is; ``batch`` is not where the
        platform has no SCHED_BATCH or refuses it (a warning says so), and the worker
        goes on.
    """
    if policy == "normal":
        return True
    setter = getattr(os, "sched_setscheduler", None)
    batch = getattr(os, "SCHED_BATCH", None)
    if setter is None or batch is None or not os.path.isdir("/proc/self/task"):
        log.warning("scheduling_unsupported", policy=policy, platform=os.uname().sysname)
        return False
    param = os.sched_param(0)
    for tid in os.listdir("/proc/self/task"):
        try:
            setter(int(tid), batch, param)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as exc:
            # A sandbox may refuse the call (seccomp, gVisor): serve anyway, as normal.
            log.warning("scheduling_refused", policy=policy, error=str(exc))
            return False
    return True
