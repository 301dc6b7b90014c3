"""Where a table row's time goes when the kernel is short: call time, device time, host time.

    python -m bench.launch_time --cases d64-s4k-random25,... > launch.jsonl
    python -m bench.launch_time --ncu-target --cases d64-s4k-causal,...   # under ncu

For each case of ``bench/benchmark_table.py`` (same inputs, layouts and implementations: the
kernel at its pinned config as a caller gets it, through the launch cache (kernels/launch_cache.py);
the same without the cache; FlexAttention; SDPA where it applies), three measures per
implementation, each taken three times:

- ``call_ms``: ``triton.testing.do_bench`` (its default: the mean over 100 ms of calls, L2
  flushed before each): what a caller waits per call, host work included when the host is slower
  than the device (the table takes ``do_bench``'s median over 150 ms, bench/roofline.py);
- ``graph_ms``: ``triton.testing.do_bench_cudagraph`` (mean): the same call replayed from a CUDA
  graph, the device time without the host, but also without the L2 flush between calls (a capture
  that fails is recorded as ``graph_error``);
- ``host_ms``: wall time of 50 calls queued without waiting for the device, per call: the host's
  time to issue one call (argument checks, the launcher, Triton's launch path).

Where ``host_ms`` exceeds ``graph_ms`` the device waits for the host and ``call_ms`` is host time
(bench/BENCHMARK.md, issue 26). Output: one JSON line per implementation with the three
repeats, then one per implementation with their medians and ``bound`` (host or device).
``--ncu-target`` instead runs each implementation once, after a warm-up, between
``cudaProfilerStart``/``Stop``, for ``ncu --profile-from-start off`` (``STEPS=ncu bash
bench/h200_run.sh``).

``--host-parts`` times, per case, the parts of the host's work that run in Python before the
launch, in microseconds per call (median of 5 rounds): the input checks, the config lookup,
``build_launch`` (the 61 runtime arguments), Triton's binder (its specialization of every
argument, what ``JITFunction.run`` does on each call before finding the compiled kernel; built
for the device's target, sm_90 on a CPU), ``launch_key``, and ``cached_hit``: the key and the
launch cache's hit (kernels/launch_cache.py) with Triton's part stubbed (the dispatch state and
the issue of the compiled kernel), i.e. what the cache does instead of the build and the binder.
The config lookup is the launcher's on a GPU; on a CPU, the target's row and its clamp (the
launcher would take the interpreter's row there). Each row records the Python, torch and Triton
versions. It needs no GPU: on a CPU it shows the parts on that CPU, next to
``host_ms`` of a GPU host's run.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from parity.kernels import attention, configs, launch, targets
from parity.kernels.launch_cache import LaunchCache, LaunchStep, triton_binder
from parity.kernels.layout import BlockLayout

from . import benchmark_table as table
from .benchmark import arguments_or_status

QUEUED_CALLS = 50
REPEATS = 3


def _cases(spec: str | None) -> list[table.Case]:
    cases = table.cases_named(spec or "")
    if not cases:
        raise ValueError("--cases: name at least one case")
    return cases


def host_ms(fn: Callable[[], Any], calls: int = QUEUED_CALLS) -> float:
    """Per call, the wall time of ``calls`` calls issued without waiting for the device."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e3


def _warm(cases: list[table.Case], device: torch.device, uncached: bool = True):
    """``(case, label, fn)`` for each implementation of each case, compiled and run once first."""
    for case in cases:
        for label, fn in table.case_implementations(case, device, uncached).items():
            fn()
            torch.cuda.synchronize()
            yield case, label, fn


def measure(cases: list[table.Case], device: torch.device) -> list[dict[str, Any]]:
    from triton.testing import do_bench, do_bench_cudagraph

    rows: list[dict[str, Any]] = []
    for case, label, fn in _warm(cases, device):
        row: dict[str, Any] = {"case": case.name, "impl": label,
                               "call_ms": [round(do_bench(fn, warmup=25, rep=100), 4) for _ in range(REPEATS)]}
        try:
            row["graph_ms"] = [round(do_bench_cudagraph(fn, rep=100), 4) for _ in range(REPEATS)]
        except Exception as err:  # recorded in the row, never hidden
            row["graph_error"] = f"{type(err).__name__}: {str(err)[:200]}"
            torch.cuda.synchronize()
        row["host_ms"] = [round(host_ms(fn), 4) for _ in range(REPEATS)]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def ncu_target(cases: list[table.Case], device: torch.device) -> None:
    for case, label, fn in _warm(cases, device, uncached=False):
        print(f"profiled: {case.name} {label}", flush=True)
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def per_call_us(fn: Callable[[], Any], calls: int, rounds: int = 5) -> float:
    """Median over ``rounds`` of the wall microseconds per call of ``calls`` calls, after a warm-up."""
    for _ in range(min(calls, 100)):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return round(statistics.median(times), 2)


def host_parts(cases: list[table.Case], device: torch.device, calls: int = 1000) -> list[dict[str, Any]]:
    """Microseconds per call of the Python parts of one prefill call (module docstring), per case."""
    import triton

    from parity.kernels import triton_attention

    arch = targets.arch_of(device) if device.type == "cuda" else "sm_90"
    binder, arg_names = triton_binder(triton_attention.block_sparse_attn_fwd, arch)
    versions = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__}
    rows = []
    for case in cases:
        layout, q, k, v, _batch, _mc = table._problem(case, device, table.Sizes())
        irregular = layout.has_doc or layout.has_bits
        cfg = configs.config_for_blocks(arch, case.head_dim, q.dtype, layout.block_m, layout.block_n, irregular=irregular)
        out, scale = torch.empty_like(q), case.head_dim ** -0.5
        use_tma = launch.tma_fits(cfg, q, k, v)
        built = launch.build_launch(q, k, v, out, None, layout, cfg, sm_scale=scale, use_tma=use_tma)
        given = {**built.args, **built.constexprs}
        if device.type == "cuda":  # the launcher's own lookup: the device's architecture, its row, the clamp
            def config_lookup(q=q, layout=layout, head_dim=case.head_dim):
                return attention.launch_config(device, head_dim, q.dtype, layout)
        else:  # on a CPU the launcher would take the interpreter's row: look up the target's instead
            def config_lookup(q=q, layout=layout, head_dim=case.head_dim, irregular=irregular):
                return configs.config_for_blocks(arch, head_dim, q.dtype, layout.block_m, layout.block_n,
                                                 irregular=irregular)
        row = {"case": case.name, "arch": arch, "runtime_arguments": len(built.args), **versions, "us_per_call": {
            "checks": per_call_us(lambda: attention.check_inputs(q, k, v, layout), calls),
            "config": per_call_us(config_lookup, calls),
            "build_launch": per_call_us(lambda: launch.build_launch(q, k, v, out, None, layout, cfg, sm_scale=scale,
                                                                     use_tma=use_tma), calls),
            "triton_binder": per_call_us(lambda: binder(**given, debug=False), calls),
            "launch_key": per_call_us(lambda: launch.launch_key(q, k, v, out, None, cfg, sm_scale=scale,
                                                                 use_tma=use_tma), calls),
            "cached_hit": per_call_us(_cached_hit(arg_names, q, k, v, out, layout, cfg, scale, use_tma), calls),
        }}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del layout, q, k, v, out
    return rows


class _StandInCompiled:
    """Has the interface ``launch_cache.direct_launch_supported`` looks for; never launched."""
    run = function = packed_metadata = launch_metadata = None


class _StandInKernel:
    """A kernel whose dispatch returns a stand-in compiled kernel (for timing the cache's hit)."""

    def __init__(self, arg_names):
        self.arg_names = arg_names

    def __getitem__(self, grid):
        return lambda **kwargs: _StandInCompiled()


def _cached_hit(arg_names, q, k, v, out, layout, cfg, scale, use_tma) -> Callable[[], None]:
    """A call's key and the launch cache's hit (the layout's version, the lookup, the argument
    list with the call's tensors), with Triton's part stubbed: the dispatch state and the issue of
    the compiled kernel, which need a GPU and are in ``host_ms``."""
    kernel = _StandInKernel(arg_names)
    cache = LaunchCache((kernel,), launch.PER_CALL, issue=lambda *args: None, state=lambda kernels: ("device", "stream"),
                        version=BlockLayout.version)

    def build():
        built = launch.build_launch(q, k, v, out, None, layout, cfg, sm_scale=scale, use_tma=use_tma)
        return [LaunchStep(kernel, built.grid, built.args, built.constexprs, built.options)]

    def call():
        cache.launch(layout, launch.launch_key(q, k, v, out, None, cfg, sm_scale=scale, use_tma=use_tma),
                     (q, k, v, out, None), build)
    return call


def _host_parts_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no GPU here")
    return torch.device(name)


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians of the three repeats, and whether the host or the device sets the call time."""
    out = []
    for row in rows:
        med = {key: statistics.median(row[key]) for key in ("call_ms", "graph_ms", "host_ms") if row.get(key)}
        bound = None
        if "graph_ms" in med:
            bound = "host" if med["host_ms"] > med["graph_ms"] else "device"
        out.append({"case": row["case"], "impl": row["impl"], **med, "bound": bound})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", metavar="NAME,...", help="table cases (bench/benchmark_table.py names)")
    parser.add_argument("--ncu-target", action="store_true", help="run each implementation once for ncu instead")
    parser.add_argument("--host-parts", action="store_true",
                        help="time the Python parts of a call's host work instead (no GPU needed)")
    parser.add_argument("--device", default=None, help="with --host-parts: cpu or cuda (default: cuda if present)")
    args = parser.parse_args(argv)
    if args.host_parts:
        try:
            cases, device = _cases(args.cases), _host_parts_device(args.device)
        except ValueError as err:
            print(f"launch_time: {err}", file=sys.stderr)
            return 2
        host_parts(cases, device)
        return 0
    cases, status = arguments_or_status("launch_time", lambda: _cases(args.cases))
    if status is not None:
        return status
    device = torch.device("cuda")
    if args.ncu_target:
        ncu_target(cases, device)
        return 0
    for row in summary(measure(cases, device)):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
