"""``python -m parity show``: what a golden bundle holds (subject, capture host, every tensor), checksums verified."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from ..errors import UsageError
from ..options import HelpFormatter, add_cli_options

EPILOG = """\
Reads the manifest (checked against its schema) and, unless --no-verify, every shard and every
tensor checksum, as `verify` does. Prints the subject (spec and arguments), how it was captured,
the capture host's platform fingerprint (the numerics settings on their own line), totals by
kind, then one table per kind of tensor: name, dtype, shape, bytes, and for recorded outputs
whether the bundle holds a high-precision reference and how many module inputs were recorded.
Nothing named in the bundle is imported or run. Exit status: 0 shown, 2 damaged or unusable
bundle or argument (one line on stderr).
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "show", help="show what a golden bundle holds: subject, platform, tensors, checksums",
        description="Show a golden bundle's subject, capture platform and every stored tensor "
                    "(kind, dtype, shape, bytes, reference, module inputs), with its checksums verified.",
        epilog=EPILOG, formatter_class=HelpFormatter,
    )
    parser.add_argument("bundle", help="the bundle directory")
    add_cli_options(parser, "json")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="do not read the tensors to check their checksums (the manifest is still checked)")
    parser.set_defaults(func=run)
    return parser


def _check_json_path(path: str) -> str:
    """The directory ``--json`` writes into; UsageError now, before a long verification, if it cannot."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"--json {path} is a directory; give a file name")
    if not os.path.isdir(directory):
        raise UsageError(f"--json {path}: directory {directory} does not exist")
    return directory


def _write_json(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (temporary file beside it, then rename)."""
    directory = _check_json_path(path)
    try:
        fd, temporary = tempfile.mkstemp(prefix=".parity-show-", suffix=".tmp", dir=directory)
    except OSError as err:
        raise UsageError(f"--json {path}: cannot write: {err.strerror or err}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(temporary, path)
    except OSError as err:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise UsageError(f"--json {path}: cannot write: {err.strerror or err}") from None


def run(args: argparse.Namespace) -> int:
    from ..show import describe_bundle, render_show

    if args.json and args.json != "-":
        _check_json_path(args.json)
    description = describe_bundle(args.bundle, verify=args.verify)
    if args.json != "-":
        print(render_show(description))
    if args.json:
        text = json.dumps(description, indent=1, ensure_ascii=False) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
        else:
            _write_json(args.json, text)
    return 0
