"""Smoke test of ``benchmarks/wake_cost.py``: a short run reports every gap, and its child
process is gone afterwards."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_short_run_reports_every_gap(tmp_path: Path) -> None:
    out = tmp_path / "wake.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/wake_cost.py", "--rounds", "10", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())
    assert [r["gap_ms"] for r in rows] == [0.0, 0.5, 2.0, 8.0, 45.0]
    for r in rows:
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("send_us", "wake_us")), r
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ") and " ms |" in line]
    assert len(table) == len(rows), proc.stdout
