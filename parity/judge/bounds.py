"""Forward rounding-error bounds of known ops, element by element, derived from their inputs and dtypes.

Pure functions: inputs in, a :class:`Bound` out (two float64 tensors of the output's shape). Each
bound covers *one op's own rounding given its inputs*: how far a correct implementation's output,
computed from exactly these inputs, may lie from the exact result. It says nothing about error
the inputs already carry (parity/NUMERICS.md, section 9, states every bound with its source):

- ``det``: the deterministic worst case, valid for any summation order, blocking, FMA use or
  matrix unit (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., eq. 3.4 and
  lemma 3.1): ``|fl(x.y) - x.y| <= gamma_K |x|.|y|`` with ``gamma_K = K u / (1 - K u)``. An error
  beyond it (by more than the report's slack) is not rounding.
- ``prob``: the probabilistic bound of Higham and Mary ("A new approach to probabilistic rounding
  error analysis", SIAM J. Sci. Comput. 41(5), 2019, theorem 3.1): ``gamma~_K(lam) |x|.|y|`` with
  ``gamma~_K(lam) = exp(lam sqrt(K) u + K u^2 / (1 - u)) - 1``, which holds with probability at
  least ``1 - 2K exp(-lam^2 (1 - u)^2 / 2)`` when the rounding errors are independent and of mean
  zero. ``lam = 6`` (hipDNN's constant, ROCm/rocm-libraries PR 4069). What rounding usually does;
  informational (never flagged): it can be exceeded by structured data (stagnation).

``u`` is the unit roundoff of the arithmetic: the accumulation dtype (fp32 for fp16, bf16 and
fp32 inputs, as matrix units and torch's CPU kernels accumulate; fp64 for fp64), plus one rounding
``u_out |y|`` where the output is stored in a coarser dtype. Transcendental functions (exp,
rsqrt, tanh) are taken to be accurate to ``TRANSCENDENTAL_U`` units of roundoff. Bounds are first
order in ``u`` (second-order terms are below the fp64 rounding of the bound itself); an fp32 dot
product under TF32 is not covered (its inputs are rounded to 10 mantissa bits: the fingerprint
says when a host allowed it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from parity.base.dtypes import accumulation_dtype
from parity.judge.metrics import json_safe_float

# exp, exp2, rsqrt and tanh in CUDA's and ROCm's fp32 libraries are accurate to 2 ulps (4 u);
# fast-math approximations (__expf, ex2.approx) to a few more: 8 u (4 ulps) covers both.
TRANSCENDENTAL_U = 8.0
# Higham and Mary's lambda; hipDNN's 6 sqrt(n) eps uses the same constant.
PROBABILISTIC_LAMBDA = 6.0


@dataclass(frozen=True)
class Bound:
    """Element-wise bounds of ``|computed - exact|`` for one op's output (float64, its shape).

    ``op``: what was bounded (``linear K=64``, ``attention D=64 keys<=1000``); ``k``: the longest
    reduction the bound depends on (1 for element-wise ops)."""

    op: str
    det: torch.Tensor
    prob: torch.Tensor
    k: int = 1


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u``: half the distance from 1 to the next number (2^-24 for fp32, 2^-8 for bf16)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int | torch.Tensor, u: float):
    """Higham's ``gamma_n = n u / (1 - n u)`` (a tensor of ``n`` gives a tensor); inf where ``n u >= 1``."""
    if isinstance(n, torch.Tensor):
        nu = n.to(torch.float64) * u
        return torch.where(nu < 1, nu / (1 - nu), torch.full_like(nu, math.inf))
    nu = n * u
    return nu / (1 - nu) if nu < 1 else math.inf


def gamma_prob(n: int | torch.Tensor, u: float, lam: float = PROBABILISTIC_LAMBDA):
    """Higham and Mary's ``gamma~_n(lam) = exp(lam sqrt(n) u + n u^2 / (1 - u)) - 1``."""
    if isinstance(n, torch.Tensor):
        n = n.to(torch.float64)
        return torch.expm1(lam * torch.sqrt(n) * u + n * u * u / (1 - u))
    return math.expm1(lam * math.sqrt(n) * u + n * u * u / (1 - u))


def _units(input_dtype: torch.dtype, out_dtype: torch.dtype) -> tuple[float, float]:
    """``(u_acc, u_out)``: the accumulation's unit roundoff, and the output rounding's (0 where the
    output is stored in the accumulation dtype or a finer one: no extra rounding)."""
    acc = accumulation_dtype(input_dtype)
    u_acc = unit_roundoff(acc)
    u_out = unit_roundoff(out_dtype)
    return u_acc, (u_out if u_out > u_acc else 0.0)


def _stored(exact: torch.Tensor, det: torch.Tensor, prob: torch.Tensor, u_out: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Adds the final rounding to the output dtype: ``u_out |computed|`` <= ``u_out (|y| + bound)``."""
    if u_out == 0.0:
        return det, prob
    magnitude = exact.abs()
    return det + u_out * (magnitude + det), prob + u_out * (magnitude + prob)


def linear_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 out_dtype: torch.dtype | None = None) -> Bound:
    """``y = x W^T + b`` (nn.Linear; a matmul with ``bias`` None): x [..., K], W [N, K], b [N].

    Each output is a dot product of length K (K + 1 with the bias, one more term):
    ``gamma_{K'} (|x| |W|^T + |b|)``, plus the output rounding.
    """
    out_dtype = out_dtype or x.dtype
    u_acc, u_out = _units(x.dtype, out_dtype)
    x64, w64 = x.to(torch.float64), weight.to(torch.float64)
    exact = x64 @ w64.T
    magnitude = x64.abs() @ w64.abs().T
    k = weight.shape[-1]
    if bias is not None:
        b64 = bias.to(torch.float64)
        exact = exact + b64
        magnitude = magnitude + b64.abs()
        k += 1
    det, prob = _stored(exact, gamma(k, u_acc) * magnitude, gamma_prob(k, u_acc) * magnitude, u_out)
    return Bound(f"linear K={weight.shape[-1]}", det, prob, k)


def matmul_bound(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> Bound:
    """``a @ b`` (batched as torch.matmul): ``gamma_K |a| |b|`` with K = a's last dimension."""
    out_dtype = out_dtype or a.dtype
    u_acc, u_out = _units(a.dtype, out_dtype)
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    exact, magnitude = a64 @ b64, a64.abs() @ b64.abs()
    k = a.shape[-1]
    det, prob = _stored(exact, gamma(k, u_acc) * magnitude, gamma_prob(k, u_acc) * magnitude, u_out)
    return Bound(f"matmul K={k}", det, prob, k)


def sum_bound(x: torch.Tensor, dim: int = -1, *, out_dtype: torch.dtype | None = None) -> Bound:
    """``x.sum(dim)``: ``gamma_{n-1} sum |x|`` (n - 1 additions; exact for n = 1)."""
    out_dtype = out_dtype or x.dtype
    u_acc, u_out = _units(x.dtype, out_dtype)
    x64 = x.to(torch.float64)
    n = x.shape[dim]
    magnitude = x64.abs().sum(dim)
    det, prob = _stored(x64.sum(dim), gamma(n - 1, u_acc) * magnitude, gamma_prob(max(n - 1, 0), u_acc) * magnitude,
                        u_out)
    return Bound(f"sum n={n}", det, prob, n)


def add_bound(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> Bound:
    """``a + b`` (a residual add): one rounding, ``u |a + b|`` in the output dtype (the sum is
    rounded once, wherever it is computed)."""
    out_dtype = out_dtype or torch.promote_types(a.dtype, b.dtype)
    exact = a.to(torch.float64) + b.to(torch.float64)
    det = unit_roundoff(out_dtype) * exact.abs()
    return Bound("add", det, det, 2)


# Element-wise activations: the relative error of the function itself, in units of u of the
# arithmetic, and whether the bound is relative to |y| or (through a cancellation, GELU's
# 1 + tanh) to |x|.
_ACTIVATIONS = {
    "relu": 0.0,  # max(x, 0) is exact
    "silu": TRANSCENDENTAL_U + 3,  # x * (1 / (1 + exp(-x))): exp, add, divide, multiply
    "sigmoid": TRANSCENDENTAL_U + 2,
    "tanh": TRANSCENDENTAL_U,
    "gelu": TRANSCENDENTAL_U + 6,  # relative to |x|: erf/tanh then 0.5 x (1 + t) cancels for x < 0
}


def activation_bound(name: str, x: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> Bound:
    """Element-wise ``name`` (one of ``relu silu sigmoid tanh gelu``) of ``x``: ``c u |y|`` (``c u
    |x|`` for gelu), plus the output rounding (none for relu, whose output is one of its inputs)."""
    out_dtype = out_dtype or x.dtype
    u_acc, u_out = _units(x.dtype, out_dtype)
    x64 = x.to(torch.float64)
    exact = {"relu": torch.relu, "silu": torch.nn.functional.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
             "gelu": torch.nn.functional.gelu}[name](x64)
    scale = x64.abs() if name == "gelu" else exact.abs()
    det = _ACTIVATIONS[name] * u_acc * scale
    if name == "relu" and out_dtype == x.dtype:
        return Bound(name, det, det)
    det, prob = _stored(exact, det, det, u_out)
    return Bound(name, det, prob)


def rms_norm_bound(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                   out_dtype: torch.dtype | None = None) -> Bound:
    """``x / sqrt(mean(x^2) + eps) * w`` over the last dimension (n): relative error
    ``gamma_{n+1} / 2`` (the mean of squares: all terms positive, so relative) ``+ (c + 3) u`` (eps,
    rsqrt, the products), plus two output roundings (normalised, then times the weight)."""
    out_dtype = out_dtype or x.dtype
    u_acc, _ = _units(x.dtype, out_dtype)
    u_out = unit_roundoff(out_dtype)
    x64 = x.to(torch.float64)
    n = x.shape[-1]
    exact = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        exact = exact * weight.to(torch.float64)
    magnitude = exact.abs()
    det = (gamma(n + 1, u_acc) / 2 + (TRANSCENDENTAL_U + 3) * u_acc) * magnitude
    prob = (gamma_prob(n + 1, u_acc) / 2 + (TRANSCENDENTAL_U + 3) * u_acc) * magnitude
    extra = 2 * u_out if u_out > u_acc else 0.0
    return Bound(f"rmsnorm n={n}", det + extra * (magnitude + det), prob + extra * (magnitude + prob), n)


def layer_norm_bound(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, *,
                     out_dtype: torch.dtype | None = None) -> Bound:
    """``(x - mean) / sqrt(var + eps) * w + b`` over the last dimension (n).

    The mean's error ``gamma_n mean|x|`` shifts every centred value; the variance (a mean of
    squares, all terms positive) has relative error ``gamma_{n+2}`` plus what the mean's error does
    to it (``2 d_mu mean|x - mu| / var``); rsqrt halves that and adds ``c u``. Then
    ``|w| s (|x - mu| (r_s + 2u) + d_mu) + u (|y| + |b|)`` and two output roundings.
    """
    out_dtype = out_dtype or x.dtype
    u_acc, _ = _units(x.dtype, out_dtype)
    u_out = unit_roundoff(out_dtype)
    x64 = x.to(torch.float64)
    n = x.shape[-1]
    mean = x64.mean(-1, keepdim=True)
    centred = x64 - mean
    var = centred.pow(2).mean(-1, keepdim=True)
    s = torch.rsqrt(var + eps)
    w64 = torch.ones((), dtype=torch.float64) if weight is None else weight.to(torch.float64)
    b64 = torch.zeros((), dtype=torch.float64) if bias is None else bias.to(torch.float64)
    exact = centred * s * w64 + b64

    def bound(g):
        d_mu = g(n, u_acc) * x64.abs().mean(-1, keepdim=True)
        r_var = g(n + 2, u_acc) + 2 * d_mu * centred.abs().mean(-1, keepdim=True) / (var + eps)
        r_s = r_var / 2 + TRANSCENDENTAL_U * u_acc
        inner = w64.abs() * s * (centred.abs() * (r_s + 2 * u_acc) + d_mu)
        return inner + u_acc * (exact.abs() + b64.abs())

    det, prob = bound(gamma), bound(gamma_prob)
    extra = 2 * u_out if u_out > u_acc else 0.0
    magnitude = exact.abs()
    return Bound(f"layernorm n={n}", det + extra * (magnitude + det), prob + extra * (magnitude + prob), n)


def softmax_bound(x: torch.Tensor, dim: int = -1, *, out_dtype: torch.dtype | None = None) -> Bound:
    """``softmax(x)``: each ``p_i = exp(x_i - m)`` has relative error ``u |x_i - m| + c u``
    (the subtraction, then exp); the normaliser a sum of n positive terms (``gamma_{n-1}``, and the
    largest of those relative errors); one division; the output rounding."""
    out_dtype = out_dtype or x.dtype
    u_acc, u_out = _units(x.dtype, out_dtype)
    x64 = x.to(torch.float64)
    n = x.shape[dim]
    exact = torch.softmax(x64, dim)
    rel_p = u_acc * (x64 - x64.amax(dim, keepdim=True)).abs() + TRANSCENDENTAL_U * u_acc
    rel_p = torch.where(exact > 0, rel_p, torch.zeros_like(rel_p))  # exp underflows to an exact 0

    def bound(g):
        return exact * (rel_p + rel_p.amax(dim, keepdim=True) + g(max(n - 1, 0), u_acc) + u_acc)

    det, prob = _stored(exact, bound(gamma), bound(gamma_prob), u_out)
    return Bound(f"softmax n={n}", det, prob, n)


def attention_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None = None, *,
                    scale: float | None = None, out_dtype: torch.dtype | None = None,
                    chunk_rows: int = 256) -> Bound:
    """Attention's output ``softmax(scale q k^T, masked) v``; q [B, Hq, Sq, D], k, v [B, Hkv, Sk, D]
    (GQA: query head h reads key/value head h // (Hq / Hkv)); ``visible`` a boolean mask that
    broadcasts to [B, Hq, Sq, Sk] (None: every key); a row that sees no key is 0 (exact).

    Per query row i with N_i visible keys and weights w_ij (fp64):

    - the scores ``s_ij``: ``gamma_D scale |q_i|.|k_j|`` from QK^T (K = D), plus ``3 u |s_ij|`` (the
      scale, and its log2(e) fold where exp2 is used);
    - each weight's relative error ``e_ij`` = that score error + ``u |s_ij - m_i|`` (subtracting
      the max) + ``c u`` (exp). The normaliser uses the same values, so they perturb the output by
      ``sum_j w_ij e_ij (v_j - o_i)``, bounded by ``sum_j w_ij e_ij (|v_j| + |o_i|)``;
    - the PV product and the normaliser are sums of N_i terms, each rescaled once per key block of
      the online softmax (at most N_i rescales, each one rounding; the rescale factor's own error
      multiplies both and cancels): ``gamma_{2 N_i}`` of ``sum_j w_ij |v_j|`` and of ``|o_i|``;
    - P rounded to V's dtype before PV where V is a 16-bit type: ``u_v sum_j w_ij |v_j|``;
    - the division and the output rounding: ``(u + u_out) |o_i|``.
    """
    out_dtype = out_dtype or q.dtype
    u_acc, u_out = _units(q.dtype, out_dtype)
    u_p = unit_roundoff(v.dtype) if unit_roundoff(v.dtype) > u_acc else 0.0
    batch, heads_q, seq_q, head_dim = q.shape
    group = heads_q // k.shape[1]
    scale = head_dim ** -0.5 if scale is None else scale
    q64 = q.to(torch.float64)
    k64 = k.to(torch.float64).repeat_interleave(group, dim=1)
    v64 = v.to(torch.float64).repeat_interleave(group, dim=1)
    det = torch.empty(batch, heads_q, seq_q, head_dim, dtype=torch.float64, device=q.device)
    prob = torch.empty_like(det)
    longest = 0
    for start in range(0, seq_q, chunk_rows):
        stop = min(seq_q, start + chunk_rows)
        qc = q64[:, :, start:stop]
        scores = scale * (qc @ k64.transpose(-1, -2))
        score_mag = scale * (qc.abs() @ k64.abs().transpose(-1, -2))
        if visible is None:
            seen = torch.ones_like(scores, dtype=torch.bool)
        else:
            seen = visible[..., start:stop, :].expand_as(scores)
        masked = scores.masked_fill(~seen, -math.inf)
        row_max = masked.amax(-1, keepdim=True)
        empty = torch.isneginf(row_max)
        row_max = torch.where(empty, torch.zeros_like(row_max), row_max)
        weights = torch.exp(masked - row_max)
        weights = weights / torch.where(empty, torch.ones_like(row_max), weights.sum(-1, keepdim=True))
        out = weights @ v64
        keys = seen.sum(-1, keepdim=True)
        longest = max(longest, int(keys.max()) if keys.numel() else 0)
        gathered = weights @ v64.abs()
        spread = u_acc * (scores - row_max).abs() + TRANSCENDENTAL_U * u_acc + 3 * u_acc * scores.abs()
        for g, target in ((gamma, det), (gamma_prob, prob)):
            rel = torch.where(seen, g(head_dim, u_acc) * score_mag + spread, torch.zeros_like(scores))
            weighted = weights * rel
            perturbation = weighted @ v64.abs() + weighted.sum(-1, keepdim=True) * out.abs()
            accumulation = g(2 * keys, u_acc)
            value = (perturbation + (accumulation + u_p) * gathered
                     + (accumulation + u_acc) * out.abs())
            value = torch.where(empty, torch.zeros_like(value), value)
            target[:, :, start:stop] = value if u_out == 0 else value + u_out * (out.abs() + value)
    return Bound(f"attention D={head_dim} keys<={longest}", det, prob, max(head_dim, longest))


# A tensor is named "beyond derived bound" when its measured error exceeds the derived one by more
# than this factor. The deterministic bound is a worst case, so a correct op stays below 1; the
# slack covers what the bound assumes rather than proves (the accuracy of exp/rsqrt/tanh taken as
# TRANSCENDENTAL_U, first-order terms). Measured benign ratios (tests/test_judge_bounds.py, CPU):
# at most 0.99 for one side against fp64 (bf16 outputs, where the final rounding is the bound),
# so at most about 0.5 for two sides against each other.
BEYOND_SLACK = 1.5


@dataclass(frozen=True)
class BoundCheck:
    """A tensor's measured error against its derived bound.

    ``sides``: how many roundings of the op lie between the two tensors compared: 2 for this
    host's replay against the golden (each computed from the same inputs, each within ``det`` of
    the exact result), 1 for a tensor against the exact (fp64) result. ``ratio`` is
    ``max_i |out_i - ref_i| / (sides * det_i)`` over the elements finite on both sides (inf where
    ``det_i`` is 0 and the tensors differ); ``probable_ratio`` the same with ``prob``.
    ``worst_index``: the element of the largest ratio. ``beyond``: ``ratio > slack``.
    """

    op: str
    k: int
    sides: int
    ratio: float
    probable_ratio: float
    derived_max: float
    worst_index: tuple[int, ...] | None
    slack: float = BEYOND_SLACK

    @property
    def beyond(self) -> bool:
        return self.ratio > self.slack

    def to_dict(self) -> dict:
        """JSON-safe (non-finite ratios as "inf"/"nan", parity.base.jsonformat)."""
        number = json_safe_float
        return {"op": self.op, "k": self.k, "sides": self.sides, "measured_over_derived": number(self.ratio),
                "measured_over_probable": number(self.probable_ratio), "derived_max": number(self.derived_max),
                "worst_index": None if self.worst_index is None else list(self.worst_index),
                "slack": self.slack, "beyond": self.beyond}

    @classmethod
    def from_dict(cls, data: dict) -> "BoundCheck":
        index = data.get("worst_index")
        return cls(op=data["op"], k=int(data["k"]), sides=int(data["sides"]),
                   ratio=float(data["measured_over_derived"]), probable_ratio=float(data["measured_over_probable"]),
                   derived_max=float(data["derived_max"]), worst_index=None if index is None else tuple(index),
                   slack=float(data.get("slack", BEYOND_SLACK)))


def _ratio(error: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    # 0/0 (an exact element on an exact bound) is 0; d/0 is inf: no multiple of 0 covers an error.
    return torch.where(error == 0, torch.zeros_like(error), error / bound)


def check_bound(out: torch.Tensor, ref: torch.Tensor, bound: Bound, *, sides: int = 2) -> BoundCheck:
    """``out`` against ``ref`` measured in units of ``sides x`` the bound (:class:`BoundCheck`).
    Raises ValueError where the shapes differ."""
    if tuple(out.shape) != tuple(ref.shape) or tuple(out.shape) != tuple(bound.det.shape):
        raise ValueError(f"bound of shape {tuple(bound.det.shape)} for tensors of shapes {tuple(out.shape)} "
                         f"and {tuple(ref.shape)}")
    out64, ref64 = out.to(torch.float64).reshape(-1), ref.to(bound.det.device, torch.float64).reshape(-1)
    out64 = out64.to(bound.det.device)
    finite = torch.isfinite(out64) & torch.isfinite(ref64)
    error = torch.where(finite, (out64 - ref64).abs(), torch.zeros_like(out64))
    det, prob = bound.det.reshape(-1) * sides, bound.prob.reshape(-1) * sides
    ratios = _ratio(error, det)
    worst = int(ratios.argmax()) if ratios.numel() else -1
    ratio = float(ratios[worst]) if worst >= 0 else 0.0
    probable = float(_ratio(error, prob).max()) if ratios.numel() else 0.0
    index = None
    if worst >= 0 and ratio > 0:
        index, flat = [], worst
        for size in reversed(tuple(out.shape)):
            flat, position = divmod(flat, size)
            index.append(position)
        index = tuple(reversed(index))
    derived_max = float(det.max()) if det.numel() else 0.0
    return BoundCheck(bound.op, bound.k, sides, ratio, probable, derived_max, index)
