"""Smoke test of ``benchmarks/stage_cpu.py``: a short run measures every process of the
reference pipeline and every step of the monolithic baseline."""

from __future__ import annotations

import math
from pathlib import Path

from tests.benchmarks._run import run_benchmark

STAGES = ("preprocess", "encode", "prefill", "decode")


def test_short_run_measures_every_process_and_step(tmp_path: Path) -> None:
    proc, figures = run_benchmark(
        "stage_cpu.py", "--requests", "8", json_out=tmp_path / "cpu.json", timeout=120
    )
    cpu = figures["cpu_ms_per_request"]
    assert set(cpu) == {*STAGES, "master and client"}
    assert all(math.isfinite(ms) and ms > 0 for ms in cpu.values()), cpu
    assert set(figures["handler_p50_ms"]) == set(STAGES)
    assert set(figures["one_process_ms"]) == {"prepare", "encode", "prefill", "decode"}
    assert all(ms > 0 for ms in figures["one_process_ms"].values())
    assert figures["e2e_mean_ms"] > 0
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and " ms |" in line]
    assert len(rows) == len(cpu) + 1, proc.stdout  # every process, and the total
