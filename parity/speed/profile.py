"""``parity profile``: where a subject's device time goes, by module, op and kernel.

Running (:func:`profile_subject`): the subject's forward under ``torch.profiler`` with the schedule
``skip_first`` / ``warmup`` / ``active`` (CUPTI on NVIDIA, roctracer or rocprofiler-sdk on ROCm,
through the same API; CPU activities alone on a CPU-only host). Every module's forward is wrapped
in a ``record_function`` range ``parity/<module>``, named as the recorder names modules in goldens
(``layers.0.attn.core``, the root ``<root>``); each step ends with a whole-device synchronisation,
so a step's wall time covers its device work.

Accounting (:func:`account`, a pure function of the profiler's events):

- Counted: device activity only, i.e. ``kernel``, ``gpu_memcpy`` and ``gpu_memset`` events; never
  op rows or ``gpu_user_annotation`` spans (which is how ``key_averages()`` counts a kernel twice,
  pytorch#60783, #130730). On a CPU-only host, each CPU op's *self* time (its duration minus its
  children's), so nested ops are not counted twice either.
- Charged to: the op or range torch links it to (its linked correlation id, else that of the
  runtime call with its correlation id), then the innermost ``parity/`` range around that op:
  its module. A runtime or driver call that torch linked to nothing (Triton's launches) is
  placed by time: the innermost frontend event around it on its thread. The
  shares of all modules (plus ``(outside modules)`` and ``(unattributed)``, shown when not empty)
  add up to 100% of the summed device time.
- Views: modules (grouped: numbered path parts become ``*``, so ``layers.*.attn.core`` sums every
  layer's), module calls (ungrouped), ops (the outermost op inside the module that launched the
  work, e.g. ``aten::linear``; a kernel launched by Python code directly is ``(launched from
  Python)``), kernels. Columns as ``rocprof --stats`` and ``nsys cuda_gpu_kern_sum``: calls,
  total, average, median, min, max, stddev (ns), % of device time; plus % of wall time.
- The hot module is the module group with the most device time; porting it could give the whole
  forward at most ``1 / (1 - share)`` (Amdahl).

Side by side (:func:`against`, ``--against``): by module where both are parity profiles, else by
kernel base name; b / a of the times per step where both have a step count, else of the totals
of the two captures as given (an imported table has no step count: :func:`against_warnings`
says so); b / a per call in every case.

Refused (:class:`ProfileError`, exit 2, one line): a profile with no device activity (CUPTI or
roctracer not working, kineto#1338), or one that ran inside a CUDA/HIP graph (graph launches hide
their kernels). Warned: a kernel count that differs between active steps; device work that could
not be attributed to a launch.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from parity.base.errors import UsageError
from parity.base.files import write_file_atomically
from parity.base.jsonformat import PROFILE_REPORT, envelope, finite
from . import stats
from .timing import group_name, synchronize
from torch.autograd.profiler import record_function
from parity.run.recorder import module_display_name
import torch
from torch.profiler import ProfilerActivity, profile, schedule
from parity.run.runtime import check_device, check_triton_mode
from parity.run.subjects import load_subject
from parity.run import platform
from .quiet import profiler_chatter_filtered
from .tables import amdahl_text, fmt_time, time_unit

RANGE_PREFIX = "parity/"
STEP_PREFIX = "ProfilerStep"
DEVICE_KINDS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
RUNTIME_KINDS = ("cuda_runtime", "cuda_driver", "privateuse1_runtime", "privateuse1_driver")
GRAPH_LAUNCHES = ("cudaGraphLaunch", "hipGraphLaunch", "cuGraphLaunch")
OUTSIDE = "(outside modules)"
UNATTRIBUTED = "(unattributed)"
PYTHON_LAUNCH = "(launched from Python)"
DEFAULT_SKIP, DEFAULT_WARMUP, DEFAULT_ACTIVE = 1, 2, 10


class ProfileError(UsageError):
    """A profile that cannot say where time goes (no device events, a CUDA graph)."""


@dataclasses.dataclass(frozen=True)
class Event:
    """One profiler event, as :func:`account` needs it (``kind``: kineto's activity type)."""

    name: str
    kind: str
    start_ns: int
    dur_ns: int
    thread: int = 0
    correlation: int = 0
    linked: int = 0
    on_device: bool = False

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.dur_ns


def kineto_events(kineto_results: Any) -> list[Event]:
    """The events of a finished ``torch.profiler`` run (``prof.profiler.kineto_results``)."""
    events = []
    for item in kineto_results.events():
        on_device = str(item.device_type()).split(".")[-1] != "CPU"
        kind = _activity(item, on_device)
        events.append(Event(name=item.name(), kind=kind, start_ns=int(item.start_ns()), dur_ns=int(item.duration_ns()),
                            thread=int(item.start_thread_id()), correlation=int(item.correlation_id()),
                            linked=int(item.linked_correlation_id()), on_device=on_device))
    return events


def _activity(item: Any, on_device: bool) -> str:
    """Kineto's activity type of an event; where this torch does not expose it, inferred as it
    names them (``Memcpy ...``/``Memset ...`` device events, ``cuda*``/``hip*`` runtime calls)."""
    reader = getattr(item, "activity_type", None)
    if callable(reader):
        return str(reader())
    name = item.name()
    if on_device:
        if item.is_user_annotation():
            return "gpu_user_annotation"
        return "gpu_memcpy" if name.startswith("Memcpy") else "gpu_memset" if name.startswith("Memset") else "kernel"
    if item.is_user_annotation():
        return "user_annotation"
    return "cuda_runtime" if name.startswith(("cuda", "hip", "cu")) and "::" not in name else "cpu_op"


# ---------------------------------------------------------------------------------------------
# Accounting


@dataclasses.dataclass
class _Node:
    event: Event
    parent: "_Node | None" = None
    children_ns: int = 0
    module: "_Node | None" = None  # innermost parity/ range, itself included
    step: "_Node | None" = None
    top_op: "_Node | None" = None  # outermost cpu_op below the module range


def _tree(cpu_events: Iterable[Event]) -> list[_Node]:
    """Nest CPU events per thread by time (a parent contains its children)."""
    nodes: list[_Node] = []
    by_thread: dict[int, list[Event]] = {}
    for event in cpu_events:
        by_thread.setdefault(event.thread, []).append(event)
    for events in by_thread.values():
        stack: list[_Node] = []
        for event in sorted(events, key=lambda e: (e.start_ns, -e.dur_ns)):
            while stack and stack[-1].event.end_ns <= event.start_ns:
                stack.pop()
            node = _Node(event, parent=stack[-1] if stack else None)
            if node.parent is not None:
                node.parent.children_ns += event.dur_ns
            parent = node.parent
            if event.kind == "user_annotation" and event.name.startswith(RANGE_PREFIX):
                node.module = node
            else:
                node.module = parent.module if parent else None
            node.step = node if event.name.startswith(STEP_PREFIX) else (parent.step if parent else None)
            if event.kind == "cpu_op":
                inside_module_op = parent is not None and parent.top_op is not None and parent.module is node.module
                node.top_op = parent.top_op if inside_module_op else node
            else:
                node.top_op = parent.top_op if parent is not None and parent.module is node.module else None
            nodes.append(node)
            stack.append(node)
    return nodes


@dataclasses.dataclass
class _Item:
    """One counted piece of time: a device event, or a CPU op's self time."""

    name: str
    kind: str
    ns: int
    start_ns: int
    end_ns: int
    module: _Node | None
    op: _Node | None
    step: _Node | None
    attributed: bool


def _place_unlinked_launches(nodes: Sequence[_Node], runtime_calls: Sequence[Event],
                             frontend: Mapping[int, _Node]) -> dict[int, _Node]:
    """The frontend event around each runtime or driver call that torch linked to nothing, by
    correlation id of the call. Seen on the H200 (torch 2.11, Triton 3.6): Triton's
    ``cuLaunchKernelEx`` is recorded, on the launching thread, inside the module's range, but with
    no link (calls made inside a torch op carry its id; Triton launches from Python, inside
    ``record_function`` ranges only). Runtime calls may carry another number for the same
    thread than torch's ops (the OS's): the numbering is learnt from the calls that are linked; a
    call whose number is neither learnt nor one of torch's threads stays unplaced."""
    unlinked = [call for call in runtime_calls if not call.linked and call.correlation]
    if not unlinked:
        return {}
    trees: dict[int, list[_Node]] = {}
    for node in nodes:
        trees.setdefault(node.event.thread, []).append(node)
    starts = {thread: [node.event.start_ns for node in tree] for thread, tree in trees.items()}
    thread_of: dict[int, int] = {}
    for call in runtime_calls:
        if call.linked and call.linked in frontend:
            thread_of.setdefault(call.thread, frontend[call.linked].event.thread)
    placed: dict[int, _Node] = {}
    for call in unlinked:
        thread = thread_of.get(call.thread, call.thread)
        if thread not in trees:
            continue
        # The last node on that thread starting at or before the call, then up to one that holds it.
        index = bisect.bisect_right(starts[thread], call.start_ns) - 1
        node = trees[thread][index] if index >= 0 else None
        while node is not None and not node.event.start_ns <= call.start_ns < node.event.end_ns:
            node = node.parent
        if node is not None:
            placed[call.correlation] = node
    return placed


def _row(name: str, values: Sequence[int], total_device: int, wall: int | None, calls: int | None = None,
         **extra: Any) -> dict[str, Any]:
    count = len(values) if calls is None else calls
    total = int(sum(values))
    n = len(values)
    mean = total / n if n else None
    stddev = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else (0.0 if n else None)
    return {"name": name, **extra, "calls": count, "total_ns": total,
            "avg_ns": total / count if count else None,
            "median_ns": stats.median(values) if values else None, "min_ns": min(values) if values else None,
            "max_ns": max(values) if values else None, "stddev_ns": stddev,
            "share": total / total_device if total_device else 0.0,
            "wall_share": total / wall if wall else None}


def _module_name(node: _Node | None) -> str | None:
    return None if node is None else node.event.name[len(RANGE_PREFIX):]


def account(events: Sequence[Event], *, cpu_only: bool = False) -> dict[str, Any]:
    """The views, totals, hot module and warnings of one profile's events (module docstring)."""
    cpu_events = [e for e in events if not e.on_device]
    graphs = sorted({e.name for e in cpu_events if any(g in e.name for g in GRAPH_LAUNCHES)})
    if graphs:
        raise ProfileError(f"the profiled forward ran inside a CUDA/HIP graph ({', '.join(graphs)}): a graph launch "
                           "hides its kernels from the profiler; profile the subject in eager mode")
    # The frontend events (torch ops, record_function ranges: linked to nothing) nest by time on
    # their thread. Runtime calls and device events link to the frontend event that issued them
    # (torch's linked correlation id); a runtime call's thread may be numbered differently (the
    # OS's), so it is placed through that link, or, where it has none, by time on the thread its
    # number maps to (_place_unlinked_launches).
    nodes = _tree(e for e in cpu_events if not e.linked and e.kind not in RUNTIME_KINDS)
    steps = [node for node in nodes if node.event.name.startswith(STEP_PREFIX)]
    warnings: list[str] = []

    items: list[_Item] = []
    if cpu_only:
        for node in nodes:
            if node.event.kind != "cpu_op":
                continue
            own = max(0, node.event.dur_ns - node.children_ns)
            items.append(_Item(node.event.name, "cpu_op", own, node.event.start_ns, node.event.end_ns, node.module,
                               node.top_op, node.step, True))
    else:
        frontend = {node.event.correlation: node for node in nodes if node.event.correlation}
        runtime_links = {e.correlation: e.linked for e in cpu_events if e.linked and e.kind in RUNTIME_KINDS}
        placed = _place_unlinked_launches(nodes, [e for e in cpu_events if e.kind in RUNTIME_KINDS], frontend)
        for event in events:
            if not event.on_device or event.kind not in DEVICE_KINDS:
                continue  # gpu_user_annotation and anything else on the device: not activity
            # The device event's own link, else the link of the runtime call with its correlation id,
            # else the frontend event around that runtime call in time.
            link = event.linked or runtime_links.get(event.correlation, 0)
            launcher = frontend.get(link) if link else placed.get(event.correlation)
            if launcher is None:
                step = next((s for s in steps if s.event.start_ns <= event.start_ns < s.event.end_ns), None)
                items.append(_Item(event.name, DEVICE_KINDS[event.kind], event.dur_ns, event.start_ns, event.end_ns,
                                   None, None, step, False))
                continue
            items.append(_Item(event.name, DEVICE_KINDS[event.kind], event.dur_ns, event.start_ns, event.end_ns,
                               launcher.module, launcher.top_op, launcher.step, True))
    if steps:
        items = [item for item in items if item.step is not None]
    if not items or sum(item.ns for item in items) == 0:
        what = "CPU op" if cpu_only else "kernel, memcpy or memset"
        raise ProfileError(f"the profile recorded no {what} activity in {len(steps)} active steps: the profiler saw "
                           "nothing to count (on a GPU: CUPTI/roctracer not working in this environment, e.g. "
                           "kineto#1338); refusing to show an empty table")

    device_total = sum(item.ns for item in items)
    wall = sum(step.event.dur_ns for step in steps) or None
    busy = _union([(item.start_ns, item.end_ns) for item in items if item.ns > 0]) if not cpu_only else \
        _union([(n.event.start_ns, n.event.end_ns) for n in nodes if n.event.kind == "cpu_op" and n.step is not None])
    per_step = [sum(1 for item in items if item.step is step) for step in steps]
    if len(set(per_step)) > 1:
        warnings.append(f"the number of counted events differs between active steps ({', '.join(map(str, per_step))}): "
                        "the forward does not do the same work each step (lazy initialisation, autotuning, "
                        "data-dependent paths); more --warmup steps may help")
    if cpu_only and wall and busy < 0.5 * wall:
        warnings.append(f"CPU ops ran {busy / wall:.0%} of the wall time; the rest is Python code between ops (the "
                        "Triton interpreter included), which a CPU profile does not attribute to modules")
    unattributed = sum(item.ns for item in items if not item.attributed)
    if unattributed:
        warnings.append(f"{unattributed / device_total:.1%} of device time could not be traced to the call that "
                        "launched it (no correlation id; pytorch#130560 on ROCm): shown as (unattributed)")

    # Module calls: every parity/ range instance in the active steps, with the time charged to it.
    instances: dict[int, int] = {}
    for node in nodes:
        if node.module is node and (not steps or node.step is not None):
            instances[id(node)] = 0
    outside: list[int] = []
    lost: list[int] = []
    for item in items:
        if not item.attributed:
            lost.append(item.ns)
        elif item.module is None:
            outside.append(item.ns)
        else:
            instances[id(item.module)] = instances.get(id(item.module), 0) + item.ns
    node_of = {id(node): node for node in nodes}
    per_module: dict[str, list[int]] = {}
    for key, ns in instances.items():
        per_module.setdefault(_module_name(node_of[key]), []).append(ns)
    inclusive = {name: 0 for name in per_module}
    for name, values in per_module.items():
        for other in inclusive:
            if other == name or other == "<root>" or name.startswith(other + "."):
                inclusive[other] += sum(values)
    module_calls = [_row(name, values, device_total, wall, inclusive_ns=inclusive[name])
                    for name, values in per_module.items()]
    grouped: dict[str, list[int]] = {}
    for name, values in per_module.items():
        grouped.setdefault(group_name(name), []).extend(values)
    modules = [_row(name, values, device_total, wall) for name, values in grouped.items()]
    for label, values in ((OUTSIDE, outside), (UNATTRIBUTED, lost)):
        if values:
            modules.append(_row(label, values, device_total, wall))
            module_calls.append(_row(label, values, device_total, wall, inclusive_ns=sum(values)))

    op_instances: dict[str, dict[int, int]] = {}
    for item in items:
        if cpu_only or item.op is not None:
            op = item.op if item.op is not None else None
            name = op.event.name if op is not None else item.name
            op_instances.setdefault(name, {}).setdefault(id(op) if op is not None else id(item), 0)
            op_instances[name][id(op) if op is not None else id(item)] += item.ns
        else:
            name = PYTHON_LAUNCH if item.attributed else UNATTRIBUTED
            op_instances.setdefault(name, {})[id(item)] = item.ns
    ops = [_row(name, list(values.values()), device_total, wall) for name, values in op_instances.items()]

    kernel_values: dict[tuple[str, str], list[int]] = {}
    for item in items:
        kernel_values.setdefault((item.name, item.kind), []).append(item.ns)
    kernels = [_row(name, values, device_total, wall, kind=kind) for (name, kind), values in kernel_values.items()]

    def by_total(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return sorted(rows, key=lambda row: (-row["total_ns"], row["name"]))

    candidates = [row for row in modules if row["name"] not in (OUTSIDE, UNATTRIBUTED) and row["total_ns"] > 0]
    hot = None
    if candidates:
        top = max(candidates, key=lambda row: row["total_ns"])
        hot = {"module": top["name"], "share": top["share"], "amdahl_bound": stats.amdahl(min(1.0, top["share"]))}
    return {"totals": {"device_ns": device_total, "wall_ns": wall, "busy_ns": busy,
                       "busy_share": busy / wall if wall else None, "steps": len(steps) or None,
                       "events_per_step": per_step},
            "modules": by_total(modules), "module_calls": by_total(module_calls), "ops": by_total(ops),
            "kernels": by_total(kernels), "hot": hot, "warnings": warnings}


def _union(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def headline(hot: Mapping[str, Any] | None, totals: Mapping[str, Any], what: str = "device time") -> str:
    """``hot module M: 85.0% of 12.3 ms of device time over 10 steps; ... at most 6.67x (Amdahl)``."""

    seconds = float(totals["device_ns"]) / 1e9
    unit, scale = time_unit([seconds])
    where = f"{fmt_time(seconds, scale)} {unit} of {what}"
    if totals.get("steps"):
        where += f" over {totals['steps']} steps"
    if not hot:
        return f"no module ranges: {where}"
    return (f"hot module {hot['module']}: {100 * float(hot['share']):.1f}% of {where}; porting it could make the "
            f"forward {amdahl_text(hot['amdahl_bound'])} (Amdahl)")


# ---------------------------------------------------------------------------------------------
# Running


class ModuleRanges:
    """A ``record_function`` range ``parity/<module>`` around every module's forward (hooks)."""

    def __init__(self, root: Any):


        self.record_function = record_function
        self.open: dict[int, list[Any]] = {}
        self.handles = []
        for path, module in root.named_modules():
            name = RANGE_PREFIX + module_display_name(path)
            self.handles.append(module.register_forward_pre_hook(self._pre(name)))
            self.handles.append(module.register_forward_hook(self._post))

    def _pre(self, name: str):
        def hook(module, args):
            scope = self.record_function(name)
            scope.__enter__()
            self.open.setdefault(id(module), []).append(scope)
        return hook

    def _post(self, module, args, output):
        self.open[id(module)].pop().__exit__(None, None, None)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _schedule(skip_first: int, warmup: int, active: int) -> Callable[[int], Any]:
    """torch's profiler schedule (no wait, one cycle), without torch's warning that warmup 0 "can
    skew profiler results": that is the caller's choice (``--warmup 0``); other warnings stay."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Profiler won't be using warmup", category=UserWarning)
        return schedule(skip_first=skip_first, wait=0, warmup=warmup, active=active, repeat=1)


def profile_subject(subject: str, *, subject_args: Mapping[str, Any] | None = None, impl: str = "reference",
                    device: Any = "cpu", skip_first: int = DEFAULT_SKIP, warmup: int = DEFAULT_WARMUP,
                    active: int = DEFAULT_ACTIVE, trace: str | os.PathLike | None = None,
                    progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Profile ``impl`` of ``subject`` on ``device`` and return the report document."""
    for value, flag, low in ((skip_first, "--skip", 0), (warmup, "--warmup", 0), (active, "--active", 1)):
        if not low <= value <= 10_000:
            raise UsageError(f"{flag} must be from {low} to 10000, got {value}")
    say = progress or (lambda message: None)
    device = check_device(device)
    check_triton_mode(impl, device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise ProfileError("the current stream is capturing a CUDA graph: profile in eager mode")
    runner = load_subject(subject, subject_args)
    runner.check_impl(impl)
    inputs = runner.make_inputs().to(device)
    runner.check_inputs(inputs)
    module = runner.build(impl, state=runner.make_state(impl), device=device)
    cpu_only = device.type == "cpu"
    activities = [ProfilerActivity.CPU] + ([] if cpu_only else [ProfilerActivity.CUDA])
    captured: dict[str, Any] = {}

    def ready(prof) -> None:
        captured["events"] = kineto_events(prof.profiler.kineto_results)
        if trace is not None:
            _export_trace(prof, trace)

    ranges = ModuleRanges(module)
    steps = skip_first + warmup + active
    say(f"{runner.name}: impl {impl} on {device}: {steps} steps (skip {skip_first}, warm-up {warmup}, "
        f"active {active})")
    started = time.monotonic()
    try:
        with profiler_chatter_filtered(), profile(
                activities=activities, schedule=_schedule(skip_first, warmup, active), on_trace_ready=ready) as prof:
            for _ in range(steps):
                with torch.no_grad():
                    output = runner.call(module, inputs)
                synchronize(device)
                del output
                prof.step()
    finally:
        ranges.remove()
    if "events" not in captured:
        raise ProfileError("the profiler produced no trace for the active steps")
    say(f"profiled in {time.monotonic() - started:.1f} s; accounting {len(captured['events'])} events")
    accounting = account(captured["events"], cpu_only=cpu_only)
    document = {
        **envelope(PROFILE_REPORT),
        "source": "torch.profiler", "subject": runner.describe(), "impl": impl, "device": str(device),
        "platform": platform.fingerprint(device),
        "settings": {"counted": ("CPU ops' self time (a CPU-only host has no device activity)" if cpu_only
                                 else "device activity: kernels, memcpy, memset"),
                     "schedule": f"skip_first={skip_first} warmup={warmup} active={active}",
                     "activities": [str(a).split(".")[-1] for a in activities]},
        **{key: accounting[key] for key in ("totals", "modules", "module_calls", "ops", "kernels", "hot")},
        "trace": str(trace) if trace is not None else None, "against": None,
        "warnings": accounting["warnings"],
    }
    document["headline"] = headline(accounting["hot"], accounting["totals"], "CPU op time" if cpu_only else "device time")
    return finite(document)


def device_time_per_call(call: Callable[[], Any], device: Any, *, warmup: int = 1, active: int = 3) -> dict[str, Any]:
    """``call()`` run ``warmup`` + ``active`` times under the profiler, as :func:`profile_subject`
    runs a forward: the counted time per active call (device activity on a GPU, i.e. kernels,
    memcpy and memset, launch gaps left out; CPU ops' self time on a CPU), or a note saying why
    there is none (no device events, a graph)."""
    cpu_only = torch.device(device).type == "cpu"
    activities = [ProfilerActivity.CPU] + ([] if cpu_only else [ProfilerActivity.CUDA])
    captured: dict[str, Any] = {}

    def ready(prof) -> None:
        captured["events"] = kineto_events(prof.profiler.kineto_results)

    with profiler_chatter_filtered(), profile(activities=activities, schedule=_schedule(0, warmup, active),
                                              on_trace_ready=ready) as prof:
        for _ in range(warmup + active):
            with torch.no_grad():
                output = call()
            synchronize(device)
            del output
            prof.step()
    counted = "CPU ops' self time" if cpu_only else "device activity: kernels, memcpy, memset"
    try:
        totals = account(captured.get("events", []), cpu_only=cpu_only)["totals"]
    except ProfileError as err:
        return {"per_call_s": None, "calls": active, "counted": counted, "note": str(err)}
    steps = totals["steps"] or active
    return {"per_call_s": totals["device_ns"] / 1e9 / steps, "calls": steps, "counted": counted, "note": None}


def _export_trace(prof: Any, path: str | os.PathLike) -> None:
    """The Chrome/Perfetto trace, exported into a temporary file beside ``path`` and renamed over it
    (:func:`parity.base.files.write_file_atomically`: whole or not at all, never held in memory; a
    FIFO or a device written into, a symbolic link's target replaced). A name ending in ``.gz``
    gets the gzip-compressed trace, as torch writes it for such a name (Perfetto reads both)."""
    suffix = ".json.gz" if str(path).endswith(".gz") else ".json"
    write_file_atomically(path, lambda temporary: prof.export_chrome_trace(str(temporary)), "--trace", suffix=suffix)


# ---------------------------------------------------------------------------------------------
# Side by side


def kernel_key(name: str) -> str:
    """A kernel's base name: without ROCm's `` [clone .kd]``/``.kd`` suffix, its argument list, its
    template arguments and a leading ``void``, so that a rocprof row
    (``void k<float, 4>(float const*, int) [clone .kd]``) meets an nsys row of the same kernel."""
    base = name.strip().removesuffix("[clone .kd]").strip().removesuffix(".kd")
    if base.endswith(")"):
        depth = 0
        for index in range(len(base) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(base[index], 0)
            if depth == 0:
                base = base[:index]
                break
    kept, depth = [], 0
    for char in base:
        if char == "<":
            depth += 1
        elif char == ">" and depth:
            depth -= 1
        elif depth == 0:
            kept.append(char)
    return "".join(kept).strip().removeprefix("void ").strip() or name


def _keyed(rows: Sequence[Mapping[str, Any]], by: str) -> dict[str, dict[str, float]]:
    """Total, share and calls by module name, or by :func:`kernel_key` (rows that share a key are summed)."""
    keyed: dict[str, dict[str, float]] = {}
    for row in rows:
        key = str(row["name"]) if by == "module" else kernel_key(str(row["name"]))
        entry = keyed.setdefault(key, {"total_ns": 0.0, "share": 0.0, "calls": 0})
        entry["total_ns"] += float(row["total_ns"])
        entry["share"] += float(row["share"])
        entry["calls"] += int(row["calls"])
    return keyed


def _steps(document: Mapping[str, Any]) -> int | None:
    """A profile's active step count; None for an imported table (its steps are unknown)."""
    steps = (document.get("totals") or {}).get("steps")
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else None


def _ratio(b: float | None, a: float | None) -> float | None:
    return b / a if a and b is not None else None


def _per_call(entry: Mapping[str, float] | None) -> float | None:
    return entry["total_ns"] / entry["calls"] if entry and entry["calls"] else None


def _side_row(name: str, ra: Mapping[str, float] | None, rb: Mapping[str, float] | None,
              a_steps: int | None, b_steps: int | None) -> dict[str, Any]:
    """One row of the side by side: totals as given, per step (where both step counts are known),
    per call, and the ratios b / a (``ratio``: per step, else of the totals)."""
    a_ns, b_ns = (ra["total_ns"] if ra else None), (rb["total_ns"] if rb else None)
    a_step = a_ns / a_steps if a_ns is not None and a_steps else None
    b_step = b_ns / b_steps if b_ns is not None and b_steps else None
    a_call, b_call = _per_call(ra), _per_call(rb)
    return {"name": name, "a_ns": a_ns, "b_ns": b_ns, "a_step_ns": a_step, "b_step_ns": b_step,
            "ratio": _ratio(b_step, a_step) if a_steps and b_steps else _ratio(b_ns, a_ns),
            "a_calls": int(ra["calls"]) if ra else None, "b_calls": int(rb["calls"]) if rb else None,
            "a_call_ns": a_call, "b_call_ns": b_call, "call_ratio": _ratio(b_call, a_call),
            "a_share": ra["share"] if ra else None, "b_share": rb["share"] if rb else None}


def against(a: Mapping[str, Any], b: Mapping[str, Any], *, a_label: str, b_label: str) -> dict[str, Any]:
    """Two profiles side by side: by module where both have modules (parity profiles), else by
    kernel. Compared per step where both have a step count (``compared``: ``"per step"``), else
    the totals of the two captures as given (``"total"``); per call in every case."""
    by = "module" if a.get("modules") and b.get("modules") else "kernel"
    key = "modules" if by == "module" else "kernels"
    rows_a, rows_b = _keyed(a.get(key) or [], by), _keyed(b.get(key) or [], by)
    if not rows_a or not rows_b:
        raise UsageError(f"--against: {'the other profile' if not rows_b else 'this profile'} has no {key} to put "
                         "side by side")
    a_steps, b_steps = _steps(a), _steps(b)
    per_step = a_steps is not None and b_steps is not None
    rows = [_side_row(name, rows_a.get(name), rows_b.get(name), a_steps, b_steps)
            for name in set(rows_a) | set(rows_b)]
    a_key, b_key = ("a_step_ns", "b_step_ns") if per_step else ("a_ns", "b_ns")
    rows.sort(key=lambda row: (-max(row[a_key] or 0.0, row[b_key] or 0.0), row["name"]))
    return {"by": by, "compared": "per step" if per_step else "total", "a_label": a_label, "b_label": b_label,
            "a_steps": a_steps, "b_steps": b_steps, "rows": rows}


def against_warnings(side: Mapping[str, Any]) -> list[str]:
    """What a reader of the side by side must know: where a step count is unknown (an imported
    table), the totals of the two captures are compared as given."""
    if side["compared"] == "per step":
        return []
    unknown = [label for label, steps in ((side["a_label"], side["a_steps"]), (side["b_label"], side["b_steps"]))
               if steps is None]
    return [f"side by side: the step count of {' and of '.join(unknown)} is unknown, so b / a compares the totals "
            "of the two captures as given, which is like for like only if both captured the same work; "
            "b / a per call does not depend on it"]


__all__ = ["DEFAULT_ACTIVE", "DEFAULT_SKIP", "DEFAULT_WARMUP", "Event", "ModuleRanges", "ProfileError", "account",
           "against", "against_warnings", "device_time_per_call", "headline", "kernel_key", "kineto_events",
           "profile_subject"]
