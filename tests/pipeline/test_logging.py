"""What the runtime drops rather than raises on is counted always and logged now and then."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import pytest
import structlog

from pipeline._logging import configure_logging, count_dropped


class _Recorder:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))


def test_drops_are_logged_as_their_count_passes_each_power_of_ten() -> None:
    """One at a time or in runs, a warning marks the 1st, 10th, 100th, ... drop, with the
    count and the context; the drops between are only counted."""
    log = _Recorder()
    count = 0
    for _ in range(150):
        count = count_dropped(log, "garbage_dropped", count, stage="s")
    count = count_dropped(log, "garbage_dropped", count, 2000, stage="s")
    assert count == 2150
    assert [fields["count"] for _, fields in log.lines] == [1, 10, 100, 2150]
    assert all(event == "garbage_dropped" and f["stage"] == "s" for event, f in log.lines)
    # A run that passes several milestones at once is one line.
    log.lines.clear()
    assert count_dropped(log, "x", 0, 50_000) == 50_000 and len(log.lines) == 1


def test_a_log_line_into_a_stderr_whose_reader_has_gone_raises_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker shares its command's stderr: with ``2>&1 | head`` its reader goes, and a
    warning logged then raised BrokenPipeError into the code that logged it (a handler's
    failure report, a garbage count). Lines that cannot be written are dropped now."""
    read, write = os.pipe()
    os.close(read)
    config = structlog.get_config()
    with os.fdopen(write, "w") as broken:
        monkeypatch.setattr(sys, "stderr", broken)
        configure_logging("info", json=True)
        try:
            log = structlog.get_logger("stagewire.test")
            log.warning("first", n=1)
            log.error("second", n=2)
        finally:
            monkeypatch.undo()
            # As it was: later tests capture logs, which loggers cached meanwhile would miss.
            structlog.configure(**config)
        with contextlib.suppress(BrokenPipeError):
            broken.close()


def test_a_log_line_into_a_full_pipe_that_does_not_block_costs_only_that_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A non-blocking stderr that is full refuses a line for now (EAGAIN): that line is
    lost, and the lines after it, once the reader has caught up, are written."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    config = structlog.get_config()
    with os.fdopen(write, "w", buffering=1) as stderr, os.fdopen(read, "rb") as reader:
        with contextlib.suppress(BlockingIOError):
            while True:
                os.write(write, b"x" * 4096)
        monkeypatch.setattr(sys, "stderr", stderr)
        configure_logging("info", json=True)
        try:
            log = structlog.get_logger("stagewire.test")
            log.warning("while_full")
            os.set_blocking(read, False)
            with contextlib.suppress(BlockingIOError):
                while reader.read(1 << 16):
                    pass
            log.warning("after_drain")
        finally:
            monkeypatch.undo()
            structlog.configure(**config)
        assert b"after_drain" in reader.read(1 << 16)
