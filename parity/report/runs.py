"""The report's sections on repeated runs and input draws, for text, Markdown, HTML and JUnit.

``compare --repeat N`` (the JSON report's ``determinism`` object, :mod:`parity.run.repeats`) and a
bundle of several seeds (its ``seeds`` object, :mod:`parity.judge.seeds`). Every renderer reads
the JSON objects, so a saved JSON report renders the same as the live one. A report without
them gets no section.
"""
from __future__ import annotations

import html
from typing import Any

from parity.base.numbers import format_number
from parity.base.text import printable

SHOWN = 20  # nondeterministic tensors listed by name; the JSON report has every one


def _spread_text(value: Any) -> str:
    if value in ("inf", "nan"):
        return value
    return format_number(value) if isinstance(value, (int, float)) else "-"


def determinism_lines(determinism: dict[str, Any] | None) -> list[str]:
    """``determinism: 3 runs, ...`` and one line per tensor that differed (first SHOWN)."""
    if not determinism:
        return []
    tensors = determinism.get("tensors") or []
    differing = [row for row in tensors if not row.get("bitwise_equal")]
    runs = determinism.get("runs")
    if not differing:
        return [f"determinism: {runs} runs, all {len(tensors)} tensors bitwise equal"]
    lines = [f"determinism: {runs} runs, {len(differing)} of {len(tensors)} tensors not bitwise equal; first in "
             f"execution order: {printable(determinism.get('first_nondeterministic'))}"]
    for row in differing[:SHOWN]:
        allowed = " (allowed: --allow-nondeterministic)" if row.get("allowed") else ""
        note = f"; {printable(row['note'], limit=300)}" if row.get("note") else ""
        lines.append(f"  {printable(row.get('name'))}: differs in {row.get('differing_runs')} of "
                     f"{(runs or 1) - 1} later runs, spread max|run_i - run_0| {_spread_text(row.get('spread'))}"
                     f"{allowed}{note}")
    if len(differing) > SHOWN:
        lines.append(f"  and {len(differing) - SHOWN} more (every one is in the JSON report)")
    return lines


def determinism_html(report: dict[str, Any]) -> str:
    """A ``<section id="determinism">`` with the same lines, or nothing."""
    return _section("determinism", "Determinism", determinism_lines(report.get("determinism")))


def determinism_junit_case(determinism: dict[str, Any] | None) -> tuple[str, str | None, str] | None:
    """One JUnit testcase for the repeated runs: (name, failure message or None, body)."""
    if not determinism:
        return None
    lines = determinism_lines(determinism)
    failure = None if determinism.get("passed") else lines[0]
    return f"determinism over {determinism.get('runs')} runs", failure, "\n".join(lines)


def seeds_lines(seeds: dict[str, Any] | None) -> list[str]:
    """``seeds: every verdict rests on 3 seeds (3, 4, 5) ...`` and one line per tensor that fails on
    some seed (first SHOWN), with its rel L2 worst and median over the seeds."""
    if not seeds:
        return []
    values = ", ".join(str(seed) for seed in seeds.get("values") or [])
    failing = seeds.get("failing_seeds") or []
    lines = [f"seeds: every verdict rests on {seeds.get('count')} input draws (seeds {values}), each tensor judged "
             f"on its worst; " + (f"failing on seed(s) {', '.join(str(s) for s in failing)}" if failing
                                  else "every seed passes")]
    rows = [row for row in seeds.get("tensors") or [] if row.get("failing_seeds")] if failing else (
        seeds.get("tensors") or [])
    for row in rows[:SHOWN]:
        rel = row.get("rel_l2") or {}
        fails = (f"; fails on seed(s) {', '.join(str(s) for s in row['failing_seeds'])} "
                 f"({len(row['failing_seeds'])} of {row.get('seeds')} seeds)"
                 if row.get("failing_seeds") else "")
        lines.append(f"  {printable(row.get('name'))}: rel L2 worst {_spread_text(rel.get('worst'))} (seed "
                     f"{row.get('worst_seed')}), median {_spread_text(rel.get('median'))}{fails}")
    if len(rows) > SHOWN:
        lines.append(f"  and {len(rows) - SHOWN} more (every one is in the JSON report)")
    return lines


def seeds_html(report: dict[str, Any]) -> str:
    """A ``<section id="seeds">`` with the same lines, or nothing."""
    return _section("seeds", "Input draws", seeds_lines(report.get("seeds")))


def _section(key: str, title: str, lines: list[str]) -> str:
    """The text lines as an HTML section: the first a paragraph, the others a list; nothing without lines."""
    if not lines:
        return ""
    items = "".join(f"<li>{html.escape(line.strip())}</li>" for line in lines[1:])
    return (f"<section id=\"{key}\"><h2>{title}</h2><p>{html.escape(lines[0])}</p>"
            + (f"<ul>{items}</ul>" if items else "") + "</section>")
