"""The golden lifecycle of pytest checks: record, judge, regenerate, keep the obtained tensors.

One lifecycle (:func:`perform_check`, pytest-regressions' ``perform_regression_check``) behind
both kinds of golden the plugin checks: tensors a test hands over (:func:`check_parity`) and a
whole subject run (:func:`check_subject`). Goldens are parity bundles, written atomically; the
judge is :class:`parity.judge.engine.Judge`, the same as ``compare``'s.

- a missing golden fails the check; with ``record`` it is written first, and the check still
  fails, saying so (a recording is never a pass);
- ``regen`` rewrites the goldens that fail (and the missing ones), and those checks fail saying
  what was regenerated; goldens that pass are left as they are, so committed binaries do not churn;
- on a failure the obtained tensors are kept as the bundle ``<name>.obtained`` in ``obtained_dir``
  (the plugin: pytest's temporary directory or ``--parity-obtained-dir``, so a failing run never
  writes into the source tree; without one, beside the golden), for diffing (``python -m parity
  diff``); its path is in the failure message, and a later pass removes it.

torch is imported inside the functions: the plugin imports this module when pytest loads it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from parity.base import dtypes
from parity.base.errors import UsageError
from parity.report.runs import determinism_lines, seeds_lines

OBTAINED_SUFFIX = ".obtained"
GOLDEN_FORMAT = "parity-plugin-golden"
_SINGLE = "tensor"  # bundle entry name of a golden that holds one bare tensor
_NAME_OK = re.compile(r"[A-Za-z0-9._+=,\-\[\]@]+")
# How the plugin words a tensor present on one side only.
_WORDING = {"missing-here": "in the golden, but not obtained", "missing-in-golden": "obtained, but not in the golden"}


class ParityFailure(AssertionError):
    """Parity does not hold (or a golden was missing, recorded or regenerated); ``str()`` says why."""

    def __init__(self, result: "ParityResult"):
        super().__init__(result.message)
        self.result = result


@dataclasses.dataclass
class CheckedTensor:
    """One tensor of a check: ``label`` is what the summary shows (the golden name, or
    ``<golden name>/<key>`` for a dict of tensors); ``result`` the engine's
    :class:`parity.judge.results.TensorResult`, or None where nothing was compared (a golden that was
    missing or has just been written)."""

    label: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    result: Any = None

    @property
    def layer(self) -> Any:
        """Deprecated name of ``result``."""
        return self.result

    @property
    def passed(self) -> bool:
        return self.result is not None and self.result.passed

    @classmethod
    def of(cls, result) -> "CheckedTensor":
        return cls(label=result.name, dtype=result.here_dtype or result.dtype,
                   shape=result.here_shape if result.here_shape is not None else result.shape, result=result)


def _derived(result) -> Any:
    isolated = getattr(result, "isolated", None)
    return getattr(isolated, "derived", None)


def _beyond(result) -> bool:
    derived = _derived(result)
    return bool(derived is not None and derived.beyond)


def _iso_bound(result) -> str | None:
    """The replayed error over the derived bound, as the reports print it (None: no bound)."""
    derived = _derived(result)
    if derived is None:
        return None
    from parity.base.numbers import format_ratio

    return format_ratio(derived.ratio)


@dataclasses.dataclass
class ParityResult:
    """What one check found: ``status`` is pass, fail, missing, recorded or regenerated."""

    name: str
    golden: Path
    status: str
    tensors: list[CheckedTensor]
    message: str = ""
    obtained: Path | None = None
    policy_source: str = ""
    test_id: str | None = None

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    @property
    def beyond_derived_bound(self) -> list[str]:
        """Labels of the tensors whose replay on the golden inputs (``isolate``) differs from the
        golden by more than the slack times their op's derived rounding bound."""
        return [tensor.label for tensor in self.tensors if _beyond(tensor.result)]

    def records(self) -> list[dict[str, Any]]:
        """JSON-safe per-tensor rows, for the summary and ``--parity-report``."""
        from parity.base.numbers import format_cosine, format_dtype, format_number
        from parity.judge.metrics import json_safe_float
        from parity.report.text import verdict_text

        rows = []
        for tensor in self.tensors or [CheckedTensor(label=self.name)]:
            result = tensor.result
            metrics = result.metrics if result is not None else None
            if result is None:
                status, verdict = self.status, self.status
            else:
                status, verdict = ("pass" if result.passed else "fail"), verdict_text(result)
                if self.status == "regenerated" and not result.passed:
                    verdict += " (regenerated)"
            number = {key: (json_safe_float(getattr(metrics, key)) if metrics is not None else None)
                      for key in ("cosine", "max_abs", "rel_l2", "mismatch_fraction")}
            rows.append({
                "test": self.test_id, "golden": str(self.golden), "tensor": tensor.label, "dtype": tensor.dtype,
                "shape": list(tensor.shape) if tensor.shape is not None else None, **number,
                "status": status, "verdict": verdict, "reasons": list(result.verdict.reasons) if result is not None else [],
                "beyond_derived_bound": _beyond(result), "iso_bound": _iso_bound(result),
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


@dataclasses.dataclass
class Judged:
    """A check's outcome against an existing golden: the results and the failure text. ``hint``:
    set where this run is not worth keeping beside the golden; what to do instead."""

    tensors: list[CheckedTensor]
    passed: bool
    text: str = ""
    hint: str | None = None


def obtained_path(golden: Path, name: str, obtained_dir: str | os.PathLike | None) -> Path:
    """Where a failing check keeps this run: ``<obtained_dir>/<name>.obtained``, or beside the golden
    without an ``obtained_dir``."""
    if obtained_dir is None:
        return golden.with_name(golden.name + OBTAINED_SUFFIX)
    return Path(obtained_dir) / (name + OBTAINED_SUFFIX)


def perform_check(path: Path, *, obtained_path: Path, record: bool, regen: bool, base: Mapping[str, Any], verb: str,
                  recorded_what: str, unjudged: list[CheckedTensor], write_golden: Callable[[Path, bool], None],
                  judge: Callable[[], Judged], write_obtained: Callable[[Path], str], regenerated: str) -> ParityResult:
    """The lifecycle (module docstring). ``write_golden(path, force)`` records the golden ``verb``
    (recorded, captured) from this run; ``judge()`` compares this run with it;
    ``write_obtained(obtained_path)`` keeps this run there and returns the sentence saying so;
    ``regenerated`` says how a failing golden was rewritten."""
    exists = _is_bundle(path)
    if not exists or record:
        write_golden(path, exists)
        _remove_obtained(obtained_path)
        why = f"re-{verb} (--parity-record)" if exists else f"missing and has been {verb}"
        return ParityResult(status="recorded", tensors=unjudged, **base, message=(
            f"parity: golden {path} was {why}{recorded_what}; "
            f"the test fails so that a recording is never a pass: rerun to check"))
    judged = judge()
    if judged.passed:
        _remove_obtained(obtained_path)
        return ParityResult(status="pass", tensors=judged.tensors, **base)
    if regen:
        write_golden(path, True)
        _remove_obtained(obtained_path)
        return ParityResult(status="regenerated", tensors=judged.tensors, **base, message=(
            f"{judged.text}\nparity: --parity-regen: golden {path} has been {regenerated}"))
    if judged.hint is not None:
        return ParityResult(status="fail", tensors=judged.tensors, **base, message=f"{judged.text}\n{judged.hint}")
    kept = write_obtained(obtained_path)
    return ParityResult(status="fail", tensors=judged.tensors, obtained=obtained_path, **base,
                        message=f"{judged.text}\n{kept}")


# ---------------------------------------------------------------------------------------------
# Tensor goldens


def check_parity(name: str, obtained: Any, *, golden_dir: str | os.PathLike, policy: Any = None, record: bool = False,
                 regen: bool = False, rootdir: str | os.PathLike | None = None,
                 test_id: str | None = None, obtained_dir: str | os.PathLike | None = None) -> ParityResult:
    """Compare ``obtained`` (a tensor or a mapping of names to tensors) with the golden bundle
    ``golden_dir/name`` through the lifecycle (a failure keeps this run in ``obtained_dir``, default
    beside the golden); never raises for a parity failure (see
    :func:`assert_parity`). Bad arguments, a bad policy file or a damaged golden raise
    ``parity.base.errors.UsageError`` (one line)."""
    name = check_name(name)
    kind, tensors = _normalize(name, obtained)
    from parity.judge.policy import as_policy  # the plugin's edge: a path or None becomes a Policy

    resolved = as_policy(policy, rootdir=rootdir)
    path = Path(golden_dir) / name

    def label(key: str) -> str:
        return name if kind == "tensor" else f"{name}/{key}"

    def write(target: Path, force: bool) -> None:
        _write_bundle(target, kind, tensors, name, test_id, force=force)

    def write_obtained(target: Path) -> str:
        write(target, True)
        return _kept_text("obtained tensors", target, path)

    def judge() -> Judged:
        from parity.bundle.reader import open_bundle
        from parity.judge.engine import Judge, Obtained

        with open_bundle(path) as bundle:
            golden_kind = (bundle.manifest.get("parity_golden") or {}).get("kind", "dict")
            if golden_kind != kind:
                keys = [entry.name for entry in bundle.entries_of("output")]
                problem = f"the golden holds {_describe(golden_kind, keys)}, this run obtained {_describe(kind, tensors)}"
                return Judged([], False, _failure_report(path, [], [problem], resolved.source))
            judge = Judge(bundle, resolved, label=label, wording=_WORDING)
            results = [judge(Obtained(label(key), tensor, key=key)) for key, tensor in tensors.items()]
            results += judge.not_obtained(strict=True).values()
        checked = [CheckedTensor.of(result) for result in results]
        passed = all(result.passed for result in results)
        return Judged(checked, passed, "" if passed else _failure_report(path, checked, [], resolved.source))

    unjudged = [CheckedTensor(label(key), dtypes.dtype_text(t.dtype), tuple(t.shape)) for key, t in tensors.items()]
    return perform_check(
        path, obtained_path=obtained_path(path, name, obtained_dir), record=record, regen=regen, verb="recorded",
        recorded_what=f" from this run ({_describe(kind, tensors)})",
        base=dict(name=name, golden=path, policy_source=resolved.source, test_id=test_id), unjudged=unjudged,
        write_golden=write, judge=judge, write_obtained=write_obtained,
        regenerated="rewritten from this run; the test fails so that a regeneration is never a pass: rerun to check")


def assert_parity(name: str, obtained: Any, *, golden_dir: str | os.PathLike, policy: Any = None,
                  record: bool = False, regen: bool = False, rootdir: str | os.PathLike | None = None,
                  test_id: str | None = None, obtained_dir: str | os.PathLike | None = None) -> ParityResult:
    """:func:`check_parity`, raising :class:`ParityFailure` (an AssertionError) unless it passed."""
    __tracebackhide__ = True
    result = check_parity(name, obtained, golden_dir=golden_dir, policy=policy, record=record, regen=regen,
                          rootdir=rootdir, test_id=test_id, obtained_dir=obtained_dir)
    if not result.passed:
        raise ParityFailure(result)
    return result


# ---------------------------------------------------------------------------------------------
# Subject goldens


def check_subject(subject: str, args: Mapping[str, Any] | None = None, *, golden: str | os.PathLike,
                  impl: str | None = None, device: Any = None, policy: Any = None, record: bool = False,
                  regen: bool = False, record_impl: str | None = None, rootdir: str | os.PathLike | None = None,
                  test_id: str | None = None, obtained_dir: str | os.PathLike | None = None, name: str | None = None,
                  impl_flag: str = "impl", device_flag: str = "device", repeat: int = 1,
                  allow_nondeterministic: tuple[str, ...] = (), seeds: int = 1, isolate: bool = False) -> ParityResult:
    """Run ``subject`` (a built-in name or ``package.module:factory``) with ``impl`` (default: the
    subject's ``reference_impl``) and compare it with the golden bundle ``golden`` through
    ``parity.judge.compare.compare_bundle``, with the same lifecycle as tensor goldens. A missing
    golden is captured with ``record_impl`` (default: the subject's reference implementation, the
    original one, as a capture host would). A golden captured from other subject arguments is a
    failure (re-captured with ``regen``). On failure this run is captured into
    ``<obtained_dir>/<name>.obtained`` (``name``: the golden's name, default the last part of its
    path; without ``obtained_dir``, beside the golden).

    ``impl_flag`` and ``device_flag`` are how the caller's user names ``impl`` and ``device`` (the
    plugin: ``--parity-impl``, ``--parity-device``), so that an unknown implementation or a Triton
    run on a CPU without the interpreter is reported in the user's own terms.

    ``repeat``: the implementation runs that many times and every tensor must also be bitwise
    equal run to run, except those matching an ``allow_nondeterministic`` glob
    (:mod:`parity.run.repeats`); the failure names the first that is not, with its spread.
    ``seeds``: a golden recorded here holds the input draws of that many seeds
    (:mod:`parity.run.seeds`); the check judges every draw a golden holds, each tensor on its worst.
    ``isolate``: a golden recorded here holds its modules' inputs, and the check replays every
    module on them (``compare --isolate``): each tensor's result then carries the error its module
    introduces and, where its op is known, that error over the derived rounding bound
    (``ParityResult.beyond_derived_bound``). A golden without inputs is a failure that says so.
    """
    import torch

    from parity.run import platform
    from parity.run.capture import capture
    from parity.run.subjects import load_subject

    from parity.run.repeats import check_runs

    repeat = check_runs(repeat, "repeat")  # before anything runs: a bad count is the test's error
    path = Path(golden)
    # The test names the subject, so the test suite vouches for it; the golden may only confirm
    # it (the spec check below) and is never where its code is imported from.
    runner = load_subject(subject, args, exclude_dirs=(path,))
    from parity.judge.policy import as_policy  # the plugin's edge: a path or None becomes a Policy

    resolved = as_policy(policy, rootdir=rootdir)
    recorder_impl = record_impl or runner.reference_impl
    impl = impl or runner.reference_impl
    run_device = device if device is not None else platform.default_device()
    for chosen, flag in ((impl, impl_flag), (recorder_impl, "record_impl")):
        if runner.impls is not None and chosen not in runner.impls:
            raise UsageError(f"subject {runner.name} has no implementation {chosen!r} ({flag}); choose from "
                             f"{', '.join(runner.impls)}")
    from parity.run.runtime import check_triton_mode

    check_triton_mode(impl, torch.device(run_device),
                      what=f"impl triton ({impl_flag}) on device cpu ({device_flag})")

    def write(target: Path, force: bool) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        capture(runner, target, impl=recorder_impl, device=run_device, force=force, seeds=seeds,
                record_inputs=isolate)

    def write_obtained(target: Path) -> str:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Repeated as the check was, so a nondeterministic run is kept (with where it differs)
        # instead of being refused by capture's hooks check.
        capture(runner, target, impl=impl, device=run_device, reference="none", force=True, repeat=repeat)
        return _kept_text(f"this run (impl {impl})", target, path)

    def judge() -> Judged:
        from parity.bundle.reader import open_bundle
        from parity.judge.compare import compare_bundle

        with open_bundle(path) as bundle:
            recorded = bundle.subject
            recorded_inputs = bool(bundle.entries_of("module_input")) if isolate else True
        wanted = runner.describe()
        if (recorded.get("spec"), recorded.get("args")) != (wanted["spec"], wanted["args"]):
            return Judged([], False, hint="rerun with --parity-regen to re-capture it", text=(
                f"parity: golden {path} was captured from subject {recorded.get('spec')!r} with arguments "
                f"{json.dumps(recorded.get('args'), sort_keys=True)[:300]}, but the test runs {wanted['spec']!r} "
                f"with {json.dumps(wanted['args'], sort_keys=True)[:300]}"))
        # Trusted for compare_bundle because the test named it and the golden records the same
        # spec (checked above); any other spec in a golden is refused there, before it is imported.
        trusting = dataclasses.replace(resolved, trusted_subjects=tuple(resolved.trusted_subjects) + (runner.spec,))
        if isolate and not recorded_inputs:
            return Judged([], False, hint="rerun with --parity-regen to re-capture it with its inputs", text=(
                f"parity: golden {path} holds no module inputs, which --parity-isolate (isolate=) replays"))
        report = compare_bundle(path, impl=impl, device=device, policy=trusting, repeat=repeat,
                                allow_nondeterministic=allow_nondeterministic, isolate=isolate)
        checked = [CheckedTensor.of(result) for result in report.layers]
        if report.passed:
            return Judged(checked, True)
        text = _failure_report(path, checked, [], resolved.source)
        if report.first_failing_layer:
            text += f"\nfirst failing tensor in execution order: {report.first_failing_layer}"
        if report.seeds is not None and report.seeds.failing_seeds:
            text += "\n" + "\n".join(seeds_lines(report.seeds.to_dict()))
        if report.determinism is not None and not report.determinism.passed:
            text += "\n" + "\n".join(determinism_lines(report.determinism.to_dict()))
        return Judged(checked, False, text)

    return perform_check(
        path, obtained_path=obtained_path(path, name or path.name, obtained_dir), record=record, regen=regen,
        verb="captured", recorded_what=f" (subject {runner.name}, impl {recorder_impl})",
        base=dict(name=path.name, golden=path, policy_source=resolved.source, test_id=test_id), unjudged=[],
        write_golden=write, judge=judge, write_obtained=write_obtained,
        regenerated=f"re-captured with impl {recorder_impl}")


# ---------------------------------------------------------------------------------------------
# Names and bundles


def check_name(name: str) -> str:
    """``name`` if it is a usable golden name (safe characters, ``/``-separated parts), else UsageError."""

    if not isinstance(name, str) or not name:
        raise UsageError(f"a golden name must be a non-empty string, got {name!r}")
    for part in name.split("/"):
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


def _normalize(name: str, obtained: Any) -> tuple[str, dict[str, Any]]:
    """(kind, {key: tensor}) for a bare tensor ("tensor") or a mapping of names to tensors ("dict")."""
    import torch

    if isinstance(obtained, torch.Tensor):
        kind, tensors = "tensor", {_SINGLE: obtained}
    elif isinstance(obtained, Mapping):
        if not obtained:
            raise UsageError(f"parity check {name!r}: the mapping of tensors is empty")
        kind, tensors = "dict", {}
        for key, value in obtained.items():
            if not isinstance(key, str) or not key:
                raise UsageError(f"parity check {name!r}: tensor names must be non-empty strings, got {key!r}")
            if not isinstance(value, torch.Tensor):
                raise UsageError(f"parity check {name!r}: {key!r} is a {type(value).__name__}, not a tensor")
            tensors[key] = value
    else:
        raise UsageError(f"parity check {name!r}: expected a tensor or a mapping of tensors, got "
                         f"{type(obtained).__name__}")
    for key, tensor in tensors.items():
        if tensor.is_complex():
            raise UsageError(f"parity check {name!r}: {key!r} is complex; complex tensors are not supported")
    return kind, {key: tensor.detach() for key, tensor in tensors.items()}


def _describe(kind: str, keys) -> str:
    if kind == "tensor":
        return "a single tensor"
    keys = list(keys)
    return f"a dict of {len(keys)} tensor{'s' if len(keys) != 1 else ''} ({', '.join(keys)})"


def _write_bundle(path: Path, kind: str, tensors: Mapping[str, Any], name: str, test_id: str | None,
                  *, force: bool) -> None:
    from parity.bundle.writer import BundleWriter
    from parity.run import platform

    device = next(iter(tensors.values())).device
    path.parent.mkdir(parents=True, exist_ok=True)
    with BundleWriter(path, force=force) as writer:
        for key, tensor in tensors.items():
            writer.add("output", key, tensor, layer=key)
        writer.commit({
            "subject": {"spec": "parity.plugin", "name": name, "args": {}},  # a label of plugin goldens, not a module
            "parity_golden": {"format": GOLDEN_FORMAT, "kind": kind, "keys": list(tensors), "test": test_id},
            "platform": platform.fingerprint(device),
        })


def _remove_obtained(path: Path) -> None:
    """Delete a stale ``<golden>.obtained`` bundle (never anything that is not a bundle)."""
    if _is_bundle(path) and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)


def _is_bundle(path: Path) -> bool:
    from parity.bundle.manifest import MANIFEST_NAME

    return path.is_dir() and (path / MANIFEST_NAME).is_file()


# ---------------------------------------------------------------------------------------------
# Failure messages


def _pct(count: int, total: int) -> str:
    return f"{100.0 * count / total:.3g}%" if total else "0%"


def _kept_text(what: str, target: Path, golden: Path) -> str:
    return (f"{what} kept in {target} (a parity bundle: python -m parity diff {golden} {target} compares them; "
            f"--parity-regen accepts this run as the golden)")


def describe_tensor(tensor: CheckedTensor) -> list[str]:
    """At most four lines on one tensor's comparison, in the spirit of ``torch.testing.assert_close``:
    what failed (the verdict), by how much against which tolerance (the mismatch count and
    percentage against the element bound, then each failing aggregate against its limit), the
    worst element once (index and both values), and the smallest tolerance that would have passed.
    A passing tensor is one line. A tensor that was not compared (shape, dtype, missing) is its
    verdict and the reason."""
    from parity.base.numbers import cosine_pair, format_cosine, format_number, format_plain, number_pair
    from parity.judge.results import would_pass_text
    from parity.report.text import verdict_text

    result = tensor.result
    shape = list(tensor.shape) if tensor.shape is not None else "?"
    head = f"{tensor.label}: {verdict_text(result)}  {tensor.dtype} {shape}"
    metrics = result.metrics
    if result.passed:
        return [f"{head}  cosine {format_cosine(metrics.cosine)}, max abs {format_number(metrics.max_abs)}, "
                f"rel L2 {format_number(metrics.rel_l2)}" if metrics is not None else head]
    if metrics is None or result.status == "dtype-mismatch":  # not compared, or refused before the numbers
        return [head] + [f"  {reason}" for reason in result.verdict.reasons]
    tol = result.tolerance
    failed = set(result.verdict.failed)
    bound = f"atol {format_number(tol.atol)}"
    if tol.atol_rms:
        bound += f" + atol_rms {format_number(tol.atol_rms)} x golden rms {format_number(metrics.ref_rms)}"
    mismatched = (f"  mismatched elements: {metrics.mismatch_count} / {metrics.finite_count} finite "
                  f"({_pct(metrics.mismatch_count, metrics.finite_count)}, allowed "
                  f"{_pct(tol.max_mismatch_fraction, 1)}) outside {bound} + rtol {format_number(tol.rtol)} x |golden|")
    if metrics.outlier_count and tol.outlier_factor is not None:
        mismatched += f"; {metrics.outlier_count} beyond {format_plain(tol.outlier_factor)}x that bound"
    aggregates = []
    if "min_cosine" in failed:
        aggregates.append("cosine {} (min {})".format(*cosine_pair(metrics.cosine, tol.min_cosine)))
    if "max_rel_l2" in failed:
        aggregates.append("rel L2 {} (max {})".format(*number_pair(metrics.rel_l2, tol.max_rel_l2)))
    if "max_abs" in failed and tol.max_abs is not None:
        aggregates.append("max abs {} (max {})".format(*number_pair(metrics.max_abs, tol.max_abs)))
    if "max_ulp" in failed:
        aggregates.append(f"{metrics.ulp_max} ULP (max {tol.max_ulp})")
    if not metrics.nonfinite_positions_agree:
        aggregates.append(
            f"NaN/Inf positions differ at {metrics.nonfinite_mismatch_count} of {metrics.numel} "
            f"({_pct(metrics.nonfinite_mismatch_count, metrics.numel)}), first at "
            f"{list(metrics.first_nonfinite_mismatch_index)}")
    worst = ""
    if metrics.worst_index is not None:
        worst = (f"  greatest |difference|: {format_number(abs(metrics.worst_out - metrics.worst_ref))} at "
                 f"{list(metrics.worst_index)} (obtained {metrics.worst_out:.8g}, golden {metrics.worst_ref:.8g})")
    third = "; ".join(part for part in [worst.strip()] + aggregates if part)
    lines = [head, mismatched] + ([f"  {third}"] if third else [])
    would_pass = would_pass_text(result)
    if would_pass:
        last = f"  would pass with: {would_pass}"
    elif result.status != "dtype-mismatch":
        last = "  no tolerance makes this pass"
    else:
        last = ""
    # The error budget has no metric of its own above: its reasons (the last ones, as the budget
    # is judged last, possibly several) say it.
    verdict = result.verdict
    others = list(verdict.reasons[list(verdict.failed).index("budget_k"):]) if "budget_k" in verdict.failed else []
    extra = "; ".join(others + [f"note: {note}" for note in result.verdict.notes])
    if extra:
        last = f"{last}; {extra}" if last else f"  {extra}"
    return lines + ([last] if last else [])


def _failure_report(path: Path, tensors: list[CheckedTensor], problems: list[str], policy_source: str) -> str:
    """The failure message: one head line, then each failing tensor (:func:`describe_tensor`);
    the passing ones are only counted in the head."""
    failing = [tensor for tensor in tensors if not tensor.passed]
    head = (f"parity: {len(failing)} of {len(tensors)} tensors differ from golden {path} (policy: {policy_source})"
            if tensors else f"parity: this run does not match golden {path} (policy: {policy_source})")
    lines = [head] + problems
    for tensor in failing:
        lines += describe_tensor(tensor)
    return "\n".join(lines)
