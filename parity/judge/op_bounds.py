"""Which known op a recorded module call is, and its derived bound (parity.judge.bounds) from the call's inputs.

A module is known by its type: ``nn.Linear``, ``nn.LayerNorm`` (over one dimension), RMSNorm
(``nn.RMSNorm``, or any module named ``*RMSNorm`` with ``weight`` and ``eps`` or
``variance_epsilon``: the built-in decoder's and transformers' Llama), ``nn.ReLU``, ``nn.SiLU``,
``nn.GELU``, ``nn.Tanh``, ``nn.Sigmoid``, ``nn.Softmax``, and the built-in block-sparse attention
(``SparseAttention``: its output ``out``; the LSE has no bound here), and the transformers
integration's attention core (``ParityAttention``: query, key and value [B, H, S, D] with
transformers' mask, output [B, Sq, Hq, D]). Anything else (a whole
decoder layer, an MLP of several ops) has none: its error is the composition of several ops'
roundings and what each propagates, which a per-op bound does not cover.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from parity.judge import bounds
from parity.kernels.layout import BlockLayout

_ACTIVATIONS = {nn.ReLU: "relu", nn.SiLU: "silu", nn.GELU: "gelu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid"}


def _first_tensor(args: tuple, kwargs: Mapping[str, Any], name: str = "input") -> torch.Tensor | None:
    value = args[0] if args else kwargs.get(name, kwargs.get("x", kwargs.get("hidden_states")))
    return value if isinstance(value, torch.Tensor) and value.is_floating_point() else None


def _rms_eps(module: nn.Module, x: torch.Tensor) -> float | None:
    eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
    if isinstance(module, nn.RMSNorm) and eps is None:
        return torch.finfo(x.dtype).eps  # nn.RMSNorm's default
    return float(eps) if isinstance(eps, (int, float)) else None


def module_bound(module: nn.Module, args: tuple, kwargs: Mapping[str, Any], path: str,
                 out: torch.Tensor) -> bounds.Bound | None:
    """The derived bound of output ``path`` (``""``: the only output) of ``module(*args, **kwargs)``,
    whose output there is ``out`` (its dtype is the output rounding), or None for an op this
    module does not know."""
    x = _first_tensor(args, kwargs)
    dtype = out.dtype
    if not out.is_floating_point():
        return None
    if isinstance(module, nn.Linear) and path == "" and x is not None:
        return bounds.linear_bound(x, module.weight, module.bias, out_dtype=dtype)
    if isinstance(module, nn.LayerNorm) and path == "" and x is not None and len(module.normalized_shape) == 1:
        return bounds.layer_norm_bound(x, module.weight, module.bias, module.eps, out_dtype=dtype)
    if ((isinstance(module, nn.RMSNorm) or type(module).__name__.endswith("RMSNorm")) and path == ""
            and x is not None):
        eps = _rms_eps(module, x)
        weight = getattr(module, "weight", None)
        if eps is not None and (weight is None or isinstance(weight, torch.Tensor)):
            return bounds.rms_norm_bound(x, weight, eps, out_dtype=dtype)
        return None
    for kind, name in _ACTIVATIONS.items():
        if type(module) is kind and path == "" and x is not None:
            if kind is nn.GELU and module.approximate != "none":
                return None  # the tanh form has its own rounding; not modelled
            return bounds.activation_bound(name, x, out_dtype=dtype)
    if type(module) is nn.Softmax and path == "" and x is not None:
        return bounds.softmax_bound(x, module.dim if module.dim is not None else -1, out_dtype=dtype)
    if type(module).__name__ == "SparseAttention" and path in ("", "out"):
        return _attention(module, args, kwargs, dtype)
    if type(module).__name__ == "ParityAttention" and path == "":
        return _transformers_attention(module, args, kwargs, dtype)
    return None


def _attention(module: nn.Module, args: tuple, kwargs: Mapping[str, Any], dtype: torch.dtype) -> bounds.Bound:
    """The block-sparse op ``forward(q, k, v, layout, layout_meta)``, arguments by position or name."""
    bound_args = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    q, k, v = bound_args["q"], bound_args["k"], bound_args["v"]
    layout = BlockLayout.from_tensors(bound_args["layout"], bound_args["layout_meta"]).to(q.device)
    visible = layout.dense_mask(0, q.shape[2])
    return bounds.attention_bound(q, k, v, visible, scale=getattr(module, "sm_scale", None), out_dtype=dtype)


def _transformers_attention(module: nn.Module, args: tuple, kwargs: Mapping[str, Any],
                            dtype: torch.dtype) -> bounds.Bound | None:
    """``ParityAttention.forward(query, key, value, attention_mask, *, scaling, sliding_window,
    is_causal, cu_seq_lens_q, cu_seq_lens_k)``: the elements it sees are transformers' mask (bool,
    or additive: visible where above fp16's minimum), or without one bottom-right causal (within
    ``sliding_window``) or every key; packed documents (``cu_seq_lens``) have no bound here. Its
    output is [B, Sq, Hq, D]: the bound is transposed to it."""
    bound_args = inspect.signature(module.forward).bind(*args, **kwargs)
    bound_args.apply_defaults()
    a = bound_args.arguments
    q, k, v, mask = a["query"], a["key"], a["value"], a["attention_mask"]
    if a.get("cu_seq_lens_q") is not None or not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return None
    seq_q, seq_k = q.shape[2], k.shape[2]
    if isinstance(mask, torch.Tensor):
        visible = mask if mask.dtype == torch.bool else mask > torch.finfo(torch.float16).min
    elif mask is not None:
        return None
    elif a.get("is_causal", True):
        position = torch.arange(seq_q, device=q.device)[:, None] + (seq_k - seq_q)
        keys = torch.arange(seq_k, device=q.device)[None, :]
        visible = keys <= position
        window = a.get("sliding_window") or 0
        if window:
            visible &= keys > position - window
    else:
        visible = None
    bound = bounds.attention_bound(q, k, v, visible, scale=a.get("scaling"), out_dtype=dtype)
    return bounds.Bound(bound.op, bound.det.transpose(1, 2), bound.prob.transpose(1, 2), bound.k)
