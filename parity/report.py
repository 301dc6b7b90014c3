"""Reports of a comparison: a text report with a table for people, JSON and JUnit XML for machines.

Text (:func:`format_text`), in this order: a header naming the bundle and both hosts (vendor,
arch, device name, torch, Triton), warnings (numerics-relevant fingerprint differences, checks the
policy configured but that could not be made), the per-tensor table, the error-growth line, the
failing tensors with their reasons and the smallest tolerance that would have passed each, and a
last line that is the verdict::

    PARITY HOLDS: 12/12 tensors
    PARITY FAILS: first failing tensor layers.1.attn (5 of 12 tensors fail)

A ``parity diff`` report (``report.candidate`` set) has the same parts; its header names both
bundles and calls the candidate's host "candidate host" instead of "this host".

Table (:func:`format_table`): tabulate's ``github`` format (pasteable into Markdown; ``|`` in
names is escaped). One row per recorded tensor in execution order; columns layer, dtype, shape,
cosine, max abs, rel L2, mismatch %, verdict; with ``--isolate`` also the replayed layer's rel L2,
max abs and verdict and whether the layer *introduces* error (fails on golden inputs too) or
*inherits* it (fails end to end only); in budget mode also rel L2 against the high-precision
reference here and on the capture host. Numbers are compact, two significant digits
(``3.1e-3``; ``0`` is exactly zero); cosines at or above 0.999 are written ``1-x`` (``1-2.0e-6``
is 0.999998), exactly 1 as ``1``, lower ones as decimals; mismatch % is the percentage of finite
elements outside ``atol + atol_rms*rms(ref) + rtol*|ref|``. The verdict names the failed checks
(``FAIL rel_l2,mismatch``) or the problem (``FAIL missing here``). ``max_rows`` collapses runs of
passing rows (failing rows, their neighbours and the first and last rows are always kept).

"Would pass with" lines give, per failing tensor, each failed check's smallest passing value as
``key = value`` (TOML, ready for a ``[[layers]]`` entry of a tolerance file; upper bounds rounded
up, ``min_cosine`` rounded down). For the mismatch check any one of the listed alternatives
(``max_mismatch_fraction``, ``atol``, ``atol_rms``, ``rtol``) alone is enough.

JSON (:func:`to_json`) is ``CompareReport.to_dict()``: every number of every tensor, JSON-safe
(non-finite floats as ``"nan"``/``"inf"``). JUnit XML (:func:`to_junit_xml`): one ``testcase``
per tensor (``classname`` ``parity.compare.<subject>``), failures with every reason and the
passing tolerances, the hosts and warnings as ``properties``; built with ``xml.etree``.
"""
from __future__ import annotations

import json
import math
import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tabulate import tabulate

from . import dtypes
from .results import CompareReport, TensorResult
from .errors import UsageError
from .text import printable

TABLE_FORMAT = "github"
FAILURE_LIMIT = 5
COSINE_NEAR_ONE = 0.999

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
    "budget_k": "budget",
    "replay": "replay",
}
_MISMATCH_ALTERNATIVES = ("atol", "atol_rms", "rtol")
# The rule column: "budget" (the error budget against the reference, the thresholds as a
# backstop) or "thresh" (the fixed thresholds alone: the bundle has no reference of the tensor).
RULE_LABELS = {"budget": "budget", "thresholds": "thresh"}


# ---------------------------------------------------------------------------------------------
# Numbers


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def format_number(value: float | None, digits: int = 2) -> str:
    """``3.1e-3``, ``0`` for exactly zero, ``inf``/``nan``, ``-`` for None."""
    if value is None:
        return "-"
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0:
        return "0"
    mantissa, _, exponent = f"{value:.{digits - 1}e}".partition("e")
    return f"{mantissa}e{int(exponent)}"


def format_cosine(value: float | None) -> str:
    """``1`` exactly, ``1-2.0e-6`` at or above 0.999, else a decimal (``0.9731``)."""
    if value is None:
        return "-"
    value = float(value)
    if math.isnan(value):
        return "nan"
    if value == 1.0:
        return "1"
    if value >= COSINE_NEAR_ONE:
        return f"1-{format_number(1.0 - value)}"
    return f"{value:.4f}"


def format_percent(fraction: float | None) -> str:
    if fraction is None:
        return "-"
    if fraction == 0:
        return "0"
    percent = 100.0 * fraction
    return f"{percent:.2g}" if percent < 100 else "100"


def format_shape(shape: Sequence[int] | None) -> str:
    if shape is None:
        return "-"
    return "x".join(str(n) for n in shape) if len(shape) else "scalar"


def format_dtype(dtype: str | None) -> str:
    if dtype is None:
        return "-"
    return dtypes.lookup(dtype) or dtype


def _round_up(value: float, digits: int = 2) -> float:
    """The smallest number of ``digits`` significant digits that is >= ``value``."""
    if value <= 0 or not math.isfinite(value):
        return value
    exponent = math.floor(math.log10(value)) - (digits - 1)
    scale = 10.0 ** exponent
    rounded = math.ceil(value / scale - 1e-9) * scale
    if rounded < value:  # float rounding of the scaled value
        rounded = (math.ceil(value / scale) + 1) * scale
    return float(f"{rounded:.{digits - 1}e}")


def passing_value(key: str, needed: Any) -> str:
    """The value to write in a tolerance file for a failed check (see the module docstring)."""
    if key in ("missing", "shape", "dtype", "replay"):
        return str(needed)
    if key == "nan_policy":
        return f'"{needed}"'
    if key == "max_ulp":
        return str(int(needed))
    value = float(needed)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf"
    if key == "min_cosine":
        gap = 1.0 - value
        return repr(1.0 - _round_up(gap)) if 0 < gap < 1 else repr(value)
    return format_number(_round_up(value))


# ---------------------------------------------------------------------------------------------
# Text


def verdict_text(result: TensorResult) -> str:
    """``pass``, or ``FAIL`` with the failed checks (``FAIL rel_l2,mismatch``) or the problem."""
    if result.status == "fused-here":
        return "fused here"
    if result.passed:
        return "pass"
    if result.status == "missing-here":
        return "FAIL missing here"
    if result.status == "missing-in-golden":
        return "FAIL missing in golden"
    if result.status == "shape-mismatch":
        return "FAIL shape"
    if result.status in ("not-recorded", "not-replayable", "replay-error"):
        return result.status
    checks = result.failed_checks()
    labels = [CHECK_LABELS.get(key, key) for key in checks if key not in _MISMATCH_ALTERNATIVES]
    return "FAIL " + ",".join(labels) if labels else "FAIL"


def _escape_cell(text: str) -> str:
    """A name from a bundle as a Markdown table cell: control characters escaped (a manifest's
    layer name must not be able to drive the terminal), ``|`` escaped."""
    return printable(text).replace("|", "\\|")


def _columns(report: CompareReport) -> list[str]:
    columns = ["layer", "dtype", "shape", "cosine", "max abs", "rel L2", "mismatch %", "rule", "verdict"]
    if report.isolate:
        columns += ["iso rel L2", "iso max abs", "iso verdict", "error"]
    if report.budget_checked:
        columns += ["ref rel L2 here", "ref rel L2 golden"]
    return columns


def _row(report: CompareReport, result: TensorResult) -> list[str]:
    metrics = result.metrics
    shape = format_shape(result.shape)
    if result.status == "shape-mismatch":
        shape = f"{format_shape(result.here_shape)} (golden {shape})"
    dtype = format_dtype(result.dtype)
    if result.status == "dtype-mismatch":
        dtype = f"{format_dtype(result.here_dtype)} (golden {dtype})"
    row = [
        _escape_cell(result.name), dtype, shape,
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
            verdict_text(isolated) if isolated is not None else "-",
            {"introduced": "introduced", "inherited": "inherited"}.get(result.attribution or "", ""),
        ]
    if report.budget_checked:
        budget = result.budget
        row += [format_number(budget.host_rel_l2 if budget else None),
                format_number(budget.capture_rel_l2 if budget else None)]
    return row


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


def format_table(report: CompareReport, *, tablefmt: str = TABLE_FORMAT, max_rows: int | None = None) -> str:
    """The per-tensor table (module docstring); ``max_rows`` collapses long runs of passing rows."""
    columns = _columns(report)
    rows = []
    for item in _kept_rows(report, max_rows):
        if isinstance(item, tuple):
            start, stop = item
            rows.append([f"... {stop - start} passing ..."] + [""] * (len(columns) - 1))
        else:
            rows.append(_row(report, report.layers[item]))
    return tabulate(rows, headers=columns, tablefmt=tablefmt, disable_numparse=True)


def _host_text(host: dict[str, Any]) -> str:
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
    subject = report.subject.get("name") or report.subject.get("spec") or "?"
    if report.candidate is None:
        lines = [
            f"parity compare: {printable(report.golden)} (subject {printable(subject)}, {len(report.layers)} tensors)",
            f"  golden host: {printable(_host_text(report.hosts['golden']))}; impl {printable(report.golden_impl)}",
            f"  this host:   {_host_text(report.hosts['here'])}; impl {report.impl} on {report.device}",
        ]
    else:
        lines = [
            f"parity diff: golden {printable(report.golden)} vs candidate {printable(report.candidate)} "
            f"(subject {printable(subject)}, {len(report.layers)} tensors; nothing was run)",
            f"  golden host:    {printable(_host_text(report.hosts['golden']))}; impl {printable(report.golden_impl)}",
            f"  candidate host: {printable(_host_text(report.hosts['here']))}; impl {printable(report.impl)} on "
            f"{printable(report.device)}",
        ]
    lines += [
        f"  policy: {printable(report.policy.source)}"
        + ("; layers replayed on golden inputs (--isolate)" if report.isolate else ""),
        f"  rules: {rules_text(report)}",
    ]
    integrity = report.integrity
    if integrity:
        not_read = ", ".join(f"{count} {kind.replace('_', ' ')}" for kind, count in sorted(integrity["not_read"].items()))
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
    text = (f"error growth (rel L2, execution order): {format_number(first[1])} at {printable(first[0])} -> "
            f"{format_number(last[1])} at {printable(last[0])}")
    ratio = growth.last_over_first
    if ratio is not None and math.isfinite(ratio) and first[1] != 0:
        text += f" ({_ratio_text(ratio)})"
    if peak is not None and peak[0] != last[0]:
        text += f"; peak {format_number(peak[1])} at {printable(peak[0])}"
    jump = growth.largest_jump
    if jump is not None:
        name, before, after = jump
        factor = "from 0" if before == 0 else _ratio_text(after / before)
        text += f"; largest jump at {printable(name)} ({format_number(before)} -> {format_number(after)}, {factor})"
    return text


def _ratio_text(ratio: float) -> str:
    return f"{ratio:.3g}x" if 0.01 <= ratio < 1000 else f"{format_number(ratio)}x"


def would_pass_text(result: TensorResult) -> str | None:
    """``max_rel_l2 = 3.1e-5, min_cosine = 0.99999999953, ...``, or None if no tolerance would pass."""
    checks = result.failed_checks()
    if any(key in checks for key in ("missing", "shape", "replay")):
        return None
    parts = []
    mismatch = [f"{key} = {passing_value(key, checks[key])}"
                for key in ("max_mismatch_fraction",) + _MISMATCH_ALTERNATIVES if key in checks]
    for key, needed in checks.items():
        if key in ("dtype",) or key in _MISMATCH_ALTERNATIVES:
            continue
        if key == "max_mismatch_fraction":
            parts.append("(mismatch, any one of) " + " or ".join(mismatch))
        else:
            parts.append(f"{key} = {passing_value(key, needed)}")
    return ", ".join(parts) if parts else None


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
            lines.append("    no tolerance makes this pass")
        if result.attribution == "inherited":
            lines.append("    passes on its golden inputs (--isolate): the error is inherited from upstream")
    if rest:
        names = ", ".join(printable(result.name) for result in rest[:20]) + (", ..." if len(rest) > 20 else "")
        lines.append(f"  and {len(rest)} more (every number is in the JSON report): {names}")
    return lines


def verdict_line(report: CompareReport) -> str:
    """``PARITY HOLDS: 12/12 tensors`` or ``PARITY FAILS: first failing tensor X (n of m tensors fail)``."""
    total = len(report.layers)
    fused = len(report.fused_here)
    fused_text = f" ({fused} fused here, judged through their enclosing modules)" if fused else ""
    if report.passed:
        return f"PARITY HOLDS: {total}/{total} tensors{fused_text}"
    if total == 0:
        return "PARITY FAILS: nothing was compared (0 tensors)"
    failing = len(report.failing)
    first = printable(report.first_failing_layer)
    return f"PARITY FAILS: first failing tensor {first} ({failing} of {total} tensors fail)"


def format_text(report: CompareReport, *, tablefmt: str = TABLE_FORMAT, max_rows: int | None = None,
                failure_limit: int | None = FAILURE_LIMIT) -> str:
    """The whole report for people; the last line is the verdict."""
    lines = header_lines(report)
    lines += [f"warning: {printable(warning, limit=2000)}" for warning in report.warnings]
    lines += ["", format_table(report, tablefmt=tablefmt, max_rows=max_rows), ""]
    lines.append(growth_line(report))
    if report.isolate and report.introducing_layers:
        lines.append("error introduced by (fails on its golden inputs, innermost modules): "
                     + ", ".join(printable(name) for name in report.introducing_layers))
    failures = failure_lines(report, failure_limit)
    if failures:
        lines += [""] + failures
    lines += ["", verdict_line(report)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Files


def _check_writable(path: str | os.PathLike, what: str) -> Path:
    file = Path(path)
    if file.is_dir():
        raise UsageError(f"{what} {file} is a directory; give a file name")
    if not file.parent.is_dir():
        raise UsageError(f"{what} {file}: directory {file.parent} does not exist")
    return file


def check_report_paths(json_path: str | os.PathLike | None, junit_path: str | os.PathLike | None) -> None:
    """UsageError now, before a long comparison, if a report could not be written where asked."""
    if json_path is not None:
        _check_writable(json_path, "--json")
    if junit_path is not None:
        _check_writable(junit_path, "--junit-xml")


def _write(path: str | os.PathLike, text: str, what: str) -> None:
    file = _check_writable(path, what)
    try:
        file.write_text(text, encoding="utf-8")
    except OSError as err:
        raise UsageError(f"{what} {file}: cannot write: {err.strerror or err}") from None


def to_json(report: CompareReport) -> str:
    return json.dumps(report.to_dict(), indent=1, ensure_ascii=False, allow_nan=False) + "\n"


def write_json(report: CompareReport, path: str | os.PathLike) -> None:
    _write(path, to_json(report), "--json")


# XML 1.0 allows tab, newline, carriage return and everything from U+0020 up, minus surrogates
# and U+FFFE/U+FFFF; a layer name or an error message may hold anything.
_XML_INVALID = re.compile("[^\t\n\r\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml_text(value: Any) -> str:
    return _XML_INVALID.sub("\ufffd", str(value))


def _metrics_text(result: TensorResult) -> str:
    lines = [f"status: {result.status}", f"dtype: {result.dtype}", f"shape: {format_shape(result.shape)}"]
    metrics = result.metrics
    if metrics is not None:
        lines += [f"cosine: {metrics.cosine!r}", f"max_abs: {metrics.max_abs!r}", f"mean_abs: {metrics.mean_abs!r}",
                  f"rel_l2: {metrics.rel_l2!r}", f"mismatch_fraction: {metrics.mismatch_fraction!r}",
                  f"worst_index: {metrics.worst_index}"]
    if result.budget is not None and result.budget.host_vs_reference is not None:
        lines += [f"rel_l2_vs_reference_here: {result.budget.host_rel_l2!r}",
                  f"rel_l2_vs_reference_golden: {result.budget.capture_rel_l2!r}"]
    if result.isolated is not None:
        iso = result.isolated
        lines.append(f"isolated: {iso.status}" + (f", rel_l2 {iso.metrics.rel_l2!r}" if iso.metrics else "")
                     + (f" ({result.attribution})" if result.attribution else ""))
    return "\n".join(lines)


def to_junit_xml(report: CompareReport) -> str:
    """JUnit XML: one testsuite, one testcase per tensor; see the module docstring."""
    subject = str(report.subject.get("name") or report.subject.get("spec") or "subject")
    failing = len(report.failing)
    attributes = {"tests": str(len(report.layers)), "failures": str(failing), "errors": "0", "skipped": "0",
                  "time": f"{report.seconds:.3f}"}
    suites = ET.Element("testsuites", {"name": "parity compare", **attributes})
    suite = ET.SubElement(suites, "testsuite", {"name": _xml_text(f"parity compare {subject}"), **attributes})
    properties = ET.SubElement(suite, "properties")
    props = [("golden", report.golden)] + ([("candidate", report.candidate)] if report.candidate else [])
    props += [("impl", report.impl), ("device", report.device),
             ("golden_host", _host_text(report.hosts["golden"])), ("this_host", _host_text(report.hosts["here"])),
             ("policy", report.policy.source), ("verdict", verdict_line(report))]
    props += [("warning", warning) for warning in report.warnings]
    for name, value in props:
        ET.SubElement(properties, "property", {"name": name, "value": _xml_text(value)})
    classname = _xml_text(f"parity.compare.{subject}")
    for result in report.layers:
        case = ET.SubElement(suite, "testcase", {"classname": classname, "name": _xml_text(result.name),
                                                 "time": "0"})
        if not result.passed:
            reasons = list(result.verdict.reasons)
            would_pass = would_pass_text(result)
            body = "\n".join(reasons + ([f"would pass with: {would_pass}"] if would_pass else []))
            failure = ET.SubElement(case, "failure", {"message": _xml_text(reasons[0] if reasons else result.status),
                                                      "type": result.status})
            failure.text = _xml_text(body)
        out = ET.SubElement(case, "system-out")
        out.text = _xml_text(_metrics_text(result))
    ET.indent(suites)
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


def write_junit_xml(report: CompareReport, path: str | os.PathLike) -> None:
    _write(path, to_junit_xml(report), "--junit-xml")
