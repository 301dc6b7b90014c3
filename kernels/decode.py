"""The decode path: split-KV ("flash-decoding") block-sparse attention for short query lengths.

Serving spends most of its time decoding: one to a few query tokens against a long KV cache. The
prefill launch (one program per batch, head and 128-row query tile) then has B * Hq programs, most
of the GPU idles, and every query head of a GQA group reads the group's K/V again. This path
instead launches ``block_sparse_decode_fwd`` on a grid of (splits, batch x head groups): each
program takes the query rows of one GQA group (heads x positions, one K/V read for all of them)
and a contiguous share of the key tiles the layout lists, and writes a normalized partial output
with its base-2 LSE. The splits of each head group are then merged in the same launch: each
program counts its arrival on the group's counter (one atomic, acq_rel), and the one that arrives
last reads every split's partials and writes the output ("the last split combines"; no program
ever waits on another). ``DecodeConfig.fused_combine=False`` launches ``decode_combine`` for the
merge instead, the same arithmetic in a second kernel (``DecodeLaunch.combine`` records which
ran). With one split the kernel writes the output itself and nothing merges.

The partial buffers and the counters live as long as a launch plan (the launch cache's entry),
not one call: a plan's hit allocates nothing but its output. That is safe because an entry is
keyed on the device and the stream (``launch_cache.dispatch_state``): two calls that share one are
queued on one stream, which runs the second call's split kernel only after the first call's merge
has read the partials and put the counters back to 0. That holds for a call of one launch (the
fused merge); with the combine kernel a call is two launches, and another host thread's launch on
the same stream can come between them, so such a plan makes its partial buffers per call
(``LaunchCache``'s ``shared``). Every other call allocates them afresh: a
call without the cache, one under CUDA-graph capture (the cache steps aside; the graph then owns
buffers of its own, its counters zeroed by a memset node every replay), and the operator's
``borrowed_only`` calls, whose plans must keep nothing they allocated alive (their cache makes the
buffers anew per hit, the counters zeroed: ``COUNTERS``).

A counter left non-zero would make a later launch merge before all its splits have written, a
wrong result with no error; it takes a launch that stopped halfway. A GPU kernel does not stop
halfway except by a fault, and a fault poisons the CUDA context (every later call raises), so no
later launch computes with it. Under the interpreter (programs run one after another in Python) an
interrupt can stop a grid halfway: ``kernels.attention`` then drops the decode plans, counters
included, so the next call builds a new one from zeros.

Only the blocks the layout keeps are read, so sparse layouts (sliding window, sink + window,
random) and ragged batches (``padding_layout``: per-sequence cache lengths, its block lists skip
each sequence's padding) cost what they keep. The number of splits is chosen from the shape and
the device's multiprocessor / compute-unit count (``choose_splits``); it changes the order of
the softmax reduction, so a parity run records it (``DecodeLaunch.num_splits``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .configs import DECODE_MAX_SEQ_Q, DecodeConfig
from .launch import element_mask_arguments, named_strides, next_power_of_2
from .launch_cache import LaunchStep, int_class, pointer_key
from .layout import BlockLayout

__all__ = ["DecodeLaunch", "decode_eligible", "heads_per_program", "choose_splits", "build_decode_launch",
           "decode_key", "decode_steps", "MAX_ROWS", "WORKSPACE", "COUNTERS", "SCALARS", "decode_scalars",
           "merge_unroll", "MERGE_UNROLL", "merge_splits"]

# The tensors the decode launch allocates and its kernels write: the split kernel's partial
# outputs and LSEs, which the merge reads (any content at a launch's start is overwritten first).
WORKSPACE = ("PartOut", "PartLse")
# The per-(batch, head group) arrival counters of the fused merge: zero at a launch's start (made
# with torch.zeros) and zero again at its end (the merging program resets its group's).
COUNTERS = ("Counter",)

# Query rows of one program (heads of a group x query positions): a group is split into fewer
# heads per program beyond this, to keep the tile's registers bounded.
MAX_ROWS = 64


def decode_eligible(seq_q: int, layout: BlockLayout, max_seq_q: int = DECODE_MAX_SEQ_Q) -> bool:
    """Whether the decode path applies: at most ``max_seq_q`` query rows (the default choice's
    threshold; asked for explicitly, up to ``MAX_ROWS``), all in the layout's first query block."""
    return 1 <= seq_q <= max_seq_q and layout.num_q_blocks == 1


def heads_per_program(gqa_group: int, seq_q: int, layout: BlockLayout) -> int:
    """How many query heads of one GQA group a program takes: all of them (one K/V read) when the
    layout's block lists are shared by every head (their head dim is 1) and the rows fit
    ``MAX_ROWS``, else the largest divisor of the group that fits; 1 where the lists differ
    between heads (element masks may still differ: the kernel reads them per row)."""
    if layout.batch_heads[1] != 1:
        return 1
    best = 1
    for heads in range(1, gqa_group + 1):
        if gqa_group % heads == 0 and heads * seq_q <= MAX_ROWS:
            best = heads
    return best


def choose_splits(programs: int, max_tiles: int, units: int, config: DecodeConfig) -> int:
    """Splits of the key range per program: the most that keep the launch within
    ``config.programs_per_unit`` programs per unit (whole waves: a partial last wave of equal
    programs leaves units idle), no split with fewer than ``config.min_tiles_per_split`` tiles of
    the longest list, at most ``config.max_splits``, at least one."""
    if max_tiles <= 0:
        return 1
    wanted = units * config.programs_per_unit // max(1, programs)
    by_work = max_tiles // config.min_tiles_per_split
    return max(1, min(wanted, by_work, config.max_splits))


# Splits whose partial tiles the merge reads per loop iteration, unrolled (``_merge_splits``): one
# program merges a group's splits, and a loop that reads one split per iteration waits for an L2
# round trip per split. 4 splits per iteration measured best of 1, 2, 4 and 8 on an H100 with the
# 16-row merge tile (bench/BENCHMARK.md, fifth round); with the tile cut to the group's real rows
# (MERGE_M) the split kernel compiles to 72 registers on sm_90, no spills (compile-only), and
# other unrollings were not measured again.
MERGE_UNROLL = 4


def merge_unroll(num_splits: int) -> int:
    """The merge's ``MERGE_UNROLL`` for ``num_splits`` splits: ``MERGE_UNROLL``, or the splits'
    next power of two where fewer (no loads that every mask turns off)."""
    return min(MERGE_UNROLL, next_power_of_2(max(1, num_splits)))


def merge_splits(num_splits: int, rows: int, config: DecodeConfig) -> int:
    """The merge's ``MERGE_SPLITS``: the config's most splits (``max_splits``) to a power of two,
    whose LSEs the merge's first pass reads as one [MERGE_SPLITS, rows] tile (the splits past
    ``num_splits`` masked), where that tile holds at most ``config.merge_lse_tile`` values; else
    0 (the split-by-split loop). From the config and the rows, not from ``num_splits``: the split
    count grows with the keys, and a constexpr that followed it would compile the split kernel
    again at every power of two a generating model's cache crosses (five times from 1k to 16k keys
    at B1); the masked lanes cost one predicated load per thread. ``rows``: the tile's (padded)
    query rows."""
    tile = next_power_of_2(max(1, config.max_splits))
    return tile if num_splits <= tile and tile * rows <= config.merge_lse_tile else 0


@dataclasses.dataclass(frozen=True)
class DecodeLaunch:
    """The launches of the decode path: ``block_sparse_decode_fwd[grid](**args, **constexprs,
    **options)``, then, where ``combine == "kernel"``, ``decode_combine[combine_grid](**combine_args,
    **combine_constexprs)``. ``combine``: how the splits were merged, "none" (one split, no merge),
    "fused" (the split kernel's last program per head group) or "kernel" (``decode_combine``)."""

    grid: tuple[int, int]
    args: dict[str, Any]
    constexprs: dict[str, Any]
    options: dict[str, Any]
    config: DecodeConfig
    num_splits: int
    combine_grid: tuple[int] | None
    combine_args: dict[str, Any] | None
    combine_constexprs: dict[str, Any] | None
    combine: str = "none"


def build_decode_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor | None, layout: BlockLayout, config: DecodeConfig, *, sm_scale: float,
                        num_splits: int | None = None, units: int = 1, emulate_bf16: bool = False,
                        amd: bool = False, warp_size: int = 32) -> DecodeLaunch:
    """The decode launch for q: [B, Hq, Sq, D] (``decode_eligible``), k, v: [B, Hkv, Sk, D].

    ``out`` [B, Hq, Sq, D] (fp32 staging when ``emulate_bf16``); ``lse`` [B, Hq, Sq] fp32 or None;
    ``config`` already clamped to the layout's key blocks; ``num_splits`` None picks them
    (``choose_splits`` over ``units`` multiprocessors), else that many (>= 1). The partial
    buffers and the fused merge's counters (zeroed) are allocated here. ``amd``: compiled for an
    AMD GPU (``SELECT_LOADED``); ``warp_size``: the target's threads per warp or wavefront
    (``targets.warp_size``; the fused merge releases in every thread). No checks of the inputs
    (the launcher's ``check_inputs`` does them).
    """

    from .triton_attention import LOG2E

    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_k = k.shape[1], k.shape[2]
    gqa_group = heads_q // heads_kv
    group = heads_per_program(gqa_group, seq_q, layout)
    head_groups = heads_q // group
    block_m = max(16, next_power_of_2(group * seq_q))
    # The merge has no tl.dot: its tile is the group's rows padded to a power of two only
    # (MERGE_M; 4 of BLOCK_M's 16 at GQA 32:8, one token), so no loads or registers go to padding.
    merge_m = next_power_of_2(group * seq_q)
    block_d = next_power_of_2(head_dim)
    sub = layout.block_n // config.block_n
    max_tiles = (layout.kv_indices.shape[-1] + layout.full_kv_indices.shape[-1]) * sub
    programs = batch * head_groups
    if num_splits is None:
        num_splits = choose_splits(programs, max_tiles, units, config)
    elif num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    split = num_splits > 1
    fused = split and config.fused_combine
    return_lse = lse is not None
    if lse is None:
        lse = torch.empty(1, 1, 1, dtype=torch.float32, device=q.device)
    rows = group * seq_q
    if split:
        part_out = torch.empty(batch, head_groups, num_splits, rows, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, head_groups, num_splits, rows, dtype=torch.float32, device=q.device)
    else:  # not read: one split writes the output itself
        part_out = torch.empty(1, 1, 1, 1, 1, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=q.device)
    # one arrival counter per program column of the grid (batch x head group); not read unfused
    counter = torch.zeros(programs if fused else 1, dtype=torch.int32, device=q.device)
    counts, indices = _first_block(layout.kv_num_blocks, layout.kv_indices, batch, heads_q)
    full_counts, full_indices = _first_block(layout.full_kv_num_blocks, layout.full_kv_indices, batch, heads_q)
    mask = layout.mask
    q_doc, k_doc, stride_qdb, stride_kdb, k_start, k_end, stride_pb, mask_bits, *bits_strides = (
        element_mask_arguments(layout, batch, heads_q))
    args = {
        "Q": q, "K": k, "V": v, "Out": out, "Lse": lse, "PartOut": part_out, "PartLse": part_lse, "Counter": counter,
        "KV_NUM": counts, "KV_IDX": indices, "FULL_NUM": full_counts, "FULL_IDX": full_indices,
        "qk_scale": sm_scale * LOG2E,
        **named_strides("q", q, "bhmd"), **named_strides("k", k, "bhnd"), **named_strides("v", v, "bhnd"),
        **named_strides("o", out, "bhmd"), **named_strides("l", lse, "bh"),
        **named_strides("po", part_out, "bhsr"), **named_strides("pl", part_lse, "bhs"),
        "stride_cb": counts.stride(0), "stride_ch": counts.stride(1),
        "stride_ib": indices.stride(0), "stride_ih": indices.stride(1),
        "stride_fcb": full_counts.stride(0), "stride_fch": full_counts.stride(1),
        "stride_fib": full_indices.stride(0), "stride_fih": full_indices.stride(1),
        "head_groups": head_groups, "gqa_group": gqa_group, "seq_q": seq_q, "seq_k": seq_k,
        "causal_offset": mask.offset, "window": mask.window, "sink_tokens": mask.sink_tokens,
        "Q_DOC": q_doc, "K_DOC": k_doc, "stride_qdb": stride_qdb, "stride_kdb": stride_kdb,
        "K_START": k_start, "K_END": k_end, "stride_pb": stride_pb,
        "MASK_BITS": mask_bits, **dict(zip(("stride_mbb", "stride_mbh", "stride_mbm"), bits_strides)),
    }
    constexprs = {
        "HEAD_DIM": head_dim, "BLOCK_D": block_d, "BLOCK_M": block_m, "BLOCK_N": config.block_n,
        "SPARSE_BLOCK_N": layout.block_n, "GROUP": group,
        "IS_CAUSAL": mask.causal, "HAS_WINDOW": mask.window > 0,
        "HAS_DOC": layout.has_doc, "HAS_PAD": layout.has_padding, "HAS_BITS": layout.has_bits,
        "RETURN_LSE": return_lse, "SPLIT": split, "FUSED": fused, "EMULATE_BF16": emulate_bf16,
        # fp32 parity needs IEEE products; for fp16/bf16 operands the setting has no effect.
        "DOT_PRECISION": "ieee",
        "SELECT_LOADED": amd,
        # one lane per thread of the program (tl.zeros needs a power of two; both factors are)
        "FENCE_LANES": config.num_warps * warp_size,
        # the merge's chunks where this kernel merges; else 1 (no compile per split count)
        "MERGE_UNROLL": merge_unroll(num_splits) if fused else 1,
        "MERGE_SPLITS": merge_splits(num_splits, merge_m, config) if fused else 0,
        "MERGE_M": merge_m if fused else 1,
    }
    combine_grid = combine_args = combine_constexprs = None
    if split and not fused:
        combine_grid = (programs,)
        combine_args = {
            "PartOut": part_out, "PartLse": part_lse, "Out": out, "Lse": lse,
            **named_strides("po", part_out, "bhsr"), **named_strides("pl", part_lse, "bhs"),
            **named_strides("o", out, "bhmd"), **named_strides("l", lse, "bh"),
            "num_splits": num_splits, "head_groups": head_groups, "seq_q": seq_q,
        }
        combine_constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "BLOCK_M": merge_m, "GROUP": group,
                              "RETURN_LSE": return_lse,
                              "MERGE_UNROLL": merge_unroll(num_splits),
                              "MERGE_SPLITS": merge_splits(num_splits, merge_m, config)}
    return DecodeLaunch((num_splits, programs), args, constexprs, config.launch_kwargs(), config, num_splits,
                        combine_grid, combine_args, combine_constexprs,
                        combine="fused" if fused else "kernel" if split else "none")


# The decode kernel's integer parameters that a decode loop changes every step (the key length and
# the causal diagonal grow by one; transformers' DynamicCache concatenates K/V anew, so their batch
# and head strides grow too): a launch plan takes them from each call (``LaunchCache``'s
# ``scalars``) and its key holds only their specialization class (``launch_cache.int_class``).
SCALARS = ("seq_k", "causal_offset", "stride_kb", "stride_kh", "stride_vb", "stride_vh")


def decode_scalars(k: torch.Tensor, v: torch.Tensor, offset: int) -> tuple[int, ...]:
    """The values of ``SCALARS`` that ``build_decode_launch`` passes for k, v: [B, Hkv, Sk, D]
    and the layout's causal ``offset``, in that order."""
    k_stride, v_stride = k.stride(), v.stride()
    return k.shape[2], offset, k_stride[0], k_stride[1], v_stride[0], v_stride[1]


def decode_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
               config: DecodeConfig, *, sm_scale: float, num_splits: int | None, emulate_bf16: bool = False) -> tuple:
    """What ``build_decode_launch`` reads from its arguments besides the layout, the addresses of
    the per-call tensors and the values of the per-call ``SCALARS``: the config, the asked-for
    split count (None: chosen from the shape and the device, both in the key), the scale and the
    flags; the per-call tensors' dtypes, shapes, strides and 16-byte alignment (Triton
    specializes pointers on it), except that k's and v's key length and batch and head strides
    enter as their specialization class only (``int_class``). On one layout, two calls with
    equal keys get the same launches but for those tensors and scalars, and Triton specializes
    them alike (``tests/test_kernels_launch_cache.py``)."""
    per_call = (q, out) if lse is None else (q, out, lse)
    kv = []
    for t in (k, v):
        (batch, heads, seq, dim), (stride_b, stride_h, stride_n, stride_d) = t.shape, t.stride()
        kv.append((t.dtype, batch, heads, dim, stride_n, stride_d, int_class(seq), int_class(stride_b),
                   int_class(stride_h), pointer_key(t)))
    return ("decode", num_splits, q.device, config, sm_scale, emulate_bf16, *kv, v.shape[2] == k.shape[2],
            *((t.dtype, tuple(t.shape), t.stride(), pointer_key(t)) for t in per_call))


def decode_steps(launch: DecodeLaunch) -> list[LaunchStep]:
    """A ``DecodeLaunch`` as its kernel launches in order (``launch_cache.LaunchStep``): the split
    kernel, then the combine kernel where it merges (``combine == "kernel"``)."""
    from .triton_attention import block_sparse_decode_fwd, decode_combine

    steps = [LaunchStep(block_sparse_decode_fwd, launch.grid, launch.args, launch.constexprs, launch.options)]
    if launch.combine_grid is not None:
        steps.append(LaunchStep(decode_combine, launch.combine_grid, launch.combine_args, launch.combine_constexprs,
                                {"num_warps": 4}))
    return steps


def _first_block(counts: torch.Tensor, indices: torch.Tensor, batch: int, heads: int):
    """Query block 0's count [B, H] and indices [B, H, max_kv_blocks], expanded over batch and
    heads with zero strides where the layout broadcasts (no copy)."""
    counts = counts[:, :, 0].to(torch.int32)
    indices = indices[:, :, 0].to(torch.int32)
    if indices.stride(-1) != 1:
        indices = indices.contiguous()
    return counts.expand(batch, heads), indices.expand(batch, heads, indices.shape[-1])
