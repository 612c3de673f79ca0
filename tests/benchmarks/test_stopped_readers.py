"""Smoke test of ``benchmarks/stopped_readers.py``: with clients that stopped reading, the
request being read still streams through, and the consumer copied out what they held."""

from __future__ import annotations

import math
from pathlib import Path

from tests.benchmarks._run import run_benchmark


def test_short_run_reads_through_stopped_readers(tmp_path: Path) -> None:
    proc, figures = run_benchmark(
        "stopped_readers.py", "--quick", json_out=tmp_path / "stopped.json", timeout=120
    )
    assert figures["alone_ms"] > 0 and math.isfinite(figures["ratio"]), figures
    assert figures["spilled"] > 0, figures
    assert "| 100 x 1024 KiB | 16MiB | 2 |" in proc.stdout, proc.stdout
