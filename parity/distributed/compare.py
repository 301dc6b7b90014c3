"""Judging rank sets: against a run in one process, a run under torchrun of any world size, or another set.

Which tensors are judged against which:

- **the same world size and placements on both sides** (two rank sets, or a run under torchrun
  against a set of its size, split alike): rank against rank. Rank r's tensors are judged against the golden's rank r; a result is
  named ``NAME@rankR`` (the policy resolves it as ``NAME``).
- **another world size or split, or one process** (a plain bundle is a set of one): full tensors rebuilt
  from each side's placements (:class:`parity.distributed.views.FullView`) are judged. Where a sharded
  tensor fails, each rank's slice is judged again under the same tolerance and the ranks whose
  slice fails are named in the verdict; replicated copies that disagree fail the tensor, naming
  the rank.

Every rule of the engine applies unchanged (:class:`parity.judge.engine.Judge`): thresholds, the error
budget against the golden's reference (rebuilt like any tensor), ``fused-here``, strict structure.

A run under torchrun (:func:`compare_distributed`) runs the golden's subject split over this
run's ranks on the golden's stored inputs and state, records it into a scratch rank set
(:func:`parity.distributed.capture.record_ranks`, not fsynced) in a temporary directory, judges that on
rank 0, and deletes it. A run in one process (:func:`compare_rank_set`) judges each tensor as it
is produced, as ``parity compare`` does.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from parity.run import platform
from parity.bundle.reader import BundleReader, open_bundle
from parity.judge.compare import bytes_read, reference_scope, subject_state
from parity.judge.diff import check_same_run
from parity.judge.engine import (Judge, Obtained, absent_warning, bundle_outputs, compare_tensors, fused_warning,
                                 notes_as_warnings)
from parity.base.errors import ParityError, UsageError
from parity.judge.policy import Policy, Tolerance, as_policy
from parity.run.recorder import RecordedTensor, Recorder
from parity.run.resources import Meter
from parity.judge.results import CompareReport, TensorResult, fingerprint_differences, hosts_summary
from parity.run.runtime import Progress, check_device, check_triton_mode, fresh_copy, launch_configs
from parity.run.subjects import Inputs, runner_from_manifest
from parity.base.text import plural, printable
from .capture import record_ranks
from .group import Group, join
from .placement import PlacementMap
from .rankset import RankSet, looks_like_rank_set, open_rank_set
from .views import FullView, describe

_RANK_SUFFIX = re.compile(r"@rank\d+$")
_DIFF_WORDING = {"missing-here": "missing in the candidate: it recorded no such tensor",
                 "missing-in-golden": "missing in the golden: only the candidate recorded this tensor"}


def open_golden(path: str | os.PathLike | BundleReader | RankSet | FullView) -> FullView:
    """A rank set or a plain bundle, as full tensors (BundleError, one line, if it is not whole)."""
    if isinstance(path, FullView):
        return path
    if isinstance(path, (BundleReader, RankSet)):
        return FullView(path)
    return FullView(open_rank_set(path) if looks_like_rank_set(path) else open_bundle(path))


def rank_name(name: str, rank: int) -> str:
    return f"{name}@rank{rank}"


class RankJudge(Judge):
    """A judge of one rank's tensors: results are named ``NAME@rankR``, tolerances resolved for ``NAME``."""

    def __init__(self, golden: BundleReader, policy: Policy, budget: bool | None, *, rank: int, **kwargs: Any):
        super().__init__(golden, policy, budget, label=lambda key: rank_name(key, rank), **kwargs)
        self.rank = rank

    def tolerance(self, name: str, dtype: torch.dtype, has_reference: bool) -> Tolerance:
        return super().tolerance(_RANK_SUFFIX.sub("", name), dtype, has_reference)


# --------------------------------------------------------------------------------------------
# Verdicts on rebuilt tensors: replicas and ranks


def _with_reasons(result: TensorResult, reasons: list[str], *, fail: bool) -> TensorResult:
    if not reasons:
        return result
    verdict = dataclasses.replace(result.verdict, passed=result.verdict.passed and not fail,
                                  reasons=list(result.verdict.reasons) + reasons)
    status = "fail" if fail and result.status in ("pass", "fused-here", "absent-here") else result.status
    return dataclasses.replace(result, verdict=verdict, status=status)


def _failing_ranks(name: str, out: torch.Tensor, golden: torch.Tensor, reference: torch.Tensor | None,
                   tolerance: Tolerance, slices: list[tuple[int, int, int]], dim: int) -> list[int]:
    """The ranks whose slice (along ``dim``) fails under the tensor's own tolerance."""
    failing = []
    for rank, start, length in slices:
        if length == 0:
            continue
        part_ref = reference.narrow(dim, start, length) if reference is not None else None
        verdict = compare_tensors(name, out.narrow(dim, start, length), golden.narrow(dim, start, length),
                                  reference=part_ref, tolerance=tolerance)
        if not verdict.passed:
            failing.append(rank)
    return failing


def locate(result: TensorResult, key: str, out: torch.Tensor, golden: FullView,
           candidate: FullView | None, *, candidate_label: str = "this run") -> list[str]:
    """Reasons naming the ranks whose shard of a failing, sharded tensor differs (each side's own)."""
    if result.passed or result.metrics is None or tuple(out.shape) != golden.entry(key).shape:
        return []
    sides = []
    golden_slices = golden.slices(key)
    candidate_slices = candidate.slices(key) if candidate is not None and candidate.has(key) else None
    if golden_slices is None and candidate_slices is None:
        return []
    golden_full = golden.load(key, device=out.device)
    reference = None
    if result.rule == "budget" and golden.has(key, "reference"):
        reference = golden.load(key, "reference", device=out.device)
    for label, view, slices in (("golden", golden, golden_slices), (candidate_label, candidate, candidate_slices)):
        if slices is None or view is None:
            continue
        placement = view.placement(key)
        assert placement.dim is not None
        ranks = _failing_ranks(result.name, out, golden_full, reference, result.tolerance, slices, placement.dim)
        where = f"{label} ({view.world_size} ranks, {placement.text})"
        if len(ranks) == 1:
            sides.append(f"{where}: rank {ranks[0]}'s shard differs")
        elif ranks:
            sides.append(f"{where}: the shards of ranks {', '.join(map(str, ranks))} differ")
        else:
            sides.append(f"{where}: no single rank's shard fails alone; the error is spread over the shards")
    return [f"shards: {side}" for side in sides]


def _replica_reasons(view: FullView | None, key: str, label: str) -> list[str]:
    if view is None:
        return []
    return [f"{label} is replicated on every rank, but {d.text}" for d in view.disagreements.pop(("output", key), [])]


def judge_rebuilt(golden: FullView, source: Iterator[Obtained], policy: Policy, budget: bool | None, *,
                  candidate: FullView | None = None, wording: dict[str, str] | None = None,
                  has_reference: Callable[[str], bool] | None = None, candidate_label: str = "this run",
                  say: Progress | None = None) -> list[TensorResult]:
    """Judge full tensors from ``source`` against the rebuilt golden, in golden order."""
    judge = Judge(golden, policy, budget, wording=wording, has_reference=has_reference)
    results = []
    for item in source:
        result = judge(item)
        key = item.key or item.name
        reasons = _replica_reasons(golden, key, "the golden")
        reasons += _replica_reasons(candidate, key, candidate_label)
        result = _with_reasons(result, reasons, fail=True)
        if item.tensor is not None and golden.has(key):
            result = _with_reasons(result, locate(result, key, item.tensor, golden, candidate,
                                                  candidate_label=candidate_label), fail=False)
        results.append(result)
        if say is not None:
            say.tick(lambda: f"compared {plural(len(results), 'tensor')} ({sum(not r.passed for r in results)} failing)")
    return judge.in_golden_order(results)


def view_outputs(view: FullView, keys: set[str] | None = None) -> Iterator[Obtained]:
    """The rebuilt outputs of a view, one at a time, in its order."""
    for entry in view.entries_of("output"):
        if keys is None or entry.name in keys:
            yield Obtained(entry.name, view.load(entry.name), layer=entry.layer, path=entry.path)


def judge_rank_by_rank(golden: RankSet, candidate: RankSet, policy: Policy, budget: bool | None, *,
                       wording: dict[str, str] | None = None, both_references: bool = False,
                       strict: bool = False) -> list[TensorResult]:
    """Rank r of ``candidate`` against rank r of ``golden``, for every rank; the results in golden
    (execution) order, the ranks of one tensor next to each other."""
    keyed: list[tuple[int, int, int, TensorResult]] = []
    order = {entry.name: index for index, entry in enumerate(golden.rank0.entries_of("output"))}
    for rank, (expected, obtained) in enumerate(zip(golden.ranks, candidate.ranks)):
        def has_reference(key: str, expected=expected, obtained=obtained) -> bool:
            return expected.has(key, "reference") and (not both_references or obtained.has(key, "reference"))

        judge = RankJudge(expected, policy, budget, rank=rank, wording=wording, has_reference=has_reference)
        keys = None if strict else [entry.name for entry in obtained.entries_of("output") if expected.has(entry.name)]
        for number, item in enumerate(bundle_outputs(obtained, keys)):
            result = judge(Obtained(rank_name(item.name, rank), item.tensor, layer=item.layer, path=item.path,
                                    key=item.name))
            keyed.append((order.get(item.name, len(order)), rank, number, result))
        for key, result in judge.not_obtained().items():
            keyed.append((order[key], rank, -1, result))
    keyed.sort(key=lambda item: item[:3])
    return [item[3] for item in keyed]


# --------------------------------------------------------------------------------------------
# Reports


def _report(golden: FullView, results: list[TensorResult], *, policy: Policy, budget: bool | None, impl: str,
            device: str, here_platform: dict[str, Any], warnings: list[str], started: float,
            kernel_configs_here: Any, candidate: str | None, integrity: dict[str, Any]) -> CompareReport:
    differences = fingerprint_differences(golden.platform, here_platform)
    warnings = ([d.message for d in differences] + warnings + notes_as_warnings(results) + fused_warning(results)
                + absent_warning(results))
    return CompareReport(
        golden=str(golden.path), candidate=candidate, subject=golden.subject, impl=impl, golden_impl=golden.impl,
        device=device, policy=policy, layers=results, hosts=hosts_summary(golden.platform, here_platform),
        fingerprint_differences=differences, platforms={"golden": dict(golden.platform), "here": dict(here_platform)},
        budget=budget, warnings=warnings,
        kernel_configs={"golden": (golden.kernel_configs or {}).get("used"), "here": kernel_configs_here},
        seconds=time.monotonic() - started, integrity=integrity,
    )


def _resources(meter: Meter, results: list[TensorResult], *views: FullView) -> dict[str, Any]:
    """What the run cost (:mod:`parity.run.resources`): bytes read are every rank bundle's tensors read."""
    nbytes = sum(bytes_read(reader) for view in views for reader in view.readers)
    return meter.summary(tensors=len(results), nbytes=nbytes, direction="read")


def _add_integrity(*parts: dict[str, Any]) -> dict[str, Any]:
    total: dict[str, Any] = {"tensors": 0, "verified": 0, "not_read": {}}
    for part in parts:
        total["tensors"] += part["tensors"]
        total["verified"] += part["verified"]
        for kind, count in part["not_read"].items():
            total["not_read"][kind] = total["not_read"].get(kind, 0) + count
    return total


def _check_budget(budget: bool | None, *views: FullView) -> None:
    if budget is True:
        for view in views:
            if not view.entries_of("reference"):
                raise UsageError(f"--budget needs high-precision references; {describe(view)} was captured with "
                                 "--reference none")


PER_MODULE_WARNING = ("the golden's references are per module (each module on its own golden inputs): the results "
                      "are judged by the thresholds (the budget of such references is checked on an isolated replay, "
                      "which rank sets and distributed runs do not have)")


def _budget_of(view: FullView, budget: bool | None) -> tuple[bool | None, list[str]]:
    """The budget mode a run against ``view`` uses, and the warning that says why it changed: a
    golden with per-module references is judged by the thresholds (a UsageError for ``--budget``)."""
    if reference_scope(view.rank0) != "module":
        return budget, []
    if budget is True:
        raise UsageError(f"--budget with {describe(view)}: its references are per module, and their budget is checked "
                         "on an isolated replay (--isolate), which rank sets and distributed runs do not have")
    return False, [PER_MODULE_WARNING]


def golden_state(view: FullView, weights_dir: str | os.PathLike | None, *, checksums: bool = True):
    """The golden's subject state, read one tensor at a time: rank 0's stored tensors and the
    checkpoint files it names, verified first (:func:`parity.judge.compare.subject_state`)."""
    if view.rank0.weights is None and weights_dir is not None:
        raise UsageError(f"--weights-dir: {describe(view)} stores its weights; it names no checkpoint files")
    return subject_state(view.rank0, weights_dir, checksums=checksums)


# --------------------------------------------------------------------------------------------
# Entry points


def compare_rank_set(
    golden: str | os.PathLike | FullView | RankSet,
    *,
    impl: str = "triton",
    device: torch.device | str | None = None,
    policy: Policy | str | os.PathLike | None = None,
    budget: bool | None = None,
    progress: Callable[[str], None] | None = None,
    weights_dir: str | os.PathLike | None = None,
) -> CompareReport:
    """Run a rank set's subject in this one process (not split) and judge every tensor against the
    golden's full tensors, rebuilt from its placements; the arguments are
    :func:`parity.judge.compare.compare_bundle`'s (``isolate`` is not available for rank sets, so a
    set with per-module references is judged by the thresholds)."""
    started = time.monotonic()
    say = Progress(progress)
    policy = as_policy(policy)
    view = open_golden(golden)
    runner = runner_from_manifest(view.subject, trusted=policy.trusted_subjects, bundle_dir=view.path)
    runner.check_impl(impl)
    device = check_device(device if device is not None else platform.default_device())
    meter = Meter(device, started=started)
    check_triton_mode(impl, device)
    _check_budget(budget, view)
    budget, warnings = _budget_of(view, budget)
    state = golden_state(view, weights_dir)  # a checkpoint file that differs is refused before the build
    say(f"{describe(view)}: subject {runner.name}, {plural(len(view.entries_of('output')), 'recorded tensor')}")
    module = runner.build(impl, state=state, device=device)
    del state
    stored = Inputs.of_bundle(view.rank0)
    inputs = Inputs({name: fresh_copy(tensor, device) for name, tensor in stored.tensors.items()}, stored.meta)
    results: list[TensorResult] = []
    judge = Judge(view, policy, budget)

    def on_tensor(record: RecordedTensor) -> None:
        if record.kind != "output":
            return
        item = Obtained(record.name, record.tensor, layer=record.layer, path=record.path)
        result = judge(item)
        result = _with_reasons(result, _replica_reasons(view, record.name, "the golden"), fail=True)
        if view.has(record.name):
            result = _with_reasons(result, locate(result, record.name, record.tensor, view, None), fail=False)
        results.append(result)
        say.tick(lambda: f"compared {plural(len(results), 'tensor')} ({sum(not r.passed for r in results)} failing)")

    say(f"run impl {impl} on {device}")
    with Recorder(module, on_tensor, layers=view.capture_layers, copy=False):
        runner.run(module, inputs)
    del inputs
    ordered = judge.in_golden_order(results)
    report = _report(view, ordered, policy=policy, budget=budget, impl=impl, device=str(device),
                     here_platform=platform.fingerprint(device), warnings=warnings, started=started,
                     kernel_configs_here=launch_configs(module), candidate=None, integrity=view.integrity())
    report = dataclasses.replace(report, resources=_resources(meter, ordered, view))
    say(f"compared {plural(len(ordered), 'tensor')} in {report.seconds:.1f} s: {len(report.failing)} failing")
    return report


def diff_sets(
    golden: str | os.PathLike | FullView | RankSet | BundleReader,
    candidate: str | os.PathLike | FullView | RankSet | BundleReader,
    *,
    policy: Policy | str | os.PathLike | None = None,
    budget: bool | None = None,
    progress: Callable[[str], None] | None = None,
    check_run: bool = True,
    candidate_label: str = "the candidate",
    read: list[FullView] | None = None,
) -> CompareReport:
    """``parity diff`` where either side is a rank set: rank against rank for two sets of one world
    size and the same placements, full tensors rebuilt otherwise. Refusals as :func:`parity.diff.diff_bundles` (``check_run``
    False skips the inputs and weights check, for a compare's scratch set, which stores neither).
    ``read``: a list the two opened sides are appended to, for a caller that counts what was read."""
    started = time.monotonic()
    say = Progress(progress)
    policy = as_policy(policy)
    expected, obtained = open_golden(golden), open_golden(candidate)
    if read is not None:  # the caller counts what was read of both
        read.extend((expected, obtained))
    if check_run:
        check_same_run(expected.rank0, obtained.rank0)
    both = check_run
    _check_budget(budget, expected, *((obtained,) if both else ()))
    common = [entry.name for entry in obtained.entries_of("output") if expected.has(entry.name)]
    if not common:
        raise UsageError(f"cannot diff {describe(expected)} and {describe(obtained)}: they have no recorded tensor in "
                         "common (were they captured with disjoint --layers?)")
    extra = [entry.name for entry in obtained.entries_of("output") if not expected.has(entry.name)]
    say(f"{describe(obtained)} against {describe(expected)}: {plural(len(common), 'tensor')} in common")
    wording = _DIFF_WORDING if check_run else None
    same_layout = (expected.rank_set is not None and obtained.rank_set is not None
                   and expected.world_size == obtained.world_size
                   and all(expected.placement(name) == obtained.placement(name) for name in common))
    if same_layout:
        mode = "rank by rank"
        results = judge_rank_by_rank(expected.rank_set, obtained.rank_set, policy, budget, wording=wording,
                                     both_references=both, strict=policy.strict_structure)
    else:
        mode = "full tensors rebuilt"

        def has_reference(key: str) -> bool:
            return expected.has(key, "reference") and (not both or obtained.has(key, "reference"))

        keys = None if policy.strict_structure else set(common)
        results = judge_rebuilt(expected, view_outputs(obtained, keys), policy, budget, candidate=obtained,
                                wording=wording, has_reference=has_reference, candidate_label=candidate_label, say=say)
    shown = describe(obtained) if check_run else f"{candidate_label} ({obtained.world_size} ranks)"
    warnings = [f"{shown} judged against {describe(expected)}: {mode}"]
    if extra and not policy.strict_structure:
        shown = ", ".join(printable(name) for name in extra[:3]) + (f" and {len(extra) - 3} more" if len(extra) > 3 else "")
        warnings.append(f"{len(extra)} recorded tensor{'s' if len(extra) != 1 else ''} only in the candidate, not "
                        f"judged ({shown})")
    return _report(expected, results, policy=policy, budget=budget, impl=obtained.impl or "?",
                   device=obtained.device or "?", here_platform=obtained.platform, warnings=warnings, started=started,
                   kernel_configs_here=(obtained.kernel_configs or {}).get("used"), candidate=str(obtained.path),
                   integrity=_add_integrity(expected.integrity(), obtained.integrity()))


def compare_distributed(
    golden: str | os.PathLike,
    *,
    impl: str = "triton",
    device: torch.device | str | None = None,
    policy: Policy | str | os.PathLike | None = None,
    budget: bool | None = None,
    placements: PlacementMap | None = None,
    progress: Callable[[str], None] | None = None,
    group: Group | None = None,
    scratch: str | os.PathLike | None = None,
    weights_dir: str | os.PathLike | None = None,
) -> tuple[CompareReport | None, bool]:
    """Every rank of a torchrun launch: run the golden's subject split over this run's ranks and
    judge it (module docstring). Returns ``(report, passed)``: the report on rank 0 (None on the
    others) and the verdict on every rank. ``scratch``: where the scratch set is written (default:
    the system's temporary directory; a directory every rank can reach). ``weights_dir``: where
    the checkpoint files a golden names are on this host; the first rank of each host (``LOCAL_RANK``
    0) checks their digests (BLAKE3, else sha256), the others their presence and size, before any rank builds."""

    started = time.monotonic()
    group = group or join(device)
    meter = Meter(group.device, started=started)  # rank 0's cost is the report's
    policy = as_policy(policy)
    error: BaseException | None = None
    view = runner = None
    warnings: list[str] = []
    try:
        view = open_golden(golden)
        runner = runner_from_manifest(view.subject, trusted=policy.trusted_subjects, bundle_dir=view.path)
        runner.check_impl(impl)
        check_triton_mode(impl, group.device)
        _check_budget(budget, view)
        budget, warnings = _budget_of(view, budget)
        # One rank per host reads the files through for their digests; the files are the same for its
        # other ranks, which agree below only once it is done.
        state = golden_state(view, weights_dir, checksums=_local_rank() == 0)
        inputs = Inputs.of_bundle(view.rank0)
    except ParityError as err:
        error = err
    group.agree(error, "opening the golden")
    assert view is not None and runner is not None
    workdir = group.broadcast(tempfile.mkdtemp(prefix="parity-compare-", dir=scratch) if group.rank == 0 else None,
                              step="making the scratch directory")
    report, passed, error = None, False, None
    read: list[FullView] = []  # the golden and the scratch set, as diff_sets opened them
    try:
        record_ranks(group, runner, Path(workdir) / "run", impl=impl, state=state, inputs=inputs, store_subject=False,
                     layers=view.capture_layers, reference=None, placements=placements, durable=False,
                     progress=progress)
        if group.rank == 0:
            try:
                report = diff_sets(view, Path(workdir) / "run", policy=policy, budget=budget, progress=progress,
                                   check_run=False, candidate_label="this run", read=read)
                report = dataclasses.replace(report, candidate=None, impl=impl, device=str(group.device),
                                             warnings=warnings + report.warnings,
                                             resources=_resources(meter, report.layers, *read),
                                             platforms={**report.platforms, "here": platform.fingerprint(group.device)},
                                             seconds=time.monotonic() - started)
                passed = report.passed
            except ParityError as err:
                error = err
        group.agree(error, "judging")
        passed = bool(group.broadcast(passed, step="sharing the verdict"))
    finally:
        if group.rank == 0:
            shutil.rmtree(workdir, ignore_errors=True)
    return report, passed


def _local_rank() -> int:
    """This process's rank on its host (``LOCAL_RANK`` as torchrun sets it; 0 outside a launch)."""
    try:
        return int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return 0
