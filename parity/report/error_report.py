"""Machine-readable reports of a run that ended without a verdict (exit status 2 or 3).

CI reads ``--json`` and ``--junit-xml`` files; a run that crashed or was refused must not leave
them missing (or, worse, stale from a previous run and passing). So when compare ends with 2 or
3, these files are still written, recording the error instead of layer results (``profile`` and
``bench`` write their ``--json`` the same way, in their own formats):

- JSON: ``{"format": "parity-compare-report", "version": ..., "passed": false,
  "error": {"status": 2|3, "kind": "usage"|"internal", "message": "..."}}`` (the same format as
  the report it stands in for, so that its readers see it; ``parity/schemas/`` describes both);
- JUnit XML: one test suite ``parity compare`` with one errored test case ``compare``.

Writing is best effort: a report that cannot be written (the path was the problem) is skipped,
since the one-line error on stderr already says what went wrong.
"""
from __future__ import annotations

import os
import re
from xml.etree import ElementTree as ET

from parity.base import jsonformat
from parity.base.errors import UsageError, classify
from parity.base.files import write_atomically

REPORT_FORMAT = jsonformat.COMPARE_REPORT

# XML 1.0 forbids most control characters; an error message may hold anything.
_XML_INVALID = re.compile("[^\t\n\r\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def error_document(status: int, kind: str, message: str, *, golden: str | None = None,
                   report_format: str = REPORT_FORMAT) -> dict:
    """The JSON report of a run that ended with ``status`` 2 or 3: compare's by default, or that of
    ``report_format`` (``profile`` and ``bench`` write theirs the same way)."""
    document = {
        "format": report_format,
        "version": jsonformat.version_of(report_format),
        "passed": False,
        "error": {"status": status, "kind": kind, "message": message},
    }
    if golden is not None:
        document["golden"] = golden
    return document


def error_junit_xml(status: int, kind: str, message: str) -> str:
    """A JUnit file with one errored test case (``errors="1"``), which CI shows as broken, not failed."""
    text = _XML_INVALID.sub("\ufffd", message)
    suites = ET.Element("testsuites", name="parity", tests="1", failures="0", errors="1")
    suite = ET.SubElement(suites, "testsuite", name="parity compare", tests="1", failures="0", errors="1",
                          skipped="0")
    case = ET.SubElement(suite, "testcase", classname="parity.compare", name="compare")
    error = ET.SubElement(case, "error", type=kind, message=text[:1000])
    error.text = f"exit status {status}: {text}"
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


def _write_atomically(path: str | os.PathLike, text: str) -> bool:
    """Best effort: the run is already failing, so a report that cannot be written is skipped."""

    try:
        write_atomically(path, text, "report")
    except UsageError:
        return False
    return True


def write_error_reports(err: BaseException, *, json_path: str | os.PathLike | None,
                        junit_path: str | os.PathLike | None, golden: str | None = None) -> None:
    """Write the requested reports for ``err`` (classified as the CLI does), best effort."""
    status, kind, message = classify(err)
    if json_path is not None:
        document = error_document(status, kind, message, golden=golden)
        _write_atomically(json_path, jsonformat.dumps(document) + "\n")
    if junit_path is not None:
        _write_atomically(junit_path, error_junit_xml(status, kind, message))
