"""Where profile's and bench's reports go: the text report on stdout, ``--json`` and ``--html`` files
(either may be ``-``, standard output, instead of the text report); written whole or not at all.
Their paths are checked, and a failed run's reports written, as compare's (:mod:`._output`)."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from typing import Any

from parity.base.files import write_atomically
from parity.base.jsonformat import dumps
from parity.cli.options import STDOUT

from ._output import check_outputs as check_report_files
from ._output import mark_written, run_reporting_errors


def write_reports(document: Mapping[str, Any], args: argparse.Namespace, text: Callable[[Mapping[str, Any]], str],
                  page: Callable[[Mapping[str, Any]], str]) -> None:
    """The text report (unless a report goes to standard output), then ``--json`` and ``--html``."""
    if STDOUT not in (args.json, args.html):
        print(text(document))
    if args.json == STDOUT:
        sys.stdout.write(dumps(document) + "\n")
    elif args.json is not None:
        write_atomically(args.json, dumps(document) + "\n", "--json")
    if args.json is not None:
        mark_written(args, "json")
    if args.html == STDOUT:
        sys.stdout.write(page(document))
    elif args.html is not None:
        write_atomically(args.html, page(document), "--html")
    if args.html is not None:
        mark_written(args, "html")


__all__ = ["check_report_files", "run_reporting_errors", "write_reports"]
