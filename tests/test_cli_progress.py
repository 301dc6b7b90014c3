"""Progress on a terminal: a counted line (``N of M``) is a bar redrawn in place with the time
left; anything else, and everything where standard error is not a terminal, is a plain line."""
from __future__ import annotations

import io

from parity.cli.progress import TerminalBar, progress_writer


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_counted_progress_is_one_bar_redrawn_in_place_with_the_time_left():
    stream, now = _Terminal(), [100.0]
    bar = TerminalBar(stream, "parity compare: ", clock=lambda: now[0])
    bar("run impl triton on cpu")
    bar("compared 0 of 40 tensors (0 failing)")
    now[0] = 110.0
    bar("compared 10 of 40 tensors (0 failing)")  # 10 in 10 s: 30 left at 1 per second
    now[0] = 120.0
    bar("compared 20 of 40 tensors (1 failing)")
    bar("isolate: replaying")  # another line ends the bar first
    text = stream.getvalue()
    lines = text.split("\n")
    assert lines[0] == "parity compare: run impl triton on cpu"
    frames = lines[1].split("\r")[1:]
    assert frames[0].startswith("parity compare: compared [" + "-" * 24 + "] 0/40 tensors (0 failing)")
    assert "[######------------------] 10/40 tensors (0 failing), about 30 s left" in frames[1]
    assert "[############------------] 20/40 tensors (1 failing), about 20 s left" in frames[2]
    assert lines[2] == "parity compare: isolate: replaying"


def test_a_bar_that_reaches_its_total_ends_its_line():
    stream = _Terminal()
    bar = TerminalBar(stream, "p: ", clock=lambda: 0.0)
    bar("isolate: replayed 3 of 3 layers")
    bar("done")
    assert stream.getvalue().endswith("3/3 layers\x1b[K\np: done\n")


def test_not_a_terminal_keeps_plain_lines_for_ci_logs():
    stream = io.StringIO()
    say = progress_writer(stream, "parity compare: ")
    say("compared 10 of 40 tensors (0 failing)")
    say("done")
    assert stream.getvalue() == "parity compare: compared 10 of 40 tensors (0 failing)\nparity compare: done\n"
    assert isinstance(progress_writer(_Terminal(), "x: "), TerminalBar)
