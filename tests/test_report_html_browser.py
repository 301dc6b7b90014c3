"""The HTML pages in a real browser: headless Chromium renders every page parity writes (compare of a
failing and of a passing port, diff, profile, profile side by side, bench, a refused run's page) at
1024 and 1400 px; no content may be cut off or run off the page (a wide table scrolls inside its
own box), no two chart labels may overlap or leave their drawing, the name columns stay readable,
and the page logs no error and loads nothing.

tests/browser_pages.py makes the pages and drives Chromium (one start per page and width);
tests/browser_measure.js is what is measured. ``test_the_measurement_*`` feed it pages with known
faults, so a green run means the pages are clean, not that the measurement sees nothing.
The browser tests are skipped, with the reason, only where no Chromium binary exists; ``make
test`` installs Debian's where it runs as root (tests/ensure_chromium.sh, tested at the end of this
file with stand-ins for apt-get).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from browser_pages import CHROMIUM, PAGES, WIDTHS, make_pages, measure, measure_all

needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH (apt-get install chromium; "
                                                              "make test installs it where it runs as root)")

NAME_HEADERS = {"tensor", "module", "op", "kernel", "impl", "case"}
MIN_NAME_WIDTH = 90  # px: a name column narrower than ~12 monospace characters breaks every name


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    pages = make_pages(tmp_path_factory.mktemp("pages"))
    return pages, measure_all(pages)


@pytest.mark.browser
@needs_chromium
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("kind", list(PAGES))
def test_page_has_nothing_cut_off_and_no_overlapping_labels(rendered, kind, width):
    pages, results = rendered
    text = pages[kind].read_text(encoding="utf-8")
    assert not re.search(r"""(?:src|href|url)\s*[=(]\s*["']?(?:https?:)?//""", text), "an external reference"
    result = results[(kind, width)]
    assert result["errors"] == [] and result["resources"] == []
    assert result["overflows"] == [], f"{kind} at {width}px: content cut off or off the page"
    assert result["page_scroll_width"] <= result["width"]
    assert result["tables"] or kind == "error"
    for table in result["tables"]:
        assert table["fits"], f"{kind} at {width}px: {table}"
        for header, cell_width in table["head"]:
            if header.strip() in NAME_HEADERS:
                assert cell_width >= MIN_NAME_WIDTH, f"{kind} at {width}px: the {header} column is {cell_width}px"
    assert result["overlaps"] == [], f"{kind} at {width}px: labels overlap"
    assert result["clipped"] == [], f"{kind} at {width}px: labels cut off by their drawing"
    if kind != "error":  # every other page draws a chart: the label check had something to check
        assert result["labels"] >= 5


FAULTY = """<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"/><title>faults</title>
<style>body{margin:8px;font:14px sans-serif}td{white-space:nowrap;border:1px solid #999}
.narrow{width:400px}.scroll{overflow-x:auto;width:400px}.cut{width:120px;overflow:hidden;white-space:nowrap}
ul.legend{list-style:none;display:flex;padding:0}ul.legend li{width:120px}</style></head><body>
<div class="narrow"><table id="spills"><tr><td>FIRST</td><td>SPILLS</td></tr></table></div>
<div class="scroll"><table id="scrolls"><tr><td>FIRST</td><td>SCROLLS</td></tr></table></div>
<div class="cut">CUT</div>
<figure><svg width="400" height="100" viewBox="0 0 400 100"><text x="50" y="40">LABEL_A</text>
<text x="60" y="44">LABEL_B</text><text x="250" y="80">APART</text><text x="380" y="60">CLIPPED</text></svg>
<ul class="legend"><li>LEGEND_1</li><li>LEGEND_2</li></ul></figure>
</body></html>"""
WIDE = "x" * 60


def faulty_page(tmp_path, *, faults: bool):
    """A page with a table too wide for its box and no scroll box, a text cut off by its box, two
    overlapping SVG labels and an SVG label cut off by the SVG's edge, and two overlapping legend
    items; with ``faults=False`` the same page with each fault undone."""
    page = FAULTY
    if faults:
        page = (page.replace("SPILLS", "SPILLS " + WIDE).replace("SCROLLS", "SCROLLS " + WIDE)
                .replace(">CUT<", f">CUT {WIDE}<").replace("<li>LEGEND_2", '<li style="margin-left:-100px">LEGEND_2'))
    else:
        page = page.replace('x="60" y="44"', 'x="150" y="44"').replace('x="380"', 'x="300"')
    path = tmp_path / ("faulty.html" if faults else "clean.html")
    path.write_text(page, encoding="utf-8")
    return path


@pytest.mark.browser
@needs_chromium
def test_the_measurement_finds_a_table_off_its_box_and_overlapping_labels(tmp_path):
    result = measure(faulty_page(tmp_path, faults=True), 1024)
    assert result["errors"] == [] and result["resources"] == []
    tables = {table["element"]: table for table in result["tables"]}
    assert tables["table#spills"]["fits"] is False and tables["table#spills"]["scroll_box"] is False
    # The same width inside a box that scrolls sideways is how a wide table should be shown.
    assert tables["table#scrolls"]["fits"] is True and tables["table#scrolls"]["scroll_box"] is True
    cut = {entry["element"]: entry for entry in result["overflows"]}
    assert set(cut) == {"div.narrow", "div.cut"}, result["overflows"]
    assert cut["div.narrow"]["client"] == 400 and cut["div.narrow"]["scroll"] > 400
    assert cut["div.cut"]["client"] == 120 and cut["div.cut"]["scroll"] > 120
    pairs = {(o["a"], o["b"]) for o in result["overlaps"]}
    assert pairs == {("LABEL_A", "LABEL_B"), ("LEGEND_1", "LEGEND_2")}, result["overlaps"]
    assert [c["text"] for c in result["clipped"]] == ["CLIPPED"]
    assert result["labels"] == 6


@pytest.mark.browser
@needs_chromium
def test_the_measurement_finds_nothing_on_the_same_page_without_the_faults(tmp_path):
    result = measure(faulty_page(tmp_path, faults=False), 1024)
    assert result["overflows"] == [] and result["overlaps"] == [] and result["clipped"] == []
    assert all(table["fits"] for table in result["tables"]) and len(result["tables"]) == 2
    assert result["labels"] == 6


@pytest.mark.browser
@needs_chromium
def test_a_page_wider_than_the_window_is_found(tmp_path):
    page = tmp_path / "wide.html"
    page.write_text(f'<!DOCTYPE html><html><body><p style="white-space:nowrap">{"word " * 400}</p></body></html>',
                    encoding="utf-8")
    result = measure(page, 1024)
    assert result["page_scroll_width"] > result["width"]
    assert {entry["element"] for entry in result["overflows"]} == {"html", "p"}


# ---------------------------------------------------------------------------------------------
# make test's browser step (tests/ensure_chromium.sh), run with a PATH of stand-ins: which branch
# it takes, and what it asks apt-get for.

ENSURE = Path(__file__).resolve().parent / "ensure_chromium.sh"
TOOLS = ("mktemp", "grep", "tail", "rm")  # what the script runs besides id, apt-get and the browser


def ensure(tmp_path, *, uid: int, browser: str | None = None, apt: str | None = None):
    """Run the script with only stand-ins on PATH: ``id -u`` prints ``uid``; ``browser`` is put on
    PATH under that name; ``apt`` is apt-get's body (its calls are logged to apt.log)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool, path=f"{os.environ.get('PATH', '')}{os.pathsep}{os.defpath}")
        assert found, f"no {tool} on this machine"
        (bin_dir / tool).symlink_to(found)
    stand_ins = {"id": f"echo {uid}"}
    if browser:
        stand_ins[browser] = "exit 0"
    if apt is not None:
        stand_ins["apt-get"] = f'echo "$*" >> {tmp_path / "apt.log"}\n{apt}'
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    done = subprocess.run(["/bin/sh", str(ENSURE)], capture_output=True, text=True, timeout=30,
                          env={"PATH": str(bin_dir), "HOME": str(tmp_path)})
    log = tmp_path / "apt.log"
    return done, (log.read_text().splitlines() if log.exists() else [])


INSTALL = "install -y -qq --no-install-recommends chromium"


@pytest.mark.parametrize("browser", ["chromium", "chromium-browser", "google-chrome"])
def test_a_browser_on_path_needs_nothing(tmp_path, browser):
    done, apt = ensure(tmp_path, uid=0, browser=browser, apt="exit 0")
    assert (done.returncode, done.stdout, done.stderr, apt) == (0, "", "", [])


def test_as_root_with_apt_get_debians_chromium_is_installed_with_one_line(tmp_path):
    done, apt = ensure(tmp_path, uid=0, apt="exit 0")
    assert done.returncode == 0 and apt == [INSTALL]
    assert done.stdout.splitlines() == ["make: installing Debian's chromium for the browser layout tests "
                                        "(apt-get install chromium)"]


def test_a_machine_without_package_lists_is_updated_once_then_installs(tmp_path):
    # The first install fails (no lists on a clean machine); update, then install again succeeds.
    first = tmp_path / "first"
    done, apt = ensure(tmp_path, uid=0, apt=f'[ "$1" = install ] && [ ! -e {first} ] && : > {first} '
                                            f'&& echo "E: Unable to locate package chromium" && exit 100; exit 0')
    assert done.returncode == 0 and apt == [INSTALL, "update -qq", INSTALL]
    assert len(done.stdout.splitlines()) == 1


def test_an_install_that_fails_says_why_and_that_the_tests_will_be_skipped(tmp_path):
    done, apt = ensure(tmp_path, uid=0, apt='echo "E: Unable to locate package chromium"; exit 100')
    assert done.returncode == 0 and apt == [INSTALL, "update -qq"]
    assert done.stdout.splitlines()[-1] == ("make: apt-get could not install chromium (E: Unable to locate package "
                                            "chromium): the browser layout tests will be skipped")


def test_without_root_nothing_is_installed_and_one_line_says_so(tmp_path):
    done, apt = ensure(tmp_path, uid=1000, apt="exit 0")
    assert done.returncode == 0 and apt == []
    assert done.stdout.splitlines() == ["make: no chromium on PATH and not root, so no apt-get install: the browser "
                                        "layout tests (tests/test_report_html_browser.py) will be skipped"]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
def test_make_test_and_test_fast_run_the_browser_step_before_pytest():
    root = ENSURE.parent.parent
    for target in ("test", "test-fast"):
        lines = subprocess.run(["make", "-n", "-C", str(root), target], capture_output=True, text=True,
                               check=True).stdout.splitlines()
        step = lines.index("sh tests/ensure_chromium.sh")
        assert any("-m pytest" in line for line in lines[step + 1:]), lines
