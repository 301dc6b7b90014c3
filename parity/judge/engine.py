"""The comparison engine: a :class:`Judge` of (name, tensor) pairs from any tensor source against a golden bundle.

One engine behind every comparison (Polygraphy's separation of running from comparing): a
*tensor source* produces :class:`Obtained` tensors, the judge compares each with its golden
counterpart under one policy and budget mode and returns a :class:`~parity.judge.results.TensorResult`.
The sources: this host's live run (``compare``: a recorder callback), the replay of single layers
on their golden inputs (:func:`replayed_layers`, ``--isolate``), another bundle
(:func:`bundle_outputs`, ``diff``) and the tensors a test hands to the pytest plugin.

The judge reads a golden tensor when its counterpart arrives, onto the counterpart's device, and
drops both after the metrics: one tensor and its golden (plus, in budget mode, its reference) are
in memory at a time, and with ``read_ahead`` (compare, diff) the next goldens, read on a
background thread, up to about 512 MiB (:class:`ReadAhead`). Tensors recorded on one side only, or with another shape or
dtype, are results (``missing-here``, ``missing-in-golden``, ``shape-mismatch``, ``dtype-mismatch``),
never crashes; a dtype mismatch still gets metrics (both sides in float64), judged by the golden
dtype's tolerance. A golden tensor of a module that was never obtained, inside a module whose
output was, is ``fused-here`` (fusing is the usual reason for a port): not a failure, the
enclosing module carries the verdict (``Policy.strict_structure`` makes it ``missing-here``).
A golden output of a layer call that ran here (another output of the same call was obtained)
but returned nothing at that place (``None``: attention weights only one backend materializes)
is ``absent-here``: not a failure either, because an output the model goes on to use changes
what is downstream of it, and that fails there; ``Policy.strict_structure`` makes it
``missing-here``, with the same message naming the output and its module.

Error budget (parity/NUMERICS.md, the flash-attention rule): the candidate's error against the golden's
high-precision reference may be at most ``k`` times the golden's own plus a rounding floor
(``parity.judge.policy.budget_floors``), for rel L2 and max abs. ``budget``: None checks it wherever a
reference exists, with the policy's ``budget_k``; True requires it (``DEFAULT_BUDGET_K`` unless
the policy sets one; a tensor without a reference is noted as not checked); False never.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch

from parity.base.dtypes import dtype_text
from parity.base.errors import UsageError
from parity.bundle.manifest import Entry
from parity.bundle.reader import BundleReader
from parity.judge.bounds import Bound, check_bound
from parity.judge.checks import BACKSTOP, ErrorBudget, Verdict, budget_floors, judge, measure, waive_backstop
from parity.judge.op_bounds import module_bound
from parity.judge.metrics import LayerMetrics, compute_error_vs_reference, compute_metrics_and_errors
from parity.judge.policy import DEFAULT_BUDGET_K, Policy, Tolerance
from parity.judge.results import BudgetInfo, TensorResult, module_of, shape_text
from parity.run.recorder import ROOT, find_module, flatten, layer_inputs, replay
from parity.run.runtime import Progress, fresh_copy

MISSING_HERE = "missing here: this host's run produced no such tensor"
MISSING_IN_GOLDEN = "missing in the golden bundle: the golden host recorded no such tensor"


@dataclasses.dataclass(frozen=True)
class Obtained:
    """One tensor from a source: ``name`` names the result (policy overrides match it), ``key`` the
    golden entry it is judged against (default: ``name``). ``tensor`` None: the source could not
    produce it, and ``status``/``note`` say why (a replay that was impossible or raised)."""

    name: str
    tensor: torch.Tensor | None
    layer: str | None = None
    path: str | None = None
    key: str | None = None
    status: str | None = None
    note: str | None = None
    bound: Bound | None = None  # the op's derived rounding bound on these inputs (a replay of a known op)


class Judge:
    """Judges obtained tensors against the outputs of one golden bundle, under one policy and budget mode.

    ``has_reference(key)``: whether the budget may use the golden's reference of a tensor (default:
    the golden holds one). ``label(key)``: the result name of a golden entry never obtained
    (default: the key). ``wording``: the reasons of ``missing-here`` / ``missing-in-golden``.
    ``read_ahead``: the golden keys in the order the source will produce them; their goldens (and
    references, where the budget will use them) are then read on a background thread while the
    source runs and the previous tensor's metrics are computed (:class:`ReadAhead`); call
    :meth:`close` when done.
    """

    def __init__(self, golden: BundleReader, policy: Policy | None = None, budget: bool | None = None, *,
                 has_reference: Callable[[str], bool] | None = None, label: Callable[[str], str] | None = None,
                 wording: Mapping[str, str] | None = None, read_ahead: Iterable[str] | None = None):
        self.golden = golden
        self.policy = Policy() if policy is None else policy
        self.budget = budget
        self.has_reference = has_reference or (lambda key: golden.has(key, "reference"))
        self.label = label or (lambda key: key)
        self.wording = {"missing-here": MISSING_HERE, "missing-in-golden": MISSING_IN_GOLDEN, **(wording or {})}
        self.seen: set[str] = set()  # golden keys obtained
        self.compared_modules: set[str] = set()
        self.ran_layers: set[str] = set()  # layer calls with at least one output obtained here
        self.reader: ReadAhead | None = None
        if read_ahead is not None:
            reads: list[tuple[str, str]] = []
            for key in read_ahead:  # in the order __call__ loads them: the reference first
                if not golden.has(key):
                    continue
                entry = golden.entry(key)
                has_ref = self.has_reference(key)
                if has_ref and self.tolerance(key, entry.torch_dtype, has_ref).budget_k is not None:
                    reads.append(("reference", key))
                reads.append(("output", key))
            self.reader = ReadAhead(golden, reads)

    def _load(self, key: str, kind: str, device: torch.device) -> torch.Tensor:
        if self.reader is not None:
            return self.reader.load(kind, key, device)
        return self.golden.load(key, kind, device=device)

    def close(self) -> None:
        """Stop reading ahead (waits for a read in progress); the judge still works, reading directly."""
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    def tolerance(self, name: str, dtype: torch.dtype, has_reference: bool) -> Tolerance:
        return budget_tolerance(self.policy.resolve(name, dtype), self.budget, dtype, has_reference)

    def __call__(self, item: Obtained) -> TensorResult:
        key = item.key or item.name
        out = item.tensor
        if out is None and item.status == "absent-here":
            return self.absent(self.golden.entry(key), name=item.name)
        if out is None:
            return self.unavailable(self.golden.entry(key), item.status, item.note, name=item.name, note=item.note)
        if item.layer is not None:
            self.ran_layers.add(item.layer)
        if not self.golden.has(key):
            tol = self.tolerance(item.name, out.dtype, False)
            return failure(item.name, "missing-in-golden", self.wording["missing-in-golden"], tol, layer=item.layer,
                           path=item.path, dtype=dtype_text(out.dtype), shape=tuple(out.shape),
                           here_dtype=dtype_text(out.dtype), here_shape=tuple(out.shape))
        self.seen.add(key)
        entry = self.golden.entry(key)
        has_reference = self.has_reference(key)
        tol = self.tolerance(item.name, entry.torch_dtype, has_reference)
        reference = None
        if tol.budget_k is not None and has_reference and tuple(out.shape) == entry.shape:
            reference = self._load(key, "reference", out.device)
        result = compare_tensors(item.name, out, self._load(key, "output", out.device), policy=self.policy,
                                 reference=reference, budget=self.budget, layer=item.layer, path=item.path,
                                 tolerance=tol if reference is not None or not has_reference else None,
                                 bound=item.bound)
        self.compared_modules.add(module_of(result))
        return result

    def judge_all(self, source: Iterable[Obtained]) -> Iterator[TensorResult]:
        """One result per obtained tensor, as the source produces them."""
        for item in source:
            yield self(item)

    def unavailable(self, entry: Entry, status: str, reason: str, *, name: str, note: str | None) -> TensorResult:
        """A failure of a golden tensor the source did not produce (``status`` says how)."""
        tol = self.tolerance(name, entry.torch_dtype, self.has_reference(entry.name))
        return failure(name, status, reason, tol, layer=entry.layer, path=entry.path, dtype=entry.dtype,
                       shape=entry.shape, note=note)

    def absent(self, entry: Entry, *, name: str, strict: bool | None = None) -> TensorResult:
        """A golden output that its layer call, which ran here, did not return: ``absent-here``
        (passes), or ``missing-here`` with ``strict`` (default ``policy.strict_structure``)."""
        strict = self.policy.strict_structure if strict is None else strict
        reason = absent_text(entry)
        if strict:
            return self.unavailable(entry, "missing-here", f"missing here: {reason} (strict_structure)", name=name,
                                    note=None)
        tol = self.tolerance(entry.name, entry.torch_dtype, self.has_reference(entry.name))
        return TensorResult(name=name, status="absent-here", tolerance=tol, verdict=Verdict(passed=True),
                            layer=entry.layer, path=entry.path, dtype=entry.dtype, shape=entry.shape,
                            note=f"{reason}; judged through what uses it downstream")

    def not_obtained(self, *, strict: bool | None = None) -> dict[str, TensorResult]:
        """Golden outputs never obtained, by key: ``absent-here`` where another output of the same
        layer call was obtained, ``fused-here`` inside a compared module, else ``missing-here``
        (always with ``strict``, default ``policy.strict_structure``; an absent output then says so)."""
        strict = self.policy.strict_structure if strict is None else strict
        results = {}
        for entry in self.golden.entries_of("output"):
            if entry.name in self.seen:
                continue
            if entry.layer is not None and entry.layer in self.ran_layers:
                results[entry.name] = self.absent(entry, name=self.label(entry.name), strict=strict)
                continue
            enclosing = None if strict else _enclosing(entry.module or entry.layer, self.compared_modules)
            if enclosing is None:
                results[entry.name] = self.unavailable(entry, "missing-here", self.wording["missing-here"],
                                                       name=self.label(entry.name), note=None)
                continue
            tol = self.tolerance(entry.name, entry.torch_dtype, self.has_reference(entry.name))
            results[entry.name] = TensorResult(
                name=self.label(entry.name), status="fused-here", tolerance=tol, verdict=Verdict(passed=True),
                layer=entry.layer, path=entry.path, dtype=entry.dtype, shape=entry.shape,
                note=f"not run here; judged through its enclosing module {enclosing}")
        return results

    def in_golden_order(self, results: list[TensorResult], *, strict: bool | None = None) -> list[TensorResult]:
        """``results`` in their order, each golden tensor never obtained just before the first
        golden tensor recorded after it that was (those at the end go last)."""
        golden_order = {entry.name: index for index, entry in enumerate(self.golden.entries_of("output"))}
        missing = self.not_obtained(strict=strict)
        pending = sorted(missing, key=golden_order.__getitem__)
        ordered: list[TensorResult] = []
        for result in results:
            position = golden_order.get(result.name)
            if position is not None:
                while pending and golden_order[pending[0]] < position:
                    ordered.append(missing[pending.pop(0)])
            ordered.append(result)
        return ordered + [missing[key] for key in pending]


def absent_text(entry: Entry) -> str:
    """Which output of which module call is absent here, in words."""
    module = entry.module or (entry.layer or entry.name).split("#", 1)[0]
    call = f" (call #{entry.call_index})" if entry.layer is not None and "#" in entry.layer else ""
    where = f"output {entry.path!r}" if entry.path else "the output"
    return (f"{where} of {module}{call} is absent here: this host's call ran and returned its other outputs, "
            "but no tensor there (None), where the golden host's returned one")


def _enclosing(module: str, compared_modules: set[str]) -> str | None:
    """The innermost module enclosing ``module`` whose output was compared, if any."""
    module = module.split("#", 1)[0]
    parts = module.split(".") if module != ROOT else []
    for depth in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:depth])
        if parent in compared_modules:
            return parent
    if module != ROOT and ROOT in compared_modules:
        return ROOT
    return None


# ---------------------------------------------------------------------------------------------
# One tensor


def budget_tolerance(tol: Tolerance, budget: bool | None, dtype: torch.dtype, has_reference: bool) -> Tolerance:
    """The tolerance with the budget mode applied (module docstring). Integer and bool tensors
    never have a budget (they are compared exactly: there is no rounding error to budget); by
    default a tensor without a reference has none either (the thresholds judge it)."""
    unbudgeted = not dtype.is_floating_point or budget is False or (budget is None and not has_reference)
    if unbudgeted:
        return replace(tol, budget_k=None) if tol.budget_k is not None else tol
    if budget is True and tol.budget_k is None:
        return replace(tol, budget_k=DEFAULT_BUDGET_K)
    return tol


def failure(name: str, status: str, reason: str, tol: Tolerance, **fields: Any) -> TensorResult:
    """A result that failed without metrics (missing on a side, shape mismatch, no replay)."""
    return TensorResult(name=name, status=status, tolerance=tol, verdict=Verdict(passed=False, reasons=[reason]),
                        **fields)


def _measure(out: torch.Tensor, golden: torch.Tensor, reference: torch.Tensor | None,
             tol: Tolerance) -> tuple[LayerMetrics, tuple[LayerMetrics, LayerMetrics] | None]:
    """``measure(out, golden, tol)``, and both hosts' errors against the reference where
    :func:`_budget_info` will want them, in one scan of the three tensors
    (``compute_metrics_and_errors``: the same numbers as the three separate calls)."""
    if (reference is not None and tuple(reference.shape) == tuple(golden.shape)
            and out.is_floating_point() and golden.is_floating_point()):
        try:
            metrics, host, capture = compute_metrics_and_errors(
                out, golden, reference.to(out.device), atol=tol.atol, rtol=tol.rtol, atol_rms=tol.atol_rms,
                outlier_factor=tol.outlier_factor)
            return metrics, (host, capture)
        except ValueError:
            pass  # a reference less precise than the tensor: measured apart, and _budget_info says why
    return measure(out, golden, tol), None


def _budget_info(out: torch.Tensor, golden: torch.Tensor, reference: torch.Tensor | None,
                 tol: Tolerance, errors: tuple[LayerMetrics, LayerMetrics] | None = None) -> BudgetInfo:
    def info(note: str, ref_dtype: str | None = None) -> BudgetInfo:
        return BudgetInfo(None, None, tol.budget_k, None, ref_dtype, note)

    if reference is None:
        return info("no high-precision reference of this tensor in the bundle")
    ref_dtype = dtype_text(reference.dtype)
    if tuple(reference.shape) != tuple(golden.shape):
        return info(f"reference shape {shape_text(tuple(reference.shape))} differs from the golden's", ref_dtype)
    if not (out.is_floating_point() and golden.is_floating_point()):
        return info("the error budget applies to floating-point tensors only", ref_dtype)
    if errors is not None:  # measured with the golden pair, in one scan
        host, capture = errors
    else:
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
    policy: Policy | None = None,
    reference: torch.Tensor | None = None,
    budget: bool | None = None,
    layer: str | None = None,
    path: str | None = None,
    tolerance: Tolerance | None = None,
    bound: Bound | None = None,
) -> TensorResult:
    """Compare one tensor (``out``) with its golden under ``policy`` (default: built-in).

    The tolerance is ``policy.resolve(name, golden.dtype)`` with the budget mode applied.
    ``reference``: the golden host's high-precision reference of ``golden``; with it, both sides'
    errors against it are computed (``TensorResult.budget``) and checked when the tolerance has
    ``budget_k`` (a budget without a reference is a note in the verdict: not checked). Metrics are
    computed on ``out``'s device. A shape or dtype mismatch is a result, never an exception.
    ``tolerance``: the tolerance already resolved for this tensor (the judge passes it).
    ``bound``: the op's derived rounding bound on the inputs both sides computed from (a replay
    on golden inputs); the result then carries measured / derived (evidence, never the verdict).
    """
    tol = tolerance
    if tol is None:
        tol = budget_tolerance((Policy() if policy is None else policy).resolve(name, golden.dtype), budget, golden.dtype,
                               reference is not None)
    fields = dict(layer=layer, path=path, dtype=dtype_text(golden.dtype), shape=tuple(golden.shape),
                  here_dtype=dtype_text(out.dtype), here_shape=tuple(out.shape))
    if tuple(out.shape) != tuple(golden.shape):
        reason = (f"shape mismatch: {shape_text(tuple(out.shape))} here, {shape_text(tuple(golden.shape))} "
                  "in the golden")
        return failure(name, "shape-mismatch", reason, tol, **fields)
    golden = golden.to(out.device)
    metrics, errors = _measure(out, golden, reference, tol)
    budget_info = None
    if reference is not None or tol.budget_k is not None:
        budget_info = _budget_info(out, golden, reference, tol, errors)
    error_budget = None
    if budget_info is not None and budget_info.host_vs_reference is not None:
        error_budget = ErrorBudget(capture_vs_reference=budget_info.capture_vs_reference,
                                   host_vs_reference=budget_info.host_vs_reference)
    verdict = judge(metrics, tol, budget=error_budget)
    if (not verdict.passed and error_budget is not None and tol.budget_k is not None and verdict.failed
            and set(verdict.failed) <= set(BACKSTOP)):
        # only backstop checks failed, within the budget: does the golden itself meet them?
        verdict = waive_backstop(verdict, tol, measure(golden, reference.to(out.device), tol))
    if tol.budget_k is not None and error_budget is None and budget_info is not None:
        # judge's note says only that the check was not made; say why (as judge does, a note).
        verdict = replace(verdict, notes=[f"error budget not checked: {budget_info.note}"
                                          if note.startswith("error budget") else note for note in verdict.notes])
    status = "pass" if verdict.passed else "fail"
    if out.dtype != golden.dtype:
        reason = f"dtype mismatch: {dtype_text(out.dtype)} here, {dtype_text(golden.dtype)} in the golden"
        verdict = replace(verdict, passed=False, reasons=[reason] + verdict.reasons)
        status = "dtype-mismatch"
    derived = None
    if bound is not None and out.is_floating_point() and golden.is_floating_point():
        derived = check_bound(out, golden, bound, sides=2)
    return TensorResult(name=name, status=status, tolerance=tol, verdict=verdict, metrics=metrics,
                        budget=budget_info, derived=derived, **fields)


# ---------------------------------------------------------------------------------------------
# Reading goldens ahead


class ReadAhead:
    """Loads a bundle's tensors in an expected order, reading ahead on background threads.

    ``load(kind, name, device)`` returns the tensor (checksum verified by the bundle reader; a
    BundleError is raised here as ``BundleReader.load`` would raise it); a tensor out of the
    expected order is read directly, and the read-ahead resumes after it. Tensors read ahead but
    never asked for are dropped. ``pread`` and sha256 release the GIL, so the threads overlap the
    forward and the metrics (one thread on a 2-core machine, whose other core computes). At most
    ``workers + 1`` tensors, and about ``max_bytes``, are held beyond the one being compared.
    Once a tensor has been asked for on an accelerator, the threads also copy what they read to
    it, so the host-to-device copies overlap the forward and the metrics too.
    """

    def __init__(self, bundle: BundleReader, order: Sequence[tuple[str, str]], *, workers: int | None = None,
                 max_bytes: int = 512 * 2**20):
        self.bundle = bundle
        self.order = list(order)
        self.position = {key: index for index, key in enumerate(self.order)}
        self.workers = workers or max(1, min(4, (os.cpu_count() or 2) - 1))
        self.max_bytes = max_bytes
        self.next = 0  # index in ``order`` of the next tensor to read ahead
        self.device: torch.device | None = None  # where the threads put what they read (None: the CPU)
        self.stream: Any = None  # the stream that uses what they read onto ``device``
        self.pending: dict[tuple[str, str], Future] = {}
        self.executor: ThreadPoolExecutor | None = None
        self._read_ahead()  # from now: the first tensors are read while the source starts

    def load(self, kind: str, name: str, device: torch.device | str | None) -> torch.Tensor:
        key = (kind, name)
        if device is not None and torch.device(device).type != "cpu":
            self.device = torch.device(device)
            # the reading threads copy on a side stream; this thread's stream, which uses what
            # they read, waits for those copies
            self.stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        future = self.pending.pop(key, None)
        index = self.position.get(key)
        if index is not None and index >= self.next:
            self.next = index + 1
        if index is not None:  # what was read ahead of a tensor asked for later is not needed
            for stale in [other for other in self.pending if self.position[other] < index]:
                self.pending.pop(stale).cancel()
        self._read_ahead()
        tensor = future.result() if future is not None else self.bundle.load(name, kind)
        return tensor if device is None else tensor.to(device)

    def _nbytes(self, key: tuple[str, str]) -> int:
        return self.bundle.entry(key[1], key[0]).nbytes

    def _read_ahead(self) -> None:
        if self.executor is None:
            self.executor = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="parity-read")
        held = sum(self._nbytes(key) for key in self.pending)
        while len(self.pending) <= self.workers and self.next < len(self.order):
            key = self.order[self.next]
            nbytes = self._nbytes(key)
            if self.pending and held + nbytes > self.max_bytes:
                break
            self.next += 1
            held += nbytes
            self.pending[key] = self.executor.submit(self._read, key[0], key[1], self.device, self.stream)

    def _read(self, kind: str, name: str, device: torch.device | None, stream: Any) -> torch.Tensor:
        # onto an accelerator through page-locked pieces (BundleReader.load_to)
        return (self.bundle.load(name, kind) if device is None
                else self.bundle.load_to(name, kind, device=device, stream=stream))

    def close(self) -> None:
        for future in self.pending.values():
            future.cancel()
        self.pending.clear()
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None


# ---------------------------------------------------------------------------------------------
# Sources


def bundle_outputs(bundle: BundleReader, keys: Iterable[str] | None = None) -> Iterator[Obtained]:
    """The recorded outputs of a bundle (those named by ``keys``, default all), on the CPU, in the
    bundle's order (``diff``); read ahead on a background thread (:class:`ReadAhead`)."""
    wanted = None if keys is None else set(keys)
    entries = [entry for entry in bundle.entries_of("output") if wanted is None or entry.name in wanted]
    reader = ReadAhead(bundle, [("output", entry.name) for entry in entries])
    try:
        for entry in entries:
            yield Obtained(entry.name, reader.load("output", entry.name, None), layer=entry.layer, path=entry.path)
    finally:
        reader.close()


def replayed_layers(bundle: BundleReader, module: torch.nn.Module, device: torch.device,
                    say: Progress | None = None) -> Iterator[Obtained]:
    """Every recorded layer call replayed on its golden inputs (``--isolate``), one output at a time.

    A layer that cannot be replayed yields each of its outputs without a tensor and with the
    reason: ``not-recorded`` (no recorded inputs), ``missing-here`` (no such module here),
    ``not-replayable`` (an input the recorder could not store), ``replay-error`` (the module
    raised on its golden inputs: a result, shown as such). Damage is a BundleError, not a result.
    """
    say = say or Progress(None)
    outputs_by_layer: dict[str, list[Entry]] = {}
    for entry in bundle.entries_of("output"):
        outputs_by_layer.setdefault(entry.layer, []).append(entry)
    layers = bundle.layers()
    say(f"isolate: replaying {len(layers)} layers on their golden inputs")
    for number, layer in enumerate(layers):
        entries = outputs_by_layer.get(layer["name"], [])
        if not entries:
            continue
        problem = None
        if layer["inputs"] is None:
            problem = ("not-recorded", "no recorded inputs for this layer")
        elif layer["module"] != ROOT and not _has_submodule(module, layer["module"]):
            problem = ("missing-here", f"this host's model has no module {layer['module']!r}")
        if problem is None:
            recorded = {path: fresh_copy(tensor, device)
                        for path, tensor in bundle.module_inputs(layer["name"]).items()}
            try:
                with torch.no_grad():
                    output = replay(module, layer, recorded)
            except UsageError as err:  # an input the recorder could not store (an opaque object)
                problem = ("not-replayable", str(err))
            except Exception as err:  # the module failed on the golden inputs: a result, shown as such
                problem = ("replay-error", f"replay raised {type(err).__name__}: {' '.join(str(err).split())}")
        if problem is not None:
            for entry in entries:
                yield Obtained(entry.name, None, entry.layer, entry.path, status=problem[0], note=problem[1])
            continue
        produced = dict(flatten(output)[1])
        del output
        returned_any = bool(produced)
        bound_of = _op_bounds(module, layer, recorded)
        del recorded
        for entry in entries:
            tensor = produced.pop(entry.path or "", None)
            if tensor is None and returned_any:  # judged as a live run's absent output
                yield Obtained(entry.name, None, entry.layer, entry.path, status="absent-here")
            elif tensor is None:
                yield Obtained(entry.name, None, entry.layer, entry.path, status="missing-here",
                               note="the replayed layer produced no tensor")
            else:
                yield Obtained(entry.name, tensor, entry.layer, entry.path, bound=bound_of(entry.path or "", tensor))
        say.tick(lambda: f"isolate: replayed {number + 1} of {len(layers)} layers")


def _op_bounds(root: torch.nn.Module, layer: Mapping[str, Any], recorded: Mapping[str, torch.Tensor]
               ) -> Callable[[str, torch.Tensor], Bound | None]:
    """``(path, output) -> the derived bound`` of a replayed layer's outputs (None where the module
    is no known op, parity.judge.op_bounds). The bound is evidence beside the verdict: an op whose
    inputs it cannot read gets none rather than failing the replay."""
    target = find_module(root, layer["module"])
    args, kwargs = layer_inputs(layer, recorded)

    def bound_of(path: str, tensor: torch.Tensor) -> Bound | None:
        try:
            with torch.no_grad():
                return module_bound(target, args, kwargs, path, tensor)
        except (TypeError, ValueError, RuntimeError, AttributeError, IndexError, KeyError):
            return None

    return bound_of


def _has_submodule(root: torch.nn.Module, path: str) -> bool:
    try:
        root.get_submodule(path)
    except AttributeError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Report parts


def notes_as_warnings(results: list[TensorResult]) -> list[str]:
    """Checks the policy configured but that could not be made, grouped: one warning per note."""
    by_note: dict[str, list[str]] = {}
    for result in results:
        for note in result.verdict.notes:
            by_note.setdefault(note, []).append(result.name)
    return [f"{note} ({_some(names, 'tensor')})" for note, names in by_note.items()]


def fused_warning(results: list[TensorResult]) -> list[str]:
    fused = [result for result in results if result.status == "fused-here"]
    if not fused:
        return []
    modules = sorted({module_of(result) for result in fused})
    shown = ", ".join(modules[:3]) + (f" and {len(modules) - 3} more" if len(modules) > 3 else "")
    return [f"{len(modules)} recorded module{'s' if len(modules) != 1 else ''} never ran here ({shown}): "
            "fused here, judged through the enclosing module (strict_structure = true makes them failures)"]


def absent_warning(results: list[TensorResult]) -> list[str]:
    """One warning naming the golden outputs absent here (``absent-here``), which pass."""
    absent = [result for result in results if result.status == "absent-here"]
    if not absent:
        return []
    names = [result.name for result in absent]
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return [f"{len(names)} recorded output{'s' if len(names) != 1 else ''} absent here ({shown}): their module calls "
            "ran here but returned None there (attention weights only one backend materializes, say); not failures, "
            "an output the model uses fails downstream (strict_structure = true makes them failures)"]


def _some(names: list[str], noun: str) -> str:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{len(names)} {noun}{'s' if len(names) != 1 else ''}: {shown}"


def integrity(bundle: BundleReader) -> dict[str, Any]:
    """What was checked of the bundle: every tensor read had its checksum verified; the others
    (references not needed, module inputs without --isolate) were not read at all."""
    not_read: dict[str, int] = {}
    for entry in bundle.entries:
        if (entry.kind, entry.name) not in bundle.verified:
            not_read[entry.kind] = not_read.get(entry.kind, 0) + 1
    return {"tensors": len(bundle.entries), "verified": len(bundle.entries) - sum(not_read.values()),
            "not_read": not_read}
