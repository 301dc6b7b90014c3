"""The timing machinery of ``parity bench``: whole-device synchronisation, the cache flush, the
interleaved timed rounds with fresh (NaN-poisoned) outputs, and per-module timing with hooks.

Fresh outputs (:func:`timed_rounds`): before each timed call of an impl, the output of its previous
call is overwritten with NaN (:func:`poison`; integers with their largest value; the inputs' and
weights' memory never) and kept alive until the call returns. A forward that allocates its
output gets new memory and is not affected; one that returns a cached tensor, or writes into a
persistent output buffer, returns memory it returned before: that is counted (``reused``), and
unless the timed call rewrote all of it, the NaN makes its parity fail, so a result computed
once in the warm-up cannot pass as the timed call's.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from parity.run.recorder import ROOT, flatten, module_display_name
from . import stats

MIN_FLUSH_BYTES = 512 * 2**20


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


# ---------------------------------------------------------------------------------------------
# Timing: the interleaved rounds and fresh outputs


def storages(output: Any) -> set[int]:
    """The addresses of the memory that ``output``'s tensors live in (empty tensors left out)."""
    return {tensor.untyped_storage().data_ptr() for _, tensor in flatten(output)[1] if tensor.numel()}


def poison(output: Any, protected: set[int]) -> int:
    """Overwrite ``output``'s tensors with NaN (integers with their largest value), except those in
    ``protected`` memory (the inputs, the weights); the number of tensors overwritten. An impl that
    returns the same buffer again without rewriting all of it then fails parity instead of
    passing with a result computed in an earlier call."""
    poisoned = 0
    with torch.no_grad():
        for _, tensor in flatten(output)[1]:
            if not tensor.numel() or tensor.untyped_storage().data_ptr() in protected:
                continue
            if tensor.is_floating_point() or tensor.is_complex():
                value: float = math.nan
            elif tensor.dtype != torch.bool:
                value = torch.iinfo(tensor.dtype).max
            else:
                continue
            try:
                tensor.fill_(value)
            except RuntimeError:  # an expanded or inference-mode tensor: left as it is
                continue
            poisoned += 1
    return poisoned


@dataclasses.dataclass
class Rounds:
    """What the timed rounds give: seconds per call, each impl's last output, the round orders, and
    per impl the calls whose output shared memory with the previous call's output (reused)."""

    times: dict[str, list[float]]
    last: dict[str, Any]
    orders: list[list[str]]
    reused: dict[str, int]
    poisoned: dict[str, int]


def protected_memory(inputs: Mapping[str, torch.Tensor], modules: Iterable[nn.Module]) -> set[int]:
    """The memory of the inputs and of every module's parameters and buffers: never poisoned."""
    return storages(dict(inputs)) | {tensor.untyped_storage().data_ptr() for module in modules
                                     for tensor in (*module.parameters(), *module.buffers())}


def timed_rounds(forward: Callable[[str], Any], impls: Sequence[str], *, reps: int, seed: int,
                 device: torch.device, flush: CacheFlush, protected: set[int],
                 progress: Callable[[str], None] | None = None,
                 after_round: Callable[[], None] | None = None) -> Rounds:
    """``reps`` interleaved rounds of ``forward(impl)`` (:mod:`parity.speed.bench`, step 3);
    ``after_round`` is called after each round, outside the timed calls. Fresh outputs: before an impl's call its previous output is
    poisoned (:func:`poison`) and kept until the call returns, so that the new output cannot be
    put in its memory unless the impl reuses its own buffer, which is then counted."""
    rng = random.Random(seed)
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    last: dict[str, Any] = {}
    reused = {impl: 0 for impl in impls}
    poisoned = {impl: 0 for impl in impls}
    orders = []
    for round_index in range(reps):
        order = list(impls)
        rng.shuffle(order)
        orders.append(order)
        for impl in order:
            previous = last.pop(impl, None)
            if previous is not None:
                poisoned[impl] += poison(previous, protected) > 0
            flush()
            synchronize(device)
            start = time.perf_counter()
            output = forward(impl)
            synchronize(device)
            times[impl].append(time.perf_counter() - start)
            if previous is not None and storages(output) & storages(previous) - protected:
                reused[impl] += 1
            del previous
            last[impl] = output
        if after_round is not None:
            after_round()
        if progress is not None and (round_index + 1) % max(1, reps // 4) == 0:
            progress(f"timed round {round_index + 1} of {reps}")
    return Rounds(times, last, orders, reused, poisoned)


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


def module_rounds(modules: Mapping[str, nn.Module], forward: Callable[[str], Any], impls: Sequence[str], *,
                  reps: int, seed: int,
                  device: torch.device) -> dict[str, list[tuple[dict[str, float], dict[str, float]]]]:
    """Interleaved rounds with every module timed: per impl, per call, (inclusive, self) seconds by module."""
    rng = random.Random(seed + 1)
    timers = {impl: ModuleTimer(modules[impl], device) for impl in impls}
    result: dict[str, list[tuple[dict[str, float], dict[str, float]]]] = {impl: [] for impl in impls}
    try:
        for _ in range(reps):
            order = list(impls)
            rng.shuffle(order)
            for impl in order:
                synchronize(device)
                output = forward(impl)
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


__all__ = ["CacheFlush", "ModuleTimer", "Rounds", "flush_bytes", "glob_seconds", "group_name", "hot_group",
           "module_rounds", "poison", "protected_memory", "storages", "synchronize", "timed_rounds"]
