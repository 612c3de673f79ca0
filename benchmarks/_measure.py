"""Small measuring helpers shared by the benchmarks."""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

__all__ = ("PhaseLog", "cpu_seconds", "hop_p50s", "median")


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
