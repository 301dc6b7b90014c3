"""The HTML report: parsed with a real HTML parser, checked against the JSON report it came from
(verdict, one table row per result, every plotted number, the marked layers), hostile names
rendered as text, nothing fetched from the network, and written whole or not at all."""
import copy
import gzip
import json
import math
import os
from html.parser import HTMLParser
from pathlib import Path

import pytest

import fault_models
from parity.base.errors import UsageError
from parity.report.html import render_html, verdict_line, write_html
from parity.base.text import printable

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
VOID = {"meta", "input", "br", "img", "link", "hr", "col", "area", "base", "source", "wbr"}


class Node:
    def __init__(self, tag, attrs, parent=None):
        self.tag, self.attrs, self.parent, self.children, self.text_parts = tag, dict(attrs), parent, [], []

    def text(self):
        return "".join(part if isinstance(part, str) else part.text() for part in self.text_parts)

    def iter(self, tag=None):
        if tag is None or self.tag == tag:
            yield self
        for child in self.children:
            yield from child.iter(tag)

    def find(self, tag, **attrs):
        return [n for n in self.iter(tag) if all(n.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items())]


class TreeBuilder(HTMLParser):
    """A small DOM from the stdlib parser; fails on an end tag that closes anything but the open one."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.current = self.root

    def handle_starttag(self, tag, attrs):
        node = Node(tag, attrs, self.current)
        self.current.children.append(node)
        self.current.text_parts.append(node)
        if tag not in VOID:
            self.current = node

    def handle_startendtag(self, tag, attrs):
        node = Node(tag, attrs, self.current)
        self.current.children.append(node)
        self.current.text_parts.append(node)

    def handle_endtag(self, tag):
        assert self.current.tag == tag, f"</{tag}> closes <{self.current.tag}>"
        self.current = self.current.parent

    def handle_data(self, data):
        self.current.text_parts.append(data)


def parse(page):
    builder = TreeBuilder()
    builder.feed(page)
    builder.close()
    assert builder.current is builder.root, f"<{builder.current.tag}> never closed"
    return builder.root


def _same(value, shown):
    """A JSON number (or its "inf"/"nan" string) against a data-value attribute."""
    if isinstance(value, str):
        return shown == value
    number = float(shown)
    return number == float(value) or (math.isnan(number) and math.isnan(float(value)))


def _points(dom, series):
    return [(int(n.attrs["data-index"]), n.attrs["data-name"], n.attrs["data-value"])
            for n in dom.iter() if n.attrs.get("data-series") == series and "data-value" in n.attrs]


def _expected(report, *path):
    out = []
    for index, layer in enumerate(report["layers"]):
        value = layer
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            out.append((index, layer["name"], value))
    return out


def _check_series(dom, report, series, *path):
    shown = _points(dom, series)
    expected = _expected(report, *path)
    assert [(i, n) for i, n, _ in shown] == [(i, printable(n, limit=100_000)) for i, n, _ in expected]
    assert all(_same(value, attr) for (_, _, attr), (_, _, value) in zip(shown, expected))
    return shown


@pytest.fixture(scope="module")
def failing_report(tmp_path_factory):
    """A real compare report with --isolate: a zeroed row injected in blocks.3 (introduced there)."""
    from parity.report.json_report import to_json
    from parity.judge.results import verdict_line

    bundle = fault_models.capture_model(tmp_path_factory.mktemp("html"), "res", "bf16")
    case = next(c for c in fault_models.CASES if c.id == "bf16-zerorow-block3")
    report = fault_models.run_case(bundle, case)
    return json.loads(to_json(report)), verdict_line(report)


@pytest.fixture(scope="module")
def h200_report():
    """The committed report of the H200 compiled kernel against the fuzz corpus (2 tensors fail)."""
    with gzip.open(GOLDEN / "results" / "h200-compare-h200-fuzz-8ulp.json.gz", "rt") as handle:
        return json.load(handle)


def test_failing_report_verdict_table_and_plots(failing_report):
    report, text_verdict = failing_report
    assert not report["passed"] and report["isolate"] and report["summary"]["introducing_layers"] == ["blocks.3"]
    dom = parse(render_html(report))
    verdict = dom.find("p", id="verdict")[0]
    assert verdict.text() == text_verdict  # the same line as the text report
    assert verdict.text().startswith("PARITY FAILS: first failing tensor blocks.3")
    assert "fail" in verdict.attrs["class"].split()

    rows = dom.find("table", id="results")[0].find("tbody")[0].find("tr")
    assert [r.attrs["data-name"] for r in rows] == [layer["name"] for layer in report["layers"]]
    assert [r.attrs["data-passed"] == "true" for r in rows] == [layer["passed"] for layer in report["layers"]]
    for row, layer in zip(rows, report["layers"]):
        cells = [c.text() for c in row.find("td")]
        assert cells[1] == layer["name"]
        assert cells[9].startswith("FAIL") != layer["passed"]
        assert cells[9] == "pass" or not layer["passed"]

    growth = report["summary"]["error_growth"]
    shown = _check_series(dom, report, "rel_l2-golden", "metrics", "rel_l2")
    assert [(n, float(v)) for _, n, v in shown] == [(n, float(v)) for n, v in growth["rel_l2"]]
    shown = _check_series(dom, report, "max_abs-golden", "metrics", "max_abs")
    assert [(n, float(v)) for _, n, v in shown] == [(n, float(v)) for n, v in growth["max_abs"]]
    for quantity in ("rel_l2", "max_abs"):
        host = _check_series(dom, report, f"{quantity}-host-ref", "budget", f"host_{quantity}")
        capture = _check_series(dom, report, f"{quantity}-capture-ref", "budget", f"capture_{quantity}")
        bound = _check_series(dom, report, f"{quantity}-budget-bound", "budget", f"allowed_{quantity}")
        assert len(host) == len(capture) == len(bound) > 10  # every tensor has an fp64 reference
    _check_series(dom, report, "rel_l2-threshold", "tolerance", "max_rel_l2")

    for quantity in ("rel_l2", "max_abs"):
        svg = dom.find("svg", id=f"plot-{quantity}")[0]
        marks = {(g.attrs["data-mark"], g.attrs["data-name"]) for g in svg.iter("g") if "data-mark" in g.attrs}
        assert marks == {("first-failing", "blocks.3"), ("introducing", "blocks.3")}
        failing_points = {int(c.attrs["data-index"]) for c in svg.iter("circle") if "fail" in c.attrs["class"].split()}
        assert failing_points == {i for i, layer in enumerate(report["layers"]) if not layer["passed"]}

    failures = dom.find("section", id="failures")[0].find("ol")[0].find("li")
    top = [li for li in failures if "data-name" in li.attrs]
    assert [li.attrs["data-name"] for li in top] == [l["name"] for l in report["layers"] if not l["passed"]]
    assert "error introduced by" in dom.find("section", id="summary")[0].text()


def test_committed_h200_report(h200_report):
    report = h200_report
    dom = parse(render_html(report))
    summary = report["summary"]
    assert dom.find("p", id="verdict")[0].text() == (
        f"PARITY FAILS: first failing tensor {summary['first_failing_layer']} "
        f"({summary['failing']} of {summary['layers']} tensors fail)")
    rows = dom.find("table", id="results")[0].find("tbody")[0].find("tr")
    assert len(rows) == len(report["layers"]) == 300
    assert sum(r.attrs["class"] == "fail" for r in rows) == summary["failing"] == 2
    for quantity in ("rel_l2", "max_abs"):
        _check_series(dom, report, f"{quantity}-golden", "metrics", quantity)
        _check_series(dom, report, f"{quantity}-host-ref", "budget", f"host_{quantity}")
        _check_series(dom, report, f"{quantity}-budget-bound", "budget", f"allowed_{quantity}")
    svg = dom.find("svg", id="plot-rel_l2")[0]
    assert [g.attrs["data-name"] for g in svg.iter("g") if g.attrs.get("data-mark") == "first-failing"] == [
        summary["first_failing_layer"]]


def test_passing_report(h200_report):
    with gzip.open(GOLDEN / "results" / "h200-compare-cpu-fuzz.json.gz", "rt") as handle:
        report = json.load(handle)
    dom = parse(render_html(report))
    verdict = dom.find("p", id="verdict")[0]
    assert verdict.text() == "PARITY HOLDS: 300/300 tensors" and "pass" in verdict.attrs["class"].split()
    assert not [g for g in dom.iter("g") if "data-mark" in g.attrs]
    assert not dom.find("section", id="failures")


def test_zero_and_nonfinite_values_are_drawn_on_their_bands(failing_report):
    report = copy.deepcopy(failing_report[0])
    report["layers"][0]["metrics"]["rel_l2"] = 0.0
    report["layers"][1]["metrics"]["rel_l2"] = "inf"
    report["layers"][2]["metrics"]["rel_l2"] = "nan"
    dom = parse(render_html(report))
    svg = dom.find("svg", id="plot-rel_l2")[0]
    frame = svg.find("rect")[0]
    bottom, top = float(frame.attrs["y"]) + float(frame.attrs["height"]), float(frame.attrs["y"])
    circles = {int(c.attrs["data-index"]): c for c in svg.iter("circle") if c.attrs["data-series"] == "rel_l2-golden"}
    assert circles[0].attrs["data-value"] == "0.0" and float(circles[0].attrs["cy"]) > bottom
    assert circles[1].attrs["data-value"] == "inf" and float(circles[1].attrs["cy"]) < top
    assert circles[2].attrs["data-value"] == "nan" and float(circles[2].attrs["cy"]) < top
    finite = [c for i, c in circles.items() if i > 2 and float(c.attrs["data-value"]) > 0]
    assert finite and all(top <= float(c.attrs["cy"]) <= bottom for c in finite)


HOSTILE = ["<root>/h", '"><script>alert(1)</script>', "a&amp;b", "x\x1b[2J\nPARITY HOLDS", "<img src=http://x/y>"]


def test_verdict_comes_from_the_json_and_old_reports_without_it_get_the_same_line(failing_report):
    report, text_verdict = failing_report
    assert report["verdict"] == text_verdict
    assert verdict_line({**report, "verdict": "PARITY FAILS: as the JSON says"}) == "PARITY FAILS: as the JSON says"
    old = {key: value for key, value in report.items() if key != "verdict"}  # written before the field
    assert verdict_line(old) == text_verdict
    old["summary"] = {**old["summary"], "first_failing_layer": HOSTILE[0]}
    assert verdict_line(old).startswith("PARITY FAILS: first failing tensor <root>/h (")


def test_hostile_names_render_as_text(failing_report):
    report = copy.deepcopy(failing_report[0])
    for index, name in enumerate(HOSTILE):
        report["layers"][index]["name"] = name
    report["summary"]["first_failing_layer"] = HOSTILE[0]
    report["verdict"] = f"PARITY FAILS: first failing tensor {HOSTILE[0]} (13 of 32 tensors fail)"
    report["layers"][0]["passed"] = False
    report["golden"] = "</title><script>alert(2)</script>"
    report["warnings"] = ["<b>bold</b> & more"]
    page = render_html(report)
    dom = parse(page)
    assert len(list(dom.iter("script"))) == 1 and not list(dom.iter("img"))
    assert all(b.parent.tag == "li" and "data-name" in b.parent.attrs for b in dom.iter("b"))  # ours only
    assert "alert(1)" not in dom.find("script")[0].text() and "<root>" not in page
    rows = dom.find("table", id="results")[0].find("tbody")[0].find("tr")
    for row, name in zip(rows, HOSTILE):
        assert row.attrs["data-name"] == printable(name, limit=100_000)
        assert row.find("td")[1].text() == printable(name)
    assert dom.find("p", id="verdict")[0].text().startswith("PARITY FAILS: first failing tensor <root>/h")
    assert "<b>bold</b> & more" in dom.find("section", id="warnings")[0].text()
    assert "\x1b" not in page


def test_self_contained_no_network(h200_report, failing_report):
    for report in (h200_report, failing_report[0]):
        page = render_html(report)
        dom = parse(page)
        assert "http://" not in page and "https://" not in page
        for node in dom.iter():
            for attr in ("src", "href", "xlink:href", "action", "data", "poster"):
                assert attr not in node.attrs, (node.tag, attr)
        assert not list(dom.iter("link")) and not list(dom.iter("iframe")) and not list(dom.iter("img"))
        style = dom.find("style")[0].text()
        assert "url(" not in style and "@import" not in style


def test_without_javascript_every_row_is_shown(failing_report):
    dom = parse(render_html(failing_report[0]))
    controls = dom.find("div", id="controls")[0]
    assert "hidden" in controls.attrs  # the filter appears only when its script runs
    table = dom.find("table", id="results")[0]
    assert "hidden" not in table.attrs and "failures-only" not in table.attrs["class"].split()
    assert all("hidden" not in row.attrs and "style" not in row.attrs for row in table.find("tr"))


def test_write_html_is_atomic(failing_report, tmp_path, monkeypatch):
    report = failing_report[0]
    target = tmp_path / "report.html"
    write_html(report, target)
    assert target.read_text(encoding="utf-8") == render_html(report)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]

    before = target.read_bytes()

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    changed = copy.deepcopy(report)
    changed["passed"] = True
    with pytest.raises(UsageError, match="cannot write: No space left on device"):
        write_html(changed, target)
    assert target.read_bytes() == before  # the old page stays whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]  # no temporary left behind


@pytest.mark.parametrize("where, fragment", [("dir", "is a directory"), ("missing", "does not exist")])
def test_write_html_bad_path(failing_report, tmp_path, where, fragment):
    path = tmp_path if where == "dir" else tmp_path / "no" / "such" / "r.html"
    with pytest.raises(UsageError, match=fragment):
        write_html(failing_report[0], path)
    assert list(tmp_path.iterdir()) == []


def test_the_wide_table_scrolls_in_its_box_and_names_wrap_only_at_dots_and_slashes(failing_report):
    report = copy.deepcopy(failing_report[0])
    report["layers"][0]["name"] = "model.layers.0.mlp.gate_proj/out"
    page = render_html(report)
    assert '<div class="table-scroll"><table id="results"' in page and ".table-scroll{overflow-x:auto" in page
    assert "<td class=\"name\">model.<wbr>layers.<wbr>0.<wbr>mlp.<wbr>gate_proj/<wbr>out</td>" in page
    assert "overflow-wrap:anywhere;min-width" not in page  # no break inside gate_proj
    dom = parse(page)
    assert dom.find("table", id="results")[0].find("tbody")[0].find("tr")[0].find("td")[1].text() == \
        "model.layers.0.mlp.gate_proj/out"


def test_a_diff_page_calls_the_candidates_host_candidate_host(failing_report):
    report = copy.deepcopy(failing_report[0])
    assert "this host" in render_html(report)
    report["candidate"] = "bundles/candidate"
    page = render_html(report)
    assert "<th>candidate host</th>" in page or ">candidate host<" in page
    # the plots' legends, their introduction and the error distribution too: the page renders no
    # output of the machine it is made on
    assert "this host" not in page
    assert "candidate host vs golden (rel L2)" in page and "candidate host's output vs the" in page
