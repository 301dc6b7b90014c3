"""GPU benchmark of the decode path (split-KV) against SDPA and FlexAttention, in one run.

    python -m bench.benchmark_decode --json decode.json [--sweep] [--threshold]
        [--variant block_n=128,num_stages=4 ...]
    python -m bench.benchmark_decode --markdown decode.json   # the document's tables, no GPU

Cases (bf16, Hq=32, Hkv=8, D=128, one query token, the default bottom-right causal alignment, so
the token sees its whole cache):
- dense: (B, Sk) = (8, 4k), (8, 32k), (1, 128k), (64, 2k): the parity kernel's decode path (the
  default for this shape), its prefill path (what ran before the decode path existed), SDPA
  (``enable_gqa=True``; PyTorch picks its backend) and FlexAttention (compiled, the same block
  mask, ``enable_gqa=True``);
- sparse, B=8, Sk=32k: sliding window 4096, 4 sink blocks + window 4096, random 25% of the
  blocks: the decode path against dense SDPA on the same cache, and FlexAttention on the mask;
- ragged, B=8, cache lengths 32k down to 2k in one padded [8, 32k] cache (``padding_layout``):
  the decode path, the decode path on the padded cache as if full, and SDPA on the padded cache;
- ``--threshold``: Sq = 1 .. 64 at (B, Sk) = (8, 32k) and (64, 2k), the decode path (forced)
  against the prefill path;
- ``--sweep`` / ``--variant``: decode configs on the dense cases;
- ``--uncached``: the decode path without the launch cache (``UNCACHED``; every call of the
  others goes through it, the default, kernels/launch_cache.py) on the dense and sparse cases,
  next to the default call (the gap in call time is the host's share the cache saves; the device
  times must be equal).

Every implementation's output is checked against the fp32 PyTorch reference on the same inputs
before it is timed (relative L2). Times are the median of 3 ``do_bench`` medians (CUDA events,
L2 flushed between calls) with their spread, (max - min) / median. "Cache read" is the bytes of
K and V in the blocks the layout keeps (each read once) over the time, against the device-to-
device copy bandwidth measured in the same run and the HBM datasheet peak (4.8 TB/s on an H200).
Imports nothing from the harness: the kernel layer stands alone.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Any, Callable

import torch

from parity.kernels import configs, targets
from parity.kernels.attention import block_sparse_attention, decode_config
from parity.kernels.decode import build_decode_launch
from parity.kernels.targets import compute_units
from parity.kernels.layout import BlockLayout, causal_layout, padding_layout, random_layout, sink_layout, sliding_window_layout
from parity.kernels.reference import reference_attention
from parity.kernels.testing import random_qkv

from . import roofline
from .benchmark import allow_recompiles, arguments_or_status, render_result
import time

FORMAT, VERSION = "parity-decode-benchmark-report", 1
# The decode path called with launch_cache=False (kernels/launch_cache.py), with --uncached.
UNCACHED = "parity decode, uncached"
HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
DENSE_CASES = ((8, 4096), (8, 32768), (1, 131072), (64, 2048))
SPARSE_BATCH, SPARSE_SEQ = 8, 32768
RAGGED_LENGTHS = (32768, 28672, 24576, 16384, 12288, 8192, 4096, 2048)
THRESHOLD_SEQ_Q = (1, 2, 4, 8, 16, 32, 64)
HBM_DATASHEET_TBPS = 4.8  # H200 SXM datasheet
# --sweep: decode configs tried on the dense cases (fields of configs.DecodeConfig).
SWEEP = (
    {"programs_per_unit": 2}, {"programs_per_unit": 3}, {"programs_per_unit": 6}, {"programs_per_unit": 8},
    {"num_stages": 2}, {"num_stages": 2, "programs_per_unit": 2}, {"num_stages": 4, "programs_per_unit": 8},
    {"block_n": 32}, {"block_n": 32, "programs_per_unit": 2},
)


def parse_variant(spec: str) -> dict[str, int]:
    """``block_n=128,num_stages=4`` -> ``{"block_n": 128, "num_stages": 4}`` (``configs.DECODE_FIELDS``);
    a ValueError names a bad item."""
    return configs.parse_fields(spec, configs.DECODE_FIELDS, flag="--variant")


def label(cfg: configs.DecodeConfig) -> str:
    """The config's settings a variant can change, the merge's named only where they differ from
    the pinned defaults (rows of one run must be told apart)."""
    default = configs.DecodeConfig(cfg.block_n, cfg.num_warps, cfg.num_stages)
    merge = [f"{name}={getattr(cfg, name)}" for name in ("max_splits", "fused_combine", "merge_lse_tile")
             if getattr(cfg, name) != getattr(default, name)]
    return " ".join([f"n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} ppu{cfg.programs_per_unit} "
                     f"min{cfg.min_tiles_per_split}", *merge])


def kept_kv_bytes(layout: BlockLayout, batch: int, heads_kv: int, head_dim: int, element_size: int) -> int:
    """Bytes of K and V in the key blocks the layout keeps for query block 0 (head 0's lists;
    per batch element where the layout has one list per sequence, as padding layouts do), each
    read once per (batch, K/V head): what the decode kernel reads (a GQA group shares one read)."""
    counts = (layout.kv_num_blocks[:, 0, 0] + layout.full_kv_num_blocks[:, 0, 0]).cpu().expand(batch)
    keys = sum(min(layout.seq_k, int(count) * layout.block_n) for count in counts)
    return keys * heads_kv * head_dim * element_size * 2


def copy_bandwidth(device: torch.device, elements: int = 2**30) -> float:
    """Device-to-device copy rate in TB/s (``bench.roofline.copy_bandwidth_tbps``)."""
    return roofline.copy_bandwidth_tbps(device, elements)


def timed(fn: Callable[[], Any], device: torch.device, repeats: int = 3) -> tuple[float, float]:
    """(median of ``repeats`` do_bench medians in microseconds, spread (max - min) / median).
    On the CPU (the interpreter: a smoke run of this script, not a measurement) one plain call."""
    if device.type != "cuda":

        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6, 0.0
    from triton.testing import do_bench

    return roofline.median_spread([float(do_bench(fn, warmup=25, rep=150, return_mode="median")) * 1e3
                                   for _ in range(repeats)])


def graph_timed(fn: Callable[[], Any], device: torch.device, calls: int = 20, replays: int = 15) -> float | None:
    """Device time per call in microseconds, launch overhead excluded: ``calls`` calls captured in
    one CUDA graph (as serving engines run decode steps), the median of ``replays`` replays timed
    with CUDA events. None on the CPU, or where the implementation cannot be captured."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm up on the capture stream (allocator, compilation)
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError as err:
        print(f"graph capture failed: {err}", file=sys.stderr)
        return None
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return sorted(times)[len(times) // 2]


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float | str:
    value = float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
    return value if math.isfinite(value) else str(value)


def flex_runner(layout: BlockLayout, q, k, v, device) -> Callable[[], torch.Tensor] | None:
    """FlexAttention on the same block mask (compiled; ``enable_gqa``), or None where it is absent."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except ImportError:
        return None
    mask = layout.mask
    nk = layout.num_kv_blocks

    def pad(indices):
        out = torch.zeros(*indices.shape[:3], nk, dtype=torch.int32)
        out[..., : indices.shape[-1]] = indices.cpu()
        return out.to(device)

    k_start = layout.k_start.to(device) if layout.has_padding else None
    k_end = layout.k_end.to(device) if layout.has_padding else None

    def mask_mod(b, h, q_idx, kv_idx):
        vis = kv_idx < layout.seq_k
        if mask.causal:
            vis = vis & (kv_idx <= q_idx + mask.offset)
        if mask.window:
            vis = vis & ((kv_idx > q_idx + mask.offset - mask.window) | (kv_idx < mask.sink_tokens))
        if k_start is not None:
            vis = vis & (kv_idx >= k_start[b]) & (kv_idx < k_end[b])
        return vis

    block_mask = BlockMask.from_kv_blocks(
        layout.kv_num_blocks.to(device), pad(layout.kv_indices),
        layout.full_kv_num_blocks.to(device), pad(layout.full_kv_indices),
        BLOCK_SIZE=(layout.block_m, layout.block_n), mask_mod=mask_mod, seq_lengths=(layout.seq_q, layout.seq_k))
    allow_recompiles()
    flex = torch.compile(flex_attention, dynamic=False)
    return lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True)


def measure_case(case: str, layout: BlockLayout, batch: int, seq_q: int, impls: dict[str, Callable[[], torch.Tensor]],
                 q, k, v, ceilings: dict[str, float], extra: dict[str, Any] | None = None,
                 check: bool = True) -> list[dict[str, Any]]:
    """Check every implementation's output against the fp32 reference, then time each. An
    implementation named "... (dense)" or "... (padded)" computes another function (the dense
    baseline a sparse layout is timed against): it is timed, not checked."""
    ref = reference_attention(q, k, v, layout, precision="fp32", chunk_rows=64) if check else None
    kv_bytes = kept_kv_bytes(layout, batch, k.shape[1], k.shape[3], k.element_size())
    # Every implementation runs (and compiles) before any is timed.
    errors = {impl: rel_l2(fn(), ref) if check and not impl.endswith(("(dense)", "(padded)")) else None
              for impl, fn in impls.items()}
    rows = []
    for impl, fn in impls.items():
        error = errors[impl]
        us, spread = timed(fn, q.device)
        graph_us = graph_timed(fn, q.device)
        # Bandwidth from the device time where the graph could be taken (launch overhead is the
        # host's, not the kernel's), else from the call time.
        tbps = kv_bytes / ((graph_us or us) * 1e-6) / 1e12
        row = {"case": case, "impl": impl, "batch": batch, "seq_q": seq_q, "seq_k": layout.seq_k,
               "density": round(layout.density(), 4), "us": round(us, 2), "spread": round(spread, 4),
               "graph_us": None if graph_us is None else round(graph_us, 2),
               "kv_bytes": kv_bytes, "cache_read_tbps": round(tbps, 3),
               "fraction_of_copy": round(tbps / ceilings["copy_tbps"], 3),
               "fraction_of_hbm_datasheet": round(tbps / HBM_DATASHEET_TBPS, 3),
               "rel_l2_vs_fp32_ref": error, **(extra or {}).get(impl, {})}
        rows.append(row)
        print(json.dumps(row), flush=True)
    del ref
    return rows


def parity_decode(q, k, v, layout, cfg: configs.DecodeConfig | None = None) -> tuple[Callable, dict]:
    cfg = cfg or decode_config(q.device, q.shape[-1], q.dtype)
    splits = build_decode_launch(q, k, v, torch.empty_like(q), None, layout, cfg.clamp(layout.block_n),
                                 sm_scale=1.0, units=compute_units(q.device)).num_splits
    return (lambda: block_sparse_attention(q, k, v, layout, config=cfg, decode=True),
            {"config": label(cfg), "num_splits": splits})


def _uncached(q, k, v, layout, uncached: bool) -> dict[str, Callable[[], torch.Tensor]]:
    """With ``uncached``, the decode path at its pinned config without the launch cache
    (kernels/launch_cache.py), as ``UNCACHED``."""
    if not uncached:
        return {}
    return {UNCACHED: lambda: block_sparse_attention(q, k, v, layout, decode=True, launch_cache=False)}


def sdpa(q, k, v) -> Callable[[], torch.Tensor]:
    # One query token with the bottom-right diagonal sees every key: no mask.
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The run's shapes (the defaults are the documented ones; tests pass tiny ones)."""

    heads_q: int = HEADS_Q
    heads_kv: int = HEADS_KV
    head_dim: int = HEAD_DIM
    dense: tuple[tuple[int, int], ...] = DENSE_CASES
    sparse_batch: int = SPARSE_BATCH
    sparse_seq: int = SPARSE_SEQ
    window: int = 4096
    ragged: tuple[int, ...] = RAGGED_LENGTHS
    threshold: tuple[int, ...] = THRESHOLD_SEQ_Q
    threshold_shapes: tuple[tuple[int, int], ...] = ((8, 32768), (64, 2048))
    copy_elements: int = 2**30


def run(*, sweep: bool, threshold: bool, variants: list[dict[str, int]], check: bool, flex: bool,
        device: torch.device | None = None, sizes: Sizes = Sizes(), dense_only: bool = False,
        uncached: bool = False) -> dict[str, Any]:
    device = device or torch.device("cuda")
    ceilings = {"copy_tbps": copy_bandwidth(device, sizes.copy_elements),
                "hbm_datasheet_tbps": HBM_DATASHEET_TBPS}
    print(json.dumps(ceilings), flush=True)
    pinned = decode_config(device, sizes.head_dim, torch.bfloat16)
    dense, sparse, ragged, sweep_rows, threshold_rows = [], [], [], [], []
    tried = [dataclasses.replace(pinned, **change) for change in (list(SWEEP) if sweep else []) + variants]
    for batch, seq_k in sizes.dense:
        q, k, v = random_qkv(batch, sizes.heads_q, sizes.heads_kv, 1, seq_k, sizes.head_dim, torch.bfloat16, seed=seq_k, device=device)
        layout = causal_layout(1, seq_k).to(device)
        decode_fn, decode_meta = parity_decode(q, k, v, layout)
        impls = {"parity decode": decode_fn,
                 **_uncached(q, k, v, layout, uncached),
                 "parity prefill path": lambda: block_sparse_attention(q, k, v, layout, decode=False),
                 "SDPA": sdpa(q, k, v)}
        flex_fn = flex_runner(layout, q, k, v, device) if flex else None
        if flex_fn is not None:
            impls["FlexAttention"] = flex_fn
        dense += measure_case(f"dense B{batch} Sk{seq_k}", layout, batch, 1, impls, q, k, v, ceilings,
                              {"parity decode": decode_meta}, check)
        for cfg in tried:
            fn, meta = parity_decode(q, k, v, layout, cfg)
            sweep_rows += measure_case(f"dense B{batch} Sk{seq_k}", layout, batch, 1, {f"decode {label(cfg)}": fn},
                                       q, k, v, ceilings, {f"decode {label(cfg)}": meta}, check=False)
        del q, k, v
    if dense_only:
        return {"format": FORMAT, "version": VERSION, "environment": targets.environment(device), "ceilings": ceilings,
                "pinned_config": pinned.to_dict(), "units": compute_units(device), "dense": dense, "sparse": [],
                "ragged": [], "sweep": sweep_rows, "threshold": []}
    q, k, v = random_qkv(sizes.sparse_batch, sizes.heads_q, sizes.heads_kv, 1, sizes.sparse_seq, sizes.head_dim, torch.bfloat16, seed=1,
                         device=device)
    sparse_layouts = {
        f"sliding window {sizes.window}": sliding_window_layout(1, sizes.sparse_seq, sizes.window),
        f"4 sink blocks + window {sizes.window}": sink_layout(1, sizes.sparse_seq, sizes.window, 4),
        "random 25%": random_layout(1, sizes.sparse_seq, 0.25, 0, causal=True),
    }
    for name, layout in sparse_layouts.items():
        layout = layout.to(device)
        decode_fn, decode_meta = parity_decode(q, k, v, layout)
        impls = {"parity decode": decode_fn, **_uncached(q, k, v, layout, uncached), "SDPA (dense)": sdpa(q, k, v)}
        flex_fn = flex_runner(layout, q, k, v, device) if flex else None
        if flex_fn is not None:
            impls["FlexAttention"] = flex_fn
        sparse += measure_case(f"{name} B{sizes.sparse_batch} Sk{sizes.sparse_seq}", layout, sizes.sparse_batch, 1, impls, q, k, v,
                               ceilings, {"parity decode": decode_meta}, check)
    padded = padding_layout(1, sizes.sparse_seq, list(sizes.ragged)).to(device)
    full = causal_layout(1, sizes.sparse_seq).to(device)
    decode_fn, decode_meta = parity_decode(q, k, v, padded)
    impls = {"parity decode": decode_fn}
    flex_fn = flex_runner(padded, q, k, v, device) if flex else None
    if flex_fn is not None:
        impls["FlexAttention"] = flex_fn
    ragged += measure_case(f"ragged B{sizes.sparse_batch} lengths {min(sizes.ragged)}..{max(sizes.ragged)}", padded,
                           sizes.sparse_batch, 1, impls, q, k, v, ceilings, {"parity decode": decode_meta}, check)
    full_fn, full_meta = parity_decode(q, k, v, full)
    ragged += measure_case(f"same cache as if full, B{sizes.sparse_batch} Sk{sizes.sparse_seq}", full, sizes.sparse_batch, 1,
                           {"parity decode": full_fn, "SDPA (padded)": sdpa(q, k, v)}, q, k, v, ceilings,
                           {"parity decode": full_meta}, check)
    if threshold:
        for batch, seq_k in sizes.threshold_shapes:
            k, v = random_qkv(batch, sizes.heads_q, sizes.heads_kv, 1, seq_k, sizes.head_dim, torch.bfloat16,
                              seed=2, device=device)[1:]
            for seq_q in sizes.threshold:
                qq = random_qkv(batch, sizes.heads_q, sizes.heads_kv, seq_q, 1, sizes.head_dim, torch.bfloat16,
                                seed=seq_q, device=device)[0]
                layout = causal_layout(seq_q, seq_k).to(device)
                fn, meta = parity_decode(qq, k, v, layout)
                threshold_rows += measure_case(
                    f"Sq{seq_q} B{batch} Sk{seq_k}", layout, batch, seq_q,
                    {"parity decode": fn,
                     "parity prefill path": lambda: block_sparse_attention(qq, k, v, layout, decode=False)},
                    qq, k, v, ceilings, {"parity decode": meta}, check=seq_q <= 16 and batch * seq_k <= 2**18)
    return {"format": FORMAT, "version": VERSION, "environment": targets.environment(device), "ceilings": ceilings,
            "pinned_config": pinned.to_dict(), "units": compute_units(device),
            "shape": {"heads_q": sizes.heads_q, "heads_kv": sizes.heads_kv, "head_dim": sizes.head_dim, "dtype": "bf16"},
            "dense": dense, "sparse": sparse, "ragged": ragged, "sweep": sweep_rows, "threshold": threshold_rows}


def markdown(result: dict[str, Any]) -> str:
    """The benchmark document's decode tables from a ``--json`` result."""
    lines = []
    by_case: dict[str, dict[str, dict]] = {}
    for row in result["dense"] + result["sparse"] + result["ragged"]:
        by_case.setdefault(row["case"], {})[row["impl"]] = row
    lines.append("| case | impl | device µs (graph) | call µs (spread) | cache read TB/s | of copy / HBM peak | "
                 "rel L2 vs fp32 ref | splits |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for case, rows in by_case.items():
        for impl, row in rows.items():
            err = row["rel_l2_vs_fp32_ref"]
            err = f"{err:.2e}" if isinstance(err, float) else (err or "-")
            graph = "-" if row.get("graph_us") is None else f"{row['graph_us']:.1f}"
            lines.append(f"| {case} | {impl} | {graph} | {row['us']:.1f} ({100 * row['spread']:.1f}%) | "
                         f"{row['cache_read_tbps']:.2f} | {row['fraction_of_copy']:.2f} / "
                         f"{row['fraction_of_hbm_datasheet']:.2f} | {err} | {row.get('num_splits', '-')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time the decode configs in SWEEP")
    parser.add_argument("--threshold", action="store_true", help="also time Sq = 1..64, decode vs prefill path")
    parser.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE,...",
                        help=f"also time this change of the pinned decode config ({', '.join(configs.DECODE_FIELDS)})")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness check")
    parser.add_argument("--no-flex", action="store_true", help="leave FlexAttention out")
    parser.add_argument("--dense-only", action="store_true", help="only the dense cases (and the sweep)")
    parser.add_argument("--uncached", action="store_true",
                        help=f"also time the decode path without the launch cache (as {UNCACHED!r})")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--markdown", metavar="RESULT.json", help="print the tables of an earlier result (no GPU)")
    args = parser.parse_args(argv)
    if args.markdown:
        return render_result(args.markdown, "benchmark_decode", markdown)
    variants, status = arguments_or_status("benchmark_decode", lambda: [parse_variant(spec) for spec in args.variant])
    if status is not None:
        return status
    result = run(sweep=args.sweep, threshold=args.threshold, variants=variants, check=not args.no_check,
                 flex=not args.no_flex, dense_only=args.dense_only, uncached=args.uncached)
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
