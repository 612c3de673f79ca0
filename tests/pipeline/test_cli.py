"""The stagewire command: run, validate, exit codes and one-line errors."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_run_demo_reports_every_request_and_the_tables() -> None:
    """run prints outputs, the per-stage and per-edge tables, and exits 0."""
    res = _run(
        "run",
        "configs/demo.yaml",
        "--input-file",
        "configs/demo-inputs.jsonl",
        "--requests",
        "60",
        "--concurrency",
        "8",
    )
    assert res.returncode == 0, res.stderr
    assert "60/60 requests ok" in res.stderr
    for word in ("stages", "edges", "split[0]", "upper->join", "inline", "hop p50"):
        assert word in res.stderr, word
    index, _, payload = res.stdout.splitlines()[0].partition(": ")
    value = json.loads(payload)["value"]
    assert index == "0"
    assert value
    assert value == value.upper()


def test_failed_requests_exit_1(tmp_path: Path) -> None:
    """When some requests fail, run still completes the others and exits 1."""
    cfg = tmp_path / "p.yaml"
    cfg.write_text("stages:\n  e: {impl: 'tests.pipeline.sample_stages:Echo'}\n")
    inputs = tmp_path / "in.jsonl"
    inputs.write_text('{"value": "fine"}\n{"value": "boom"}\n')
    res = _run("run", str(cfg), "--input-file", str(inputs), "--requests", "4")
    assert res.returncode == 1
    assert "2/4 requests ok" in res.stderr
    assert "cannot echo 'boom'" in res.stderr


def test_debug_shows_a_failed_stages_traceback(tmp_path: Path) -> None:
    """With --debug, run prints the traceback the stage's worker formatted for a failure."""
    cfg = tmp_path / "p.yaml"
    cfg.write_text("stages:\n  e: {impl: 'tests.pipeline.sample_stages:Echo'}\n")
    res = _run("--debug", "run", str(cfg), "--input", '{"value": "boom"}')
    assert res.returncode == 1
    assert "stage traceback:" in res.stderr
    assert "sample_stages.py" in res.stderr and "ValueError: cannot echo 'boom'" in res.stderr
    plain = _run("run", str(cfg), "--input", '{"value": "boom"}')
    assert "stage traceback:" not in plain.stderr


def test_validate_ok_and_errors_are_one_line(tmp_path: Path) -> None:
    """validate exits 0 on a good file and 2 with one line naming file and line on a bad one."""
    ok = _run("validate", "configs/demo.yaml")
    assert ok.returncode == 0 and "ok" in ok.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages:\n  a: {impl: 'stages.text:Split', replicas: two}\n")
    res = _run("validate", str(bad))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert f"{bad}:2:" in lines[0] and "replicas" in lines[0]
    assert "Traceback" not in res.stderr


def test_bad_input_json_is_exit_2() -> None:
    """An input that does not match the source's payload type exits 2 naming the field."""
    res = _run("run", "configs/demo.yaml", "--input", '{"value": 3}')
    assert res.returncode == 2
    assert "$.value" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("where", ["before the command", "after it"])
def test_debug_shows_the_traceback(tmp_path: Path, where: str) -> None:
    """--debug trades the one-line error for the full traceback, given before the command
    or among its own arguments."""
    command = ("validate", str(tmp_path / "missing.yaml"))
    args = ("--debug", *command) if where == "before the command" else (*command, "--debug")
    res = _run(*args)
    assert res.returncode != 0
    assert "Traceback" in res.stderr
    plain = _run(*command)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr


def test_debug_shows_where_a_stages_setup_failed(tmp_path: Path) -> None:
    """A stage whose setup raises fails start-up with one line (exit 3); with --debug the
    worker's traceback of it comes too, naming the setup that raised."""
    cfg = tmp_path / "p.yaml"
    cfg.write_text("stages:\n  broken: {impl: 'tests.pipeline.sample_stages:BrokenSetup'}\n")
    plain = _run("run", str(cfg), "--input", '{"value": "a"}')
    assert plain.returncode == 3, plain.stderr
    assert "OSError: weights file is missing" in plain.stderr
    assert "Traceback" not in plain.stderr
    debug = _run("run", str(cfg), "--input", '{"value": "a"}', "--debug")
    assert debug.returncode != 0
    assert "stage traceback:" in debug.stderr and "in setup" in debug.stderr, debug.stderr


@pytest.mark.parametrize("headless", [False, True], ids=["terminal", "headless"])
def test_a_headless_worker_logs_json_lines_even_on_a_terminal(headless: bool) -> None:
    """On a terminal a worker's log is rendered for reading; ``--headless`` makes it JSON
    lines there too, for a log collector. (Here: no master to reach, so it logs that.)"""
    primary, secondary = pty.openpty()
    try:
        args = ["worker", "--master", "tcp://127.0.0.1:9", "--stage", "split",
                "--connect-timeout", "1", *(["--headless"] if headless else [])]  # fmt: skip
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline", *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=secondary,
        )  # fmt: skip
        os.close(secondary)
        assert proc.wait(60) == 4
        text = b""
        while True:
            try:
                piece = os.read(primary, 65536)
            except OSError:  # the terminal's other end closed: all read
                break
            if not piece:
                break
            text += piece
    finally:
        os.close(primary)
    lines = [ln for ln in text.decode(errors="replace").splitlines() if "master_unreachable" in ln]
    assert lines, text
    records = [ln.strip() for ln in lines if ln.strip().startswith("{")]
    if headless:
        assert records and json.loads(records[0])["event"] == "master_unreachable"
    else:
        assert not records, lines


def test_show_stream_prints_the_first_response_as_it_streams(tmp_path: Path) -> None:
    """--show-stream FIELD writes that field of each streamed chunk, in order, before the batch."""
    cfg = tmp_path / "p.yaml"
    cfg.write_text(
        "stages:\n"
        "  tokens: {impl: 'tests.pipeline.sample_stages:Tokens'}\n"
        "  relay: {impl: 'tests.pipeline.sample_stages:Relay'}\n"
        "edges:\n  - {from: tokens, to: relay}\n"
    )
    res = _run(
        "run",
        str(cfg),
        "--input",
        '{"value": "alpha beta gamma"}',
        "--requests",
        "3",
        "--show-stream",
        "value",
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0] == "alphabetagamma"
    assert "streaming one request" in res.stderr
    assert "3/3 requests ok" in res.stderr


def test_bad_arguments_are_one_line_errors_not_tracebacks(tmp_path: Path) -> None:
    """Arguments that cannot work fail at once, on one line, with exit status 2: a negative
    request count, an input file that is not UTF-8, a worker's master that is not an
    endpoint. (Each used to end in a traceback, some only after the pipeline started.)"""
    binary = tmp_path / "inputs.jsonl"
    binary.write_bytes(b"\xff\xfe not json")
    cases = [
        (("run", "configs/demo.yaml", "--input", '{"value": "a"}', "--requests", "-1"),
         "--requests: -1 is below 0"),
        (("run", "configs/demo.yaml", "--input-file", str(binary)), "not UTF-8 text"),
        (("worker", "--master", "not-an-endpoint", "--stage", "split"),
         "is not a control endpoint"),
    ]  # fmt: skip
    for args, expected in cases:
        done = _run(*args, timeout=60)
        assert done.returncode == 2, (args, done.stderr)
        assert expected in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr, (args, done.stderr)


def test_debug_flag_reaches_the_worker_command() -> None:
    """``stagewire --debug worker ...`` runs the worker (here: no master to reach, exit 4),
    not the run command's code path (which failed with an AttributeError)."""
    done = _run(
        "--debug", "worker", "--master", "tcp://127.0.0.1:9", "--stage", "split",
        "--connect-timeout", "1", timeout=60,
    )  # fmt: skip
    assert done.returncode == 4, done.stderr
    assert "AttributeError" not in done.stderr


def test_error_messages_are_flattened_to_one_line() -> None:
    """A multi-line error (a stage's validation error, say) prints as one line."""
    from pipeline._cli import _one_line

    text = "2 validation errors for Params\nsize\n  Input should be a valid integer\n"
    flat = "2 validation errors for Params | size | Input should be a valid integer"
    assert _one_line(text) == flat


def test_version_names_the_installed_distribution() -> None:
    from importlib.metadata import version

    res = _run("--version")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"stagewire {version('stagewire')}"
