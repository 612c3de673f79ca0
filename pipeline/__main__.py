"""``python -m pipeline ...`` is ``stagewire ...`` (whose console script calls :func:`run`);
local workers are started this way."""

import sys
from collections.abc import Callable


def worker_argv(argv: list[str]) -> list[str] | None:
    """The ``stagewire worker`` arguments in ``argv`` (``--debug`` passed on), or None
    when ``argv`` is another command."""
    debug = argv[:1] == ["--debug"]
    command = argv[1:] if debug else argv
    if command[:1] != ["worker"]:
        return None
    return [*command[1:], *(["--debug"] if debug else [])]


def _import_structlog_without_rich() -> None:
    """Import structlog so that it does not load rich.

    structlog's console renderer formats exceptions with rich whenever rich imports, and
    loading rich's traceback and pretty-printing modules costs a worker about a sixth of
    its start-up. A worker's log lines are JSON unless its stderr is a terminal; there,
    its exceptions show as plain tracebacks. Only the import is steered: the stage's own
    code may import rich as usual afterwards.
    """
    if "structlog" in sys.modules or "rich" in sys.modules:
        return
    sys.modules["rich"] = None  # type: ignore[assignment]  # what makes an import fail
    try:
        import structlog  # noqa: F401
    finally:
        del sys.modules["rich"]


def run() -> int:
    """The ``stagewire`` command: its modules load under a Ctrl-C handler of its own.

    A worker loads only what it serves with (not the command line's progress bars,
    tables, master and launcher): every worker of a pipeline pays its imports at
    start-up, and the launcher starts them all at once.
    """
    worker = worker_argv(sys.argv[1:])
    entry: Callable[[list[str] | None], int]
    try:
        if worker is None:
            from pipeline._cli import main as entry
        else:
            _import_structlog_without_rich()
            from pipeline._worker import main as entry
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    return entry(worker)


if __name__ == "__main__":
    sys.exit(run())
