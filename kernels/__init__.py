"""Block-sparse attention: the Triton kernel, its PyTorch reference, layouts and launch configs.

Installed as ``parity.kernels`` (never as a top-level ``kernels``: a PyPI package of that name
exists and ``transformers`` probes for it). Importing this package does not import Triton;
the kernel module is loaded on first use, so the reference works where Triton is absent.
"""
from .attention import block_sparse_attention, check_inputs, launch_config
from .configs import LaunchConfig, config_for
from .layout import (
    BlockLayout,
    LayoutError,
    MaskSpec,
    causal_layout,
    document_layout,
    layout_from_block_mask,
    layout_from_dense_mask,
    layout_from_mask_mod,
    padding_layout,
    prefix_lm_layout,
    random_layout,
    sink_layout,
    sliding_window_layout,
    varlen_layout,
)
from .reference import reference_attention

__all__ = [
    "BlockLayout", "LayoutError", "MaskSpec", "LaunchConfig",
    "causal_layout", "sliding_window_layout", "sink_layout", "random_layout", "layout_from_block_mask",
    "layout_from_dense_mask", "layout_from_mask_mod", "document_layout", "varlen_layout", "padding_layout",
    "prefix_lm_layout",
    "block_sparse_attention", "reference_attention", "check_inputs", "launch_config", "config_for",
]
