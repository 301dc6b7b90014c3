"""Block-sparse attention: the Triton kernel, its PyTorch reference, layouts and launch configs.

Installed as ``parity.kernels`` (never as a top-level ``kernels``: a PyPI package of that name
exists and ``transformers`` probes for it). Importing this package does not import Triton;
the kernel module is loaded on first use, so the reference works where Triton is absent.
"""
import os as _os
import sys as _sys


def _hand_over_to_installed_kernels() -> bool:
    """When this folder is imported as a top-level ``kernels``, load the installed one instead.

    That happens when the repository root is on ``sys.path`` (``python -m pytest`` or
    ``python -m parity`` run from a checkout) and something imports the PyPI package ``kernels``
    (Hugging Face's hub kernels, a dependency of transformers >= 5.25). The first match on
    ``sys.path`` would be this folder and the import would fail inside transformers. If a
    ``kernels`` package is installed elsewhere on the path, it replaces this module in
    ``sys.modules`` and True is returned; otherwise nothing changes.
    """
    import importlib.machinery
    import importlib.util

    root = _os.path.dirname(_os.path.dirname(_os.path.realpath(__file__)))
    path = [p for p in _sys.path if _os.path.realpath(p or _os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)
    _sys.modules["kernels"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del _sys.modules["kernels"]
        raise
    return True


if __name__ == "kernels" and _hand_over_to_installed_kernels():
    pass  # the import system returns sys.modules["kernels"], the installed package
else:
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
