"""The checks of an attention call's inputs, shared by the launcher and the naive reference. Torch only."""
from __future__ import annotations

import torch

from .layout import BlockLayout, LayoutError


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout) -> None:
    """Raise ValueError (or LayoutError) naming the problem; shared with the reference."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq, head_dim], got shape {list(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    batch, heads_q, seq_q, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k/v shape {list(k.shape)} does not match q {list(q.shape)} in batch or head_dim")
    heads_kv = k.shape[1]
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv})")
    if not isinstance(layout, BlockLayout):
        raise ValueError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    if layout.seq_q != seq_q or layout.seq_k != k.shape[2]:
        raise LayoutError(
            f"layout is for seq_q={layout.seq_q}, seq_k={layout.seq_k} but q/k have {seq_q}, {k.shape[2]}"
        )
    # Over the block tensors and the element masks (each is 1 or one common size, layout.py).
    lb, lh = layout.broadcast_batch_heads
    if lb not in (1, batch) or lh not in (1, heads_q):
        raise LayoutError(f"layout batch/head dims {lb}x{lh} must be 1 or match q's {batch}x{heads_q}")
