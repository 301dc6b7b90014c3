"""What limits an attention kernel: its FLOPs and bytes against the device's measured ceilings.

A roofline from counts, not a profiler: the benchmarks time a kernel, count what it must do, and
divide by what the device was measured to do in the same run.

- FLOPs: 4 * D per (query, key) element of the blocks computed (two matmuls, QK^T and PV, of
  2 * D each); masked elements inside computed blocks count, as the tensor cores do them.
- Bytes: the least HBM traffic the problem needs, Q, K and V read once and O written once. A
  kernel whose tiles re-read K/V from L2 moves more through the caches, not through HBM.
- Ceilings: the dense bf16 matmul rate (``torch.matmul`` of n x n by n x n) and the copy rate
  (device-to-device, bytes read plus written), timed on the device itself.

The fraction of each ceiling a kernel reaches says what bounds it: the larger one is the nearer
wall. Attention at these sizes does hundreds of FLOPs per byte, far above the ridge point
(ceiling TFLOP/s / TB/s), so a kernel well below the matmul ceiling is losing time elsewhere
(softmax, pipeline bubbles, tails), not to memory. Imports only torch (and Triton to time).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

__all__ = ["attention_flops", "min_hbm_bytes", "limits", "matmul_ceiling_tflops", "copy_bandwidth_tbps",
           "measure_ceilings"]


def attention_flops(computed_elements: int, head_dim: int) -> int:
    """FLOPs of the two matmuls over ``computed_elements`` (query, key) pairs, all heads counted."""
    if computed_elements < 0 or head_dim <= 0:
        raise ValueError(f"need computed_elements >= 0 and head_dim > 0, got {computed_elements}, {head_dim}")
    return 4 * head_dim * computed_elements


def min_hbm_bytes(batch: int, heads_q: int, heads_kv: int, seq_q: int, seq_k: int, head_dim: int,
                  element_size: int) -> int:
    """Q and O over the query heads, K and V over the K/V heads, each moved once."""
    if min(batch, heads_q, heads_kv, seq_q, seq_k, head_dim, element_size) <= 0:
        raise ValueError("every size must be positive")
    return element_size * head_dim * batch * (2 * heads_q * seq_q + 2 * heads_kv * seq_k)


def limits(flops: int, hbm_bytes: int, seconds: float, ceilings: dict[str, float]) -> dict[str, Any]:
    """Achieved rates and their fractions of the ceilings (``matmul_tflops``, ``copy_tbps``),
    the arithmetic intensity against the ridge point, and which ceiling is nearer."""
    if seconds <= 0:
        raise ValueError(f"time must be positive, got {seconds}")
    tflops = flops / seconds / 1e12
    tbps = hbm_bytes / seconds / 1e12
    of_matmul = tflops / ceilings["matmul_tflops"]
    of_hbm = tbps / ceilings["copy_tbps"]
    intensity = flops / hbm_bytes if hbm_bytes else float("inf")
    ridge = ceilings["matmul_tflops"] / ceilings["copy_tbps"]
    bound = "compute" if intensity >= ridge else "memory"
    return {
        "tflops": round(tflops, 1), "fraction_of_matmul": round(of_matmul, 3),
        "min_tbps": round(tbps, 3), "fraction_of_hbm": round(of_hbm, 3),
        "flops_per_byte": round(intensity, 1), "ridge_flops_per_byte": round(ridge, 1), "bound": bound,
    }


def median_spread(times: Sequence[float]) -> tuple[float, float]:
    """The median of repeated timings and their spread, (max - min) / median (0 for a zero median):
    what every benchmark here reports for its repeats."""
    ordered = sorted(times)
    median = ordered[len(ordered) // 2]
    return median, (ordered[-1] - ordered[0]) / median if median > 0 else 0.0


def _time_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Median time of ``fn`` in ms (triton's do_bench on a GPU; one plain call on a CPU, where
    the number is a smoke value, not a measurement)."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=150, return_mode="median"))


def matmul_ceiling_tflops(device: torch.device, n: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """Dense matmul rate, n x n by n x n, in TFLOP/s: what the matrix units do on this device."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = _time_ms(lambda: torch.matmul(a, b), device)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def copy_bandwidth_tbps(device: torch.device, elements: int = 2**30) -> float:
    """Device-to-device copy of ``elements`` fp16 values: bytes read plus written per second, TB/s."""
    src = torch.empty(elements, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), device)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e12


def measure_ceilings(device: torch.device, *, matmul_n: int = 8192, copy_elements: int = 2**30) -> dict[str, float]:
    """Both ceilings, measured now on ``device`` (4 significant digits)."""
    return {"matmul_tflops": float(f"{matmul_ceiling_tflops(device, matmul_n):.4g}"),
            "copy_tbps": float(f"{copy_bandwidth_tbps(device, copy_elements):.4g}")}
