#!/bin/sh
# The browser that tests/test_report_html_browser.py renders the HTML reports in, for `make test`:
# nothing when one is on PATH; Debian's chromium where this runs as root with apt-get (a clean CI
# machine); else one line saying the browser tests will be skipped, and why. Never fails the run:
# without a browser those tests skip with the same reason.
for name in chromium chromium-browser google-chrome chrome; do
    command -v "$name" >/dev/null 2>&1 && exit 0
done
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "make: installing Debian's chromium for the browser layout tests (apt-get install chromium)"
    log=$(mktemp)
    # A clean machine may have no package lists yet: update once, only where the install needs it.
    if DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >"$log" 2>&1 ||
       { apt-get update -qq >>"$log" 2>&1 &&
         DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >>"$log" 2>&1; }; then
        rm -f "$log"
        exit 0
    fi
    echo "make: apt-get could not install chromium ($(grep -E '^(E|W):' "$log" | tail -n 1)): the browser layout tests will be skipped"
    rm -f "$log"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then why="not root, so no apt-get install"; else why="no apt-get here"; fi
echo "make: no chromium on PATH and $why: the browser layout tests (tests/test_report_html_browser.py) will be skipped"
