"""Smoke test of ``benchmarks/wake_cost.py``: a short run reports every gap, and its child
process is gone afterwards."""

from __future__ import annotations

import math
from pathlib import Path

from tests.benchmarks._run import run_benchmark


def test_short_run_reports_every_gap(tmp_path: Path) -> None:
    proc, rows = run_benchmark(
        "wake_cost.py", "--rounds", "10", json_out=tmp_path / "wake.json", timeout=60
    )
    assert [r["gap_ms"] for r in rows] == [0.0, 0.5, 2.0, 8.0, 45.0]
    for r in rows:
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("send_us", "wake_us")), r
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ") and " ms |" in line]
    assert len(table) == len(rows), proc.stdout
