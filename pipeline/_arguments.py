"""The command line's argument parser: usage errors on one line, as the command's others."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import NoReturn

from pipeline._exit_codes import EXIT_CONFIG

__all__ = ("OneLineParser",)


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line: what is wrong, the option meant by a
    misspelt one, and where the help is. (argparse prints its usage block first: most of
    the lines, none of them the one that matters.) Its subcommands' parsers are of this
    class too."""

    def parse(self, args: Sequence[str] | None = None) -> argparse.Namespace:
        """Parse ``args`` as ``parse_args`` does; an unknown argument is refused by the
        parser of the subcommand it was given to, naming the option it resembles.

        Raises:
            SystemExit: the arguments are not valid (exit status 2), after one line on
                stderr; or ``--help`` or ``--version`` was given (status 0).
        """
        parsed, extras = self.parse_known_args(args)
        if extras:
            parser = self._command_parser(parsed)
            message = f"unrecognized arguments: {' '.join(extras)}"
            parser.error(message + parser._closest(extras))
        return parsed

    def error(self, message: str) -> NoReturn:
        """Exit with status 2 after one line saying what is wrong (argparse calls this)."""
        self.exit(EXIT_CONFIG, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def _command_parser(self, parsed: argparse.Namespace) -> OneLineParser:
        """The parser of the subcommand ``parsed`` names (the deepest), else this one."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                sub = action.choices.get(str(getattr(parsed, action.dest, "")))
                if isinstance(sub, OneLineParser):
                    return sub._command_parser(parsed)
        return self

    def _closest(self, extras: list[str]) -> str:
        """``: did you mean --x?`` for the first of ``extras`` that looks like a misspelt
        option of this parser; empty when none does."""
        options = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        for extra in extras:
            if extra.startswith("--"):
                close = difflib.get_close_matches(extra.partition("=")[0], options, n=1)
                if close:
                    return f"; did you mean {close[0]}?"
        return ""
