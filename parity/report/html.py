"""The comparison report as one self-contained HTML page: summary, verdict, plots of error against depth, the table.

:func:`render_html` takes the JSON report exactly as ``compare --json`` writes it
(``CompareReport.to_dict()``) and returns a page that needs nothing else: inline CSS, inline SVG
plots, and a few lines of inline JavaScript that only add sorting and a "failures only" filter
(without JavaScript every row is shown). No external URL, font or script is referenced.

Plots (inline SVG, log scale, one point per compared tensor in execution order):

- rel L2 and max abs of this host's output against the golden (``metrics``), the threshold the
  fixed rule allows for it (``tolerance.max_rel_l2`` / ``tolerance.max_abs``);
- where the bundle has a high-precision reference (the error budget): this host's and the
  capture host's error against it (``budget.host_*`` / ``budget.capture_*``) and the budget's
  bound on this host's (``budget.allowed_*``: k x the capture host's error + floor);
- the first failing tensor (``summary.first_failing_layer``) and, with ``--isolate``, the
  layers that introduce the error (``summary.introducing_layers``) are marked.

After the plots, one histogram of ``|out - golden|`` per tensor (:mod:`parity.report.histogram`);
with ``--isolate`` the table has ``iso/bound`` (measured / derived rounding bound of the replay)
and the summary names the tensors beyond their derived bound.

A value of exactly 0 is drawn on a band under the axis and a non-finite one ("inf"/"nan" in the
JSON) on a band above it; every drawn point carries ``data-series``, ``data-index``,
``data-name`` and ``data-value`` (the JSON number, round-trippable), so the page can be checked
against the JSON it came from. Every string from the report (layer names come from a bundle) is
escaped: a name like ``<root>/h`` renders as text.
"""
from __future__ import annotations

import html
import math
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

from parity.base.files import write_atomically
from parity.base.numbers import format_cosine, format_dtype, format_number, format_percent, format_ratio, format_shape
from parity.base.text import plural, printable, subject_name
from parity.judge.policy import would_pass_from_checks
from parity.judge.results import verdict_from_counts
from parity.report.histogram import render_histograms
from parity.report.runs import determinism_html, seeds_html
from parity.report.text import host_text, verdict_cell

NAME_LIMIT = 100_000  # names are escaped, not cut, in attributes (the page is checked against the JSON)

# Plot geometry (SVG user units).
WIDTH, HEIGHT = 960, 330
LEFT, RIGHT, TOP, BOTTOM = 72, 16, 26, 62
# Distance of the "0" and "non-finite" bands from the plot area: their tick labels sit that far from
# the nearest decade's, and an 11 px label's box is 13 px tall (measured in Chromium), so 12 overlaps.
BAND = 14
# x-axis labels: 11 px monospace advances 0.6 em per character, so a label's width is known here.
TICK_CHARS, TICK_CHAR_WIDTH, TICK_GAP = 18, 6.6, 8.0


def _esc(value: Any, limit: int = 2000) -> str:
    """Text for an HTML text node or attribute: control characters escaped, then HTML-escaped."""
    return html.escape(printable("" if value is None else value, limit=limit), quote=True)


def _name_attr(name: Any) -> str:
    return _esc(name, NAME_LIMIT)


def _data_number(value: Any) -> str:
    """A JSON number as an attribute that parses back to the same float (``repr``); the JSON's
    own strings ("inf", "nan") as they are."""
    if isinstance(value, str):
        return _esc(value)
    return repr(float(value))


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _number(value: Any) -> Any:
    """A JSON number or its string form ("inf", "nan") as a float; None stays None."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return value


# ---------------------------------------------------------------------------------------------
# Text pieces (the same words as the text report, from the JSON)


def verdict_line(report: dict[str, Any]) -> str:
    """The text report's last line: the JSON's ``verdict``; a report written before that field
    existed gets it from its summary, by the text report's own wording (``parity.judge.results.verdict_from_counts``)."""
    if isinstance(report.get("verdict"), str):
        return printable(report["verdict"], limit=2000)
    layers = report.get("layers") or []
    summary = report.get("summary") or {}
    return verdict_from_counts(
        passed=bool(report.get("passed")), total=summary.get("layers", len(layers)),
        fused=summary.get("fused_here") or 0, absent=summary.get("absent_here") or 0,
        first_failing=summary.get("first_failing_layer"),
        failing=summary.get("failing", sum(not layer.get("passed") for layer in layers)))


def verdict_text(result: dict[str, Any]) -> str:
    """A result's verdict cell: ``pass``, ``FAIL rel_l2,budget``, ``FAIL missing here``, ..."""
    return verdict_cell(result.get("status"), bool(result.get("passed")), result.get("failed_checks") or {})


def would_pass_text(result: dict[str, Any]) -> str | None:
    """The smallest tolerance that would have passed a failing result, as TOML ``key = value``
    (only values the policy loader accepts: ``parity.judge.policy.would_pass_from_checks``)."""
    return would_pass_from_checks(result.get("failed_checks") or {})


def _growth_text(growth: dict[str, Any] | None) -> str:
    if not growth or not growth.get("rel_l2"):
        return "no tensor was compared"
    first, last, peak, jump = growth.get("first"), growth.get("last"), growth.get("peak"), growth.get("largest_jump")
    if growth.get("independent_cases") and peak:
        return (f"{growth['independent_cases']} independent cases, so no growth to follow: peak "
                f"{format_number(_number(peak[1]))} at {printable(peak[0])}")
    text = (f"{format_number(_number(first[1]))} at {printable(first[0])} -> "
            f"{format_number(_number(last[1]))} at {printable(last[0])}")
    if peak and peak[0] != last[0]:
        text += f"; peak {format_number(_number(peak[1]))} at {printable(peak[0])}"
    if jump:
        text += (f"; largest jump at {printable(jump['layer'])} ({format_number(_number(jump['from']))} -> "
                 f"{format_number(_number(jump['to']))})")
    return text


# ---------------------------------------------------------------------------------------------
# Plots


class Series:
    """One plotted quantity: a point per tensor that has it (``(index, name, value)``)."""

    def __init__(self, key: str, label: str, css: str, points: list[tuple[int, str, Any]], *, bound: bool = False):
        self.key, self.label, self.css, self.points, self.bound = key, label, css, points, bound


def _get(layer: dict[str, Any], *path: str) -> Any:
    value: Any = layer
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def judged_host(report: dict[str, Any]) -> str:
    """What the page calls the host whose outputs are judged: "candidate host" for ``parity diff``
    (two bundles, neither from the machine that renders the page), else "this host", as the text
    report does."""
    return "candidate host" if report.get("candidate") else "this host"


def plot_series(report: dict[str, Any], quantity: str) -> list[Series]:
    """The series of one plot (``quantity``: ``rel_l2`` or ``max_abs``), from the report's layers."""
    layers = report.get("layers") or []
    threshold = "max_rel_l2" if quantity == "rel_l2" else "max_abs"
    label = "rel L2" if quantity == "rel_l2" else "max abs"
    host = judged_host(report)
    spec: list[tuple[str, str, str, Callable[[dict[str, Any]], Any], bool]] = [
        (f"{quantity}-golden", f"{host} vs golden ({label})", "s-golden", lambda l: _get(l, "metrics", quantity), False),
        (f"{quantity}-host-ref", f"{host} vs reference", "s-host", lambda l: _get(l, "budget", f"host_{quantity}"), False),
        (f"{quantity}-capture-ref", "capture host vs reference", "s-capture",
         lambda l: _get(l, "budget", f"capture_{quantity}"), False),
        (f"{quantity}-budget-bound", f"budget bound (k x capture + floor), on {host} vs reference", "s-budget",
         lambda l: _get(l, "budget", f"allowed_{quantity}"), True),
        (f"{quantity}-threshold", f"fixed threshold {threshold}, on {host} vs golden", "s-threshold",
         lambda l: _get(l, "tolerance", threshold), True),
    ]
    out = []
    for key, text, css, getter, bound in spec:
        points = [(index, layer.get("name", ""), value) for index, layer in enumerate(layers)
                  if (value := getter(layer)) is not None and not isinstance(value, bool)]
        if points:
            out.append(Series(key, text, css, points, bound=bound))
    return out


def _decades(series: Sequence[Series]) -> tuple[int, int]:
    values = [v for s in series for _, _, raw in s.points if (v := _finite(raw)) is not None and v > 0]
    if not values:
        return -8, 0
    low, high = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))
    return (low, high) if high > low else (low - 1, high + 1)


def tick_label(name: str, index: int) -> str:
    """A tensor name as an x-axis label: its last TICK_CHARS characters (the most specific part,
    ``…attn.core``), or its index where it has no name."""
    text = printable(name) if name else str(index)
    return text if len(text) <= TICK_CHARS else "\u2026" + text[-(TICK_CHARS - 1):]


def x_ticks(names: Sequence[str], x_of: Callable[[float], float]) -> list[tuple[int, float, str]]:
    """``(index, centre x, label)`` of the x axis: every ``stride``-th tensor's name, with the
    smallest stride of 1, 2, 5, 10, 20, ... at which no two labels come closer than TICK_GAP
    (widths estimated as TICK_CHAR_WIDTH per character of a monospace font, which is exact up to
    the font's own advance). A label is moved inwards where it would leave the drawing."""
    count = len(names)
    labels = [tick_label(name, index) for index, name in enumerate(names)]
    stride = 1
    while count:
        placed, right = [], -math.inf
        for index in range(0, count, stride):
            half = len(labels[index]) * TICK_CHAR_WIDTH / 2
            centre = min(max(x_of(index), half + 1), WIDTH - half - 1)
            if centre - half < right + TICK_GAP:
                break
            placed.append((index, centre, labels[index]))
            right = centre + half
        else:
            return placed
        stride = next(nice for nice in (s * 10 ** e for e in range(12) for s in (1, 2, 5)) if nice > stride)
    return []


def render_plot(report: dict[str, Any], quantity: str) -> str:
    """One inline SVG plot of ``quantity`` against tensor order, with its legend."""
    series = plot_series(report, quantity)
    layers = report.get("layers") or []
    count = max(len(layers), 1)
    title = "rel L2" if quantity == "rel_l2" else "max abs"
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    low, high = _decades(series)
    step = plot_w / count

    def x_of(index: float) -> float:
        return LEFT + (index + 0.5) * step

    def y_of(value: Any) -> float:
        number = _number(value)
        if number is None or isinstance(number, bool) or not math.isfinite(float(number)):
            return TOP - BAND  # the non-finite band, above the plot
        if number <= 0:
            return TOP + plot_h + BAND  # exactly 0 (error measures are never negative)
        fraction = (math.log10(number) - low) / (high - low)
        return TOP + plot_h * (1 - fraction)

    parts = [f'<svg class="plot" id="plot-{quantity}" data-quantity="{quantity}" '
             f'viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" '
             f'aria-label="{title} against tensor order, log scale">',
             f'<rect class="frame" x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}"/>']
    for decade in range(low, high + 1):
        y = y_of(10.0 ** decade)
        parts.append(f'<line class="grid" x1="{LEFT}" y1="{y:.2f}" x2="{LEFT + plot_w}" y2="{y:.2f}"/>'
                     f'<text class="tick" x="{LEFT - 6}" y="{y + 4:.2f}" text-anchor="end">1e{decade}</text>')
    parts.append(f'<text class="tick" x="{LEFT - 6}" y="{TOP + plot_h + BAND + 4}" text-anchor="end">0</text>'
                 f'<text class="tick" x="{LEFT - 6}" y="{TOP - BAND + 4}" text-anchor="end">inf/nan</text>')
    for index, center, label in x_ticks([layer.get("name", "") for layer in layers], x_of):
        parts.append(f'<text class="xtick" data-index="{index}" x="{center:.2f}" y="{TOP + plot_h + BAND + 20}" '
                     f'text-anchor="middle">{_esc(label)}<title>#{index} {_esc(layers[index].get("name", ""), 300)}'
                     f'</title></text>')
    parts.append(f'<text class="axis" x="{LEFT + plot_w / 2:.2f}" y="{HEIGHT - 8}" text-anchor="middle">'
                 f'tensor, in execution order (depth); hover a point or a name for the full name</text>'
                 f'<text class="axis" x="14" y="{TOP + plot_h / 2:.2f}" text-anchor="middle" '
                 f'transform="rotate(-90 14 {TOP + plot_h / 2:.2f})">{title} (log)</text>')

    # Marks: the first failing tensor and the layers that introduce error (--isolate).
    summary = report.get("summary") or {}
    index_of: dict[str, int] = {}
    for index, layer in enumerate(layers):
        index_of.setdefault(layer.get("name", ""), index)
    marks = []
    first = summary.get("first_failing_layer")
    if first is not None and first in index_of:
        marks.append(("first-failing", first, "first failing"))
    for name in summary.get("introducing_layers") or []:
        # an introducing layer is a module; its result is the tensor named for it (or its first output)
        index = index_of.get(name)
        if index is None:
            index = next((i for i, l in enumerate(layers) if l.get("layer") == name), None)
        if index is not None:
            marks.append(("introducing", layers[index].get("name", name), "introduces error"))
    # A mark is a line only; its words are in the legend under the plot, where no label can fall on
    # another label or on the data (several marks often share one tensor, e.g. the first failing
    # tensor is also the one that introduces the error).
    for kind, name, text in marks:
        x = x_of(index_of[name])
        parts.append(f'<g class="mark {kind}" data-mark="{kind}" data-name="{_name_attr(name)}" '
                     f'data-index="{index_of[name]}"><line x1="{x:.2f}" y1="{TOP}" x2="{x:.2f}" y2="{TOP + plot_h}"/>'
                     f'<title>{_esc(text)}: #{index_of[name]} {_esc(name, 300)}</title></g>')

    failing = {index for index, layer in enumerate(layers) if not layer.get("passed", True)}
    for s in series:
        parts.append(f'<g class="series {s.css}" data-series="{s.key}" data-label="{_esc(s.label)}">')
        if s.bound:
            for index, name, value in s.points:
                y = y_of(value)
                parts.append(f'<line class="point bound" data-series="{s.key}" data-index="{index}" '
                             f'data-name="{_name_attr(name)}" data-value="{_data_number(value)}" '
                             f'x1="{x_of(index - 0.5):.2f}" y1="{y:.2f}" x2="{x_of(index + 0.5):.2f}" y2="{y:.2f}">'
                             f'<title>{_esc(name, 300)}: {_esc(s.label)} {_esc(format_number(_number(value), 3))}</title>'
                             f'</line>')
        else:
            path = " ".join(f"{x_of(index):.2f},{y_of(value):.2f}" for index, _, value in s.points)
            parts.append(f'<polyline class="line" points="{path}"/>')
            for index, name, value in s.points:
                fail = " fail" if index in failing else ""
                parts.append(f'<circle class="point{fail}" data-series="{s.key}" data-index="{index}" '
                             f'data-name="{_name_attr(name)}" data-value="{_data_number(value)}" '
                             f'cx="{x_of(index):.2f}" cy="{y_of(value):.2f}" r="{3.2 if fail else 2.4}">'
                             f'<title>{_esc(name, 300)}: {_esc(s.label)} {_esc(format_number(_number(value), 3))}</title>'
                             f'</circle>')
        parts.append("</g>")
    parts.append("</svg>")
    legend = "".join(f'<li><span class="swatch {s.css}{" dashed" if s.bound else ""}"></span>{_esc(s.label)}</li>'
                     for s in series)
    for kind, css, words in (("first-failing", "m-first", "first failing tensor"),
                             ("introducing", "m-intro", "introduces the error (--isolate)")):
        named = [name for mark_kind, name, _ in marks if mark_kind == kind]
        if named:
            where = ", ".join(f"#{index_of[name]} {_esc(name, 200)}" for name in named)
            legend += (f'<li class="mark-label" data-mark="{kind}"><span class="swatch {css}"></span>'
                       f'{words}: <code>{where}</code></li>')
    return (f'<figure class="plot-figure"><figcaption>{title} against depth</figcaption>{"".join(parts)}'
            f'<ul class="legend">{legend}</ul></figure>')


# ---------------------------------------------------------------------------------------------
# Table


def _columns(report: dict[str, Any]) -> list[tuple[str, str]]:
    """(header, sort type) of the table's columns."""
    columns = [("#", "num"), ("tensor", "text"), ("dtype", "text"), ("shape", "text"), ("cosine", "num"),
               ("max abs", "num"), ("rel L2", "num"), ("mismatch %", "num"), ("rule", "text"), ("verdict", "text")]
    if report.get("isolate"):
        columns += [("iso rel L2", "num"), ("iso max abs", "num"), ("iso/bound", "num"), ("iso verdict", "text"),
                    ("error", "text")]
    if (report.get("budget") or {}).get("checked"):
        columns += [("ref rel L2 here", "num"), ("ref rel L2 golden", "num"), ("budget rel L2", "num")]
    return columns


def _cell(text: str, sort: Any = None, css: str = "") -> str:
    attrs = f' class="{css}"' if css else ""
    if sort is not None and not isinstance(sort, bool):
        number = _number(sort)
        if number is not None:
            attrs += f' data-sort="{_data_number(number)}"'
    return f"<td{attrs}>{text}</td>"


def _row(report: dict[str, Any], index: int, layer: dict[str, Any], keep: Sequence[bool] | None = None) -> str:
    """One result's ``<tr>``; ``keep`` (one flag per column) leaves out the columns not kept."""
    metrics = layer.get("metrics") or {}
    shape = format_shape(layer.get("shape"))
    if layer.get("status") == "shape-mismatch":
        shape = f"{format_shape(layer.get('here_shape'))} (golden {shape})"
    dtype = format_dtype(layer.get("dtype"))
    if layer.get("status") == "dtype-mismatch":
        dtype = f"{format_dtype(layer.get('here_dtype'))} (golden {dtype})"
    verdict = verdict_text(layer)
    cells = [
        _cell(str(index), index),
        _cell(_breakable(layer.get("name")), css="name"),
        _cell(_esc(dtype)), _cell(_esc(shape)),
        _cell(_esc(format_cosine(_number(metrics.get("cosine")))), metrics.get("cosine")),
        _cell(_esc(format_number(_number(metrics.get("max_abs")))), metrics.get("max_abs")),
        _cell(_esc(format_number(_number(metrics.get("rel_l2")))), metrics.get("rel_l2")),
        _cell(_esc(format_percent(_number(metrics.get("mismatch_fraction")))), metrics.get("mismatch_fraction")),
        _cell(_esc({"budget": "budget", "thresholds": "thresh"}.get(layer.get("rule") or "", "-"))),
        _cell(_esc(verdict), css="verdict"),
    ]
    if report.get("isolate"):
        isolated = layer.get("isolated") or {}
        iso = isolated.get("metrics") or {}
        cells += [_cell(_esc(format_number(_number(iso.get("rel_l2")))), iso.get("rel_l2")),
                  _cell(_esc(format_number(_number(iso.get("max_abs")))), iso.get("max_abs")),
                  bound_cell(isolated.get("derived_bound")),
                  _cell(_esc(verdict_text(isolated) if isolated else "-"), css="iso-verdict"),
                  _cell(_esc(layer.get("attribution") if layer.get("attribution") in ("introduced", "inherited") else ""))]
    if (report.get("budget") or {}).get("checked"):
        budget = layer.get("budget") or {}
        cells += [_cell(_esc(format_number(_number(budget.get(key)))), budget.get(key))
                  for key in ("host_rel_l2", "capture_rel_l2", "allowed_rel_l2")]
    if keep is not None:
        cells = [cell for cell, kept in zip(cells, keep) if kept]
    state = "pass" if layer.get("passed") else "fail"
    return (f'<tr class="{state}" data-index="{index}" data-name="{_name_attr(layer.get("name"))}" '
            f'data-status="{_esc(layer.get("status"))}" data-passed="{"true" if layer.get("passed") else "false"}">'
            + "".join(cells) + "</tr>")


def bound_cell(check: dict[str, Any] | None) -> str:
    """The isolated replay's measured / derived rounding bound (``-``: no bound for this op); the
    title names the op and the probabilistic ratio, ``!`` marks a tensor beyond the slack."""
    if not check:
        return _cell("-")
    ratio = _number(check.get("measured_over_derived"))
    text = "0" if ratio == 0 else format_ratio(ratio) + ("!" if check.get("beyond") else "")
    title = f"{check.get('op')}; measured/probable {format_ratio(_number(check.get('measured_over_probable')))}"
    sort = check.get("measured_over_derived")
    return _cell(f'<span title="{_esc(title)}">{_esc(text)}</span>', sort, css="beyond" if check.get("beyond") else "")


def _breakable(name: Any) -> str:
    """A tensor name, escaped, that a narrow column wraps only after a ``.`` or ``/`` (never
    inside a part: ``gate_pr`` / ``oj``)."""
    return _esc(name, 500).replace(".", ".<wbr>").replace("/", "/<wbr>")


_EMPTY_CELL = re.compile(r"<td[^>]*>-?</td>")


def _filled_columns(report: dict[str, Any]) -> list[bool]:
    """Per column: whether any row shows a value in it (not only "" or "-"). A column empty in
    every row (``error`` where no layer was attributed) is left out of the table."""
    filled = [False] * len(_columns(report))
    if not report.get("layers"):
        return [True] * len(filled)
    for index, layer in enumerate(report.get("layers") or []):
        cells = re.findall(r"<td[^>]*>.*?</td>", _row(report, index, layer))
        for column, cell in enumerate(cells[:len(filled)]):
            filled[column] = filled[column] or not _EMPTY_CELL.fullmatch(cell)
    return filled


def render_table(report: dict[str, Any]) -> str:
    keep = _filled_columns(report)
    head = "".join(f'<th data-type="{kind}" scope="col">{_esc(name)}</th>'
                   for (name, kind), kept in zip(_columns(report), keep) if kept)
    rows = "\n".join(_row(report, index, layer, keep) for index, layer in enumerate(report.get("layers") or []))
    # The wide table scrolls sideways inside its own box instead of running off the page.
    return (f'<div class="table-scroll"><table id="results" class="results"><thead><tr>{head}</tr></thead>'
            f'<tbody>\n{rows}\n</tbody></table></div>')


# ---------------------------------------------------------------------------------------------
# Page

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:1.5em auto;max-width:1200px;padding:0 1em;color:#1d1d1f}
h1{font-size:1.5em;margin:.2em 0}h2{font-size:1.15em;margin:1.4em 0 .5em;border-bottom:1px solid #ddd}
p.verdict{font:bold 1.25em ui-monospace,monospace;padding:.5em .8em;border-radius:4px;display:inline-block;overflow-wrap:anywhere}
p.verdict.pass{background:#e3f6e5;color:#11621c}p.verdict.fail{background:#fde4e1;color:#9c1c10}
table.kv td,table.kv th{text-align:left;padding:.15em .8em .15em 0;vertical-align:top}table.kv td{overflow-wrap:anywhere}
table.kv th{color:#555;font-weight:600;white-space:nowrap}
.warnings li{color:#8a5300}
table.results{border-collapse:collapse;font:11.5px ui-monospace,SFMono-Regular,Menlo,monospace;width:100%}
table.results th,table.results td{border:1px solid #ddd;padding:2px 4px;text-align:right;white-space:nowrap}
.table-scroll{overflow-x:auto;max-width:100%}
table.results td.name{text-align:left;white-space:normal;overflow-wrap:normal;word-break:normal;min-width:9em}
table.results td.name{position:sticky;left:0;background:#fff;z-index:1}table.results th:nth-child(2){left:0;z-index:2}
table.results th{background:#f4f4f6;position:sticky;top:0;cursor:pointer;white-space:normal;vertical-align:bottom}
table.results td.verdict,table.results td.iso-verdict{white-space:normal}table.results tr.fail td{background:#fff0ee}table.results tr.fail td.verdict{color:#b3261e;font-weight:bold}
table.results.failures-only tr.pass{display:none}
.controls{margin:.5em 0}.controls label{margin-right:1.5em}.controls details.columns{margin-top:.3em}
#column-toggles label{margin-right:1em;white-space:nowrap;display:inline-block}
figure{margin:.5em 0 1.5em}figcaption{font-weight:600}
svg.plot{max-width:100%;height:auto;background:#fff}
svg .frame{fill:none;stroke:#999}svg .grid{stroke:#e6e6e6}svg .tick,svg .axis{font:11px sans-serif;fill:#555}
svg .xtick{font:11px ui-monospace,SFMono-Regular,Menlo,monospace;fill:#555}
svg .line{fill:none;stroke-width:1.2}svg .point{stroke-width:0}
svg .point.fail{stroke:#b3261e;stroke-width:1.5}
svg .bound{stroke-width:1.6;stroke-dasharray:4 2}
svg .s-golden .line{stroke:#1f5fbf}svg .s-golden circle{fill:#1f5fbf}
svg .s-host .line{stroke:#e07b00}svg .s-host circle{fill:#e07b00}
svg .s-capture .line{stroke:#2c9a44}svg .s-capture circle{fill:#2c9a44}
svg .s-budget line{stroke:#c0392b}svg .s-threshold line{stroke:#7b7b7b}
svg .mark line{stroke-width:1.5}ul.legend code{font-size:11px;overflow-wrap:anywhere}
svg .first-failing line{stroke:#b3261e}svg .first-failing text{fill:#b3261e}
svg .introducing line{stroke:#8e44ad;stroke-dasharray:5 3}svg .introducing text{fill:#8e44ad}
ul.legend{list-style:none;padding:0;margin:.2em 0;display:flex;flex-wrap:wrap;gap:.3em 1.4em;font-size:12px}
.swatch{display:inline-block;width:18px;height:3px;vertical-align:middle;margin-right:5px}
.swatch.s-golden{background:#1f5fbf}.swatch.s-host{background:#e07b00}.swatch.s-capture{background:#2c9a44}
.swatch.s-budget{background:#c0392b}.swatch.s-threshold{background:#7b7b7b}
.swatch.m-first{background:#b3261e;width:3px;height:14px}.swatch.m-intro{background:#8e44ad;width:3px;height:14px}
.failures li{margin-bottom:.6em}.failures code{white-space:pre-wrap;word-break:break-all}
footer{margin-top:2em;color:#777;font-size:12px}
@media (max-width:1100px){body{padding:0 .5em}}
"""

# Sorting (click a header) and the "failures only" filter. The controls are hidden until this
# runs, so a page opened without JavaScript shows every row and no control that does nothing.
_JS = """
(function(){
  var table=document.getElementById('results');if(!table)return;
  var controls=document.getElementById('controls');controls.hidden=false;
  var only=document.getElementById('failures-only');
  only.addEventListener('change',function(){table.classList.toggle('failures-only',only.checked);});
  var filter=document.getElementById('name-filter');
  filter.addEventListener('input',function(){
    var text=filter.value.toLowerCase();
    Array.prototype.forEach.call(table.tBodies[0].rows,function(row){
      row.style.display=(!text||row.getAttribute('data-name').toLowerCase().indexOf(text)>=0)?'':'none';});});
  Array.prototype.forEach.call(table.tHead.rows[0].cells,function(th,column){
    th.addEventListener('click',function(){
      var numeric=th.getAttribute('data-type')==='num',asc=th.getAttribute('data-dir')!=='asc';
      Array.prototype.forEach.call(table.tHead.rows[0].cells,function(other){other.removeAttribute('data-dir');});
      th.setAttribute('data-dir',asc?'asc':'desc');
      var body=table.tBodies[0],rows=Array.prototype.slice.call(body.rows);
      function key(row){var cell=row.cells[column];if(!numeric)return cell.textContent;
        var v=cell.getAttribute('data-sort');if(v===null)return -Infinity;v=parseFloat(v);return isNaN(v)?Infinity:v;}
      rows.sort(function(a,b){var x=key(a),y=key(b);var c=numeric?(x-y||0):(x<y?-1:x>y?1:0);return asc?c:-c;});
      rows.forEach(function(row){body.appendChild(row);});});});
  var toggles=document.getElementById('column-toggles');
  Array.prototype.forEach.call(table.tHead.rows[0].cells,function(th,column){
    if(column<2)return;  // the index and the name always stay
    var box=document.createElement('input');box.type='checkbox';box.checked=true;
    var label=document.createElement('label');label.appendChild(box);
    label.appendChild(document.createTextNode(' '+th.textContent));toggles.appendChild(label);
    box.addEventListener('change',function(){
      var show=box.checked?'':'none';th.style.display=show;
      Array.prototype.forEach.call(table.tBodies[0].rows,function(row){
        if(row.cells[column])row.cells[column].style.display=show;});});});
})();
"""


def _summary_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    subject = report.get("subject") or {}
    hosts = report.get("hosts") or {}
    summary = report.get("summary") or {}
    policy = report.get("policy") or {}
    rules = report.get("rules") or {}
    budget = report.get("budget") or {}
    rows = [
        ("golden bundle", printable(report.get("golden"))),
        ("subject", f"{subject_name(subject.get('name'), subject.get('spec'))} (spec {printable(subject.get('spec'))})"),
        ("golden host", f"{host_text(hosts.get('golden'))}; impl {printable(report.get('golden_impl'))}"),
        (judged_host(report), f"{host_text(hosts.get('here'))}; impl {printable(report.get('impl'))} on {printable(report.get('device'))}"),
        ("policy", printable(policy.get("source") or "?")
         + ("; layers replayed on golden inputs (--isolate)" if report.get("isolate") else "")),
        ("rules", ", ".join(f"{name}: {plural(count, 'tensor')}" for name, count in rules.items()) or "no tensor compared"),
        ("error budget", f"mode {budget.get('mode', '?')}; " + ("checked" if budget.get("checked") else "not checked")),
        ("tensors", f"{summary.get('layers', 0)}: {summary.get('passing', 0)} pass, {summary.get('failing', 0)} fail"
         + (f", {summary['fused_here']} fused here" if summary.get("fused_here") else "")
         + (f", {summary['absent_here']} absent here" if summary.get("absent_here") else "")),
        ("first failing tensor", printable(summary.get("first_failing_layer")) if summary.get("first_failing_layer") else "none"),
    ]
    if report.get("isolate"):
        introducing = summary.get("introducing_layers") or []
        rows.append(("error introduced by", ", ".join(printable(n) for n in introducing) or "none"))
        beyond = summary.get("beyond_derived_bound") or []
        rows.append(("beyond derived bound", ", ".join(printable(n) for n in beyond) or "none"))
    rows.append(("error growth (rel L2)", _growth_text(summary.get("error_growth"))))
    integrity = report.get("integrity") or {}
    if integrity:
        rows.append(("bundle checksums", f"verified for the {integrity.get('verified')} of {integrity.get('tensors')} "
                                         f"stored tensors this run read"))
    if report.get("seconds") is not None:
        rows.append(("time", f"{report['seconds']} s"))
    return rows


def _failures(report: dict[str, Any]) -> str:
    failing = [(index, layer) for index, layer in enumerate(report.get("layers") or []) if not layer.get("passed", True)]
    if not failing:
        return ""
    items = []
    for index, layer in failing:
        reasons = "".join(f"<li><code>{_esc(reason, 2000)}</code></li>" for reason in _get(layer, "verdict", "reasons") or [])
        would = would_pass_text(layer)
        extra = (f"<li>would pass with: <code>{_esc(would)}</code></li>" if would else
                 "<li>no tolerance makes this pass</li>" if layer.get("status") != "dtype-mismatch" else "")
        if layer.get("attribution") == "inherited":
            extra += "<li>passes on its golden inputs (--isolate): the error is inherited from upstream</li>"
        items.append(f'<li data-index="{index}" data-name="{_name_attr(layer.get("name"))}"><b>#{index} '
                     f'{_esc(layer.get("name"), 500)}</b>: {_esc(verdict_text(layer))}<ul>{reasons}{extra}</ul></li>')
    return (f'<section id="failures"><h2>Failing tensors ({len(failing)}), with the smallest tolerance that would '
            f'have passed each</h2><ol class="failures">{"".join(items)}</ol></section>')


def render_html(report: dict[str, Any]) -> str:
    """The whole page for a compare report's JSON dict (module docstring)."""
    passed = bool(report.get("passed"))
    verdict = verdict_line(report)
    subject = report.get("subject") or {}
    command = "diff" if "candidate" in report else "compare"  # a diff report names its candidate bundle
    title = f"parity {command}: {subject_name(subject.get('name'), subject.get('spec'))[:120]}: {verdict}"
    summary = "".join(f"<tr><th>{_esc(key)}</th><td>{_esc(value, 4000)}</td></tr>" for key, value in _summary_rows(report))
    warnings = [d.get("message") or d.get("key") for d in report.get("fingerprint_differences") or []]
    warnings += [w for w in report.get("warnings") or [] if w not in warnings]
    warning_html = ("<section id=\"warnings\"><h2>Warnings</h2><ul class=\"warnings\">"
                    + "".join(f"<li>{_esc(w, 2000)}</li>" for w in warnings) + "</ul></section>") if warnings else ""
    plots = "".join(render_plot(report, quantity) for quantity in ("rel_l2", "max_abs"))
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8"/>
<meta name="viewport" content="width=device-width, initial-scale=1"/>
<title>{_esc(title, 400)}</title>
<style>{_CSS}</style>
</head>
<body>
<header>
<h1>parity {command}: {_esc(subject_name(subject.get('name'), subject.get('spec')), 200)}</h1>
<p id="verdict" class="verdict {'pass' if passed else 'fail'}" data-passed="{'true' if passed else 'false'}">{_esc(verdict, 1000)}</p>
</header>
<section id="summary"><h2>Summary</h2><table class="kv"><tbody>{summary}</tbody></table></section>
{warning_html}
{determinism_html(report)}
{seeds_html(report)}
<section id="plots"><h2>Error against depth</h2>
<p>Each point is one compared tensor, in execution order. Against the golden: {judged_host(report)}'s output vs the
capture host's. Against the reference (where the bundle holds a high-precision one): each host's own error, and
the error budget's bound on {judged_host(report)}'s.</p>
{plots}</section>
{render_histograms(report, judged_host(report))}
{_failures(report)}
<section id="table"><h2>Every tensor</h2>
<div id="controls" class="controls" hidden="hidden"><label><input type="checkbox" id="failures-only"/> failures only</label>
<label>layer name contains <input type="search" id="name-filter"/></label> (click a column header to sort)
<details class="columns"><summary>columns shown</summary><span id="column-toggles"></span></details></div>
{render_table(report)}
</section>
<footer>Written by parity from the JSON report (format {_esc(report.get('format'))} version {_esc(report.get('version'))}); self-contained, no network.</footer>
<script>{_JS}</script>
</body>
</html>
"""


# ---------------------------------------------------------------------------------------------
# File


def write_html(report: dict[str, Any], path: str | os.PathLike) -> None:
    """Write :func:`render_html`'s page to ``path`` whole or not at all (``parity.base.files``)."""
    write_atomically(path, render_html(report), "--html")
