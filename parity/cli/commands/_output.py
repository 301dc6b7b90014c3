"""Where the commands' reports go: the text report on stdout, and ``--json``, ``--junit-xml``,
``--html``, ``--markdown`` files, any one of which may be ``-`` (standard output, instead of the
text report); which report paths are refused before a run, and the reports of a run that ended
with an error.

A report path is refused (one line, exit status 2) where writing it could lose data: a path that
is also one of the command's input files (``--import``, ``--against``, ``--tolerances``) or
another of its outputs (the same file under any name), or a path inside a parity bundle or rank
set (any enclosing directory whose manifest declares one), which a stray file would corrupt.
"""
from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path

from parity.base.errors import ParityError, UsageError, check_readable_file
from parity.base.files import check_distinct, check_writable, shown, write_atomically
from parity.base.jsonformat import COMPARE_REPORT
from parity.cli.options import STDOUT
from parity.cli.progress import progress_writer
from parity.report.error_report import error_reports

# The report options, by argparse dest: each may be a file or "-".
_REPORTS = (("json", "--json"), ("junit_xml", "--junit-xml"), ("html", "--html"), ("markdown", "--markdown"))
# Files the run itself writes (profile's trace): never standard output, never an error report.
_RUN_OUTPUTS = (("trace", "--trace"),)
# The attribute of the arguments that lists the reports this run has written (emit_report).
_WRITTEN = "_parity_reports_written"
# Input files, which no report may replace.
_INPUTS = (("import_file", "--import"), ("against", "--against"), ("tolerances", "--tolerances"))


def _given(args: argparse.Namespace, options) -> list[tuple[str, str, str]]:
    """``(dest, flag, value)`` of each of ``options`` that ``args`` sets."""
    return [(dest, flag, getattr(args, dest)) for dest, flag in options if getattr(args, dest, None) is not None]


def _to_stdout(args: argparse.Namespace) -> list[str]:
    return [flag for _, flag, path in _given(args, _REPORTS) if path == STDOUT]


def _declares(manifest: Path, format_name: str) -> bool:
    """Whether ``manifest`` is a regular file holding a JSON object of format ``format_name``. A
    file past the manifest size limit is not one of parity's (it is not read)."""
    from parity.bundle.manifest import MAX_MANIFEST_BYTES, parse_json

    try:
        info = os.stat(manifest)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_MANIFEST_BYTES:
            return False
        with open(manifest, "rb") as handle:
            document = parse_json(handle.read(MAX_MANIFEST_BYTES), str(manifest))
    except (OSError, ParityError):
        return False
    return isinstance(document, dict) and document.get("format") == format_name


def _enclosing_store(path: str) -> str | None:
    """``parity bundle DIR`` or ``parity rank set DIR`` where ``path`` (links resolved) lies inside one
    (any enclosing directory), else None."""
    from parity.bundle.manifest import FORMAT_NAME, MANIFEST_NAME
    from parity.distributed.rankset import FORMAT as RANK_SET_FORMAT, TOP_NAME

    for directory in Path(os.path.realpath(path)).parents:
        if _declares(directory / MANIFEST_NAME, FORMAT_NAME):
            return f"parity bundle {shown(directory)}"
        if _declares(directory / TOP_NAME, RANK_SET_FORMAT):
            return f"parity rank set {shown(directory)}"
    return None


def check_report_path(path: str, flag: str, others: list[tuple[str, str]]) -> None:
    """UsageError unless a report may be written at ``path`` (given as ``flag``): writable
    (:func:`parity.base.files.check_writable`), none of ``others`` ((flag, path) of the inputs and
    the other reports), outside any parity bundle or rank set."""
    check_writable(path, flag)
    check_distinct(path, flag, others)
    store = _enclosing_store(path)
    if store is not None:
        raise UsageError(f"{flag} {shown(path)} is inside {store}; write reports outside it")


def _files(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """``(dest, flag, path)`` of every output file asked for: the run's own, then the reports not on
    standard output."""
    return _given(args, _RUN_OUTPUTS) + [item for item in _given(args, _REPORTS) if item[2] != STDOUT]


def report_problems(args: argparse.Namespace) -> dict[str, UsageError]:
    """Why each report asked for in ``args`` may not be written, by dest (absent: it may): a second
    report asked on standard output, or a path :func:`check_report_path` refuses."""
    on_stdout = [(dest, flag) for dest, flag, path in _given(args, _REPORTS) if path == STDOUT]
    problems = {dest: UsageError(f"{on_stdout[0][1]} - and {flag} -: only one report can go to standard output; "
                                 f"give the other a file name") for dest, flag in on_stdout[1:]}
    others = [(flag, path) for _, flag, path in _given(args, _INPUTS)]
    for dest, flag, path in _files(args):
        try:
            check_report_path(path, flag, others)
        except UsageError as err:
            problems[dest] = err
        else:
            others.append((flag, path))
    return problems


def check_outputs(args: argparse.Namespace) -> None:
    """UsageError now, before a long run, for the first report that may not be written where asked
    (:func:`report_problems`)."""
    problems = report_problems(args)
    if problems:
        raise next(iter(problems.values()))


def emit_report(args: argparse.Namespace, dest: str, text: Callable[[], str],
                write_file: Callable[[str], object]) -> None:
    """The report ``dest`` (an argparse dest of :data:`_REPORTS`) if asked for: ``text()`` on
    standard output for ``-``, else ``write_file(path)``; then recorded as written, so that an
    error later in the run leaves it alone (:func:`write_error_outputs`)."""
    path = getattr(args, dest)
    if path is None:
        return
    if path == STDOUT:
        sys.stdout.write(text())
    else:
        write_file(path)
    vars(args).setdefault(_WRITTEN, set()).add(dest)


def write_outputs(report, args: argparse.Namespace) -> None:
    """The text report (unless a report goes to standard output), then every report file asked for."""
    from parity.report.json_report import to_json, write_json
    from parity.report.junit import to_junit_xml, write_junit_xml
    from parity.report.markdown import format_markdown, write_markdown
    from parity.report.text import TABLE_WIDTH, format_text

    if not _to_stdout(args):
        print(format_text(report, max_rows=args.max_rows, width=None if args.wide else TABLE_WIDTH,
                          distribution=getattr(args, "distribution", False)))
    emit_report(args, "json", lambda: to_json(report), lambda path: write_json(report, path))
    emit_report(args, "junit_xml", lambda: to_junit_xml(report), lambda path: write_junit_xml(report, path))
    emit_report(args, "markdown", lambda: format_markdown(report, max_rows=args.max_rows),
                lambda path: write_markdown(report, path, max_rows=args.max_rows))
    if args.html is not None:
        from parity.report.html import render_html, write_html

        document = json.loads(to_json(report))  # the page is drawn from the JSON report, as written
        emit_report(args, "html", lambda: render_html(document), lambda path: write_html(document, path))


def write_error_outputs(err: BaseException, args: argparse.Namespace, report_format: str) -> None:
    """A run that was refused or crashed leaves every report asked for saying so
    (:func:`parity.report.error_report.error_reports`), never none or a stale one from an earlier
    run; on standard output where ``-`` was asked. A report this run already wrote whole (the
    run failed on a later one) keeps what it holds: it is this run's, complete, and the exit
    status and stderr say what failed after it. Best effort: a report that may not
    (:func:`report_problems`) or cannot be written is skipped; the error on stderr says why."""
    written = getattr(args, _WRITTEN, set())
    asked = [(dest, flag, path) for dest, flag, path in _given(args, _REPORTS) if dest not in written]
    if not asked:
        return
    problems = report_problems(args)
    texts = error_reports(err, report_format=report_format, golden=getattr(args, "golden", None))
    for dest, flag, path in asked:
        if dest in problems:
            continue
        if path == STDOUT:
            sys.stdout.write(texts[dest])
            continue
        try:
            write_atomically(path, texts[dest], flag, wait_for_reader=False)
        except UsageError:
            pass


def run_reporting_errors(body: Callable[[argparse.Namespace], int], args: argparse.Namespace,
                         report_format: str = COMPARE_REPORT) -> int:
    """``body(args)``; a refused or crashed run still leaves its report files saying so, in
    ``report_format`` (:func:`write_error_outputs`), before the error goes on to the CLI's exit status."""
    try:
        return body(args)
    except Exception as err:
        write_error_outputs(err, args, report_format)
        raise


def check_judging_args(args: argparse.Namespace) -> None:
    """The arguments compare and diff share, checked before any bundle is read."""
    if args.max_rows is not None and args.max_rows < 1:
        raise UsageError(f"--max-rows must be at least 1, got {args.max_rows}")
    if args.tolerances is not None:
        check_readable_file(args.tolerances, "--tolerances")  # before open(): a FIFO would block forever
    check_outputs(args)


def stderr_progress(command: str) -> Callable[[str], None]:
    """Progress lines on stderr, ``parity <command>: ...``; on a terminal, counted progress
    (``N of M``) as a bar with the time left (:mod:`parity.cli.progress`)."""
    return progress_writer(sys.stderr, f"parity {command}: ")
