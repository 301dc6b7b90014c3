"""Compare: run a golden bundle's subject on this host and judge every recorded tensor as it is produced.

How a bundle is compared (:func:`compare_bundle`):

1. Open the bundle (lazy, checksummed); re-create its subject from the manifest (only a trusted
   spec: :mod:`parity.run.subjects.base`); build the module for ``impl`` on ``device`` from the
   bundle's stored state, and run it once on the bundle's stored inputs (never regenerated: GPU
   random generators differ between vendors).
2. A :class:`~parity.run.recorder.Recorder` (with the capture's own ``--layers`` globs) hands over
   each tensor as it is produced, on its own device, to the :class:`~parity.judge.engine.Judge`, which
   loads its golden counterpart only then (the engine's module docstring has the statuses, the
   ``fused-here`` rule and the error-budget modes of ``budget``).
   The stored state is read into the module in bounded chunks (a
   :class:`~parity.run.subjects.base.StateSource`), never whole; a bundle that names its
   checkpoint files instead (schema 5, :mod:`parity.bundle.weights`) has them verified (BLAKE3, else sha256)
   *before* anything is built, and the weights are read from them.
3. ``isolate=True`` (bundles captured with ``--record-inputs``): every recorded layer call is
   replayed on its *golden* inputs (:func:`~parity.judge.engine.replayed_layers`) and judged again. A
   layer that fails end to end but passes in isolation inherits its error from upstream; one that
   fails in isolation introduces it (``CompareReport.introducing_layers`` keeps the innermost).
   Isolated results are diagnostic: ``report.passed`` is decided by the end-to-end results alone.

Per-module references (capture ``--reference-scope module``). Such a reference is each
module's exact output on the capture host's own inputs to it, so the capture host's error against
it is what that module introduces. The end-to-end run's error also holds what the layers before
inherited, so the budget is not applied to it (the thresholds judge it, and a warning says so);
the isolated replay, where this host's module runs on the same golden inputs, is judged with the
budget against the per-module reference: the flash-attention rule, one module at a time.

Platform. Differences between the two hosts' fingerprints in ``platform.NUMERICS_KEYS`` (TF32,
reduced-precision reductions, deterministic mode, Triton FP fusion and fp32 dot precision) are
warnings: informational, never failures. Versions and device names differ by design and are
shown in the report header only.

The result model lives in :mod:`parity.judge.results`, the engine in :mod:`parity.judge.engine`,
device and interpreter checks in :mod:`parity.run.runtime`, policy loading in :mod:`parity.judge.policy`.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

import torch

from parity.base.errors import UsageError
from parity.base.text import plural, printable
from parity.bundle import weights as checkpoint_weights
from parity.bundle.reader import BundleReader, open_bundle
from parity.judge.engine import (Judge, Obtained, absent_warning, fused_warning, integrity, notes_as_warnings,
                                 replayed_layers)
from parity.judge.policy import Policy, as_policy
from parity.run.repeats import DeterminismReport, RepeatTracker, capture_repeat_warning, check_runs
from parity.judge.results import CompareReport, TensorResult, fingerprint_differences, hosts_summary
from parity.judge.seeds import combine
from parity.run import platform
from parity.run.recorder import RecordedTensor, Recorder, select_modules
from parity.run.resources import Meter, Phases, weights_stage
from parity.run.runtime import Progress, check_device, check_triton_mode, fresh_copy, launch_configs
from parity.run.seeds import DrawView, draw_views
from parity.run.subjects import Inputs, runner_from_manifest
from parity.run.subjects.base import StateSource, SubjectRunner, check_trusted


def compare_bundle(
    golden: str | os.PathLike | BundleReader,
    *,
    impl: str = "triton",
    device: torch.device | str | None = None,
    policy: Policy | str | os.PathLike | None = None,
    isolate: bool = False,
    progress: Callable[[str], None] | None = None,
    budget: bool | None = None,
    weights_dir: str | os.PathLike | None = None,
    repeat: int = 1,
    allow_nondeterministic: Sequence[str] = (),
) -> CompareReport:
    """Run the golden bundle's subject here with ``impl`` and compare every recorded tensor.

    ``golden``: a bundle directory (or an open reader). ``device``: default ``cuda`` when a GPU is
    present, else ``cpu``. ``policy``: a Policy, a tolerance file path, or None for the built-in
    defaults (the CLI also reads ``[tool.parity]`` from ``./pyproject.toml``; this function does
    not). ``isolate``: also replay each layer on its golden inputs. ``budget``: the error-budget
    mode (:mod:`parity.judge.engine`). ``progress``: called with progress messages.
    ``weights_dir``: where this host holds the checkpoint files a bundle names (by file name;
    default: the paths recorded at capture). ``repeat``: run the implementation this many times on
    the same inputs and judge each tensor bitwise run to run (:mod:`parity.run.repeats`); a
    tensor that differs fails the report unless it matches an ``allow_nondeterministic`` glob.

    Raises UsageError (BundleError) for an unusable bundle, a subject that cannot be re-created,
    an unknown impl, a bad device, Triton on the CPU without the interpreter, ``isolate`` without
    recorded inputs, and ``budget=True`` without references. Tensor-level problems are results.
    The report's ``resources`` say what the run cost (:mod:`parity.run.resources`; the GPU peak
    counter of a CUDA ``device`` is reset when the run starts).
    """
    started = time.monotonic()
    repeat = check_runs(repeat)
    say = Progress(progress)
    policy = as_policy(policy)
    bundle = golden if isinstance(golden, BundleReader) else open_bundle(golden)
    runner = runner_from_manifest(bundle.subject, trusted=policy.trusted_subjects, bundle_dir=bundle.path)
    runner.check_impl(impl)
    device = check_device(device if device is not None else platform.default_device())
    meter = Meter(device, started=started)  # once the device is known: its GPU peak counter starts here
    phases = Phases()
    check_triton_mode(impl, device)
    if isolate and not bundle.record_inputs:
        raise UsageError(f"--isolate needs a bundle captured with --record-inputs; {bundle.path} was captured "
                         "without recorded layer inputs")
    if budget is True and not bundle.entries_of("reference"):
        raise UsageError(f"--budget needs high-precision references in the bundle; {bundle.path} was captured "
                         "with --reference none")
    per_module = reference_scope(bundle) == "module"
    if budget is True and per_module and not isolate:
        raise UsageError(f"--budget with {bundle.path}: its references are per module (each module on its own "
                         "golden inputs), so the budget is checked on the replay: add --isolate")
    if bundle.weights is not None:
        say(f"verifying {len(bundle.weights['files'])} checkpoint file(s) the bundle names")
    verify_started = time.monotonic()
    with phases("verify"):
        state = subject_state(bundle, weights_dir)  # a checkpoint that differs is refused here, before the build
    verify_seconds = time.monotonic() - verify_started

    warnings: list[str] = []
    say(f"{bundle.path}: subject {runner.name}, {plural(len(bundle.entries_of('output')), 'recorded tensor')}, captured with "
        f"impl {bundle.impl} on {bundle.platform.get('device_name') or bundle.platform.get('arch')}")
    with phases("build"):
        module = runner.build(impl, state=state, device=device)
    phases.add("load", state.stream_seconds)  # the weights' part of the build
    weights = weights_stage(seconds=state.stream_seconds, nbytes=state.stream_bytes,
                            checkpoint_bytes=sum(file["bytes"] for file in (bundle.weights or {}).get("files", [])),
                            checkpoint_seconds=verify_seconds)
    del state
    stored = Inputs.of_bundle(bundle)
    inputs = Inputs({name: fresh_copy(tensor, device) for name, tensor in stored.tensors.items()}, stored.meta)
    del stored

    # The goldens are read ahead in the order this run will produce them (the golden's own order).
    # A per-module reference does not hold the error the end-to-end run inherits: no budget there.
    judge = Judge(bundle, policy, budget, read_ahead=[entry.name for entry in bundle.entries_of("output")],
                  has_reference=(lambda key: False) if per_module else None)
    expected = len(bundle.entries_of("output"))  # the total of the progress line
    if per_module:
        warnings.append("the bundle's references are per module: the end-to-end results are judged by the "
                        "thresholds" + ("; the isolated replay by the error budget" if isolate
                                        else "; add --isolate for the error budget of each module"))
    results: list[TensorResult] = []
    tracker = RepeatTracker(repeat, allow_nondeterministic) if repeat > 1 else None

    def on_tensor(record: RecordedTensor) -> None:
        if record.kind != "output":
            return
        if tracker is not None:
            tracker.baseline(record.name, record.tensor)
        with phases("judge"):  # on a GPU: where the host waits for the forward queued before the tensor
            results.append(judge(Obtained(record.name, record.tensor, layer=record.layer, path=record.path)))
        say.tick(lambda: f"compared {len(results)} of {expected} tensors ({sum(not r.passed for r in results)} failing)")

    say(f"run impl {impl} on {device}")
    # copy=False: each output is judged before its hook returns, so the module's own tensor is
    # used as it is (no copy of every output).
    globs = _capture_globs(bundle, module, warnings)
    try:
        with phases("run"), Recorder(module, on_tensor, layers=globs, copy=False):
            runner.run(module, inputs)
    finally:
        judge.close()
    determinism = None
    if tracker is not None:
        determinism = repeat_runs(tracker, runner, module, inputs, globs, say)
    del inputs
    ordered = judge.in_golden_order(results)
    seeds_report = None
    views = draw_views(bundle)
    if views:
        draws = [(bundle.seeds["values"][0], ordered)]
        for view in views:
            say(f"input draw of seed {view.seed}: impl {impl} on {device}")
            draws.append((view.seed, judge_draw(view, runner, module, device, policy, budget, globs, per_module)))
        ordered, seeds_report = combine(draws)
        say(f"judged {len(draws)} input draws (seeds {', '.join(str(seed) for seed, _ in draws)}): each tensor on "
            "its worst")

    if isolate:
        replay_judge = Judge(bundle, policy, budget)
        with phases("replay"):
            isolated = {result.name: result
                        for result in replay_judge.judge_all(replayed_layers(bundle, module, device, say))}
        ordered = [replace(result, isolated=isolated.get(result.name)) if result.status != "missing-in-golden"
                   else result for result in ordered]

    with phases("fingerprint"):
        golden_fp, here_fp = bundle.platform, platform.fingerprint(device)
    differences = fingerprint_differences(golden_fp, here_fp)
    warnings = ([d.message for d in differences] + capture_repeat_warning(bundle.capture_info) + warnings
                + notes_as_warnings(ordered) + fused_warning(ordered)
                + absent_warning(ordered))
    report = CompareReport(
        golden=str(bundle.path), subject=bundle.subject, impl=impl, golden_impl=bundle.impl, device=str(device),
        policy=policy, layers=ordered, hosts=hosts_summary(golden_fp, here_fp), fingerprint_differences=differences,
        platforms={"golden": dict(golden_fp), "here": here_fp},
        isolate=isolate, budget=budget, warnings=warnings,
        kernel_configs={"golden": (bundle.kernel_configs or {}).get("used"), "here": launch_configs(module)},
        seconds=time.monotonic() - started,
        integrity=integrity(bundle),
        independent_cases=len(runner.case_ids(dict(module.named_children()))),
        determinism=determinism,
        seeds=seeds_report,
        resources=meter.summary(tensors=len(ordered), nbytes=bytes_read(bundle), direction="read", weights=weights,
                                phases=phases),
    )
    say(f"compared {plural(len(ordered), 'tensor')} in {report.seconds:.1f} s: {len(report.failing)} failing")
    return report


def judge_draw(view: DrawView, runner: SubjectRunner, module: torch.nn.Module, device: torch.device, policy: Policy,
               budget: bool | None, globs: list[str] | None, per_module: bool) -> list[TensorResult]:
    """One later input draw of the bundle (:mod:`parity.run.seeds`), run through the same module
    and judged by the same engine against that draw's goldens and references."""
    judge = Judge(view, policy, budget, read_ahead=[entry.name for entry in view.entries_of("output")],
                  has_reference=(lambda key: False) if per_module else None)
    inputs = Inputs({name: fresh_copy(tensor, device) for name, tensor in view.tensors("input").items()},
                    view.inputs_meta)
    results: list[TensorResult] = []

    def on_tensor(record: RecordedTensor) -> None:
        if record.kind == "output":
            results.append(judge(Obtained(record.name, record.tensor, layer=record.layer, path=record.path)))

    try:
        with Recorder(module, on_tensor, layers=globs, copy=False):
            runner.run(module, inputs)
    finally:
        judge.close()
    return judge.in_golden_order(results)


def repeat_runs(tracker: RepeatTracker, runner: SubjectRunner, module: torch.nn.Module, inputs: Inputs,
                globs: list[str] | None, say: Progress) -> DeterminismReport:
    """The later runs of ``compare --repeat``: the same module on the same inputs, every recorded
    output hashed against the first run's (nothing is judged against the golden again)."""
    for number in range(2, tracker.runs + 1):
        say(f"repeat run {number} of {tracker.runs}: bitwise against the first")
        tracker.start_run()
        with Recorder(module, lambda record: tracker.observe(record.name, record.tensor)
                      if record.kind == "output" else None, layers=globs, copy=False):
            runner.run(module, inputs)
    report = tracker.report()
    say(report.summary())
    return report


def bytes_read(bundle: BundleReader) -> int:
    """Bytes of the bundle's tensors this run read (each one read is checksummed: ``verified``)."""
    return sum(entry.nbytes for entry in bundle.entries if (entry.kind, entry.name) in bundle.verified)


def reference_scope(bundle: BundleReader) -> str | None:
    """``"model"`` (a whole-model reference run), ``"module"`` (each module replayed on its own
    inputs) or None (no references). Bundles from before scopes existed hold whole-model ones."""
    if not bundle.entries_of("reference"):
        return None
    info = (bundle.capture_info or {}).get("reference") or {}
    return "module" if info.get("scope") == "module" else "model"


def subject_state(bundle: BundleReader, weights_dir: str | os.PathLike | None = None, *,
                  checksums: bool = True) -> StateSource:
    """The bundle's subject state, read one tensor at a time: its stored tensors and, for a bundle
    that names checkpoint files, theirs, after every file's size and digest are verified
    (a UsageError names the first that is missing or differs). ``checksums=False`` checks the
    files' presence and size only: for the other ranks of a host where one rank checks the digests."""
    if weights_dir is not None and bundle.weights is None:
        raise UsageError(f"--weights-dir: {bundle.path} stores its weights; it names no checkpoint files")
    meta = {entry.name: (entry.shape, entry.torch_dtype) for entry in bundle.entries_of("state")}
    loaders = {name: (lambda device, stream, name=name: bundle.load_to(name, "state", device=device, stream=stream))
               for name in meta}
    if bundle.weights is not None:
        files = checkpoint_weights.verify(bundle.weights, weights_dir, checksums=checksums)
        file_meta, load = checkpoint_weights.file_state(bundle.weights, files)
        meta.update(file_meta)
        loaders.update({name: (lambda device, stream, name=name: _to_device(bundle, load(name), device, stream))
                        for name in file_meta})
    return StateSource(meta, lambda name: loaders[name](torch.device("cpu"), None),
                       load_to=lambda name, device, stream: loaders[name](device, stream))


def _to_device(bundle: BundleReader, tensor: torch.Tensor, device: torch.device, stream: Any) -> torch.Tensor:
    """A checkpoint's host tensor onto ``device``: to a GPU through the bundle reader's ring of
    page-locked pieces (asynchronous, bounded), elsewhere as it is copied."""
    if device.type == "cuda" and torch.cuda.is_available():
        return bundle.stager(device).load_tensor(tensor, stream)
    return tensor.to(device)


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



def trusted_for_run(subject_flag: str | None, spec: Any, where: str | os.PathLike, trusted: Iterable[str]) -> tuple[str, ...]:
    """The specs a run of the bundle (or rank set) at ``where``, captured from subject ``spec``,
    trusts: ``trusted`` (the policy's ``trust`` list) plus ``--subject``, which must name that
    subject. Refuses (UsageError) an untrusted one before any import (:func:`check_trusted`)."""
    trusted = tuple(trusted)
    if subject_flag is not None:
        if subject_flag != spec:
            raise UsageError(f"--subject {printable(subject_flag)!r} does not match bundle {printable(str(where))}, "
                             f"which was captured from subject {printable(str(spec))!r}")
        trusted += (subject_flag,)
    check_trusted(spec, trusted, bundle=where)
    return trusted
