"""Per-layer error metrics of this host's output against a golden, computed in chunks on the tensors' device.

Pure functions: no printing, no asserts, no pass/fail decisions (that is ``parity.policy``).

Conventions (the report and the policy rely on them):

- ``out`` is this host's tensor, ``ref`` the golden (or a high-precision reference). The
  difference is ``d = out - ref``; every error is two-sided (``|d|``).
- NaN/Inf are counted on each side and their positions compared: NaN against NaN agrees, +Inf
  against +Inf and -Inf against -Inf agree, anything else at a position where either side is not
  finite is a non-finite disagreement. Every other statistic (cosine, errors, mismatch, ULP, the
  worst element) is computed over the positions where *both* sides are finite;
  ``finite_count`` says how many that is and is the denominator of ``mean_abs`` and
  ``mismatch_fraction``.
- Cosine similarity: two vectors that are identical (including both all-zero or both empty) have
  cosine 1.0; an all-zero vector against a non-zero one has cosine 0.0 (there is no direction to
  agree with, and a kernel that writes zeros must not look perfect).
- Relative L2 error ``||d|| / ||ref||``: 0.0 when both are zero, ``inf`` when ``ref`` is zero and
  ``out`` is not.
- Max relative error ``max |d| / max(|ref|, rel_floor)``: the floor keeps near-zero references
  from dividing by zero; the floor used is recorded.
- Mismatch: an element is outside the tolerance when ``|d| > A + rtol * |ref|`` (the
  ``torch.isclose`` convention), where the absolute term ``A = atol + atol_rms * ref_rms`` may
  scale with the reference's RMS (over its finite elements): benign error near zero is
  proportional to the tensor's typical magnitude, not to the element's, so one absolute atol
  cannot suit a tensor of RMS 0.1 and one of RMS 2. ``A`` is recorded as ``effective_atol``.
  Integer and bool tensors are compared exactly (``out != ref``); the tolerances do not apply.
- Outliers: an element's *bound ratio* is ``|d| / (A + rtol * |ref|)``, how many times its own
  mismatch bound its error is (``inf`` where the bound is 0 and ``|d| > 0``). With
  ``outlier_factor`` set, ``outlier_count`` counts the elements whose ratio exceeds it; the
  element with the largest ratio is recorded (``worst_bound_*``) whether or not a factor is set.
  Integer and bool tensors have no outliers (they are compared exactly).
- "Smallest tolerance that would have passed": ``needed_atol`` is the smallest absolute term
  ``A`` for which no element mismatches at the given rtol (``max(|d| - rtol*|ref|)``, at least 0);
  ``needed_rtol`` is the smallest rtol for the given ``A`` (``max((|d| - A) / |ref|)`` over
  elements with ``|d| > A``, at least 0; ``inf`` if such an element has ``ref == 0``). Exact up to
  float64 rounding of the bound itself.
- ULP distance (fp16 and bf16 only, when both sides have the same dtype): the distance between the
  16-bit patterns on the sign-magnitude number line, so adjacent representable values are 1 ULP
  apart, +0 and -0 are 0 apart, and the two smallest subnormals of opposite sign are 2 apart.
- Sums are accumulated in float64 on the tensors' device; inputs are cast chunk by chunk, so the
  extra memory is a small multiple (about a dozen float64 arrays) of one chunk, whatever the
  tensor size. ``ref`` is read twice (its RMS first, for the absolute term). Results depend on
  ``chunk_elements`` only through float64 rounding. A non-contiguous input is flattened with one
  copy; bundle tensors are contiguous.
- ``LayerMetrics.to_dict()`` is JSON-safe: non-finite floats become the strings ``"nan"``,
  ``"inf"`` and ``"-inf"`` (``float()`` reads them back), absent values are ``None``, indices are
  lists.
"""
from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass, fields

import torch

DEFAULT_CHUNK_ELEMENTS = 2**22
# Informational only (no default policy checks max_rel): small enough not to hide a relative
# error on a genuinely small reference, large enough that a reference of exactly 0 stays finite.
DEFAULT_REL_FLOOR = 1e-6

SIXTEEN_BIT_FLOATS = (torch.float16, torch.bfloat16)


def json_safe_float(value: float | None) -> float | str | None:
    """A float as JSON can carry it: non-finite values become "nan", "inf" or "-inf"."""
    if value is None:
        return None
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _float_from_json(value: float | str | None) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class LayerMetrics:
    """Errors of one recorded tensor (``out``) against its reference (``ref``); see the module docstring."""

    numel: int
    finite_count: int
    out_dtype: str
    ref_dtype: str
    cosine: float
    max_abs: float
    mean_abs: float
    rel_l2: float
    max_rel: float
    rel_floor: float
    ref_max_abs: float
    ref_rms: float
    atol: float
    atol_rms: float
    effective_atol: float
    rtol: float
    mismatch_count: int
    mismatch_fraction: float
    needed_atol: float
    needed_rtol: float
    ulp_max: int | None
    ulp_over_1_count: int | None
    nan_out: int
    nan_ref: int
    inf_out: int
    inf_ref: int
    nonfinite_mismatch_count: int
    first_nonfinite_mismatch_index: tuple[int, ...] | None
    worst_index: tuple[int, ...] | None
    worst_out: float | None
    worst_ref: float | None
    outlier_factor: float | None = None
    outlier_count: int = 0
    worst_bound_ratio: float = 0.0
    worst_bound_index: tuple[int, ...] | None = None
    worst_bound_out: float | None = None
    worst_bound_ref: float | None = None

    @property
    def nonfinite_positions_agree(self) -> bool:
        return self.nonfinite_mismatch_count == 0

    def to_dict(self) -> dict:
        """Plain JSON-safe values: ints, floats, "nan"/"inf"/"-inf" strings, None, lists."""
        result = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, float):
                value = json_safe_float(value)
            result[field.name] = value
        return result

    @classmethod
    def from_dict(cls, data: dict) -> "LayerMetrics":
        """Inverse of ``to_dict`` (reports and bundles store metrics as JSON)."""
        values = {}
        for field in fields(cls):
            if field.name not in data and field.default is not dataclasses.MISSING:
                continue  # a report written before the field existed
            value = data[field.name]
            if field.name in ("first_nonfinite_mismatch_index", "worst_index", "worst_bound_index"):
                value = None if value is None else tuple(int(i) for i in value)
            elif isinstance(value, (float, str)) and field.name not in ("out_dtype", "ref_dtype"):
                value = _float_from_json(value)
            values[field.name] = value
        return cls(**values)


def compute_metrics(
    out: torch.Tensor,
    ref: torch.Tensor,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    atol_rms: float = 0.0,
    rel_floor: float = DEFAULT_REL_FLOOR,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    outlier_factor: float | None = None,
) -> LayerMetrics:
    """Compare ``out`` (this host) with ``ref`` (the golden); both of the same shape, on one device.

    ``atol``, ``atol_rms`` and ``rtol`` define the mismatch count and the "needed" tolerances;
    pass the values of the policy that will judge the result (``parity.policy.measure`` does).
    ``outlier_factor``: count the elements whose error exceeds this many times their bound.
    Dtypes may differ (e.g. bf16 against an fp64 reference); ULP distances are then not computed.
    Raises ``ValueError`` for tensors that cannot be compared (different shapes or devices,
    complex dtypes) and for bad arguments.
    """
    _check_arguments(out, ref, atol, rtol, atol_rms, rel_floor, chunk_elements)
    if outlier_factor is not None and not (math.isfinite(outlier_factor) and outlier_factor >= 1):
        raise ValueError(f"outlier_factor must be finite and >= 1, got {outlier_factor!r}")
    shape = tuple(out.shape)
    out_flat = out.reshape(-1)
    ref_flat = ref.reshape(-1)
    numel = out_flat.numel()
    exact = not out.is_floating_point() and not ref.is_floating_point()
    with_ulp = out.dtype == ref.dtype and out.dtype in SIXTEEN_BIT_FLOATS

    ref_rms = _finite_rms(ref_flat, chunk_elements)  # a 0-dim device tensor: no synchronization
    effective_atol = atol + atol_rms * ref_rms
    acc = _Accumulators(out.device)
    for start in range(0, numel, chunk_elements):
        stop = min(start + chunk_elements, numel)
        acc.add_chunk(
            out_flat[start:stop], ref_flat[start:stop], start,
            absolute_term=effective_atol, rtol=rtol, rel_floor=rel_floor, exact=exact, with_ulp=with_ulp,
            outlier_factor=outlier_factor,
        )
    return acc.finish(
        out_flat, ref_flat, shape, out.dtype, ref.dtype,
        atol=atol, atol_rms=atol_rms, ref_rms=ref_rms, effective_atol=effective_atol, rtol=rtol,
        rel_floor=rel_floor, with_ulp=with_ulp, outlier_factor=outlier_factor,
    )


def compute_error_vs_reference(
    out: torch.Tensor, high_precision_ref: torch.Tensor, **kwargs
) -> LayerMetrics:
    """This host's error against a high-precision (typically fp64) reference of the same computation.

    The error-budget inputs: the capture host stores its own ``compute_error_vs_reference`` of the
    golden, this host computes its own, and the policy compares the two (numerics.md: the
    flash-attention rule). Same arguments and results as ``compute_metrics``; the reference must
    be a floating dtype at least as precise as ``out``.
    """
    if not high_precision_ref.is_floating_point() or (
        out.is_floating_point()
        and torch.finfo(high_precision_ref.dtype).eps > torch.finfo(out.dtype).eps
    ):
        raise ValueError(
            f"reference dtype {high_precision_ref.dtype} is less precise than {out.dtype}"
        )
    return compute_metrics(out, high_precision_ref, **kwargs)


def _check_arguments(out, ref, atol, rtol, atol_rms, rel_floor, chunk_elements) -> None:
    if not isinstance(out, torch.Tensor) or not isinstance(ref, torch.Tensor):
        raise TypeError("compute_metrics compares two torch.Tensor objects")
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: out {tuple(out.shape)} vs ref {tuple(ref.shape)}")
    if out.device != ref.device:
        raise ValueError(f"device mismatch: out on {out.device}, ref on {ref.device}")
    if out.is_complex() or ref.is_complex():
        raise ValueError("complex tensors are not supported")
    for name, value in (("atol", atol), ("rtol", rtol), ("atol_rms", atol_rms)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    if not (math.isfinite(rel_floor) and rel_floor > 0):
        raise ValueError(f"rel_floor must be finite and > 0, got {rel_floor!r}")
    if not (isinstance(chunk_elements, int) and chunk_elements >= 1):
        raise ValueError(f"chunk_elements must be a positive int, got {chunk_elements!r}")


def _finite_rms(flat: torch.Tensor, chunk_elements: int) -> torch.Tensor:
    """RMS of the finite elements (0 if there are none), accumulated in float64 on the device."""
    square_sum = torch.zeros((), dtype=torch.float64, device=flat.device)
    count = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), chunk_elements):
        values = flat[start : start + chunk_elements].to(torch.float64)
        finite = torch.isfinite(values)
        values = torch.where(finite, values, 0.0)
        square_sum += (values * values).sum()
        count += finite.sum()
    return torch.sqrt(square_sum / count.clamp_min(1))


def _ordered_bits(values16: torch.Tensor) -> torch.Tensor:
    """16-bit float patterns mapped to integers that are consecutive for adjacent floats.

    IEEE floats are sign-magnitude; the two's-complement view of a negative float runs backwards,
    so negative values are mapped to minus their magnitude bits (and -0 to 0, the same as +0).
    """
    bits = values16.view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


class _Accumulators:
    """Running float64/int64 totals kept on the device, so the chunk loop never synchronizes."""

    def __init__(self, device: torch.device):
        def f64(value=0.0):
            return torch.tensor(value, dtype=torch.float64, device=device)

        def i64(value=0):
            return torch.tensor(value, dtype=torch.int64, device=device)

        self.dot, self.out_sq, self.ref_sq, self.diff_sq, self.abs_sum = f64(), f64(), f64(), f64(), f64()
        self.max_abs, self.max_rel, self.ref_max_abs = f64(), f64(), f64()
        self.needed_atol, self.needed_rtol = f64(), f64()
        self.worst_abs, self.worst_flat = f64(-1.0), i64(-1)
        self.finite_count, self.mismatch_count = i64(), i64()
        self.nan_out, self.nan_ref, self.inf_out, self.inf_ref = i64(), i64(), i64(), i64()
        self.nonfinite_mismatch_count, self.first_nonfinite_mismatch = i64(), i64(-1)
        self.ulp_max, self.ulp_over_1_count = i64(), i64()
        self.outlier_count, self.worst_ratio, self.worst_ratio_flat = i64(), f64(0.0), i64(-1)

    def add_chunk(self, out_raw, ref_raw, start, *, absolute_term, rtol, rel_floor, exact, with_ulp,
                  outlier_factor=None):
        out = out_raw.to(torch.float64)
        ref = ref_raw.to(torch.float64)
        out_nan, ref_nan = torch.isnan(out), torch.isnan(ref)
        out_inf, ref_inf = torch.isinf(out), torch.isinf(ref)
        both_finite = ~(out_nan | out_inf | ref_nan | ref_inf)
        self.nan_out += out_nan.sum()
        self.nan_ref += ref_nan.sum()
        self.inf_out += out_inf.sum()
        self.inf_ref += ref_inf.sum()

        # Same-signed infinities compare equal, so `out == ref` settles the Inf cases.
        agree = both_finite | (out_nan & ref_nan) | (out_inf & (out == ref))
        disagree = ~agree
        del out_nan, ref_nan, out_inf, ref_inf, agree
        self.nonfinite_mismatch_count += disagree.sum()
        first_here = start + disagree.to(torch.uint8).argmax()  # argmax returns the first maximum
        self.first_nonfinite_mismatch = torch.where(
            (self.first_nonfinite_mismatch < 0) & disagree.any(), first_here, self.first_nonfinite_mismatch
        )
        del disagree

        # Zero the non-finite positions so they contribute nothing to any sum or maximum below.
        out = torch.where(both_finite, out, 0.0)
        ref = torch.where(both_finite, ref, 0.0)
        self.finite_count += both_finite.sum()
        self.dot += (out * ref).sum()
        self.out_sq += (out * out).sum()
        self.ref_sq += (ref * ref).sum()
        abs_diff = (out - ref).abs()
        ref_abs = ref.abs()
        del out, ref
        self.diff_sq += (abs_diff * abs_diff).sum()
        self.abs_sum += abs_diff.sum()
        self.max_abs = torch.maximum(self.max_abs, abs_diff.max())
        self.ref_max_abs = torch.maximum(self.ref_max_abs, ref_abs.max())
        self.max_rel = torch.maximum(self.max_rel, (abs_diff / ref_abs.clamp_min(rel_floor)).max())

        if exact:
            mismatch = both_finite & (out_raw != ref_raw)
        else:
            # zeroed (non-finite) positions never exceed an absolute term >= 0
            bound = absolute_term + rtol * ref_abs
            mismatch = abs_diff > bound
            # How many times its own bound each element's error is; 0/0 (an exact element on a
            # zero bound) is 0, d/0 is inf: no multiple of a zero bound forgives an error.
            ratio = torch.where(mismatch, abs_diff / bound, 0.0)
            if outlier_factor is not None:
                self.outlier_count += (ratio > outlier_factor).sum()
            chunk_ratio, chunk_ratio_at = ratio.max(dim=0)
            take = chunk_ratio > self.worst_ratio
            self.worst_ratio = torch.where(take, chunk_ratio, self.worst_ratio)
            self.worst_ratio_flat = torch.where(take, start + chunk_ratio_at, self.worst_ratio_flat)
            del bound, ratio
        self.mismatch_count += mismatch.sum()
        del mismatch
        self.needed_atol = torch.maximum(self.needed_atol, (abs_diff - rtol * ref_abs).max())
        excess = abs_diff - absolute_term
        # excess / 0 is inf where ref == 0: no rtol can cover an error on an exact-zero reference.
        rtol_each = torch.where(excess > 0, excess / ref_abs, 0.0)
        self.needed_rtol = torch.maximum(self.needed_rtol, rtol_each.max())
        del excess, rtol_each, ref_abs

        # -1 marks non-finite positions so they are never the worst finite element; the strict
        # ">" keeps the first occurrence across chunks, as max(dim) does within one.
        chunk_worst, chunk_worst_at = torch.where(both_finite, abs_diff, -1.0).max(dim=0)
        take = chunk_worst > self.worst_abs
        self.worst_abs = torch.where(take, chunk_worst, self.worst_abs)
        self.worst_flat = torch.where(take, start + chunk_worst_at, self.worst_flat)
        del abs_diff

        if with_ulp:
            ulp = (_ordered_bits(out_raw) - _ordered_bits(ref_raw)).abs()
            ulp = torch.where(both_finite, ulp, 0)
            self.ulp_max = torch.maximum(self.ulp_max, ulp.max().to(torch.int64))
            self.ulp_over_1_count += (ulp > 1).sum()

    def finish(self, out_flat, ref_flat, shape, out_dtype, ref_dtype, *,
               atol, atol_rms, ref_rms, effective_atol, rtol, rel_floor, with_ulp, outlier_factor=None):
        numel = out_flat.numel()
        finite_count = int(self.finite_count)
        dot, out_sq, ref_sq, diff_sq = (float(t) for t in (self.dot, self.out_sq, self.ref_sq, self.diff_sq))
        if diff_sq == 0.0:
            cosine = 1.0  # identical on every compared position, including both zero or empty
        elif out_sq == 0.0 or ref_sq == 0.0:
            cosine = 0.0
        else:
            product = out_sq * ref_sq
            norms = math.sqrt(product) if math.isfinite(product) else math.sqrt(out_sq) * math.sqrt(ref_sq)
            cosine = min(1.0, max(-1.0, dot / norms))
        if ref_sq == 0.0:
            rel_l2 = 0.0 if diff_sq == 0.0 else math.inf
        else:
            rel_l2 = math.sqrt(diff_sq) / math.sqrt(ref_sq)
        mismatch_count = int(self.mismatch_count)
        worst_flat = int(self.worst_flat)
        first_bad = int(self.first_nonfinite_mismatch)
        if worst_flat >= 0:
            worst_index = _unravel(worst_flat, shape)
            worst_out = float(out_flat[worst_flat].item())
            worst_ref = float(ref_flat[worst_flat].item())
        else:
            worst_index = worst_out = worst_ref = None
        ratio_flat = int(self.worst_ratio_flat)
        if ratio_flat >= 0:
            bound_index = _unravel(ratio_flat, shape)
            bound_out = float(out_flat[ratio_flat].item())
            bound_ref = float(ref_flat[ratio_flat].item())
        else:
            bound_index = bound_out = bound_ref = None
        return LayerMetrics(
            numel=numel,
            finite_count=finite_count,
            out_dtype=str(out_dtype).removeprefix("torch."),
            ref_dtype=str(ref_dtype).removeprefix("torch."),
            cosine=cosine,
            max_abs=float(self.max_abs),
            mean_abs=float(self.abs_sum) / finite_count if finite_count else 0.0,
            rel_l2=rel_l2,
            max_rel=float(self.max_rel),
            rel_floor=float(rel_floor),
            ref_max_abs=float(self.ref_max_abs),
            ref_rms=float(ref_rms),
            atol=float(atol),
            atol_rms=float(atol_rms),
            effective_atol=float(effective_atol),
            rtol=float(rtol),
            mismatch_count=mismatch_count,
            mismatch_fraction=mismatch_count / finite_count if finite_count else 0.0,
            needed_atol=float(self.needed_atol),
            needed_rtol=float(self.needed_rtol),
            ulp_max=int(self.ulp_max) if with_ulp else None,
            ulp_over_1_count=int(self.ulp_over_1_count) if with_ulp else None,
            nan_out=int(self.nan_out),
            nan_ref=int(self.nan_ref),
            inf_out=int(self.inf_out),
            inf_ref=int(self.inf_ref),
            nonfinite_mismatch_count=int(self.nonfinite_mismatch_count),
            first_nonfinite_mismatch_index=_unravel(first_bad, shape) if first_bad >= 0 else None,
            worst_index=worst_index,
            worst_out=worst_out,
            worst_ref=worst_ref,
            outlier_factor=None if outlier_factor is None else float(outlier_factor),
            outlier_count=int(self.outlier_count),
            worst_bound_ratio=float(self.worst_ratio),
            worst_bound_index=bound_index,
            worst_bound_out=bound_out,
            worst_bound_ref=bound_ref,
        )


def _unravel(flat_index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        flat_index, position = divmod(flat_index, size)
        index.append(position)
    return tuple(reversed(index))
