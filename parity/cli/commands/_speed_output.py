"""Where profile's and bench's reports go: the text report on stdout, ``--json`` and ``--html`` files
(either may be ``-``, standard output, instead of the text report); written whole or not at all."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from typing import Any

from parity.base.errors import UsageError, classify
from parity.cli.options import STDOUT
from parity.base.files import check_writable
from parity.base.files import write_atomically
from parity.base.jsonformat import dumps
from parity.report.error_report import error_document


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


def run_reporting_errors(body: Callable[[argparse.Namespace], int], args: argparse.Namespace,
                         report_format: str) -> int:
    """``body(args)``; a refused or crashed run still leaves its ``--json`` report saying so (the
    error document in ``report_format``, :mod:`parity.report.error_report`), never none or a stale
    one from an earlier run, before the error goes on to the CLI's exit status. Best effort: a
    report that cannot be written is skipped (the error on stderr says why)."""
    try:
        return body(args)
    except Exception as err:
        if args.json is not None:
            status, kind, message = classify(err)
            text = dumps(error_document(status, kind, message, report_format=report_format)) + "\n"
            if args.json == STDOUT:
                sys.stdout.write(text)
            else:
                try:
                    write_atomically(args.json, text, "--json")
                except UsageError:
                    pass
        raise
