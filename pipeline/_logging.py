"""structlog set-up: a console renderer on a TTY, JSON lines otherwise, always to stderr.

Only lifecycle events are logged (``stage_started``, ``replica_dead``); the hot path keeps
counters instead.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

__all__ = ("configure_logging",)


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
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
