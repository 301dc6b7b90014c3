"""Dense PyTorch reference of block-sparse attention: the semantics the Triton kernel must match.

It computes exactly the function of (q, k, v, layout) the kernel computes: the same element
visibility (``BlockLayout.dense_mask``: block classes, the MaskSpec predicate and the layout's
element masks: document ids, key padding, mask bits), GQA head mapping, scale, and the empty-row
rule (a query row that sees no key returns 0 and LSE -inf, never NaN). On an NVIDIA GPU it runs through
PyTorch's CUDA kernels and is what a capture there records as the original implementation.

Query rows are processed in chunks so that the score matrix never exceeds ``chunk_rows x Sk``
per (batch, head); long sequences stay within memory.
"""
from __future__ import annotations

import torch

from . import dtypes
from .inputs import check_inputs  # one set of input checks for kernel and reference
from .layout import BlockLayout

__all__ = ["reference_attention", "PRECISIONS"]

PRECISIONS = ("fp32", "fp64", "same")


def _compute_dtype(precision: str, input_dtype: torch.dtype) -> torch.dtype:
    if precision == "same":
        return input_dtype
    if precision in PRECISIONS:
        return dtypes.torch_dtype(precision)
    raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    *,
    sm_scale: float | None = None,
    return_lse: bool = False,
    precision: str = "fp32",
    chunk_rows: int = 1024,
):
    """Block-sparse attention computed densely in PyTorch.

    q: [B, Hq, Sq, D]; k, v: [B, Hkv, Sk, D] with Hq a multiple of Hkv.
    precision: "fp32" or "fp64" (compute in that dtype), or "same" (compute in the input dtype:
    the same-precision baseline of the flash-attention tolerance rule).
    Returns out [B, Hq, Sq, D] in the compute dtype, and with ``return_lse`` the natural-log
    LSE [B, Hq, Sq] (fp32, or fp64 for "fp64"); rows with no visible key give 0 and -inf.
    """
    check_inputs(q, k, v, layout)
    dtype = _compute_dtype(precision, q.dtype)
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_k = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    layout = layout.to(q.device)

    qc = q.to(dtype)
    # GQA: query head h reads key/value head h // group. The query heads of one K/V head are
    # stacked as rows of one matrix ([B, Hkv, group x rows, D]) instead of repeating K and V per
    # query head: the same dot products, without a copy of K and V `group` times over in the
    # compute dtype (34 GB each in fp64 for a batch of 8 over a 128k-key cache).
    kc = k.to(dtype)
    vc = v.to(dtype)
    out = torch.empty(batch, heads_q, seq_q, head_dim, dtype=dtype, device=q.device)
    lse_dtype = dtypes.accumulation_dtype(dtype)
    lse = torch.empty(batch, heads_q, seq_q, dtype=lse_dtype, device=q.device)

    for start in range(0, seq_q, chunk_rows):
        end = min(seq_q, start + chunk_rows)
        visible = layout.dense_mask(start, end)  # [B' or 1, H' or 1, rows, Sk]: blocks and element masks
        rows = end - start
        stacked = qc[:, :, start:end].reshape(batch, heads_kv, group * rows, head_dim)
        scores = torch.matmul(stacked, kc.transpose(-1, -2)).view(batch, heads_q, rows, seq_k) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        row_max = scores.amax(dim=-1, keepdim=True)
        empty = torch.isneginf(row_max)
        # exp(-inf - 0) = 0 for empty rows instead of exp(-inf - -inf) = NaN
        row_max = torch.where(empty, torch.zeros_like(row_max), row_max)
        probs = torch.exp(scores - row_max)
        denom = probs.sum(dim=-1, keepdim=True)
        safe_denom = torch.where(empty, torch.ones_like(denom), denom)
        probs = probs / safe_denom
        stacked_probs = probs.to(dtype).reshape(batch, heads_kv, group * rows, seq_k)
        out[:, :, start:end] = torch.matmul(stacked_probs, vc).view(batch, heads_q, rows, head_dim)
        chunk_lse = (row_max + torch.log(safe_denom)).squeeze(-1)
        lse[:, :, start:end] = torch.where(empty.squeeze(-1), float("-inf"), chunk_lse).to(lse_dtype)

    return (out, lse) if return_lse else out
