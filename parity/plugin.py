"""pytest plugin asserting parity against goldens (registered through the pytest11 entry point).

In a test::

    def test_attention(parity_check):
        out, lse = run_my_kernel()
        parity_check({"out": out, "lse": lse})            # golden <test dir>/goldens/<module>/<test id>
        parity_check(out, name="B1-Hq2-...-s0")           # golden <test dir>/goldens/B1-Hq2-...-s0

    @pytest.mark.parity(golden="attention-smoke", policy="tests/parity.toml")
    def test_subject(parity_check):
        parity_check.subject("attention", {"cases": "smoke"})   # a whole subject run, via compare_bundle

Without the fixture: ``assert_parity(name, tensor_or_dict, golden_dir=..., policy=...)``.

Goldens are parity bundles (:mod:`parity.bundle`), one per golden name, written atomically. The
same metrics (:mod:`parity.metrics`) and tolerance policies (:mod:`parity.policy`) as ``compare``
decide. Lifecycle:

- a missing golden fails the test; with ``--parity-record`` it is written first, and the test
  still fails, saying so (a recording is never a pass);
- ``--parity-regen`` rewrites the goldens that fail (and the missing ones), and those tests fail
  saying what was regenerated; goldens that pass are left as they are, so committed binaries
  do not churn;
- on a failure the obtained tensors are written beside the golden, as the bundle
  ``<golden>.obtained``, for diffing; a later pass removes it.

Policy, most specific first: ``policy=`` of the call, ``policy=`` of the ``parity`` marker,
``--parity-tolerances FILE``, ``[tool.parity]`` of the rootdir's ``pyproject.toml``, the built-in
defaults. A policy is a ``parity.policy.Policy`` or a path to a TOML file.

Each check's per-tensor results ride on the test report (``user_properties`` entries named
``parity``, JSON), so the end-of-run summary and ``--parity-report FILE`` (JSON) also work under
pytest-xdist, where the controller aggregates what the workers report.

Errors. Unusable input (a bad name, policy or golden) and an exception raised by a subject's own
code (make_inputs, build, forward: a :class:`parity.errors.SubjectError`) fail the test with one
line, like the CLI's exit statuses 2 and 3; ``PARITY_DEBUG=1`` shows a subject's traceback.

Trust. ``parity_check.subject(spec)`` builds the subject the test names; a golden bundle only
confirms it (a golden recorded from another spec fails). The golden's directory is never searched
for the subject's module, the same rule as ``compare`` (:mod:`parity.subjects.base`).

torch, safetensors and Hypothesis are imported inside hooks, fixtures and helpers, never when
pytest loads this module.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from .options import add_pytest_options

MARKER = "parity"
PROPERTY = "parity"  # the user_properties key of per-tensor results
OBTAINED_SUFFIX = ".obtained"
GOLDEN_FORMAT = "parity-plugin-golden"
_SINGLE = "tensor"  # bundle entry name of a golden that holds one bare tensor
_MARKER_KWARGS = ("golden", "policy", "subject", "args", "impl", "record_impl")
_NAME_OK = re.compile(r"[A-Za-z0-9._+=,\-\[\]@]+")

MARKER_HELP = (
    "parity(golden=None, policy=None, subject=None, args=None, impl=None, record_impl=None): "
    "defaults for the parity_check fixture: the golden name, a tolerance policy (Policy or TOML path), "
    "the subject and its args for parity_check.subject(), the impl to run and the impl that records"
)


class ParityFailure(AssertionError):
    """Parity does not hold (or a golden was missing, recorded or regenerated); ``str()`` says why."""

    def __init__(self, result: "ParityResult"):
        super().__init__(result.message)
        self.result = result


# ---------------------------------------------------------------------------------------------
# Results


@dataclasses.dataclass
class TensorResult:
    """One tensor of a check: ``label`` is what the summary shows (the golden name, or
    ``<golden name>/<key>`` for a dict of tensors); ``layer`` is compare's
    :class:`parity.compare.LayerResult` (metrics, tolerance, verdict, status), or None where
    nothing was compared (a golden that was missing or has just been written)."""

    label: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    layer: Any = None

    @property
    def passed(self) -> bool:
        return self.layer is not None and self.layer.passed


@dataclasses.dataclass
class ParityResult:
    """What one check found: ``status`` is pass, fail, missing, recorded or regenerated."""

    name: str
    golden: Path
    status: str
    tensors: list[TensorResult]
    message: str = ""
    obtained: Path | None = None
    policy_source: str = ""
    test_id: str | None = None

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def records(self) -> list[dict[str, Any]]:
        """JSON-safe per-tensor rows, for the summary and ``--parity-report``."""
        from .metrics import json_safe_float
        from .report import format_cosine, format_dtype, format_number, verdict_text

        rows = []
        for tensor in self.tensors or [TensorResult(label=self.name)]:
            layer = tensor.layer
            metrics = layer.metrics if layer is not None else None
            if layer is None:
                status, verdict = self.status, self.status
            else:
                status, verdict = ("pass" if layer.passed else "fail"), verdict_text(layer)
                if self.status == "regenerated" and not layer.passed:
                    verdict += " (regenerated)"
            rows.append({
                "test": self.test_id,
                "golden": str(self.golden),
                "tensor": tensor.label,
                "dtype": tensor.dtype,
                "shape": list(tensor.shape) if tensor.shape is not None else None,
                "cosine": json_safe_float(metrics.cosine) if metrics is not None else None,
                "max_abs": json_safe_float(metrics.max_abs) if metrics is not None else None,
                "rel_l2": json_safe_float(metrics.rel_l2) if metrics is not None else None,
                "mismatch_fraction": json_safe_float(metrics.mismatch_fraction) if metrics is not None else None,
                "status": status,
                "verdict": verdict,
                "reasons": list(layer.verdict.reasons) if layer is not None else [],
                # Formatted where the check ran, so that the xdist controller prints the summary
                # without importing torch.
                "text": {
                    "dtype": format_dtype(tensor.dtype),
                    "cosine": format_cosine(metrics.cosine if metrics is not None else None),
                    "max_abs": format_number(metrics.max_abs if metrics is not None else None),
                    "rel_l2": format_number(metrics.rel_l2 if metrics is not None else None),
                },
            })
        return rows


# ---------------------------------------------------------------------------------------------
# Policies


def resolve_policy(policy: Any = None, *, rootdir: str | os.PathLike | None = None):
    """A ``Policy`` from a Policy, a TOML path, or None (``[tool.parity]`` of ``rootdir/pyproject.toml``
    if it has one, else the built-in defaults). A bad file raises ``parity.errors.UsageError``."""
    from .errors import UsageError
    from .policy import Policy, load_policy

    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, (str, os.PathLike)):
        from .errors import check_readable_file

        check_readable_file(policy, "tolerance file")  # a FIFO would block the test run forever
        return load_policy(policy)
    if policy is not None:
        raise UsageError(f"a parity policy is a parity.policy.Policy or a TOML path, got {type(policy).__name__}")
    if rootdir is None:
        return Policy()
    from .compare import policy_for_cli  # the CLI's rule: [tool.parity] of pyproject.toml, else built-ins

    return policy_for_cli(None, cwd=rootdir)


# ---------------------------------------------------------------------------------------------
# Comparing tensors


def _normalize(name: str, obtained: Any) -> tuple[str, dict[str, Any]]:
    """(kind, {key: tensor}) for a bare tensor ("tensor") or a mapping of names to tensors ("dict")."""
    import torch

    from .errors import UsageError

    if isinstance(obtained, torch.Tensor):
        tensors = {_SINGLE: obtained}
        kind = "tensor"
    elif isinstance(obtained, Mapping):
        if not obtained:
            raise UsageError(f"parity check {name!r}: the mapping of tensors is empty")
        tensors = {}
        for key, value in obtained.items():
            if not isinstance(key, str) or not key:
                raise UsageError(f"parity check {name!r}: tensor names must be non-empty strings, got {key!r}")
            if not isinstance(value, torch.Tensor):
                raise UsageError(f"parity check {name!r}: {key!r} is a {type(value).__name__}, not a tensor")
            tensors[key] = value
        kind = "dict"
    else:
        raise UsageError(f"parity check {name!r}: expected a tensor or a mapping of tensors, got "
                         f"{type(obtained).__name__}")
    for key, tensor in tensors.items():
        if tensor.is_complex():
            raise UsageError(f"parity check {name!r}: {key!r} is complex; complex tensors are not supported")
    return kind, {key: tensor.detach() for key, tensor in tensors.items()}


def _label(name: str, kind: str, key: str) -> str:
    return name if kind == "tensor" else f"{name}/{key}"


def _dtype_label(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_result(label: str, layer) -> TensorResult:
    return TensorResult(label=label, dtype=layer.here_dtype or layer.dtype,
                        shape=layer.here_shape if layer.here_shape is not None else layer.shape, layer=layer)


def _missing(label: str, status: str, reason: str, dtype: str, shape: tuple[int, ...], policy, *,
             here: bool) -> TensorResult:
    """A tensor on one side only, as compare reports it (status missing-here / missing-in-golden)."""
    from .compare import LayerResult
    from .policy import Verdict

    layer = LayerResult(name=label, status=status, dtype=dtype, shape=shape, tolerance=policy.resolve(label, dtype),
                        verdict=Verdict(passed=False, reasons=[reason]),
                        here_dtype=dtype if here else None, here_shape=shape if here else None)
    return _tensor_result(label, layer)


def _check_name(name: str) -> str:
    from .errors import UsageError

    if not isinstance(name, str) or not name:
        raise UsageError(f"a golden name must be a non-empty string, got {name!r}")
    parts = name.split("/")
    for part in parts:
        if part in ("", ".", "..") or not _NAME_OK.fullmatch(part) or part.endswith(OBTAINED_SUFFIX):
            raise UsageError(
                f"bad golden name {name!r}: use letters, digits and ._+=,-[]@ in '/'-separated parts, "
                f"no empty, '.' or '..' parts, and no part ending in {OBTAINED_SUFFIX}"
            )
    return name


def default_golden_name(nodeid: str) -> str:
    """``tests/test_x.py::TestA::test_b[p-1]`` -> ``test_x/TestA.test_b[p-1]`` (safe characters only)."""
    path, _, rest = nodeid.partition("::")
    module = Path(path).stem or "tests"
    rest = rest.replace("::", ".") or "test"
    return "/".join(re.sub(r"[^A-Za-z0-9._+=,\-\[\]@]", "_", part).strip(".") or "_" for part in (module, rest))


def _write_bundle(path: Path, kind: str, tensors: Mapping[str, Any], name: str, test_id: str | None,
                  *, force: bool) -> None:
    from . import platform
    from .bundle import BundleWriter

    device = next(iter(tensors.values())).device
    path.parent.mkdir(parents=True, exist_ok=True)
    with BundleWriter(path, force=force) as writer:
        for key, tensor in tensors.items():
            writer.add("output", key, tensor, layer=key)
        writer.commit({
            "subject": {"spec": "parity.plugin", "name": name, "args": {}},
            "parity_golden": {"format": GOLDEN_FORMAT, "kind": kind, "keys": list(tensors), "test": test_id},
            "platform": platform.fingerprint(device),
        })


def _remove_obtained(path: Path) -> None:
    """Delete a stale ``<golden>.obtained`` bundle (never anything that is not a bundle)."""
    from .bundle import MANIFEST_NAME

    if path.is_dir() and not path.is_symlink() and (path / MANIFEST_NAME).is_file():
        shutil.rmtree(path, ignore_errors=True)


def _is_bundle(path: Path) -> bool:
    from .bundle import MANIFEST_NAME

    return path.is_dir() and (path / MANIFEST_NAME).is_file()


def check_parity(
    name: str,
    obtained: Any,
    *,
    golden_dir: str | os.PathLike,
    policy: Any = None,
    record: bool = False,
    regen: bool = False,
    rootdir: str | os.PathLike | None = None,
    test_id: str | None = None,
) -> ParityResult:
    """Compare ``obtained`` (a tensor or a mapping of names to tensors) with the golden bundle
    ``golden_dir/name`` and apply the golden lifecycle (module docstring); never raises for a
    parity failure (see :func:`assert_parity`). Bad arguments, a bad policy file or a damaged
    golden raise ``parity.errors.UsageError`` (one line).
    """
    from .bundle import open_bundle

    name = _check_name(name)
    kind, tensors = _normalize(name, obtained)
    resolved = resolve_policy(policy, rootdir=rootdir)
    path = Path(golden_dir) / name
    obtained_path = path.with_name(path.name + OBTAINED_SUFFIX)
    base = dict(name=name, golden=path, policy_source=resolved.source, test_id=test_id)

    # Golden lifecycle (pytest-regressions, syrupy): a missing golden is written from this run and
    # the test still fails; --parity-record (the reference host) re-records every golden it checks.
    exists = _is_bundle(path)
    if not exists or record:
        _write_bundle(path, kind, tensors, name, test_id, force=exists)
        _remove_obtained(obtained_path)
        why = "re-recorded (--parity-record)" if exists else "missing and has been recorded"
        return ParityResult(status="recorded", tensors=_unjudged(name, kind, tensors), **base, message=(
            f"parity: golden {path} was {why} from this run ({_describe(kind, tensors)}); "
            f"the test fails so that a recording is never a pass: rerun to check"))

    from .compare import compare_tensors

    with open_bundle(path) as bundle:
        golden_kind = (bundle.manifest.get("parity_golden") or {}).get("kind", "dict")
        entries = {entry.name: entry for entry in bundle.entries_of("output")}
        results: list[TensorResult] = []
        problems: list[str] = []
        if golden_kind != kind:
            problems.append(
                f"the golden holds {_describe(golden_kind, entries)}, this run obtained {_describe(kind, tensors)}")
        else:
            for key, tensor in tensors.items():
                label = _label(name, kind, key)
                if key not in entries:
                    results.append(_missing(label, "missing-in-golden", "obtained, but not in the golden",
                                            _dtype_label(tensor.dtype), tuple(tensor.shape), resolved, here=True))
                    continue
                golden = bundle.load(entries[key], device=tensor.device)
                results.append(_tensor_result(label, compare_tensors(label, tensor, golden, policy=resolved)))
            for key, entry in entries.items():
                if key not in tensors:
                    results.append(_missing(_label(name, kind, key), "missing-here", "in the golden, but not obtained",
                                            entry.dtype, tuple(entry.shape), resolved, here=False))
    passed = not problems and all(result.passed for result in results)
    if passed:
        _remove_obtained(obtained_path)
        return ParityResult(status="pass", tensors=results, **base)

    report = _failure_report(path, results, problems, resolved.source)
    if regen:
        _write_bundle(path, kind, tensors, name, test_id, force=True)
        _remove_obtained(obtained_path)
        return ParityResult(status="regenerated", tensors=results, **base, message=(
            f"{report}\nparity: --parity-regen: golden {path} has been rewritten from this run; "
            f"the test fails so that a regeneration is never a pass: rerun to check"))
    _write_bundle(obtained_path, kind, tensors, name, test_id, force=True)
    return ParityResult(status="fail", tensors=results, obtained=obtained_path, **base, message=(
        f"{report}\nobtained tensors saved beside the golden: {obtained_path} (a parity bundle; "
        f"rerun with --parity-regen to accept them as the golden)"))


def assert_parity(name: str, obtained: Any, *, golden_dir: str | os.PathLike, policy: Any = None,
                  record: bool = False, regen: bool = False, rootdir: str | os.PathLike | None = None,
                  test_id: str | None = None) -> ParityResult:
    """:func:`check_parity`, raising :class:`ParityFailure` (an AssertionError) unless it passed."""
    __tracebackhide__ = True
    result = check_parity(name, obtained, golden_dir=golden_dir, policy=policy, record=record, regen=regen,
                          rootdir=rootdir, test_id=test_id)
    if not result.passed:
        raise ParityFailure(result)
    return result


def _unjudged(name: str, kind: str, tensors: Mapping[str, Any]) -> list[TensorResult]:
    return [TensorResult(_label(name, kind, key), _dtype_label(t.dtype), tuple(t.shape)) for key, t in tensors.items()]


def _describe(kind: str, tensors: Mapping[str, Any]) -> str:
    if kind == "tensor":
        return "a single tensor"
    return f"a dict of {len(tensors)} tensor{'s' if len(tensors) != 1 else ''} ({', '.join(tensors)})"


# ---------------------------------------------------------------------------------------------
# Failure messages


def _pct(count: int, total: int) -> str:
    return f"{100.0 * count / total:.3g}%" if total else "0%"


def describe_tensor(result: TensorResult) -> list[str]:
    """Lines describing one tensor's comparison: verdict and reasons; on failure the mismatch count
    and percentage, the worst element with its index and both values, NaN/Inf agreement, and the
    smallest tolerance that would have passed (compare's "would pass with", TOML-ready)."""
    from .report import format_cosine, format_number, verdict_text, would_pass_text

    layer = result.layer
    shape = list(result.shape) if result.shape is not None else "?"
    head = f"{result.label}: {verdict_text(layer)}  {result.dtype} {shape}"
    metrics = layer.metrics
    summary = "" if metrics is None else (
        f"cosine {format_cosine(metrics.cosine)}, max abs {format_number(metrics.max_abs)}, "
        f"mean abs {format_number(metrics.mean_abs)}, rel L2 {format_number(metrics.rel_l2)}")
    if layer.passed:
        return [f"{head}  {summary}"]
    lines = [head] + [f"  {reason}" for reason in layer.verdict.reasons]
    if metrics is not None:
        tol = layer.tolerance
        bound = f"atol {format_number(tol.atol)}"
        if tol.atol_rms:
            bound += f" + atol_rms {format_number(tol.atol_rms)} x golden rms {format_number(metrics.ref_rms)}"
        lines.append(
            f"  mismatched: {metrics.mismatch_count} of {metrics.finite_count} finite elements "
            f"({_pct(metrics.mismatch_count, metrics.finite_count)}) outside {bound} + rtol "
            f"{format_number(tol.rtol)} x |golden|")
        if metrics.worst_index is not None:
            lines.append(
                f"  worst element at {list(metrics.worst_index)}: obtained {metrics.worst_out!r}, golden "
                f"{metrics.worst_ref!r} (|diff| {format_number(abs(metrics.worst_out - metrics.worst_ref))})")
        counts = (f"(obtained {metrics.nan_out} NaN, {metrics.inf_out} Inf; golden {metrics.nan_ref} NaN, "
                  f"{metrics.inf_ref} Inf)")
        if metrics.nonfinite_positions_agree:
            lines.append(f"  NaN/Inf positions agree {counts}")
        else:
            lines.append(
                f"  NaN/Inf positions DISAGREE at {metrics.nonfinite_mismatch_count} of {metrics.numel} elements "
                f"({_pct(metrics.nonfinite_mismatch_count, metrics.numel)}), first at "
                f"{list(metrics.first_nonfinite_mismatch_index)} {counts}")
        lines.append(f"  {summary}")
    would_pass = would_pass_text(layer)
    if would_pass:
        lines.append(f"  smallest tolerance that would have passed: {would_pass}")
    elif layer.status != "dtype-mismatch":
        lines.append("  no tolerance makes this pass")
    lines += [f"  note: {note}" for note in layer.verdict.notes]
    return lines


def _failure_report(path: Path, results: list[TensorResult], problems: list[str], policy_source: str) -> str:
    failing = [result for result in results if not result.passed]
    head = (f"parity: {len(failing)} of {len(results)} tensors differ from golden {path} (policy: {policy_source})"
            if results else f"parity: this run does not match golden {path} (policy: {policy_source})")
    lines = [head] + problems
    for result in results:
        lines += describe_tensor(result)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Subjects (a whole run, through compare_bundle)


def check_subject(
    subject: str,
    args: Mapping[str, Any] | None = None,
    *,
    golden: str | os.PathLike,
    impl: str = "triton",
    device: Any = None,
    policy: Any = None,
    record: bool = False,
    regen: bool = False,
    record_impl: str | None = None,
    rootdir: str | os.PathLike | None = None,
    test_id: str | None = None,
) -> ParityResult:
    """Run ``subject`` (a built-in name or ``package.module:factory``) with ``impl`` and compare it
    with the golden bundle ``golden`` through ``parity.compare.compare_bundle``, with the golden
    lifecycle of tensor checks. A missing golden is captured (``--parity-record``) with
    ``record_impl`` (default: the subject's reference implementation, the original one, as a
    capture host would). A golden captured from other subject arguments is a failure (regenerated
    with ``--parity-regen``). On failure this run is captured into ``<golden>.obtained``.
    """
    from .capture import capture
    from .subjects import load_subject

    path = Path(golden)
    obtained_path = path.with_name(path.name + OBTAINED_SUFFIX)
    # The test names the subject, so the test suite vouches for it; the golden may only confirm
    # it (the spec check below) and is never where its code is imported from.
    runner = load_subject(subject, args, exclude_dirs=(path,))
    resolved = resolve_policy(policy, rootdir=rootdir)
    base = dict(name=path.name, golden=path, policy_source=resolved.source, test_id=test_id)
    recorder_impl = record_impl or runner.reference_impl
    run_device = device if device is not None else _default_device()

    def record_golden(force: bool) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        capture(runner, path, impl=recorder_impl, device=run_device, force=force)

    exists = _is_bundle(path)
    if not exists or record:  # the same lifecycle as tensor goldens (check_parity)
        record_golden(force=exists)
        why = "re-captured (--parity-record)" if exists else "missing and has been captured"
        return ParityResult(status="recorded", tensors=[], **base, message=(
            f"parity: golden {path} was {why} (subject {runner.name}, impl {recorder_impl}); "
            f"the test fails so that a recording is never a pass: rerun to check"))

    from .bundle import open_bundle

    with open_bundle(path) as bundle:
        recorded = bundle.subject
    wanted = runner.describe()
    if (recorded.get("spec"), recorded.get("args")) != (wanted["spec"], wanted["args"]):
        message = (f"parity: golden {path} was captured from subject {recorded.get('spec')!r} with arguments "
                   f"{json.dumps(recorded.get('args'), sort_keys=True)[:300]}, but the test runs {wanted['spec']!r} "
                   f"with {json.dumps(wanted['args'], sort_keys=True)[:300]}")
        if regen:
            record_golden(force=True)
            return ParityResult(status="regenerated", tensors=[], **base,
                                message=f"{message}\nparity: --parity-regen: golden {path} has been re-captured")
        return ParityResult(status="fail", tensors=[], **base,
                            message=f"{message}\nrerun with --parity-regen to re-capture it")

    from .compare import compare_bundle

    # Trusted for compare_bundle because the test named it and the golden records the same spec
    # (checked above); any other spec in a golden is refused there, before it is imported.
    trusting = dataclasses.replace(resolved, trusted_subjects=tuple(resolved.trusted_subjects) + (runner.spec,))
    report = compare_bundle(path, impl=impl, device=device, policy=trusting)
    results = [_tensor_result(layer.name, layer) for layer in report.layers]
    if report.passed:
        _remove_obtained(obtained_path)
        return ParityResult(status="pass", tensors=results, **base)
    text = _failure_report(path, results, [], resolved.source)
    first = getattr(report, "first_failing_layer", None)
    if first:
        text += f"\nfirst failing layer in execution order: {first}"
    if regen:
        record_golden(force=True)
        return ParityResult(status="regenerated", tensors=results, **base, message=(
            f"{text}\nparity: --parity-regen: golden {path} has been re-captured with impl {recorder_impl}"))
    capture(runner, obtained_path, impl=impl, device=run_device, reference="none", force=True)
    return ParityResult(status="fail", tensors=results, obtained=obtained_path, **base, message=(
        f"{text}\nthis run (impl {impl}) captured beside the golden: {obtained_path}"))


def _default_device():
    from . import platform

    return platform.default_device()


# ---------------------------------------------------------------------------------------------
# pytest integration


@dataclasses.dataclass
class _State:
    golden_dir: Path | None
    impl: str
    device: str | None
    tolerances: str | None
    report: Path | None
    record: bool
    regen: bool
    rootdir: Path
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    is_worker: bool = False


STATE = pytest.StashKey[_State]()


def pytest_addoption(parser):
    add_pytest_options(parser.getgroup("parity", "numerical parity against golden bundles"))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    config.addinivalue_line("markers", MARKER_HELP)
    here = config.invocation_params.dir

    def absolute(value):
        return None if value is None else (here / value).resolve()

    config.stash[STATE] = _State(
        golden_dir=absolute(config.getoption("parity_golden")),
        impl=config.getoption("parity_impl"),
        device=config.getoption("parity_device"),
        tolerances=str(absolute(config.getoption("parity_tolerances"))) if config.getoption("parity_tolerances")
        else None,
        report=absolute(config.getoption("parity_json")),
        record=config.getoption("parity_record"),
        regen=config.getoption("parity_regen"),
        rootdir=config.rootpath,
        is_worker=hasattr(config, "workerinput"),
    )
    config.pluginmanager.register(_Aggregator(config.stash[STATE]), "parity-aggregator")
    # `--hypothesis-profile parity-gpu`: the parity profiles must exist before Hypothesis' own
    # plugin loads the named one in its pytest_configure (this hook runs first).
    profile = config.getoption("hypothesis_profile", None)
    if isinstance(profile, str) and profile.startswith("parity-"):
        from . import strategies  # noqa: F401  (registers the profiles)


class ParityChecker:
    """The ``parity_check`` fixture: checks bound to one test, its marker and the run's options."""

    def __init__(self, request: pytest.FixtureRequest):
        self._request = request
        self._state: _State = request.config.stash[STATE]
        self._marker = _marker_kwargs(request.node)
        self._checked: set[str] = set()

    @property
    def golden_dir(self) -> Path:
        """Where this test's goldens live: ``--parity-golden-dir``, else ``<test file dir>/goldens``."""
        if self._state.golden_dir is not None:
            return self._state.golden_dir
        return Path(self._request.node.path).parent / "goldens"

    def golden_name(self, name: str | None = None) -> str:
        if name is not None:
            return name
        return self._marker.get("golden") or default_golden_name(self._request.node.nodeid)

    def _policy(self, policy: Any):
        if policy is not None:
            return policy
        if self._marker.get("policy") is not None:
            return self._marker["policy"]
        return self._state.tolerances

    def _run(self, name: str, check) -> ParityResult:
        __tracebackhide__ = True  # the failure is the message, not the plugin's frames
        from .errors import SubjectError, UsageError, debug_from_environment

        if name in self._checked:
            pytest.fail(f"parity: golden {name!r} checked twice in one test; give each check its own name=",
                        pytrace=False)
        self._checked.add(name)
        try:
            result = check()
        except UsageError as err:
            problem = f"parity: {err}"
        except SubjectError as err:
            # The subject's own code raised: a failing test with the one line the CLI prints,
            # never a pass; PARITY_DEBUG=1 keeps the traceback (the original is chained).
            if debug_from_environment():
                raise
            problem = f"parity: {err}; set PARITY_DEBUG=1 for the traceback"
        else:
            problem = None
        if problem is not None:  # outside the except block: one line, no chained traceback
            pytest.fail(problem, pytrace=False)
        for row in result.records():
            self._request.node.user_properties.append((PROPERTY, json.dumps(row, allow_nan=False)))
        if not result.passed:
            raise ParityFailure(result)
        return result

    def __call__(self, obtained: Any, name: str | None = None, *, policy: Any = None) -> ParityResult:
        """Assert that ``obtained`` (a tensor or a mapping of names to tensors) matches its golden."""
        __tracebackhide__ = True
        golden = self.golden_name(name)
        state = self._state
        return self._run(golden, lambda: check_parity(
            golden, obtained, golden_dir=self.golden_dir, policy=self._policy(policy), record=state.record,
            regen=state.regen, rootdir=state.rootdir, test_id=self._request.node.nodeid))

    check = __call__

    def subject(self, subject: str | None = None, args: Mapping[str, Any] | None = None, *,
                name: str | None = None, policy: Any = None, impl: str | None = None,
                record_impl: str | None = None) -> ParityResult:
        """Assert that a whole subject run (``--parity-impl`` on ``--parity-device``) matches its golden bundle."""
        __tracebackhide__ = True
        subject = subject or self._marker.get("subject")
        if subject is None:
            pytest.fail("parity: parity_check.subject() needs a subject (as an argument or in the parity marker)",
                        pytrace=False)
        args = args if args is not None else self._marker.get("args")
        golden = self.golden_name(name)
        state = self._state
        run_impl = impl or self._marker.get("impl") or state.impl
        record_impl = record_impl or self._marker.get("record_impl")
        return self._run(golden, lambda: check_subject(
            subject, args, golden=self.golden_dir / _check_name(golden), impl=run_impl, device=state.device,
            policy=self._policy(policy), record=state.record, regen=state.regen, record_impl=record_impl,
            rootdir=state.rootdir, test_id=self._request.node.nodeid))


def _marker_kwargs(node) -> dict[str, Any]:
    marker = node.get_closest_marker(MARKER)
    if marker is None:
        return {}
    kwargs = dict(marker.kwargs)
    if marker.args:
        if len(marker.args) > 1 or "golden" in kwargs:
            pytest.fail(f"parity marker on {node.nodeid}: at most one positional argument, the golden name",
                        pytrace=False)
        kwargs["golden"] = marker.args[0]
    unknown = set(kwargs) - set(_MARKER_KWARGS)
    if unknown:
        pytest.fail(f"parity marker on {node.nodeid}: unknown argument(s) {', '.join(sorted(unknown))}; "
                    f"expected {', '.join(_MARKER_KWARGS)}", pytrace=False)
    return kwargs


@pytest.fixture
def parity_check(request) -> ParityChecker:
    """Assert parity against goldens: ``parity_check(tensor_or_dict, name=None, policy=None)`` and
    ``parity_check.subject(subject, args)``; see ``parity.plugin``."""
    return ParityChecker(request)


class _Aggregator:
    """Collects the per-tensor rows of every test report into the run's state (registered per config,
    so that a hook without a config argument can reach it)."""

    def __init__(self, state: _State):
        self.state = state

    def pytest_runtest_logreport(self, report):
        # Every phase's report carries the item's user_properties as they were then; the teardown
        # report comes last and holds all of them. Under xdist this runs on the controller for the
        # workers' reports too (they arrive serialized, user_properties included).
        if report.when == "teardown":
            self.state.records.extend(json.loads(value) for key, value in report.user_properties if key == PROPERTY)


def _sorted_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # xdist delivers reports in completion order; sort so the summary is the same run to run.
    return sorted(rows, key=lambda row: (row.get("test") or "", row.get("tensor") or ""))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    state = config.stash.get(STATE, None)
    if state is None or not state.records:
        return
    from tabulate import tabulate

    rows = _sorted_rows(state.records)
    table = []
    for row in rows:
        text = row.get("text") or {}
        table.append([row.get("test") or "-", row.get("tensor"), text.get("dtype", "-"), text.get("cosine", "-"),
                      text.get("max_abs", "-"), text.get("rel_l2", "-"), row.get("verdict")])
    passed = sum(1 for row in rows if row.get("status") == "pass")
    terminalreporter.section("parity summary")
    for line in tabulate(table, headers=["test", "tensor", "dtype", "cosine", "max abs", "rel L2", "verdict"],
                         tablefmt="github", disable_numparse=True).splitlines():
        terminalreporter.write_line(line)
    terminalreporter.write_line(f"parity: {len(rows)} tensors checked: {passed} pass, {len(rows) - passed} not")


def pytest_sessionfinish(session, exitstatus):
    state = session.config.stash.get(STATE, None)
    if state is None or state.is_worker or state.report is None:
        return
    rows = _sorted_rows(state.records)
    passed = sum(1 for row in rows if row.get("status") == "pass")
    payload = {"format": "parity-pytest-report", "checked": len(rows), "passed": passed,
               "not_passed": len(rows) - passed, "tensors": rows}
    state.report.parent.mkdir(parents=True, exist_ok=True)
    tmp = state.report.with_name(state.report.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(tmp, state.report)
