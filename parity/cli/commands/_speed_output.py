"""Where profile's and bench's reports go: the text report on stdout, ``--json`` and ``--html`` files
(either may be ``-``, standard output, instead of the text report); written whole or not at all."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from typing import Any

from parity.base.errors import UsageError
from parity.cli.options import STDOUT
from parity.base.files import check_writable
from parity.base.files import write_atomically
from parity.base.jsonformat import dumps


def check_report_files(args: argparse.Namespace) -> None:
    """UsageError now, before a long run, for a report that could not be written where asked."""

    if args.json == STDOUT and args.html == STDOUT:
        raise UsageError("--json - and --html -: only one report can go to standard output; give the other a file name")
    for flag, path in (("--json", args.json), ("--html", args.html)):
        if path is not None and path != STDOUT:
            check_writable(path, flag)


def write_reports(document: Mapping[str, Any], args: argparse.Namespace, text: Callable[[Mapping[str, Any]], str],
                  page: Callable[[Mapping[str, Any]], str]) -> None:

    if STDOUT not in (args.json, args.html):
        print(text(document))
    if args.json == STDOUT:
        sys.stdout.write(dumps(document) + "\n")
    elif args.json is not None:
        write_atomically(args.json, dumps(document) + "\n", "--json")
    if args.html == STDOUT:
        sys.stdout.write(page(document))
    elif args.html is not None:
        write_atomically(args.html, page(document), "--html")
