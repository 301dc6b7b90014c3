"""The kernel's dtype facts: short names (``bf16``), torch dtypes and Triton type names. Torch only.

The harness's dtype vocabulary (``parity.base.dtypes``: one-line usage errors, any spelling a
user types) builds on this table; the kernel, its reference and its ahead-of-time inspection read
it here, so the kernel layer needs nothing of the harness.
"""
from __future__ import annotations

import torch

# short name -> (torch dtype, Triton scalar type, other accepted names), widest first.
TABLE: dict[str, tuple[torch.dtype, str, tuple[str, ...]]] = {
    "fp64": (torch.float64, "fp64", ("float64", "double")),
    "fp32": (torch.float32, "fp32", ("float32", "float")),
    "fp16": (torch.float16, "fp16", ("float16", "half")),
    "bf16": (torch.bfloat16, "bf16", ("bfloat16",)),
}
FLOATING: tuple[str, ...] = tuple(TABLE)
# The dtypes the attention kernel computes in (attention.SUPPORTED_DTYPES is built from this).
KERNEL_DTYPES: tuple[str, ...] = ("fp16", "bf16", "fp32")

_BY_NAME: dict[str, str] = {alias: short for short, (_, _, aliases) in TABLE.items() for alias in (short, *aliases)}
_BY_TORCH: dict[torch.dtype, str] = {dtype: short for short, (dtype, _, _) in TABLE.items()}


def lookup(dtype: object) -> str | None:
    """The short name of ``dtype`` (any spelling, ``torch.`` prefix allowed, or a torch dtype), or
    None when it has none."""
    if isinstance(dtype, torch.dtype):
        return _BY_TORCH.get(dtype)
    return _BY_NAME.get(dtype.removeprefix("torch.")) if isinstance(dtype, str) else None


def short_name(dtype: object) -> str:
    """``torch.bfloat16``, ``"bfloat16"`` or ``"bf16"`` -> ``"bf16"``; ValueError for anything else."""
    short = lookup(dtype)
    if short is None:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(FLOATING)}")
    return short


def torch_dtype(dtype: object) -> torch.dtype:
    """``"bf16"`` (or any alias, or a torch dtype) -> ``torch.bfloat16``; ValueError for others."""
    return TABLE[short_name(dtype)][0]


def triton_name(dtype: object) -> str:
    """Triton's scalar type name, as in ``triton.compile`` signatures: ``torch.float32`` -> ``"fp32"``."""
    return TABLE[short_name(dtype)][1]


def triton_pointer(dtype: object) -> str:
    """Triton's signature type of a tensor argument of this dtype: ``"*bf16"``."""
    return "*" + triton_name(dtype)


def accumulation_dtype(dtype: object) -> torch.dtype:
    """The dtype a correct kernel accumulates in for tensors of ``dtype``: fp64 for fp64, fp32 for
    everything else (fp16/bf16 matrix units accumulate in fp32; so do the references)."""
    return torch.float64 if lookup(dtype) == "fp64" else torch.float32
