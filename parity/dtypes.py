"""The one dtype vocabulary: short names (``bf16``), torch names (``bfloat16``), torch dtypes and
Triton type names, each way round, with one error for a name nobody knows.

Short names are what people type and what configs, case ids, benchmarks and ahead-of-time reports
use; torch names (``str(dtype)`` without ``torch.``) are what bundle manifests store; Triton names
(``bf16``, pointers ``*bf16``) are what ``triton.compile`` signatures use. Every alias below is
accepted wherever a dtype name is read, so ``--dtype bfloat16`` and ``--dtype bf16`` mean the same.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from .errors import UsageError

__all__ = [
    "FLOATING", "KERNEL_DTYPES", "lookup", "short_name", "torch_dtype", "torch_name", "triton_name", "triton_pointer",
    "check_name", "accumulation_dtype",
]

# short name -> (torch dtype, Triton scalar type, other accepted names), widest first.
_TABLE: dict[str, tuple[torch.dtype, str, tuple[str, ...]]] = {
    "fp64": (torch.float64, "fp64", ("float64", "double")),
    "fp32": (torch.float32, "fp32", ("float32", "float")),
    "fp16": (torch.float16, "fp16", ("float16", "half")),
    "bf16": (torch.bfloat16, "bf16", ("bfloat16",)),
}
FLOATING: tuple[str, ...] = tuple(_TABLE)
# The dtypes the attention kernel computes in (kernels.attention.SUPPORTED_DTYPES is built from
# this): the attention subject, the fuzzer, `parity inspect` and `parity capture --dtype` offer them.
KERNEL_DTYPES: tuple[str, ...] = ("fp16", "bf16", "fp32")

_BY_NAME: dict[str, str] = {alias: short for short, (_, _, aliases) in _TABLE.items() for alias in (short, *aliases)}
_BY_TORCH: dict[torch.dtype, str] = {dtype: short for short, (dtype, _, _) in _TABLE.items()}


def lookup(dtype: object) -> str | None:
    """The short name of ``dtype`` (any spelling, or a torch dtype), or None when it has none:
    for callers where other dtypes are legitimate (a report shows ``int64`` as it is)."""
    if isinstance(dtype, torch.dtype):
        return _BY_TORCH.get(dtype)
    return _BY_NAME.get(dtype.removeprefix("torch.")) if isinstance(dtype, str) else None


def short_name(dtype: torch.dtype | str, *, what: str = "dtype") -> str:
    """``torch.bfloat16``, ``"bfloat16"``, ``"torch.bfloat16"`` or ``"bf16"`` -> ``"bf16"``.

    A UsageError (one line, ``unknown dtype 'fp8'; use one of ...``) for anything else; ``what``
    names where the value came from (``--dtype``, ``attention case dtype``).
    """
    short = lookup(dtype)
    if short is not None:
        return short
    raise UsageError(f"unknown {what} {_shown(dtype)}; use one of {', '.join(FLOATING)}")


def check_name(name: object, allowed: Iterable[str] = KERNEL_DTYPES, *, what: str = "dtype") -> str:
    """The short name of ``name`` if it is one of ``allowed`` (short names), else a UsageError
    naming ``what`` and the choices: the check every ``--dtype`` and config ``dtype`` goes through."""
    allowed = tuple(allowed)
    short = lookup(name) if isinstance(name, str) else None
    if short not in allowed:
        raise UsageError(f"unknown {what} {_shown(name)}; use one of {', '.join(allowed)}")
    return short


def torch_dtype(dtype: torch.dtype | str, *, what: str = "dtype") -> torch.dtype:
    """``"bf16"`` (or any alias, or a torch dtype) -> ``torch.bfloat16``."""
    return _TABLE[short_name(dtype, what=what)][0]


def torch_name(dtype: torch.dtype | str) -> str:
    """The torch (and bundle manifest) name: ``"bf16"`` or ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(torch_dtype(dtype)).removeprefix("torch.")


def triton_name(dtype: torch.dtype | str) -> str:
    """Triton's scalar type name, as in ``triton.compile`` signatures: ``torch.float32`` -> ``"fp32"``."""
    return _TABLE[short_name(dtype)][1]


def triton_pointer(dtype: torch.dtype | str) -> str:
    """Triton's signature type of a tensor argument of this dtype: ``"*bf16"``."""
    return "*" + triton_name(dtype)


def accumulation_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """The dtype a correct kernel accumulates in for tensors of ``dtype`` (a torch dtype or any
    name): fp64 for fp64, fp32 for everything else (fp16/bf16 matrix units accumulate in fp32;
    so do the references; integer and unknown names too)."""
    return torch.float64 if lookup(dtype) == "fp64" else torch.float32


def _shown(value: object) -> str:
    from .text import printable

    return printable(repr(value) if isinstance(value, str) else str(value), limit=80)
