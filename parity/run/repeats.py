"""Determinism of one implementation on one host: N runs on the same inputs, judged bitwise per tensor.

The first run (the judged run of ``compare``, the recorded run of ``capture``) is the baseline:
:meth:`RepeatTracker.baseline` keeps each tensor's BLAKE3 digest (the bundle's own checksum,
:mod:`parity.bundle.checksums`) and a CPU copy, in execution order. Each later run hands its
tensors to :meth:`RepeatTracker.observe`: a tensor whose bytes hash the same is bitwise equal; one
that does not gets its spread, ``max |run_i - run_0|`` over every element and every run, computed
in float64 (a NaN on one side only, or an Inf that moved, is an infinite spread; NaN against NaN is
no spread: its payload bits may differ, its value does not).

Why bitwise: the same kernel, inputs, launch config and host must give the same bits unless the
kernel races or reduces in an order that varies run to run (float atomics: split-K, a backward's
dK/dV, scatter-add). Cross-vendor results never match bitwise (parity/NUMERICS.md), same-host
repeats should, so any difference here is the implementation's own, not the port's arithmetic.

Verdict. Nondeterminism fails the run by default: a user porting to AMD wants to know, and an
unintended race looks exactly like this. Atomics-based reductions are legitimately
nondeterministic; the tensors they produce are named with ``allowed`` globs (``compare
--allow-nondeterministic GLOB``), which keep their row and spread but do not fail.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from parity.base.errors import UsageError
from parity.bundle import checksums

DIGEST = checksums.BLAKE3


def check_runs(value: Any, flag: str = "--repeat") -> int:
    """``value`` as a number of runs (an int >= 1); anything else is a one-line UsageError."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.strip().lstrip("+").isdigit():
            value = int(value)
        else:
            raise UsageError(f"{flag} must be a whole number of runs >= 1, got {value!r}")
    if value < 1:
        raise UsageError(f"{flag} must be a whole number of runs >= 1, got {value}")
    return value


def json_safe_float(value: float | None) -> float | str | None:
    """A spread as JSON carries it: an infinite one is ``"inf"`` (the JSON reports' convention)."""
    if value is None:
        return None
    return "inf" if math.isinf(value) else float(value)


def spread(run: torch.Tensor, base: torch.Tensor) -> float:
    """``max |run - base|`` in float64; a NaN or Inf that is not in the same place on both sides
    is ``inf`` (the runs disagree on a non-finite value), NaN against NaN is 0."""
    if run.shape != base.shape:
        return math.inf
    if run.numel() == 0:
        return 0.0
    a = run.detach().to("cpu", torch.float64)
    b = base.detach().to("cpu", torch.float64)
    both_nan = a.isnan() & b.isnan()
    same_inf = a.isinf() & (a == b)
    diff = (a - b).abs()
    diff = torch.where(both_nan | same_inf, torch.zeros_like(diff), diff)
    diff = torch.where(diff.isnan(), torch.full_like(diff, math.inf), diff)
    return float(diff.max())


@dataclasses.dataclass(frozen=True)
class RepeatResult:
    """One tensor over ``runs`` runs: ``bitwise_equal`` in every run, else how many later runs
    differed from the first and the largest ``max |run_i - run_0|`` (``spread``). ``note``: a
    run that did not produce the tensor, or produced another shape or dtype. ``allowed``: named
    by an allow glob (reported, not a failure)."""

    name: str
    runs: int
    bitwise_equal: bool
    differing_runs: int = 0
    spread: float | None = None
    allowed: bool = False
    note: str | None = None

    @property
    def passed(self) -> bool:
        return self.bitwise_equal or self.allowed

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "runs": self.runs, "bitwise_equal": self.bitwise_equal,
                "differing_runs": self.differing_runs, "spread": json_safe_float(self.spread),
                "allowed": self.allowed, "note": self.note}


@dataclasses.dataclass(frozen=True)
class DeterminismReport:
    """Every tensor of N runs, in the first run's execution order."""

    runs: int
    tensors: tuple[RepeatResult, ...]
    allowed_globs: tuple[str, ...] = ()

    @property
    def nondeterministic(self) -> list[RepeatResult]:
        return [result for result in self.tensors if not result.bitwise_equal]

    @property
    def bitwise_equal(self) -> bool:
        return not self.nondeterministic

    @property
    def first_nondeterministic(self) -> str | None:
        """The first tensor, in execution order, that is not bitwise equal in every run."""
        return next((result.name for result in self.tensors if not result.bitwise_equal), None)

    @property
    def failing(self) -> list[RepeatResult]:
        return [result for result in self.tensors if not result.passed]

    @property
    def passed(self) -> bool:
        return not self.failing

    @property
    def max_spread(self) -> float | None:
        spreads = [result.spread for result in self.nondeterministic if result.spread is not None]
        return max(spreads) if spreads else None

    def summary(self) -> str:
        """One line: ``determinism: 3 runs, 12 tensors bitwise equal`` or what differed."""
        total = len(self.tensors)
        if self.bitwise_equal:
            return f"determinism: {self.runs} runs, all {total} tensors bitwise equal"
        bad = self.nondeterministic
        allowed = sum(result.allowed for result in bad)
        spread_text = "inf" if self.max_spread == math.inf else f"{self.max_spread:.3g}" if self.max_spread is not None else "-"
        return (f"determinism: {self.runs} runs, {len(bad)} of {total} tensors not bitwise equal"
                + (f" ({allowed} allowed by --allow-nondeterministic)" if allowed else "")
                + f"; first in execution order: {self.first_nondeterministic}; largest spread {spread_text}")

    def to_dict(self) -> dict[str, Any]:
        return {"runs": self.runs, "bitwise_equal": self.bitwise_equal, "passed": self.passed,
                "first_nondeterministic": self.first_nondeterministic,
                "nondeterministic": [result.name for result in self.nondeterministic],
                "max_spread": json_safe_float(self.max_spread), "allowed_globs": list(self.allowed_globs),
                "tensors": [result.to_dict() for result in self.tensors]}


class RepeatTracker:
    """Collects the baseline run and the later runs of one implementation (module docstring)."""

    def __init__(self, runs: int, allowed: Sequence[str] = ()):
        self.runs = runs
        self.allowed = tuple(allowed)
        self._digest: dict[str, str] = {}
        self._copy: dict[str, torch.Tensor] = {}
        self._order: list[str] = []
        self._differing: dict[str, int] = {}
        self._spread: dict[str, float] = {}
        self._notes: dict[str, str] = {}
        self._seen: set[str] = set()
        self._run = 0
        self._done = False

    def baseline(self, name: str, tensor: torch.Tensor) -> None:
        """A tensor of the first run (copied to the CPU: the module may reuse its memory)."""
        copy = tensor.detach().to("cpu", copy=True)
        self._order.append(name)
        self._digest[name] = checksums.of_tensor(DIGEST, copy)
        self._copy[name] = copy

    def start_run(self) -> None:
        """Call before each later run."""
        self._finish_run()
        self._run += 1
        self._seen = set()

    def observe(self, name: str, tensor: torch.Tensor) -> None:
        """A tensor of a later run."""
        self._seen.add(name)
        base = self._copy.get(name)
        if base is None:
            if name not in self._order:
                self._order.append(name)
            self._mark(name, math.inf, "produced in a later run but not in the first")
            return
        if tensor.dtype != base.dtype or tensor.shape != base.shape:
            self._mark(name, math.inf, f"run {self._run + 1} gave {tensor.dtype}{list(tensor.shape)}, the first "
                                       f"{base.dtype}{list(base.shape)}")
            return
        if checksums.of_tensor(DIGEST, tensor) != self._digest[name]:
            self._mark(name, spread(tensor, base))

    def _mark(self, name: str, value: float, note: str | None = None) -> None:
        self._differing[name] = self._differing.get(name, 0) + 1
        self._spread[name] = max(self._spread.get(name, 0.0), value)
        if note is not None:
            self._notes.setdefault(name, note)

    def _finish_run(self) -> None:
        if self._run == 0:
            return
        for name in self._order:
            if name not in self._seen and name in self._copy:
                self._mark(name, math.inf, f"run {self._run + 1} did not produce it")

    def report(self) -> DeterminismReport:
        if not self._done:
            self._finish_run()
            self._done = True
        results = tuple(
            RepeatResult(name=name, runs=self.runs, bitwise_equal=name not in self._differing,
                         differing_runs=self._differing.get(name, 0), spread=self._spread.get(name),
                         allowed=name in self._differing and matches(name, self.allowed),
                         note=self._notes.get(name))
            for name in self._order)
        return DeterminismReport(runs=self.runs, tensors=results, allowed_globs=self.allowed)


def matches(name: str, globs: Iterable[str]) -> bool:
    """Whether a tensor name, or its layer (the name up to the first ``/``), matches a glob."""
    layer = name.split("/", 1)[0]
    return any(fnmatch.fnmatchcase(name, glob) or fnmatch.fnmatchcase(layer, glob) for glob in globs)


def capture_record(report: DeterminismReport) -> dict[str, Any]:
    """What a bundle's manifest records of ``capture --repeat N`` (``capture.repeat``): whether the
    capture was repeated bitwise, and where it was not."""
    return {"runs": report.runs, "bitwise_equal": report.bitwise_equal,
            "first_nondeterministic": report.first_nondeterministic,
            "nondeterministic": [result.name for result in report.nondeterministic],
            "max_spread": json_safe_float(report.max_spread)}


def capture_repeat_warning(capture_info: Any) -> list[str]:
    """A warning for a golden whose capture was repeated and was not bitwise equal: its goldens are
    one draw of a nondeterministic implementation, so this host cannot match them bitwise either."""
    repeat = (capture_info or {}).get("repeat") if isinstance(capture_info, dict) else None
    if not isinstance(repeat, dict) or repeat.get("bitwise_equal") is not False:
        return []
    names = repeat.get("nondeterministic") or []
    return [f"the golden's capture was not bitwise repeatable over {repeat.get('runs')} runs: "
            f"{len(names)} tensor(s) differ run to run, first {repeat.get('first_nondeterministic')} "
            f"(largest spread {repeat.get('max_spread')})"]
