"""Compare: run a bundle's subject on this host, stream each recorded tensor against its golden, judge it.

How a bundle is compared (:func:`compare_bundle`):

1. Open the bundle (lazy, checksummed); re-create its subject from the manifest; build the module
   for ``impl`` on ``device`` from the bundle's stored state, and run it once on the bundle's
   stored inputs (never regenerated: GPU random generators differ between vendors).
2. A :class:`~parity.recorder.Recorder` (with the capture's own ``--layers`` globs) hands over
   each tensor as it is produced, on its own device; its golden counterpart is loaded only then,
   onto the same device, the metrics are computed there and both are dropped. At most one
   recorded tensor and its golden (plus, in budget mode, its reference) are in memory at a time.
3. Tensors recorded on only one side, or with a different shape or dtype, are failures of those
   layers (statuses ``missing-here``, ``missing-in-golden``, ``shape-mismatch``,
   ``dtype-mismatch``), never crashes. A dtype mismatch still gets metrics (both sides are
   compared in float64), judged by the golden dtype's tolerance. One exception, because fusing
   is the usual reason for a port: a golden tensor of a module that this host never ran, inside
   a module whose output *was* recorded and compared here, is ``fused-here``: not a failure,
   the enclosing module carries the verdict (``Policy.strict_structure`` makes it
   ``missing-here`` again).
4. ``isolate=True`` (bundles captured with ``--record-inputs``): every recorded layer call is
   replayed on its *golden* inputs and its output compared again. A layer that fails end to end
   but passes in isolation inherits its error from upstream; one that fails in isolation
   introduces it (a parent module introduces the error of any child that does:
   ``CompareReport.introducing_layers`` keeps only the innermost ones). Isolated results are
   diagnostic: ``report.passed`` is decided by the end-to-end results alone.

Names. A :class:`LayerResult` is one recorded tensor: ``name`` is the bundle's tensor name
(``layers.0.attn``, ``block#1``, ``<root>/logits``, ``<case id>/out``), ``layer`` the layer call it
belongs to and ``path`` its place in that call's output. Results are in execution order (golden
tensors this host never produced are placed where the golden recorded them).
``first_failing_layer`` is the ``name`` of the first failing result.

Error budget (numerics.md, the flash-attention rule): this host's error against the bundle's
high-precision reference may be at most ``k`` times the capture host's own (golden against the
same reference) plus a rounding floor (``parity.policy.budget_floors``), for rel L2 and max abs.
``budget`` chooses when it is checked:

- ``None`` (default): on every floating tensor the bundle holds a reference of, with the
  policy's ``budget_k`` (built-in 2.0; ``budget_k = "off"`` in a tolerance file turns it off).
  Tensors without a reference are judged by the fixed thresholds alone.
- ``True`` (``--budget``): required: the bundle must hold references (a UsageError otherwise),
  and a tensor without one is noted as not checked. The policy's ``budget_k`` where it sets one,
  else ``DEFAULT_BUDGET_K`` (2.0).
- ``False`` (``--no-budget``): never, whatever the policy says.

``LayerResult.rule`` says which rule judged each tensor: ``budget`` (the budget and the fixed
thresholds as a backstop) or ``thresholds`` (the fixed thresholds alone).

Whenever the budget is checked, both numbers (this host vs reference, capture host vs reference)
are in the layer's ``budget`` info. The budget check is one more check of the layer's verdict;
the direct comparison against the golden is still made.

Platform. Differences between the two hosts' fingerprints in ``platform.NUMERICS_KEYS`` (TF32,
reduced-precision reductions, deterministic mode, Triton FP fusion and fp32 dot precision) are
listed as warnings: informational, never failures. Versions and device names differ by design
and are shown in the report header only.

Triton on the CPU. The library never changes the environment: ``impl="triton"`` on a CPU device
without ``TRITON_INTERPRET=1`` is the same UsageError as in capture. The CLI calls
:func:`enable_triton_interpreter` first, which turns the interpreter on when that is still
possible (Triton not imported yet) instead of asking the user to.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from . import platform
from .bundle import BundleReader, Entry, open_bundle
from .capture import Progress, _launch_configs, check_device, check_triton_mode
from .errors import UsageError
from .metrics import LayerMetrics, compute_error_vs_reference, json_safe_float
from .policy import (
    DEFAULT_BUDGET_K,
    ErrorBudget,
    Policy,
    Tolerance,
    Verdict,
    budget_floors,
    judge,
    load_policy,
    measure,
)
from .recorder import ROOT, RecordedTensor, Recorder, flatten, replay, select_modules, tensor_name
from .subjects import Inputs, runner_from_manifest

REPORT_FORMAT = "parity-compare-report"
REPORT_VERSION = 1

STATUSES = ("pass", "fused-here", "fail", "missing-in-golden", "missing-here", "shape-mismatch",
            "dtype-mismatch")
# Statuses that do not fail a comparison.
PASSING_STATUSES = ("pass", "fused-here")
# Isolated (replayed) results have these too, plus the ways a replay can be impossible.
ISOLATED_STATUSES = STATUSES + ("not-recorded", "not-replayable", "replay-error")

# Isolated statuses that mean the layer could not be replayed at all (no attribution).
_NO_REPLAY = ("not-recorded", "not-replayable", "missing-here", "missing-in-golden")

# Fingerprint fields shown for each host in the report header.
HOST_KEYS = ("vendor", "arch", "device_name", "torch", "triton", "triton_interpreter")


# ---------------------------------------------------------------------------------------------
# Results


@dataclasses.dataclass(frozen=True)
class BudgetInfo:
    """Both hosts' errors against the capture host's high-precision reference of one tensor.

    ``host_vs_reference`` is this host's output, ``capture_vs_reference`` the golden, each against
    the same reference; ``k`` and ``floors`` (by quantity, ``rel_l2`` and ``max_abs``) are the
    budget checked (``k`` None: numbers only). ``note`` says why no numbers could be computed
    (no reference, a less precise reference).
    """

    host_vs_reference: LayerMetrics | None
    capture_vs_reference: LayerMetrics | None
    k: float | None
    floors: Mapping[str, float] | None = None
    reference_dtype: str | None = None
    note: str | None = None

    @property
    def checked(self) -> bool:
        return self.k is not None and self.host_vs_reference is not None

    def allowed(self, quantity: str) -> float | None:
        """``k x capture host's error + floor`` for ``rel_l2`` or ``max_abs`` (None: not checked)."""
        if not self.checked or self.floors is None:
            return None
        return self.k * getattr(self.capture_vs_reference, quantity) + self.floors[quantity]

    @property
    def host_rel_l2(self) -> float | None:
        return None if self.host_vs_reference is None else self.host_vs_reference.rel_l2

    @property
    def capture_rel_l2(self) -> float | None:
        return None if self.capture_vs_reference is None else self.capture_vs_reference.rel_l2

    @property
    def rel_l2_ratio(self) -> float | None:
        """This host's rel L2 vs reference over the capture host's (the ``k`` it used, for rel L2)."""
        host, capture = self.host_rel_l2, self.capture_rel_l2
        if host is None or capture is None:
            return None
        if capture == 0:
            return 1.0 if host == 0 else math.inf
        return host / capture

    def to_dict(self) -> dict[str, Any]:
        def numbers(metrics: LayerMetrics | None) -> dict[str, Any] | None:
            return None if metrics is None else metrics.to_dict()

        return {
            "k": json_safe_float(self.k),
            "floor_rel_l2": json_safe_float(None if self.floors is None else self.floors["rel_l2"]),
            "floor_max_abs": json_safe_float(None if self.floors is None else self.floors["max_abs"]),
            "allowed_rel_l2": json_safe_float(self.allowed("rel_l2")),
            "allowed_max_abs": json_safe_float(self.allowed("max_abs")),
            "reference_dtype": self.reference_dtype,
            "host_rel_l2": json_safe_float(self.host_rel_l2),
            "capture_rel_l2": json_safe_float(self.capture_rel_l2),
            "host_max_abs": json_safe_float(None if self.host_vs_reference is None else self.host_vs_reference.max_abs),
            "capture_max_abs": json_safe_float(
                None if self.capture_vs_reference is None else self.capture_vs_reference.max_abs),
            "rel_l2_ratio": json_safe_float(self.rel_l2_ratio),
            "note": self.note,
            "host_vs_reference": numbers(self.host_vs_reference),
            "capture_vs_reference": numbers(self.capture_vs_reference),
        }


@dataclasses.dataclass(frozen=True)
class LayerResult:
    """One recorded tensor compared with its golden: metrics, the tolerance applied, the verdict.

    ``dtype``/``shape`` are the golden's (this host's where the golden has no such tensor);
    ``here_dtype``/``here_shape`` are this host's (None where it produced no such tensor).
    ``metrics`` is None where nothing could be compared (missing on a side, shape mismatch).
    ``isolated``: the result of replaying the layer on its golden inputs (``--isolate``), whose
    own ``isolated`` is None. ``budget``: the error-budget numbers, when the budget was checked
    or a reference was given. ``note``: why a replay was impossible or failed.
    """

    name: str
    status: str
    dtype: str | None
    shape: tuple[int, ...] | None
    tolerance: Tolerance
    verdict: Verdict
    metrics: LayerMetrics | None = None
    layer: str | None = None
    path: str | None = None
    here_dtype: str | None = None
    here_shape: tuple[int, ...] | None = None
    budget: BudgetInfo | None = None
    isolated: "LayerResult | None" = None
    note: str | None = None

    @property
    def passed(self) -> bool:
        return self.status in PASSING_STATUSES

    @property
    def rule(self) -> str | None:
        """Which rule judged the tensor: ``"budget"`` (the error budget against the bundle's
        reference, with the fixed thresholds as a backstop), ``"thresholds"`` (the fixed
        thresholds alone: no reference), or None where nothing was compared."""
        if self.metrics is None:
            return None
        return "budget" if self.budget is not None and self.budget.checked else "thresholds"

    @property
    def attribution(self) -> str | None:
        """With an isolated result: ``"introduced"`` (fails on golden inputs too, a replay that
        raises included), ``"inherited"`` (fails end to end only), ``"none"`` (passes both ways);
        None without a replay (not isolated, no recorded inputs, no such module here)."""
        if self.isolated is None or self.isolated.status in _NO_REPLAY:
            return None
        if not self.isolated.passed:
            return "introduced"
        return "inherited" if not self.passed else "none"

    def failed_checks(self) -> dict[str, Any]:
        """Each failed check and the smallest tolerance value that would have passed it.

        Keys are tolerance fields (``max_rel_l2``, ``min_cosine``, ``max_mismatch_fraction``,
        ``max_abs``, ``max_ulp``, ``budget_k``); a failed mismatch check also lists ``atol``,
        ``atol_rms`` and ``rtol`` (any one of them alone would have passed it). ``nan_policy``
        (positions differ: only ``"ignore"`` passes), ``shape``, ``dtype``, ``missing`` are
        failures that no tolerance fixes; their value describes the problem.
        """
        return failed_checks(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "layer": self.layer,
            "path": self.path,
            "status": self.status,
            "passed": self.passed,
            "rule": self.rule,
            "dtype": self.dtype,
            "shape": None if self.shape is None else list(self.shape),
            "here_dtype": self.here_dtype,
            "here_shape": None if self.here_shape is None else list(self.here_shape),
            "metrics": None if self.metrics is None else self.metrics.to_dict(),
            "tolerance": self.tolerance.to_dict(),
            "verdict": self.verdict.to_dict(),
            "failed_checks": {key: _json_value(value) for key, value in self.failed_checks().items()},
            "budget": None if self.budget is None else self.budget.to_dict(),
            "isolated": None if self.isolated is None else self.isolated.to_dict(),
            "attribution": self.attribution,
            "note": self.note,
        }


@dataclasses.dataclass(frozen=True)
class FingerprintDifference:
    """A numerics-relevant platform setting (``platform.NUMERICS_KEYS``) that differs between hosts."""

    key: str
    golden: Any
    here: Any

    @property
    def message(self) -> str:
        return (f"{self.key} differs: golden host {self.golden!r}, this host {self.here!r} "
                "(changes numerics; informational, not a failure)")

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "golden": self.golden, "here": self.here, "message": self.message}


@dataclasses.dataclass(frozen=True)
class ErrorGrowth:
    """How rel L2 against the golden evolves over the compared tensors, in execution order.

    ``points``: ``(name, rel_l2, max_abs)`` of every result with metrics. ``largest_jump``: the
    tensor whose rel L2 grows most over the one before it (as a ratio; from exactly 0 counts as
    infinite, ties going to the larger value), ``(name, previous rel_l2, rel_l2)``.
    """

    points: tuple[tuple[str, float, float], ...]

    @property
    def first(self) -> tuple[str, float] | None:
        return (self.points[0][0], self.points[0][1]) if self.points else None

    @property
    def last(self) -> tuple[str, float] | None:
        return (self.points[-1][0], self.points[-1][1]) if self.points else None

    @property
    def peak(self) -> tuple[str, float] | None:
        finite = [p for p in self.points if not math.isnan(p[1])]
        if not finite:
            return None
        name, rel_l2, _ = max(finite, key=lambda p: p[1])
        return name, rel_l2

    @property
    def last_over_first(self) -> float | None:
        if not self.points:
            return None
        first, last = self.points[0][1], self.points[-1][1]
        if first == 0:
            return 1.0 if last == 0 else math.inf
        return last / first

    @property
    def largest_jump(self) -> tuple[str, float, float] | None:
        best = None
        best_key = None
        for (_, before, _), (name, after, _) in zip(self.points, self.points[1:]):
            if not after > before:  # also skips NaN
                continue
            ratio = math.inf if before == 0 else after / before
            key = (ratio, after)
            if best_key is None or key > best_key:
                best, best_key = (name, before, after), key
        return best

    def to_dict(self) -> dict[str, Any]:
        jump = self.largest_jump
        return {
            "rel_l2": [[name, json_safe_float(rel_l2)] for name, rel_l2, _ in self.points],
            "max_abs": [[name, json_safe_float(max_abs)] for name, _, max_abs in self.points],
            "first": None if self.first is None else [self.first[0], json_safe_float(self.first[1])],
            "last": None if self.last is None else [self.last[0], json_safe_float(self.last[1])],
            "peak": None if self.peak is None else [self.peak[0], json_safe_float(self.peak[1])],
            "last_over_first": json_safe_float(self.last_over_first),
            "largest_jump": None if jump is None else {
                "layer": jump[0], "from": json_safe_float(jump[1]), "to": json_safe_float(jump[2])},
        }


@dataclasses.dataclass
class CompareReport:
    """Everything one comparison found; ``to_dict()`` is the JSON report (see ``parity.report``)."""

    golden: str
    subject: dict[str, Any]
    impl: str
    golden_impl: str | None
    device: str
    policy: Policy
    layers: list[LayerResult]
    hosts: dict[str, dict[str, Any]]
    fingerprint_differences: list[FingerprintDifference]
    platforms: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    isolate: bool = False
    budget: bool | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)
    kernel_configs: dict[str, Any] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    # What was read of the bundle: {"tensors", "verified", "not_read": {kind: count}} (_integrity).
    integrity: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """Parity holds: at least one tensor compared, and every end-to-end result passes."""
        return bool(self.layers) and all(result.passed for result in self.layers)

    @property
    def failing(self) -> list[LayerResult]:
        return [result for result in self.layers if not result.passed]

    @property
    def first_failing_layer(self) -> str | None:
        return next((result.name for result in self.layers if not result.passed), None)

    @property
    def budget_checked(self) -> bool:
        return any(result.rule == "budget" for result in self.layers)

    @property
    def rules(self) -> dict[str, int]:
        """How many tensors each rule judged (``LayerResult.rule``)."""
        counts: dict[str, int] = {}
        for result in self.layers:
            if result.rule is not None:
                counts[result.rule] = counts.get(result.rule, 0) + 1
        return counts

    @property
    def fused_here(self) -> list[LayerResult]:
        return [result for result in self.layers if result.status == "fused-here"]

    @property
    def error_growth(self) -> ErrorGrowth:
        return ErrorGrowth(tuple(
            (result.name, result.metrics.rel_l2, result.metrics.max_abs)
            for result in self.layers if result.metrics is not None
        ))

    @property
    def introducing_layers(self) -> list[str]:
        """Results that fail on their golden inputs (``--isolate``) and contain no other such layer.

        A parent module replayed on golden inputs re-runs its children, so it fails whenever a
        child introduces error; only the innermost failing modules are named.
        """
        failing = [r for r in self.layers if r.isolated is not None and r.attribution == "introduced"]
        modules = {_module_of(r) for r in failing}
        return [r.name for r in failing
                if not any(other != _module_of(r) and _is_inside(other, _module_of(r)) for other in modules)]

    def to_dict(self) -> dict[str, Any]:
        failing = self.failing
        return {
            "format": REPORT_FORMAT,
            "version": REPORT_VERSION,
            "passed": self.passed,
            "golden": self.golden,
            "subject": self.subject,
            "impl": self.impl,
            "golden_impl": self.golden_impl,
            "device": self.device,
            "isolate": self.isolate,
            "budget": {"mode": {None: "default", True: "required", False: "off"}[self.budget],
                       "checked": self.budget_checked},
            "rules": self.rules,
            "hosts": self.hosts,
            "platforms": self.platforms,
            "fingerprint_differences": [d.to_dict() for d in self.fingerprint_differences],
            "warnings": list(self.warnings),
            "summary": {
                "layers": len(self.layers),
                "passing": len(self.layers) - len(failing),
                "failing": len(failing),
                "fused_here": len(self.fused_here),
                "first_failing_layer": self.first_failing_layer,
                "introducing_layers": self.introducing_layers if self.isolate else None,
                "statuses": {status: sum(r.status == status for r in self.layers)
                             for status in STATUSES if any(r.status == status for r in self.layers)},
                "error_growth": self.error_growth.to_dict(),
            },
            "policy": self.policy.to_dict(),
            "kernel_configs": self.kernel_configs,
            "integrity": self.integrity,
            "seconds": round(self.seconds, 3),
            "layers": [result.to_dict() for result in self.layers],
        }


def _module_of(result: LayerResult) -> str:
    layer = result.layer or result.name
    return layer.split("#", 1)[0]


def _is_inside(module: str, parent: str) -> bool:
    if parent == "<root>":
        return module != "<root>"
    return module.startswith(parent + ".")


# ---------------------------------------------------------------------------------------------
# Failed checks and the tolerance that would have passed


def failed_checks(result: LayerResult) -> dict[str, Any]:
    """See :meth:`LayerResult.failed_checks`."""
    if result.passed:
        return {}
    if result.status == "missing-here":
        return {"missing": "this host produced no such tensor"}
    if result.status == "missing-in-golden":
        return {"missing": "the golden bundle has no such tensor"}
    if result.status == "shape-mismatch":
        return {"shape": f"{_shape_text(result.here_shape)} here, {_shape_text(result.shape)} in the golden"}
    if result.status in ("not-recorded", "not-replayable", "replay-error"):
        return {"replay": result.note}
    checks: dict[str, Any] = {}
    if result.status == "dtype-mismatch":
        checks["dtype"] = f"{result.here_dtype} here, {result.dtype} in the golden"
    metrics, tol, needed = result.metrics, result.tolerance, result.verdict.needed
    if metrics is None:
        return checks
    if tol.nan_policy == "positions" and metrics.nonfinite_mismatch_count:
        checks["nan_policy"] = "ignore"
    if not needed.get("max_mismatch_fraction", 0.0) <= tol.max_mismatch_fraction:
        checks["max_mismatch_fraction"] = needed["max_mismatch_fraction"]
        for key in ("atol", "atol_rms", "rtol"):
            if key in needed:
                checks[key] = needed[key]
    if tol.outlier_factor is not None and metrics.outlier_count:
        checks["outlier_factor"] = needed.get("outlier_factor", metrics.worst_bound_ratio)
    if "min_cosine" in needed and not needed["min_cosine"] >= tol.min_cosine:
        checks["min_cosine"] = needed["min_cosine"]
    if "max_rel_l2" in needed and not needed["max_rel_l2"] <= tol.max_rel_l2:
        checks["max_rel_l2"] = needed["max_rel_l2"]
    if tol.max_abs is not None and "max_abs" in needed and not needed["max_abs"] <= tol.max_abs:
        checks["max_abs"] = needed["max_abs"]
    if tol.max_ulp is not None and "max_ulp" in needed and not needed["max_ulp"] <= tol.max_ulp:
        checks["max_ulp"] = needed["max_ulp"]
    if tol.budget_k is not None and "budget_k" in needed and not needed["budget_k"] <= tol.budget_k:
        checks["budget_k"] = needed["budget_k"]
    return checks


# ---------------------------------------------------------------------------------------------
# One tensor


def _as_policy(policy: Policy | str | os.PathLike | None) -> Policy:
    if policy is None:
        return Policy()
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, (str, os.PathLike)):
        return load_policy(policy)
    raise TypeError(f"policy must be a Policy, a path to a policy file or None, not {type(policy).__name__}")


def _dtype_text(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shape_text(shape: tuple[int, ...] | None) -> str:
    return "?" if shape is None else "[" + ", ".join(str(n) for n in shape) + "]"


def _budget_tolerance(tol: Tolerance, budget: bool | None, dtype: torch.dtype, has_reference: bool) -> Tolerance:
    """The tolerance with the budget mode applied (module docstring). Integer and bool tensors
    never have a budget (they are compared exactly: there is no rounding error to budget); by
    default a tensor without a reference has none either (the thresholds judge it)."""
    unbudgeted = not dtype.is_floating_point or budget is False or (budget is None and not has_reference)
    if unbudgeted:
        return replace(tol, budget_k=None) if tol.budget_k is not None else tol
    if budget is True and tol.budget_k is None:
        return replace(tol, budget_k=DEFAULT_BUDGET_K)
    return tol


def _failure(name: str, status: str, reason: str, tol: Tolerance, **fields: Any) -> LayerResult:
    return LayerResult(name=name, status=status, tolerance=tol, verdict=Verdict(passed=False, reasons=[reason]),
                       **fields)


def _budget_info(out: torch.Tensor, golden: torch.Tensor, reference: torch.Tensor | None,
                 tol: Tolerance) -> BudgetInfo:
    def info(note: str, ref_dtype: str | None = None) -> BudgetInfo:
        return BudgetInfo(None, None, tol.budget_k, None, ref_dtype, note)

    if reference is None:
        return info("no high-precision reference of this tensor in the bundle")
    ref_dtype = _dtype_text(reference.dtype)
    if tuple(reference.shape) != tuple(golden.shape):
        return info(f"reference shape {_shape_text(tuple(reference.shape))} differs from the golden's", ref_dtype)
    if not (out.is_floating_point() and golden.is_floating_point()):
        return info("the error budget applies to floating-point tensors only", ref_dtype)
    reference = reference.to(out.device)
    try:
        host = compute_error_vs_reference(out, reference)
        capture = compute_error_vs_reference(golden, reference)
    except ValueError as err:  # a reference less precise than the tensor (fp32 reference of fp64)
        return info(str(err), ref_dtype)
    return BudgetInfo(host, capture, tol.budget_k, budget_floors(tol, golden.dtype, capture.ref_max_abs), ref_dtype)


def compare_tensors(
    name: str,
    out: torch.Tensor,
    golden: torch.Tensor,
    *,
    policy: Policy | str | os.PathLike | None = None,
    reference: torch.Tensor | None = None,
    budget: bool | None = None,
    layer: str | None = None,
    path: str | None = None,
) -> LayerResult:
    """Compare one tensor of this host (``out``) with its golden under ``policy`` (default: built-in).

    The tolerance is ``policy.resolve(name, golden.dtype)``. ``reference``: the capture host's
    high-precision reference of ``golden``; with it, both hosts' errors against it are computed
    (``LayerResult.budget``), and checked when the tolerance has ``budget_k`` (``budget``: as in
    :func:`compare_bundle`; a budget without a reference is a note in the verdict: not checked).
    Policy overrides match ``name``.
    Metrics are computed on ``out``'s device (``golden`` is moved there). Never raises for a shape
    or dtype mismatch: those are results with status ``shape-mismatch`` / ``dtype-mismatch``.
    """
    policy = _as_policy(policy)
    tol = _budget_tolerance(policy.resolve(name, golden.dtype), budget, golden.dtype, reference is not None)
    fields = dict(layer=layer, path=path, dtype=_dtype_text(golden.dtype), shape=tuple(golden.shape),
                  here_dtype=_dtype_text(out.dtype), here_shape=tuple(out.shape))
    if tuple(out.shape) != tuple(golden.shape):
        reason = (f"shape mismatch: {_shape_text(tuple(out.shape))} here, {_shape_text(tuple(golden.shape))} "
                  "in the golden")
        return _failure(name, "shape-mismatch", reason, tol, **fields)
    golden = golden.to(out.device)
    metrics = measure(out, golden, tol)
    budget_info = None
    if reference is not None or tol.budget_k is not None:
        budget_info = _budget_info(out, golden, reference, tol)
    error_budget = None
    if budget_info is not None and budget_info.host_vs_reference is not None:
        error_budget = ErrorBudget(capture_vs_reference=budget_info.capture_vs_reference,
                                   host_vs_reference=budget_info.host_vs_reference)
    verdict = judge(metrics, tol, budget=error_budget)
    if tol.budget_k is not None and error_budget is None and budget_info is not None:
        # judge's note says only that the check was not made; say why (as judge does, a note).
        verdict = Verdict(verdict.passed, verdict.reasons, verdict.needed,
                          [f"error budget not checked: {budget_info.note}" if note.startswith("error budget")
                           else note for note in verdict.notes])
    status = "pass" if verdict.passed else "fail"
    if out.dtype != golden.dtype:
        reason = f"dtype mismatch: {_dtype_text(out.dtype)} here, {_dtype_text(golden.dtype)} in the golden"
        verdict = Verdict(False, [reason] + verdict.reasons, verdict.needed, verdict.notes)
        status = "dtype-mismatch"
    return LayerResult(name=name, status=status, tolerance=tol, verdict=verdict, metrics=metrics,
                       budget=budget_info, **fields)


# ---------------------------------------------------------------------------------------------
# A bundle


def enable_triton_interpreter(impl: str, device: torch.device | str) -> bool:
    """For the CLI: turn on ``TRITON_INTERPRET`` for a run on a CPU device, if still possible.

    Triton decides between compiling and interpreting a kernel when the kernel is defined, so the
    variable only takes effect if Triton has not been imported yet; then it is set and True is
    returned. Any impl, not only ``triton``: a user subject's kernel impl (``--impl kernel`` of a
    transformers model) runs Triton too, and on CPU tensors Triton can only ever interpret. If
    Triton is already imported without it, ``impl="triton"`` raises the same UsageError as
    :func:`parity.capture.check_triton_mode`; other impls are left alone (False).
    """
    device = torch.device(device)
    if device.type != "cpu" or platform.triton_interpreter_enabled():
        return False
    if "triton" in sys.modules:
        check_triton_mode(impl, device)  # raises for impl "triton": too late to switch
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return True


def _hosts(golden: Mapping[str, Any], here: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {"golden": {key: golden.get(key) for key in HOST_KEYS},
            "here": {key: here.get(key) for key in HOST_KEYS}}


def fingerprint_differences(golden: Mapping[str, Any], here: Mapping[str, Any]) -> list[FingerprintDifference]:
    """``NUMERICS_KEYS`` whose values differ (keys the golden did not record are skipped)."""
    return [FingerprintDifference(key, golden[key], here.get(key))
            for key in platform.NUMERICS_KEYS if key in golden and golden[key] != here.get(key)]


def _capture_globs(bundle: BundleReader, module: torch.nn.Module, warnings: list[str]) -> list[str] | None:
    """The capture's ``--layers`` globs, without those that match no module here (a warning each)."""
    globs = bundle.capture_layers
    if globs is None:
        return None
    usable = []
    for pattern in globs:
        try:
            select_modules(module, [pattern])
        except UsageError:
            warnings.append(f"capture --layers glob {pattern!r} matches no module of this host's model")
            continue
        usable.append(pattern)
    return usable


def _in_execution_order(here: list[LayerResult], missing_here: dict[str, LayerResult],
                        golden_order: dict[str, int]) -> list[LayerResult]:
    """This host's results in its order, each golden-only result just before the first golden
    tensor recorded after it that this host did produce."""
    pending = sorted(missing_here.values(), key=lambda r: golden_order[r.name])
    ordered: list[LayerResult] = []
    for result in here:
        position = golden_order.get(result.name)
        if position is not None:
            while pending and golden_order[pending[0].name] < position:
                ordered.append(pending.pop(0))
        ordered.append(result)
    return ordered + pending


def compare_bundle(
    golden: str | os.PathLike | BundleReader,
    *,
    impl: str = "triton",
    device: torch.device | str | None = None,
    policy: Policy | str | os.PathLike | None = None,
    isolate: bool = False,
    progress: Callable[[str], None] | None = None,
    budget: bool | None = None,
) -> CompareReport:
    """Run the golden bundle's subject here with ``impl`` and compare every recorded tensor.

    ``golden``: a bundle directory (or an open reader). ``device``: default ``cuda`` when a GPU is
    present, else ``cpu``. ``policy``: a Policy, a tolerance file path, or None for the built-in
    defaults (the CLI also reads ``[tool.parity]`` from ``./pyproject.toml``; this function does
    not). ``isolate``: also replay each layer on its golden inputs. ``budget``: the error-budget
    mode (module docstring). ``progress``: called with progress messages.

    Raises UsageError (BundleError) for an unusable bundle, a subject that cannot be re-created,
    an unknown impl, a bad device, Triton on the CPU without the interpreter, ``isolate`` without
    recorded inputs, and ``budget=True`` without references. Layer-level problems are results.
    """
    started = time.monotonic()
    say = Progress(progress)
    policy = _as_policy(policy)
    bundle = golden if isinstance(golden, BundleReader) else open_bundle(golden)
    runner = runner_from_manifest(bundle.subject, trusted=policy.trusted_subjects, bundle_dir=bundle.path)
    runner.check_impl(impl)
    device = check_device(device if device is not None else platform.default_device())
    check_triton_mode(impl, device)
    if isolate and not bundle.record_inputs:
        raise UsageError(f"--isolate needs a bundle captured with --record-inputs; {bundle.path} was captured "
                         "without recorded layer inputs")
    has_references = bool(bundle.entries_of("reference"))
    if budget is True and not has_references:
        raise UsageError(f"--budget needs high-precision references in the bundle; {bundle.path} was captured "
                         "with --reference none")

    golden_entries = bundle.entries_of("output")
    golden_order = {entry.name: index for index, entry in enumerate(golden_entries)}
    warnings: list[str] = []
    say(f"{bundle.path}: subject {runner.name}, {len(golden_entries)} recorded tensors, captured with impl "
        f"{bundle.impl} on {bundle.platform.get('device_name') or bundle.platform.get('arch')}")

    module = runner.build(impl, state=bundle.subject_state(), device=device)
    stored = bundle.subject_inputs()
    inputs = Inputs({name: _fresh(tensor, device) for name, tensor in stored.tensors.items()}, stored.meta)
    del stored
    results: list[LayerResult] = []
    seen: set[str] = set()

    def on_tensor(record: RecordedTensor) -> None:
        if record.kind != "output":
            return
        out = record.tensor
        if not bundle.has(record.name, "output"):
            tol = _budget_tolerance(policy.resolve(record.name, out.dtype), budget, out.dtype, False)
            results.append(_failure(
                record.name, "missing-in-golden", "missing in the golden bundle: the golden host recorded no "
                "such tensor", tol, layer=record.layer, path=record.path, dtype=_dtype_text(out.dtype),
                shape=tuple(out.shape), here_dtype=_dtype_text(out.dtype), here_shape=tuple(out.shape)))
        else:
            seen.add(record.name)
            entry = bundle.entry(record.name)
            tol = _budget_tolerance(policy.resolve(record.name, entry.torch_dtype), budget, entry.torch_dtype,
                                    bundle.has(record.name, "reference"))
            reference = None
            if tol.budget_k is not None and bundle.has(record.name, "reference") and tuple(out.shape) == entry.shape:
                reference = bundle.load(record.name, "reference", device=out.device)
            results.append(compare_tensors(
                record.name, out, bundle.load(entry, device=out.device), policy=policy, reference=reference,
                budget=budget, layer=record.layer, path=record.path))
        say.tick(lambda: f"compared {len(results)} tensors ({sum(not r.passed for r in results)} failing)")

    say(f"run impl {impl} on {device}")
    recorder = Recorder(module, on_tensor, layers=_capture_globs(bundle, module, warnings), copy_to=None)
    with recorder:
        runner.run(module, inputs)
    del inputs

    compared_modules = {_module_of(result) for result in results if result.name in seen}
    missing_here = {}
    for entry in golden_entries:
        if entry.name not in seen:
            tol = _budget_tolerance(policy.resolve(entry.name, entry.torch_dtype), budget, entry.torch_dtype,
                                    bundle.has(entry.name, "reference"))
            enclosing = None if policy.strict_structure else _enclosing(entry.module or entry.layer, compared_modules)
            if enclosing is not None:
                missing_here[entry.name] = LayerResult(
                    name=entry.name, status="fused-here", tolerance=tol, verdict=Verdict(passed=True),
                    layer=entry.layer, path=entry.path, dtype=entry.dtype, shape=entry.shape,
                    note=f"not run here; judged through its enclosing module {enclosing}")
                continue
            missing_here[entry.name] = _failure(
                entry.name, "missing-here", "missing here: this host's run produced no such tensor", tol,
                layer=entry.layer, path=entry.path, dtype=entry.dtype, shape=entry.shape)
    ordered = _in_execution_order(results, missing_here, golden_order)

    if isolate:
        isolated = _isolate(bundle, module, device, policy, budget, say)
        ordered = [replace(result, isolated=isolated.get(result.name)) if result.status != "missing-in-golden"
                   else result for result in ordered]

    golden_fp, here_fp = bundle.platform, platform.fingerprint(device)
    differences = fingerprint_differences(golden_fp, here_fp)
    warnings = [d.message for d in differences] + warnings + _notes_as_warnings(ordered) + _fused_warning(ordered)
    report = CompareReport(
        golden=str(bundle.path), subject=bundle.subject, impl=impl, golden_impl=bundle.impl, device=str(device),
        policy=policy, layers=ordered, hosts=_hosts(golden_fp, here_fp), fingerprint_differences=differences,
        platforms={"golden": dict(golden_fp), "here": here_fp},
        isolate=isolate, budget=budget, warnings=warnings,
        kernel_configs={"golden": (bundle.kernel_configs or {}).get("used"), "here": _launch_configs(module)},
        seconds=time.monotonic() - started,
        integrity=_integrity(bundle),
    )
    say(f"compared {len(ordered)} tensors in {report.seconds:.1f} s: {len(report.failing)} failing")
    return report


def _integrity(bundle: BundleReader) -> dict[str, Any]:
    """What compare checked of the bundle: every tensor it read had its checksum verified; the
    others (references it did not need, module inputs without --isolate) were not read at all."""
    not_read: dict[str, int] = {}
    for entry in bundle.entries:
        if (entry.kind, entry.name) not in bundle.verified:
            not_read[entry.kind] = not_read.get(entry.kind, 0) + 1
    return {"tensors": len(bundle.entries), "verified": len(bundle.entries) - sum(not_read.values()),
            "not_read": not_read}


def _enclosing(module: str, compared_modules: set[str]) -> str | None:
    """The innermost module enclosing ``module`` whose output was compared here, if any."""
    module = module.split("#", 1)[0]
    parts = module.split(".") if module != ROOT else []
    for depth in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:depth])
        if parent in compared_modules:
            return parent
    if module != ROOT and ROOT in compared_modules:
        return ROOT
    return None


def _fused_warning(results: list[LayerResult]) -> list[str]:
    fused = [result for result in results if result.status == "fused-here"]
    if not fused:
        return []
    modules = sorted({_module_of(result) for result in fused})
    shown = ", ".join(modules[:3]) + (f" and {len(modules) - 3} more" if len(modules) > 3 else "")
    return [f"{len(modules)} recorded module{'s' if len(modules) != 1 else ''} never ran here ({shown}): "
            "fused here, judged through the enclosing module (strict_structure = true makes them failures)"]


def _notes_as_warnings(results: list[LayerResult]) -> list[str]:
    """Checks the policy configured but that could not be made, grouped: one warning per note."""
    by_note: dict[str, list[str]] = {}
    for result in results:
        for note in result.verdict.notes:
            by_note.setdefault(note, []).append(result.name)
    warnings = []
    for note, names in by_note.items():
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        warnings.append(f"{note} ({len(names)} tensor{'s' if len(names) != 1 else ''}: {shown})")
    return warnings


def _isolate(bundle: BundleReader, module: torch.nn.Module, device: torch.device, policy: Policy,
             budget: bool | None, say: Progress) -> dict[str, LayerResult]:
    """Replay every recorded layer call on its golden inputs; results by tensor name."""
    results: dict[str, LayerResult] = {}
    outputs_by_layer: dict[str, list[Entry]] = {}
    for entry in bundle.entries_of("output"):
        outputs_by_layer.setdefault(entry.layer, []).append(entry)

    def fail(entry: Entry, status: str, note: str) -> LayerResult:
        tol = _budget_tolerance(policy.resolve(entry.name, entry.torch_dtype), budget, entry.torch_dtype,
                                bundle.has(entry.name, "reference"))
        return _failure(entry.name, status, note, tol, layer=entry.layer, path=entry.path, dtype=entry.dtype,
                        shape=entry.shape, note=note)

    layers = bundle.layers()
    say(f"isolate: replaying {len(layers)} layers on their golden inputs")
    for number, layer in enumerate(layers):
        entries = outputs_by_layer.get(layer["name"], [])
        problem = None
        if not entries:
            continue
        if layer["inputs"] is None:
            problem = ("not-recorded", "no recorded inputs for this layer")
        elif layer["module"] != "<root>" and not _has_submodule(module, layer["module"]):
            problem = ("missing-here", f"this host's model has no module {layer['module']!r}")
        if problem is None:
            # Damage is a BundleError (exit 2), not a result.
            layer_inputs = {path: _fresh(tensor, device) for path, tensor in bundle.module_inputs(layer["name"]).items()}
            try:
                with torch.no_grad():
                    output = replay(module, layer, layer_inputs)
            except UsageError as err:  # an input the recorder could not store (an opaque object)
                problem = ("not-replayable", str(err))
            except Exception as err:  # the module failed on the golden inputs: a result, shown as such
                problem = ("replay-error", f"replay raised {type(err).__name__}: {' '.join(str(err).split())}")
            del layer_inputs
        if problem is not None:
            for entry in entries:
                results[entry.name] = fail(entry, *problem)
            continue
        produced = dict(flatten(output)[1])
        del output
        for entry in entries:
            tensor = produced.pop(entry.path or "", None)
            if tensor is None:
                results[entry.name] = fail(entry, "missing-here", "the replayed layer produced no such output")
                continue
            tol = _budget_tolerance(policy.resolve(entry.name, entry.torch_dtype), budget, entry.torch_dtype,
                                    bundle.has(entry.name, "reference"))
            reference = None
            if tol.budget_k is not None and bundle.has(entry.name, "reference") and tuple(tensor.shape) == entry.shape:
                reference = bundle.load(entry.name, "reference", device=tensor.device)
            results[entry.name] = compare_tensors(
                entry.name, tensor, bundle.load(entry, device=tensor.device), policy=policy, reference=reference,
                budget=budget, layer=entry.layer, path=entry.path)
        say.tick(lambda: f"isolate: replayed {number + 1} of {len(layers)} layers")
    return results


def _fresh(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy in newly allocated memory on ``device``, for feeding stored tensors to the model.

    Tensors read from a safetensors shard sit at whatever offset the file gives them (8-byte
    aligned, measured), and CPU GEMM kernels pick code paths by alignment: an fp32 Linear on such
    a tensor differed from the same values in freshly allocated memory by 2.4e-7 (max abs). A fresh
    copy makes a same-host comparison, and a replay, bitwise reproducible.
    """
    return tensor.to(device, copy=True)


def _has_submodule(root: torch.nn.Module, path: str) -> bool:
    try:
        root.get_submodule(path)
    except AttributeError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Policy for the CLI


def policy_for_cli(tolerances: str | os.PathLike | None, *, cwd: str | os.PathLike | None = None) -> Policy:
    """``--tolerances FILE`` if given, else ``[tool.parity]`` of ``./pyproject.toml`` if it has one,
    else the built-in defaults. (The pytest plugin's ``--parity-tolerances`` means the same.)"""
    if tolerances is not None:
        return load_policy(tolerances)
    pyproject = Path(cwd or os.getcwd()) / "pyproject.toml"
    if not pyproject.is_file():
        return Policy()
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            return Policy()
    try:
        data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise UsageError(f"{pyproject}: invalid TOML (read for [tool.parity]): {' '.join(str(err).split())}") from None
    tool = data.get("tool")
    if isinstance(tool, dict) and "parity" in tool:
        return Policy.from_pyproject(pyproject)
    return Policy()


# ---------------------------------------------------------------------------------------------
# JSON helpers


def _json_value(value: Any) -> Any:
    return json_safe_float(value) if isinstance(value, float) else value
