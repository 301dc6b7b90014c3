"""The comparison report as JUnit XML (xunit2), built with ``xml.etree``: one testsuite, one
testcase per tensor (see :mod:`parity.report.text` for what each part holds)."""
from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from typing import Any

from parity.base.files import write_atomically
from parity.base.numbers import format_shape
from parity.judge.results import CompareReport, TensorResult, verdict_line, would_pass_text
from parity.report.runs import determinism_junit_case, seeds_lines
from parity.report.text import host_text

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
                  f"rel_l2: {metrics.rel_l2!r}", f"bias: {metrics.bias!r} (z {metrics.bias_z!r})",
                  f"mismatch_fraction: {metrics.mismatch_fraction!r}",
                  f"worst_index: {metrics.worst_index}"]
    if result.budget is not None and result.budget.host_vs_reference is not None:
        lines += [f"rel_l2_vs_reference_here: {result.budget.host_rel_l2!r}",
                  f"rel_l2_vs_reference_golden: {result.budget.capture_rel_l2!r}"]
    if result.note is not None:
        lines.append(f"note: {result.note}")
    if result.isolated is not None:
        iso = result.isolated
        lines.append(f"isolated: {iso.status}" + (f", rel_l2 {iso.metrics.rel_l2!r}" if iso.metrics else "")
                     + (f" ({result.attribution})" if result.attribution else ""))
        if iso.derived is not None:
            check = iso.derived
            lines.append(f"isolated measured/derived bound: {check.ratio!r} ({check.op}; probable {check.probable_ratio!r})"
                         + (f"; beyond derived bound (slack {check.slack:g}x)" if check.beyond else ""))
    return "\n".join(lines)


def to_junit_xml(report: CompareReport) -> str:
    """JUnit XML: one testsuite, one testcase per tensor; see the module docstring."""
    subject = str(report.subject.get("name") or report.subject.get("spec") or "subject")
    failing = len(report.failing)
    attributes = {"tests": str(len(report.layers)), "failures": str(failing), "errors": "0", "skipped": "0",
                  "time": f"{report.seconds:.3f}"}
    # <testsuites> has no "skipped" attribute in the JUnit schema; only a suite counts skips.
    suites = ET.Element("testsuites", {"name": "parity compare",
                                       **{key: value for key, value in attributes.items() if key != "skipped"}})
    suite = ET.SubElement(suites, "testsuite", {"name": _xml_text(f"parity compare {subject}"), **attributes})
    properties = ET.SubElement(suite, "properties")
    props = [("golden", report.golden)] + ([("candidate", report.candidate)] if report.candidate else [])
    props += [("impl", report.impl), ("device", report.device),
             ("golden_host", host_text(report.hosts["golden"])), ("this_host", host_text(report.hosts["here"])),
             ("policy", report.policy.source), ("verdict", verdict_line(report))]
    props += [("warning", warning) for warning in report.warnings]
    props += [("seeds", line) for line in seeds_lines(report.seeds.to_dict() if report.seeds is not None else None)[:1]]
    props += [("beyond_derived_bound", result.name) for result in report.beyond_derived_bound]
    for name, value in props:
        ET.SubElement(properties, "property", {"name": name, "value": _xml_text(value)})
    classname = _xml_text(f"parity.compare.{subject}")
    repeats = determinism_junit_case(report.determinism.to_dict() if report.determinism is not None else None)
    if repeats is not None:
        name, message, body = repeats
        case = ET.SubElement(suite, "testcase", {"classname": classname, "name": _xml_text(name)})
        if message is not None:
            ET.SubElement(case, "failure", {"message": _xml_text(message), "type": "nondeterministic"}).text = _xml_text(body)
        ET.SubElement(case, "system-out").text = _xml_text(body)
        for element in (suites, suite):
            element.set("tests", str(int(element.get("tests")) + 1))
            element.set("failures", str(int(element.get("failures")) + (message is not None)))
    for result in report.layers:
        # No "time": tensors are not timed one by one (the suite's time is the whole run's).
        case = ET.SubElement(suite, "testcase", {"classname": classname, "name": _xml_text(result.name)})
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
    write_atomically(path, to_junit_xml(report), "--junit-xml")
