"""The comparison report for people: the text report and its table (Markdown, JSON, JUnit XML and
HTML are the sibling modules of :mod:`parity.report`; their parts are described here once).

Text (:func:`format_text`), in this order: a header naming the bundle and both hosts (vendor,
arch, device name, torch, Triton), warnings (numerics-relevant fingerprint differences, checks the
policy configured but that could not be made), the per-tensor table, the error-growth line, the
failing tensors with their reasons and the smallest tolerance that would have passed each, and a
last line that is the verdict::

    PARITY HOLDS: 12/12 tensors
    PARITY FAILS: first failing tensor layers.1.attn (5 of 12 tensors fail)

Before the failures, one line per tensor *beyond its derived bound* (evidence, never the verdict).
``distribution=True`` (``--distribution``) adds a table of every tensor's error percentiles.

A ``parity diff`` report (``report.candidate`` set) has the same parts; its header names both
bundles and calls the candidate's host "candidate host" instead of "this host".

Table (:func:`format_table`): tabulate's ``github`` format. On a terminal names are as they are
(control characters escaped); in Markdown output (``markdown=True``) ``| < > & * ` ] ~ $`` and a
``_`` that is not between two letters are backslash-escaped, so ``<root>/h`` renders as text. One row per recorded tensor in execution order; columns layer,
dtype, shape, cosine, max abs, rel L2, mismatch %, rule, verdict; with ``--isolate`` also the replayed layer's rel L2,
max abs, ``iso/bound`` (its error against the golden over the op's derived rounding bound on those
inputs, both hosts' roundings: ``0.31x``, ``0`` bit for bit, ``12x!`` beyond the slack, ``-`` for a
module that is no known op; :mod:`parity.judge.bounds`) and verdict and whether the layer
*introduces* error (fails on golden inputs too) or *inherits* it (fails end to end only); in budget mode also rel L2 against the high-precision
reference here and on the capture host. Numbers are compact, two significant digits
(``3.1e-3``; ``0`` is exactly zero); cosines at or above 0.999 are written ``1-x`` (``1-2.0e-6``
is 0.999998), exactly 1 as ``1``, lower ones as decimals; mismatch % is the percentage of finite
elements outside ``atol + atol_rms*rms(ref) + rtol*|ref|``. The verdict names the failed checks
(``FAIL rel_l2,mismatch``) or the problem (``FAIL missing here``). ``max_rows`` collapses runs of
passing rows (failing rows, their neighbours and the first and last rows are always kept).
``width`` (the CLI's 120 unless ``--wide``) keeps every line that narrow: first shape, the
isolated max abs and verdict, the reference columns and mismatch % are left out, the isolated rel
L2 and "introduced"/"inherited" merged into one "isolated" column, then iso/bound, and the rule column left out
where one rule judged every tensor (the header's "rules:" line says which); then verdicts name
their first failed check and a count (``FAIL mismatch+4``); then the longest parts of names are
cut in the middle (``transfo…blocks.1.attenti…ve_name``: indices and ends stay).

"Would pass with" lines give, per failing tensor, each failed check's smallest passing value as
``key = value`` (TOML, ready for a ``[[layers]]`` entry of a tolerance file; upper bounds rounded
up, ``min_cosine`` rounded down). For the mismatch check any one of the listed alternatives
(``max_mismatch_fraction``, ``atol``, ``atol_rms``, ``rtol``) alone is enough. Only values the
policy loader accepts are proposed: an alternative that would need an infinite value (``atol_rms``
against an all-zero golden) is named as one that cannot relax the check, and a check that only an
infinite value would pass (``max_rel_l2`` against an all-zero golden) means no tolerance passes.

JSON (:func:`to_json`) is ``CompareReport.to_dict()`` (format ``parity-compare-report``, the
conventions and schema of :mod:`parity.base.jsonformat`): every number of every tensor, JSON-safe
(non-finite floats as ``"nan"``/``"inf"``/``"-inf"``), and the verdict line as ``verdict``. JUnit
XML (:func:`to_junit_xml`), valid against the JUnit (xunit2) schema: one ``testcase`` per tensor
(``classname`` ``parity.compare.<subject>``, no ``time``: tensors are not timed one by one),
failures with every reason and the passing tolerances, the hosts, the verdict and warnings as
``properties`` of the ``testsuite`` (a test case has none); built with ``xml.etree``.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tabulate import tabulate

from parity.base.numbers import format_cosine, format_dtype, format_number, format_percent, format_ratio, format_shape
from parity.base.text import plural, printable, subject_name
from parity.judge import distribution as distribution_bins
from parity.judge.bounds import BoundCheck
from parity.run.resources import summary_line
from parity.judge.policy import MISMATCH_ALTERNATIVES
from parity.judge.results import CompareReport, TensorResult, unrelaxable_checks, verdict_line, would_pass_text
from parity.report.runs import determinism_lines, seeds_lines

TABLE_FORMAT = "github"
FAILURE_LIMIT = 5

# Short names of failed checks for the verdict column.
CHECK_LABELS = {
    "missing": "missing",
    "shape": "shape",
    "dtype": "dtype",
    "nan_policy": "nan/inf",
    "max_mismatch_fraction": "mismatch",
    "outlier_factor": "outliers",
    "min_cosine": "cosine",
    "max_rel_l2": "rel_l2",
    "max_abs": "max_abs",
    "max_ulp": "ulp",
    "max_bias": "biased",
    "budget_k": "budget",
    "replay": "replay",
}
# The rule column: "budget" (the error budget against the reference, the thresholds as a
# backstop) or "thresh" (the fixed thresholds alone: the bundle has no reference of the tensor).
RULE_LABELS = {"budget": "budget", "thresholds": "thresh"}


# ---------------------------------------------------------------------------------------------
# Text


def verdict_text(result: TensorResult) -> str:
    """``pass``, or ``FAIL`` with the failed checks (``FAIL rel_l2,mismatch``) or the problem."""
    return verdict_cell(result.status, result.passed, result.failed_checks())


def verdict_cell(status: str, passed: bool, failed_checks: Mapping[str, Any]) -> str:
    """:func:`verdict_text` from a result's parts (live, or read back from the JSON)."""
    if status == "fused-here":
        return "fused here"
    if status == "absent-here":
        return "absent here"
    if passed:
        return "pass"
    special = {"missing-here": "FAIL missing here", "missing-in-golden": "FAIL missing in golden",
               "shape-mismatch": "FAIL shape"}
    if status in special:
        return special[status]
    if status in ("not-recorded", "not-replayable", "replay-error"):
        return status
    labels = [CHECK_LABELS.get(key, key) for key in failed_checks if key not in MISMATCH_ALTERNATIVES]
    return "FAIL " + ",".join(labels) if labels else "FAIL"


# Markdown (GitHub) gives these a meaning inside a table cell: a name from a bundle is written with
# them backslash-escaped, so that ``<root>/h`` renders as text, not as an HTML tag, and ``a*b*``
# is not emphasis. ``]`` is escaped, ``[`` is not: every link, image and footnote needs its ``]``,
# and ``x[0]`` stays readable. ``_`` is escaped except between two letters or digits, where GFM
# never reads it as emphasis (``self_attn`` stays as it is). A backslash is already doubled by
# :func:`printable`.
_MARKDOWN_SPECIAL = frozenset("`*]<>&|~$")
ELLIPSIS = "…"
TABLE_WIDTH = 120  # the CLI's table without --wide
NAME_WIDTH_GOOD = 30  # drop a column before shortening names below this
NAME_WIDTH_MIN = 16  # names are never shortened below this
# Columns left out (or merged into one), in this order, while a table is wider than asked:
# (columns to leave out, the column that takes the first one's place or None). "rule" only where
# one rule judged every tensor (the header's "rules:" line says which).
_DROP_ORDER = ((("shape",), None), (("iso max abs",), None), (("iso verdict",), None),
               (("ref rel L2 here", "ref rel L2 golden"), None), (("mismatch %",), None),
               (("iso rel L2", "error"), "isolated"), (("iso/bound",), None), (("rule",), None))
_MERGED = ("isolated",)  # columns of a narrow table only: "7.1e-4 introduced" = iso rel L2 + error


def markdown_escape(text: str) -> str:
    """``text`` (already :func:`printable`) with Markdown's special characters backslash-escaped."""
    out = []
    last = len(text) - 1
    for index, char in enumerate(text):
        if char in _MARKDOWN_SPECIAL or (char == "_" and not (0 < index < last and text[index - 1].isalnum()
                                                               and text[index + 1].isalnum())):
            out.append("\\" + char)
        else:
            out.append(char)
    return "".join(out)


def _escape_cell(text: str, markdown: bool = False) -> str:
    """A name from a bundle as a table cell: control characters escaped (a manifest's layer name
    must not be able to drive the terminal) and ``|`` (it would split the cell); with
    ``markdown``, Markdown's other special characters too."""
    return markdown_escape(printable(text)) if markdown else printable(text).replace("|", "\\|")


def _cut(part: str, length: int, markdown: bool = False) -> str:
    """``part`` in ``length`` characters or so, the middle replaced by ``…`` (escaped as the cell is)."""
    if length >= len(part):
        return _escape_cell(part, markdown)
    head = (length - 1) // 2
    return (_escape_cell(part[:head], markdown) + ELLIPSIS
            + _escape_cell(part[len(part) - (length - 1 - head):], markdown))


LONG_NAME = 8  # names longer than this many cell widths are cut to their ends before shortening


def shorten_name(name: str, width: int, *, markdown: bool = False) -> str:
    """``name`` as a table cell of at most ``width`` characters. The longest dotted parts are cut
    in the middle first (``…`` in place of what was cut), so that the module indices and the ends
    of the names stay (``transfor…blocks.1.attenti…ve_name``); if that is not enough, the whole
    name is cut in the middle, more of its end kept than of its start. A name longer than
    ``LONG_NAME`` widths (an imported kernel name may run to megabytes) is first cut to its two
    ends: the search below costs the square of the length it starts from. ``markdown``: the cell
    is for Markdown output (special characters escaped, :func:`markdown_escape`)."""
    cell = _escape_cell(name, markdown)
    if len(cell) <= width:
        return cell
    keep = LONG_NAME * max(width, 1) // 2
    if len(name) > 2 * keep:
        name = name[:keep] + ELLIPSIS + name[-keep:]
    parts = name.split(".")
    lengths = [len(part) for part in parts]
    while True:
        candidate = ".".join(_cut(part, length, markdown) for part, length in zip(parts, lengths))
        if len(candidate) <= width:
            return candidate
        longest = max(range(len(parts)), key=lambda index: lengths[index])
        if lengths[longest] <= 5:
            break
        lengths[longest] -= 1
    for kept in range(min(len(name), width) - 1, 0, -1):
        head = kept * 2 // 5
        candidate = _escape_cell(name[:head], markdown) + ELLIPSIS + _escape_cell(name[len(name) - (kept - head):],
                                                                                markdown)
        if len(candidate) <= width:
            return candidate
    return ELLIPSIS


def _columns(report: CompareReport) -> list[str]:
    columns = ["tensor", "dtype", "shape", "cosine", "max abs", "rel L2", "mismatch %", "rule", "verdict"]
    if report.isolate:
        columns += ["iso rel L2", "iso max abs", "iso/bound", "iso verdict", "error", "isolated"]
    if report.budget_checked:
        columns += ["ref rel L2 here", "ref rel L2 golden"]
    return columns


def _row(report: CompareReport, result: TensorResult) -> list[str]:
    """The row's cells, the layer's name unescaped (the table escapes and shortens it)."""
    metrics = result.metrics
    shape = format_shape(result.shape)
    if result.status == "shape-mismatch":
        shape = f"{format_shape(result.here_shape)} (golden {shape})"
    dtype = format_dtype(result.dtype)
    if result.status == "dtype-mismatch":
        dtype = f"{format_dtype(result.here_dtype)} (golden {dtype})"
    row = [
        result.name, dtype, shape,
        format_cosine(metrics.cosine if metrics else None),
        format_number(metrics.max_abs if metrics else None),
        format_number(metrics.rel_l2 if metrics else None),
        format_percent(metrics.mismatch_fraction if metrics else None),
        RULE_LABELS.get(result.rule, "-"),
        verdict_text(result),
    ]
    if report.isolate:
        isolated = result.isolated
        iso_metrics = isolated.metrics if isolated is not None else None
        row += [
            format_number(iso_metrics.rel_l2 if iso_metrics else None),
            format_number(iso_metrics.max_abs if iso_metrics else None),
            bound_text(isolated.derived if isolated is not None else None),
            verdict_text(isolated) if isolated is not None else "-",
            {"introduced": "introduced", "inherited": "inherited"}.get(result.attribution or "", ""),
        ]
        row.append(f"{row[-5]} {row[-1]}".rstrip())  # "isolated", the narrow table's merge
    if report.budget_checked:
        budget = result.budget
        row += [format_number(budget.host_rel_l2 if budget else None),
                format_number(budget.capture_rel_l2 if budget else None)]
    return row


def bound_text(check: BoundCheck | None) -> str:
    """measured / derived: ``0.31x``, ``0`` (bit for bit), with ``!`` beyond the slack; ``-`` where
    the op has no derived bound."""
    if check is None:
        return "-"
    if check.ratio == 0:
        return "0"
    return format_ratio(check.ratio) + ("!" if check.beyond else "")


def bound_lines(report: CompareReport) -> list[str]:
    """One line per tensor beyond its derived bound (evidence beside the verdict)."""
    lines = []
    for result in report.beyond_derived_bound:
        check = result.isolated.derived
        lines.append(f"beyond derived bound: {printable(result.name)} ({check.op}): replayed on golden inputs it "
                     f"differs from the golden by {format_ratio(check.ratio)} the rounding bound of both hosts "
                     f"(slack {check.slack:g}x): not explained by rounding (evidence; the verdict is the rules')")
    return lines


def _compact_verdict(verdict: str, labels: int = 1) -> str:
    """``FAIL mismatch,cosine,rel_l2`` as ``FAIL mismatch+2`` (the failure lines under the table
    name every check)."""
    head, _, checks = verdict.partition(" ")
    parts = checks.split(",")
    if head != "FAIL" or len(parts) <= labels:
        return verdict
    return f"FAIL {','.join(parts[:labels])}+{len(parts) - labels}"


def _kept_rows(report: CompareReport, max_rows: int | None) -> list[int | tuple[int, int]]:
    """Indices of the rows to show; ``(start, stop)`` marks a collapsed run of passing rows.

    Kept: the first and last rows, every failing row and its neighbours, and the rows of the
    error-growth line (peak, largest jump)."""
    results = report.layers
    count = len(results)
    if not max_rows or count <= max_rows:
        return list(range(count))
    keep = {0, count - 1}
    growth = report.error_growth
    marked = {item[0] for item in (growth.peak, growth.largest_jump) if item is not None}
    for index, result in enumerate(results):
        if not result.passed:
            keep.update((index - 1, index, index + 1))
        if result.name in marked:
            keep.add(index)
    shown: list[int | tuple[int, int]] = []
    index = 0
    while index < count:
        if index in keep:
            shown.append(index)
            index += 1
            continue
        start = index
        while index < count and index not in keep:
            index += 1
        shown.append(index - 1 if index - start == 1 else (start, index))
    return shown


def _fit(columns: list[str], rows: list[list[str]], names: list[str | None], width: int
         ) -> tuple[list[str], list[list[str]], int]:
    """The columns to show and the name column's width for a table of at most ``width``
    characters a line: columns are left out or merged (``_DROP_ORDER``) until names fit or get
    ``NAME_WIDTH_GOOD`` characters, then verdicts name one check, then names are shortened (never
    below ``NAME_WIDTH_MIN``). tabulate's github format: ``| a | b |``, each column as wide as its
    widest cell or its header plus 2, 3 characters between columns, 1 at the end."""
    rule = columns.index("rule")
    uniform_rule = len({row[rule] for row, name in zip(rows, names) if name is not None}) <= 1
    longest = max([len(_escape_cell(name)) for name in names if name is not None] + [len(columns[0]) + 2]
                  + [len(row[0]) for row, name in zip(rows, names) if name is None])

    def name_room(shown: list[str]) -> int:
        widths = [max([len(column) + 2] + [len(row[columns.index(column)]) for row in rows]) for column in shown[1:]]
        return width - sum(widths) - 3 * len(shown) - 1

    shown = [column for column in columns if column not in _MERGED]
    steps = [step for step in _DROP_ORDER if step[0] != ("rule",) or uniform_rule]
    while name_room(shown) < min(longest, NAME_WIDTH_GOOD) and steps:
        dropped, merged = steps.pop(0)
        if merged is not None and dropped[0] in shown:
            shown.insert(shown.index(dropped[0]), merged)
        shown = [column for column in shown if column not in dropped]
    if name_room(shown) < min(longest, NAME_WIDTH_GOOD):
        verdict = columns.index("verdict")
        rows = [row[:verdict] + [_compact_verdict(row[verdict])] + row[verdict + 1:] for row in rows]
    return shown, rows, max(NAME_WIDTH_MIN, name_room(shown))


def format_table(report: CompareReport, *, tablefmt: str = TABLE_FORMAT, max_rows: int | None = None,
                 width: int | None = None, markdown: bool = False) -> str:
    """The per-tensor table (module docstring); ``max_rows`` collapses long runs of passing rows.
    ``width``: at most that many characters a line (columns left out, names shortened in the
    middle); None: every column, names in full. ``markdown``: names escaped for Markdown output
    (never on a terminal, where ``\\<root\\>`` would be noise)."""
    columns = _columns(report)
    rows: list[list[str]] = []
    names: list[str | None] = []  # None: a collapsed run, not a name
    for item in _kept_rows(report, max_rows):
        if isinstance(item, tuple):
            start, stop = item
            rows.append([f"... {stop - start} passing ..."] + [""] * (len(columns) - 1))
            names.append(None)
        else:
            row = _row(report, report.layers[item])
            names.append(row[0])
            rows.append(row)
    kept, name_width = [column for column in columns if column not in _MERGED], None
    if width is not None:
        kept, rows, name_width = _fit(columns, rows, names, width)
    cells = []
    for row, name in zip(rows, names):
        if name is not None:
            row = [_escape_cell(name, markdown) if name_width is None
                   else shorten_name(name, name_width, markdown=markdown)] + row[1:]
        cells.append([row[columns.index(column)] for column in kept])
    return tabulate(cells, headers=kept, tablefmt=tablefmt, disable_numparse=True)


def host_text(host: dict[str, Any] | None) -> str:
    """``nvidia sm_90 NVIDIA H200, torch 2.11.0, triton 3.6.0``: a host of the report's ``hosts``."""
    host = host or {}
    parts = [str(host.get("vendor") or "?")]
    for key in ("arch", "device_name"):  # a CPU host is "cpu cpu x86_64" otherwise
        if host.get(key) and str(host[key]) not in parts:
            parts.append(str(host[key]))
    text = " ".join(parts) + f", torch {host.get('torch') or '?'}"
    triton = host.get("triton")
    text += f", triton {triton}" if triton else ", no triton"
    if host.get("triton_interpreter"):
        text += " (interpreter)"
    return text


def rules_text(report: CompareReport) -> str:
    """Which rule judged how many tensors, in words."""
    rules = report.rules
    parts = []
    if rules.get("budget"):
        parts.append(f"error budget (k x the capture host's own error vs the reference, thresholds as backstop) "
                     f"on {rules['budget']}")
    if rules.get("thresholds"):
        parts.append(f"fixed thresholds alone on {rules['thresholds']}"
                     + (" (no reference in the bundle)" if report.budget is not False else " (--no-budget)"))
    return "; ".join(parts) if parts else "no tensor compared"


def header_lines(report: CompareReport) -> list[str]:
    subject = subject_name(report.subject.get("name"), report.subject.get("spec"))
    if report.candidate is None:
        lines = [
            f"parity compare: {printable(report.golden)} (subject {subject}, {plural(len(report.layers), 'tensor')})",
            f"  golden host: {printable(host_text(report.hosts['golden']))}; impl {printable(report.golden_impl)}",
            f"  this host:   {host_text(report.hosts['here'])}; impl {report.impl} on {report.device}",
        ]
    else:
        lines = [
            f"parity diff: golden {printable(report.golden)} vs candidate {printable(report.candidate)} "
            f"(subject {subject}, {plural(len(report.layers), 'tensor')}; nothing was run)",
            f"  golden host:    {printable(host_text(report.hosts['golden']))}; impl {printable(report.golden_impl)}",
            f"  candidate host: {printable(host_text(report.hosts['here']))}; impl {printable(report.impl)} on "
            f"{printable(report.device)}",
        ]
    lines += [
        f"  policy: {printable(report.policy.source)}"
        + ("; layers replayed on golden inputs (--isolate)" if report.isolate else ""),
        f"  rules: {rules_text(report)}",
    ]
    integrity = report.integrity
    if integrity:
        not_read = ", ".join(f"{count} {kind.replace('_', ' ')}" + ("s" if count != 1 else "")
                             for kind, count in sorted(integrity["not_read"].items()))
        lines.append(f"  bundle: checksums verified for the {integrity['verified']} of {integrity['tensors']} stored "
                     f"tensors this run read" + (f"; not read: {not_read} (python -m parity verify checks every "
                                                  "one)" if not_read else ""))
    return lines


def growth_line(report: CompareReport) -> str:
    """How rel L2 grows over the tensors in execution order, in one line."""
    growth = report.error_growth
    if not growth.points:
        return "error growth: no tensor was compared"
    if all(rel_l2 == 0 for _, rel_l2, _ in growth.points):
        return "error growth: none (rel L2 is 0 for every compared tensor)"
    first, last, peak = growth.first, growth.last, growth.peak
    if growth.cases:
        return (f"error (rel L2) over {growth.cases} independent cases, so no growth to follow: peak "
                f"{format_number(peak[1])} at {printable(peak[0])}" if peak is not None else
                f"error (rel L2) over {growth.cases} independent cases: every value is NaN")
    text = (f"error growth (rel L2, execution order): {format_number(first[1])} at {printable(first[0])} -> "
            f"{format_number(last[1])} at {printable(last[0])}")
    ratio = growth.last_over_first
    if ratio is not None and math.isfinite(ratio) and first[1] != 0:
        text += f" ({format_ratio(ratio)})"
    if peak is not None and peak[0] != last[0]:
        text += f"; peak {format_number(peak[1])} at {printable(peak[0])}"
    jump = growth.largest_jump
    if jump is not None:
        name, before, after = jump
        factor = "from 0" if before == 0 else format_ratio(after / before)
        text += f"; largest jump at {printable(name)} ({format_number(before)} -> {format_number(after)}, {factor})"
    return text


def failure_lines(report: CompareReport, limit: int | None = FAILURE_LIMIT) -> list[str]:
    failing = report.failing
    if not failing:
        return []
    shown = failing if limit is None else failing[:limit]
    more = f" (first {len(shown)} of {len(failing)})" if len(shown) < len(failing) else ""
    lines = [f"failing tensors{more}, with the smallest tolerance that would have passed each:"]
    rest = failing[len(shown):]
    for result in shown:
        lines.append(f"  {printable(result.name)}:")
        lines.extend(f"    {printable(reason, limit=2000)}" for reason in result.verdict.reasons)
        would_pass = would_pass_text(result)
        if would_pass:
            lines.append(f"    would pass with: {would_pass}")
        elif result.status != "dtype-mismatch":
            stuck = unrelaxable_checks(result)
            lines.append("    no tolerance makes this pass"
                         + (f" (no finite {' or '.join(stuck)} passes)" if stuck else ""))
        if result.attribution == "inherited":
            lines.append("    passes on its golden inputs (--isolate): the error is inherited from upstream")
    if rest:
        names = ", ".join(printable(result.name) for result in rest[:20]) + (", ..." if len(rest) > 20 else "")
        lines.append(f"  and {len(rest)} more (every number is in the JSON report): {names}")
    return lines


def distribution_table(report: CompareReport, *, tablefmt: str = TABLE_FORMAT, width: int | None = None,
                       markdown: bool = False) -> str:
    """Per compared tensor, the percentiles of ``|out - golden|`` (``p50`` ...) and of the relative
    error (``rel p50`` ..., ``|d| / max(|golden|, rel_floor)``): median, p90, p99, p99.9, each at most
    1.125x the exact one (:mod:`parity.judge.distribution`; the maxima are the main table's max abs
    and the JSON's ``max_rel``); "" where no tensor has them."""
    keys = [distribution_bins.percentile_key(q) for q in distribution_bins.PERCENTILES]
    headers = ["tensor"] + keys + [f"rel {key}" for key in keys]
    rows = []
    for result in report.layers:
        metrics = result.metrics
        if metrics is None or metrics.abs_err_percentiles is None:
            continue
        rows.append([result.name] + [format_number(metrics.abs_err_percentiles[key]) for key in keys]
                    + [format_number(metrics.rel_err_percentiles[key]) for key in keys])
    if not rows:
        return ""
    if width is not None:
        numbers = sum(max(len(header) + 2, *(len(row[i]) for row in rows)) for i, header in
                      enumerate(headers) if i) + 3 * len(headers) + 1
        room = max(NAME_WIDTH_MIN, width - numbers)
        rows = [[shorten_name(row[0], room, markdown=markdown)] + row[1:] for row in rows]
    else:
        rows = [[_escape_cell(row[0], markdown)] + row[1:] for row in rows]
    return tabulate(rows, headers=headers, tablefmt=tablefmt, disable_numparse=True)


def format_text(report: CompareReport, *, tablefmt: str = TABLE_FORMAT, max_rows: int | None = None,
                failure_limit: int | None = FAILURE_LIMIT, width: int | None = None,
                distribution: bool = False) -> str:
    """The whole report for people; the last line is the verdict. ``width``: the table's
    (:func:`format_table`; the CLI's is :data:`TABLE_WIDTH` unless ``--wide``). ``distribution``:
    also the error distribution of every tensor (:func:`distribution_table`, ``--distribution``)."""
    lines = header_lines(report)
    lines += [f"warning: {printable(warning, limit=2000)}" for warning in report.warnings]
    lines += ["", format_table(report, tablefmt=tablefmt, max_rows=max_rows, width=width), ""]
    if distribution:
        table = distribution_table(report, tablefmt=tablefmt, width=width)
        if table:
            lines += ["error distribution: percentiles of |d| = |this host - golden| (p50 ... p99.9), then of",
                      "|d| / max(|golden|, rel_floor) (rel); each at most 1.125x above the exact percentile", table, ""]
    lines.append(growth_line(report))
    if report.isolate and report.introducing_layers:
        lines.append("error introduced by (fails on its golden inputs, innermost modules): "
                     + ", ".join(printable(name) for name in report.introducing_layers))
    lines += bound_lines(report)
    failures = failure_lines(report, failure_limit)
    if failures:
        lines += [""] + failures
    runs = determinism_lines(report.determinism.to_dict() if report.determinism is not None else None)
    runs += seeds_lines(report.seeds.to_dict() if report.seeds is not None else None)
    if runs:
        lines += [""] + runs
    if report.resources is not None:
        lines += ["", f"compare cost: {summary_line(report.resources)}"]
    lines += ["", verdict_line(report)]
    return "\n".join(lines)
