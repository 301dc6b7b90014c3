"""Diff: judge one bundle's recorded tensors against another's, without running anything.

``diff_bundles(golden, candidate)`` compares two captures of the same subject, arguments, inputs
and weights (for example one captured on the NVIDIA host and one on the AMD host, or two CI runs)
with the engine of ``compare`` (:class:`parity.judge.engine.Judge`): the same metrics, policies, budget,
report (:class:`parity.judge.results.CompareReport`, with ``candidate`` set) and exit statuses. The
golden is the expected side; the candidate's tensors are read one at a time and judged.

Refused (UsageError, exit 2): a damaged bundle (BundleError, from the reader), bundles of
different subjects or subject arguments, different inputs or weights (by the manifests'
checksums), and bundles with no recorded tensor in common. Bundles are data: nothing named in
either manifest is imported or run.

Structure. A tensor only in the golden is ``missing-here`` (``fused-here`` inside a compared
module, ``absent-here`` where the candidate recorded other outputs of the same layer call, as in
compare); one only in the candidate is a warning (the captures recorded different
layers), a ``missing-in-golden`` failure with ``strict_structure``.

Error budget: where both bundles hold a high-precision reference of a tensor, the candidate's
error against the *golden's* reference is held to ``k`` times the golden's own (``budget`` as in
compare; ``True`` requires references in both). Where the candidate's reference disagrees with
the golden's beyond rounding, a warning says so: the two references were not computed alike.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from parity.base.errors import ParityError, UsageError
from parity.base.text import plural, printable
from parity.bundle import checksums
from parity.bundle.reader import BundleReader, open_bundle
from parity.judge.checks import accumulation_eps
from parity.judge.engine import Judge, absent_warning, bundle_outputs, fused_warning, integrity, notes_as_warnings
from parity.judge.policy import Policy, as_policy
from parity.judge.results import CompareReport, fingerprint_differences, hosts_summary
from parity.run.runtime import Progress
from parity.run.subjects.base import is_builtin, load_subject

_WORDING = {"missing-here": "missing in the candidate bundle: it recorded no such tensor",
            "missing-in-golden": "missing in the golden bundle: only the candidate recorded this tensor"}
# A reference agrees with another when their rel L2 is within this many ulps of its arithmetic.
REFERENCE_AGREEMENT_ULPS = 64


def diff_bundles(
    golden: str | os.PathLike | BundleReader,
    candidate: str | os.PathLike | BundleReader,
    *,
    policy: Policy | str | os.PathLike | None = None,
    budget: bool | None = None,
    progress: Callable[[str], None] | None = None,
) -> CompareReport:
    """Judge every recorded output of ``candidate`` against ``golden`` (both bundle directories or
    open readers); ``policy`` and ``budget`` as in :func:`parity.judge.compare.compare_bundle`.
    Raises UsageError for the refusals in the module docstring."""
    started = time.monotonic()
    say = Progress(progress)
    policy = as_policy(policy)
    expected = golden if isinstance(golden, BundleReader) else open_bundle(golden)
    obtained = candidate if isinstance(candidate, BundleReader) else open_bundle(candidate)
    check_same_run(expected, obtained)
    common = [entry.name for entry in obtained.entries_of("output") if expected.has(entry.name)]
    if not common:
        raise UsageError(f"cannot diff {_show(expected)} and {_show(obtained)}: they have no recorded tensor in "
                         "common (were they captured with disjoint --layers?)")
    if budget is True:
        for bundle in (expected, obtained):
            if not bundle.entries_of("reference"):
                raise UsageError(f"--budget needs high-precision references in both bundles; {_show(bundle)} was "
                                 "captured with --reference none")

    def both_have_reference(key: str) -> bool:
        return expected.has(key, "reference") and obtained.has(key, "reference")

    extra = [entry.name for entry in obtained.entries_of("output") if not expected.has(entry.name)]
    judged = None if policy.strict_structure else common
    say(f"{_show(obtained)} against {_show(expected)}: {plural(len(common), 'tensor')} in common")
    order = [entry.name for entry in obtained.entries_of("output") if judged is None or expected.has(entry.name)]
    judge = Judge(expected, policy, budget, has_reference=both_have_reference, wording=_WORDING, read_ahead=order)
    try:
        results = judge.in_golden_order(list(judge.judge_all(bundle_outputs(obtained, judged))))
    finally:
        judge.close()

    warnings = [d.message for d in fingerprint_differences(expected.platform, obtained.platform)]
    if extra and not policy.strict_structure:
        shown = ", ".join(printable(name) for name in extra[:3]) + (f" and {len(extra) - 3} more" if len(extra) > 3 else "")
        warnings.append(f"{len(extra)} recorded tensor{'s' if len(extra) != 1 else ''} only in the candidate, not "
                        f"judged ({shown}): the captures recorded different layers (strict_structure = true makes "
                        "them failures)")
    warnings += _reference_warnings(expected, obtained, [r.name for r in results if r.rule == "budget"])
    warnings += notes_as_warnings(results) + fused_warning(results) + absent_warning(results)
    report = CompareReport(
        golden=str(expected.path), candidate=str(obtained.path), subject=expected.subject,
        impl=obtained.impl or "?", golden_impl=expected.impl, device=obtained.device or "?", policy=policy,
        layers=results, hosts=hosts_summary(expected.platform, obtained.platform),
        fingerprint_differences=fingerprint_differences(expected.platform, obtained.platform),
        platforms={"golden": dict(expected.platform), "here": dict(obtained.platform)}, budget=budget,
        warnings=warnings,
        kernel_configs={"golden": (expected.kernel_configs or {}).get("used"),
                        "here": (obtained.kernel_configs or {}).get("used")},
        seconds=time.monotonic() - started, integrity=_integrity(expected, obtained),
        independent_cases=_independent_cases(expected),
    )
    say(f"compared {plural(len(results), 'tensor')} in {report.seconds:.1f} s: {len(report.failing)} failing")
    return report


def _independent_cases(bundle: BundleReader) -> int:
    """How many independent cases a built-in subject's bundle holds (its case set: the error
    growth line then shows the peak, not a growth between cases); 0 otherwise. Only a built-in
    subject is loaded (parity's own code); diff imports nothing a bundle names."""
    spec, args = bundle.subject.get("spec"), bundle.subject.get("args")
    if not isinstance(spec, str) or not is_builtin(spec) or not isinstance(args, dict):
        return 0
    try:
        runner = load_subject(spec, args)
    except ParityError:  # arguments this version of the built-in rejects, or cannot hold: compare would say so
        return 0
    return len(runner.case_ids({entry.layer.split(".")[0] for entry in bundle.entries_of("output") if entry.layer}))


def check_same_run(golden: BundleReader, candidate: BundleReader) -> None:
    """UsageError unless both bundles captured the same subject spec and arguments on the same
    inputs and weights (the manifests' checksums of every ``input`` and ``state`` tensor; where the
    two bundles use different checksum algorithms, the candidate's tensors are read and hashed
    with the golden's)."""
    first, second = golden.subject, candidate.subject
    prefix = f"cannot diff {_show(golden)} and {_show(candidate)}"
    if first.get("spec") != second.get("spec"):
        raise UsageError(f"{prefix}: they capture different subjects ({printable(str(first.get('spec')))!r} and "
                         f"{printable(str(second.get('spec')))!r})")
    args_a, args_b = first.get("args") or {}, second.get("args") or {}
    if not same_arguments(args_a, args_b):
        where, value_a, value_b = _first_difference(args_a, args_b, "")
        raise UsageError(f"{prefix}: their subject arguments differ (first at {printable(where)}: "
                         f"{_brief(value_a)} vs {_brief(value_b)})")
    for kind, what in (("input", "inputs"), ("state", "weights")):
        sums_a, sums_b = _checksums(golden, kind, golden.checksum), _checksums(candidate, kind, golden.checksum)
        if sums_a != sums_b:
            names = sorted(name for name in set(sums_a) | set(sums_b) if sums_a.get(name) != sums_b.get(name))
            shown = ", ".join(printable(name) for name in names[:3]) + (
                f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise UsageError(f"{prefix}: their {what} differ ({golden.checksum} checksums of {shown}); diff compares captures "
                             f"of the same {what}")


def same_arguments(first: Any, second: Any) -> bool:
    """Equal subject arguments (JSON values), where a mapping key that one side lacks equals a
    neutral value on the other (0, False, None, empty): subjects add fields with neutral defaults,
    so a capture by an older version records fewer (the ``prefix``/``docs`` fields of attention
    cases). ``...`` stands for an absent value."""
    if isinstance(first, Mapping) and isinstance(second, Mapping):
        return all(same_arguments(first.get(key, ...), second.get(key, ...)) for key in set(first) | set(second))
    if isinstance(first, (list, tuple)) and isinstance(second, (list, tuple)):
        return len(first) == len(second) and all(same_arguments(a, b) for a, b in zip(first, second))
    if first is ... or second is ...:
        other = second if first is ... else first
        return other is ... or other in (0, None, False, "", [], {})
    return first == second and isinstance(first, bool) == isinstance(second, bool)


def _first_difference(first: Any, second: Any, where: str) -> tuple[str, Any, Any]:
    """The path (``cases[3].seed``) and both values of the first argument that differs."""
    if isinstance(first, Mapping) and isinstance(second, Mapping):
        for key in sorted(set(first) | set(second), key=str):
            if not same_arguments(first.get(key, ...), second.get(key, ...)):
                return _first_difference(first.get(key, ...), second.get(key, ...), f"{where}.{key}".lstrip("."))
    if isinstance(first, (list, tuple)) and isinstance(second, (list, tuple)) and len(first) == len(second):
        for index, (a, b) in enumerate(zip(first, second)):
            if not same_arguments(a, b):
                return _first_difference(a, b, f"{where}[{index}]")
    return where or "arguments", first, second


def _checksums(bundle: BundleReader, kind: str, algorithm: str) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """Each ``kind`` tensor's (checksum by ``algorithm``, dtype, shape): from the manifest where the
    bundle records that algorithm, else read (and verified) and hashed."""
    if bundle.checksum == algorithm:
        return {entry.name: (entry.checksum, entry.dtype, tuple(entry.shape)) for entry in bundle.entries_of(kind)}
    return {entry.name: (checksums.of_tensor(algorithm, tensor), entry.dtype, tuple(entry.shape))
            for entry, tensor in bundle.iter_tensors(kind)}


def _brief(value: Any) -> str:
    text = "absent" if value is ... else json.dumps(value, sort_keys=True, default=str)
    return printable(text if len(text) <= 60 else text[:57] + "...")


def _show(bundle: BundleReader) -> str:
    return printable(str(bundle.path))


def _reference_warnings(golden: BundleReader, candidate: BundleReader, names: list[str]) -> list[str]:
    """Tensors whose two references differ beyond rounding (the budget used the golden's)."""
    disagree: list[tuple[str, float]] = []
    for name in names:
        ref_a = golden.load(name, "reference")
        ref_b = candidate.load(name, "reference")
        distance = reference_distance(ref_a, ref_b)
        if distance > REFERENCE_AGREEMENT_ULPS * accumulation_eps(ref_a.dtype):
            disagree.append((name, distance))
    if not disagree:
        return []
    worst = max(disagree, key=lambda item: item[1])
    return [f"the candidate's high-precision reference differs from the golden's beyond rounding for "
            f"{len(disagree)} tensor{'s' if len(disagree) != 1 else ''} (largest rel L2 {worst[1]:.1e} at "
            f"{printable(worst[0])}); the budget used the golden's reference"]


def reference_distance(first: torch.Tensor, second: torch.Tensor) -> float:
    """Rel L2 between two references in float64 over the elements finite in both; inf where their
    shapes or non-finite positions differ."""
    if first.shape != second.shape:
        return float("inf")
    a, b = first.double(), second.double()
    finite_a, finite_b = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(finite_a, finite_b) or not torch.equal(a[~finite_a].nan_to_num(), b[~finite_b].nan_to_num()):
        return float("inf")
    a, b = a[finite_a], b[finite_b]
    norm = torch.linalg.vector_norm(a).item()
    distance = torch.linalg.vector_norm(a - b).item()
    return distance / norm if norm > 0 else (0.0 if distance == 0 else float("inf"))


def _integrity(*bundles: BundleReader) -> dict[str, Any]:
    """Both bundles' integrity (``engine.integrity``) added up."""
    total: dict[str, Any] = {"tensors": 0, "verified": 0, "not_read": {}}
    for bundle in bundles:
        part = integrity(bundle)
        total["tensors"] += part["tensors"]
        total["verified"] += part["verified"]
        for kind, count in part["not_read"].items():
            total["not_read"][kind] = total["not_read"].get(kind, 0) + count
    return total
