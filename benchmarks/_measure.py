"""Small measuring helpers shared by the benchmarks."""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import argparse

    from pipeline._cpu_idle import CpuIdle

__all__ = (
    "PhaseLog",
    "add_cpu_idle_option",
    "cpu_seconds",
    "hold_cpu_idle_for_run",
    "hop_p50s",
    "median",
)


def median(xs: list[float]) -> float:
    """The median of ``xs``; NaN when empty."""
    return statistics.median(xs) if xs else float("nan")


class PhaseLog:
    """Notes the start of each phase on stderr (stdout is kept for the report)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._t0 = time.perf_counter()
        #: When each phase started, in seconds since the run began (goes into --json).
        self.phases: dict[str, float] = {}

    def __call__(self, msg: str) -> None:
        now = time.perf_counter() - self._t0
        self.phases[msg] = round(now, 2)
        print(f"[{self._name} +{now:5.1f}s] {msg}", file=sys.stderr, flush=True)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU of a process, from /proc (0.0 where unavailable)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # Fields 14 and 15 (utime, stime) are the 12th and 13th after the command name.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def hop_p50s(stats: dict[str, Any]) -> dict[str, float]:
    """Envelope hop p50 per edge (µs, sent to received), from replicas and the client."""
    out = {}
    for r in [*stats["replicas"], stats["client"]]:
        for i in r["inputs"]:
            out[i["edge"]] = i["hop_p50_us"]
    return out


def add_cpu_idle_option(parser: argparse.ArgumentParser, measured: str) -> None:
    """The ``--cpu-idle default|poll`` option of a benchmark; ``measured`` names what else
    runs in that state (poll is held by the benchmark's own process for the whole run)."""
    parser.add_argument(
        "--cpu-idle",
        choices=("default", "poll"),
        default="default",
        help="the pipelines' defaults.cpu_idle; poll is held by this process too, for the "
        f"whole run ({measured} then runs with idle CPUs polling: needs root)",
    )


def hold_cpu_idle_for_run(policy: CpuIdle) -> None:
    """Hold ``policy`` in this process until it exits; exits saying so if refused, since
    a run half in one state and half in the other compares nothing."""
    from pipeline._cpu_idle import hold_cpu_idle

    if policy != "default" and hold_cpu_idle(policy) is None:
        sys.exit(f"--cpu-idle {policy}: the PM QoS device refused it (see the warning)")
