"""The text reports of ``parity profile`` and ``parity bench``, drawn from their JSON documents.

Tables use tabulate's ``github`` format (Markdown-pasteable, as compare's); names are shortened in
the middle to fit (:func:`parity.report.shorten_name`). Times are shown in the unit that suits
the largest value of the column (ns, us, ms, s).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from parity.report.text import TABLE_FORMAT, shorten_name
from parity.base.numbers import format_ratio
from parity.base.text import printable, subject_name
from tabulate import tabulate

NAME_WIDTH = 48


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return float(value)


def time_unit(seconds: Sequence[float | None]) -> tuple[str, float]:
    """(unit, scale) for a column of times in seconds: the largest value shown as 1 .. 9999."""
    largest = max((abs(v) for v in seconds if v is not None), default=0.0)
    for unit, scale in (("s", 1.0), ("ms", 1e3), ("us", 1e6)):
        if largest * scale >= 1.0:
            return unit, scale
    return "ns", 1e9


# The smallest non-zero time of a table, in the unit chosen for it, is at least this: two digits.
INTEGER_DIGITS_FLOOR = 10


def integer_time_unit(nanoseconds: Sequence[float | None]) -> tuple[str, float]:
    """(unit, ns per unit) for a table of times shown as integers, as ``nsys stats`` and ``rocprof``
    show ns: the largest of ms, us and ns in which the smallest non-zero time still reads as at
    least INTEGER_DIGITS_FLOOR, so no row of the table rounds to 0 or 1 and large rows keep every
    digit (grouped by thousands)."""
    smallest = min((abs(v) for v in nanoseconds if v), default=None)
    for unit, per in (("ms", 1e6), ("us", 1e3)):
        if smallest is not None and smallest / per >= INTEGER_DIGITS_FLOOR:
            return unit, per
    return "ns", 1.0


def fmt_integer_time(nanoseconds: Any, per: float) -> str:
    """A time in ns as an integer count of the unit ``per`` ns, grouped by thousands (``12,345``)."""
    value = _number(nanoseconds)
    return "-" if value is None else f"{round(value / per):,}"


def fmt_time(seconds: Any, scale: float) -> str:
    value = _number(seconds)
    return "-" if value is None else f"{value * scale:.3g}" if value * scale < 100 else f"{value * scale:.0f}"


def amdahl_text(bound: Any) -> str:
    """Amdahl's bound on the whole forward's speedup in words: ``at most 6.67x faster``
    (:func:`parity.base.numbers.format_ratio`); a module that holds all the device time has no
    bound, which ``f"{inf:.2f}x"`` would print as ``infx``."""
    value = _number(bound)
    if value is None or math.isnan(value):
        return "faster by an unknown factor"
    if math.isinf(value):
        return "faster without bound (it holds all of the counted time)"
    return f"at most {format_ratio(value)} faster"


def fmt_percent(fraction: Any) -> str:
    value = _number(fraction)
    return "-" if value is None else f"{100 * value:.1f}%"


def _table(headers: list[str], rows: list[list[str]]) -> str:

    return tabulate(rows, headers=headers, tablefmt=TABLE_FORMAT, disable_numparse=True)


# ---------------------------------------------------------------------------------------------
# bench


def bench_text(document: Mapping[str, Any]) -> str:
    settings = document["settings"]
    lines = [f"parity bench: subject {subject_name(document['subject'].get('name'), document['subject'].get('spec'))} on {document['device']}, "
             f"{settings['reps']} interleaved rounds after {settings['warmup']} warm-up calls each (seed "
             f"{settings['seed']}); inputs: {printable(document['inputs'])}",
             f"cache flush: {settings['cache_flush']}; judged: {settings['judged']} against "
             f"{settings['judged_against']}",
             f"clock throttling: {printable((document.get('clocks') or {}).get('summary', 'not recorded'), limit=300)}",
             ""]
    rows_json = document["impls"]
    unit, scale = time_unit([_number(row["summary"]["median"]) for row in rows_json])
    device = any("device_time" in row for row in rows_json)
    headers = ["impl", f"median {unit}", f"IQR {unit}", f"p20 {unit}", f"p80 {unit}", "n"]
    headers += [f"device {unit}", "device speedup"] if device else []
    headers += ["speedup [95% CI]", "verdict", "equivalence [90% CI]", "parity", "speedup valid?"]
    rows = []
    for row in rows_json:
        s, parity = row["summary"], row["parity"]
        parity_cell = {"baseline": "baseline", "holds": "holds"}.get(parity["status"], "FAILS")
        if "vs_baseline" in row:
            cmp = row["vs_baseline"]
            speed = f"{_number(cmp['speedup']):.3f}x [{_number(cmp['ci_low']):.3f}, {_number(cmp['ci_high']):.3f}]"
            verdict, validity = cmp["verdict"], row["validity"]
            equivalence = equivalence_cell(cmp.get("equivalence"))
        else:
            speed, verdict, validity, equivalence = "1 (baseline)", "-", "-", "-"
        cells = [printable(row["impl"]), fmt_time(s["median"], scale), fmt_time(s["iqr"], scale),
                 fmt_time(s["p20"], scale), fmt_time(s["p80"], scale), str(s["n"])]
        if device:
            measured = row.get("device_time") or {}
            ratio = _number(measured.get("speedup"))
            cells += [fmt_time(measured.get("per_call_s"), scale),
                      "-" if ratio is None else f"{ratio:.3f}x"]
        rows.append(cells + [speed, verdict, equivalence, parity_cell, printable(validity, limit=200)])
    lines.append("whole forward" + (f" (device: {printable(settings['device_time'], limit=200)})"
                                    if device and settings.get("device_time") else "") + ":")
    lines.append(_table(headers, rows))
    modules = document.get("modules")
    if modules and modules.get("rows"):
        lines += ["", "modules (timed with hooks, in separate interleaved rounds):"]
        unit, scale = time_unit([_number(r["summary"]["median"]) for r in modules["rows"]])
        mrows = []
        for r in modules["rows"]:
            cmp = r.get("vs_baseline")
            share = (modules.get("baseline_share") or {}).get(r["module"])
            mrows.append([shorten_name(r["module"], NAME_WIDTH), printable(r["impl"]),
                          fmt_time(r["summary"]["median"], scale), fmt_time(r["summary"]["iqr"], scale),
                          fmt_percent(share),
                          f"{_number(cmp['speedup']):.3f}x [{_number(cmp['ci_low']):.3f}, {_number(cmp['ci_high']):.3f}]"
                          if cmp else "1 (baseline)", cmp["verdict"] if cmp else "-",
                          f"{_number(r['amdahl_whole_forward']):.3f}x" if cmp else "-"])
        lines.append(_table(["module", "impl", f"median {unit}", f"IQR {unit}", "baseline share",
                             "speedup [95% CI]", "verdict", "Amdahl: forward"], mrows))
    cases = document.get("cases")
    if cases:
        failing = [r for r in cases["rows"] if not r["parity_holds"]]
        lines.append("")
        lines += cases["lines"]
        for r in failing[:5]:
            lines.append(f"  {printable(r['impl'])} {shorten_name(r['case'], 80)}: parity fails")
    against = document.get("baseline_run")
    if against:
        lines += ["", against_run_title(against) + ":"]
        unit, scale = time_unit([_number(r["then_median_s"]) for r in against["rows"]]
                                + [_number(r["now_median_s"]) for r in against["rows"]])
        lines.append(_table(["impl", f"then median {unit}", f"now median {unit}", "now / then [95% CI]", "status"],
                            [[printable(r["impl"]), fmt_time(r["then_median_s"], scale),
                              fmt_time(r["now_median_s"], scale), ratio_cell(r), r["status"]]
                             for r in against["rows"]]))
    for warning in document.get("warnings") or []:
        lines.append(f"warning: {printable(warning, limit=500)}")
    lines += ["", document["verdict"]]
    return "\n".join(lines)


def equivalence_cell(equivalence: Mapping[str, Any] | None) -> str:
    """``EQUIVALENT within ±2% [0.991, 1.004]`` (or ``not shown ...``); ``-`` in a report without it."""
    if not equivalence:
        return "-"
    return (f"{printable(equivalence['verdict'])} [{_number(equivalence['ci_low']):.3f}, "
            f"{_number(equivalence['ci_high']):.3f}]")


def ratio_cell(row: Mapping[str, Any]) -> str:
    return f"{_number(row['ratio']):.3f} [{_number(row['ci_low']):.3f}, {_number(row['ci_high']):.3f}]"


def against_run_title(against: Mapping[str, Any]) -> str:
    return (f"against the saved run {printable(against['path'], limit=200)} (REGRESSED: the "
            f"{100 * _number(against['confidence']):.0f}% interval of median(now) / median(then) above "
            f"1 + {_number(against['threshold']):g})")


# ---------------------------------------------------------------------------------------------
# profile

def _name_cell(name: Any) -> str:
    """A module or kernel name as a cell of NAME_WIDTH (:func:`shorten_name`)."""
    return shorten_name(str(name), NAME_WIDTH)


_VIEW_TITLES = {"modules": "modules (device time charged to the innermost module; repeated layers grouped)",
                "module_calls": "modules, one row per module", "ops": "ops", "kernels": "kernels"}


def view_table(rows: Sequence[Mapping[str, Any]], *, header: str, kind: bool = False, wall: bool = True,
               limit: int | None = None) -> str:
    shown = list(rows)[:limit] if limit else list(rows)
    unit, scale = time_unit([(_number(r.get("total_ns")) or 0.0) / 1e9 for r in shown])
    headers = [header] + (["kind"] if kind else []) + ["calls", f"total {unit}", f"avg {unit}", f"median {unit}",
                                                       f"min {unit}", f"max {unit}", "% device"]
    headers += ["% wall"] if wall else []
    out = []
    for r in shown:
        line = [_name_cell(r["name"])] + ([printable(r.get("kind") or "")] if kind else [])
        line.append(str(r["calls"]))
        for key in ("total_ns", "avg_ns", "median_ns", "min_ns", "max_ns"):
            value = _number(r.get(key))
            line.append(fmt_time(None if value is None else value / 1e9, scale))
        line.append(fmt_percent(r.get("share")))
        if wall:
            line.append(fmt_percent(r.get("wall_share")))
        out.append(line)
    text = _table(headers, out)
    if limit and len(rows) > limit:
        text += f"\n({len(rows) - limit} more rows in --json)"
    return text


def profile_text(document: Mapping[str, Any], *, views: Sequence[str] = ("modules", "ops", "kernels"),
                 limit: int | None = 15) -> str:
    totals = document["totals"]
    wall = totals.get("wall_ns") is not None
    settings = document.get("settings") or {}
    lines = []
    if document.get("subject"):
        lines.append(f"parity profile: subject {subject_name(document['subject'].get('name'), document['subject'].get('spec'))}, impl "
                     f"{printable(document.get('impl'))} on {document.get('device')}; {settings.get('schedule')}; "
                     f"counted: {settings.get('counted')}")
    else:
        lines.append(f"parity profile: {printable(settings.get('file'))} ({settings.get('file_format')}); "
                     f"counted: {settings.get('counted')}")
    if wall:
        lines.append(f"device time {fmt_time(float(totals['device_ns']) / 1e9, 1e3)} ms, wall "
                     f"{fmt_time(float(totals['wall_ns']) / 1e9, 1e3)} ms over {totals['steps']} steps; busy "
                     f"{fmt_percent(totals.get('busy_share'))} of wall")
    for view in views:
        rows = document.get(view) or []
        if rows:
            header = {"modules": "module", "module_calls": "module", "ops": "op", "kernels": "kernel"}[view]
            lines += ["", f"{_VIEW_TITLES[view]}:", view_table(rows, header=header, kind=view == "kernels",
                                                               wall=wall, limit=limit)]
    against = document.get("against")
    if against:
        headers, cells = against_table(against, limit=limit)
        for row in cells:
            row[0] = _name_cell(row[0])
        lines += ["", f"{against_title(against)}:", _table(headers, cells)]
    for warning in document.get("warnings") or []:
        lines.append(f"warning: {printable(warning, limit=500)}")
    lines += ["", printable(document["headline"], limit=1000)]
    return "\n".join(lines)


def _pair_unit(rows: Sequence[Mapping[str, Any]], a_key: str, b_key: str) -> tuple[str, float]:
    """The unit of a pair of ns columns (a and b), as :func:`time_unit` picks it."""
    return time_unit([max(_number(r.get(a_key)) or 0.0, _number(r.get(b_key)) or 0.0) / 1e9 for r in rows])


def _ns_cell(value: Any, scale: float) -> str:
    number = _number(value)
    return fmt_time(None if number is None else number / 1e9, scale)


def _ratio_cell(value: Any) -> str:
    number = _number(value)
    return "-" if number is None else f"{number:.2f}"


def against_title(against: Mapping[str, Any]) -> str:
    """``side by side, by module, per step (a: LABEL, 2 steps; b: LABEL, 10 steps)``: what is compared."""
    what = "per step" if against["compared"] == "per step" else "totals of the captures as given"

    def side(label: Any, steps: Any) -> str:
        return f"{printable(label, limit=200)}, {f'{steps} steps' if steps else 'steps unknown'}"

    return (f"side by side, by {against['by']}, {what} (a: {side(against['a_label'], against.get('a_steps'))}; "
            f"b: {side(against['b_label'], against.get('b_steps'))})")


def against_table(against: Mapping[str, Any], *, limit: int | None = None) -> tuple[list[str], list[list[str]]]:
    """Headers and cells (names in full) of the side by side: a and b as compared (per step, or the
    totals as given) and per call, every time header with its unit (``a ms per step``)."""
    rows = list(against["rows"])[:limit] if limit else list(against["rows"])
    per_step = against["compared"] == "per step"
    a_key, b_key = ("a_step_ns", "b_step_ns") if per_step else ("a_ns", "b_ns")
    basis = "per step" if per_step else "total"
    unit, scale = _pair_unit(rows, a_key, b_key)
    call_unit, call_scale = _pair_unit(rows, "a_call_ns", "b_call_ns")
    headers = [against["by"], f"a {unit} {basis}", f"b {unit} {basis}", "b / a", f"a {call_unit} per call",
               f"b {call_unit} per call", "b / a per call", "% a", "% b"]
    cells = [[str(r["name"]), _ns_cell(r.get(a_key), scale), _ns_cell(r.get(b_key), scale), _ratio_cell(r.get("ratio")),
              _ns_cell(r.get("a_call_ns"), call_scale), _ns_cell(r.get("b_call_ns"), call_scale),
              _ratio_cell(r.get("call_ratio")), fmt_percent(r.get("a_share")), fmt_percent(r.get("b_share"))]
             for r in rows]
    return headers, cells
