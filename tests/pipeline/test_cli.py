"""The stagewire command: run, validate, exit codes and one-line errors."""

from __future__ import annotations

import argparse
import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from pipeline import Pipeline, _cli


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


def test_run_shows_the_first_outputs_and_counts_the_rest_and_survives_a_full_stdout(
    tmp_path: Path,
) -> None:
    """Off ``--print-outputs`` only the three outputs of the lowest request numbers are
    kept (every output was held in memory until the end); a stdout that cannot be written
    (a full disk) is one line, not a traceback that lost the tables, and exit status 1
    (it was 0, the outputs lost without a trace in the status); a failure is one line
    however long its message."""
    cfg = tmp_path / "p.yaml"
    cfg.write_text("stages:\n  e: {impl: 'tests.pipeline.sample_stages:Echo'}\n")
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(f'{{"value": "v{i}"}}\n' for i in range(30)))
    res = _run("run", str(cfg), "--input-file", str(inputs), "--concurrency", "8")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [f'{i}: {{"value":"v{i}"}}' for i in range(3)]
    assert "(27 more outputs; --print-outputs shows all)" in res.stderr
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "pipeline", "run", str(cfg), "--input-file", str(inputs)],
            stdout=full, stderr=subprocess.PIPE, text=True, timeout=120, check=False,
        )  # fmt: skip
    # Its outputs are lost: exit status 1, not 0 (a reader that went away, ``| head``, is
    # another matter: see below).
    assert done.returncode == 1, done.stderr
    assert "cannot write the outputs: [Errno 28] No space left on device" in done.stderr
    assert "Traceback" not in done.stderr and "30/30 requests ok" in done.stderr
    boom = _run("run", str(cfg), "--input", '{"value": "boom' + "x" * 300 + '"}')
    (line,) = [ln for ln in boom.stderr.splitlines() if ln.startswith("failed ")]
    assert line.endswith("x" * 100 + "'"), boom.stderr


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
    """A stage whose setup raises fails start-up with one line (exit 3: the worker's own
    log line of it came first, saying it twice); with --debug the worker's traceback of it
    comes too, naming the setup that raised."""
    cfg = tmp_path / "p.yaml"
    cfg.write_text("stages:\n  broken: {impl: 'tests.pipeline.sample_stages:BrokenSetup'}\n")
    plain = _run("run", str(cfg), "--input", '{"value": "a"}')
    assert plain.returncode == 3, plain.stderr
    assert plain.stderr.count("OSError: weights file is missing") == 1, plain.stderr
    assert plain.stderr.startswith("error: pipeline failed to start"), plain.stderr
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


def _token_relay_config(tmp_path: Path) -> Path:
    """tokens (streams a token per word) -> relay, written to ``tmp_path/p.yaml``."""
    cfg = tmp_path / "p.yaml"
    cfg.write_text(
        "stages:\n"
        "  tokens: {impl: 'tests.pipeline.sample_stages:Tokens'}\n"
        "  relay: {impl: 'tests.pipeline.sample_stages:Relay'}\n"
        "edges:\n  - {from: tokens, to: relay}\n"
    )
    return cfg


def test_show_stream_prints_the_first_response_as_it_streams(tmp_path: Path) -> None:
    """--show-stream FIELD writes that field of each streamed chunk, in order, before the batch."""
    cfg = _token_relay_config(tmp_path)
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
    # The tables count the streamed request with the batch's three, and the summary says so.
    assert "3/3 requests ok (and the one streamed first, counted in the tables)" in res.stderr


@pytest.mark.parametrize("stdout", ["reader gone", "closed"])
def test_show_stream_to_a_stdout_that_cannot_be_written_still_runs_the_batch(
    tmp_path: Path, stdout: str
) -> None:
    """--show-stream into a pipe whose reader has gone (``| head``), or into a closed
    stdout: the stream's text is dropped and the batch still runs, its figures on stderr.
    (The batch never ran and the command exited 1, or with a traceback.)"""
    cfg = _token_relay_config(tmp_path)
    read, write = os.pipe()
    if stdout == "reader gone":
        os.close(read)
        command = [sys.executable, "-m", "pipeline"]
    else:
        os.close(read)
        command = ["sh", "-c", 'exec "$@" >&-', "sh", sys.executable, "-m", "pipeline"]
    try:
        res = subprocess.run(
            [*command, "run", str(cfg), "--input", '{"value": "alpha beta"}',
             "--requests", "3", "--show-stream", "value"],
            stdout=write, stderr=subprocess.PIPE, text=True, timeout=120, check=False,
        )  # fmt: skip
    finally:
        os.close(write)
    assert res.returncode == 0, res.stderr
    assert "3/3 requests ok" in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_bad_arguments_are_one_line_errors_not_tracebacks(tmp_path: Path) -> None:
    """Arguments that cannot work fail at once, on one line, with exit status 2: a negative
    request count, an input file that is not UTF-8, a worker's master that is not an
    endpoint. (Each used to end in a traceback, some only after the pipeline started.)"""
    binary = tmp_path / "inputs.jsonl"
    binary.write_bytes(b"\xff\xfe not json")
    not_utf8 = os.fsdecode(b'{"value": "caf' + bytes([0xE9]) + b'"}')
    deep = '{"value": "a", "x": ' + "[" * 5000 + "]" * 5000 + "}"
    sums = tmp_path / "sums.yaml"
    sums.write_text("stages:\n  s: {impl: 'tests.pipeline.sample_stages:Sums'}\n")
    wide = "99999999999999999999999"
    cases = [
        (("run", "configs/demo.yaml", "--input", '{"value": "a"}', "--requests", "-1"),
         "--requests: -1 is below 0"),
        (("run", "configs/demo.yaml", "--input-file", str(binary)), "not UTF-8 text"),
        # Bytes that are not UTF-8 in the argument itself, and JSON nested past what the
        # decoder goes (both ended in tracebacks, exit status 1).
        (("run", "configs/demo.yaml", "--input", not_utf8), "--input: not UTF-8 text"),
        (("submit", "--master", "tcp://127.0.0.1:9", "--input", not_utf8),
         "--input: not UTF-8 text"),
        (("run", "configs/demo.yaml", "--input", deep), "--input: JSON nested too deeply"),
        (("submit", "--master", "tcp://127.0.0.1:9", "--input", deep),
         "--input: JSON nested too deeply"),
        # A misspelt field was dropped without a word (an optional one kept its default).
        (("run", "configs/demo.yaml", "--input", '{"value": "a", "valeu": "b"}'),
         "--input: Text has no field 'valeu' (its fields: value)"),
        # An integer past 64 bits was read, the workers started, and its request failed
        # as it was sent ("cannot encode payload"), naming no field.
        (("run", str(sums), "--input", f'{{"values": [1, {wide}]}}'),
         f"--input: values[1] is {wide}, which does not fit in 64 bits"),
        (("submit", "--master", "tcp://127.0.0.1:9", "--input", f'{{"value": {wide}}}'),
         f"--input: value is {wide}, which does not fit in 64 bits"),
        (("worker", "--master", "not-an-endpoint", "--stage", "split"),
         "is not a control endpoint"),
        (("worker", "--master", "tcp://127.0.0.1:9", "--stage", "split", "--replica", "-1"),
         "--replica must be 0 or more"),
        # An address of no interface here (TEST-NET-1): the bind fails, nothing is sent.
        (("worker", "--master", "tcp://127.0.0.1:9", "--stage", "split",
          "--bind-host", "192.0.2.1"), "--bind-host '192.0.2.1' cannot be bound here"),
    ]  # fmt: skip
    for args, expected in cases:
        done = _run(*args, timeout=60)
        assert done.returncode == 2, (args, done.stderr)
        assert expected in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr, (args, done.stderr)


def test_a_run_with_its_stderr_closed_writes_its_outputs(tmp_path: Path) -> None:
    """A command started with its stderr closed (``2>&-``) runs, its workers too, and
    writes its outputs; a bad config is still exit status 2. (Both ended at once with exit
    status 1 and nothing written: the console and the log found no stderr.)"""
    closed = ["sh", "-c", 'exec "$@" 2>&-', "sh", sys.executable, "-m", "pipeline"]
    done = subprocess.run(
        [*closed, "run", "configs/demo.yaml", "--input", '{"value": "a b"}'],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (0, '0: {"value":"A B"}\n'), done
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: {a: {impl: 'stages.text:Split', nope: 1}}\n")
    refused = subprocess.run(
        [*closed, "validate", str(bad)], capture_output=True, timeout=60, check=False
    )
    assert refused.returncode == 2, refused


def test_what_a_stage_prints_goes_to_stderr_not_among_the_outputs(tmp_path: Path) -> None:
    """stdout holds the outputs alone, so ``run ... > out.jsonl`` is JSON lines; what a
    stage prints shows on stderr. (It was mixed into the outputs.)"""
    cfg = tmp_path / "p.yaml"
    cfg.write_text("stages:\n  e: {impl: 'tests.pipeline.sample_stages:Prints'}\n")
    done = _run("run", str(cfg), "--input", '{"value": "v"}', "--requests", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ['0: {"value":"v"}', '1: {"value":"v"}'], done.stdout
    assert "set up" in done.stderr and done.stderr.count("echoing v") == 2, done.stderr


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


def _echo_config(tmp_path: Path, name: str = "echo") -> Path:
    cfg = tmp_path / "p.yaml"
    cfg.write_text(
        f"name: {json.dumps(name)}\nstages:\n  e: {{impl: 'tests.pipeline.sample_stages:Echo'}}\n"
    )
    return cfg


def test_untrusted_text_is_printed_literally_not_as_rich_markup(tmp_path: Path) -> None:
    """Names, paths and error messages that look like rich markup are printed as written:
    a name "[/x]" neither crashes validate nor is "[bold]big" turned into "big"."""
    for name in ("[/x]", "[bold]big"):
        res = _run("validate", str(_echo_config(tmp_path, name)), timeout=60)
        assert res.returncode == 0, res.stderr
        assert f"pipeline {name!r}" in res.stderr, res.stderr
    missing = tmp_path / "[bold]x.yaml"
    res = _run("validate", str(missing), timeout=60)
    assert res.returncode == 2, res.stderr
    assert f"error: {missing}: file not found" in res.stderr, res.stderr
    failed = _run("run", str(_echo_config(tmp_path)), "--input", '{"value": "boom [/x]"}')
    assert failed.returncode == 1, failed.stderr
    assert "cannot echo 'boom [/x]'" in failed.stderr and "Traceback" not in failed.stderr


def test_debug_keeps_the_exit_code(tmp_path: Path) -> None:
    """--debug prints the traceback and still exits with the error's own code (2 for a bad
    file), not the 1 of an uncaught exception."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages:\n  a: {impl: 'stages.text:Split', replicas: two}\n")
    res = _run("--debug", "validate", str(bad), timeout=60)
    assert res.returncode == 2, res.stderr
    assert "Traceback" in res.stderr and "ConfigError" in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith(f"error: {bad}:2:")


def test_submit_failures_map_to_their_exit_codes() -> None:
    """A request the pipeline failed (a stage's PayloadError, a timeout once the master
    answered) is exit code 1; 3 only when no master answered, or it went away."""
    from pipeline._cli import EXIT_CONFIG, EXIT_FAILED, EXIT_START, _submit_failure
    from pipeline._errors import ConfigError, MasterUnavailable, PayloadError, StageError

    master = "tcp://127.0.0.1:7600"
    cases = [
        (PayloadError("relay: Token is not a Text"), True, EXIT_FAILED),
        (StageError("relay", "r1", "refused 'boom'"), True, EXIT_FAILED),
        (TimeoutError(), True, EXIT_FAILED),
        (MasterUnavailable(master, "it went away"), True, EXIT_START),
        (TimeoutError(), False, EXIT_START),
        (MasterUnavailable(master, "no answer"), False, EXIT_START),
        (ConfigError("not a ZMQ endpoint"), False, EXIT_CONFIG),
    ]
    for exc, answered, code in cases:
        fail = _submit_failure(exc, master, 5.0, answered=answered)
        assert fail.code == code, (exc, answered)
        assert "\n" not in str(fail)


def test_input_file_lines_end_at_newlines_only(tmp_path: Path) -> None:
    """A JSON line holding a raw U+2028, U+2029 or U+0085 in a string (which JSON allows)
    is one input, a line ending "\\r\\n" is read without its "\\r", and a byte-order mark
    (as some editors save) is not part of the first line ("malformed (byte 0)" before)."""
    inputs = tmp_path / "in.jsonl"
    values = ["a\u2028b", "c\u2029d", "e\u0085f"]
    inputs.write_text(
        "\ufeff" + "".join(json.dumps({"value": v}, ensure_ascii=False) + "\r\n" for v in values),
        encoding="utf-8",
        newline="",
    )
    res = _run("run", str(_echo_config(tmp_path)), "--input-file", str(inputs))
    assert res.returncode == 0, res.stderr
    assert "3/3 requests ok" in res.stderr
    outputs = [json.loads(line.partition(": ")[2])["value"] for line in res.stdout.split("\n")[:3]]
    assert outputs == values


def test_counts_beyond_the_maximum_are_usage_errors(tmp_path: Path) -> None:
    """A request count past 2**31 is refused by the argument parser (exit 2, one error line,
    nothing started), not an islice traceback after the workers started."""
    for flag in ("--requests", "--concurrency"):
        res = _run("run", str(_echo_config(tmp_path)), "--input", '{"value": "a"}',
                   flag, "99999999999999999999", timeout=60)  # fmt: skip
        assert res.returncode == 2, res.stderr
        errors = [ln for ln in res.stderr.splitlines() if "error:" in ln]
        assert errors == [
            f"stagewire run: error: argument {flag}: 99999999999999999999 is above 2147483648"
            " (see `stagewire run --help`)"
        ], res.stderr
        assert "Traceback" not in res.stderr


def test_usage_errors_are_one_line_naming_the_option_meant() -> None:
    """argparse printed its usage block (up to six lines) above the one line that says what
    is wrong. Now that line alone, with the option a misspelt one resembles, for the
    command's own parser as for a worker's."""
    cases = [
        (("run",), "stagewire run: error: the following arguments are required: config"
         " (see `stagewire run --help`)"),
        (("run", "configs/demo.yaml", "--requets", "3"), "stagewire run: error: unrecognized "
         "arguments: --requets 3; did you mean --requests? (see `stagewire run --help`)"),
        (("bogus",), "stagewire: error: argument command: invalid choice: 'bogus'"),
        (("worker", "--master", "tcp://127.0.0.1:9", "--stage", "s", "--replca", "1"),
         "stagewire worker: error: unrecognized arguments: --replca 1; did you mean "
         "--replica? (see `stagewire worker --help`)"),
    ]  # fmt: skip
    for args, expected in cases:
        done = _run(*args, timeout=60)
        assert done.returncode == 2, (args, done.stderr)
        assert len(done.stderr.splitlines()) == 1, (args, done.stderr)
        assert done.stderr.startswith(expected), (args, done.stderr)


def test_concurrency_is_at_most_the_number_of_requests(tmp_path: Path) -> None:
    """--concurrency above the request count starts one client per request, no more."""
    res = _run("run", str(_echo_config(tmp_path)), "--input", '{"value": "a"}',
               "--requests", "2", "--concurrency", "50")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "2/2 requests ok" in res.stderr and "at concurrency 2)" in res.stderr


def test_concurrency_is_at_most_what_the_pipeline_admits(tmp_path: Path) -> None:
    """--concurrency above the pipeline's max_inflight starts that many clients, and says
    so: each client beyond would only wait for a slot (2**31 of them ran out of memory)."""
    cfg = tmp_path / "p.yaml"
    cfg.write_text(
        "defaults: {max_inflight: 3}\nstages:\n  e: {impl: 'tests.pipeline.sample_stages:Echo'}\n"
    )
    res = _run("run", str(cfg), "--input", '{"value": "a"}',
               "--requests", "7", "--concurrency", "2147483648")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "7/7 requests ok" in res.stderr and "at concurrency 3)" in res.stderr
    assert "--concurrency 2147483648: the pipeline admits 3 requests at once" in res.stderr


def test_keys_refuses_an_empty_directory(tmp_path: Path) -> None:
    """``stagewire keys ''`` exits 2 with one line and writes nothing into the current
    directory (Path('') is the current directory)."""
    res = subprocess.run(
        [sys.executable, "-m", "pipeline", "keys", ""],
        capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert (
        res.stderr.strip() == "error: the key pair's directory is empty: name one, such as ./keys"
    )
    assert list(tmp_path.iterdir()) == []


def test_keys_refuses_a_file_saying_so(tmp_path: Path) -> None:
    """``stagewire keys FILE`` said "File exists", naming no problem a user could see."""
    target = tmp_path / "keys"
    target.write_text("not a directory")
    res = _run("keys", str(target), timeout=60)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == (
        f"error: {target} is a file, not a directory: name a directory for the key pair"
    )
    assert target.read_text() == "not a directory"


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://127.0.0.1", "tcp://", "tcp://*:7600", "tcp://:7600", "tcp://127.0.0.1:99999",
     "tcp://127.0.0.1:0", "ipc://"],
)  # fmt: skip
def test_malformed_master_endpoints_are_usage_errors(endpoint: str) -> None:
    """A master endpoint with no port, no host, a wildcard host or a port out of range fails
    worker and submit at once with exit 2 and one error line (not a ZMQ traceback, nor a
    wait that never ends)."""
    for args in (("worker", "--master", endpoint, "--stage", "split"),
                 ("submit", "--master", endpoint, "--input", '{"value": "a"}')):  # fmt: skip
        res = _run(*args, timeout=30)
        assert res.returncode == 2, (args, res.stderr)
        errors = [ln for ln in res.stderr.splitlines() if "error:" in ln]
        assert len(errors) == 1 and f"--master {endpoint!r}" in errors[0], (args, res.stderr)
        assert "Traceback" not in res.stderr, (args, res.stderr)


def test_show_stream_names_the_fields_when_none_is_the_one_asked(tmp_path: Path) -> None:
    """--show-stream with a field no chunk has says so and lists theirs (it printed
    nothing, silently)."""
    cfg = tmp_path / "p.yaml"
    cfg.write_text("stages:\n  tokens: {impl: 'tests.pipeline.sample_stages:Tokens'}\nedges: []\n")
    res = _run("run", str(cfg), "--input", '{"value": "a b"}', "--show-stream", "nosuch")
    assert res.returncode == 0, res.stderr
    assert "no streamed chunk has a text field 'nosuch'" in res.stderr
    assert "theirs: index, value" in res.stderr


def test_show_stream_of_several_sinks_names_each_chunks_sink(tmp_path: Path) -> None:
    """With several sinks, --show-stream prints each chunk as ``{sink: value}`` (or the
    field's text after the sink's name): it printed Python reprs of SinkOutput, and for a
    field nothing at all, without a word."""
    cfg = tmp_path / "p.yaml"
    cfg.write_text(
        "stages:\n"
        "  a: {impl: 'tests.pipeline.sample_stages:Echo'}\n"
        "  b: {impl: 'tests.pipeline.sample_stages:Echo'}\n"
        "  c: {impl: 'tests.pipeline.sample_stages:Echo'}\n"
        "edges: [{from: a, to: b}, {from: a, to: c}]\n"
    )
    chunks = _run("run", str(cfg), "--input", '{"value": "x y"}', "--show-stream")
    assert chunks.returncode == 0, chunks.stderr
    assert sorted(chunks.stdout.splitlines()[:2]) == [
        '{"b":{"value":"x y"}}',
        '{"c":{"value":"x y"}}',
    ]
    field = _run("run", str(cfg), "--input", '{"value": "x y"}', "--show-stream", "value")
    assert field.returncode == 0, field.stderr
    assert sorted(field.stdout.splitlines()[:2]) == ["[b] x y", "[c] x y"]


def test_run_writes_progress_lines_where_no_bar_shows(tmp_path: Path) -> None:
    """With stderr a file (a log, CI), no bar is drawn (nor a blank line where a transient
    one was): progress lines are written instead, every --progress-every seconds; and a
    period that is no time is a usage error."""
    cfg = _echo_config(tmp_path)
    done = _run("run", str(cfg), "--input", '{"value": "sleep 0.25"}', "--requests", "6",
                "--concurrency", "1", "--progress-every", "0.3")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "\n\n" not in done.stderr and not done.stderr.startswith("\n"), done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("progress: ")]
    assert lines, done.stderr
    assert re.fullmatch(r"progress: \d+/6 requests, 0 failed, [\d.]+ req/s, \d+s elapsed", lines[0])
    for bad in ("0", "nan", "inf", "soon"):
        refused = _run("run", str(cfg), "--input", '{"value": "a"}', "--progress-every", bad)
        assert refused.returncode == 2 and "--progress-every" in refused.stderr, refused.stderr


def test_a_ctrl_c_while_the_command_loads_is_one_line() -> None:
    """``import pipeline`` loads nothing heavy, so the ``stagewire`` entry point is running
    before its modules (pydantic, ZMQ, the codec) load, and a Ctrl-C meanwhile prints one
    line and exits 130: it printed a KeyboardInterrupt traceback, as in the first 0.3 s of
    every command. The interrupt is delivered as the CLI module starts to import."""
    script = (
        "import sys\n"
        "import pipeline\n"
        "heavy = [m for m in ('pipeline._api', 'pydantic', 'zmq') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'pipeline._cli':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Interrupt())\n"
        "from pipeline.__main__ import run\n"
        "sys.exit(run())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 130, done.stderr
    assert done.stderr == "interrupted\n", done.stderr


def _first_output_then_gone(stderr: Any) -> int:
    """Run a 3000-request batch of the demo printing its outputs, read the first line of its
    stdout, then close that pipe (as ``| head -1`` does); the command's exit status."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "run", "configs/demo.yaml", "--input-file",
         "configs/demo-inputs.jsonl", "--requests", "3000", "--print-outputs"],
        stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline()
        proc.stdout.close()
        return proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_reader_that_stops_early_ends_the_outputs_quietly(tmp_path: Path) -> None:
    """``stagewire run ... --print-outputs | head -1``: once the reader has gone, the outputs
    stop without a BrokenPipeError traceback, the figures still go to stderr, and the exit
    status is the run's own (it was 1, after a traceback and no figures)."""
    with (tmp_path / "err").open("wb") as err_file:
        assert _first_output_then_gone(err_file) == 0
    err = (tmp_path / "err").read_text()
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert "3000/3000 requests ok" in err, err


def test_a_reader_of_both_streams_that_stops_early_leaves_the_run_its_status() -> None:
    """``stagewire run ... 2>&1 | head -1``: once the reader has gone, whatever the command
    still writes, outputs, progress or figures (or a worker's log line), is dropped, and
    the run ends with its own exit status. The console's first write into the broken pipe
    used to end the command with status 1."""
    assert _first_output_then_gone(subprocess.STDOUT) == 0


def test_a_debug_traceback_into_a_stderr_whose_reader_has_gone_keeps_the_exit_status(
    tmp_path: Path,
) -> None:
    """``stagewire --debug validate BAD 2>&1 | head -0``: the traceback's write into the
    broken pipe raised, and the command exited 1 as for a broken stdout, not 2."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages:\n  a: {impl: 'm:A', replicas: 0}\n")
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pipeline", "--debug", "validate", str(bad)],
            stdout=write, stderr=write, timeout=60, check=False,
        )  # fmt: skip
    finally:
        os.close(write)
    assert done.returncode == 2


def test_validate_checks_the_key_pair_the_config_names(tmp_path: Path) -> None:
    """A ``master.keys`` directory without a pair passed ``validate`` and then failed
    ``run``: both refuse it now, on one line naming the file, field and line, exit 2."""
    cfg = tmp_path / "p.yaml"
    cfg.write_text(
        f"master: {{keys: {str(tmp_path / 'no-keys')!r}}}\n"
        "stages:\n  a: {impl: 'stages.text:Split'}\n"
    )
    for command in (("validate", str(cfg)), ("run", str(cfg), "--input", '{"value": "a"}')):
        done = _run(*command, timeout=60)
        assert done.returncode == 2, (command, done.stderr)
        assert "no CURVE key pair" in done.stderr and done.stderr.count("\n") == 1, done.stderr
        assert f"{cfg}:1: master.keys: no CURVE key pair in" in done.stderr, done.stderr


def test_an_output_json_cannot_hold_is_shown_as_python_shows_it() -> None:
    """A dict keyed by tuples (which the codec carries) failed the whole run after its
    requests succeeded: NotImplementedError, no tables, exit 1."""
    from pipeline._cli import to_json

    assert to_json({(1, 2): "a", "t": torch.zeros(2, 3)}) == (
        b'{"(1, 2)":"a","t":{"dtype":"torch.float32","shape":[2,3]}}'
    )


def test_latencies_read_in_their_unit() -> None:
    """A latency past a second read "3000.95 ms"."""
    from pipeline._report import _us

    assert [_us(v) for v in (850, 12_340, 3_000_950)] == ["850 µs", "12.34 ms", "3.00 s"]


def test_heartbeat_options_take_any_duration() -> None:
    """An infinite duration overflowed the conversion to milliseconds."""
    from pipeline._sockets import _ms

    assert [_ms(x, 100, 60_000) for x in (0.01, 1.5, 1e9, float("inf"))] == [
        100, 1500, 60_000, 60_000,
    ]  # fmt: skip


def test_an_input_file_that_never_ends_is_refused_at_a_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--input-file /dev/zero`` (a device named by mistake) was read whole: a MemoryError
    traceback, or the machine out of memory. Now it is read up to a bound and refused."""
    monkeypatch.setattr(_cli, "MAX_INPUT_CHARS", 4096)
    pipe = Pipeline.from_yaml("configs/demo.yaml")
    args = argparse.Namespace(input=None, input_file="/dev/zero")
    with pytest.raises(_cli._Fail, match="/dev/zero: more than 4,096 characters") as info:
        _cli._read_inputs(pipe, args)
    assert info.value.code == 2


class _Tagged(msgspec.Struct, tag=True):
    value: str


def test_a_tagged_source_type_takes_its_own_encoding_as_input() -> None:
    """A tagged Struct's JSON names its tag field; it was refused as an unknown field."""
    known = _cli._field_names(_Tagged)
    assert known == {"type", "value"}
    _cli._refuse_unknown_fields("--input", {"type": "_Tagged", "value": "x"}, "_Tagged", known)
    with pytest.raises(_cli._Fail, match="no field 'valeu'"):
        _cli._refuse_unknown_fields("--input", {"type": "_Tagged", "valeu": "x"}, "_Tagged", known)
