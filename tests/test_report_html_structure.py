"""What a browser would show of the HTML pages, checked from their structure (no browser needed):
wide tables inside a box that scrolls sideways, the depth chart's mark labels out of the plot (in
the legend), x-axis labels that never collide (their widths estimated from the text, 0.6 em per
character of the 11 px monospace font), empty columns left out, and the profile page's tables
largest first, in one integer unit per table, with nsys's standard deviation column, folded past
their largest rows. ``test_report_html_browser.py`` measures the same pages in headless Chromium
where one is installed.
"""
from __future__ import annotations

import copy
import gzip
import json
import re
from pathlib import Path

import pytest

from parity.base.text import subject_name
from parity.report.html import HEIGHT, WIDTH, render_html, render_plot
from parity.speed.pages import VIEW_ROWS, render_profile

from test_report_html import parse

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
CHAR_WIDTH = 0.6 * 11  # a monospace font's advance at 11 px


@pytest.fixture(scope="module")
def h200_report():
    """The committed H200 report: 300 tensors with long case names, two fail."""
    with gzip.open(GOLDEN / "results" / "h200-compare-h200-fuzz-8ulp.json.gz", "rt") as handle:
        return json.load(handle)


def isolated(report, layers=None):
    """``report`` as an --isolate run whose first failing tensor also introduces the error, cut to
    ``layers`` tensors; no layer has an isolated result or an attribution (empty columns)."""
    report = copy.deepcopy(report)
    if layers is not None:
        first = next(i for i, layer in enumerate(report["layers"]) if not layer["passed"])
        report["layers"] = report["layers"][max(0, first - layers // 2):][:layers]
    report["isolate"] = True
    first = report["summary"]["first_failing_layer"]
    report["summary"]["introducing_layers"] = [first]
    return report


def x_labels(svg):
    """(left, right, text) of each x-axis label, in order, from its SVG coordinates."""
    out = []
    for node in svg.iter("text"):
        if "xtick" in node.attrs.get("class", "").split():
            label = "".join(part for part in node.text_parts if isinstance(part, str))
            x, width = float(node.attrs["x"]), len(label) * CHAR_WIDTH
            assert node.attrs["text-anchor"] == "middle"
            out.append((x - width / 2, x + width / 2, label, float(node.attrs["y"])))
    return out


@pytest.mark.parametrize("count", [1, 6, 40, 300])
def test_x_axis_labels_are_names_that_never_collide_or_leave_the_plot(h200_report, count):
    report = isolated(h200_report, count)
    svg = parse(render_plot(report, "rel_l2")).find("svg")[0]
    labels = x_labels(svg)
    assert labels, "no x-axis label"
    for left, right, text, _ in labels:
        assert 0 <= left and right <= WIDTH, f"{text!r} leaves the drawing ({left:.1f}..{right:.1f})"
    for (_, right, a, _), (left, _, b, _) in zip(labels, labels[1:]):
        assert left - right >= 4, f"{a!r} and {b!r} collide ({right:.1f} > {left:.1f})"
    names = [layer["name"] for layer in report["layers"]]
    # Labels are the names' ends (the specific part), never bare indices.
    indices = [int(node.attrs["data-index"]) for node in svg.iter("text") if "data-index" in node.attrs
               and "xtick" in node.attrs.get("class", "")]
    for index, (_, _, text, _) in zip(indices, labels):
        assert names[index].endswith(text.lstrip("\u2026"))
    if count <= 6:  # the case names (about 60 characters) cut to 18 fit six to a plot
        assert indices == list(range(count))
    else:
        assert len(indices) >= 4 and indices[0] == 0


def test_x_axis_labels_sit_below_the_zero_band_and_under_the_axis_title(h200_report):
    svg = parse(render_plot(isolated(h200_report, 40), "max_abs")).find("svg")[0]
    frame = svg.find("rect")[0]
    bottom = float(frame.attrs["y"]) + float(frame.attrs["height"])
    title_y = max(float(n.attrs["y"]) for n in svg.iter("text") if n.attrs.get("class") == "axis"
                  and "transform" not in n.attrs)
    for _, _, text, y in x_labels(svg):
        assert bottom + 12 + 11 <= y <= title_y - 11, f"{text!r} at y={y} overlaps the zero band or the title"
    assert title_y <= HEIGHT


def test_mark_labels_are_in_the_legend_never_drawn_in_the_plot(h200_report):
    report = isolated(h200_report, 40)
    first = report["summary"]["first_failing_layer"]
    dom = parse(render_html(report))
    index = [layer["name"] for layer in report["layers"]].index(first)
    for quantity in ("rel_l2", "max_abs"):
        svg = dom.find("svg", id=f"plot-{quantity}")[0]
        marks = [g for g in svg.iter("g") if "data-mark" in g.attrs]
        assert {(g.attrs["data-mark"], g.attrs["data-name"]) for g in marks} == {
            ("first-failing", first), ("introducing", first)}
        assert all(not g.find("text") for g in marks), "a mark draws text inside the plot"
        figure = svg.parent
        legend = {li.attrs["data-mark"]: li.text() for li in figure.find("li") if "data-mark" in li.attrs}
        assert legend == {"first-failing": f"first failing tensor: #{index} {first}",
                          "introducing": f"introduces the error (--isolate): #{index} {first}"}


def headers(dom):
    return [th.text() for th in dom.find("table", id="results")[0].find("th")]


def test_columns_with_no_value_in_any_row_are_left_out(h200_report):
    report = isolated(h200_report, 20)
    dom = parse(render_html(report))
    shown = headers(dom)
    assert "error" not in shown and "iso rel L2" not in shown and "iso verdict" not in shown
    assert shown[:10] == ["#", "tensor", "dtype", "shape", "cosine", "max abs", "rel L2", "mismatch %", "rule", "verdict"]
    for row in dom.find("table", id="results")[0].find("tbody")[0].find("tr"):
        assert len(row.find("td")) == len(shown)
    report["layers"][3]["attribution"] = "introduced"
    assert "error" in headers(parse(render_html(report)))


def test_a_person_can_hide_columns_where_javascript_runs(h200_report):
    page = render_html(isolated(h200_report, 5))
    dom = parse(page)
    controls = dom.find("div", id="controls")[0]
    assert controls.attrs.get("hidden") == "hidden"  # without JavaScript no control that does nothing
    assert controls.find("details")[0].find("span", id="column-toggles")
    script = dom.find("script")[0].text()
    assert "column-toggles" in script and "style.display=show" in script


def wide_tables(dom):
    return [t for t in dom.iter("table") if "kv" not in t.attrs.get("class", "").split()]


def test_every_wide_table_of_the_compare_page_is_in_a_scroll_box(h200_report):
    dom = parse(render_html(h200_report))
    tables = wide_tables(dom)
    assert tables and all("table-scroll" in t.parent.attrs.get("class", "").split() for t in tables)
    assert ".table-scroll{overflow-x:auto" in dom.find("style")[0].text()


# ---------------------------------------------------------------------------------------------
# profile page


def view_row(name, values_ns):
    total = sum(values_ns)
    n = len(values_ns)
    mean = total / n
    stddev = (sum((v - mean) ** 2 for v in values_ns) / (n - 1)) ** 0.5 if n > 1 else 0.0
    return {"name": name, "calls": n, "total_ns": total, "avg_ns": mean, "median_ns": sorted(values_ns)[n // 2],
            "min_ns": min(values_ns), "max_ns": max(values_ns), "stddev_ns": stddev, "share": 0.0, "wall_share": None}


def profile_document(ops):
    device = sum(row["total_ns"] for row in ops)
    for row in ops:
        row["share"] = row["total_ns"] / device
    return {"format": "parity-profile-report", "version": 1, "subject": {"name": "subject", "spec": "pkg.mod:make"},
            "impl": "reference", "device": "cpu", "source": "parity", "settings": {"counted": "CPU self time",
                                                                                  "schedule": "skip 0"},
            "totals": {"device_ns": device, "wall_ns": None, "steps": 2}, "hot": None, "headline": "no module ranges",
            "ops": ops}


def table_of(page, key):
    return parse(page).find("table", id=f"table-{key}")[0]


def test_profile_tables_are_largest_first_in_one_integer_unit_with_a_stddev_column():
    # Calls from 40 us to 20 ms, listed smallest first: the smallest time (40 us) picks us.
    ops = [view_row(f"aten::op{i}", [10_000 * (i % 7 + 4), 10_000 * (i % 5 + 4) + 500]) for i in range(40)]
    ops.append(view_row("aten::big", [20_000_000, 20_002_000]))
    table = table_of(render_profile(profile_document(ops)), "ops")
    assert [th.text() for th in table.find("th")] == ["op", "calls", "total us", "avg us", "median us", "min us",
                                                      "max us", "stddev us", "% device"]
    rows = table.find("tbody")[0].find("tr")
    totals = [float(row.find("td")[2].attrs["data-sort"]) for row in rows]
    assert totals == sorted(totals, reverse=True) and rows[0].attrs["data-name"] == "aten::big"
    big = rows[0].find("td")
    assert [cell.text() for cell in big[2:8]] == ["40,002", "20,001", "20,002", "20,000", "20,002", "1"]
    for row in rows:
        for cell in row.find("td")[2:8]:
            assert re.fullmatch(r"\d{1,3}(,\d{3})*", cell.text()), cell.text()  # integers, no 1e-05
    stddevs = {row.attrs["data-name"]: float(row.find("td")[7].attrs["data-sort"]) for row in rows}
    assert stddevs == {row["name"]: pytest.approx(row["stddev_ns"]) for row in ops}
    assert [("extra" in row.attrs.get("class", "")) for row in rows] == [i >= VIEW_ROWS for i in range(len(rows))]


@pytest.mark.parametrize("smallest_ns, unit", [(9_999, "ns"), (10_000, "us"), (25_000_000, "ms"),
                                                (9_000_000_000, "ms")])
def test_the_unit_keeps_the_smallest_time_of_the_table_at_two_digits(smallest_ns, unit):
    ops = [view_row("small", [smallest_ns]), view_row("large", [smallest_ns * 1000])]
    table = table_of(render_profile(profile_document(ops)), "ops")
    assert table.find("th")[2].text() == f"total {unit}"
    shown = int(table.find("tbody")[0].find("tr")[1].find("td")[2].text().replace(",", ""))
    assert shown >= 10 if smallest_ns >= 10_000 else shown == smallest_ns


def test_long_profile_tables_fold_behind_a_show_all_box_that_needs_no_script():
    ops = [view_row(f"op{i}", [1_000 + i]) for i in range(VIEW_ROWS + 5)]
    page = render_profile(profile_document(ops))
    dom = parse(page)
    section = dom.find("section", id="ops")[0]
    box = [n for n in section.find("input") if n.attrs.get("type") == "checkbox"][0]
    assert "show-all" in box.attrs["class"] and section.find("label", **{"for": box.attrs["id"]})
    assert "input.show-all:not(:checked)~.table-scroll table:not(.filtering) tr.extra{display:none}" in page
    assert f"show all {VIEW_ROWS + 5} rows" in section.text()
    few = parse(render_profile(profile_document(ops[:VIEW_ROWS])))
    assert not few.find("section", id="ops")[0].find("input", type="checkbox")  # nothing to fold


def test_profile_tables_are_sortable_and_filterable_and_scroll_in_their_box():
    page = render_profile(profile_document([view_row("a", [5]), view_row("b", [7])]))
    dom = parse(page)
    for table in wide_tables(dom):
        assert "sortable" in table.attrs["class"].split()
        assert "table-scroll" in table.parent.attrs.get("class", "").split()
        assert [th.attrs["data-type"] for th in table.find("th")][:2] == ["text", "num"]
    search = dom.find("input", **{"class": "name-filter"})[0]
    assert search.attrs["data-table"] == "table-ops" and search.parent.attrs.get("hidden") == "hidden"
    assert "table.sortable" in dom.find("script")[0].text()


def test_a_real_cpu_profile_page(tmp_path):
    import speed_subjects
    from parity.cli.main import main

    gen = speed_subjects.one_thread()
    next(gen)
    try:
        out, page = tmp_path / "p.json", tmp_path / "p.html"
        assert main(["profile", "--quiet", "--subject", speed_subjects.MATMUL_SPEC, "--skip", "0", "--warmup", "1",
                     "--active", "2", "--json", str(out), "--html", str(page)]) == 0
    finally:
        gen.close()
    document = json.loads(out.read_text())
    dom = parse(page.read_text())
    for key in ("modules", "ops"):
        rows = dom.find("table", id=f"table-{key}")[0].find("tbody")[0].find("tr")
        expected = sorted(document[key], key=lambda r: -r["total_ns"])
        assert [r.attrs["data-name"] for r in rows] == [r["name"] for r in expected]
        assert [float(r.find("td")[7].attrs["data-sort"]) for r in rows] == [r["stddev_ns"] for r in expected]
    assert "infx" not in page.read_text() and "e0x" not in page.read_text()


# ---------------------------------------------------------------------------------------------
# wording


def test_subject_name_never_reads_subject_subject():
    assert subject_name("decoder", "parity.run.subjects:decoder") == "decoder"
    assert subject_name("subject", "pkg.mod:make") == "pkg.mod:make"
    assert subject_name(None, "pkg.mod:make") == "pkg.mod:make"
    assert subject_name("", None) == "?"
    assert subject_name("evil\x1b[31m", None) == "evil\\x1b[31m"
    page = render_html({"subject": {"name": "subject", "spec": "pkg.mod:make"}, "layers": []})
    assert "subject subject" not in page and "parity compare: pkg.mod:make" in page



def test_the_tensor_column_stays_in_view_while_the_table_scrolls_sideways(h200_report):
    """The tensor's name (the second column, after the index) is sticky to the scroll box's left
    edge, opaque, and above the cells that scroll under it; its header likewise, above the sticky
    header row."""
    dom = parse(render_html(h200_report))
    style = dom.find("style")[0].text()
    assert "table.results td.name{position:sticky;left:0;background:#fff;z-index:1}" in style
    assert "table.results th:nth-child(2){left:0;z-index:2}" in style
    table = dom.find("table", id="results")[0]
    assert [th.text() for th in table.find("th")][1] == "tensor"
    second = [row.find("td")[1] for row in table.iter("tr") if row.find("td")]
    assert len(second) == 300 and all("name" in cell.attrs.get("class", "").split() for cell in second)


# ---------------------------------------------------------------------------------------------
# labels the browser test found overlapping (tests/test_report_html_browser.py), held here where
# no browser runs: positions from the SVG, text boxes as Chromium draws them


LABEL_BOX_11PX = 13  # px: the height of an 11 px sans-serif label's box, measured in Chromium 156


def own_text(node):
    return "".join(part for part in node.text_parts if isinstance(part, str))


def test_the_zero_and_non_finite_band_labels_clear_the_nearest_decade_labels(h200_report):
    svg = parse(render_plot(isolated(h200_report, 40), "rel_l2")).find("svg")[0]
    ticks = {own_text(node): float(node.attrs["y"]) for node in svg.iter("text")
             if node.attrs.get("class") == "tick"}
    decades = sorted(y for text, y in ticks.items() if text.startswith("1e"))
    assert len(decades) >= 2
    assert ticks["0"] - decades[-1] >= LABEL_BOX_11PX  # y grows downwards: the lowest decade is the largest y
    assert decades[0] - ticks["inf/nan"] >= LABEL_BOX_11PX


@pytest.mark.parametrize("times", [[7.3e-6, 8.1e-6, 2.0e-4], [0.5, 0.52, 123.4], [1.0, 1.0, 1.0]])
def test_the_strip_plots_axis_title_and_tick_labels_stay_apart_and_inside_the_drawing(times):
    from parity.speed.pages import STRIP_CHAR_WIDTH, STRIP_WIDTH, strip_plot

    svg = parse(strip_plot([("reference", times, ""), ("fast", [t / 2 for t in times], "")],
                           label="timings")).find("svg")[0]
    axis = svg.find("g", **{"class": "axis"})[0]
    labels = [(float(n.attrs["x"]), n.attrs["text-anchor"], own_text(n)) for n in axis.iter("text")]
    title = [label for label in labels if label[2].startswith("time (")]
    assert len(title) == 1 and title[0][1] == "end"
    boxes = [(x - len(text) * STRIP_CHAR_WIDTH / 2, x + len(text) * STRIP_CHAR_WIDTH / 2, text)
             for x, anchor, text in labels if anchor == "middle"]
    assert 3 <= len(boxes) <= 7  # round ticks (nice_ticks): about five steps across the range
    values = [float(text) for _, _, text in boxes]
    steps = {round(b - a, 9) for a, b in zip(values, values[1:])}
    assert len(steps) == 1 and all(len(text.replace("0.", "").strip("0")) <= 2 for _, _, text in boxes), boxes
    assert title[0][0] + 4 <= boxes[0][0], f"{title[0][2]!r} runs into {boxes[0][2]!r}"
    for (_, right, a), (left, _, b) in zip(boxes, boxes[1:]):
        assert right + 4 <= left, f"{a!r} and {b!r} collide"
    assert boxes[-1][1] <= STRIP_WIDTH
    title_left = title[0][0] - len(title[0][2]) * STRIP_CHAR_WIDTH
    assert title_left >= 0


def test_the_error_page_wraps_a_long_message():
    from parity.report.error_report import error_html

    page = error_html(2, "usage", "bundle /ci/" + "x" * 300 + " does not exist")
    assert re.search(r"<style>pre\{white-space:pre-wrap;overflow-wrap:anywhere\}</style>", page)
