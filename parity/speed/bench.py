"""``parity bench``: time implementations of one subject on the same inputs, and call a speedup valid
only where the timed output holds parity.

Procedure (:func:`run_bench`):

1. Inputs and weights: a bundle's stored ones (``bundle=``; the subject is re-created from its
   manifest, only if trusted), else the subject's own ``make_inputs``/``make_state`` (without
   ``make_state``, the first impl's build's own weights). A bundle captured with weights by
   reference (``--weights-from``) names checkpoint files instead: each is found (in
   ``weights_dir`` by file name, else at its recorded path) and its size and digest verified
   before anything is built (:func:`parity.judge.compare.subject_state`, as compare does), and a
   missing or changed file is refused (UsageError naming it). Either way the state is read one
   tensor at a time into each build, never held whole beside the models. Every impl gets the same
   inputs, moved to the device once, and the same weights.
2. Warm-up: ``warmup`` calls of each impl (compilation and autotuning happen here; the first
   call's time is reported apart as ``first_call_s``).
3. Timed rounds: ``reps`` rounds; in each, every impl runs once, in an order shuffled per round
   by ``random.Random(seed)`` (interleaving spreads clock and load drift over all impls). Before
   each call the cache is flushed (a write of :func:`parity.speed.timing.flush_bytes` bytes: at least 4x the L2 the
   device reports and 512 MiB, i.e. 2x the 256 MiB Infinity Cache of an MI300X, which torch does
   not report; on a CPU there is no flush, and the report says so) and the whole device is
   synchronised; the call is timed on the host between two whole-device synchronisations, so
   work on every stream counts. Fresh outputs: before an impl's call, its previous output is
   NaN-poisoned and kept until the call returns, so a cached or persistent output buffer is
   seen (warned) and cannot pass parity with a result of an earlier call
   (:func:`parity.speed.timing.timed_rounds`).
   The device's clock and clock-throttling reasons are sampled before the rounds and after each
   one (:mod:`parity.speed.clocks`: NVML on NVIDIA, amdsmi on ROCm, nothing on a CPU); throttling
   is warned.
4. Parity of what was timed: the output of each impl's *last timed call* is judged, with the
   default rule of the policy, against the bundle's golden (the recorded ``<root>`` output, or
   the recorded outputs of the modules the forward returns by name) or, without a bundle,
   against the first impl's timed output (the baseline, not itself judged then).
5. Statistics (:mod:`parity.speed.stats`): per impl the median, IQR, p20/p80; per candidate the
   ratio of medians over the baseline (the first impl) with a bootstrap 95% interval and a
   verdict, and the equivalence verdict (TOST: the 90% interval inside +-``equivalence``).
   A speedup is ``valid`` only for an impl whose parity holds; the report says
   ``not valid: parity fails at TENSOR`` otherwise. With a saved run (``previous``, a report
   of an earlier ``bench --json``), each impl in both runs gets its time ratio now / then and a
   REGRESSED / IMPROVED / SAME / UNCLEAR status (:mod:`parity.speed.regression`); the setup
   check against it runs before any timing.
6. Device time: 3 more calls of each impl under ``torch.profiler``
   (:func:`parity.speed.profile.device_time_per_call`): the time of its kernels, memcpy and
   memset per call next to the wall time (on a CPU, the CPU ops' self time), and the
   kernel-only speedup over the baseline.
7. Modules: a second set of interleaved rounds with forward hooks timing every module (device
   events on a GPU, the host clock on a CPU). The modules of ``modules`` globs (default: the
   module group with the largest self time in the baseline, e.g. ``layers.*.attn.core``) get
   their own statistics, so the op's speedup and the model's both show, with Amdahl's
   prediction of the second from the first. A subject with several cases (``subject.cases``
   whose ids name the root's children, as the attention subject's) gets a per-case time and
   verdict, and the fast_p line: how many cases hold parity and are at least ``fast_p`` faster.

The verdict: exit status 1 when the fastest impl fails parity (its speed claims nothing) or an
impl REGRESSED against the saved run.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from parity.run import platform
from parity.base.text import printable
from parity.base.errors import UsageError
from parity.base.jsonformat import BENCH_REPORT, envelope, finite
from parity.run.recorder import ROOT, flatten, tensor_name
from . import clocks, regression, stats
from .profile import device_time_per_call
from .timing import (CacheFlush, Rounds, glob_seconds, hot_group, module_rounds, protected_memory, synchronize,
                     timed_rounds)
from parity.run.runtime import check_triton_mode, fresh_copy
from parity.run.subjects import Inputs, load_subject, runner_from_manifest
from parity.judge.compare import subject_state
from parity.judge.engine import Judge, Obtained, compare_tensors
from parity.judge.policy import as_policy
from parity.run.runtime import check_device

DEFAULT_WARMUP = 3
DEFAULT_REPS = 20
DEFAULT_FAST_P = 1.2
MAX_REPS = 100_000


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    impls: tuple[str, ...]
    warmup: int = DEFAULT_WARMUP
    reps: int = DEFAULT_REPS
    seed: int = 0
    min_effect: float = stats.DEFAULT_MIN_EFFECT
    fast_p: float = DEFAULT_FAST_P
    flush: bool = True
    modules: tuple[str, ...] | None = None  # globs; None: the hot module group, found by timing
    module_timing: bool = True
    device_time: bool = True  # a few profiled calls per impl: kernel-only time next to the wall time
    equivalence: float = stats.DEFAULT_EQUIVALENCE
    regression_threshold: float = regression.DEFAULT_THRESHOLD

    def check(self) -> None:
        if len(self.impls) < 2:
            raise UsageError(f"--impls needs at least two implementations to compare, got {','.join(self.impls)}")
        if len(set(self.impls)) != len(self.impls):
            raise UsageError(f"--impls names an implementation twice: {','.join(self.impls)}")
        if not 1 <= self.warmup <= MAX_REPS:
            raise UsageError(f"--warmup must be from 1 to {MAX_REPS} (the first call compiles), got {self.warmup}")
        if not 3 <= self.reps <= MAX_REPS:
            raise UsageError(f"--reps must be from 3 to {MAX_REPS}, got {self.reps}")
        if not (math.isfinite(self.min_effect) and 0 <= self.min_effect < 1):
            raise UsageError(f"--min-effect must be in [0, 1), got {self.min_effect}")
        if not (math.isfinite(self.fast_p) and self.fast_p > 0):
            raise UsageError(f"--fast-p must be a positive number, got {self.fast_p}")
        if not (math.isfinite(self.equivalence) and 0 < self.equivalence < 1):
            raise UsageError(f"--equivalence must be in (0, 1), got {self.equivalence}")
        if not (math.isfinite(self.regression_threshold) and 0 < self.regression_threshold < 1):
            raise UsageError(f"--regression-threshold must be in (0, 1), got {self.regression_threshold}")


# ---------------------------------------------------------------------------------------------
# What runs: the subject, its impls, the inputs


@dataclasses.dataclass
class Prepared:
    runner: Any  # SubjectRunner
    inputs: Any  # Inputs, on the device
    modules: dict[str, nn.Module]
    bundle: Any | None  # BundleReader
    source: str  # where inputs and weights came from


def prepare(subject: str | None, subject_args: Mapping[str, Any] | None, *, impls: Sequence[str],
            device: torch.device, bundle: Any | None = None, trusted: Sequence[str] = (),
            weights_dir: str | os.PathLike | None = None,
            progress: Callable[[str], None] | None = None) -> Prepared:
    """Load the subject (from ``bundle``'s manifest when given), build every impl with the same
    weights, and put the same inputs on ``device``. ``weights_dir``: where this host holds the
    checkpoint files a bundle captured with weights by reference names (by file name; default:
    the paths recorded at capture); every file is verified before the first build."""

    say = progress or (lambda message: None)
    if bundle is not None:
        runner = runner_from_manifest(bundle.subject, trusted=trusted, bundle_dir=bundle.path)
    else:
        if subject is None:
            raise UsageError("bench needs --subject or --bundle")
        if weights_dir is not None:
            raise UsageError("--weights-dir applies only with --bundle (a bundle captured with --weights-from)")
        runner = load_subject(subject, subject_args)
    for impl in impls:  # refused before a checkpoint's digests are taken (minutes at 16 GB)
        runner.check_impl(impl)
        check_triton_mode(impl, device)
    if bundle is not None:
        if bundle.weights is not None:
            say(f"verifying {len(bundle.weights['files'])} checkpoint file(s) the bundle names")
        # Verified here, before any build or input is read: a missing or changed file is refused
        # with nothing built and nothing timed.
        state = subject_state(bundle, weights_dir)
        stored = Inputs.of_bundle(bundle)
        inputs = Inputs({name: fresh_copy(tensor, device) for name, tensor in stored.tensors.items()}, stored.meta)
        source = f"bundle {bundle.path}"
        if bundle.weights is not None:
            source += (f" (weights from the {len(bundle.weights['files'])} checkpoint file(s) it names, size and "
                       "digest verified)")
    else:
        made = runner.make_inputs()
        inputs = made.to(device)
        # A subject without make_state: the first impl's build supplies the weights every impl gets,
        # drawn where it builds. Building it once more on the host only to read its state would cost
        # a second copy of the model (a Llama-3-8B shape: 16 GB, and minutes of initialisation on a CPU).
        state = runner.made_state()
        source = ("the subject's own inputs and weights (make_inputs, make_state)" if state is not None else
                  f"the subject's own inputs (make_inputs) and the weights of its {impls[0]} build")
    runner.check_inputs(inputs)
    modules: dict[str, nn.Module] = {}
    for impl in impls:
        modules[impl] = runner.build(impl, state=state, device=device)
        if state is None:
            state = modules[impl].state_dict()
    return Prepared(runner, inputs, modules, bundle, source)


def input_shapes(inputs: Any) -> dict[str, dict[str, Any]]:
    """Each input tensor's dtype and shape: what a saved run must match to be compared."""
    return {name: {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
            for name, tensor in sorted(inputs.tensors.items())}


def _forward(prepared: Prepared, impl: str) -> Any:
    with torch.no_grad():
        return prepared.runner.call(prepared.modules[impl], prepared.inputs)


# ---------------------------------------------------------------------------------------------
# Parity of the timed output


@dataclasses.dataclass
class ParityOutcome:
    status: str  # "holds", "fails" or "baseline" (the reference of a run without a bundle)
    tensors: int
    failing: list[str]
    reason: str | None
    results: list[Any]  # TensorResult
    cases_failing: set[str] = dataclasses.field(default_factory=set)

    @property
    def holds(self) -> bool:
        return self.status in ("holds", "baseline")

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "tensors": self.tensors, "failing": len(self.failing),
                "first_failing": self.failing[0] if self.failing else None, "reason": self.reason,
                "results": [{"name": r.name, "status": r.status, "passed": r.passed,
                             "reasons": list(r.verdict.reasons),
                             # whether the error budget against the bundle's reference judged it
                             # (else the fixed thresholds did)
                             "budget_checked": bool(r.budget is not None and r.budget.checked)}
                            for r in self.results]}


def _golden_names(bundle: Any, paths: Sequence[str]) -> dict[str, str]:
    """The bundle entry each output path of the forward is judged against: ``<root>/path`` where
    the root's output was recorded, else ``path`` itself where the forward returns recorded
    modules' outputs by module name (the attention subject), else, where the forward returns one
    bare tensor and the root's recorded output holds exactly one tensor, that one (a subject whose
    ``call`` returns ``model(...).logits`` of a Hugging Face model: its root records ``<root>/logits``;
    anything else computed from it would differ from it and fail, never pass by the mapping)."""
    rooted = {path: tensor_name(ROOT, path) for path in paths}
    if all(bundle.has(name) for name in rooted.values()):
        return rooted
    direct = {path: path for path in paths}
    if all(bundle.has(name) for name in direct.values()):
        return direct
    if list(paths) == [""]:
        root_outputs = [entry.name for entry in bundle.entries_of("output") if entry.layer == ROOT]
        if len(root_outputs) == 1:
            return {"": root_outputs[0]}
    missing = next(name for name in rooted.values() if not bundle.has(name))
    raise UsageError(f"bundle {bundle.path} has no golden of the forward's output {missing!r}: bench judges the "
                     "whole output; capture it with the root module recorded (no --layers, or --layers '<root>' ...)")


def judge_outputs(outputs: Mapping[str, Any], *, impls: Sequence[str], bundle: Any | None, policy: Any,
                  case_ids: Sequence[str] = ()) -> dict[str, ParityOutcome]:
    """Each impl's timed output judged against the golden (or the first impl's output)."""

    outcomes: dict[str, ParityOutcome] = {}
    baseline_tensors = dict(flatten(outputs[impls[0]])[1])
    for impl in impls:
        tensors = flatten(outputs[impl])[1]
        if not tensors:
            raise UsageError(f"impl {impl}: the forward returned no tensor; nothing to judge")
        if bundle is not None:
            names = _golden_names(bundle, [path for path, _ in tensors])
            judge = Judge(bundle, policy, None)
            results = [judge(Obtained(names[path], tensor.detach(), layer=None, path=path)) for path, tensor in tensors]
        elif impl == impls[0]:
            outcomes[impl] = ParityOutcome("baseline", len(tensors), [], None, [])
            continue
        else:
            results = []
            for path, tensor in tensors:
                name = tensor_name(ROOT, path)
                if path not in baseline_tensors:
                    raise UsageError(f"impl {impl} returns {name!r}, which {impls[0]} does not: the outputs differ "
                                     "in structure")
                results.append(compare_tensors(name, tensor.detach(), baseline_tensors[path], policy=policy))
        failing = [result.name for result in results if not result.passed]
        reason = None
        if failing:
            first = next(result for result in results if not result.passed)
            reason = "; ".join(first.verdict.reasons[:2]) or first.status
        cases_failing = {case for case in case_ids for result in results
                         if not result.passed and _in_case(result.name, case)}
        outcomes[impl] = ParityOutcome("fails" if failing else "holds", len(results), failing, reason, results,
                                       cases_failing)
    return outcomes


def _in_case(name: str, case: str) -> bool:
    bare = name[len(ROOT) + 1:] if name.startswith(ROOT + "/") else name
    return bare == case or bare.startswith(case + "/")


def case_ids(prepared: Prepared) -> list[str]:
    """The subject's cases, where it has several and each is a child module of the root."""
    return prepared.runner.case_ids(dict(next(iter(prepared.modules.values())).named_children()))


# ---------------------------------------------------------------------------------------------
# The run


def run_bench(subject: str | None, *, subject_args: Mapping[str, Any] | None = None, bundle: Any | None = None,
              options: BenchOptions, device: torch.device | str = "cpu", policy: Any = None,
              trusted: Sequence[str] = (), progress: Callable[[str], None] | None = None,
              previous: Mapping[str, Any] | None = None, previous_path: str = "",
              weights_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Run the benchmark and return the report document (``parity-bench-report``); with
    ``previous`` (a saved report, :func:`parity.speed.regression.load_previous`), compared with it.
    ``weights_dir``: where the checkpoint files a bundle names are on this host (:func:`prepare`)."""

    options.check()
    started = time.monotonic()
    say = progress or (lambda message: None)
    device = check_device(device)
    policy = as_policy(policy)
    impls = list(options.impls)
    prepared = prepare(subject, subject_args, impls=impls, device=device, bundle=bundle, trusted=trusted,
                       weights_dir=weights_dir, progress=say)
    say(f"{prepared.runner.name}: {len(impls)} impls on {device}; inputs from {prepared.source}")
    identity = {"subject": prepared.runner.describe(), "device": str(device),
                "platform": platform.fingerprint(device), "input_shapes": input_shapes(prepared.inputs)}
    setup_warnings = (regression.check_same_setup(identity, previous, path=previous_path, impls=impls)
                      if previous is not None else [])

    first_call: dict[str, float] = {}
    for impl in impls:
        for index in range(options.warmup):
            synchronize(device)
            start = time.perf_counter()
            output = _forward(prepared, impl)
            synchronize(device)
            if index == 0:
                first_call[impl] = time.perf_counter() - start
            del output
    say(f"warmed up ({options.warmup} calls each); timing {options.reps} interleaved rounds")

    flush = CacheFlush(device, options.flush)
    watch = clocks.ClockWatch(device)
    watch.sample()
    protected = protected_memory(prepared.inputs.tensors, prepared.modules.values())
    rounds = timed_rounds(lambda impl: _forward(prepared, impl), impls, reps=options.reps, seed=options.seed,
                          device=device, flush=flush, protected=protected, progress=say, after_round=watch.sample)
    times, last, orders = rounds.times, rounds.last, rounds.orders
    flush.release()
    cases = case_ids(prepared)
    outcomes = judge_outputs(last, impls=impls, bundle=prepared.bundle, policy=policy, case_ids=cases)
    del last

    summaries = {impl: stats.summarize(times[impl]) for impl in impls}
    baseline = impls[0]
    rows, timing_warnings = impl_rows(times, outcomes, impls, min_effect=options.min_effect, seed=options.seed,
                                      first_call=first_call, rounds=rounds, equivalence=options.equivalence)
    warnings: list[str] = setup_warnings + watch.warnings() + timing_warnings
    fastest = min(impls, key=lambda impl: summaries[impl].median)
    if options.device_time:
        say("device time: 3 profiled calls of each impl")
        _add_device_times(rows, prepared, impls, device, warnings)
    modules_section = None
    fast_p_section = None
    if options.module_timing:
        say(f"timing modules: {options.reps} interleaved rounds with hooks")
        calls = module_rounds(prepared.modules, lambda impl: _forward(prepared, impl), impls, reps=options.reps,
                              seed=options.seed, device=device)
        patterns = list(options.modules) if options.modules else [g for g in [hot_group(calls[baseline])] if g]
        modules_section = _modules_section(calls, patterns, impls, options, warnings)
        if cases:
            fast_p_section = _fast_p_section(calls, cases, impls, options, outcomes)

    against = None
    verdict = _verdict_line(fastest, outcomes, rows, baseline)
    if previous is not None:
        against = regression.compare_runs(times, previous, path=previous_path,
                                          threshold=options.regression_threshold, seed=options.seed)
        if (previous.get("settings") or {}).get("cache_flush") != flush.note:
            warnings.append(f"--baseline {printable(previous_path, limit=200)}: its cache flush was "
                            f"{(previous.get('settings') or {}).get('cache_flush')!r}, this run's {flush.note!r}: "
                            "cold and warm caches time differently")
        verdict += "; " + against["line"]
    passed = outcomes[fastest].holds and not (against and against["regressed"])
    document = {
        **envelope(BENCH_REPORT),
        "subject": prepared.runner.describe(), "bundle": str(prepared.bundle.path) if prepared.bundle else None,
        "inputs": prepared.source, "input_shapes": identity["input_shapes"], "device": str(device),
        "platform": identity["platform"],
        "settings": {"impls": impls, "baseline": baseline, "warmup": options.warmup, "reps": options.reps,
                     "seed": options.seed, "min_effect": options.min_effect, "fast_p": options.fast_p,
                     "equivalence": options.equivalence, "equivalence_confidence": stats.EQUIVALENCE_CONFIDENCE,
                     "confidence": stats.DEFAULT_CONFIDENCE, "resamples": stats.DEFAULT_RESAMPLES,
                     "cache_flush": flush.note, "cache_flush_bytes": flush.nbytes,
                     "timer": "host clock between whole-device synchronisations",
                     "device_time": ("3 profiled calls per impl after the timed rounds (torch.profiler): "
                                     + ("CPU ops' self time, the profiler's overhead included (it may exceed "
                                        "the wall time)" if device.type == "cpu" else
                                        "kernels, memcpy and memset, without launch gaps or host time")
                                     if options.device_time else "not measured (--no-device-time)"),
                     "judged": "the output of each impl's last timed call",
                     "judged_against": ("the bundle's golden" if prepared.bundle is not None
                                        else f"the output of {baseline} (no bundle)"),
                     "orders": orders[:5]},
        "clocks": watch.to_dict(),
        "impls": rows, "fastest": fastest, "passed": passed, "verdict": verdict,
        "modules": modules_section, "cases": fast_p_section, "baseline_run": against,
        "warnings": warnings, "seconds": time.monotonic() - started,
    }
    return finite(document)


def impl_rows(times: Mapping[str, Sequence[float]], outcomes: Mapping[str, ParityOutcome], impls: Sequence[str], *,
              min_effect: float = stats.DEFAULT_MIN_EFFECT, seed: int = 0,
              first_call: Mapping[str, float] | None = None, rounds: Rounds | None = None,
              equivalence: float = stats.DEFAULT_EQUIVALENCE) -> tuple[list[dict[str, Any]], list[str]]:
    """The whole forward's row of each impl (statistics, speedup over the first impl, parity, valid
    or not) and the warnings they raise: noisy timings (IQR/median above 0.1), a speedup above 10x,
    an output buffer reused between calls. A pure function of the timings and the parity outcomes."""
    baseline = impls[0]
    rows, warnings = [], []
    for impl in impls:
        summary = stats.summarize(times[impl])
        warning = stats.noise_warning(summary, f"{impl} (whole forward)")
        if warning:
            warnings.append(warning)
        row: dict[str, Any] = {"impl": impl, "times_s": list(times[impl]), "summary": summary.to_dict(),
                               "first_call_s": (first_call or {}).get(impl), "parity": outcomes[impl].to_dict()}
        if rounds is not None:
            reused = rounds.reused[impl]
            row["fresh_outputs"] = {"reused_calls": reused, "poisoned_calls": rounds.poisoned[impl],
                                    "calls": len(times[impl])}
            if reused:
                warnings.append(f"{impl}: {reused} of {len(times[impl]) - 1} timed calls returned an output in the "
                                "memory of the previous call's output (a cached or persistent output buffer, not a "
                                "fresh output); that output was NaN-poisoned before each call, so parity says "
                                "whether the timed call really rewrote it")
        if impl != baseline:
            comparison = stats.compare(times[baseline], times[impl], min_effect=min_effect, seed=seed, what=impl,
                                       equivalence=equivalence)
            warnings.extend(comparison.warnings)
            row["vs_baseline"] = comparison.to_dict()
            row["valid"] = outcomes[impl].holds and outcomes[baseline].holds
            row["validity"] = _validity(outcomes, impl, baseline, comparison.verdict)
        rows.append(row)
    return rows, warnings


def _add_device_times(rows: list[dict[str, Any]], prepared: Prepared, impls: Sequence[str], device: torch.device,
                      warnings: list[str]) -> None:
    """Each row's ``device_time``: the profiler's counted time per call (kernels, memcpy, memset on
    a GPU: no launch gaps, no host time; CPU ops' self time on a CPU), its share of the median
    wall time, and the baseline's over it (the kernel-only speedup)."""
    for row in rows:
        impl = row["impl"]
        measured = device_time_per_call(lambda impl=impl: _forward(prepared, impl), device)
        per_call = measured["per_call_s"]
        measured["wall_share"] = per_call / row["summary"]["median"] if per_call is not None else None
        if measured["note"]:
            warnings.append(f"{impl}: no device time: {measured['note']}")
        row["device_time"] = measured
    base = rows[0]["device_time"]["per_call_s"]
    for row in rows[1:]:
        mine = row["device_time"]["per_call_s"]
        speedup = base / mine if base and mine else None
        row["device_time"]["speedup"] = speedup
        suspicious = stats.suspicious_speedup(speedup, row["impl"], "device speedup")
        if suspicious:
            warnings.append(suspicious)


def _validity(outcomes: Mapping[str, ParityOutcome], impl: str, baseline: str, verdict: str) -> str:
    """Whether the row's speed claim stands on parity; a SLOWER row makes no speedup claim, so it
    is never called valid."""
    outcome = outcomes[impl]
    if not outcome.holds:
        return f"not valid: parity fails at {outcome.failing[0]}"
    if not outcomes[baseline].holds:
        return f"not valid: the baseline {baseline} fails parity at {outcomes[baseline].failing[0]} (unverified)"
    if verdict == "SLOWER":
        return "parity holds; slower"
    return "valid: parity holds"


def _verdict_line(fastest: str, outcomes: Mapping[str, ParityOutcome], rows: list[dict[str, Any]],
                  baseline: str) -> str:
    outcome = outcomes[fastest]
    if not outcome.holds:
        return (f"SPEEDUP NOT VALID: the fastest impl, {fastest}, fails parity at {outcome.failing[0]} "
                f"({len(outcome.failing)} of {outcome.tensors} tensors fail)")
    if fastest == baseline:
        shown = [row["impl"] for row in rows[1:] if row["vs_baseline"].get("equivalence", {}).get("equivalent")]
        margin = rows[1]["vs_baseline"].get("equivalence", {}).get("margin") if len(rows) > 1 else None
        return (f"NO SPEEDUP: the baseline {baseline} is the fastest"
                + (f"; {', '.join(shown)} {stats.equivalence_text(margin, True)} of it" if shown and margin else ""))
    row = next(row for row in rows if row["impl"] == fastest)
    cmp = row["vs_baseline"]
    if not row["valid"]:
        return f"{fastest} is fastest, {row['validity']}"
    return (f"SPEEDUP VALID: {fastest} {cmp['speedup']:.2f}x {baseline} [{cmp['ci_low']:.2f}, {cmp['ci_high']:.2f}] "
            f"{cmp['verdict']}, parity holds ({outcome.tensors} tensor{'s' if outcome.tensors != 1 else ''})")


def _modules_section(calls, patterns, impls, options, warnings) -> dict[str, Any]:
    """Per module pattern and impl: the module's time per call, its speedup over the baseline's
    and Amdahl's bound for the whole forward. The baseline share is the module's fraction of the
    whole forward within the same hooked calls (the median over calls of module / root time), so
    it is at most 1: the forward's own rounds are other calls, with a cache flush and no hooks."""
    baseline = impls[0]
    section: dict[str, Any] = {"patterns": patterns, "rows": []}
    roots = glob_seconds(calls[baseline], ROOT)
    for pattern in patterns:
        per_impl = {impl: glob_seconds(calls[impl], pattern) for impl in impls}
        if not any(per_impl[baseline]):
            warnings.append(f"--module {pattern!r} matches no module that ran")
            continue
        share = stats.median([part / whole for part, whole in zip(per_impl[baseline], roots) if whole > 0] or [0.0])
        for impl in impls:
            summary = stats.summarize(per_impl[impl])
            row: dict[str, Any] = {"module": pattern, "impl": impl, "summary": summary.to_dict()}
            noisy = stats.noise_warning(summary, f"{impl} {pattern}")
            if noisy:
                warnings.append(noisy)
            if impl != baseline and min(per_impl[impl]) > 0:
                comparison = stats.compare(per_impl[baseline], per_impl[impl], min_effect=options.min_effect,
                                           seed=options.seed, what=f"{impl} {pattern}",
                                           equivalence=options.equivalence)
                warnings.extend(comparison.warnings)
                row["vs_baseline"] = comparison.to_dict()
                row["amdahl_whole_forward"] = stats.amdahl(min(1.0, share), comparison.speedup)
            section["rows"].append(row)
        section.setdefault("baseline_share", {})[pattern] = share
    return section


def _fast_p_section(calls, cases, impls, options, outcomes) -> dict[str, Any]:
    baseline = impls[0]
    rows = []
    lines = []
    for impl in impls[1:]:
        good = 0
        for case in cases:
            base_times = [inclusive.get(case, 0.0) for inclusive, _ in calls[baseline]]
            impl_times = [inclusive.get(case, 0.0) for inclusive, _ in calls[impl]]
            if min(base_times) <= 0 or min(impl_times) <= 0:
                continue
            comparison = stats.compare(base_times, impl_times, min_effect=options.min_effect, seed=options.seed)
            holds = case not in outcomes[impl].cases_failing and case not in outcomes[baseline].cases_failing
            fast = holds and comparison.speedup >= options.fast_p
            good += fast
            rows.append({"case": case, "impl": impl, "parity_holds": holds, "speedup": comparison.speedup,
                         "ci_low": comparison.low, "ci_high": comparison.high, "verdict": comparison.verdict,
                         "fast": fast})
        lines.append(f"fast_p {impl}: {good} of {len(cases)} cases hold parity and are >= {options.fast_p:g}x "
                     f"faster than {baseline}")
    return {"threshold": options.fast_p, "rows": rows, "lines": lines}


def exit_status(document: Mapping[str, Any]) -> int:
    """0 when the fastest impl holds parity and none regressed against a saved run, else 1."""
    return 0 if document["passed"] else 1


def parse_impls(text: str) -> tuple[str, ...]:
    impls = tuple(part.strip() for part in text.split(","))
    if not all(impls) or not all(re.fullmatch(r"[\w.\-]+", impl) for impl in impls):
        raise UsageError(f"--impls must be a comma-separated list of implementation names, got {text!r}")
    return impls


__all__ = ["BenchOptions", "Prepared", "exit_status", "impl_rows", "input_shapes", "judge_outputs", "parse_impls",
           "prepare", "run_bench"]
