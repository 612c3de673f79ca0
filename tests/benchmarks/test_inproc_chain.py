"""Smoke test of ``benchmarks/inproc_chain.py``: both shapes run the real actors and
orchestrator to the end and report a positive cost."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.benchmarks._run import ROOT


def _run(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "benchmarks/inproc_chain.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _best(out: str) -> float:
    m = re.search(r"best ([\d.]+) µs", out)
    assert m is not None, out
    return float(m.group(1))


def test_streamed_chunks_and_one_chunk_requests_both_report_their_cost() -> None:
    streamed = _run("--chunks", "2000", "--trials", "2")
    assert "per chunk across the 4-stage chain" in streamed
    assert _best(streamed) > 0
    warm = _run("--requests", "50", "--trials", "2")
    cold = _run("--requests", "50", "--trials", "2", "--evict", "4")
    assert "one-chunk request" in warm and "caches evicted (4 MiB walked)" in cold
    assert _best(warm) > _best(streamed) > 0
