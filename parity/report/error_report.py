"""The reports of a run that ended without a verdict (exit status 2 or 3).

CI reads ``--json`` and ``--junit-xml`` files, and people the ``--html`` page and ``--markdown``
summary; a run that crashed or was refused must not leave them missing (or, worse, stale from a
previous run and passing). So when compare ends with 2 or 3, every report file asked for is still
written, recording the error instead of layer results (``profile`` and ``bench`` write their
``--json`` and ``--html`` the same way, in their own formats):

- JSON: ``{"format": "parity-compare-report", "version": ..., "passed": false,
  "error": {"status": 2|3, "kind": "usage"|"internal", "message": "..."}}`` (the same format as
  the report it stands in for, so that its readers see it; ``parity/schemas/`` describes both);
- JUnit XML: one test suite ``parity compare`` with one errored test case ``compare``;
- HTML: a short self-contained page with the exit status and the message;
- Markdown: a heading, the exit status and the message.

Writing is best effort (``parity.cli.commands._output``): a report that may not or cannot be
written (the path was the problem) is skipped, since the one-line error on stderr already says
what went wrong.
"""
from __future__ import annotations

import html
import re
from xml.etree import ElementTree as ET

from parity.base import jsonformat
from parity.base.errors import classify

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


def _command(report_format: str) -> str:
    """``parity compare`` for ``parity-compare-report``."""
    return "parity " + report_format.removeprefix("parity-").removesuffix("-report")


def _exit_line(status: int, kind: str) -> str:
    return f"exit status {status} ({kind} error): no result"


def error_html(status: int, kind: str, message: str, *, report_format: str = REPORT_FORMAT) -> str:
    """A short self-contained page saying that the run ended with ``status`` and why."""
    title = html.escape(f"{_command(report_format)}: error")
    # The message is one line that often holds a long path: it wraps anywhere rather than widen the page.
    return (f"<!DOCTYPE html>\n<html lang=\"en\">\n<head><meta charset=\"utf-8\"><title>{title}</title>"
            f"<style>pre{{white-space:pre-wrap;overflow-wrap:anywhere}}</style></head>\n"
            f"<body>\n<h1>{title}</h1>\n<p>{html.escape(_exit_line(status, kind))}</p>\n"
            f"<pre>{html.escape(message)}</pre>\n</body>\n</html>\n")


def error_markdown(status: int, kind: str, message: str, *, report_format: str = REPORT_FORMAT) -> str:
    """A Markdown summary saying that the run ended with ``status`` and why (the message as an
    indented code block, every line of it)."""
    block = "\n".join(f"    {line}" for line in message.splitlines() or [""])
    return f"## {_command(report_format)}: error\n\n{_exit_line(status, kind)}\n\n{block}\n"


def error_reports(err: BaseException, *, report_format: str = REPORT_FORMAT,
                  golden: str | None = None) -> dict[str, str]:
    """The text of each report of ``err`` (classified as the CLI does), by the option's dest:
    ``json``, ``junit_xml``, ``html``, ``markdown``."""
    status, kind, message = classify(err)
    document = error_document(status, kind, message, golden=golden, report_format=report_format)
    return {
        "json": jsonformat.dumps(document) + "\n",
        "junit_xml": error_junit_xml(status, kind, message),
        "html": error_html(status, kind, message, report_format=report_format),
        "markdown": error_markdown(status, kind, message, report_format=report_format),
    }
