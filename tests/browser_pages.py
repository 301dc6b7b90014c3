"""Every HTML page parity writes, made on small CPU subjects and rendered in headless Chromium:
measured (for tests/test_report_html_browser.py) or photographed (the screenshots in docs/).

Chromium is driven by its own command line (``--headless --dump-dom`` / ``--screenshot``), one
start per page and width, so no Python driver is needed. A measured page is a copy with two
scripts added: one at the start of ``<head>`` records errors and anything the copy's
Content-Security-Policy blocks (the pages must load nothing), and tests/browser_measure.js at the
end of ``<body>`` writes its measurements into the DOM, which ``--dump-dom`` returns.

    python tests/browser_pages.py --screenshots docs/screenshots   # the docs' PNGs, 1024 px wide
"""
from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# The names Debian, Ubuntu and Google give the binary; tests/ensure_chromium.sh looks for the same.
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")
CHROMIUM = next((found for name in BROWSERS if (found := shutil.which(name))), None)
WIDTHS = (1024, 1400)
HEIGHT = 900  # measurements do not depend on the height; the vertical scrollbar takes 15 px of width
SHOT_WIDTH, SHOT_HEIGHT = 1024, 1600
# Pages, in the order the docs show them: (file stem, what it is).
PAGES = {
    "compare-fail": "parity compare --isolate, a port that fails (a 1% error in one block)",
    "compare-pass": "parity compare --isolate, a port that holds",
    "diff": "parity diff of two bundles",
    "profile": "parity profile",
    "profile-against": "parity profile --against a saved profile (side by side)",
    "bench": "parity bench of three implementations, one of them wrong",
    "error": "a refused run's page (compare of a bundle that does not exist)",
}

# The docs' screenshots: (PNG stem, page, the one part of the page shown ("": all of it), height).
SHOTS = [(name, name, "", SHOT_HEIGHT) for name in PAGES if name != "error"] + [
    ("compare-fail-table", "compare-fail", "#table", 700),  # the wide table in its sideways-scrolling box
    ("error", "error", "", 300),
]

_HEAD = ("<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
         "script-src 'unsafe-inline'; img-src data:\">"
         "<script>window.__parityErrors=[];"
         "window.addEventListener('error',function(e){window.__parityErrors.push('error:'+e.message)});"
         "document.addEventListener('securitypolicyviolation',function(e){"
         "window.__parityErrors.push('blocked:'+e.blockedURI)});"
         "var ce=console.error;console.error=function(){window.__parityErrors.push('console:'+"
         "Array.prototype.join.call(arguments,' '));ce.apply(console,arguments)};</script>")
_RESULT = re.compile(r'<pre id="parity-measure"[^>]*>(.*?)</pre>', re.S)


class BrowserError(RuntimeError):
    """Chromium ran but gave no measurement (it crashed, or the page never finished loading)."""


def chromium_command(user_dir: Path, width: int, height: int) -> list[str]:
    """Chromium headless, offline (every host name resolves nowhere) and without its background
    services; ``--virtual-time-budget`` lets the page's scripts run before the DOM is dumped."""
    assert CHROMIUM is not None
    return [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run",
            "--host-resolver-rules=MAP * ~NOTFOUND", f"--user-data-dir={user_dir}",
            f"--window-size={width},{height}", "--virtual-time-budget=2000"]


def make_pages(root: Path) -> dict[str, Path]:
    """Each page of :data:`PAGES` under ``root``, written by the CLI as a user would: a fault-injected
    residual model (bf16) for compare and diff, the matmul subject of the bench tests for profile
    and bench (timed on their virtual clock, so the bench page is the same on any machine). Asserts each command's exit status, so a page is never of the wrong run."""
    sys.path.insert(0, str(HERE))
    import fault_models
    import speed_subjects
    from speed_subjects import MATMUL_SPEC
    from parity.cli.main import main
    from parity.run.capture import capture

    threads = speed_subjects.one_thread()
    next(threads)
    try:
        root.mkdir(parents=True, exist_ok=True)
        spec, args = fault_models.SPEC, {"model": "res", "dtype": "bf16"}
        capture(spec, root / "golden", subject_args=args, impl="reference", record_inputs=True)
        capture(spec, root / "faulty", subject_args=args, impl="scale1.01-block3")
        made = {name: root / f"{name}.html" for name in PAGES}
        compare = ["compare", "--quiet", "--bundle", str(root / "golden"), "--subject", spec, "--isolate",
                   "--device", "cpu"]
        runs = [
            (1, [*compare, "--impl", "scale1.01-block3", "--html", str(made["compare-fail"])]),
            (0, [*compare, "--impl", "reference", "--html", str(made["compare-pass"])]),
            (1, ["diff", "--quiet", str(root / "golden"), str(root / "faulty"), "--html", str(made["diff"])]),
            (0, ["profile", "--quiet", "--subject", MATMUL_SPEC, "--skip", "0", "--warmup", "1", "--active", "2",
                 "--html", str(made["profile"])]),
            (1, ["bench", "--quiet", "--subject", MATMUL_SPEC, "--impls", "reference,fast,wrong", "--reps", "4",
                 "--warmup", "1", "--html", str(made["bench"])]),
            (0, ["profile", "--quiet", "--subject", MATMUL_SPEC, "--impl", "fast", "--skip", "0", "--warmup", "1",
                 "--active", "2", "--json", str(root / "fast.json")]),
            (0, ["profile", "--quiet", "--subject", MATMUL_SPEC, "--skip", "0", "--warmup", "1", "--active", "3",
                 "--against", str(root / "fast.json"), "--html", str(made["profile-against"])]),
            # A CI workspace's path: one long word, which the page must wrap, not run off the window.
            (2, ["compare", "--quiet", "--bundle", str(root / ("no-such-bundle-" + "0123456789abcdef" * 8)),
                 "--impl", "reference", "--html", str(made["error"])]),
        ]
        for status, argv in runs:
            with pytest.MonkeyPatch.context() as patch:
                if argv[0] == "bench":  # the bench tests' virtual clock: the same timings on a loaded machine
                    clock = speed_subjects.virtual_clock(patch)
                    next(clock)
                got = main(argv)
            assert got == status, f"parity {' '.join(argv)} exited {got}, not {status}"
    finally:
        threads.close()
    return made


def measure(page: Path, width: int) -> dict:
    """Render a measuring copy of ``page`` at ``width`` px: tests/browser_measure.js's result."""
    text = page.read_text(encoding="utf-8")
    script = (HERE / "browser_measure.js").read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory(prefix="parity-browser-") as scratch:
        copy = Path(scratch) / page.name
        copy.write_text(text.replace("<head>", "<head>" + _HEAD, 1)
                        .replace("</body>", f"<script>{script}</script></body>", 1), encoding="utf-8")
        done = subprocess.run([*chromium_command(Path(scratch) / "profile", width, HEIGHT), "--dump-dom",
                               copy.as_uri()], capture_output=True, text=True, timeout=120)
    found = _RESULT.search(done.stdout)
    if not found:
        raise BrowserError(f"chromium rendered no measurement of {page.name} at {width}px "
                           f"(exit {done.returncode}): {done.stderr.strip()[-400:]}")
    return json.loads(html.unescape(found.group(1)))


def measure_all(pages: dict[str, Path], widths=WIDTHS, workers: int = 2) -> dict[tuple[str, int], dict]:
    """:func:`measure` of every page at every width, ``workers`` Chromiums at a time."""
    jobs = [(name, width) for name in pages for width in widths]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = pool.map(lambda job: measure(pages[job[0]], job[1]), jobs)
        return dict(zip(jobs, results))


def screenshot(page: Path, target: Path, width: int = SHOT_WIDTH, height: int = SHOT_HEIGHT, only: str = "") -> Path:
    """A PNG of the first ``height`` px of ``page`` at ``width`` px; with ``only`` (the id of one of
    the body's sections, ``#table``) of a copy in which the body shows that section alone."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="parity-browser-") as scratch:
        shown = page.resolve()
        if only:
            shown = Path(scratch) / page.name
            shown.write_text(page.read_text(encoding="utf-8").replace(
                "</head>", f"<style>body>:not({only}){{display:none}}</style></head>", 1), encoding="utf-8")
        done = subprocess.run([*chromium_command(Path(scratch) / "profile", width, height),
                               f"--screenshot={target.resolve()}", shown.as_uri()],
                              capture_output=True, text=True, timeout=120)
    if not target.is_file():
        raise BrowserError(f"chromium wrote no screenshot of {page.name} (exit {done.returncode}): "
                           f"{done.stderr.strip()[-400:]}")
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--screenshots", metavar="DIR", required=True,
                        help=f"write <page>.png of every page, {SHOT_WIDTH} px wide, into DIR")
    args = parser.parse_args(argv)
    if CHROMIUM is None:
        print(f"browser_pages: error: no browser on PATH (looked for {', '.join(BROWSERS)})", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="parity-pages-") as scratch:
        with open(os.devnull, "w") as quiet, redirect_stdout(quiet), redirect_stderr(quiet):  # the runs' reports
            pages = make_pages(Path(scratch))
        for stem, name, only, height in SHOTS:
            shot = screenshot(pages[name], Path(args.screenshots) / f"{stem}.png", height=height, only=only)
            print(f"{shot}: {PAGES[name]}{', ' + only + ' alone' if only else ''} ({shot.stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
