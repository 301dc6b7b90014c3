"""The kernel as a PyTorch operator (``torch.ops.parity.block_sparse_attention``) and its public
wrapper ``sparse_attention``: what torch.compile, CUDA graphs and torch.export hold.

The operator takes only tensors and plain scalars: q, k, v, the layout's four block tensors, its
five optional element-mask tensors (None where absent), its integer metadata (block sizes and the
``MaskSpec`` fields; the sequence lengths are q's and k's), the scale and whether the LSE is
wanted. It returns (out, lse); lse is an empty fp32 tensor when not asked for. Its implementation
(CPU under the Triton interpreter, CUDA) is the launcher, ``kernels.attention``, through its launch
plans (``kernels.launch_cache``): nothing in it reads a tensor's values on the host, so a call can
be captured in a CUDA graph; what it decides (prefill or decode path, config, split count) follows
from shapes and the layout's integer metadata.

Why ``torch.library.Library`` (a schema, one implementation, ``register_fake``) and not
``triton_op`` + ``wrap_triton`` or ``custom_op``:

* opaque to Inductor on purpose: the launcher keeps each call's compiled kernels and bound
  arguments and issues them directly (host time per call, ``bench/launch_overhead.py``); under
  ``wrap_triton`` Inductor would launch the kernel through its own path with every argument
  rebound, and the kernel takes None for absent element masks and host-made TMA descriptors per
  call. An attention kernel has no neighbour Inductor could fuse into it.
* eager dispatch cost, measured on the 2-core CPU of this project (torch 2.13.0, an op returning
  two new tensors, 20,000 calls): ``custom_op`` 38.6 us per call, a ``Library`` op 13.6 us, the
  plain function 5.0 us; a second run with the machine's two cores busy: 79.4, 19.1 and 7.9 us
  (``python bench/op_dispatch.py``). So eager calls of ``sparse_attention``
  call the launcher directly, and the operator is called where something traces (torch.compile,
  export, FakeTensor or other tensor subclasses): the same launcher either way.

Works from torch 2.6 (``torch.library.register_fake`` and ``opcheck`` exist from 2.4; the device
runs 2.11, this machine 2.13).
"""
from __future__ import annotations

import torch

from .attention import attention_from_tensors, block_sparse_attention
from .layout import BlockLayout

__all__ = ["sparse_attention", "OP_NAME", "op_arguments"]

OP_NAME = "parity::block_sparse_attention"

_SCHEMA = ("block_sparse_attention(Tensor q, Tensor k, Tensor v, Tensor kv_num_blocks, Tensor kv_indices, "
           "Tensor full_kv_num_blocks, Tensor full_kv_indices, Tensor? q_doc, Tensor? k_doc, Tensor? k_start, "
           "Tensor? k_end, Tensor? mask_bits, int block_m, int block_n, bool causal, int window, "
           "int sink_tokens, int offset, float sm_scale, bool return_lse) -> (Tensor, Tensor)")

_LIBRARY = torch.library.Library("parity", "FRAGMENT")
_LIBRARY.define(_SCHEMA)


def _implementation(q, k, v, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_doc, k_doc,
                    k_start, k_end, mask_bits, block_m, block_n, causal, window, sink_tokens, offset, sm_scale,
                    return_lse):
    out, lse = attention_from_tensors(
        q, k, v, (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_doc, k_doc, k_start, k_end,
                  mask_bits), (block_m, block_n, causal, window, sink_tokens, offset), sm_scale, return_lse)
    return out, (lse if return_lse else _no_lse(q))


def _no_lse(q: torch.Tensor) -> torch.Tensor:
    # An operator returns new tensors, never None: an empty one stands for "not asked for".
    return torch.empty(0, dtype=torch.float32, device=q.device)


for _key in ("CPU", "CUDA"):
    _LIBRARY.impl("block_sparse_attention", _implementation, _key)


@torch.library.register_fake(OP_NAME, lib=_LIBRARY)
def _fake(q, k, v, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_doc, k_doc, k_start, k_end,
          mask_bits, block_m, block_n, causal, window, sink_tokens, offset, sm_scale, return_lse):
    # What the implementation allocates: out like q (torch.empty_like keeps q's strides), the
    # LSE [B, Hq, Sq] fp32 contiguous.
    out = torch.empty_like(q)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32) if return_lse else q.new_empty(0, dtype=torch.float32)
    return out, lse


def op_arguments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout, sm_scale: float,
                 return_lse: bool) -> tuple:
    """The operator's positional arguments for a call on ``layout`` (its tensors and metadata)."""
    mask = layout.mask
    return (q, k, v, layout.kv_num_blocks, layout.kv_indices, layout.full_kv_num_blocks, layout.full_kv_indices,
            layout.q_doc, layout.k_doc, layout.k_start, layout.k_end, layout.mask_bits,
            layout.block_m, layout.block_n, mask.causal, mask.window, mask.sink_tokens, mask.offset,
            float(sm_scale), bool(return_lse))


def operator_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout_arguments: tuple,
                  sm_scale: float | None = None) -> torch.Tensor:
    """The operator on a layout given as its arguments (``layout.dense_mask_arguments``), for a
    graph that holds no ``BlockLayout``: out [B, Hq, Sq, D]."""
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    out, _ = torch.ops.parity.block_sparse_attention.default(q, k, v, *layout_arguments, float(scale), False)
    return out


def _tracing(q: torch.Tensor) -> bool:
    """Whether this call is being traced (torch.compile, export) or runs on tensor subclasses
    (FakeTensor, functional tensors): then the operator must appear in the graph."""
    return torch.compiler.is_compiling() or type(q) is not torch.Tensor


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout,
                     sm_scale: float | None = None, return_lse: bool = False):
    """Block-sparse attention with the Triton kernel, as a PyTorch operator.

    q: [B, Hq, Sq, D]; k, v: [B, Hkv, Sk, D], Hq a multiple of Hkv (GQA); fp16, bf16 or fp32;
    D in {16, 32, 64, 96, 128, 256}. layout: a ``BlockLayout`` for (Sq, Sk) on q's device,
    broadcast over batch and heads where its dims are 1. sm_scale: defaults to D ** -0.5.
    Returns out [B, Hq, Sq, D] in q's dtype, and with ``return_lse`` also the natural-log LSE
    [B, Hq, Sq] fp32 (a row that sees no key: 0 and -inf).

    The pinned config, the decode path for short queries and the launch plans are the launcher's
    (``kernels.attention.block_sparse_attention``, which also takes a config, preallocated outputs
    and the decode options). Under torch.compile (``fullgraph=True`` works) the call is
    ``torch.ops.parity.block_sparse_attention``, opaque to Inductor; in eager mode the launcher is
    called directly (module docstring: the dispatcher's cost). Equal bits either way.
    """
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    if _tracing(q):
        out, lse = torch.ops.parity.block_sparse_attention.default(*op_arguments(q, k, v, layout, scale, return_lse))
        return (out, lse) if return_lse else out
    return block_sparse_attention(q, k, v, layout, sm_scale=scale, return_lse=return_lse)
