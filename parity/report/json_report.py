"""The comparison report as JSON (``CompareReport.to_dict()``, format ``parity-compare-report``,
the conventions and schema of :mod:`parity.base.jsonformat`)."""
from __future__ import annotations

import os

from parity.base import jsonformat
from parity.base.files import write_atomically
from parity.judge.results import CompareReport


def to_json(report: CompareReport) -> str:
    return jsonformat.dumps(report.to_dict()) + "\n"


def write_json(report: CompareReport, path: str | os.PathLike) -> None:
    write_atomically(path, to_json(report), "--json")
