"""The comparison report as JSON (``CompareReport.to_dict()``, format ``parity-compare-report``,
the conventions and schema of :mod:`parity.base.jsonformat`), and the check of the machine
reports' paths before a long run."""
from __future__ import annotations

import os

from parity.base import jsonformat
from parity.base.files import check_writable, write_atomically
from parity.judge.results import CompareReport


def check_report_paths(json_path: str | os.PathLike | None, junit_path: str | os.PathLike | None) -> None:
    """UsageError now, before a long comparison, if a report could not be written where asked."""
    if json_path is not None:
        check_writable(json_path, "--json")
    if junit_path is not None:
        check_writable(junit_path, "--junit-xml")


def to_json(report: CompareReport) -> str:
    return jsonformat.dumps(report.to_dict()) + "\n"


def write_json(report: CompareReport, path: str | os.PathLike) -> None:
    write_atomically(path, to_json(report), "--json")
