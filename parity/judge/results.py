"""The result model of a comparison: one result per tensor, the report of a whole run.

A :class:`TensorResult` is one tensor judged against its golden: ``name`` is the bundle's tensor
name (``layers.0.attn``, ``block#1``, ``<root>/logits``, ``<case id>/out``), ``layer`` the layer
call it belongs to and ``path`` its place in that call's output. A :class:`CompareReport` holds the
results of one run in execution order, the hosts, warnings and policy; ``to_dict()`` is the JSON
report (:mod:`parity.report` renders it for people). The same model serves ``compare`` (this host
against a golden bundle), ``compare --isolate``, ``diff`` (two bundles) and the pytest plugin.

``TensorResult.rule`` says which rule judged each tensor: ``budget`` (the error budget against
the bundle's high-precision reference, with the fixed thresholds as a backstop) or ``thresholds``
(the fixed thresholds alone). The budget numbers of both sides are in ``TensorResult.budget``.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from parity.base import jsonformat
from parity.base.text import printable
from parity.judge.bounds import BoundCheck
from parity.judge.checks import Verdict
from parity.judge.metrics import LayerMetrics, json_safe_float, json_value
from parity.judge.policy import Policy, Tolerance, unrelaxable_from_checks, would_pass_from_checks
from parity.run import platform

REPORT_FORMAT = jsonformat.COMPARE_REPORT
REPORT_VERSION = jsonformat.version_of(REPORT_FORMAT)

STATUSES = ("pass", "fused-here", "absent-here", "fail", "missing-in-golden", "missing-here", "shape-mismatch",
            "dtype-mismatch")
# Statuses that do not fail a comparison (``strict_structure`` turns the last two into ``missing-here``).
PASSING_STATUSES = ("pass", "fused-here", "absent-here")
# Isolated (replayed) results have these too, plus the ways a replay can be impossible.
ISOLATED_STATUSES = STATUSES + ("not-recorded", "not-replayable", "replay-error")

# Isolated statuses that mean the layer could not be replayed at all (no attribution).
_NO_REPLAY = ("not-recorded", "not-replayable", "missing-here", "missing-in-golden")

# Fingerprint fields shown for each host in the report header.
HOST_KEYS = ("vendor", "arch", "device_name", "torch", "triton", "triton_interpreter")


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
class TensorResult:
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
    isolated: "TensorResult | None" = None
    note: str | None = None
    derived: BoundCheck | None = None

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
            "failed_checks": {key: json_value(value) for key, value in self.failed_checks().items()},
            "budget": None if self.budget is None else self.budget.to_dict(),
            "isolated": None if self.isolated is None else self.isolated.to_dict(),
            "attribution": self.attribution,
            "note": self.note,
            "derived_bound": None if self.derived is None else self.derived.to_dict(),
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

    ``cases``: the number of independent cases the tensors belong to (a subject's case set, whose
    cases do not feed one another), 0 for one model. With cases there is no growth to follow:
    the ratio of the last to the first and the largest jump are None; the peak stays.
    """

    points: tuple[tuple[str, float, float], ...]
    cases: int = 0

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
        if not self.points or self.cases:
            return None
        first, last = self.points[0][1], self.points[-1][1]
        if first == 0:
            return 1.0 if last == 0 else math.inf
        return last / first

    @property
    def largest_jump(self) -> tuple[str, float, float] | None:
        if self.cases:
            return None
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
            "independent_cases": self.cases,
        }


@dataclasses.dataclass
class CompareReport:
    """Everything one comparison found; ``to_dict()`` is the JSON report (see ``parity.report``).

    ``layers``: one :class:`TensorResult` per tensor, in execution order (the name is the JSON
    key's). ``golden`` is the golden bundle; ``candidate`` the bundle judged against it by
    ``parity diff`` (None for ``compare``, whose candidate is this host's run: ``impl`` on
    ``device``); ``hosts``/``platforms`` key ``"here"`` is the candidate's host either way.
    """

    golden: str
    subject: dict[str, Any]
    impl: str
    golden_impl: str | None
    device: str
    policy: Policy
    layers: list[TensorResult]
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
    candidate: str | None = None
    independent_cases: int = 0  # the subject's case count where its cases do not feed one another
    # ``compare --repeat N``: a parity.run.repeats.DeterminismReport of this host's N runs (None: one run).
    determinism: Any = None
    # A bundle of several input draws (capture --seeds N): a parity.judge.seeds.SeedsReport; each
    # result in ``layers`` is then its tensor's worst draw.
    seeds: Any = None
    # What the run cost (compare: parity.run.resources.summary; None for diff, which runs nothing).
    resources: dict[str, Any] | None = None

    @property
    def tensors(self) -> list[TensorResult]:
        return self.layers

    @property
    def passed(self) -> bool:
        """Parity holds: at least one tensor compared, every end-to-end result passes, and (with
        ``--repeat``) every tensor not allowed to vary was bitwise equal run to run."""
        return (bool(self.layers) and all(result.passed for result in self.layers)
                and (self.determinism is None or self.determinism.passed))

    @property
    def failing(self) -> list[TensorResult]:
        return [result for result in self.layers if not result.passed]

    @property
    def first_failing_layer(self) -> str | None:
        return next((result.name for result in self.layers if not result.passed), None)

    @property
    def budget_checked(self) -> bool:
        return any(result.rule == "budget" for result in self.layers)

    @property
    def rules(self) -> dict[str, int]:
        """How many tensors each rule judged (``TensorResult.rule``)."""
        counts: dict[str, int] = {}
        for result in self.layers:
            if result.rule is not None:
                counts[result.rule] = counts.get(result.rule, 0) + 1
        return counts

    @property
    def fused_here(self) -> list[TensorResult]:
        return [result for result in self.layers if result.status == "fused-here"]

    @property
    def absent_here(self) -> list[TensorResult]:
        """Golden outputs that their layer call, which ran here, did not return (``absent-here``)."""
        return [result for result in self.layers if result.status == "absent-here"]

    @property
    def error_growth(self) -> ErrorGrowth:
        return ErrorGrowth(tuple(
            (result.name, result.metrics.rel_l2, result.metrics.max_abs)
            for result in self.layers if result.metrics is not None
        ), cases=self.independent_cases)

    @property
    def introducing_layers(self) -> list[str]:
        """Results that fail on their golden inputs (``--isolate``) and contain no other such layer.

        A parent module replayed on golden inputs re-runs its children, so it fails whenever a
        child introduces error; only the innermost failing modules are named.
        """
        failing = [r for r in self.layers if r.isolated is not None and r.attribution == "introduced"]
        modules = {module_of(r) for r in failing}
        return [r.name for r in failing
                if not any(other != module_of(r) and is_inside(other, module_of(r)) for other in modules)]

    @property
    def beyond_derived_bound(self) -> list[TensorResult]:
        """Results whose replay on golden inputs (``--isolate``) differs from the golden by more
        than the slack times the op's derived rounding bound: evidence that the op computes
        something else than rounding explains, named beside the verdict (never changing it)."""
        return [result for result in self.layers
                if result.isolated is not None and result.isolated.derived is not None
                and result.isolated.derived.beyond]

    def to_dict(self) -> dict[str, Any]:
        """The JSON report (format ``parity-compare-report``, schema ``parity/schemas/``); ``verdict``
        is the text report's last line."""
        failing = self.failing
        return {
            "format": REPORT_FORMAT,
            "version": REPORT_VERSION,
            "passed": self.passed,
            "verdict": verdict_line(self),
            "golden": self.golden,
            **({"candidate": self.candidate} if self.candidate is not None else {}),
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
                "absent_here": len(self.absent_here),
                "first_failing_layer": self.first_failing_layer,
                "introducing_layers": self.introducing_layers if self.isolate else None,
                "beyond_derived_bound": [result.name for result in self.beyond_derived_bound],
                "statuses": {status: sum(r.status == status for r in self.layers)
                             for status in STATUSES if any(r.status == status for r in self.layers)},
                "error_growth": self.error_growth.to_dict(),
            },
            "policy": self.policy.to_dict(),
            "kernel_configs": self.kernel_configs,
            "integrity": self.integrity,
            "seconds": round(self.seconds, 3),
            **({"determinism": self.determinism.to_dict()} if self.determinism is not None else {}),
            **({"seeds": self.seeds.to_dict()} if self.seeds is not None else {}),
            **({"resources": self.resources} if self.resources is not None else {}),
            "layers": [result.to_dict() for result in self.layers],
        }


def module_of(result: TensorResult) -> str:
    layer = result.layer or result.name
    return layer.split("#", 1)[0]


def is_inside(module: str, parent: str) -> bool:
    if parent == "<root>":
        return module != "<root>"
    return module.startswith(parent + ".")




# ---------------------------------------------------------------------------------------------
# Failed checks and the tolerance that would have passed


def failed_checks(result: TensorResult) -> dict[str, Any]:
    """See :meth:`TensorResult.failed_checks`: the failures a status states, then the checks that
    ``judge`` failed (``Verdict.failed``) with the smallest value that would have passed each."""
    if result.passed:
        return {}
    if result.status == "missing-here":
        return {"missing": "this host produced no such tensor"}
    if result.status == "missing-in-golden":
        return {"missing": "the golden bundle has no such tensor"}
    if result.status == "shape-mismatch":
        return {"shape": f"{shape_text(result.here_shape)} here, {shape_text(result.shape)} in the golden"}
    if result.status in ("not-recorded", "not-replayable", "replay-error"):
        return {"replay": result.note}
    checks: dict[str, Any] = {}
    if result.status == "dtype-mismatch":
        checks["dtype"] = f"{result.here_dtype} here, {result.dtype} in the golden"
    metrics, needed = result.metrics, result.verdict.needed
    if metrics is None:
        return checks
    for key in result.verdict.failed:
        if key == "nan_policy":  # the positions differ: only "ignore" passes
            checks[key] = "ignore"
        elif key == "outlier_factor":
            checks[key] = needed.get(key, metrics.worst_bound_ratio)
        else:
            checks[key] = needed[key]
        if key == "max_mismatch_fraction":
            checks.update({alt: needed[alt] for alt in ("atol", "atol_rms", "rtol") if alt in needed})
    return checks


def hosts_summary(golden: Mapping[str, Any], here: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The ``HOST_KEYS`` of both fingerprints, for the report header."""
    return {"golden": {key: golden.get(key) for key in HOST_KEYS},
            "here": {key: here.get(key) for key in HOST_KEYS}}


def fingerprint_differences(golden: Mapping[str, Any], here: Mapping[str, Any]) -> list[FingerprintDifference]:
    """``NUMERICS_KEYS`` whose values differ (keys the golden did not record are skipped)."""
    return [FingerprintDifference(key, golden[key], here.get(key))
            for key in platform.NUMERICS_KEYS if key in golden and golden[key] != here.get(key)]


def shape_text(shape: tuple[int, ...] | None) -> str:
    return "?" if shape is None else "[" + ", ".join(str(n) for n in shape) + "]"


def would_pass_text(result: TensorResult) -> str | None:
    """``max_rel_l2 = 3.1e-5, min_cosine = 0.99999999953, ...``, or None if no tolerance would pass
    (:func:`parity.judge.policy.would_pass_from_checks`)."""
    return would_pass_from_checks(result.failed_checks())


def unrelaxable_checks(result: TensorResult) -> list[str]:
    """The failed checks' keys that no value in a tolerance file relaxes enough (the value that
    would pass is infinite or not a number: a rel L2 against an all-zero golden, say)."""
    return unrelaxable_from_checks(result.failed_checks())


def verdict_line(report: CompareReport) -> str:
    """``PARITY HOLDS: 12/12 tensors`` or ``PARITY FAILS: first failing tensor X (n of m tensors fail)``;
    where every tensor passes but a repeated run was not bitwise equal, ``PARITY FAILS: not
    deterministic: first X (n of m tensors differ run to run)``."""
    determinism = report.determinism
    if (determinism is not None and not determinism.passed and report.layers
            and all(result.passed for result in report.layers)):
        return (f"PARITY FAILS: not deterministic: first {printable(determinism.first_nondeterministic)} "
                f"({len(determinism.failing)} of {len(determinism.tensors)} tensors differ run to run "
                f"over {determinism.runs} runs)")
    line = verdict_from_counts(passed=report.passed, total=len(report.layers), fused=len(report.fused_here),
                               failing=len(report.failing), first_failing=report.first_failing_layer,
                               absent=len(report.absent_here))
    if report.seeds is not None:  # how many input draws every verdict rests on
        line += f" [{len(report.seeds.values)} seeds, judged on the worst]"
    return line


def verdict_from_counts(*, passed: bool, total: int, fused: int, failing: int, first_failing: str | None,
                        absent: int = 0) -> str:
    """:func:`verdict_line` from the counts alone (also how a JSON report without ``verdict``,
    written before the field existed, gets its line back). A passing line counts every recorded
    tensor and says how many of them were not compared here, and why."""
    uncompared = ([f"{fused} fused here, judged through their enclosing modules"] if fused else []) + (
        [f"{absent} absent here, outputs this host's module calls returned as None"] if absent else [])
    uncompared_text = f" ({'; '.join(uncompared)})" if uncompared else ""
    if passed:
        return f"PARITY HOLDS: {total}/{total} tensors{uncompared_text}"
    if total == 0:
        return "PARITY FAILS: nothing was compared (0 tensors)"
    return f"PARITY FAILS: first failing tensor {printable(first_failing)} ({failing} of {total} tensors fail)"
