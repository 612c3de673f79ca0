"""Running a benchmark script as a user would, for the smoke tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(
    script: str, *args: str, json_out: Path, timeout: float
) -> tuple[subprocess.CompletedProcess[str], Any]:
    """Run ``benchmarks/<script>`` from the repository root with ``--json json_out``.

    Returns the finished process and the JSON it wrote; fails the test (with the script's
    stderr) when it exits non-zero.
    """
    proc = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args, "--json", str(json_out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(json_out.read_text())
