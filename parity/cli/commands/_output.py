"""Where compare's and diff's reports go: the text report on stdout, and ``--json``, ``--junit-xml``,
``--html``, ``--markdown`` files, any one of which may be ``-`` (standard output, instead of the
text report)."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from parity.base.errors import UsageError, check_readable_file, classify
from parity.cli.options import STDOUT
from parity.report.error_report import error_document, error_junit_xml, write_error_reports

_FLAGS = (("json", "--json"), ("junit_xml", "--junit-xml"), ("html", "--html"), ("markdown", "--markdown"))


def _to_stdout(args: argparse.Namespace) -> list[str]:
    return [flag for dest, flag in _FLAGS if getattr(args, dest, None) == STDOUT]


def check_outputs(args: argparse.Namespace) -> None:
    """UsageError now, before a long comparison, for a report that could not be written where asked,
    or for two reports both asked on standard output."""
    from parity.report.html import check_html_path
    from parity.report.json_report import check_report_paths
    from parity.report.markdown import check_markdown_path

    stdout = _to_stdout(args)
    if len(stdout) > 1:
        raise UsageError(f"{' and '.join(f'{flag} -' for flag in stdout)}: only one report can go to standard "
                         f"output; give the others a file name")
    check_report_paths(None if args.json == STDOUT else args.json,
                       None if args.junit_xml == STDOUT else args.junit_xml)
    if args.html is not None and args.html != STDOUT:
        check_html_path(args.html)
    if args.markdown is not None and args.markdown != STDOUT:
        check_markdown_path(args.markdown)


def write_outputs(report, args: argparse.Namespace) -> None:
    """The text report (unless a report goes to standard output), then every report file asked for."""
    from parity.report.json_report import to_json, write_json
    from parity.report.junit import to_junit_xml, write_junit_xml
    from parity.report.markdown import format_markdown, write_markdown
    from parity.report.text import TABLE_WIDTH, format_text

    if not _to_stdout(args):
        print(format_text(report, max_rows=args.max_rows, width=None if args.wide else TABLE_WIDTH))
    if args.json == STDOUT:
        sys.stdout.write(to_json(report))
    elif args.json is not None:
        write_json(report, args.json)
    if args.junit_xml == STDOUT:
        sys.stdout.write(to_junit_xml(report))
    elif args.junit_xml is not None:
        write_junit_xml(report, args.junit_xml)
    if args.markdown == STDOUT:
        sys.stdout.write(format_markdown(report, max_rows=args.max_rows))
    elif args.markdown is not None:
        write_markdown(report, args.markdown, max_rows=args.max_rows)
    if args.html is not None:
        from parity.report.html import render_html, write_html

        document = json.loads(to_json(report))  # the page is drawn from the JSON report, as written
        if args.html == STDOUT:
            sys.stdout.write(render_html(document))
        else:
            write_html(document, args.html)


def write_error_outputs(err: BaseException, args: argparse.Namespace, golden: str | None) -> None:
    """A run that was refused or crashed leaves ``--json`` / ``--junit-xml`` reports saying so (CI
    reads them), never none or a stale passing one; on standard output where ``-`` was asked."""
    if args.json is None and args.junit_xml is None:
        return

    write_error_reports(err, json_path=None if args.json == STDOUT else args.json,
                        junit_path=None if args.junit_xml == STDOUT else args.junit_xml, golden=golden)
    if STDOUT in (args.json, args.junit_xml):
        status, kind, message = classify(err)
        if args.json == STDOUT:
            document = error_document(status, kind, message, golden=golden)
            sys.stdout.write(json.dumps(document, indent=1, ensure_ascii=False) + "\n")
        else:
            sys.stdout.write(error_junit_xml(status, kind, message))


def run_reporting_errors(body: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``body(args)``; a refused or crashed run still leaves its report files saying so
    (:func:`write_error_outputs`) before the error goes on to the CLI's exit status."""
    try:
        return body(args)
    except Exception as err:
        write_error_outputs(err, args, golden=args.golden)
        raise


def check_judging_args(args: argparse.Namespace) -> None:
    """The arguments compare and diff share, checked before any bundle is read."""
    if args.max_rows is not None and args.max_rows < 1:
        raise UsageError(f"--max-rows must be at least 1, got {args.max_rows}")
    if args.tolerances is not None:
        check_readable_file(args.tolerances, "--tolerances")  # before open(): a FIFO would block forever
    check_outputs(args)


def stderr_progress(command: str) -> Callable[[str], None]:
    """Progress lines on stderr, ``parity <command>: ...``."""
    def say(message: str) -> None:
        print(f"parity {command}: {message}", file=sys.stderr, flush=True)
    return say
