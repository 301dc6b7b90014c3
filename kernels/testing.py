"""Inputs and the kernel-vs-reference error rule, shared by tests, property tests and benchmarks.

The rule is flash-attention's (tests/test_flash_attn.py there): the kernel's max abs error
against a high-precision reference may be at most twice the error of the plain PyTorch
implementation computed in the same low precision, plus a rounding floor (the rounding error of
values of the output's magnitude in that dtype).
"""
from __future__ import annotations

import dataclasses

import torch

from .layout import BlockLayout
from .reference import reference_attention

__all__ = ["random_qkv", "KernelCheck", "KernelReference", "kernel_reference", "check_kernel_output", "ERROR_FACTOR", "LSE_TOLERANCE"]

# flash-attention's factor: the kernel may be at most 2x as far from the truth as PyTorch in
# the same precision.
ERROR_FACTOR = 2.0
# LSE comes from fp32 accumulation of exact (or fp32) products, the same in every dtype; an
# error above this means wrong mathematics, not rounding (measured: <= 1.1e-6 on the test cases).
LSE_TOLERANCE = 1e-4


def random_qkv(batch: int, heads_q: int, heads_kv: int, seq_q: int, seq_k: int, head_dim: int,
               dtype: torch.dtype, seed: int, device: torch.device | str = "cpu"):
    """q [B, Hq, Sq, D], k and v [B, Hkv, Sk, D]: a pure function of the arguments.

    Drawn on the CPU with a seeded generator (GPU generators differ between vendors), then moved.
    """
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads_q, seq_q, head_dim, generator=gen, dtype=torch.float32)
    k = torch.randn(batch, heads_kv, seq_k, head_dim, generator=gen, dtype=torch.float32)
    v = torch.randn(batch, heads_kv, seq_k, head_dim, generator=gen, dtype=torch.float32)
    return tuple(t.to(dtype).to(device) for t in (q, k, v))


@dataclasses.dataclass(frozen=True)
class KernelCheck:
    kernel_error: float  # max |kernel - fp64 reference|
    same_precision_error: float  # max |PyTorch in the input dtype - fp64 reference|
    rounding_floor: float
    bound: float
    lse_error: float  # max |kernel LSE - fp64 LSE| over rows that see a key
    empty_rows_agree: bool  # kernel LSE is -inf exactly where the reference's is
    nonfinite_outputs: int  # NaN/Inf count in the kernel's output (must be 0)

    @property
    def passed(self) -> bool:
        return (self.kernel_error <= self.bound and self.empty_rows_agree and self.nonfinite_outputs == 0
                and self.lse_error <= LSE_TOLERANCE)

    def __str__(self) -> str:
        return (f"kernel max abs err {self.kernel_error:.3e} vs bound {self.bound:.3e} "
                f"(= {ERROR_FACTOR} x same-precision {self.same_precision_error:.3e} + floor "
                f"{self.rounding_floor:.3e}); LSE err {self.lse_error:.3e}; empty rows agree "
                f"{self.empty_rows_agree}; non-finite outputs {self.nonfinite_outputs}")


def _exp_argument_floor(q, k, v, sm_scale) -> float:
    """Error from rounding the fp32 exponent argument, which a flash kernel cannot avoid.

    The kernel evaluates exp2(s * scale * log2(e) - m) in fp32; the argument carries an absolute
    rounding error of about eps32 * (|s| + |m|) <= 2 eps32 max|s| (in natural-log units), so each
    probability has that relative error and the output, a weighted mean of v, up to
    2 eps32 max|s| max|v|. A single-pass PyTorch softmax rounds once, so in fp32, where nothing
    else dominates, the kernel's error can exceed 2x PyTorch's by about this much (measured
    1.6e-6 against 2 x 5.7e-7 on a [2, 3, 96, 32] fp32 case). For fp16/bf16 it is negligible.
    """
    if q.numel() == 0 or k.numel() == 0:
        return 0.0
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    batch, heads_kv = k.shape[:2]
    # the query heads of one K/V head stacked as rows (GQA) rather than K repeated per query head
    stacked = q.double().reshape(batch, heads_kv, -1, q.shape[-1])
    scores = torch.matmul(stacked, k.double().transpose(-1, -2))
    eps32 = torch.finfo(torch.float32).eps
    return float(2 * eps32 * scores.abs().max() * abs(scale) * v.double().abs().max())


@dataclasses.dataclass(frozen=True)
class KernelReference:
    """What the rule needs from the references, computed once for one set of inputs."""
    truth: torch.Tensor  # fp64 output
    truth_lse: torch.Tensor  # fp64 LSE
    same_precision_error: float
    floor: float  # rounding floor in the output's dtype, plus the exp-argument floor


def kernel_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout, *,
                     out_dtype: torch.dtype | None = None, sm_scale: float | None = None) -> KernelReference:
    """The fp64 and same-precision references of one input set, for judging several kernel
    results (e.g. every split count of a decode call) without recomputing them."""
    cpu = torch.device("cpu")
    qc, kc, vc = (t.to(cpu) for t in (q, k, v))
    layout = layout.to(cpu)
    truth, truth_lse = reference_attention(qc, kc, vc, layout, sm_scale=sm_scale, return_lse=True,
                                           precision="fp64")
    same = reference_attention(qc, kc, vc, layout, sm_scale=sm_scale, precision="same")
    empty = truth.numel() == 0
    same_error = 0.0 if empty else float((same.double() - truth).abs().max())
    # Rounding error of numbers of the output's magnitude in this dtype (flash-attention's
    # `(out_ref + 0.3 - 0.3 - out_ref).abs().max()`).
    floor_probe = truth.to(out_dtype or q.dtype)
    floor = 0.0 if empty else float(((floor_probe + 0.3) - 0.3 - floor_probe).abs().max())
    floor += _exp_argument_floor(qc, kc, vc, sm_scale)
    return KernelReference(truth, truth_lse, same_error, floor)


def check_kernel_output(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, layout: BlockLayout, *, sm_scale: float | None = None,
                        reference: KernelReference | None = None) -> KernelCheck:
    """Judge a kernel result against the fp64 reference by the flash-attention rule
    (``reference``: one computed beforehand by `kernel_reference` for these inputs)."""
    ref = reference or kernel_reference(q, k, v, layout, out_dtype=out.dtype, sm_scale=sm_scale)
    cpu = torch.device("cpu")
    out64 = out.to(cpu, torch.float64)
    kernel_error = float((out64 - ref.truth).abs().max()) if out.numel() else 0.0
    lse_cpu = lse.to(cpu, torch.float64)
    seen = torch.isfinite(ref.truth_lse)
    lse_error = float((lse_cpu[seen] - ref.truth_lse[seen]).abs().max()) if seen.any() else 0.0
    return KernelCheck(
        kernel_error=kernel_error,
        same_precision_error=ref.same_precision_error,
        rounding_floor=ref.floor,
        bound=ERROR_FACTOR * ref.same_precision_error + ref.floor,
        lse_error=lse_error,
        empty_rows_agree=bool(torch.equal(torch.isneginf(lse_cpu), torch.isneginf(ref.truth_lse))),
        nonfinite_outputs=int((~torch.isfinite(out)).sum()),
    )
