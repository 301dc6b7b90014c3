"""The HTML pages (compare, diff, profile, bench) in a real browser: headless Chromium renders each
at 1024 and 1400 pixels; the page must not scroll sideways, every table must fit the window, the
name columns must stay readable, and the page must log no error and load nothing.

The measurement runs in a copy of each page: a script at the start records errors (and any
resource the Content-Security-Policy of the copy blocks), a script at the end writes the widths
into the DOM, which ``--dump-dom`` returns. The pages themselves hold no such script.
Screenshots are written too (to ``PARITY_SCREENSHOTS`` when set, to look at them).
"""
from __future__ import annotations

import html
import json
import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from parity.cli.main import main

import speed_subjects
from speed_subjects import MATMUL_SPEC

CHROMIUM = next((found for name in ("chromium", "chromium-browser", "google-chrome", "chrome")
                 if (found := shutil.which(name))), None)
pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH (apt-get install chromium)")]

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--host-resolver-rules=MAP * ~NOTFOUND",
         "--virtual-time-budget=2000"]  # scrollbars shown: a window of 1024 has 1009 px for the page
HEAD = ("<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
        "script-src 'unsafe-inline'; img-src data:\">"
        "<script>window.__errors=[];window.addEventListener('error',function(e){window.__errors.push('error:'+e.message)});"
        "document.addEventListener('securitypolicyviolation',function(e){window.__errors.push('blocked:'+e.blockedURI)});"
        "var ce=console.error;console.error=function(){window.__errors.push('console:'+Array.prototype.join.call("
        "arguments,' '));ce.apply(console,arguments)};</script>")
TAIL = ("<script>(function(){var r={scroll:document.documentElement.scrollWidth,"
        "client:document.documentElement.clientWidth,tables:[]};"
        "document.querySelectorAll('table').forEach(function(t){var box=t.getBoundingClientRect();"
        "var head=t.tHead?Array.prototype.map.call(t.tHead.rows[0].cells,function(c){"
        "return [c.textContent,Math.round(c.getBoundingClientRect().width)]}):[];"
        "r.tables.push({cls:t.className,right:Math.round(box.right),head:head})});"
        "r.resources=performance.getEntriesByType('resource').map(function(e){return e.name});"
        "r.errors=window.__errors;var pre=document.createElement('pre');pre.id='parity-measure';"
        "pre.style.whiteSpace='pre-wrap';pre.style.wordBreak='break-all';"  # no overflow of its own in the screenshot
        "pre.textContent=JSON.stringify(r);document.body.appendChild(pre)})();</script>")
NAME_HEADERS = {"tensor", "module", "op", "kernel", "impl", "case"}


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """One page of each kind, failures included (a faulty impl, a wrong impl)."""
    import fault_models
    from parity.run.capture import capture

    gen = speed_subjects.one_thread()
    next(gen)
    root = tmp_path_factory.mktemp("pages")
    spec, args = fault_models.SPEC, {"model": "res", "dtype": "bf16"}
    capture(spec, root / "golden", subject_args=args, impl="reference", record_inputs=True)
    capture(spec, root / "faulty", subject_args=args, impl="scale1.01-block3")
    made = {name: root / f"{name}.html" for name in ("compare", "diff", "profile", "bench", "profile-against",
                                                      "error")}
    assert main(["compare", "--quiet", "--bundle", str(root / "golden"), "--subject", spec, "--impl",
                 "scale1.01-block3", "--isolate", "--device", "cpu", "--html", str(made["compare"])]) == 1
    assert main(["diff", "--quiet", str(root / "golden"), str(root / "faulty"), "--html", str(made["diff"])]) == 1
    assert main(["profile", "--quiet", "--subject", MATMUL_SPEC, "--skip", "0", "--warmup", "1", "--active", "2",
                 "--html", str(made["profile"])]) == 0
    assert main(["bench", "--quiet", "--subject", MATMUL_SPEC, "--impls", "reference,fast,wrong", "--reps", "4",
                 "--warmup", "1", "--html", str(made["bench"])]) == 1
    # Side by side (the widest profile table: per step and per call), and a refused run's error page.
    assert main(["profile", "--quiet", "--subject", MATMUL_SPEC, "--impl", "fast", "--skip", "0", "--warmup", "1",
                 "--active", "2", "--json", str(root / "fast.json")]) == 0
    assert main(["profile", "--quiet", "--subject", MATMUL_SPEC, "--skip", "0", "--warmup", "1", "--active", "3",
                 "--against", str(root / "fast.json"), "--html", str(made["profile-against"])]) == 0
    assert main(["compare", "--quiet", "--bundle", str(root / "no-such-bundle"), "--html", str(made["error"])]) == 2
    gen.close()
    return made


def measure(page: Path, width: int, shot: Path) -> dict:
    """Render a measuring copy of ``page`` at ``width`` x 900: the measurements, and a screenshot."""
    text = page.read_text(encoding="utf-8")
    copy = page.with_name(f"{page.stem}-measure-{width}.html")
    copy.write_text(text.replace("<head>", "<head>" + HEAD, 1).replace("</body>", TAIL + "</body>", 1), encoding="utf-8")
    done = subprocess.run([CHROMIUM, *FLAGS, f"--window-size={width},900", "--dump-dom", f"--screenshot={shot}",
                           copy.as_uri()], capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="parity-measure"[^>]*>(.*?)</pre>', done.stdout, re.S)
    assert found, f"chromium rendered no measurement of {page.name}: {done.stderr[-500:]}"
    return json.loads(html.unescape(found.group(1)))


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("kind", ["compare", "diff", "profile", "bench", "profile-against", "error"])
def test_page_fits_1024_and_1400_pixels(pages, kind, tmp_path):
    page = pages[kind]
    text = page.read_text(encoding="utf-8")
    assert not re.search(r"""(?:src|href|url)\s*[=(]\s*["']?(?:https?:)?//""", text), "an external reference"
    shots = Path(os.environ.get("PARITY_SCREENSHOTS", tmp_path))
    for width in (1024, 1400):
        shot = shots / f"{kind}-{width}.png"
        result = measure(page, width, shot)
        assert result["errors"] == [] and result["resources"] == []
        assert result["scroll"] <= result["client"], f"{kind} at {width}px scrolls sideways: {result['scroll']}px"
        for table in result["tables"]:
            assert table["right"] <= result["client"], f"{kind} at {width}px: table {table['cls']} ends at {table['right']}"
            for header, cell_width in table["head"]:
                if header.strip() in NAME_HEADERS:
                    assert cell_width >= 90, f"{kind} at {width}px: the {header} column is {cell_width}px wide"
        assert png_size(shot) == (width, 900)
