"""Smoke test of ``benchmarks/vcpu_share.py``: a short run reports every probe, and leaves
no process behind."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks._run import ROOT, run_benchmark


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the probes need two CPUs")
def test_short_run_reports_every_probe(tmp_path: Path) -> None:
    proc, r = run_benchmark(
        "vcpu_share.py", "--rounds", "10", json_out=tmp_path / "vcpu.json", timeout=120
    )
    assert [row["sender_idle_ms"] for row in r["free"]] == [0.0, 1.0, 2.0, 3.0, 5.0]
    for row in [*r["free"], r["pinned_apart"]]:
        assert 0.0 <= row["same_cpu_share"] <= 1.0
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("send_us", "wake_us")), row
    # Pinned to different CPUs, the receiver can never wake on the sender's.
    assert r["pinned_apart"]["same_cpu_share"] == 0.0
    assert r["sibling"]["alone_ms"] > 0 and r["sibling"]["beside_ms"] > 0
    assert proc.stdout.count("\n| ") >= 8, proc.stdout


def test_refuses_a_single_cpu() -> None:
    code = (
        "import os, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "sys.path.insert(0, 'benchmarks'); import vcpu_share; sys.exit(vcpu_share.main([]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "needs two CPUs" in proc.stderr
