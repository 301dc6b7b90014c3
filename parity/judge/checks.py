"""Judging one tensor: the checks of a :class:`~parity.judge.policy.Tolerance` against its
:class:`~parity.judge.metrics.LayerMetrics`, and the error budget (:func:`judge`, :func:`measure`).

What each check means, and the calibration of every default, is in :mod:`parity.judge.policy`'s
docstring. A :class:`Verdict` holds one reason per failed check and, for every check made, the
tightest tolerance the observed metrics would still satisfy (from which
:func:`parity.judge.policy.would_pass_text` proposes a tolerance file's values). Imports the
metrics, the policy and :mod:`parity.base`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from parity.base import dtypes
from parity.base.numbers import cosine_pair, format_plain, format_ratio, number_pair, scientific
from parity.judge.metrics import LayerMetrics, compute_metrics, json_value
from parity.judge.policy import Tolerance, dtype_class


@dataclass(frozen=True)
class ErrorBudget:
    """Both hosts' errors against the same high-precision reference (``compute_error_vs_reference``)."""

    capture_vs_reference: LayerMetrics
    host_vs_reference: LayerMetrics


@dataclass(frozen=True)
class Verdict:
    """Outcome of ``judge`` for one layer.

    ``reasons``: one line per failed check. ``needed``: for every check that was made, the
    tightest value of its tolerance that the observed metrics would still satisfy (observed
    cosine, max_abs, rel_l2, ULPs, mismatch fraction; ``atol``, ``atol_rms`` and ``rtol``, each
    the value that alone, with the other two as given, leaves no mismatch at all; ``budget_k``
    for the error budget).
    ``notes``: checks that were configured but could not be made. ``failed``: the tolerance field
    of each failed check, in the order of ``reasons`` (``nan_policy``, ``max_mismatch_fraction``,
    ``outlier_factor``, ``min_cosine``, ``max_rel_l2``, ``max_abs``, ``max_ulp``, ``max_bias``, ``budget_k``).
    """

    passed: bool
    reasons: list[str] = field(default_factory=list)
    needed: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    failed: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "reasons": list(self.reasons),
            "needed": {name: json_value(value) for name, value in self.needed.items()},
            "notes": list(self.notes),
        }


# The fixed thresholds that back the error budget up (policy.py: "Which rule judges a tensor").
BACKSTOP = ("max_mismatch_fraction", "min_cosine", "max_rel_l2", "max_abs")


def waive_backstop(verdict: Verdict, tol: Tolerance, golden_vs_reference: LayerMetrics) -> Verdict:
    """``verdict`` with each failed backstop check waived that the golden itself fails against the
    high-precision reference, measured under the same tolerances (``golden_vs_reference``:
    ``measure(golden, reference, tol)``); pure.

    A backstop catches what a budget computed from a bad golden would let through; it cannot ask
    of a port what the capture host's own arithmetic does not achieve. Two correct bf16 runs of a
    deep model each differ from fp32 by as much as the thresholds allow (a random-weight Llama's
    16th layer: rel L2 2.7e-2 against the 2.5e-2 backstop, ``docs/scale.md``), so the port fails
    where the golden would too. Only for a verdict whose budget was checked and passed and whose
    failures are all backstop checks; a waived check becomes a note that names the golden's value,
    so the report still shows a golden far from its reference."""
    if verdict.passed or tol.budget_k is None or not verdict.failed or not set(verdict.failed) <= set(BACKSTOP):
        return verdict
    golden = golden_vs_reference
    golden_fails = {
        "max_mismatch_fraction": golden.mismatch_fraction > tol.max_mismatch_fraction,
        "min_cosine": not golden.cosine >= tol.min_cosine,
        "max_rel_l2": not golden.rel_l2 <= tol.max_rel_l2,
        "max_abs": tol.max_abs is not None and not golden.max_abs <= tol.max_abs,
    }
    kept = [(name, reason) for name, reason in zip(verdict.failed, verdict.reasons) if not golden_fails[name]]
    waived = [name for name in verdict.failed if golden_fails[name]]
    if not waived:
        return verdict
    shown = {"max_mismatch_fraction": f"mismatch {scientific(golden.mismatch_fraction)}",
             "min_cosine": f"cosine {cosine_pair(golden.cosine, tol.min_cosine)[0]}",
             "max_rel_l2": f"rel L2 {scientific(golden.rel_l2)}", "max_abs": f"max abs {scientific(golden.max_abs)}"}
    note = (f"backstop waived for {', '.join(waived)}: the golden itself is beyond it against the reference "
            f"({', '.join(shown[name] for name in waived)}); judged by the error budget, which holds")
    return Verdict(passed=not kept, reasons=[reason for _, reason in kept], needed=verdict.needed,
                   notes=verdict.notes + [note], failed=tuple(name for name, _ in kept))


def measure(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance, **kwargs) -> LayerMetrics:
    """``compute_metrics`` with the mismatch tolerances of ``tol``, ready for ``judge``."""
    return compute_metrics(out, ref, atol=tol.atol, atol_rms=tol.atol_rms, rtol=tol.rtol,
                           outlier_factor=tol.outlier_factor, **kwargs)


def judge(metrics: LayerMetrics, tol: Tolerance, *, budget: ErrorBudget | None = None) -> Verdict:
    """Apply ``tol`` to ``metrics`` (computed with ``tol``'s atol, atol_rms, rtol: ``measure``); pure."""
    used = (metrics.atol, metrics.atol_rms, metrics.rtol)
    if used != (tol.atol, tol.atol_rms, tol.rtol):
        raise ValueError(
            f"metrics were computed with (atol, atol_rms, rtol) = {used} but the tolerance has "
            f"{(tol.atol, tol.atol_rms, tol.rtol)}: compute them with measure(out, ref, tol)"
        )
    reasons: list[str] = []
    needed: dict[str, float] = {}
    notes: list[str] = []
    failed: list[str] = []

    if tol.nan_policy == "positions" and not metrics.nonfinite_positions_agree:
        failed.append("nan_policy")
        reasons.append(
            f"NaN/Inf positions differ at {metrics.nonfinite_mismatch_count} of {metrics.numel} elements "
            f"(out: {metrics.nan_out} NaN, {metrics.inf_out} Inf; ref: {metrics.nan_ref} NaN, "
            f"{metrics.inf_ref} Inf); first at {metrics.first_nonfinite_mismatch_index}"
        )

    needed["max_mismatch_fraction"] = metrics.mismatch_fraction
    needed.update(_needed_mismatch_tolerances(metrics))
    if not metrics.mismatch_fraction <= tol.max_mismatch_fraction:
        failed.append("max_mismatch_fraction")
        observed, allowed = number_pair(metrics.mismatch_fraction, tol.max_mismatch_fraction)
        bound = f"atol {scientific(tol.atol)}"
        if tol.atol_rms:
            bound = (f"{scientific(metrics.effective_atol)} (atol {scientific(tol.atol)} + atol_rms "
                     f"{scientific(tol.atol_rms)} x ref rms {scientific(metrics.ref_rms)})")
        reasons.append(
            f"mismatch_fraction {observed} > {allowed} ({metrics.mismatch_count} of "
            f"{metrics.finite_count} elements outside {bound} + rtol {scientific(tol.rtol)}*|ref|; "
            f"largest |out - ref| at {metrics.worst_index}: out {metrics.worst_out!r}, "
            f"ref {metrics.worst_ref!r})"
        )

    if tol.outlier_factor is not None:
        needed["outlier_factor"] = metrics.worst_bound_ratio
        if metrics.outlier_factor != tol.outlier_factor:
            raise ValueError("metrics were computed with another outlier_factor: use measure(out, ref, tol)")
        if metrics.outlier_count:
            failed.append("outlier_factor")
            reasons.append(
                f"outliers: {metrics.outlier_count} element{'s' if metrics.outlier_count != 1 else ''} beyond "
                f"{format_plain(tol.outlier_factor)}x their bound (worst at {metrics.worst_bound_index}: "
                f"{format_ratio(metrics.worst_bound_ratio)} its bound, out {metrics.worst_bound_out!r}, "
                f"ref {metrics.worst_bound_ref!r})"
            )

    needed["min_cosine"] = metrics.cosine
    if not metrics.cosine >= tol.min_cosine:
        failed.append("min_cosine")
        observed, allowed = cosine_pair(metrics.cosine, tol.min_cosine)
        reasons.append(f"cosine {observed} < {allowed}")

    needed["max_rel_l2"] = metrics.rel_l2
    if not metrics.rel_l2 <= tol.max_rel_l2:
        failed.append("max_rel_l2")
        observed, allowed = number_pair(metrics.rel_l2, tol.max_rel_l2)
        reasons.append(f"rel_l2 {observed} > {allowed}")

    if tol.max_abs is not None:
        needed["max_abs"] = metrics.max_abs
        if not metrics.max_abs <= tol.max_abs:
            failed.append("max_abs")
            observed, allowed = number_pair(metrics.max_abs, tol.max_abs)
            reasons.append(f"max_abs {observed} > {allowed}")

    if tol.max_ulp is not None:
        if metrics.ulp_max is None:
            notes.append(
                f"max_ulp not checked: ULP distances exist only for fp16/bf16 against the same dtype "
                f"(out {metrics.out_dtype}, ref {metrics.ref_dtype})"
            )
        else:
            needed["max_ulp"] = metrics.ulp_max
            if metrics.ulp_max > tol.max_ulp:
                failed.append("max_ulp")
                reasons.append(
                    f"ulp_max {metrics.ulp_max} > {tol.max_ulp} ({metrics.ulp_over_1_count} elements "
                    f"more than 1 ULP apart)"
                )

    if tol.max_bias is not None:
        needed["max_bias"] = abs(metrics.bias)
        if abs(metrics.bias) > tol.max_bias and abs(metrics.bias_z) > tol.bias_z:
            failed.append("max_bias")
            observed, allowed = number_pair(abs(metrics.bias), tol.max_bias)
            reasons.append(
                f"biased: error projected on the reference {metrics.bias:+.3g} (|bias| {observed} > {allowed}; "
                f"significance {metrics.bias_z:+.3g} sigma, beyond {format_plain(tol.bias_z)}): a systematic "
                "error (a scale, a missing term, a wrong precision), not rounding"
            )

    if tol.budget_k is not None:
        if budget is None:
            notes.append("error budget not checked: no metrics against a high-precision reference")
        else:
            before = len(reasons)
            _judge_budget(budget, tol, reasons, needed)
            if len(reasons) > before:
                failed.append("budget_k")

    return Verdict(passed=not reasons, reasons=reasons, needed=needed, notes=notes, failed=tuple(failed))


def _needed_mismatch_tolerances(metrics: LayerMetrics) -> dict[str, float]:
    """Each of atol, atol_rms, rtol that alone (the others as given) would leave no mismatch."""
    scaled_part = metrics.atol_rms * metrics.ref_rms
    missing = metrics.needed_atol - metrics.atol  # what atol_rms * ref_rms must cover
    if missing <= 0:
        needed_atol_rms = 0.0
    else:
        needed_atol_rms = missing / metrics.ref_rms if metrics.ref_rms > 0 else math.inf
    return {
        "atol": max(metrics.needed_atol - scaled_part, 0.0),
        "atol_rms": needed_atol_rms,
        "rtol": metrics.needed_rtol,
    }


def accumulation_eps(dtype: torch.dtype | str) -> float:
    """Machine epsilon of the arithmetic a correct kernel does for tensors of ``dtype``: fp64's
    for fp64, fp32's for everything narrower (16-bit and fp8 kernels accumulate in fp32)."""
    return torch.finfo(dtypes.accumulation_dtype(dtype_class(dtype))).eps


def ulp_at(dtype: torch.dtype | str, magnitude: float) -> float:
    """The spacing of ``dtype``'s numbers at ``magnitude`` (0 for a magnitude of 0 or not finite)."""
    if not math.isfinite(magnitude) or magnitude <= 0:
        return 0.0
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return 0.0
    info = torch.finfo(dtype)
    _, exponent = math.frexp(max(magnitude, info.tiny))  # magnitude = m * 2**exponent, m in [0.5, 1)
    return math.ldexp(info.eps, exponent - 1)


def budget_floors(tol: Tolerance, dtype: torch.dtype | str, reference_max_abs: float) -> dict[str, float]:
    """The error budget's floor for ``rel_l2`` and ``max_abs`` of one tensor (module docstring)."""
    eps = accumulation_eps(dtype)
    return {
        "rel_l2": tol.budget_ulps * eps + tol.budget_floor,
        "max_abs": max(tol.budget_ulps * eps * reference_max_abs, ulp_at(dtype, reference_max_abs))
        + tol.budget_floor,
    }


def _judge_budget(budget: ErrorBudget, tol: Tolerance, reasons: list[str], needed: dict) -> None:
    capture_metrics = budget.capture_vs_reference
    floors = budget_floors(tol, capture_metrics.out_dtype, capture_metrics.ref_max_abs)
    k = tol.budget_k
    smallest_k = 0.0
    for name in ("rel_l2", "max_abs"):
        capture = getattr(capture_metrics, name)
        host = getattr(budget.host_vs_reference, name)
        floor = floors[name]
        allowed = k * capture + floor
        if not host <= allowed:
            observed, limit = number_pair(host, allowed)
            reasons.append(
                f"error budget: {name} vs reference {observed} > {limit} "
                f"(= {format_plain(k)} x capture host's {scientific(capture)} + floor {scientific(floor)})"
            )
        excess = host - floor
        if excess > 0:
            smallest_k = max(smallest_k, excess / capture if capture > 0 else math.inf)
    needed["budget_k"] = smallest_k


