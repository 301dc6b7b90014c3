"""Command line entry point: argparse subcommands, thin over the library API.

Each subcommand lives in ``parity/commands/<name>.py`` and provides ``add_parser(subparsers)``
(which sets ``func`` on its parser) and a ``run(args) -> int``. Exit status: 0 parity holds,
1 parity fails, 2 the input was unusable (one line on stderr, no traceback).
"""
from __future__ import annotations

import argparse
import importlib
import sys

from .errors import UsageError

COMMANDS = ("capture", "compare", "inspect")

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own usage errors: one line, exit 2
        self.exit(EXIT_USAGE, f"parity: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m parity", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMANDS:
        module = importlib.import_module(f"parity.commands.{name}")
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse's usage errors (2) and --help (0), as a return value
        return int(exc.code or 0)
    try:
        return int(args.func(args))
    except UsageError as err:
        print(f"parity: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, TypeError) as err:
        # Raised while building or running a subject from the given arguments (a bad --arg, a
        # manifest whose subject args do not fit, a kernel input check): unusable input, not a
        # parity failure, so exit 2 with one line rather than a traceback and status 1.
        print(f"parity: error: {type(err).__name__}: {err}".splitlines()[0], file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("parity: interrupted", file=sys.stderr)
        return 130
