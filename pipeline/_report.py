"""The end-of-run table: per-stage and per-edge figures from the replicas' statistics."""

from __future__ import annotations

from typing import Any

from rich.table import Table

__all__ = ("edge_rows", "render_tables", "stage_rows")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _us(v: float) -> str:
    return f"{v / 1000:.2f} ms" if v >= 1000 else f"{v:.0f} µs"


def stage_rows(
    replicas: list[dict[str, Any]], order: list[str] | None = None
) -> list[dict[str, Any]]:
    """One row per stage replica: requests, failures, chunks and process latency."""
    rank = {name: i for i, name in enumerate(order or [])}
    rows = []
    for r in sorted(replicas, key=lambda r: (rank.get(r["stage"], len(rank)), r["replica"])):
        rows.append(
            {
                "stage": f"{r['stage']}[{r['replica']}]",
                "requests": r["completed"],
                "failed": r["failed"],
                "aborted": r["aborted"],
                "chunks_in": sum(i["chunks"] for i in r["inputs"]),
                "chunks_out": sum(o["chunks"] for o in r["outputs"]),
                "p50_us": r["process_p50_us"],
                "p99_us": r["process_p99_us"],
                "counters": r.get("counters", {}),
            }
        )
    return rows


def _counters(counters: dict[str, Any]) -> str:
    return ", ".join(
        f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in counters.items()
    )


def edge_rows(
    replicas: list[dict[str, Any]], client: dict[str, Any], order: list[str] | None = None
) -> list[dict[str, Any]]:
    """One row per edge: chunks, bytes, transports actually used and hop latency.

    Rows follow ``order`` (edge names) where given, then the client's edges, then the rest.
    """
    sent: dict[str, dict[str, Any]] = {}
    hops: dict[str, dict[str, Any]] = {}
    for r in [*replicas, client]:
        for o in r["outputs"]:
            row = sent.setdefault(
                o["edge"],
                {"chunks": 0, "bytes": 0, "used": {}, "fallbacks": 0, "transport": o["transport"]},
            )
            row["chunks"] += o["chunks"]
            row["fallbacks"] += o.get("fallbacks", 0)
            row["bytes"] += o["bytes"]
            for name, n in o["used"].items():
                row["used"][name] = row["used"].get(name, 0) + n
        for i in r["inputs"]:
            hops.setdefault(i["edge"], i)
    rows = []
    rank = {name: i for i, name in enumerate(order or [])}
    # Follow the data: the client's input edges first, its output edges last.
    ordered = sorted(
        sent,
        key=lambda e: (not e.startswith("@"), e.endswith("@client"), rank.get(e, len(rank)), e),
    )
    for edge in ordered:
        row = sent[edge]
        used = ", ".join(f"{k} {v}" for k, v in sorted(row["used"].items()))
        # A stream that ends after its last payload ends with a chunk that carries none:
        # no transport carried it, but it is counted among the chunks.
        ends = row["chunks"] - sum(row["used"].values())
        if ends > 0:
            used += f"{', ' if used else ''}{ends} end mark{'s' if ends != 1 else ''}"
        used = used or "-"
        if row["fallbacks"]:
            used += f" ({row['fallbacks']} fell back)"
        hop = hops.get(edge, {})
        rows.append(
            {
                "edge": edge,
                "chunks": row["chunks"],
                "bytes": row["bytes"],
                "transport": row["transport"],
                "used": used,
                "p50_us": hop.get("hop_p50_us", 0.0),
                "p99_us": hop.get("hop_p99_us", 0.0),
            }
        )
    return rows


def render_tables(
    stats: dict[str, Any],
    edge_order: list[str] | None = None,
    stage_order: list[str] | None = None,
) -> list[Table]:
    """Rich tables for the stages and the edges of a run, in the pipeline's order."""
    stages = Table(title="stages", title_justify="left")
    rows = stage_rows(stats["replicas"], stage_order)
    # The stages' own counters get a column only when some stage has any.
    with_counters = any(row["counters"] for row in rows)
    cols = ("stage", "requests", "failed", "aborted", "chunks in", "chunks out", "p50", "p99")
    for col in (*cols, "counters") if with_counters else cols:
        stages.add_column(col, justify="left" if col in ("stage", "counters") else "right")
    for row in rows:
        cells = [
            row["stage"],
            str(row["requests"]),
            str(row["failed"]),
            str(row["aborted"]),
            str(row["chunks_in"]),
            str(row["chunks_out"]),
            _us(row["p50_us"]),
            _us(row["p99_us"]),
        ]
        if with_counters:
            cells.append(_counters(row["counters"]))
        stages.add_row(*cells)
    edges = Table(title="edges", title_justify="left")
    for col in ("edge", "chunks", "bytes", "transport", "used", "hop p50", "hop p99"):
        edges.add_column(col, justify="right" if col in ("chunks", "bytes") else "left")
    for row in edge_rows(stats["replicas"], stats["client"], edge_order):
        edges.add_row(
            row["edge"],
            str(row["chunks"]),
            _size(row["bytes"]),
            row["transport"],
            row["used"],
            _us(row["p50_us"]),
            _us(row["p99_us"]),
        )
    return [stages, edges]
