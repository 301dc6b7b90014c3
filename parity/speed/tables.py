"""The text reports of ``parity profile`` and ``parity bench``, drawn from their JSON documents.

Tables use tabulate's ``github`` format (Markdown-pasteable, as compare's); names are shortened in
the middle to fit (:func:`parity.report.shorten_name`). Times are shown in the unit that suits
the largest value of the column (ns, us, ms, s).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..report import TABLE_FORMAT, shorten_name
from ..text import printable

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


def fmt_time(seconds: Any, scale: float) -> str:
    value = _number(seconds)
    return "-" if value is None else f"{value * scale:.3g}" if value * scale < 100 else f"{value * scale:.0f}"


def fmt_percent(fraction: Any) -> str:
    value = _number(fraction)
    return "-" if value is None else f"{100 * value:.1f}%"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    from tabulate import tabulate

    return tabulate(rows, headers=headers, tablefmt=TABLE_FORMAT, disable_numparse=True)


# ---------------------------------------------------------------------------------------------
# bench


def bench_text(document: Mapping[str, Any]) -> str:
    settings = document["settings"]
    lines = [f"parity bench: subject {printable(document['subject'].get('name'))} on {document['device']}, "
             f"{settings['reps']} interleaved rounds after {settings['warmup']} warm-up calls each (seed "
             f"{settings['seed']}); inputs: {printable(document['inputs'])}",
             f"cache flush: {settings['cache_flush']}; judged: {settings['judged']} against "
             f"{settings['judged_against']}", ""]
    rows_json = document["impls"]
    unit, scale = time_unit([_number(row["summary"]["median"]) for row in rows_json])
    headers = ["impl", f"median {unit}", f"IQR {unit}", f"p20 {unit}", f"p80 {unit}", "n", "speedup [95% CI]",
               "verdict", "parity", "speedup valid?"]
    rows = []
    for row in rows_json:
        s, parity = row["summary"], row["parity"]
        parity_cell = {"baseline": "baseline", "holds": "holds"}.get(parity["status"], "FAILS")
        if "vs_baseline" in row:
            cmp = row["vs_baseline"]
            speed = f"{_number(cmp['speedup']):.3f}x [{_number(cmp['ci_low']):.3f}, {_number(cmp['ci_high']):.3f}]"
            verdict, validity = cmp["verdict"], row["validity"]
        else:
            speed, verdict, validity = "1 (baseline)", "-", "-"
        rows.append([printable(row["impl"]), fmt_time(s["median"], scale), fmt_time(s["iqr"], scale),
                     fmt_time(s["p20"], scale), fmt_time(s["p80"], scale), str(s["n"]), speed, verdict,
                     parity_cell, printable(validity, limit=200)])
    lines.append("whole forward:")
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
    for warning in document.get("warnings") or []:
        lines.append(f"warning: {printable(warning, limit=500)}")
    lines += ["", document["verdict"]]
    return "\n".join(lines)
