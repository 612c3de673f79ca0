"""``python -m pipeline ...`` is ``stagewire ...`` (whose console script calls :func:`run`);
local workers are started this way."""

import sys


def run() -> int:
    """The ``stagewire`` command: its modules load under a Ctrl-C handler of its own."""
    try:
        from pipeline._cli import main
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    return main()


if __name__ == "__main__":
    sys.exit(run())
