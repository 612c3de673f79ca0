"""The end-of-run table: per-stage and per-edge figures from the replicas' statistics."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

__all__ = ("edge_rows", "print_tables", "render_tables", "stage_rows")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _us(v: float) -> str:
    """A latency in µs, in the unit that reads best."""
    if v >= 1_000_000:
        return f"{v / 1_000_000:.2f} s"
    return f"{v / 1000:.2f} ms" if v >= 1000 else f"{v:.0f} µs"


def stage_rows(
    replicas: list[dict[str, Any]], order: list[str] | None = None
) -> list[dict[str, Any]]:
    """One row per stage replica: requests completed, failed and aborted there, chunks and
    process latency."""
    rank = {name: i for i, name in enumerate(order or [])}
    rows = []
    for r in sorted(replicas, key=lambda r: (rank.get(r["stage"], len(rank)), r["replica"])):
        rows.append(
            {
                "stage": f"{r['stage']}[{r['replica']}]",
                "completed": r["completed"],
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

    An edge into several replicas has each replica's hop percentiles, not their samples:
    its p50 is the median of theirs, weighted by the chunks each got, and its p99 the
    highest of theirs (a bound: the slowest replica's tail is the edge's).

    Rows follow ``order`` (edge names) where given, then the client's edges, then the rest.
    """
    sent: dict[str, dict[str, Any]] = {}
    hops: dict[str, list[dict[str, Any]]] = {}
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
            hops.setdefault(i["edge"], []).append(i)
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
        # Copied out of a full shm arena at its consumer, unread (see InputChannel.spill):
        # a sign that the arena is small for the requests whose readers stop.
        spilled = sum(i.get("spilled", 0) for i in hops.get(edge, []))
        if spilled:
            used += f" ({spilled} spilled)"
        p50, p99 = _hop_percentiles(hops.get(edge, []))
        rows.append(
            {
                "edge": edge,
                "chunks": row["chunks"],
                "bytes": row["bytes"],
                "transport": row["transport"],
                "used": used,
                "p50_us": p50,
                "p99_us": p99,
            }
        )
    return rows


def _hop_percentiles(inputs: list[dict[str, Any]]) -> tuple[float, float]:
    """An edge's hop p50 and p99 from those of the replicas it feeds (see edge_rows)."""
    got = [i for i in inputs if i.get("chunks", 0)] or inputs
    if not got:
        return 0.0, 0.0
    by_p50 = sorted(got, key=lambda i: i.get("hop_p50_us", 0.0))
    half, seen = sum(i.get("chunks", 1) for i in by_p50) / 2, 0
    p50 = 0.0
    for i in by_p50:
        seen += i.get("chunks", 1)
        p50 = i.get("hop_p50_us", 0.0)
        if seen >= half:
            break
    return p50, max(i.get("hop_p99_us", 0.0) for i in got)


def render_tables(
    stats: dict[str, Any],
    edge_order: list[str] | None = None,
    stage_order: list[str] | None = None,
) -> list[Table]:
    """Rich tables for the stages and the edges of a run, in the pipeline's order, and
    the stages' own counters when any stage has some.

    On a narrow terminal no figure and no name is cut: headers wrap at their spaces, and
    only the columns of free text (the transports used, the counters) wrap their cells.
    """
    rows = stage_rows(stats["replicas"], stage_order)
    stages = _table(
        "stages",
        ("stage", "completed", "failed", "aborted", "chunks in", "chunks out", "p50", "p99"),
        [
            [
                row["stage"],
                str(row["completed"]),
                str(row["failed"]),
                str(row["aborted"]),
                str(row["chunks_in"]),
                str(row["chunks_out"]),
                _us(row["p50_us"]),
                _us(row["p99_us"]),
            ]
            for row in rows
        ],
    )
    edges = _table(
        "edges",
        ("edge", "chunks", "bytes", "transport", "used", "hop p50", "hop p99"),
        [
            [
                row["edge"],
                str(row["chunks"]),
                _size(row["bytes"]),
                row["transport"],
                row["used"],
                _us(row["p50_us"]),
                _us(row["p99_us"]),
            ]
            for row in edge_rows(stats["replicas"], stats["client"], edge_order)
        ],
        free=("transport", "used"),
    )
    tables = [stages, edges]
    if any(row["counters"] for row in rows):
        # A table of their own: a column of them squeezed the figures on a narrow terminal.
        tables.append(
            _table(
                "stage counters",
                ("stage", "counters"),
                [[row["stage"], _counters(row["counters"])] for row in rows if row["counters"]],
                free=("counters",),
            )
        )
    return tables


def print_tables(console: Console, tables: list[Table]) -> None:
    """Print ``tables`` whole: where the terminal is narrower than the names and figures
    need, their lines are longer than it (and wrap there), not cut to it."""
    wide = console.options.update(max_width=1 << 16)
    for table in tables:
        need = Measurement.get(console, wide, table).minimum
        console.print(table, width=max(console.width, need), crop=False)


def _table(
    title: str, columns: tuple[str, ...], cells: list[list[str]], free: tuple[str, ...] = ()
) -> Table:
    """A table whose first column (names) and figures are never cut nor wrapped; the
    ``free`` columns of text wrap their cells when the terminal is narrow."""
    # Columns apart by their padding alone: the figures of a 4-stage pipeline fit on 80
    # columns, which lines between them did not leave room for.
    table = Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    for k, col in enumerate(columns):
        if col in free:
            # Wrapped at spaces, never inside a word: squeezed below its longest word, a
            # narrow terminal cut "inline" into "inl/ine", or dropped the column whole.
            longest = max((cell_len(w) for row in cells for w in row[k].split()), default=0)
            table.add_column(
                col, justify="left", overflow="fold", min_width=max(longest, cell_len(col))
            )
            continue
        values = [row[k] for row in cells]
        widest = max((cell_len(v) for v in values), default=0)
        # A header well longer than its figures takes a line per word.
        header = col if len(col) < widest + 3 else "\n".join(col.split())
        width = max([widest] + [len(w) for w in header.splitlines()])
        table.add_column(
            header, justify="left" if k == 0 else "right", no_wrap=True, min_width=width
        )
    for row in cells:
        # Plain text: names and counters are the user's, and "[x]" is no markup there.
        table.add_row(*(Text(cell) for cell in row))
    return table
