"""The comparison report as Markdown (a CI job summary, a pull-request comment): the text report's
lines with Markdown's special characters escaped (:mod:`parity.report.text`)."""
from __future__ import annotations

import os

from parity.base.files import write_atomically
from parity.base.text import printable
from parity.judge.results import CompareReport, verdict_line
from parity.report.runs import determinism_lines, seeds_lines
from parity.report.text import FAILURE_LIMIT, failure_lines, format_table, growth_line, header_lines, markdown_escape


def format_markdown(report: CompareReport, *, max_rows: int | None = None,
                    failure_limit: int | None = FAILURE_LIMIT) -> str:
    """The text report as a Markdown document (a CI job summary, a pull-request comment): the
    verdict in bold first and last, the header and failures as lists, the table with every
    column. Every line is the text report's (already :func:`printable`) with Markdown's special
    characters escaped, so a name or a reason from a bundle renders as the text it is."""
    verdict = f"**{markdown_escape(verdict_line(report))}**"
    header = header_lines(report)
    lines = [verdict, "", markdown_escape(header[0]), ""]
    lines += [f"- {markdown_escape(line.strip())}" for line in header[1:]]
    lines += [f"- warning: {markdown_escape(printable(warning, limit=2000))}" for warning in report.warnings]
    lines += ["", format_table(report, max_rows=max_rows, markdown=True), "", markdown_escape(growth_line(report))]
    if report.isolate and report.introducing_layers:
        lines += ["", "error introduced by (fails on its golden inputs, innermost modules): "
                  + ", ".join(markdown_escape(printable(name)) for name in report.introducing_layers)]
    failures = failure_lines(report, failure_limit)
    if failures:
        lines += ["", markdown_escape(failures[0])]
        for line in failures[1:]:  # "  name:" and "    reason" lines: a list and its sublists
            depth = (len(line) - len(line.lstrip(" "))) // 2
            lines.append("  " * (depth - 1) + "- " + markdown_escape(line.strip()))
    for runs in (determinism_lines(report.determinism.to_dict() if report.determinism is not None else None),
                 seeds_lines(report.seeds.to_dict() if report.seeds is not None else None)):
        if runs:
            lines += ["", markdown_escape(runs[0])] + [f"- {markdown_escape(line.strip())}" for line in runs[1:]]
    lines += ["", verdict]
    return "\n".join(lines) + "\n"


def write_markdown(report: CompareReport, path: str | os.PathLike, *, max_rows: int | None = None) -> None:
    write_atomically(path, format_markdown(report, max_rows=max_rows), "--markdown")
