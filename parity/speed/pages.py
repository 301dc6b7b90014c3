"""The profile and bench reports as self-contained HTML pages, drawn from their JSON documents.

Inline CSS and inline SVG bar charts, no external URL, font or image: a page opened from an
artifact store shows everything. The profile page's tables (largest rows first, nsys's columns,
times as integers in one unit per table) sort and filter with a few lines of inline script and
fold past their largest rows behind a "show all" box that works without it. Every string from a document (module and kernel names
come from a model or an imported CSV) is escaped. Pages fit a 1024-pixel window: tables wrap
long names at dots and underscores (``overflow-wrap:anywhere``) instead of widening the page.
"""
from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

from parity.base.text import printable, subject_name
from . import stats
from .tables import (against_run_title, against_table, against_title, amdahl_text, equivalence_cell,
                     fmt_integer_time, fmt_percent, fmt_time, integer_time_unit, ratio_cell, time_unit)

BAR_WIDTH, BAR_HEIGHT, BAR_LABEL = 900, 22, 330
MAX_BARS = 15
STRIP_WIDTH, STRIP_ROW, STRIP_LABEL, STRIP_AXIS = 900, 34, 230, 28
STRIP_CHAR_WIDTH = 7.2  # the advance of the 12 px monospace font of the strip plot's text
MAX_POINTS = 400  # points drawn per row; the box is computed from every timing

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:1.5em auto;max-width:1200px;padding:0 1em;color:#1d1d1f}
h1{font-size:1.5em;margin:.2em 0}h2{font-size:1.15em;margin:1.4em 0 .5em;border-bottom:1px solid #ddd}
.verdict{font:bold 1.1em ui-monospace,monospace;padding:.5em .8em;border-radius:4px;display:inline-block;overflow-wrap:anywhere}
.verdict.pass{background:#e3f6e5;color:#11621c}.verdict.fail{background:#fde4e1;color:#9c1c10}
.verdict.info{background:#e8eefb;color:#1f3f7a}
table.kv td,table.kv th{text-align:left;padding:.15em .8em .15em 0;vertical-align:top}
table.kv th{color:#555;font-weight:600;white-space:nowrap}table.kv td{overflow-wrap:anywhere}
.warnings li{color:#8a5300}
table.view{border-collapse:collapse;font:12.5px ui-monospace,SFMono-Regular,Menlo,monospace;width:100%;table-layout:auto}
table.view th,table.view td{border:1px solid #ddd;padding:2px 6px;text-align:right;white-space:nowrap}
table.view td.name,table.view th.name{text-align:left;white-space:normal;overflow-wrap:anywhere;min-width:14em}
table.view td.text{text-align:left;white-space:normal;overflow-wrap:break-word}
table.view th{background:#f4f4f6;white-space:normal}
table.view tr.fail td{background:#fff0ee}
.table-scroll{overflow-x:auto;max-width:100%}
table.sortable th{cursor:pointer;position:sticky;top:0}
input.show-all{margin:.3em .3em .3em 0}label.show-all{font-size:12px;color:#555}
input.show-all:not(:checked)~.table-scroll table:not(.filtering) tr.extra{display:none}
.view-controls{margin:.3em 0;font-size:12px}
svg.bars{max-width:100%;height:auto;background:#fff}
svg.bars text{font:12px ui-monospace,monospace;fill:#333}svg.bars rect.bar{fill:#1f5fbf}
svg.bars rect.bar.hot{fill:#e07b00}svg.bars rect.bar.fail{fill:#b3261e}svg.bars rect.bar.base{fill:#7b7b7b}
svg.bars line.one{stroke:#555;stroke-dasharray:4 2}
svg.strip{max-width:100%;height:auto;background:#fff}svg.strip text{font:12px ui-monospace,monospace;fill:#333}
svg.strip .box{fill:#dbe6f7;stroke:#1f5fbf}svg.strip .median{stroke:#1f5fbf;stroke-width:2}
svg.strip .whisker{stroke:#1f5fbf}svg.strip circle{fill:#1f5fbf;fill-opacity:.45}
svg.strip .fail .box{fill:#fbe0dc;stroke:#b3261e}svg.strip .fail .median,svg.strip .fail .whisker{stroke:#b3261e}
svg.strip .fail circle{fill:#b3261e}svg.strip .then .box{fill:#eee;stroke:#7b7b7b}
svg.strip .then .median,svg.strip .then .whisker{stroke:#7b7b7b}svg.strip .then circle{fill:#7b7b7b}
svg.strip .axis line{stroke:#999}svg.strip .grid{stroke:#eee}
footer{margin-top:2em;color:#777;font-size:12px}
@media (max-width:1100px){body{padding:0 .5em}}
"""


# Sorting (click a header) and a name filter for every sortable table. The filter is hidden until
# this runs, so a page opened without JavaScript shows no control that does nothing. A folded
# table (data-fold) keeps its largest rows in view: after a sort, the first rows of the new order.
_SORT_JS = """
(function(){
  function refold(table){var n=parseInt(table.getAttribute('data-fold')||'0',10);if(!n)return;
    Array.prototype.forEach.call(table.tBodies[0].rows,function(row,i){row.classList.toggle('extra',i>=n);});}
  Array.prototype.forEach.call(document.querySelectorAll('table.sortable'),function(table){
    Array.prototype.forEach.call(table.tHead.rows[0].cells,function(th,column){
      th.addEventListener('click',function(){
        var numeric=th.getAttribute('data-type')==='num',dir=th.getAttribute('data-dir');
        var asc=numeric?dir==='desc':dir!=='asc';  // numbers: largest first on the first click
        Array.prototype.forEach.call(table.tHead.rows[0].cells,function(other){other.removeAttribute('data-dir');});
        th.setAttribute('data-dir',asc?'asc':'desc');
        var body=table.tBodies[0],rows=Array.prototype.slice.call(body.rows);
        function key(row){var cell=row.cells[column];if(!numeric)return cell.textContent;
          var v=cell.getAttribute('data-sort');v=parseFloat(v===null?cell.textContent.replace(/,/g,''):v);
          return isNaN(v)?-Infinity:v;}
        rows.sort(function(a,b){var x=key(a),y=key(b);var c=numeric?(x-y||0):(x<y?-1:x>y?1:0);return asc?c:-c;});
        rows.forEach(function(row){body.appendChild(row);});refold(table);});});});
  Array.prototype.forEach.call(document.querySelectorAll('input.name-filter'),function(input){
    var table=document.getElementById(input.getAttribute('data-table'));if(!table)return;
    input.parentNode.hidden=false;
    input.addEventListener('input',function(){var text=input.value.toLowerCase();
      table.classList.toggle('filtering',!!text);
      Array.prototype.forEach.call(table.tBodies[0].rows,function(row){
        row.style.display=(!text||row.getAttribute('data-name').toLowerCase().indexOf(text)>=0)?'':'none';});});});
})();
"""


def _esc(value: Any, limit: int = 2000) -> str:
    return html.escape(printable("" if value is None else value, limit=limit), quote=True)


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _page(title: str, heading: str, verdict: str, verdict_class: str, body: str, document: Mapping[str, Any],
          script: str = "") -> str:
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
<h1>{_esc(heading, 300)}</h1>
<p id="verdict" class="verdict {verdict_class}">{_esc(verdict, 1000)}</p>
</header>
{body}
<footer>Written by parity from the JSON report (format {_esc(document.get('format'))} version {_esc(document.get('version'))}); self-contained, no network.</footer>
{f"<script>{script}</script>" if script else ""}
</body>
</html>
"""


def _kv(rows: Sequence[tuple[str, Any]]) -> str:
    cells = "".join(f"<tr><th>{_esc(key)}</th><td>{_esc(value, 4000)}</td></tr>" for key, value in rows)
    return f'<table class="kv"><tbody>{cells}</tbody></table>'


def _warnings(document: Mapping[str, Any]) -> str:
    warnings = document.get("warnings") or []
    if not warnings:
        return ""
    items = "".join(f"<li>{_esc(w)}</li>" for w in warnings)
    return f'<section id="warnings"><h2>Warnings</h2><ul class="warnings">{items}</ul></section>'


def bar_chart(bars: Sequence[tuple[str, float, str]], *, label: str, reference: float | None = None,
              value_text=None) -> str:
    """Horizontal bars: ``(name, value, css class)``; ``reference`` draws a dashed line (e.g. 1x)."""
    bars = list(bars)[:MAX_BARS]
    if not bars:
        return ""
    top = max([value for _, value, _ in bars] + ([reference] if reference else []))
    top = top if top > 0 else 1.0
    span = BAR_WIDTH - BAR_LABEL - 90
    height = BAR_HEIGHT * len(bars) + 10
    parts = [f'<svg class="bars" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {BAR_WIDTH} {height}" '
             f'width="{BAR_WIDTH}" height="{height}" role="img" aria-label="{_esc(label)}">']
    for index, (name, value, css) in enumerate(bars):
        y = 5 + index * BAR_HEIGHT
        width = max(1.0, span * value / top)
        shown = printable(name, limit=2000)
        short = shown if len(shown) <= 44 else shown[:18] + "\u2026" + shown[-25:]
        text = value_text(value) if value_text else f"{value:.3g}"
        parts.append(f'<g data-name="{_esc(name, 100000)}" data-value="{value!r}"><title>{_esc(name)}</title>'
                     f'<text x="{BAR_LABEL - 6}" y="{y + 15}" text-anchor="end">{_esc(short)}</text>'
                     f'<rect class="bar {css}" x="{BAR_LABEL}" y="{y + 3}" width="{width:.1f}" height="{BAR_HEIGHT - 6}"/>'
                     f'<text x="{BAR_LABEL + width + 5:.1f}" y="{y + 15}">{_esc(text)}</text></g>')
    if reference:
        x = BAR_LABEL + span * reference / top
        parts.append(f'<line class="one" x1="{x:.1f}" y1="0" x2="{x:.1f}" y2="{height}"/>')
    parts.append("</svg>")
    return "".join(parts)


def nice_ticks(low: float, high: float, scale: float, count: int = 5) -> list[float]:
    """Tick values (seconds) inside [low, high] at a round step in the axis's unit (1, 2 or 5
    times a power of ten, about ``count`` steps across), as a person draws an axis: 0, 0.5, 1,
    1.5 ms rather than fifths of the range (0.698, 1.4, 2.09)."""
    span = (high - low) * scale
    if not span > 0 or not math.isfinite(span):
        return [low]
    raw = span / count
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw * (1 - 1e-9))
    first = math.ceil(low * scale / step - 1e-9)
    ticks = []
    k = first
    while k * step <= high * scale * (1 + 1e-12):
        ticks.append(round(k * step, 12) / scale)
        k += 1
    return ticks or [low]


def strip_plot(rows: Sequence[tuple[str, Sequence[float], str]], *, label: str) -> str:
    """Each row's timings (seconds) as a box plot (q1 to q3, the median, whiskers to min and max)
    over its points, on one shared time axis; ``(name, times, css class)``. Points are spread
    vertically by their index, so equal times stay visible; at most :data:`MAX_POINTS` per row
    (every k-th of the sorted times) are drawn."""
    rows = [(name, [t for t in (_num(v) for v in times) if t is not None], css) for name, times, css in rows]
    rows = [row for row in rows if row[1]]
    if not rows:
        return ""
    low = min(min(times) for _, times, _ in rows)
    high = max(max(times) for _, times, _ in rows)
    pad = (high - low) * 0.05 or abs(high) * 0.05 or 1e-9
    low, high = max(0.0, low - pad), high + pad
    unit, scale = time_unit([high])
    span = STRIP_WIDTH - STRIP_LABEL - 20

    def x_of(value: float) -> float:
        return STRIP_LABEL + span * (value - low) / (high - low)

    height = STRIP_ROW * len(rows) + STRIP_AXIS
    parts = [f'<svg class="strip" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {STRIP_WIDTH} {height}" '
             f'width="{STRIP_WIDTH}" height="{height}" role="img" aria-label="{_esc(label)}">']
    ticks = nice_ticks(low, high, scale)
    axis_y = STRIP_ROW * len(rows) + 4
    parts.append('<g class="axis">')
    for tick in ticks:
        x, text = x_of(tick), fmt_time(tick, scale)
        centre = min(x, STRIP_WIDTH - len(text) * STRIP_CHAR_WIDTH / 2 - 1)  # the last label inside the drawing
        parts.append(f'<line class="grid" x1="{x:.1f}" y1="0" x2="{x:.1f}" y2="{axis_y}"/>'
                     f'<text x="{centre:.1f}" y="{axis_y + 16}" text-anchor="middle">{_esc(text)}</text>')
    # The axis title ends left of the first tick's label, which is centred on the axis's start (12 px
    # monospace: 7.2 px a character).
    unit_x = min(STRIP_LABEL - 6, x_of(ticks[0]) - len(fmt_time(ticks[0], scale)) * STRIP_CHAR_WIDTH / 2 - 12)
    parts.append(f'<text x="{unit_x:.1f}" y="{axis_y + 16}" text-anchor="end">time ({_esc(unit)})</text></g>')
    for index, (name, times, css) in enumerate(rows):
        summary = stats.summarize(times)
        middle = index * STRIP_ROW + STRIP_ROW / 2
        shown = printable(name, limit=2000)
        short = shown if len(shown) <= 30 else shown[:12] + "\u2026" + shown[-17:]
        parts.append(f'<g class="row {css}" data-name="{_esc(name, 100000)}" data-n="{summary.n}" '
                     f'data-median="{summary.median!r}"><title>{_esc(name)}: median '
                     f'{_esc(fmt_time(summary.median, scale))} {unit}, IQR {_esc(fmt_time(summary.iqr, scale))} '
                     f'{unit}, {summary.n} timings</title>'
                     f'<text x="{STRIP_LABEL - 6}" y="{middle + 4:.1f}" text-anchor="end">{_esc(short)}</text>'
                     f'<line class="whisker" x1="{x_of(summary.min):.1f}" y1="{middle:.1f}" '
                     f'x2="{x_of(summary.max):.1f}" y2="{middle:.1f}"/>'
                     f'<rect class="box" x="{x_of(summary.q1):.1f}" y="{middle - 9:.1f}" '
                     f'width="{max(1.0, x_of(summary.q3) - x_of(summary.q1)):.1f}" height="18"/>'
                     f'<line class="median" x1="{x_of(summary.median):.1f}" y1="{middle - 11:.1f}" '
                     f'x2="{x_of(summary.median):.1f}" y2="{middle + 11:.1f}"/>')
        ordered = sorted(times)
        step = max(1, -(-len(ordered) // MAX_POINTS))
        for k, value in enumerate(ordered[::step]):
            parts.append(f'<circle cx="{x_of(value):.1f}" cy="{middle + ((k * 5) % 11 - 5) * 1.4:.1f}" r="2.2"/>')
        parts.append("</g>")
    parts.append("</svg>")
    return "".join(parts)


# ---------------------------------------------------------------------------------------------
# profile


VIEW_ROWS = 15  # rows of a profile table shown before "show all": the top of a sorted table


def _time_columns() -> list[tuple[str, str]]:
    """(row key, header) of a view's time columns, as nsys: total, avg, median, min, max, stddev."""
    return [("total_ns", "total"), ("avg_ns", "avg"), ("median_ns", "median"), ("min_ns", "min"),
            ("max_ns", "max"), ("stddev_ns", "stddev")]


def _view_table(rows: Sequence[Mapping[str, Any]], *, key: str, name_header: str, wall: bool,
                kind: bool = False) -> str:
    """One profile view as nsys's ``cuda_gpu_kern_sum`` shows kernels: largest total first, times
    as integers in the unit the table calls for (:func:`integer_time_unit`), a standard deviation
    column; sortable and filterable where JavaScript runs. Rows past VIEW_ROWS are folded behind a
    "show all" box (a checkbox and CSS, so it works without JavaScript too)."""
    rows = sorted(rows, key=lambda r: -(_num(r.get("total_ns")) or 0.0))
    times = _time_columns()
    # The unit comes from the times, not their spread: a small stddev reads as a small integer.
    unit, per = integer_time_unit([_num(r.get(field)) for r in rows for field, _ in times if field != "stddev_ns"])
    headers = ([(name_header, "text")] + ([("kind", "text")] if kind else []) + [("calls", "num")]
               + [(f"{title} {unit}", "num") for _, title in times] + [("% device", "num")]
               + ([("% wall", "num")] if wall else []))
    head = "".join(f'<th data-type="{sort}"{" class=name" if i == 0 else ""} scope="col">{_esc(h)}</th>'
                   for i, (h, sort) in enumerate(headers))
    body = []
    for number, r in enumerate(rows):
        cells = [f'<td class="name">{_esc(r.get("name"))}</td>']
        if kind:
            cells.append(f'<td class="text">{_esc(r.get("kind"))}</td>')
        cells.append(_sort_cell(_esc(r.get("calls")), r.get("calls")))
        cells += [_sort_cell(_esc(fmt_integer_time(r.get(field), per)), r.get(field)) for field, _ in times]
        cells.append(_sort_cell(_esc(fmt_percent(r.get("share"))), r.get("share")))
        if wall:
            cells.append(_sort_cell(_esc(fmt_percent(r.get("wall_share"))), r.get("wall_share")))
        extra = ' class="extra"' if number >= VIEW_ROWS else ""
        body.append(f'<tr{extra} data-name="{_esc(r.get("name"), 100000)}">{"".join(cells)}</tr>')
    table = (f'<div class="table-scroll"><table class="view sortable" id="table-{key}" data-fold="{VIEW_ROWS}">'
             f'<thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>')
    fold = (f'<input type="checkbox" class="show-all" id="all-{key}"/><label for="all-{key}" class="show-all">show all '
            f'{len(rows)} rows (the largest {VIEW_ROWS} are shown)</label>' if len(rows) > VIEW_ROWS else "")
    search = (f'<label class="filter" hidden="hidden">name contains <input type="search" class="name-filter" '
              f'data-table="table-{key}"/></label>')
    return f'<div class="view-controls">{search}</div>{fold}{table}'


def _sort_cell(text: str, value: Any) -> str:
    number = _num(value)
    return f'<td data-sort="{number!r}">{text}</td>' if number is not None else f"<td>{text}</td>"


def render_profile(document: Mapping[str, Any]) -> str:
    subject = document.get("subject") or {}
    hot = document.get("hot")
    totals = document.get("totals") or {}
    wall = totals.get("wall_ns") is not None
    name = subject.get("name") or document.get("source") or "?"
    verdict = document.get("headline") or "profile"
    rows = [("source", document.get("source")), ("impl", document.get("impl")), ("device", document.get("device")),
            ("counted", (document.get("settings") or {}).get("counted")),
            ("steps", f"{totals.get('steps')} active (schedule: {(document.get('settings') or {}).get('schedule')})"),
            ("counted time", _ns_text(totals.get("device_ns")))]
    if wall:
        rows += [("wall time", _ns_text(totals.get("wall_ns"))),
                 ("busy", f"{_ns_text(totals.get('busy_ns'))} ({fmt_percent(totals.get('busy_share'))} of wall)")]
    if hot:
        rows.append(("hot module", f"{hot['module']}: {fmt_percent(hot['share'])} of device time; porting it could "
                                   f"make the forward {amdahl_text(hot['amdahl_bound'])} (Amdahl)"))
    body = [f'<section id="summary"><h2>Summary</h2>{_kv(rows)}</section>', _warnings(document)]
    primary = document.get("modules") or document.get("kernels") or []
    if primary:
        what = "module" if document.get("modules") else "kernel"
        hot_name = hot["module"] if hot else None
        bars = [(r["name"], 100 * (_num(r.get("share")) or 0.0), "hot" if r["name"] == hot_name else "")
                for r in sorted(primary, key=lambda r: -(_num(r.get("share")) or 0.0))]
        body.append(f'<section id="chart"><h2>Share of device time by {what}</h2>'
                    + bar_chart(bars, label=f"share of device time by {what}", value_text=lambda v: f"{v:.1f}%")
                    + "</section>")
    against = document.get("against")
    if against:
        body.append(_against_section(against))
    for key, title, header, kind in (("modules", "Modules (device time charged to the innermost module)", "module", False),
                                     ("ops", "Ops", "op", False), ("kernels", "Kernels", "kernel", True)):
        if document.get(key):
            body.append(f'<section id="{key}"><h2>{_esc(title)}</h2>'
                        + _view_table(document[key], key=key, name_header=header, wall=wall, kind=kind)
                        + "</section>")
    return _page(f"parity profile: {printable(name, limit=120)}", f"parity profile: {printable(name, limit=200)}",
                 verdict, "info", "\n".join(body), document, script=_SORT_JS)


def _ns_text(value: Any) -> str:
    number = _num(value)
    if number is None:
        return "-"
    unit, scale = time_unit([number / 1e9])
    return f"{fmt_time(number / 1e9, scale)} {unit}"


def _against_section(against: Mapping[str, Any]) -> str:
    """The side by side (:func:`parity.speed.tables.against_table`), every cell escaped."""
    headers, cells = against_table(against)
    head = "".join(f'<th data-type="{"num" if i else "text"}"{"" if i else " class=name"}>{_esc(h)}</th>'
                   for i, h in enumerate(headers))
    body = "".join(f'<tr data-name="{_esc(row[0], 100000)}"><td class="name">' + "</td><td>".join(_esc(cell) for cell in row)
                   + "</td></tr>" for row in cells)
    title = against_title(against)
    return (f'<section id="against"><h2>{_esc(title[:1].upper() + title[1:])}</h2>'
            f'<div class="table-scroll"><table class="view sortable" id="table-against"><thead><tr>{head}</tr></thead>'
            f'<tbody>{body}</tbody></table></div></section>')


# ---------------------------------------------------------------------------------------------
# bench


def render_bench(document: Mapping[str, Any]) -> str:
    subject = document.get("subject") or {}
    settings = document.get("settings") or {}
    rows = document.get("impls") or []
    summary = _kv([("subject", f"{subject.get('name')} (spec {subject.get('spec')})"),
                   ("device", document.get("device")), ("inputs", document.get("inputs")),
                   ("rounds", f"{settings.get('reps')} interleaved (seed {settings.get('seed')}), "
                              f"{settings.get('warmup')} warm-up calls each"),
                   ("cache flush", settings.get("cache_flush")), ("timer", settings.get("timer")),
                   ("device time", settings.get("device_time", "not measured")),
                   ("clock throttling", (document.get("clocks") or {}).get("summary", "not recorded")),
                   ("judged", f"{settings.get('judged')} against {settings.get('judged_against')}"),
                   ("verdict rule", f"FASTER/SLOWER only when the {100 * (_num(settings.get('confidence')) or 0.95):.0f}% "
                                    f"interval clears 1 \u00b1 {_num(settings.get('min_effect'))}"),
                   ("equivalence rule", "EQUIVALENT when the "
                                        f"{100 * (_num(settings.get('equivalence_confidence')) or 0.9):.0f}% interval lies "
                                        f"inside 1 \u00b1 {_num(settings.get('equivalence'))} (two one-sided tests)"
                                        if settings.get("equivalence") is not None else "not recorded")])
    unit, scale = time_unit([_num(r["summary"]["median"]) for r in rows])
    device = any("device_time" in r for r in rows)
    headers = (["impl", f"median {unit}", f"IQR {unit}", f"p20\u2013p80 {unit}", f"min\u2013max {unit}", "n"]
               + ([f"device {unit} (speedup)"] if device else [])
               + ["speedup [95% CI]", "verdict", "equivalence [90% CI]", "parity", "speedup valid?"])
    # What a reader looks for first (the speedup, its verdict and whether it counts) before the
    # spread of the timings, so that a narrow window shows it without scrolling sideways
    first = [0, 1, len(headers) - 5, len(headers) - 4, len(headers) - 1, len(headers) - 2, len(headers) - 3]
    order = first + [i for i in range(len(headers)) if i not in first]
    head = "".join(f"<th{' class=name' if i == 0 else ''}>{_esc(headers[j])}</th>" for i, j in enumerate(order))
    body = []
    bars = []
    for r in rows:
        s, parity = r["summary"], r["parity"]
        cmp = r.get("vs_baseline")
        fails = parity.get("status") == "fails"
        cells = [f'<td class="name">{_esc(r["impl"])}</td>'] + [
            f"<td>{_esc(fmt_time(s[key], scale))}</td>" for key in ("median", "iqr")]
        cells.append(f"<td>{_esc(fmt_time(s['p20'], scale))}\u2013{_esc(fmt_time(s['p80'], scale))}</td>")
        times = [value for value in (_num(t) for t in r.get("times_s") or []) if value is not None]
        cells.append(f"<td>{_esc(fmt_time(min(times), scale))}\u2013{_esc(fmt_time(max(times), scale))}</td>"
                     if times else "<td>-</td>")
        cells.append(f"<td>{_esc(s['n'])}</td>")
        if device:
            measured = r.get("device_time") or {}
            ratio = _num(measured.get("speedup"))
            cells.append(f"<td>{_esc(fmt_time(measured.get('per_call_s'), scale))}"
                         f"{'' if ratio is None else f'<br/>({ratio:.3f}x)'}</td>")
        if cmp:
            cells += [f"<td>{_num(cmp['speedup']):.3f}x<br/>[{_num(cmp['ci_low']):.3f}, {_num(cmp['ci_high']):.3f}]</td>",
                      f"<td>{_esc(cmp['verdict'])}</td>",
                      f'<td class="text">{_esc(equivalence_cell(cmp.get("equivalence")))}</td>']
            bars.append((r["impl"], _num(cmp["speedup"]) or 0.0, "fail" if not r.get("valid") else ""))
        else:
            cells += ["<td>baseline</td>", "<td>-</td>", "<td>-</td>"]
            bars.append((r["impl"], 1.0, "base"))
        cells.append(f'<td class="text">{_esc(parity.get("status"))}</td>')
        cells.append(f'<td class="text">{_esc(r.get("validity", "-"))}</td>')
        body.append(f'<tr class="{"fail" if fails else "pass"}">{"".join(cells[j] for j in order)}</tr>')
    table = f'<div class="table-scroll"><table class="view"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'
    parts = [f'<section id="summary"><h2>Summary</h2>{summary}</section>', _warnings(document),
             '<section id="chart"><h2>Speedup over the baseline (whole forward; red: not valid, parity fails)</h2>'
             + bar_chart(bars, label="speedup over the baseline", reference=1.0, value_text=lambda v: f"{v:.2f}x")
             + "</section>",
             f'<section id="impls"><h2>Whole forward</h2>{table}</section>',
             _distribution_section(document), _against_run_section(document.get("baseline_run"))]
    modules = document.get("modules")
    if modules and modules.get("rows"):
        munit, mscale = time_unit([_num(r["summary"]["median"]) for r in modules["rows"]])
        mhead = "".join(f"<th{' class=name' if i == 0 else ''}>{_esc(h)}</th>" for i, h in enumerate(
            ["module", "impl", f"median {munit}", f"IQR {munit}", "speedup [95% CI]", "verdict",
             "Amdahl: whole forward"]))
        mbody = []
        for r in modules["rows"]:
            cmp = r.get("vs_baseline")
            mbody.append(f'<tr><td class="name">{_esc(r["module"])}</td><td class="text">{_esc(r["impl"])}</td>'
                         f'<td>{_esc(fmt_time(r["summary"]["median"], mscale))}</td>'
                         f'<td>{_esc(fmt_time(r["summary"]["iqr"], mscale))}</td>'
                         + (f'<td>{_num(cmp["speedup"]):.3f}x [{_num(cmp["ci_low"]):.3f}, {_num(cmp["ci_high"]):.3f}]</td>'
                            f'<td>{_esc(cmp["verdict"])}</td><td>{_num(r["amdahl_whole_forward"]):.3f}x</td>'
                            if cmp else "<td>baseline</td><td>-</td><td>-</td>") + "</tr>")
        parts.append('<section id="modules"><h2>Modules (timed with hooks in separate rounds)</h2>'
                     f'<div class="table-scroll"><table class="view"><thead><tr>{mhead}</tr></thead>'
                     f'<tbody>{"".join(mbody)}</tbody></table></div></section>')
    cases = document.get("cases")
    if cases:
        lines = "".join(f"<li>{_esc(line)}</li>" for line in cases.get("lines") or [])
        chead = "".join(f"<th{' class=name' if i == 0 else ''}>{_esc(h)}</th>" for i, h in enumerate(
            ["case", "impl", "parity", "speedup", "95% CI", "verdict"]))
        cbody = "".join(
            f'<tr class="{"pass" if r["parity_holds"] else "fail"}"><td class="name">{_esc(r["case"])}</td>'
            f'<td class="text">{_esc(r["impl"])}</td><td class="text">{"holds" if r["parity_holds"] else "fails"}</td>'
            f'<td>{_num(r["speedup"]):.3f}x</td><td>[{_num(r["ci_low"]):.3f}, {_num(r["ci_high"]):.3f}]</td>'
            f'<td>{_esc(r["verdict"])}</td></tr>' for r in cases.get("rows") or [])
        parts.append(f'<section id="cases"><h2>Cases</h2><ul>{lines}</ul>'
                     f'<div class="table-scroll"><table class="view"><thead><tr>{chead}</tr></thead>'
                     f'<tbody>{cbody}</tbody></table></div></section>')
    passed = bool(document.get("passed"))
    name = subject_name(subject.get("name"), subject.get("spec"))
    return _page(f"parity bench: {printable(name, limit=120)}",
                 f"parity bench: {printable(name, limit=200)}", document.get("verdict") or "",
                 "pass" if passed else "fail", "\n".join(p for p in parts if p), document)


def _distribution_section(document: Mapping[str, Any]) -> str:
    """Every timing of each impl (and of the saved run's, grey, with --baseline) as a box over its points."""
    against = document.get("baseline_run") or {}
    then = {row["impl"]: row.get("then_times_s") or [] for row in against.get("rows") or []}
    rows = []
    for r in document.get("impls") or []:
        css = "fail" if (r.get("parity") or {}).get("status") == "fails" else ""
        rows.append((r["impl"], r.get("times_s") or [], css))
        if then.get(r["impl"]):
            rows.append((f"{r['impl']} (then)", then[r["impl"]], "then"))
    plot = strip_plot(rows, label="timings of the whole forward per implementation")
    if not plot:
        return ""
    return ('<section id="distribution"><h2>Timings of the whole forward (box: q1 to q3 and the median; whiskers: '
            'min to max; red: parity fails' + ("; grey: the saved run" if then else "") + ")</h2>" + plot + "</section>")


def _against_run_section(against: Mapping[str, Any] | None) -> str:
    if not against:
        return ""
    rows = against.get("rows") or []
    unit, scale = time_unit([_num(r["then_median_s"]) for r in rows] + [_num(r["now_median_s"]) for r in rows])
    head = "".join(f"<th{' class=name' if i == 0 else ''}>{_esc(h)}</th>" for i, h in enumerate(
        ["impl", f"then median {unit}", f"now median {unit}", "now / then [95% CI]", "status"]))
    body = "".join(
        f'<tr class="{"fail" if r["status"] == "REGRESSED" else "pass"}"><td class="name">{_esc(r["impl"])}</td>'
        f'<td>{_esc(fmt_time(r["then_median_s"], scale))}</td><td>{_esc(fmt_time(r["now_median_s"], scale))}</td>'
        f'<td>{_esc(ratio_cell(r))}</td><td class="text">{_esc(r["status"])}</td></tr>' for r in rows)
    title = against_run_title(against)
    return (f'<section id="baseline-run"><h2>{_esc(title[:1].upper() + title[1:])}</h2>'
            f'<p>{_esc(against.get("line"))}</p>'
            f'<div class="table-scroll"><table class="view"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
            '</div></section>')
