"""structlog set-up: a console renderer on a TTY, JSON lines otherwise, always to stderr.

Only lifecycle events are logged (``stage_started``, ``replica_dead``); the hot path keeps
counters instead.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from typing import Any, TextIO, cast

import structlog

__all__ = ("configure_logging", "count_dropped")

#: Counts of dropped messages at which a warning is logged: enough to see a flood begin,
#: and how it grows, without a line per message.
_MILESTONES = (1, 10, 100, 1000, 10_000, 100_000)


def count_dropped(logger: Any, event: str, before: int, n: int = 1, **context: Any) -> int:
    """``before + n``, logging ``event`` (a warning) as the count passes 1, 10, 100, ...

    For what the runtime drops rather than raises on (garbage on a socket, a malformed
    frame): counted always, logged where the count reaches each milestone.
    """
    after = before + n
    if any(before < m <= after for m in _MILESTONES):
        logger.warning(event, count=after, **context)
    return after


class Unfailing:
    """A text stream for log lines that never raises into the code that logs: once it
    cannot be written (its reader has gone, as in ``stagewire run ... 2>&1 | head``, or it
    was closed), lines are dropped. A log line must not fail what logged it."""

    __slots__ = ("__weakref__", "_stream", "broken")

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.broken = False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                self._stream.write(text)
            except (OSError, ValueError) as exc:  # ValueError: the stream was closed
                self._failed(exc)
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except (OSError, ValueError) as exc:  # ValueError: the stream was closed
                self._failed(exc)

    def _failed(self, exc: OSError | ValueError) -> None:
        """Stop writing for good once nobody reads (or the stream is closed); only this
        line is lost to a passing failure (a full pipe that does not block, a full disk)."""
        if not isinstance(exc, OSError) or exc.errno in (errno.EBADF, errno.EPIPE):
            self.broken = True


def configure_logging(level: str | None = None, *, json: bool | None = None) -> None:
    """Configure structlog for this process.

    Args:
        level: minimum level name; defaults to ``STAGEWIRE_LOG_LEVEL`` or ``warning``.
        json: force JSON (True) or console (False) rendering; defaults to JSON unless
            stderr is a TTY.
    """
    name = (level or os.environ.get("STAGEWIRE_LOG_LEVEL") or "warning").upper()
    if json is None:
        json = not sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(name)),
        logger_factory=structlog.PrintLoggerFactory(cast(TextIO, Unfailing(sys.stderr))),
        cache_logger_on_first_use=True,
    )
