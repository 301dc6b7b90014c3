"""The profiler's own chatter kept off the terminal: Kineto's ``USDT: ... profiler_start/stop`` lines.

PyTorch's Kineto writes a line to file descriptor 2 from C++ each time a profiler starts and
stops (``USDT:<date> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start``, measured
with torch 2.13 on a CPU), beside ``parity profile``'s and ``parity bench``'s own output. It does
not go through ``sys.stderr``, so it can only be filtered at the descriptor: for the profiler run
alone, descriptor 2 goes to a temporary file, and afterwards every line of it except those is
written back to the real stderr, in order (Python's own stderr lines written meanwhile too).
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator

CHATTER_PREFIXES = (b"USDT:",)  # Kineto's profiler_start / profiler_stop markers


def is_chatter(line: bytes) -> bool:
    return line.startswith(CHATTER_PREFIXES)


@contextlib.contextmanager
def profiler_chatter_filtered() -> Iterator[None]:
    """Around a profiler run: descriptor 2's lines, less the profiler's markers, come out when it ends."""
    # Descriptor 2 itself, where the C++ side writes, whatever object sys.stderr is now.
    stderr_fd = 2
    sys.stderr.flush()
    saved = os.dup(stderr_fd)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), stderr_fd)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, stderr_fd)
            os.close(saved)
            held.seek(0)
            kept = b"".join(line for line in held if not is_chatter(line))
            if kept:
                os.write(stderr_fd, kept)
