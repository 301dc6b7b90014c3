"""Progress on a terminal: counted progress as one bar redrawn in place, with the time left.

The library reports progress as plain lines (``compared 19 of 56 tensors (0 failing)``,
``isolate: replayed 8 of 30 layers``). Where standard error is a terminal, a line that counts
``N of M`` is drawn as a bar that replaces the previous one (``\\r``), with an estimate of the time
left from the rate so far (as ``tqdm`` does); any other line ends the bar first. Where it is not a
terminal (a CI log, a file, a pipe) every line is written as it comes, one write per line.
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import TextIO

from parity.base.text import write_line

__all__ = ["progress_writer", "TerminalBar"]

_COUNTED = re.compile(r"^(?P<what>.*?)(?P<done>\d+) of (?P<total>\d+)(?P<rest>.*)$")
WIDTH = 24


def _seconds(value: float) -> str:
    if value < 60:
        return f"{value:.0f} s"
    return f"{value // 60:.0f} min {value % 60:02.0f} s"


class TerminalBar:
    """Writes ``prefix: message`` lines to ``stream``, drawing counted ones as a bar in place.
    ``clock``: seconds (tests pass a stand-in)."""

    def __init__(self, stream: TextIO, prefix: str, clock: Callable[[], float] = time.monotonic):
        self.stream, self.prefix, self.clock = stream, prefix, clock
        self._open = False  # a bar is on the current line
        self._started: dict[str, tuple[float, int]] = {}  # the counted phrase -> (start time, first count)

    def __call__(self, message: str) -> None:
        counted = _COUNTED.match(message)
        if counted is None or int(counted["total"]) <= 0:
            self._end()
            write_line(self.stream, f"{self.prefix}{message}")
            return
        done, total = int(counted["done"]), int(counted["total"])
        key = f"{counted['what']}|{total}"
        now = self.clock()
        start, first = self._started.setdefault(key, (now, done))
        filled = min(WIDTH, round(WIDTH * done / total))
        left = ""
        if done > first and now > start:
            rate = (done - first) / (now - start)
            left = f", about {_seconds((total - done) / rate)} left" if done < total else ""
        bar = (f"\r{self.prefix}{counted['what']}[{'#' * filled}{'-' * (WIDTH - filled)}] {done}/{total}"
               f"{counted['rest']}{left}\x1b[K")
        self.stream.write(bar)
        self.stream.flush()
        self._open = True
        if done >= total:
            self._end()

    def _end(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


def progress_writer(stream: TextIO, prefix: str) -> Callable[[str], None]:
    """``prefix: message`` lines on ``stream``: a :class:`TerminalBar` where it is a terminal,
    else one plain line per message."""
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return TerminalBar(stream, prefix)
    return lambda message: write_line(stream, f"{prefix}{message}")
