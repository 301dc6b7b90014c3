"""Where profile's and bench's reports go: the text report on stdout, ``--json`` and ``--html`` files
(either may be ``-``, standard output, instead of the text report); written whole or not at all.
Their paths are checked, and a failed run's reports written, as compare's (:mod:`._output`)."""
from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

from parity.base.files import write_atomically
from parity.base.jsonformat import dumps
from parity.cli.options import STDOUT

from ._output import check_outputs as check_report_files
from ._output import emit_report, run_reporting_errors


def write_reports(document: Mapping[str, Any], args: argparse.Namespace, text: Callable[[Mapping[str, Any]], str],
                  page: Callable[[Mapping[str, Any]], str]) -> None:
    """The text report (unless a report goes to standard output), then ``--json`` and ``--html``."""
    if STDOUT not in (args.json, args.html):
        print(text(document))
    emit_report(args, "json", lambda: dumps(document) + "\n",
                lambda path: write_atomically(path, dumps(document) + "\n", "--json"))
    emit_report(args, "html", lambda: page(document), lambda path: write_atomically(path, page(document), "--html"))


__all__ = ["check_report_files", "run_reporting_errors", "write_reports"]
