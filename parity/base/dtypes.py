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

from parity.base.errors import UsageError
from parity.base.text import printable
from parity.kernels.dtypes import FLOATING, KERNEL_DTYPES
from parity.kernels.dtypes import TABLE as _TABLE
from parity.kernels.dtypes import accumulation_dtype, lookup

__all__ = [
    "FLOATING", "KERNEL_DTYPES", "lookup", "short_name", "torch_dtype", "torch_name", "triton_name", "triton_pointer",
    "check_name", "accumulation_dtype", "dtype_text",
]
# The table (short name -> torch dtype, Triton type, aliases), FLOATING, KERNEL_DTYPES (the dtypes
# the attention kernel computes in: the attention subject, the fuzzer, `parity inspect` and
# `parity capture --dtype` offer them), lookup() (the short name of any spelling, or None where
# other dtypes are legitimate: a report shows ``int64`` as it is) and accumulation_dtype() are the
# kernel layer's (parity.kernels.dtypes); this module adds the one usage error for a name nobody
# knows, and the names for manifests and reports.


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
    return dtype_text(torch_dtype(dtype))


def dtype_text(dtype: object) -> str:
    """Any dtype as manifests and reports write it: ``torch.int64`` -> ``"int64"`` (strings, and
    dtypes outside the vocabulary, pass through without the ``torch.`` prefix)."""
    return str(dtype).removeprefix("torch.")


def triton_name(dtype: torch.dtype | str) -> str:
    """Triton's scalar type name, as in ``triton.compile`` signatures: ``torch.float32`` -> ``"fp32"``."""
    return _TABLE[short_name(dtype)][1]


def triton_pointer(dtype: torch.dtype | str) -> str:
    """Triton's signature type of a tensor argument of this dtype: ``"*bf16"``."""
    return "*" + triton_name(dtype)


def _shown(value: object) -> str:
    return printable(repr(value) if isinstance(value, str) else str(value), limit=80)
