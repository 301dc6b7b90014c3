"""Inline SVG histograms of each tensor's error distribution, the HTML report's "Error distribution" section.

Drawn from the JSON report alone (``metrics.abs_err_histogram``: counts of ``|out - golden|`` by
octave, and the percentiles; parity.judge.distribution): one small bar chart per compared tensor,
bars per power of two on a log axis, with exact zeros as a bar of their own, and the median, p99
and p99.9 marked. Self-contained (no script, no fonts or libraries fetched), styled by SVG
attributes so the page's stylesheet is untouched.
"""
from __future__ import annotations

import html
import math
from typing import Any

from parity.base.numbers import format_number
from parity.base.text import printable

WIDTH, HEIGHT = 320, 96
LEFT, RIGHT, TOP, BOTTOM = 8, 8, 8, 22
_MARKS = (("p50", "#1f5fbf"), ("p99", "#e07b00"), ("p99.9", "#b3261e"))


def _esc(value: Any, limit: int = 300) -> str:
    return html.escape(printable(value, limit=limit), quote=True)


def _float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def histogram_svg(histogram: dict[str, Any], percentiles: dict[str, Any] | None, name: str) -> str:
    """One tensor's bar chart: a bar for exact zeros, then one per octave ``[2^e, 2^(e+1))`` from
    the smallest to the largest octave with errors (empty octaves between drawn as gaps)."""
    octaves = {int(e): int(n) for e, n in histogram.get("log2") or []}
    zero = int(histogram.get("zero") or 0)
    low, high = (min(octaves), max(octaves)) if octaves else (0, 0)
    slots = 1 + (high - low + 1 if octaves else 0)  # the zero bar, then every octave in range
    total = max(zero + sum(octaves.values()), 1)
    tallest = max([zero, *octaves.values()]) or 1
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    step = plot_w / slots
    parts = [f'<svg class="hist" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" '
             f'aria-label="|out - golden| of {_esc(name)} by power of two">',
             f'<line x1="{LEFT}" y1="{TOP + plot_h}" x2="{LEFT + plot_w}" y2="{TOP + plot_h}" stroke="#999"/>']

    def bar(slot: int, count: int, label: str, fill: str) -> None:
        if not count:
            return
        h = plot_h * count / tallest
        parts.append(f'<rect x="{LEFT + slot * step + 0.5:.2f}" y="{TOP + plot_h - h:.2f}" '
                     f'width="{max(step - 1, 0.5):.2f}" height="{h:.2f}" fill="{fill}" data-count="{count}">'
                     f'<title>{_esc(label)}: {count} ({100 * count / total:.3g}%)</title></rect>')

    bar(0, zero, "exactly 0", "#999")
    for exponent, count in octaves.items():
        bar(1 + exponent - low, count, f"[2^{exponent}, 2^{exponent + 1})", "#6a8fcf")
    for key, colour in _MARKS:  # percentile marks at their octave (fraction within it, log-linear)
        value = _float((percentiles or {}).get(key))
        if value is None or not octaves:
            continue
        if value == 0:
            x = LEFT + step / 2
        else:
            position = min(max(math.log2(value), low), high + 1)
            x = LEFT + (1 + position - low) * step
        parts.append(f'<line x1="{x:.2f}" y1="{TOP}" x2="{x:.2f}" y2="{TOP + plot_h}" stroke="{colour}" '
                     f'stroke-dasharray="3 2" data-percentile="{key}"><title>{key} {_esc(format_number(value))}'
                     f'</title></line>')
    parts.append(f'<text x="{LEFT}" y="{HEIGHT - 6}" font-size="10" fill="#555">0</text>')
    if octaves:
        parts.append(f'<text x="{LEFT + step:.2f}" y="{HEIGHT - 6}" font-size="10" fill="#555">2^{low}</text>'
                     f'<text x="{LEFT + plot_w}" y="{HEIGHT - 6}" font-size="10" fill="#555" text-anchor="end">'
                     f'2^{high + 1}</text>')
    parts.append("</svg>")
    return "".join(parts)


def render_histograms(report: dict[str, Any], host: str = "this host") -> str:
    """The section: one figure per tensor with a histogram, in execution order; "" where none has one.
    ``host``: what the page calls the host whose outputs are judged."""
    figures = []
    for index, layer in enumerate(report.get("layers") or []):
        metrics = layer.get("metrics") or {}
        histogram = metrics.get("abs_err_histogram")
        if not histogram:
            continue
        percentiles = metrics.get("abs_err_percentiles") or {}
        rel = metrics.get("rel_err_percentiles") or {}
        caption = ", ".join(f"{key} {format_number(_float(value))}" for key, value in percentiles.items())
        rel_caption = ", ".join(f"{key} {format_number(_float(value))}" for key, value in rel.items())
        figures.append(f'<figure class="hist-figure" data-index="{index}" data-name="{_esc(layer.get("name"), 100_000)}">'
                       f'<figcaption><span style="font-weight:bold">#{index} {_esc(layer.get("name"))}</span><br/>|d|: {_esc(caption)}'
                       f'<br/>relative: {_esc(rel_caption)}</figcaption>'
                       f'{histogram_svg(histogram, percentiles, layer.get("name") or "")}</figure>')
    if not figures:
        return ""
    return ('<section id="distribution"><h2>Error distribution</h2><p>'
            f'|{host} - golden| of every element, by power of two (grey: exactly 0); dashed: median (blue), p99 (orange), p99.9 (red). Percentiles are '
            'within 1.125x above the exact ones (parity.judge.distribution).</p><details><summary>'
            f'{len(figures)} tensors</summary><div style="display:flex;flex-wrap:wrap;gap:12px">'
            + "".join(figures) + "</div></details></section>")
