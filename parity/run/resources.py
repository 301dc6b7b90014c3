"""What a capture or compare run cost: wall time, tensors and bytes per second, peak host and GPU memory.

Measured, not estimated:

- host peak: the process's peak resident set, ``VmHWM`` of ``/proc/self/status`` (Linux). It is
  the peak since the process started, so a library call in a long-lived process reports at least
  what the process held before; the CLI runs one command per process, where it is that command's.
  ``getrusage``'s ``ru_maxrss`` is not used: it is carried across ``fork`` and ``exec``, so a child
  of a large process would report its parent's size. None where there is no ``/proc``.
- GPU peak: ``torch.cuda.max_memory_allocated`` of the run's device (the caching allocator's
  tensors, not its reserved pool), reset when the meter starts: the peak of this run alone. None
  when the run did not use a CUDA (or ROCm) device.

:func:`summary` makes the JSON object (the manifest's ``capture.resources``, the compare report's
``resources``) from the counts; :func:`summary_line` says it in one line.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from parity.base.text import plural

_STATUS = "/proc/self/status"


def peak_host_bytes() -> int | None:
    """This process's peak resident set (VmHWM) in bytes; None where /proc is not there."""
    try:
        with open(_STATUS) as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _gpu(device: torch.device | str | None) -> torch.device | None:
    if device is None:
        return None
    device = torch.device(device)
    return device if device.type == "cuda" and torch.cuda.is_available() else None


class Meter:
    """Started when a run begins: ``elapsed()`` seconds since, and the GPU's peak since (reset here).
    ``started``: the run's own ``time.monotonic()`` start, where it began before its device was known."""

    def __init__(self, device: torch.device | str | None = None, started: float | None = None):
        self.device = _gpu(device)
        if self.device is not None:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.started = time.monotonic() if started is None else started

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def peak_gpu_bytes(self) -> int | None:
        return None if self.device is None else int(torch.cuda.max_memory_allocated(self.device))

    def summary(self, *, tensors: int, nbytes: int, direction: str,
                weights: dict[str, Any] | None = None, phases: Phases | None = None) -> dict[str, Any]:
        """:func:`summary` of this run so far."""
        return summary(tensors=tensors, nbytes=nbytes, seconds=self.elapsed(), direction=direction,
                       peak_host=peak_host_bytes(), peak_gpu=self.peak_gpu_bytes(), weights=weights,
                       phases=None if phases is None else phases.seconds())


class Phases:
    """Seconds spent in each named phase of a run (``with phases("build"): ...``), in the order
    the phases were first recorded; a phase entered again adds to its time. Phases run on other threads at
    the same time as these (the checkpoint's digests at capture) are added with :meth:`add`, so
    the sum of all phases can exceed the wall time: it says where time went, not a partition of it."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.add(name, time.monotonic() - started)

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def seconds(self) -> dict[str, float]:
        """name -> seconds, rounded to the millisecond (what the JSON records)."""
        with self._lock:
            return {name: round(value, 3) for name, value in self._seconds.items()}


def weights_stage(*, seconds: float, nbytes: int, checkpoint_bytes: int, checkpoint_seconds: float) -> dict[str, Any]:
    """What loading the model's weights cost in a compare: ``bytes`` of state read into the module
    (from the bundle or the checkpoint files it names) in ``seconds`` (the first read to the last
    tensor loaded, copies into the module included), and ``checkpoint_bytes`` of checkpoint files
    whose digest was verified first, in ``checkpoint_seconds``."""
    return {"seconds": round(seconds, 3), "bytes": nbytes,
            "gb_per_second": round(nbytes / 1e9 / seconds, 3) if seconds > 0 else None,
            "checkpoint_bytes_verified": checkpoint_bytes, "checkpoint_verify_seconds": round(checkpoint_seconds, 3)}


def summary(*, tensors: int, nbytes: int, seconds: float, direction: str, peak_host: int | None,
            peak_gpu: int | None, weights: dict[str, Any] | None = None,
            phases: dict[str, float] | None = None) -> dict[str, Any]:
    """The JSON object of a run's cost. ``direction``: ``"written"`` (capture: bytes of shards
    written) or ``"read"`` (compare: bytes of the bundle's tensors read and checksummed).
    ``weights``: :func:`weights_stage` of a compare (its ``bytes`` from the bundle are counted in
    ``bytes_read`` too; a checkpoint's are not, being no part of the bundle). ``phases``: seconds
    per named phase (:class:`Phases`), where the run timed them."""
    rate = (lambda count: round(count / seconds, 3)) if seconds > 0 else (lambda count: None)
    info = {"seconds": round(seconds, 3), "tensors": tensors, f"bytes_{direction}": nbytes,
            "tensors_per_second": rate(tensors), "gb_per_second": rate(nbytes / 1e9),
            "peak_host_bytes": peak_host, "peak_gpu_bytes": peak_gpu}
    if weights is not None:
        info["weights"] = weights
    if phases is not None:
        info["phases"] = phases
    return info


def _gib(nbytes: int | None) -> str:
    return "not measured" if nbytes is None else f"{nbytes / 2**30:.2f} GiB"


def summary_line(info: dict[str, Any]) -> str:
    """One line for people: ``97 tensors, 1.75 GB written in 22.1 s (4.4 tensors/s, 0.08 GB/s);
    peak memory: host 1.02 GiB (VmHWM), GPU not used``."""
    direction = "written" if "bytes_written" in info else "read"
    nbytes = info[f"bytes_{direction}"]
    rates = ("" if info["tensors_per_second"] is None
             else f" ({info['tensors_per_second']:.1f} tensors/s, {info['gb_per_second']:.2f} GB/s)")
    gpu = "not used" if info["peak_gpu_bytes"] is None else _gib(info["peak_gpu_bytes"])
    weights = info.get("weights")
    loaded = ""
    if weights is not None and weights["bytes"]:
        speed = "" if weights["gb_per_second"] is None else f", {weights['gb_per_second']:.2f} GB/s"
        checked = (f" after {weights['checkpoint_bytes_verified'] / 1e9:.3g} GB of checkpoint files verified in "
                   f"{weights['checkpoint_verify_seconds']:.1f} s" if weights["checkpoint_bytes_verified"] else "")
        loaded = f"; weights: {weights['bytes'] / 1e9:.3g} GB loaded in {weights['seconds']:.1f} s{speed}{checked}"
    return (f"{plural(info['tensors'], 'tensor')}, {nbytes / 1e9:.3g} GB {direction} in {info['seconds']:.1f} s{rates}"
            f"{loaded}; peak memory: host {_gib(info['peak_host_bytes'])} (VmHWM), GPU {gpu}")
