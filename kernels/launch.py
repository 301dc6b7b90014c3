"""The kernel's launch arguments, built once for both users: the launcher (``kernels.attention``),
which launches them, and ahead-of-time inspection (``kernels.aot``), which compiles them.

``build_launch`` turns a problem (tensors, layout, clamped config, flags) into the grid, every
runtime argument by the kernel's parameter name, the constexprs and the compiler options. Because
``aot`` compiles exactly this (its Triton signature is specialized from these arguments), the
compiled code cannot drift from what the launcher runs. Importing this module does not import
Triton; ``build_launch`` does.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from .configs import LaunchConfig
from .launch_cache import pointer_key
from .layout import BlockLayout

__all__ = ["KernelLaunch", "build_launch", "launch_key", "PER_CALL", "element_mask_arguments", "named_strides",
           "next_power_of_2", "tma_fits", "tile_order_on_device", "host_tma_fits", "kv_descriptors", "DESCRIPTORS", "MAX_PROGRAMS"]

# One launch's 1-D grid is at most 2**31 - 1 programs.
MAX_PROGRAMS = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class KernelLaunch:
    """Everything ``block_sparse_attn_fwd[grid](**args, **constexprs, **options)`` is given."""

    grid: tuple[int]
    args: dict[str, Any]  # runtime arguments by parameter name, in the kernel's order
    constexprs: dict[str, Any]
    options: dict[str, Any]  # LaunchConfig.launch_kwargs(): num_warps, num_stages, AMD knobs
    config: LaunchConfig  # the clamped config the tiles come from


def build_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor | None, layout: BlockLayout, config: LaunchConfig, *, sm_scale: float,
                 emulate_bf16: bool = False, use_tma: bool = False, amd: bool = False,
                 descriptors: tuple[Any, Any] = (None, None)) -> KernelLaunch:
    """The launch of ``block_sparse_attn_fwd`` for q: [B, Hq, Sq, D], k, v: [B, Hkv, Sk, D].

    ``out``: [B, Hq, Sq, D] the kernel writes (fp32 staging when ``emulate_bf16``); ``lse``:
    [B, Hq, Sq] fp32 to write the LSE to, None for no LSE (a [1, 1, 1] placeholder is passed).
    ``layout`` on q's device; ``config`` already clamped to the layout's blocks; ``sm_scale`` > 0.
    ``amd``: the kernel is compiled for an AMD GPU (``SELECT_LOADED``, a Triton 3.6 work-around).
    ``descriptors``: this call's host-made K and V descriptors (``kv_descriptors``; with
    ``use_tma``), or None, None for the descriptors built in the kernel.
    No checks of the inputs here (``kernels.attention.check_inputs`` does them) except the grid's
    size, a ValueError.
    """
    from .triton_attention import LOG2E

    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_k = k.shape[1], k.shape[2]
    return_lse = lse is not None
    if lse is None:
        lse = torch.empty(1, 1, 1, dtype=torch.float32, device=q.device)
    programs = batch * heads_q * -(-seq_q // config.block_m)  # plain integers: no Triton call per launch
    if programs > MAX_PROGRAMS:
        raise ValueError(f"{programs} query tiles (batch x heads x ceil(seq_q / {config.block_m})) exceed one "
                         f"launch's 2**31 - 1")
    counts, indices = _broadcast(layout.kv_num_blocks, layout.kv_indices, batch, heads_q)
    full_counts, full_indices = _broadcast(layout.full_kv_num_blocks, layout.full_kv_indices, batch, heads_q)
    mask = layout.mask
    # Where work is not monotone in the query tile (element masks), heaviest tiles first.
    tile_order = tile_order_on_device(layout, config.block_m) if (layout.has_doc or layout.has_bits) else None
    q_doc, k_doc, stride_qdb, stride_kdb, k_start, k_end, stride_pb, mask_bits, *bits_strides = (
        element_mask_arguments(layout, batch, heads_q))
    args = {
        "Q": q, "K": k, "V": v, "Out": out, "Lse": lse,
        "KV_NUM": counts, "KV_IDX": indices, "FULL_NUM": full_counts, "FULL_IDX": full_indices,
        # The kernel's softmax is in base 2: exp(s * scale) = exp2(s * scale * log2(e)).
        "qk_scale": sm_scale * LOG2E,
        **named_strides("q", q, "bhmd"), **named_strides("k", k, "bhnd"), **named_strides("v", v, "bhnd"),
        **named_strides("o", out, "bhmd"), **named_strides("l", lse, "bh"),
        **named_strides("c", counts, "bhm"), **named_strides("i", indices, "bhm"),
        **named_strides("fc", full_counts, "bhm"), **named_strides("fi", full_indices, "bhm"),
        "heads_q": heads_q, "gqa_group": heads_q // heads_kv, "seq_q": seq_q, "seq_k": seq_k,
        "causal_offset": mask.offset, "window": mask.window, "sink_tokens": mask.sink_tokens,
        "Q_DOC": q_doc, "K_DOC": k_doc, "stride_qdb": stride_qdb, "stride_kdb": stride_kdb,
        "K_START": k_start, "K_END": k_end, "stride_pb": stride_pb,
        "MASK_BITS": mask_bits, **dict(zip(("stride_mbb", "stride_mbh", "stride_mbm"), bits_strides)),
        "Q_ORDER": tile_order,
        "K_DESC": descriptors[0], "V_DESC": descriptors[1],
    }
    constexprs = {
        "HEAD_DIM": head_dim,
        "BLOCK_D": next_power_of_2(head_dim),
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "SPARSE_BLOCK_M": layout.block_m,
        "SPARSE_BLOCK_N": layout.block_n,
        "IS_CAUSAL": mask.causal,
        "HAS_WINDOW": mask.window > 0,
        "HAS_DOC": layout.has_doc,
        "HAS_PAD": layout.has_padding,
        "HAS_BITS": layout.has_bits,
        "HAS_ORDER": tile_order is not None,
        "RETURN_LSE": return_lse,
        "EMULATE_BF16": emulate_bf16,
        # fp32 parity needs IEEE products; for fp16/bf16 operands the setting has no effect.
        "DOT_PRECISION": "ieee",
        "USE_TMA": use_tma,
        "ONE_LOOP": config.one_loop,
        "SELECT_LOADED": amd,
        "HOST_TMA": use_tma and descriptors[0] is not None,
    }
    _check_signature(args, constexprs)
    return KernelLaunch((programs,), args, constexprs, config.launch_kwargs(), config)


# The parameters that take a call's own tensors; everything else a launch passes follows from the
# layout and ``launch_key`` (kernels/launch_cache.py).
PER_CALL = ("Q", "K", "V", "Out", "Lse")
# The prefill kernel's parameters that take a call's host-made K and V descriptors
# (``kv_descriptors``; None where none are made, which ``launch_key``'s config and shapes decide).
DESCRIPTORS = ("K_DESC", "V_DESC")


def launch_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
               config: LaunchConfig, *, sm_scale: float, emulate_bf16: bool = False, use_tma: bool = False) -> tuple:
    """What ``build_launch`` reads from its arguments besides the layout and the addresses of the
    ``PER_CALL`` tensors: their dtypes, devices, shapes and strides, whether each base is 16-byte
    aligned (Triton specializes pointers on it), the config, the scale and the flags. On one
    layout, two calls with equal keys get the same launch but for those tensors, and Triton
    specializes them alike (``tests/test_kernels_launch_cache.py``). Keep it in step with
    ``build_launch``."""
    per_call = (q, k, v, out) if lse is None else (q, k, v, out, lse)
    return (q.device, config, sm_scale, emulate_bf16, use_tma,  # with or without lse: the length differs
            *((t.dtype, tuple(t.shape), t.stride(), pointer_key(t)) for t in per_call))


def tma_fits(config: LaunchConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``config`` asks for TMA and the tensors allow its descriptors: a power-of-two head
    dim (no padded tile), a unit last stride, 16-byte aligned bases and row strides. The device
    (an NVIDIA GPU, not the interpreter) is the caller's to check; otherwise the pointer path
    runs, with the same values."""
    head_dim = q.shape[-1]
    if not config.tma or head_dim & (head_dim - 1):
        return False
    for t in (k, v):
        elem = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any((s * elem) % 16 for s in t.stride()[:-1]):
            return False
    return True


def host_tma_fits(config: LaunchConfig, k: torch.Tensor, v: torch.Tensor, block_n: int | None = None) -> bool:
    """Whether the kernel can take K and V as host-made descriptors (``config.host_tma``): each as
    one array of [B * Hkv * Sk, D] rows with one row stride (heads follow rows, batches heads,
    or the dim has one entry), a key length that is a multiple of the key tile and of the
    layout's key block ``block_n`` where given (a tile then never reads the next head's rows,
    which the per-head descriptors' bounds would zero-fill: a tile narrower than the block visits
    every sub-tile of a partial last block, also those starting at Sk, and a NaN there would
    reach this head's output through a zero weight), and fewer than 2**31 rows (TMA coordinates
    are 32-bit). ``tma_fits`` is the caller's to check first."""
    if not config.host_tma:
        return False
    for t in (k, v):
        batch, heads, seq, _ = t.shape
        if seq % config.block_n or (block_n and seq % block_n) or batch * heads * seq >= 2**31:
            return False
        if (heads > 1 and t.stride(1) != seq * t.stride(2)) or (batch > 1 and t.stride(0) != heads * t.stride(1)):
            return False
    return True


def kv_descriptors(k: torch.Tensor, v: torch.Tensor, config: LaunchConfig, use_tma: bool,
                   block_n: int | None = None) -> tuple[Any, Any]:
    """This call's K and V descriptors for a ``config.host_tma`` launch (Triton's
    ``TensorDescriptor`` over all rows, [BLOCK_N, D] boxes), or (None, None) where the kernel
    builds its own or loads through pointers. Made per call: they hold the tensors' addresses.
    ``block_n``: the layout's key block (``host_tma_fits``)."""
    if not (use_tma and host_tma_fits(config, k, v, block_n)):
        return None, None
    from triton.tools.tensor_descriptor import TensorDescriptor

    head_dim = k.shape[-1]
    return tuple(TensorDescriptor(t, [t.shape[0] * t.shape[1] * t.shape[2], head_dim], [t.stride(2), 1],
                                  [config.block_n, next_power_of_2(head_dim)]) for t in (k, v))


def tile_order_on_device(layout: BlockLayout, block_m: int) -> torch.Tensor:
    """``BlockLayout.tile_order`` (query tiles of ``block_m`` rows, heaviest first, ties later tile
    first) computed where the layout lives, with no copy to the host: a launch then never waits
    for the device, and can be captured in a CUDA graph. A stable descending sort of the work
    listed last tile first keeps equal tiles later-first, the order ``tile_order`` sorts to."""
    work = (layout.kv_num_blocks.to(torch.int64) + layout.full_kv_num_blocks).sum(dim=(0, 1))
    work = work.repeat_interleave(layout.block_m // block_m)[: -(-layout.seq_q // block_m)]
    last_first = torch.sort(work.flip(0), descending=True, stable=True).indices
    return (work.numel() - 1 - last_first).to(torch.int32)


def element_mask_arguments(layout: BlockLayout, batch: int, heads: int) -> tuple:
    """The kernel's element-mask arguments, in its parameter order: (Q_DOC, K_DOC, stride_qdb,
    stride_kdb, K_START, K_END, stride_pb, MASK_BITS, stride_mbb, stride_mbh, stride_mbm).

    Absent masks are None (Triton makes a None argument a constexpr, so the kernel compiled for
    a layout without element masks has the signature and code it had before they existed).
    Present ones are expanded to (batch, heads) with zero strides where the layout broadcasts;
    the kernel indexes their last dim with unit stride.
    """
    doc, pad, bits = (None,) * 4, (None,) * 3, (None,) * 4
    if layout.has_doc:
        q_doc = layout.q_doc.contiguous().expand(batch, layout.seq_q)
        k_doc = layout.k_doc.contiguous().expand(batch, layout.seq_k)
        doc = (q_doc, k_doc, q_doc.stride(0), k_doc.stride(0))
    if layout.has_padding:
        k_start, k_end = layout.k_start.expand(batch), layout.k_end.expand(batch)
        if k_start.stride(0) != k_end.stride(0):
            k_start, k_end = k_start.contiguous(), k_end.contiguous()
        pad = (k_start, k_end, k_start.stride(0))
    if layout.has_bits:
        words = layout.mask_bits.contiguous()
        words = words.expand(batch, heads, *words.shape[2:])
        bits = (words, *words.stride()[:3])
    return (*doc, *pad, *bits)


def _broadcast(counts: torch.Tensor, indices: torch.Tensor, batch: int, heads: int):
    """Expand layout dims of size 1 to (batch, heads) with zero strides (no copy)."""
    if counts.dtype != torch.int32:
        counts = counts.to(torch.int32)
    if indices.dtype != torch.int32:
        indices = indices.to(torch.int32)
    if indices.stride(-1) != 1:
        indices = indices.contiguous()
    return (counts.expand(batch, heads, counts.shape[2]),
            indices.expand(batch, heads, *indices.shape[2:]))


def named_strides(prefix: str, tensor: torch.Tensor, dims: str) -> dict[str, int]:
    """``stride_{prefix}{dim}`` for the leading ``len(dims)`` dims: ("q", q, "bhmd") ->
    stride_qb, stride_qh, stride_qm, stride_qd (the kernel's names)."""
    return dict(zip(_stride_names(prefix, dims), tensor.stride()))


@functools.lru_cache(maxsize=None)
def _stride_names(prefix: str, dims: str) -> tuple[str, ...]:
    return tuple(f"stride_{prefix}{dim}" for dim in dims)


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for n >= 1, in plain Python (that one is a Triton function)."""
    return 1 << (n - 1).bit_length()


_SIGNATURE_CHECKED: list[str] = []  # the kernel's parameter names once build_launch has matched them


def _check_signature(args: dict[str, Any], constexprs: dict[str, Any]) -> None:
    """RuntimeError if the names ``build_launch`` builds are not the kernel's parameters. Every
    launch builds the same names, so once they have matched, a launch's check is one comparison."""
    names = list(args) + list(constexprs)
    if names == _SIGNATURE_CHECKED:
        return
    runtime, constant = _kernel_parameters()
    if list(args) != runtime or set(constexprs) != constant:
        raise RuntimeError("kernels/launch.py is out of date with block_sparse_attn_fwd's signature: "
                           f"builds {list(args)} + {sorted(constexprs)}, the kernel takes {runtime} + "
                           f"{sorted(constant)}")
    _SIGNATURE_CHECKED[:] = names


@functools.lru_cache(maxsize=1)
def _kernel_parameters() -> tuple[list[str], set[str]]:
    """(runtime parameter names in order, constexpr names) of block_sparse_attn_fwd."""
    import inspect

    from . import triton_attention

    # .fn is the Python function under both JITFunction and the interpreter's wrapper.
    params = inspect.signature(triton_attention.block_sparse_attn_fwd.fn).parameters.values()
    constant = {p.name for p in params if "constexpr" in str(p.annotation)}
    return [p.name for p in params if p.name not in constant], constant
