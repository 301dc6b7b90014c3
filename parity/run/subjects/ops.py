"""The block-sparse attention op as a module, switchable between the reference and the Triton kernel.

Its layout arrives as tensors plus JSON metadata (``BlockLayout.to_tensors()`` and ``.meta``),
not as a ``BlockLayout`` object, so that a recorded call can be replayed from a bundle.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from parity.base import dtypes

IMPLS = ("reference", "triton")


class SparseAttention(nn.Module):
    """Block-sparse attention, ``impl`` ``"reference"`` or ``"triton"``.

    forward(q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, D], layout: dict of the layout's
    tensors, layout_meta: the layout's meta) -> out [B, Hq, Sq, D] in q's dtype, or with
    ``return_lse`` ``{"out": out, "lse": lse [B, Hq, Sq]}``.

    ``reference`` is the PyTorch reference computed in fp32 (fp64 for fp64 inputs, as in a
    high-precision reference run) and cast to q's dtype: what the original implementation
    computes. ``triton`` is the kernel with its pinned launch config, which it exposes after a
    call as ``parity_launch_config`` for the bundle's ``kernel_configs``.
    """

    def __init__(self, impl: str, *, return_lse: bool = False, sm_scale: float | None = None):
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        self.impl = impl
        self.return_lse = return_lse
        self.sm_scale = sm_scale
        self.parity_launch_config: dict[str, Any] | None = None

    def extra_repr(self) -> str:
        return f"impl={self.impl}, return_lse={self.return_lse}"

    def forward(self, q, k, v, layout: dict[str, torch.Tensor], layout_meta: dict[str, Any]):
        from parity.kernels import BlockLayout, block_sparse_attention, launch_config, reference_attention

        block_layout = BlockLayout.from_tensors(layout, layout_meta)
        if self.impl == "reference":
            precision = dtypes.short_name(dtypes.accumulation_dtype(q.dtype))
            out, lse = reference_attention(q, k, v, block_layout, sm_scale=self.sm_scale, return_lse=True,
                                           precision=precision)
            out = out.to(q.dtype)
        else:
            config = launch_config(q.device, q.shape[-1], q.dtype, block_layout)
            self.parity_launch_config = config.to_dict()
            out, lse = block_sparse_attention(q, k, v, block_layout, sm_scale=self.sm_scale, return_lse=True,
                                              config=config)
        return {"out": out, "lse": lse} if self.return_lse else out
