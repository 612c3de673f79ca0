"""A stage's own counters reach Pipeline.statistics() and the run table."""

from __future__ import annotations

import re

import pytest
from rich.cells import cell_len
from rich.console import Console

from pipeline import Pipeline
from pipeline._report import print_tables, render_tables
from stages.text import Text
from tests.pipeline.conftest import spec


async def test_stage_counters_reach_statistics_and_the_table() -> None:
    s = spec({"echo": ":Echo", "count": ":Counted"}, [("echo", "count")])
    async with Pipeline(s) as pipe:
        for i in range(5):
            assert await pipe.submit(Text(f"x{i}")) == Text(f"x{i}")
        stats = await pipe.statistics()
    by_stage = {r["stage"]: r for r in stats["replicas"]}
    # Only numbers are kept: the label is left out; numpy's numbers are numbers, and an
    # integer past 64 bits is a float. (numpy's were left out, and the huge integer made
    # the replica's figures unsendable: it was reported as not answering.)
    assert by_stage["count"]["counters"] == {
        "echoed": 5,
        "half": 2.5,
        "bytes_seen": float(2**70),
        "np_count": 5,
        "np_rate": 0.5,
    }
    assert stats["unanswered"] == []
    assert by_stage["echo"]["counters"] == {}
    console = Console(width=200, record=True)
    for table in render_tables(stats, stage_order=["echo", "count"]):
        console.print(table)
    text = console.export_text()
    assert "counters" in text and "echoed 5, half 2.50" in text, text


def test_the_table_has_no_counters_column_when_no_stage_counts() -> None:
    replica = {
        "stage": "a",
        "replica": 0,
        "completed": 1,
        "failed": 0,
        "aborted": 0,
        "inputs": [],
        "outputs": [],
        "process_p50_us": 10.0,
        "process_p99_us": 20.0,
        "counters": {},
    }
    console = Console(width=200, record=True)
    for table in render_tables({"replicas": [replica], "client": {"outputs": [], "inputs": []}}):
        console.print(table)
    assert "counters" not in console.export_text()


async def test_the_edge_table_counts_a_streams_end_mark_apart_from_its_payloads() -> None:
    """A stream's last chunk marks its end and carries nothing: the table says so, so that
    the chunks column adds up with what each transport carried."""
    s = spec({"tokens": ":Tokens", "collect": ":Collect"}, [("tokens", "collect")])
    async with Pipeline(s) as pipe:
        for words in ("a b c", "d e"):
            assert await pipe.submit(Text(words)) == Text(words)
        stats = await pipe.statistics()
    console = Console(width=200, record=True)
    for table in render_tables(stats, edge_order=["tokens->collect"]):
        console.print(table)
    (line,) = [x for x in console.export_text().splitlines() if "tokens->collect" in x]
    cells = re.split(r"\s{2,}", line.strip())  # columns apart by two spaces or more
    assert cells[1] == "7" and cells[4] == "inline 5, 2 end marks", line


def _replica(stage: str, k: int, inputs: list[dict[str, object]]) -> dict[str, object]:
    return {
        "stage": stage, "replica": k, "completed": 150, "failed": 150, "aborted": 0,
        "inputs": inputs, "outputs": [], "process_p50_us": 10.0, "process_p99_us": 20.0,
        "counters": {},
    }  # fmt: skip


def test_an_edge_into_several_replicas_takes_the_hop_figures_of_them_all() -> None:
    """The edge's hop p99 was the first replica's alone (4.5 ms where another's was 9 ms):
    now the highest of the replicas', and the p50 the chunk-weighted median of theirs. Long
    stage and edge names are never cut on a narrow terminal, and the stage column of
    completed requests says so (read as "requests", 150 of them next to 150 failed looked
    like all failed)."""
    edge = "preprocessing_the_inputs->upper"
    hops = [(100, 1000.0, 4500.0), (300, 2000.0, 9000.0), (50, 3000.0, 5000.0)]
    replicas = [
        _replica("upper_case_everything", k, [{"edge": edge, "chunks": n, "hop_p50_us": p50,
                                               "hop_p99_us": p99}])
        for k, (n, p50, p99) in enumerate(hops)
    ]  # fmt: skip
    client = {"outputs": [{"edge": edge, "chunks": 450, "bytes": 4500, "used": {"inline": 450},
                           "transport": "auto"}], "inputs": []}  # fmt: skip
    console = Console(width=80, record=True)
    print_tables(console, render_tables({"replicas": replicas, "client": client}))
    text = console.export_text()
    (line,) = [x for x in text.splitlines() if edge in x]
    assert "2.00" in line and "9.00" in line, text  # ms, wrapped on 80 columns
    assert all(f"upper_case_everything[{k}]" in text for k in range(3)), text
    wide = Console(width=200, record=True)
    wide.print(render_tables({"replicas": replicas, "client": client})[0])
    assert "completed" in wide.export_text() and "requests" not in wide.export_text()


@pytest.mark.parametrize(
    "names",
    [
        ["preprocess", "encode", "prefill", "decode"],
        ["preprocess_the_images_and_the_prompts_of_requests", "前処理ステージ", "decode"],
    ],
    ids=["fits", "too long"],
)
def test_figures_are_never_cut_on_80_columns(names: list[str]) -> None:
    """A 4-stage pipeline's tables on an 80-column terminal: the p99 column was cut to
    "34.… ms", headers to "comp…", and a counters column squeezed them all. With names too
    long for the terminal, whole columns were cropped off its edge (wide characters were
    counted as one column each): now the lines run longer than the terminal instead."""
    replicas = [
        {**_replica(name, 0, []), "process_p50_us": 28_090.0, "process_p99_us": 38_120.0,
         "counters": {"steps": 216, "mean_batch": 4.44} if name == "decode" else {}}
        for name in names
    ]  # fmt: skip
    console = Console(width=80, record=True)
    print_tables(
        console, render_tables({"replicas": replicas, "client": {"outputs": [], "inputs": []}})
    )
    text = console.export_text()
    assert "…" not in text, text
    if len(names[0]) < 20:
        assert max(map(cell_len, text.splitlines())) <= 80, text
    for name in names:
        (row,) = [x for x in text.splitlines() if x.strip().startswith(f"{name}[0]") and "ms" in x]
        assert row.split()[-4:] == ["28.09", "ms", "38.12", "ms"], text
    assert "steps 216, mean_batch 4.44" in text


def test_names_and_counters_are_plain_text_and_free_columns_keep_their_words() -> None:
    """A stage's own counter named like rich markup ("cache[/]") is printed as written (it
    raised MarkupError after a run that succeeded, losing the summary), and on a 60-column
    terminal the transport columns keep whole words (they were cut to "inl/ine", or
    dropped, at 60 columns)."""
    edge = "preprocess->encode"
    replicas = [
        {**_replica("[bold]stage", 0, [{"edge": edge, "chunks": 10, "hop_p50_us": 900.0,
                                        "hop_p99_us": 2000.0}]),
         "counters": {"cache[/]": 3, "[red]hits": 1}},
    ]  # fmt: skip
    client = {"outputs": [{"edge": edge, "chunks": 10, "bytes": 10_000,
                           "used": {"inline": 10}, "transport": "auto"}], "inputs": []}  # fmt: skip
    console = Console(width=60, record=True)
    print_tables(console, render_tables({"replicas": replicas, "client": client}))
    text = console.export_text()
    assert "[bold]stage[0]" in text and "cache[/] 3, [red]hits 1" in text, text
    (header,) = [x for x in text.splitlines() if x.split()[:1] == ["edge"]]
    assert "transport" in header.split() and "used" in header.split(), text
    (row,) = [x for x in text.splitlines() if x.strip().startswith(edge)]
    assert row.split()[4:6] == ["auto", "inline"], text
