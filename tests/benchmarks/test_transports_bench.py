"""Smoke test of ``benchmarks/transport_bench.py``: a tiny run gives tables, numbers, baselines.

It runs the benchmark as a user would (a subprocess from the repository root) with
``--smoke``: sizes 1 KiB and 64 KiB, one short trial, no Ray, every transport that is
registered (the others must be reported as not installed, never crash the run).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

from tests.benchmarks._run import run_benchmark

SIZES = ("1024", "65536")


def _positive(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_smoke_run_reports_transports_and_baselines(tmp_path: Path) -> None:
    out_png = tmp_path / "transports.png"
    proc, r = run_benchmark(
        "transport_bench.py",
        "--smoke",
        "--plot",
        str(out_png),
        json_out=tmp_path / "transports.json",
        timeout=90,
    )
    report = proc.stdout
    for heading in (
        "### Baselines",
        "### stagewire pipeline",
        "### Transport alone",
        "### Targets",
    ):
        assert heading in report, report
    assert "| 1 KiB |" in report and "| 64 KiB |" in report
    assert "µs" in report and ("GB/s" in report or "MB/s" in report)

    b = r["baselines"]
    assert _positive(b["pipe"]["1024"]["one_way_p50_us"])
    for size in SIZES:
        assert _positive(b["memcpy"][size]["p50_us"])
        assert _positive(b["memcpy"][size]["bytes_per_s"])
        for key in ("zmq_ipc", "zmq_tcp", "mp_queue"):
            assert _positive(b[key][size]["latency"]["p50_us"]), (key, b[key][size])
            assert _positive(b[key][size]["stream"]["bytes_per_s"]), (key, b[key][size])
    assert "skipped" in b["ray"]  # --smoke leaves Ray out

    avail = r["availability"]
    assert avail["inline"] is None and avail["auto"] is None
    for name, reason in avail.items():
        if reason is not None:  # not installed / no GPU: said in the tables, not measured
            assert name not in r["stagewire"]
            assert reason in report
            continue
        for size in SIZES:
            entry = r["stagewire"][name][size]
            assert "error" not in entry, (name, entry)
            assert _positive(entry["hop"]["p50_us"]) and _positive(entry["hop"]["p99_us"])
            assert _positive(entry["stream"]["bytes_per_s"])
            if name != "auto":
                for kind, metric in (("inproc", "cycle"), ("two_process", "hop")):
                    alone = r["alone"][kind][name][size]
                    assert "error" not in alone, (name, kind, alone)
                    assert _positive(alone[metric]["p50_us"])

    targets = {t["what"]: t for t in r["targets"]}
    one_kib = targets["1 KiB hop p50, inline (pipeline)"]
    assert one_kib["status"] in ("met", "**missed**") and _positive(one_kib["ratio"])

    assert r["shm"]["left_ours"] == []
    if importlib.util.find_spec("matplotlib") is not None:
        assert out_png.stat().st_size > 0
    else:
        assert "matplotlib not installed" in report
