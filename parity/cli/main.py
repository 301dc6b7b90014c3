"""Command line entry point: argparse subcommands, thin over the library API.

Each subcommand lives in ``parity/cli/commands/<name>.py`` and provides ``add_parser(subparsers)``
(which sets ``func`` on its parser and returns it) and a ``run(args) -> int``. Exit status
(:mod:`parity.base.errors`): 0 parity holds, 1 parity fails, 2 the input was unusable (one line on
stderr, no traceback), 3 internal error (one line naming the failing place; ``--debug``, before
or after the subcommand, or ``PARITY_DEBUG=1`` prints the traceback), 130 interrupted.

``python -m parity`` and the ``parity`` console script behave the same: ``__main__`` takes off
``sys.path`` the current directory that ``python -m`` puts there, and the commands put it back
only for a subject spec the user named (``--subject``, or the ``trust`` list of their own config).
"""
from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
from importlib import metadata

from parity import __version__
from parity.base.errors import (
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    UsageError,
    classify,
    debug_from_environment,
    print_traceback,
)
from parity.base.text import did_you_mean, printable
from parity.cli.options import HelpFormatter, OneLineParser, stdout_as_dash

COMMANDS = ("capture", "compare", "diff", "inspect", "show", "verify", "profile", "bench")
# The commands that know they are one rank of a distributed launch (parity.distributed); any other,
# started by torchrun on several ranks, would run whole on each, racing for the same reports.
RANK_AWARE = ("capture", "compare")

EXIT_OK, EXIT_FAIL = 0, 1  # re-exported for callers of the CLI; the full table is in parity.base.errors

_DEBUG_HELP = "on an error, print the full traceback (also PARITY_DEBUG=1)"
DESCRIPTION = ("Numerical parity of kernels ported between GPU vendors: capture goldens on one host,\n"
               "compare another host's run against them, and profile and bench the port.\n"
               "`python -m parity COMMAND --help` for each command.")


def version() -> str:
    """The installed distribution's version (importlib.metadata), else ``parity.__version__``."""

    try:
        return metadata.version("parity")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed

        return __version__


class _Parser(OneLineParser):
    error_prefix = "parity"  # argparse's own usage errors: one line, exit 2


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m parity", description=DESCRIPTION, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"parity {version()}")
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMANDS:
        module = importlib.import_module(f"parity.cli.commands.{name}")
        command = module.add_parser(sub)
        if command is not None:
            # SUPPRESS: given after the subcommand it sets args.debug; absent, it leaves the
            # top-level parser's value alone.
            command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    return parser


@functools.lru_cache(maxsize=1)
def _shared_parser() -> argparse.ArgumentParser:
    """:func:`build_parser`'s parser, built once a process: parsing leaves a parser as it was, and
    building one imports every command and adds some 130 options, 8-16 ms that every ``main()``
    call paid (the bundle reader's mutation run calls it 4,000 times in one process)."""
    return build_parser()


def misspelling(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """A mistyped command or long option, named with the closest spelling, before argparse
    parses: argparse reports a missing required option first (``--bundel`` reads as "--bundle is
    required") and never suggests a spelling. None where nothing is mistyped, or where no known
    spelling is close (argparse's own message then stands); an unambiguous prefix of an option is
    not a typo (argparse accepts it)."""
    commands = next((action.choices for action in parser._actions
                     if isinstance(action, argparse._SubParsersAction)), {})
    words = iter(argv)
    for word in words:
        if word == "--":
            return None
        if word.startswith("-"):
            continue  # the top-level options (--debug, --version, --help)
        if word not in commands:
            hint = did_you_mean(word, commands)
            return f"unknown command {word!r}{hint}; commands: {', '.join(commands)}" if hint else None
        command, actions = word, commands[word]._option_string_actions
        break
    else:
        return None
    options = list(actions)
    for word in words:
        if word == "--":
            return None
        if not word.startswith("--") or len(word) == 2 or " " in word:  # argparse: a word with a space is a value
            continue
        name, given = word.split("=", 1)[0], "=" in word
        known = [name] if name in actions else [option for option in options if option.startswith(name)]
        if len(known) == 1:
            # the option's own value(s) follow it unless given with "=": never read as options
            nargs = actions[known[0]].nargs
            taken = 0 if given else 1 if nargs is None else nargs if isinstance(nargs, int) else 0
            for _ in range(taken):
                next(words, None)
            continue
        hint = did_you_mean(name, [option for option in options if option.startswith("--")])
        if hint:
            return f"unknown option {name} for parity {command}{hint}"
    return None


def report_error(err: BaseException, *, debug: bool) -> int:
    """Print ``err`` as the CLI does (one line; the traceback too with ``debug``); its exit status."""
    status, _, message = classify(err)
    if debug:
        print_traceback(err)
    if status == EXIT_USAGE:
        line = f"parity: error: {message}"
    else:
        line = f"parity: {message}" + ("" if debug else "; rerun with --debug for the traceback")
    print(line, file=sys.stderr, flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    debug = debug_from_environment()
    try:
        parser = _shared_parser()
        if not (sys.argv[1:] if argv is None else argv):  # no command: what there is, not one terse line
            sys.stderr.write(parser.format_help())
            return EXIT_USAGE
        misspelled = misspelling(parser, sys.argv[1:] if argv is None else list(argv))
        if misspelled:
            print(f"parity: error: {printable(misspelled, limit=500)}", file=sys.stderr, flush=True)
            return EXIT_USAGE
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # argparse's usage errors (2) and --help (0), as a return value
            return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
        # A default list (``action="append", default=[]``) is the parser's own object: a copy, so
        # that a command changing its list leaves the shared parser's default as it was.
        for name, value in vars(args).items():
            if isinstance(value, list):
                setattr(args, name, list(value))
        debug = debug or bool(getattr(args, "debug", False))
        _check_launch(args.command)
        stdout_as_dash(args)
        return int(args.func(args))
    except KeyboardInterrupt:
        print("parity: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as err:  # noqa: BLE001 - every exception becomes exit 2 or 3 with one line
        return report_error(err, debug=debug)


def _check_launch(command: str) -> None:
    """UsageError for a command that is not rank-aware, started as one of several ranks (``RANK``
    set and ``WORLD_SIZE`` above 1, as torchrun sets them and ``parity.distributed.group`` reads them)."""
    if command in RANK_AWARE or "RANK" not in os.environ:
        return
    world = os.environ.get("WORLD_SIZE", "1").strip()
    if world.isascii() and world.isdecimal() and int(world) > 1:
        raise UsageError(f"parity {command} runs in one process, not on each of {world} ranks (WORLD_SIZE={world}, "
                         f"as torchrun sets it): run it without torchrun; under torchrun, "
                         f"{' and '.join(RANK_AWARE)} take rank sets")


def entry() -> None:
    """The program (``parity`` and ``python -m parity``): :func:`main`, then exit with its status.

    A rank of a distributed launch that joined its process group here ends with ``os._exit`` once
    its output is flushed (bundles and reports are already committed and synced by then): at a
    normal interpreter exit, C++ destructors of the communication library's threads have aborted
    rank processes after successful runs ("terminate called without an active exception",
    SIGABRT, seen with gloo on a loaded CPU machine), turning a finished rank into a failed one.
    """
    status = main()
    group = sys.modules.get("parity.distributed.group")
    if group is not None and group.joined_here():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


__all__ = ["COMMANDS", "RANK_AWARE", "EXIT_OK", "EXIT_FAIL", "EXIT_USAGE", "EXIT_INTERNAL", "build_parser", "entry", "main",
           "report_error", "version"]
