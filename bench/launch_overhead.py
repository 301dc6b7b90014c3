"""Host time per call of the kernel's launcher, per prefill-table row and decode row, as JSON lines.

    python bench/launch_overhead.py                       # CPU: the launcher with the launch stubbed
    python bench/launch_overhead.py --device cuda         # GPU: call time minus CUDA-graph time
    python bench/launch_overhead.py --rows d64-s4k-causal,decode-b8-4k

Two paths per row, in one run (on a GPU a third, ``plan_tensors``: the plan's hit handing
Triton's launcher the tensors instead of their addresses): ``plan`` is a model's call (``block_sparse_attention(q, k, v,
layout)``, a hit of its launch plan, kernels/attention.py ``_planned``); ``full`` is the same call
through the launcher's full path (checks, config, ``launch_key``, the launch cache's hit), which
every call took before plans (forced here by passing the path explicitly, ``decode=``).

CPU (``--device cpu``, the default without a GPU; needs no GPU): Triton's part is stubbed, so what
is timed is exactly the launcher's Python: a build returns a stand-in compiled kernel, the issue
of a compiled kernel is a no-op and the dispatch state is a constant (on a GPU: the device and
stream reads and the C launch, ``kernels.launch_cache.issue_compiled``). Runs under the
interpreter's config rows; bf16 rows run in fp16 (under the interpreter bf16 adds an fp32 staging
buffer that a GPU never makes); q, k, v are allocated, never written (the kernel never runs), and
each call's output is allocated as on a GPU (here by the CPU allocator). Median of 5 rounds of
``--calls`` calls, microseconds per call.

GPU (``--device cuda``): ``call_us`` (``triton.testing.do_bench``, mean), ``graph_us``
(``do_bench_cudagraph``: the same call replayed from a CUDA graph, no host), ``host_us`` = call
minus graph, and ``queued_us`` (wall time of 50 calls issued without waiting, per call).
Decode rows on a GPU also get ``hit_parts``: the host microseconds per call of each step of the
plan's hit (dispatch state, key, lookup, the output's and the workspace's allocation, each kernel's
issue), issued back to back, beside the whole call and PyTorch's SDPA on the same tensors, once per
merge of the splits (``combine_modes``: "fused", the split kernel's last program merges, one launch
and nothing allocated but the output; "kernel", ``decode_combine`` after it, two launches), each
with the plan's ``call_us``/``graph_us``/``host_us``: host and device time of both side by side;
and ``sdpa``, the same four times of PyTorch's SDPA on the same q, k, v, with ``call_vs_sdpa``
(the plan's eager call time over SDPA's: the issue's decode target).
Each line records the device, Python, torch and Triton versions.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import torch  # noqa: E402

from bench.launch_time import per_call_us  # noqa: E402  (the same timing loop as the host-parts table)

# The decode rows of the issue's targets (kernels/BENCHMARK.md's decode table: Hq=32, Hkv=8,
# D=128, one token, bf16): name -> (batch, cache length).
DECODE_ROWS = {"decode-b8-4k": (8, 4096), "decode-b1-128k": (1, 131072), "decode-b1-4k": (1, 4096)}
DEFAULT_PREFILL = ("d128-s4k-causal", "d128-s4k-window1024", "d128-s4k-random25", "d128-s4k-dense",
                   "d64-s4k-causal", "d64-s4k-window1024", "d64-s4k-random25", "d64-s4k-dense",
                   "gqa32:8-d128-s8k-causal", "gqa32:8-d128-s8k-window1024", "fp16-d128-s8k-causal")


class _StandInCompiled:
    """Has the interface ``launch_cache.direct_launch_supported`` looks for; never launched."""
    run = function = packed_metadata = launch_metadata = None


@contextlib.contextmanager
def _stubbed_launches():
    """Triton's part replaced (CPU timing): builds return a stand-in compiled kernel, issues do
    nothing, the dispatch state is a constant."""
    from parity.kernels import attention
    from parity.kernels.launch_cache import LaunchStep

    original = LaunchStep.dispatch
    LaunchStep.dispatch = lambda self: _StandInCompiled()
    saved = dict(attention._LAUNCH_CACHES)
    attention._LAUNCH_CACHES.clear()
    try:
        for path in ("prefill", "decode"):
            cache = attention._launch_cache(path)
            cache._issue = lambda compiled, grid, values, state: None
            cache._state = lambda kernels: ("device", "stream")
        yield
    finally:
        LaunchStep.dispatch = original
        attention._LAUNCH_CACHES.clear()
        attention._LAUNCH_CACHES.update(saved)


@contextlib.contextmanager
def _tensor_arguments():
    """Plans built and hit with tensors as the launcher's arguments (``LaunchCache(addresses=False)``),
    in fresh caches, restored afterwards."""
    from parity.kernels import attention

    saved = dict(attention._LAUNCH_CACHES)
    attention._LAUNCH_CACHES.clear()
    try:
        for path in ("prefill", "decode"):
            attention._launch_cache(path)._addresses = False
        yield
    finally:
        attention._LAUNCH_CACHES.clear()
        attention._LAUNCH_CACHES.update(saved)


def _problem(name: str, device: torch.device, cpu: bool):
    """(layout, q, k, v, decode) for a row; on the CPU q, k, v are allocated and never written."""
    from parity.kernels import causal_layout
    from bench import benchmark_table as table
    from parity.kernels.testing import random_qkv

    def tensors(batch, hq, hkv, sq, sk, d, dtype):
        if cpu:
            return (torch.empty(batch, hq, sq, d, dtype=dtype), torch.empty(batch, hkv, sk, d, dtype=dtype),
                    torch.empty(batch, hkv, sk, d, dtype=dtype))
        return random_qkv(batch, hq, hkv, sq, sk, d, dtype, 0, device)

    if name in DECODE_ROWS:
        batch, seq_k = DECODE_ROWS[name]
        dtype = torch.float16 if cpu else torch.bfloat16
        return (causal_layout(1, seq_k, block_m=128, block_n=128).to(device),
                *tensors(batch, 32, 8, 1, seq_k, 128, dtype), True)
    (case,) = table.cases_named(name)
    dtype = torch.float16 if cpu else table.DTYPES[case.dtype]
    if case.layout in ("document", "padding"):
        mc = table.mask_case(case.layout, case.seq, device)
        layout, batch = mc.layout.to(device), mc.batch
    else:
        layout, batch = table.plain_layout(case.seq, case.layout, 128).to(device), case.batch
    return (layout, *tensors(batch, case.heads_q, case.heads_kv, case.seq, case.seq, case.head_dim, dtype), False)


def _gpu_us(fn) -> dict[str, float]:
    from triton.testing import do_bench, do_bench_cudagraph

    fn()
    torch.cuda.synchronize()
    call = do_bench(fn, warmup=25, rep=100) * 1e3
    graph = do_bench_cudagraph(fn, rep=100) * 1e3
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(50):
        fn()
    queued = (time.perf_counter() - start) / 50 * 1e6
    torch.cuda.synchronize()
    return {"call_us": round(call, 2), "graph_us": round(graph, 2), "host_us": round(call - graph, 2),
            "queued_us": round(queued, 2)}


def _hit_parts(layout, q, k, v, calls: int = 400) -> dict[str, float]:
    """Host microseconds per call of each part of a decode call's plan hit on the GPU, issued
    back to back (``kernels.attention._planned``'s steps, in order), beside the whole call and
    PyTorch's SDPA on the same tensors: where the host time of a hit goes."""
    from parity.kernels import attention, block_sparse_attention
    from parity.kernels.decode import decode_scalars

    block_sparse_attention(q, k, v, layout)  # the plan exists
    tensors = (layout.kv_num_blocks, layout.kv_indices, layout.full_kv_num_blocks, layout.full_kv_indices,
               layout.q_doc, layout.k_doc, layout.k_start, layout.k_end, layout.mask_bits)
    mask = layout.mask
    meta = (layout.seq_q, layout.seq_k, layout.block_m, layout.block_n, mask.causal, mask.window,
            mask.sink_tokens, mask.offset)
    cache = attention._launch_cache("decode")
    state = cache.state()
    key = (state, attention._plan_key(q, k, v, tensors, meta, None, False, True,
                                       attention._exact_keys(tensors, False)))  # as _planned keys it
    scalars = decode_scalars(k, v, mask.offset)
    version = attention._layout_version(tensors)
    entry = cache.find(tensors[0], key, version)
    if entry is None:
        raise RuntimeError("no decode plan under the launcher's key: the bench's key is out of step with _planned")
    out = torch.empty_like(q)
    made = {name: torch.empty_strided(*spec[:2], dtype=spec[2], device=spec[3]) for name, spec in entry.fresh.items()}
    group = q.shape[1] // k.shape[1]

    def issue_each(index):
        def run():
            cache.issue(dataclasses.replace(entry, steps=entry.steps[index:index + 1]), (q, k, v, out, None), state,
                        scalars)
        return run

    parts = {
        "whole_call": lambda: block_sparse_attention(q, k, v, layout),
        "dispatch_state": cache.state,
        "plan_key": lambda: attention._plan_key(q, k, v, tensors, meta, None, False, True,
                                               attention._exact_keys(tensors, False)),
        "layout_version": lambda: attention._layout_version(tensors),
        "find": lambda: cache.find(tensors[0], key, version),
        "empty_like_out": lambda: torch.empty_like(q),
        "workspace": lambda: [torch.empty_strided(*spec[:2], dtype=spec[2], device=spec[3])
                              for spec in entry.fresh.values()],
        "issue_split_kernel": issue_each(0),
        "issue_combine_kernel": issue_each(1) if len(entry.steps) > 1 else None,
        "sdpa_call": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=group > 1),
    }
    del made
    result = {}
    for name, fn in parts.items():
        if fn is None:
            continue
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - start) / calls * 1e6)
            torch.cuda.synchronize()
        result[name] = round(sorted(times)[2], 2)
    return result


@contextlib.contextmanager
def _combine_mode(fused: bool):
    """Plain calls take the pinned decode config with ``fused_combine`` set (plans are dropped on
    entry and exit: a plan's key does not hold the config, which follows from the device)."""
    from parity.kernels import attention

    pinned = attention.decode_config
    attention._LAUNCH_CACHES.clear()
    attention.decode_config = lambda *a, **kw: dataclasses.replace(pinned(*a, **kw), fused_combine=fused)
    try:
        yield
    finally:
        attention.decode_config = pinned
        attention._LAUNCH_CACHES.clear()


def measure(rows: list[str], device: torch.device, calls: int) -> list[dict]:
    from parity.kernels import block_sparse_attention, targets

    cpu = device.type == "cpu"
    env = {"device": targets.environment(device)["device"], "python": platform.python_version(),
           "torch": torch.__version__}
    import triton

    env["triton"] = triton.__version__
    out = []
    with _stubbed_launches() if cpu else contextlib.nullcontext():
        for name in rows:
            layout, q, k, v, decode = _problem(name, device, cpu)
            paths = {"plan": lambda: block_sparse_attention(q, k, v, layout),
                     "full": lambda: block_sparse_attention(q, k, v, layout, decode=decode)}
            row = {"row": name, "shape": {"q": list(q.shape), "k": list(k.shape), "dtype": str(q.dtype)}, **env}
            for path, fn in paths.items():
                row[path] = {"us_per_call": per_call_us(fn, calls)} if cpu else _gpu_us(fn)
            if not cpu:  # the plan's hit handing the launcher tensors, as before it handed addresses
                with _tensor_arguments():
                    row["plan_tensors"] = _gpu_us(paths["plan"])
                if decode:
                    # the issue's decode measure: eager call time against SDPA's on the same tensors
                    # (one query row sees every key: no mask), in the same process
                    group = q.shape[1] // k.shape[1]
                    row["sdpa"] = _gpu_us(lambda: torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, enable_gqa=group > 1))
                    row["call_vs_sdpa"] = round(row["plan"]["call_us"] / row["sdpa"]["call_us"], 3)
                    row["combine_modes"] = {}
                    for mode, fused in (("fused", True), ("kernel", False)):
                        with _combine_mode(fused):
                            measured = row["combine_modes"][mode] = {"plan": _gpu_us(paths["plan"])}
                            try:
                                measured["hit_parts"] = _hit_parts(layout, q, k, v)
                            except Exception as err:  # a measurement aid: the row keeps what it measured
                                measured["hit_parts"] = {"error": f"{type(err).__name__}: {err}"[:300]}
            out.append(row)
            print(json.dumps(row), flush=True)
            del layout, q, k, v
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated prefill-table case names and decode rows "
                                       f"({', '.join(DECODE_ROWS)}); default: the 4k and 8k table rows and both decode rows")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--calls", type=int, default=2000, help="calls per round on the CPU (default 2000)")
    args = parser.parse_args(argv)
    from bench import benchmark_table as table

    rows = [r.strip() for r in (args.rows or ",".join(DEFAULT_PREFILL + tuple(DECODE_ROWS))).split(",") if r.strip()]
    known = {case.name for case in table.CASES} | set(DECODE_ROWS)
    unknown = [r for r in rows if r not in known]
    if unknown or not rows or args.calls < 1:
        print(f"launch_overhead: unknown rows {', '.join(unknown)}" if unknown else "launch_overhead: bad --rows/--calls",
              file=sys.stderr)
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("launch_overhead: --device cuda: no GPU here", file=sys.stderr)
        return 2
    if device.type == "cpu":
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported: the launcher's CPU mode
    measure(rows, device, args.calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
