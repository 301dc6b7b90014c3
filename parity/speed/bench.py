"""``parity bench``: time implementations of one subject on the same inputs, and call a speedup valid
only where the timed output holds parity.

Procedure (:func:`run_bench`):

1. Inputs and weights: a bundle's stored ones (``bundle=``; the subject is re-created from its
   manifest, only if trusted), else the subject's own ``make_inputs``/``make_state``. Every impl
   gets the same inputs, moved to the device once, and the same weights.
2. Warm-up: ``warmup`` calls of each impl (compilation and autotuning happen here; the first
   call's time is reported apart as ``first_call_s``).
3. Timed rounds: ``reps`` rounds; in each, every impl runs once, in an order shuffled per round
   by ``random.Random(seed)`` (interleaving spreads clock and load drift over all impls). Before
   each call the cache is flushed (a write of :func:`flush_bytes` bytes: at least 4x the L2 the
   device reports and 512 MiB, i.e. 2x the 256 MiB Infinity Cache of an MI300X, which torch does
   not report; on a CPU there is no flush, and the report says so) and the whole device is
   synchronised; the call is timed on the host between two whole-device synchronisations, so
   work on every stream counts. The forward allocates fresh outputs each call; the previous
   output of an impl is released before its next call, except that of the last round.
4. Parity of what was timed: the output of each impl's *last timed call* is judged, with the
   default rule of the policy, against the bundle's golden (the recorded ``<root>`` output, or
   the recorded outputs of the modules the forward returns by name) or, without a bundle,
   against the first impl's timed output (the baseline, not itself judged then).
5. Statistics (:mod:`parity.speed.stats`): per impl the median, IQR, p20/p80; per candidate the
   ratio of medians over the baseline (the first impl) with a bootstrap 95% interval and a
   verdict. A speedup is ``valid`` only for an impl whose parity holds; the report says
   ``not valid: parity fails at TENSOR`` otherwise.
6. Modules: a second set of interleaved rounds with forward hooks timing every module (device
   events on a GPU, the host clock on a CPU). The modules of ``modules`` globs (default: the
   module group with the largest self time in the baseline, e.g. ``layers.*.attn.core``) get
   their own statistics, so the op's speedup and the model's both show, with Amdahl's
   prediction of the second from the first. A subject with several cases (``subject.cases``
   whose ids name the root's children, as the attention subject's) gets a per-case time and
   verdict, and the fast_p line: how many cases hold parity and are at least ``fast_p`` faster.

The verdict: exit status 1 when the fastest impl fails parity (its speed claims nothing).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from parity.run import platform
from parity.base.errors import UsageError
from parity.base.jsonformat import BENCH_REPORT, envelope, finite
from parity.run.recorder import ROOT, flatten, module_display_name, tensor_name
from . import stats
from parity.run.runtime import check_triton_mode, fresh_copy
from parity.run.subjects import Inputs, load_subject, runner_from_manifest
from parity.judge.engine import Judge, Obtained, compare_tensors
from parity.judge.policy import as_policy
from parity.run.runtime import check_device

DEFAULT_WARMUP = 3
DEFAULT_REPS = 20
DEFAULT_FAST_P = 1.2
MIN_FLUSH_BYTES = 512 * 2**20
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


# ---------------------------------------------------------------------------------------------
# The device: synchronisation and the cache flush


def synchronize(device: torch.device) -> None:
    """Wait for all work on ``device`` (every stream), a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def flush_bytes(device: torch.device) -> int:
    """Bytes written to flush the caches before a timed call: max(4 x the L2 the device reports,
    512 MiB), at most a quarter of the free memory; 0 on the CPU (no flush)."""
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    l2 = int(getattr(props, "L2_cache_size", 0) or 0)
    wanted = max(4 * l2, MIN_FLUSH_BYTES)
    free, _ = torch.cuda.mem_get_info(device)
    return int(min(wanted, free // 4)) // 4 * 4


class CacheFlush:
    """Overwrites a device buffer of :func:`flush_bytes` bytes (does nothing on the CPU)."""

    def __init__(self, device: torch.device, enabled: bool):
        self.nbytes = flush_bytes(device) if enabled else 0
        self.buffer = torch.empty(self.nbytes // 4, dtype=torch.int32, device=device) if self.nbytes else None
        if device.type == "cuda" and enabled and self.nbytes:
            note = f"{self.nbytes / 2**20:.0f} MiB written before every timed call"
        elif device.type == "cuda":
            note = "disabled (--no-flush): warm-cache timings"
        else:
            note = "none: a CPU has no cache flush here (timings are warm-cache)"
        self.note = note

    def __call__(self) -> None:
        if self.buffer is not None:
            self.buffer.add_(1)

    def release(self) -> None:
        """Give the flush buffer's memory back (after the timed rounds)."""
        self.buffer = None


def clock_mhz(device: torch.device) -> int | None:
    """The SM/GFX clock the device reports now (through pynvml or amdsmi), None where it cannot."""
    if device.type != "cuda":
        return None
    try:
        return int(torch.cuda.clock_rate(device))
    except (ImportError, ModuleNotFoundError, RuntimeError, AttributeError, ValueError):
        return None


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
            device: torch.device, bundle: Any | None = None, trusted: Sequence[str] = ()) -> Prepared:
    """Load the subject (from ``bundle``'s manifest when given), build every impl with the same
    weights, and put the same inputs on ``device``."""

    if bundle is not None:
        runner = runner_from_manifest(bundle.subject, trusted=trusted, bundle_dir=bundle.path)
        stored = Inputs.of_bundle(bundle)
        inputs = Inputs({name: fresh_copy(tensor, device) for name, tensor in stored.tensors.items()}, stored.meta)
        state = bundle.subject_state()
        source = f"bundle {bundle.path}"
    else:
        if subject is None:
            raise UsageError("bench needs --subject or --bundle")
        runner = load_subject(subject, subject_args)
        made = runner.make_inputs()
        inputs = made.to(device)
        state = runner.make_state()
        source = "the subject's own inputs and weights (make_inputs, make_state)"
    for impl in impls:
        runner.check_impl(impl)
        check_triton_mode(impl, device)
    runner.check_inputs(inputs)
    modules = {impl: runner.build(impl, state=state, device=device) for impl in impls}
    return Prepared(runner, inputs, modules, bundle, source)


def _forward(prepared: Prepared, impl: str) -> Any:
    with torch.no_grad():
        return prepared.runner.call(prepared.modules[impl], prepared.inputs)


# ---------------------------------------------------------------------------------------------
# Timing


def timed_rounds(prepared: Prepared, impls: Sequence[str], *, reps: int, seed: int, device: torch.device,
                 flush: CacheFlush, progress: Callable[[str], None] | None = None) -> tuple[dict[str, list[float]], dict[str, Any], list[list[str]]]:
    """``reps`` interleaved rounds: seconds per call of each impl, each impl's last output, the orders."""
    rng = random.Random(seed)
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    last: dict[str, Any] = {}
    orders = []
    for round_index in range(reps):
        order = list(impls)
        rng.shuffle(order)
        orders.append(order)
        for impl in order:
            last.pop(impl, None)  # fresh outputs: the previous one is released before the call
            flush()
            synchronize(device)
            start = time.perf_counter()
            output = _forward(prepared, impl)
            synchronize(device)
            times[impl].append(time.perf_counter() - start)
            last[impl] = output
        if progress is not None and (round_index + 1) % max(1, reps // 4) == 0:
            progress(f"timed round {round_index + 1} of {reps}")
    return times, last, orders


class ModuleTimer:
    """Forward hooks that time every module call (device events on a GPU, the host clock on a CPU);
    ``collect()`` after a synchronised forward gives inclusive seconds per module name."""

    def __init__(self, root: nn.Module, device: torch.device):
        self.device = device
        self.names = {id(module): module_display_name(path) for path, module in root.named_modules()}
        self.children = {module_display_name(path): [module_display_name(f"{path}.{child}" if path else child)
                                                     for child, _ in module.named_children()]
                         for path, module in root.named_modules()}
        self.open: dict[int, list[Any]] = {}
        self.pending: list[tuple[str, Any, Any]] = []
        self.handles: list[Any] = []
        for _, module in root.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._pre))
            self.handles.append(module.register_forward_hook(self._post))

    def _stamp(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _pre(self, module, args):
        self.open.setdefault(id(module), []).append(self._stamp())

    def _post(self, module, args, output):
        start = self.open[id(module)].pop()
        self.pending.append((self.names[id(module)], start, self._stamp()))

    def collect(self) -> dict[str, float]:
        inclusive: dict[str, float] = {}
        for name, start, end in self.pending:
            seconds = start.elapsed_time(end) / 1e3 if self.device.type == "cuda" else end - start
            inclusive[name] = inclusive.get(name, 0.0) + seconds
        self.pending = []
        return inclusive

    def self_times(self, inclusive: Mapping[str, float]) -> dict[str, float]:
        """Inclusive time minus that of the children (time a module spends in its own ops)."""
        return {name: max(0.0, seconds - sum(inclusive.get(child, 0.0) for child in self.children.get(name, ())))
                for name, seconds in inclusive.items()}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def group_name(module: str) -> str:
    """``layers.3.attn.core`` -> ``layers.*.attn.core``: numbered path parts become ``*``."""
    if module == ROOT:
        return module
    return ".".join("*" if part.isdigit() else part for part in module.split("."))


def module_rounds(prepared: Prepared, impls: Sequence[str], *, reps: int, seed: int,
                  device: torch.device) -> dict[str, list[tuple[dict[str, float], dict[str, float]]]]:
    """Interleaved rounds with every module timed: per impl, per call, (inclusive, self) seconds by module."""
    rng = random.Random(seed + 1)
    timers = {impl: ModuleTimer(prepared.modules[impl], device) for impl in impls}
    result: dict[str, list[tuple[dict[str, float], dict[str, float]]]] = {impl: [] for impl in impls}
    try:
        for _ in range(reps):
            order = list(impls)
            rng.shuffle(order)
            for impl in order:
                synchronize(device)
                output = _forward(prepared, impl)
                synchronize(device)
                del output
                inclusive = timers[impl].collect()
                result[impl].append((inclusive, timers[impl].self_times(inclusive)))
    finally:
        for timer in timers.values():
            timer.remove()
    return result


def hot_group(calls: Sequence[tuple[dict[str, float], dict[str, float]]]) -> str | None:
    """The module group with the largest median self time over ``calls`` (the root excluded when
    anything else has time: its self time is the glue between its children)."""
    totals: dict[str, list[float]] = {}
    for _, self_times in calls:
        grouped: dict[str, float] = {}
        for name, seconds in self_times.items():
            grouped[group_name(name)] = grouped.get(group_name(name), 0.0) + seconds
        for group, seconds in grouped.items():
            totals.setdefault(group, []).append(seconds)
    candidates = {group: stats.median(values) for group, values in totals.items() if group != ROOT}
    if not candidates:
        return None
    return max(candidates, key=candidates.__getitem__)


def glob_seconds(calls: Sequence[tuple[dict[str, float], dict[str, float]]], pattern: str) -> list[float]:
    """Per call, the inclusive seconds of every module matching ``pattern`` that no other matching
    module encloses (so nested matches are not counted twice)."""
    out = []
    for inclusive, _ in calls:
        matched = [name for name in inclusive if fnmatch.fnmatchcase(name, pattern)]
        outermost = [name for name in matched
                     if not any(other != name and (other == ROOT or name.startswith(other + ".")) for other in matched)]
        out.append(sum(inclusive[name] for name in outermost))
    return out


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
                             "reasons": list(r.verdict.reasons)} for r in self.results]}


def _golden_names(bundle: Any, paths: Sequence[str]) -> dict[str, str]:
    """The bundle entry each output path of the forward is judged against: ``<root>/path`` where
    the root's output was recorded, else ``path`` itself where the forward returns recorded
    modules' outputs by module name (the attention subject)."""
    rooted = {path: tensor_name(ROOT, path) for path in paths}
    if all(bundle.has(name) for name in rooted.values()):
        return rooted
    direct = {path: path for path in paths}
    if all(bundle.has(name) for name in direct.values()):
        return direct
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
    cases = getattr(prepared.runner.subject, "cases", None)
    if not isinstance(cases, (list, tuple)) or len(cases) < 2:
        return []
    ids = [getattr(case, "id", None) for case in cases]
    children = set(dict(next(iter(prepared.modules.values())).named_children()))
    if not all(isinstance(case_id, str) and case_id in children for case_id in ids):
        return []
    return ids


# ---------------------------------------------------------------------------------------------
# The run


def run_bench(subject: str | None, *, subject_args: Mapping[str, Any] | None = None, bundle: Any | None = None,
              options: BenchOptions, device: torch.device | str = "cpu", policy: Any = None,
              trusted: Sequence[str] = (), progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the benchmark and return the report document (``parity-bench-report``)."""

    options.check()
    started = time.monotonic()
    say = progress or (lambda message: None)
    device = check_device(device)
    policy = as_policy(policy)
    impls = list(options.impls)
    prepared = prepare(subject, subject_args, impls=impls, device=device, bundle=bundle, trusted=trusted)
    say(f"{prepared.runner.name}: {len(impls)} impls on {device}; inputs from {prepared.source}")

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
    clock_before = clock_mhz(device)
    times, last, orders = timed_rounds(prepared, impls, reps=options.reps, seed=options.seed, device=device,
                                       flush=flush, progress=say)
    clock_after = clock_mhz(device)
    flush.release()
    cases = case_ids(prepared)
    outcomes = judge_outputs(last, impls=impls, bundle=prepared.bundle, policy=policy, case_ids=cases)
    del last

    warnings: list[str] = []
    if clock_before is not None and clock_after is not None and clock_after < 0.9 * clock_before:
        warnings.append(f"the device clock fell from {clock_before} to {clock_after} MHz during the timed rounds: "
                        "throttling; the timings are not comparable with a cool run")
    summaries = {impl: stats.summarize(times[impl]) for impl in impls}
    for impl in impls:
        warning = stats.noise_warning(summaries[impl], f"{impl} (whole forward)")
        if warning:
            warnings.append(warning)
    baseline = impls[0]
    rows = []
    for impl in impls:
        row: dict[str, Any] = {"impl": impl, "times_s": times[impl], "summary": summaries[impl].to_dict(),
                               "first_call_s": first_call[impl], "parity": outcomes[impl].to_dict()}
        if impl != baseline:
            comparison = stats.compare(times[baseline], times[impl], min_effect=options.min_effect,
                                       seed=options.seed, what=impl)
            warnings.extend(comparison.warnings)
            row["vs_baseline"] = comparison.to_dict()
            row["valid"] = outcomes[impl].holds and outcomes[baseline].holds
            row["validity"] = _validity(outcomes, impl, baseline)
        rows.append(row)

    fastest = min(impls, key=lambda impl: summaries[impl].median)
    modules_section = None
    fast_p_section = None
    if options.module_timing:
        say(f"timing modules: {options.reps} interleaved rounds with hooks")
        calls = module_rounds(prepared, impls, reps=options.reps, seed=options.seed, device=device)
        patterns = list(options.modules) if options.modules else [g for g in [hot_group(calls[baseline])] if g]
        modules_section = _modules_section(calls, patterns, impls, options, summaries, warnings)
        if cases:
            fast_p_section = _fast_p_section(calls, cases, impls, options, outcomes)

    passed = outcomes[fastest].holds
    verdict = _verdict_line(fastest, outcomes, rows, baseline)
    document = {
        **envelope(BENCH_REPORT),
        "subject": prepared.runner.describe(), "bundle": str(prepared.bundle.path) if prepared.bundle else None,
        "inputs": prepared.source, "device": str(device), "platform": platform.fingerprint(device),
        "settings": {"impls": impls, "baseline": baseline, "warmup": options.warmup, "reps": options.reps,
                     "seed": options.seed, "min_effect": options.min_effect, "fast_p": options.fast_p,
                     "confidence": stats.DEFAULT_CONFIDENCE, "resamples": stats.DEFAULT_RESAMPLES,
                     "cache_flush": flush.note, "cache_flush_bytes": flush.nbytes,
                     "timer": "host clock between whole-device synchronisations",
                     "judged": "the output of each impl's last timed call",
                     "judged_against": ("the bundle's golden" if prepared.bundle is not None
                                        else f"the output of {baseline} (no bundle)"),
                     "orders": orders[:5]},
        "clock_mhz": {"before": clock_before, "after": clock_after},
        "impls": rows, "fastest": fastest, "passed": passed, "verdict": verdict,
        "modules": modules_section, "cases": fast_p_section,
        "warnings": warnings, "seconds": time.monotonic() - started,
    }
    return finite(document)


def _validity(outcomes: Mapping[str, ParityOutcome], impl: str, baseline: str) -> str:
    outcome = outcomes[impl]
    if not outcome.holds:
        return f"not valid: parity fails at {outcome.failing[0]}"
    if not outcomes[baseline].holds:
        return f"not valid: the baseline {baseline} fails parity at {outcomes[baseline].failing[0]} (unverified)"
    return "valid: parity holds"


def _verdict_line(fastest: str, outcomes: Mapping[str, ParityOutcome], rows: list[dict[str, Any]],
                  baseline: str) -> str:
    outcome = outcomes[fastest]
    if not outcome.holds:
        return (f"SPEEDUP NOT VALID: the fastest impl, {fastest}, fails parity at {outcome.failing[0]} "
                f"({len(outcome.failing)} of {outcome.tensors} tensors fail)")
    if fastest == baseline:
        return f"NO SPEEDUP: the baseline {baseline} is the fastest"
    row = next(row for row in rows if row["impl"] == fastest)
    cmp = row["vs_baseline"]
    if not row["valid"]:
        return f"{fastest} is fastest, {row['validity']}"
    return (f"SPEEDUP VALID: {fastest} {cmp['speedup']:.2f}x {baseline} [{cmp['ci_low']:.2f}, {cmp['ci_high']:.2f}] "
            f"{cmp['verdict']}, parity holds ({outcome.tensors} tensor{'s' if outcome.tensors != 1 else ''})")


def _modules_section(calls, patterns, impls, options, summaries, warnings) -> dict[str, Any]:
    baseline = impls[0]
    section: dict[str, Any] = {"patterns": patterns, "rows": []}
    for pattern in patterns:
        per_impl = {impl: glob_seconds(calls[impl], pattern) for impl in impls}
        if not any(per_impl[baseline]):
            warnings.append(f"--module {pattern!r} matches no module that ran")
            continue
        share = stats.median(per_impl[baseline]) / summaries[baseline].median
        for impl in impls:
            row: dict[str, Any] = {"module": pattern, "impl": impl,
                                   "summary": stats.summarize(per_impl[impl]).to_dict()}
            if impl != baseline and min(per_impl[impl]) > 0:
                comparison = stats.compare(per_impl[baseline], per_impl[impl], min_effect=options.min_effect,
                                           seed=options.seed, what=f"{impl} {pattern}")
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
    """0 when the fastest impl holds parity, 1 when it fails (its speed claims nothing)."""
    return 0 if document["passed"] else 1


def parse_impls(text: str) -> tuple[str, ...]:
    impls = tuple(part.strip() for part in text.split(","))
    if not all(impls) or not all(re.fullmatch(r"[\w.\-]+", impl) for impl in impls):
        raise UsageError(f"--impls must be a comma-separated list of implementation names, got {text!r}")
    return impls


__all__ = ["BenchOptions", "CacheFlush", "ModuleTimer", "exit_status",
           "flush_bytes", "glob_seconds", "group_name", "hot_group", "judge_outputs", "parse_impls", "run_bench"]
