"""Per-layer error metrics of this host's output against a golden, computed in chunks on the tensors' device.

Pure functions: no printing, no asserts, no pass/fail decisions (that is ``parity.judge.checks``).
Long because every metric, its chunked accumulation and its JSON form are kept together: one pass
over the tensors computes them all (parity/NUMERICS.md, section 6).

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
- Bias ``(d . ref) / (ref . ref)``: the signed error projected on the reference, the ``s`` that
  best fits ``out ~ (1 + s) * ref`` in least squares (a relative scale error). Rounding error is
  unbiased (it averages out of the projection: about ``rel_l2 / sqrt(n)``); a wrong scale, a
  missing term, a wrong epsilon or an accumulation in the wrong precision is not (a scale error
  of 0.5% has bias +5e-3 whatever its rel_l2). 0.0 when ``ref`` is zero. ``bias_z``, its
  significance: ``(d . ref) / sqrt(sum (d_i ref_i)^2)``, the self-normalized sum of the element
  products, about standard normal when the element errors are independent and unbiased, and
  about ``sqrt(n / 3)`` for a pure scale error on Gaussian data: a small tensor's bias can be
  large by chance, a large tensor's cannot. 0.0 when every ``d_i ref_i`` is zero.
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
- Everything is computed in float64 on the tensors' device, chunk by chunk, in scratch arrays
  allocated once per call and reused (four float64 arrays of one chunk, whatever the tensor
  size); per-chunk sums are added with ``math.fsum``. One pass computes every statistic when the
  absolute term is known up front (``atol_rms`` 0); otherwise a second pass, for the mismatch
  and bound statistics, reads only the chunks whose largest error exceeds the absolute term
  (no other element can mismatch). A chunk without NaN/Inf skips the non-finite bookkeeping.
  Results depend on ``chunk_elements`` only through float64 rounding. A non-contiguous input
  is flattened with one copy; bundle tensors are contiguous.
- Error distribution: the percentiles p50, p90, p99, p99.9 of ``|d|`` and of ``|d| / max(|ref|,
  rel_floor)`` over the finite elements, and the histogram of ``|d|`` by octave, come from a fixed
  log-spaced histogram added chunk by chunk (:mod:`parity.judge.distribution`): each percentile
  is at most 1.125 times the exact one, never below it.
- ``LayerMetrics.to_dict()`` is JSON-safe: non-finite floats become the strings ``"nan"``,
  ``"inf"`` and ``"-inf"`` (``float()`` reads them back), absent values are ``None``, indices are
  lists.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any

import torch

from parity.base.dtypes import dtype_text
from parity.judge import distribution

# Elements per chunk. On the CPU a chunk's float64 scratch (four arrays of 256 KiB) stays in
# the L2 cache and is reused across chunks: whole-tensor temporaries page-fault on every use
# (parity/NUMERICS.md). Up to torch's parallel grain size (32768) every op runs on one thread: split
# over 2 threads, each op on a busy 2-core machine waited for a time slice (measured: 2^16
# chunks 1.5-4x slower at 2 threads than at 1). On a GPU large chunks keep launches few.
CPU_CHUNK_ELEMENTS = 2**15
DEVICE_CHUNK_ELEMENTS = 2**22
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


def json_value(value: Any) -> Any:
    """``value`` as JSON can carry it: a float through :func:`json_safe_float`, anything else as it is."""
    return json_safe_float(value) if isinstance(value, float) else value


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
    bias: float = 0.0
    bias_z: float = 0.0
    # Percentiles (p50, p90, p99, p99.9) of |d| and of |d| / max(|ref|, rel_floor) over the finite
    # elements, each within a factor 1.125 above the exact one (parity.judge.distribution), and
    # the histogram of |d| by octave; None in reports written before they existed.
    abs_err_percentiles: dict[str, float] | None = None
    rel_err_percentiles: dict[str, float] | None = None
    abs_err_histogram: dict[str, Any] | None = None

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
            elif field.name.endswith("_percentiles") and value is not None:
                value = {key: json_safe_float(number) for key, number in value.items()}
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
            elif field.name.endswith("_percentiles") and value is not None:
                value = {key: float(number) for key, number in value.items()}
            elif isinstance(value, (float, str)) and field.name not in ("out_dtype", "ref_dtype"):
                value = _float_from_json(value)
            values[field.name] = value
        return cls(**values)


def default_chunk_elements(device: torch.device | str) -> int:
    """Chunk size for ``device``: cache-sized on the CPU, large on accelerators."""
    return CPU_CHUNK_ELEMENTS if torch.device(device).type == "cpu" else DEVICE_CHUNK_ELEMENTS


def compute_metrics(
    out: torch.Tensor,
    ref: torch.Tensor,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    atol_rms: float = 0.0,
    rel_floor: float = DEFAULT_REL_FLOOR,
    chunk_elements: int | None = None,
    outlier_factor: float | None = None,
) -> LayerMetrics:
    """Compare ``out`` (this host) with ``ref`` (the golden); both of the same shape, on one device.

    ``atol``, ``atol_rms`` and ``rtol`` define the mismatch count and the "needed" tolerances;
    pass the values of the policy that will judge the result (``parity.judge.policy.measure`` does).
    ``outlier_factor``: count the elements whose error exceeds this many times their bound.
    Dtypes may differ (e.g. bf16 against an fp64 reference); ULP distances are then not computed.
    ``chunk_elements``: elements per chunk (default :func:`default_chunk_elements`).
    Raises ``ValueError`` for tensors that cannot be compared (different shapes or devices,
    complex dtypes) and for bad arguments.
    """
    _check_arguments(out, ref, atol, rtol, atol_rms, rel_floor, chunk_elements)
    _check_outlier_factor(outlier_factor)
    chunk_elements = chunk_elements or default_chunk_elements(out.device)
    sides = _sides([out, ref], chunk_elements)
    pair = _Pair(out, ref, sides[0], sides[1], chunk_elements, atol=atol, rtol=rtol, atol_rms=atol_rms,
                 rel_floor=rel_floor, outlier_factor=outlier_factor)
    for chunk in pair.scan.chunks:
        pair.first(chunk)
    return pair.finish()


def compute_metrics_and_errors(
    out: torch.Tensor,
    golden: torch.Tensor,
    high_precision_ref: torch.Tensor,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    atol_rms: float = 0.0,
    rel_floor: float = DEFAULT_REL_FLOOR,
    chunk_elements: int | None = None,
    outlier_factor: float | None = None,
) -> tuple[LayerMetrics, LayerMetrics, LayerMetrics]:
    """``compute_metrics(out, golden, ...)``, ``compute_error_vs_reference(out, high_precision_ref)``
    and ``compute_error_vs_reference(golden, high_precision_ref)``, with the same results, from
    one scan of the three tensors: each chunk of each tensor is cast to float64, squared and (as
    a reference) made absolute once for the pairs that share it. What compare computes for
    every tensor with a reference. The tolerance arguments are the first pair's; raises as the
    three calls would.
    """
    _check_reference(out, high_precision_ref)
    _check_reference(golden, high_precision_ref)
    _check_arguments(out, golden, atol, rtol, atol_rms, rel_floor, chunk_elements)
    _check_outlier_factor(outlier_factor)
    _check_arguments(out, high_precision_ref, 0.0, 0.0, 0.0, DEFAULT_REL_FLOOR, chunk_elements)
    _check_arguments(golden, high_precision_ref, 0.0, 0.0, 0.0, DEFAULT_REL_FLOOR, chunk_elements)
    chunk_elements = chunk_elements or default_chunk_elements(out.device)
    out_side, golden_side, ref_side = _sides([out, golden, high_precision_ref], chunk_elements)
    pairs = [
        _Pair(out, golden, out_side, golden_side, chunk_elements, atol=atol, rtol=rtol, atol_rms=atol_rms,
              rel_floor=rel_floor, outlier_factor=outlier_factor),
        _Pair(out, high_precision_ref, out_side, ref_side, chunk_elements),
        _Pair(golden, high_precision_ref, golden_side, ref_side, chunk_elements),
    ]
    for index in range(len(pairs[0].scan.chunks)):  # in step, so that the sides' work is shared
        for pair in pairs:
            pair.first(pair.scan.chunks[index])
    return pairs[0].finish(), pairs[1].finish(), pairs[2].finish()


def _sides(tensors: list[torch.Tensor], chunk_elements: int) -> list[_Side]:
    size = min(chunk_elements, tensors[0].numel())
    return [_Side(tensor.reshape(-1), size) for tensor in tensors]


class _Pair:
    """One comparison (``out`` against ``ref`` under the given tolerances) driven chunk by chunk.

    Without atol_rms the absolute term is known up front and the first scan does everything;
    with it, the term waits for the reference's RMS, and the tolerance statistics are a second
    scan over only the chunks with an error beyond it (no other element can mismatch or need an
    rtol).
    """

    def __init__(self, out: torch.Tensor, ref: torch.Tensor, out_side: _Side, ref_side: _Side, chunk_elements: int,
                 *, atol: float = 0.0, rtol: float = 0.0, atol_rms: float = 0.0,
                 rel_floor: float = DEFAULT_REL_FLOOR, outlier_factor: float | None = None):
        self.shape, self.out_dtype, self.ref_dtype = tuple(out.shape), out.dtype, ref.dtype
        self.atol, self.atol_rms, self.outlier_factor = atol, atol_rms, outlier_factor
        self.provisional = float(atol) if atol_rms == 0 else None
        self.scan = _Scan(out_side, ref_side, chunk_elements, rtol=float(rtol), rel_floor=float(rel_floor),
                          outlier_factor=outlier_factor,
                          exact=not out.is_floating_point() and not ref.is_floating_point(),
                          with_ulp=out.dtype == ref.dtype and out.dtype in SIXTEEN_BIT_FLOATS)

    def first(self, chunk: _Chunk) -> None:
        self.scan.first(chunk, self.provisional)

    def finish(self) -> LayerMetrics:
        ref_rms = self.scan.ref_rms()
        effective_atol = self.atol + self.atol_rms * ref_rms
        if not effective_atol == self.provisional:  # also NaN: atol_rms * inf RMS, as before
            self.scan.tolerance_pass(effective_atol)
        return self.scan.finish(
            self.shape, self.out_dtype, self.ref_dtype, atol=self.atol, atol_rms=self.atol_rms, ref_rms=ref_rms,
            effective_atol=effective_atol, outlier_factor=self.outlier_factor,
        )


def compute_error_vs_reference(
    out: torch.Tensor, high_precision_ref: torch.Tensor, **kwargs
) -> LayerMetrics:
    """This host's error against a high-precision (typically fp64) reference of the same computation.

    The error-budget inputs: the capture host stores its own ``compute_error_vs_reference`` of the
    golden, this host computes its own, and the policy compares the two (parity/NUMERICS.md: the
    flash-attention rule). Same arguments and results as ``compute_metrics``; the reference must
    be a floating dtype at least as precise as ``out``.
    """
    _check_reference(out, high_precision_ref)
    return compute_metrics(out, high_precision_ref, **kwargs)


def _check_outlier_factor(outlier_factor: float | None) -> None:
    if outlier_factor is not None and not (math.isfinite(outlier_factor) and outlier_factor >= 1):
        raise ValueError(f"outlier_factor must be finite and >= 1, got {outlier_factor!r}")


def _check_reference(out: torch.Tensor, high_precision_ref: torch.Tensor) -> None:
    if not isinstance(out, torch.Tensor) or not isinstance(high_precision_ref, torch.Tensor):
        raise TypeError("compute_metrics compares two torch.Tensor objects")
    if not high_precision_ref.is_floating_point() or (
        out.is_floating_point()
        and torch.finfo(high_precision_ref.dtype).eps > torch.finfo(out.dtype).eps
    ):
        raise ValueError(
            f"reference dtype {high_precision_ref.dtype} is less precise than {out.dtype}"
        )


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
    if chunk_elements is not None and not (isinstance(chunk_elements, int) and chunk_elements >= 1):
        raise ValueError(f"chunk_elements must be a positive int, got {chunk_elements!r}")


def _ordered_bits(values16: torch.Tensor) -> torch.Tensor:
    """16-bit float patterns mapped to integers that are consecutive for adjacent floats.

    IEEE floats are sign-magnitude; the two's-complement view of a negative float runs backwards,
    so negative values are mapped to minus their magnitude bits (and -0 to 0, the same as +0).
    """
    bits = values16.view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def _ordered_bits_into(values16: torch.Tensor, out: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
    """:func:`_ordered_bits` in int32 scratch ``out`` (``temp``: more scratch), without allocating.

    For a negative pattern ``b`` (an int16 widened to int32), ``-(b & 0x7FFF)`` is
    ``(b ^ 0x7FFF) + 1``; with ``s = b >> 15`` (0 or -1) both cases are ``(b ^ (s & 0x7FFF)) - s``.
    """
    bits = out.copy_(values16.view(torch.int16))
    sign = torch.bitwise_right_shift(bits, 15, out=temp).bitwise_and_(0x7FFF)  # 0 or 0x7FFF
    bits.bitwise_xor_(sign)
    sign >>= 14  # 0 or 1
    return bits.add_(sign)


class _Chunk:
    """One chunk's statistics, as host numbers. Sums are combined with ``math.fsum`` at the end."""

    __slots__ = (
        "start", "stop", "masked", "dot", "error_dot", "error_dot_sq", "out_sq", "ref_sq", "diff_sq", "abs_sum", "ref_rms_sq", "ref_finite",
        "finite", "nan_out", "nan_ref", "inf_out", "inf_ref", "nonfinite_mismatch", "first_nonfinite",
        "max_abs", "ref_max_abs", "ref_min_abs", "max_rel", "needed_atol", "ulp_max", "ulp_over_1",
        "mismatch", "ratio_max", "outliers", "needed_rtol",
    )

    def __init__(self, start: int, stop: int):
        self.start, self.stop = start, stop
        self.masked = False
        self.nan_out = self.nan_ref = self.inf_out = self.inf_ref = self.nonfinite_mismatch = 0
        self.first_nonfinite = -1
        self.ulp_max = self.ulp_over_1 = 0
        self.mismatch = self.outliers = 0
        self.ratio_max = self.needed_rtol = 0.0


def _norm(values: torch.Tensor) -> torch.Tensor:
    """The 2-norm as a 0-dim tensor; its square (taken on the host) is the sum of squares. One
    pass without a temporary; the norm is not rescaled, so it overflows, and propagates NaN, as
    the sum would (measured: 8 us for 32768 float64 elements, 17 us for ``mul`` and ``sum``)."""
    return torch.linalg.vector_norm(values)


def _host(values: list[torch.Tensor]) -> list[float]:
    """0-dim device values as Python numbers, with one transfer (one synchronization) off the CPU."""
    if values[0].device.type == "cpu":
        return [value.item() for value in values]
    return torch.stack([value.to(torch.float64) for value in values]).tolist()


class _Side:
    """One flattened tensor as the scans read it, chunk by chunk: the chunk in float64 (a scratch
    copy, or a view of a float64 input, never written), its sum of squares, and its absolute
    values with their extremes, each computed once however many pairs read the chunk."""

    def __init__(self, flat: torch.Tensor, size: int):
        self.flat = flat
        self.buffer = None if flat.dtype == torch.float64 else torch.empty(size, dtype=torch.float64,
                                                                            device=flat.device)
        self.abs_buffer = torch.empty(size, dtype=torch.float64, device=flat.device)
        self._at: tuple[int, int] | None = None

    def load(self, chunk: _Chunk) -> torch.Tensor:
        if self._at != (chunk.start, chunk.stop):
            values = self.flat[chunk.start:chunk.stop]
            if self.buffer is not None:
                values = self.buffer[:chunk.stop - chunk.start].copy_(values)
            self.values, self._at = values, (chunk.start, chunk.stop)
            self._square_sum = self._abs = None
        return self.values

    def square_sum(self, chunk: _Chunk) -> float:
        values = self.load(chunk)
        if self._square_sum is None:
            (norm,) = _host([_norm(values)])
            self._square_sum = norm * norm
        return self._square_sum

    def abs_extremes(self, chunk: _Chunk) -> tuple[torch.Tensor, float, float]:
        """``(|values|, min, max)`` of the chunk."""
        values = self.load(chunk)
        if self._abs is None:
            absolute = torch.abs(values, out=self.abs_buffer[:values.numel()])
            self._abs = (absolute, *_host(list(torch.aminmax(absolute))))
        return self._abs


class _Scratch:
    """A scan's own arrays of one chunk (the differences, work space, flags, 16-bit ULPs), reused."""

    def __init__(self, size: int, device: torch.device):
        def empty(dtype=torch.float64):
            return torch.empty(size, dtype=dtype, device=device)

        self.size, self.device = size, device
        self.abs_diff, self.ref_abs, self.work = empty(), empty(), empty()
        self.flags = empty(torch.bool)
        self.ulp: list[torch.Tensor] | None = None  # int32, allocated for 16-bit floats only
        self.keys = empty(torch.int64)  # histogram bin of each element
        self.ones = torch.ones(size, dtype=torch.int64, device=device)  # what each element adds to its bin

    def ulp_arrays(self) -> list[torch.Tensor]:
        if self.ulp is None:
            self.ulp = [torch.empty(self.size, dtype=torch.int32, device=self.device) for _ in range(3)]
        return self.ulp


class _Scan:
    """The chunked computation behind :func:`compute_metrics`, for one pair of :class:`_Side`.

    Each chunk is cast to float64 into scratch arrays allocated once per call and reused, so no
    temporary is ever larger than a chunk. A chunk whose ``out . out`` and ``ref . ref`` are
    finite has no NaN or Inf on either side (a square cannot overflow float64 from a 16- or
    32-bit value; a float64 chunk with values beyond 1e154 takes the masked path, which is
    always right): such a chunk skips every NaN/Inf mask and count. Other chunks take the
    masked path, which zeroes the positions where either side is not finite (they then add
    nothing to any sum or maximum) and counts and compares them. Scans that share a side and
    visit their chunks in step (:func:`compute_metrics_and_errors`) share its per-chunk work.

    The worst element and the worst bound ratio are located after the scan: the first chunk
    holding the overall maximum is scanned again for the first index of it, which is the index
    a running ``max(dim)`` over all chunks would have kept.
    """

    def __init__(self, out_side: _Side, ref_side: _Side, chunk_elements: int, *, rtol: float,
                 rel_floor: float, outlier_factor: float | None, exact: bool, with_ulp: bool):
        self.out_side, self.ref_side = out_side, ref_side
        self.out, self.ref = out_side.flat, ref_side.flat
        self.numel = self.out.numel()
        self.rtol, self.rel_floor, self.outlier_factor = rtol, rel_floor, outlier_factor
        self.exact, self.with_ulp = exact, with_ulp
        self.absolute_term: float | None = None
        self.chunks = [_Chunk(start, min(start + chunk_elements, self.numel))
                       for start in range(0, self.numel, chunk_elements)]
        self._scratch = _Scratch(min(chunk_elements, self.numel), self.out.device)
        self.abs_hist = distribution.LogHistogram(self.out.device)
        self.rel_hist = distribution.LogHistogram(self.out.device)

    # chunk data -------------------------------------------------------------------------------
    def _arrays(self, chunk: _Chunk) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(|d|, |ref|, both_finite)`` of a chunk again, zeroed where either side is not finite
        (``both_finite`` None where both sides are finite everywhere)."""
        out, ref = self.out_side.load(chunk), self.ref_side.load(chunk)
        both = None
        if chunk.masked:
            both = torch.isfinite(out) & torch.isfinite(ref)
            out, ref = torch.where(both, out, 0.0), torch.where(both, ref, 0.0)
        n = out.numel()
        abs_diff = torch.sub(out, ref, out=self._scratch.abs_diff[:n]).abs_()
        ref_abs = torch.abs(ref, out=self._scratch.ref_abs[:n])
        return abs_diff, ref_abs, both

    # the first scan ---------------------------------------------------------------------------
    def first_pass(self, absolute_term: float | None) -> None:
        """Every statistic; the tolerance ones too when the absolute term is already known."""
        for chunk in self.chunks:
            self.first(chunk, absolute_term)

    def first(self, chunk: _Chunk, absolute_term: float | None) -> None:
        """The first scan's work on one chunk."""
        self.absolute_term = absolute_term
        scratch = self._scratch
        out, ref = self.out_side.load(chunk), self.ref_side.load(chunk)
        n = out.numel()
        work = scratch.work[:n]
        out_sq, ref_sq = self.out_side.square_sum(chunk), self.ref_side.square_sum(chunk)
        both = None
        if math.isfinite(out_sq) and math.isfinite(ref_sq):
            chunk.finite = chunk.ref_finite = n
            chunk.ref_rms_sq = ref_sq
            ref_abs, chunk.ref_min_abs, ref_max = self.ref_side.abs_extremes(chunk)
        else:
            chunk.masked = True
            out, ref, both = self._mask_nonfinite(chunk, out, ref)
            out_sq, ref_sq = (norm * norm for norm in _host([_norm(out), _norm(ref)]))
            ref_abs = torch.abs(ref, out=scratch.ref_abs[:n])
            chunk.ref_min_abs, ref_max = _host(list(torch.aminmax(ref_abs)))
        # Not torch.dot: MKL's ddot starts threads even for a chunk, and on a busy 2-core machine
        # each call then waited for a time slice (measured: 5 us median, 12 ms at the 90th
        # percentile, for 16384 elements).
        dot = torch.mul(out, ref, out=work).sum()
        abs_diff = torch.sub(out, ref, out=scratch.abs_diff[:n])
        diff_norm = _norm(abs_diff)
        products = torch.mul(abs_diff, ref, out=work)  # d_i ref_i, signed (before |d|): the bias
        error_dot, error_dot_sq = products.sum(), _norm(products)
        abs_diff.abs_()
        abs_sum, max_abs = abs_diff.sum(), abs_diff.amax()
        if chunk.ref_min_abs >= self.rel_floor:  # the floor changes nothing in this chunk
            torch.div(abs_diff, ref_abs, out=work)
        else:
            torch.div(abs_diff, torch.clamp(ref_abs, min=self.rel_floor, out=work), out=work)
        max_rel = work.amax()
        placeholders = n - chunk.finite if chunk.masked else 0  # zeroed non-finite positions
        self.abs_hist.add(abs_diff, scratch.keys, scratch.ones, excluded=placeholders)
        self.rel_hist.add(work, scratch.keys, scratch.ones, excluded=placeholders)
        if self.rtol == 0.0:
            needed_atol = max_abs  # |d| - 0 * |ref| is |d|
        else:
            needed_atol = torch.sub(abs_diff, torch.mul(ref_abs, self.rtol, out=work), out=work).amax()
        values = [dot, diff_norm, abs_sum, max_abs, max_rel, needed_atol, error_dot, error_dot_sq]
        if self.with_ulp:
            values += self._ulp_stats(chunk, both)
        values = _host(values)
        chunk.dot, diff_norm, chunk.abs_sum, chunk.max_abs, chunk.max_rel, chunk.needed_atol = values[:6]
        chunk.error_dot, chunk.error_dot_sq = values[6], values[7] * values[7]
        chunk.diff_sq = diff_norm * diff_norm
        chunk.out_sq, chunk.ref_sq, chunk.ref_max_abs = out_sq, ref_sq, ref_max
        if self.with_ulp:
            chunk.ulp_max, chunk.ulp_over_1 = int(values[8]), int(values[9])
        if absolute_term is not None:
            self._tolerance(chunk, abs_diff, ref_abs, both, absolute_term)

    def _ulp_stats(self, chunk: _Chunk, both: torch.Tensor | None) -> list[torch.Tensor]:
        """Largest ULP distance and how many elements are more than 1 ULP apart (16-bit floats)."""
        n = chunk.stop - chunk.start
        out_bits, ref_bits, temp = (array[:n] for array in self._scratch.ulp_arrays())
        ulp = _ordered_bits_into(self.out[chunk.start:chunk.stop], out_bits, temp)
        ulp.sub_(_ordered_bits_into(self.ref[chunk.start:chunk.stop], ref_bits, temp)).abs_()
        if both is not None:
            ulp.masked_fill_(~both, 0)
        return [ulp.amax(), torch.gt(ulp, 1, out=self._scratch.flags[:n]).sum()]

    def _mask_nonfinite(self, chunk: _Chunk, out: torch.Tensor, ref: torch.Tensor):
        """Count NaN/Inf on each side, compare their positions, and zero every position where
        either side is not finite (new tensors: ``out``/``ref`` are a side's, never written)."""
        out_nan, ref_nan = torch.isnan(out), torch.isnan(ref)
        out_inf, ref_inf = torch.isinf(out), torch.isinf(ref)
        ref_finite = ~(ref_nan | ref_inf)
        both = ref_finite & ~(out_nan | out_inf)
        # Same-signed infinities compare equal, so `out == ref` settles the Inf cases.
        disagree = ~(both | (out_nan & ref_nan) | (out_inf & (out == ref)))
        ref_finite_values = torch.where(ref_finite, ref, 0.0)
        counts = _host([out_nan.sum(), ref_nan.sum(), out_inf.sum(), ref_inf.sum(), disagree.sum(), both.sum(),
                        ref_finite.sum(), _norm(ref_finite_values)])
        (chunk.nan_out, chunk.nan_ref, chunk.inf_out, chunk.inf_ref, chunk.nonfinite_mismatch, chunk.finite,
         chunk.ref_finite) = (int(value) for value in counts[:7])
        chunk.ref_rms_sq = counts[7] * counts[7]
        if chunk.nonfinite_mismatch:
            chunk.first_nonfinite = chunk.start + int(disagree.to(torch.uint8).argmax())  # the first maximum
        return torch.where(both, out, 0.0), torch.where(both, ref, 0.0), both

    # the tolerance statistics -----------------------------------------------------------------
    def tolerance_pass(self, absolute_term: float) -> None:
        """The tolerance statistics for the final absolute term; only chunks with an error beyond it
        (or, for integer tensors, any difference) are read again."""
        self.absolute_term = absolute_term
        for chunk in self.chunks:
            chunk.mismatch = chunk.outliers = 0
            chunk.ratio_max = chunk.needed_rtol = 0.0
            if self.exact or chunk.max_abs > absolute_term:
                abs_diff, ref_abs, both = self._arrays(chunk)
                self._tolerance(chunk, abs_diff, ref_abs, both, absolute_term)

    def _tolerance(self, chunk: _Chunk, abs_diff: torch.Tensor, ref_abs: torch.Tensor, both: torch.Tensor | None,
                   absolute_term: float) -> None:
        """Mismatches, bound ratios, outliers and the needed rtol of one chunk.

        An element mismatches when ``|d| > A + rtol * |ref|``; none can where ``|d| <= A``, so a
        chunk whose largest error is within ``A`` has no mismatch and needs no rtol (exact: the
        rounded bound is never below ``A``). Zeroed (non-finite) positions never mismatch.
        """
        work, flags = self._scratch.work[:abs_diff.numel()], self._scratch.flags[:abs_diff.numel()]
        beyond = chunk.max_abs > absolute_term  # False for a NaN term, as every comparison with it
        exact_zero_bound = absolute_term == 0.0 and self.rtol == 0.0
        if self.exact:
            differ = self.out[chunk.start:chunk.stop] != self.ref[chunk.start:chunk.stop]
            if both is not None:
                differ &= both
            chunk.mismatch = int(differ.sum())
        elif not beyond:
            pass
        elif exact_zero_bound:
            # The bound is 0: every nonzero error mismatches, each one infinitely many times its bound.
            chunk.mismatch = int(torch.count_nonzero(abs_diff))
            chunk.ratio_max = math.inf if chunk.mismatch else 0.0
            chunk.outliers = chunk.mismatch if self.outlier_factor is not None else 0
        else:
            bound = torch.mul(ref_abs, self.rtol, out=work).add_(absolute_term)
            mismatch = torch.gt(abs_diff, bound, out=flags)
            chunk.mismatch = int(mismatch.sum())
            if chunk.mismatch:
                # How many times its own bound each element's error is; 0/0 (an exact element on a
                # zero bound) is 0, d/0 is inf: no multiple of a zero bound forgives an error.
                ratio = torch.where(mismatch, abs_diff / bound, 0.0)
                values = [ratio.max()]
                if self.outlier_factor is not None:
                    values.append((ratio > self.outlier_factor).sum())
                values = _host(values)
                chunk.ratio_max = values[0]
                chunk.outliers = int(values[1]) if self.outlier_factor is not None else 0
        if not beyond:
            chunk.needed_rtol = 0.0
        elif absolute_term == 0.0 and chunk.ref_min_abs >= self.rel_floor:
            chunk.needed_rtol = chunk.max_rel  # max |d| / |ref|, computed as max_rel with an idle floor
        elif absolute_term == 0.0:
            # |d| / |ref| where |d| > 0: 0/0 (NaN) only where |d| == 0; d/0 is inf: no rtol can
            # cover an error on an exact-zero reference.
            rtol_each = torch.div(abs_diff, ref_abs, out=work).nan_to_num_(nan=0.0, posinf=math.inf)
            (chunk.needed_rtol,) = _host([rtol_each.max()])
        else:
            excess = torch.sub(abs_diff, absolute_term, out=work)
            positive = torch.gt(excess, 0.0, out=flags)
            rtol_each = excess.div_(ref_abs).masked_fill_(positive.logical_not_(), 0.0)
            (chunk.needed_rtol,) = _host([rtol_each.max()])

    # results ----------------------------------------------------------------------------------
    def ref_rms(self) -> float:
        """RMS of the reference's finite elements (0 if there are none)."""
        count = sum(chunk.ref_finite for chunk in self.chunks)
        return math.sqrt(math.fsum(chunk.ref_rms_sq for chunk in self.chunks) / max(count, 1))

    def _worst_flat(self) -> int:
        """Flat index of the first largest |d| among positions finite on both sides, or -1."""
        candidates = [chunk for chunk in self.chunks if chunk.finite]
        if not candidates:
            return -1
        largest = max(chunk.max_abs for chunk in candidates)
        chunk = next(chunk for chunk in candidates if chunk.max_abs == largest)
        abs_diff, _, both = self._arrays(chunk)
        if both is not None:  # -1 marks non-finite positions so they are never the worst finite element
            abs_diff = torch.where(both, abs_diff, -1.0)
        return chunk.start + int(abs_diff.argmax())

    def _worst_ratio_flat(self) -> int:
        """Flat index of the first largest bound ratio, or -1 where no element mismatches."""
        largest = max((chunk.ratio_max for chunk in self.chunks), default=0.0)
        if not largest > 0:
            return -1
        chunk = next(chunk for chunk in self.chunks if chunk.ratio_max == largest)
        abs_diff, ref_abs, _ = self._arrays(chunk)
        bound = self.absolute_term + self.rtol * ref_abs
        ratio = torch.where(abs_diff > bound, abs_diff / bound, 0.0)
        return chunk.start + int(ratio.argmax())

    def finish(self, shape, out_dtype, ref_dtype, *, atol, atol_rms, ref_rms, effective_atol,
               outlier_factor=None) -> LayerMetrics:
        chunks = self.chunks

        def total(name: str) -> float:
            return math.fsum(getattr(chunk, name) for chunk in chunks)

        def count(name: str) -> int:
            return sum(int(getattr(chunk, name)) for chunk in chunks)

        def largest(name: str, start=0.0):
            # as torch.maximum over the chunks would: NaN wins, and the running value starts at 0
            values = [getattr(chunk, name) for chunk in chunks]
            return math.nan if any(value != value for value in values) else max([start, *values])

        finite_count = count("finite")
        dot, out_sq, ref_sq, diff_sq = total("dot"), total("out_sq"), total("ref_sq"), total("diff_sq")
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
            bias = 0.0  # no direction to project on (rel_l2 is inf where out is not zero too)
        else:
            rel_l2 = math.sqrt(diff_sq) / math.sqrt(ref_sq)
            bias = total("error_dot") / ref_sq
        spread = math.sqrt(total("error_dot_sq"))
        bias_z = total("error_dot") / spread if spread > 0 else 0.0
        mismatch_count = count("mismatch")
        worst_flat = self._worst_flat()
        if worst_flat >= 0:
            worst_index = _unravel(worst_flat, shape)
            worst_out = float(self.out[worst_flat].item())
            worst_ref = float(self.ref[worst_flat].item())
        else:
            worst_index = worst_out = worst_ref = None
        ratio_flat = self._worst_ratio_flat()
        if ratio_flat >= 0:
            bound_index = _unravel(ratio_flat, shape)
            bound_out = float(self.out[ratio_flat].item())
            bound_ref = float(self.ref[ratio_flat].item())
        else:
            bound_index = bound_out = bound_ref = None
        first_bad = next((chunk.first_nonfinite for chunk in chunks if chunk.first_nonfinite >= 0), -1)
        max_abs, max_rel = float(largest("max_abs")), float(largest("max_rel"))
        abs_zeros, abs_counts = self.abs_hist.counts()
        rel_zeros, rel_counts = self.rel_hist.counts()
        return LayerMetrics(
            numel=self.numel,
            finite_count=finite_count,
            out_dtype=dtype_text(out_dtype),
            ref_dtype=dtype_text(ref_dtype),
            cosine=cosine,
            max_abs=max_abs,
            mean_abs=total("abs_sum") / finite_count if finite_count else 0.0,
            rel_l2=rel_l2,
            max_rel=max_rel,
            rel_floor=float(self.rel_floor),
            ref_max_abs=float(largest("ref_max_abs")),
            ref_rms=float(ref_rms),
            atol=float(atol),
            atol_rms=float(atol_rms),
            effective_atol=float(effective_atol),
            rtol=float(self.rtol),
            mismatch_count=mismatch_count,
            mismatch_fraction=mismatch_count / finite_count if finite_count else 0.0,
            needed_atol=float(largest("needed_atol")),
            needed_rtol=float(largest("needed_rtol")),
            ulp_max=int(largest("ulp_max", 0)) if self.with_ulp else None,
            ulp_over_1_count=count("ulp_over_1") if self.with_ulp else None,
            nan_out=count("nan_out"),
            nan_ref=count("nan_ref"),
            inf_out=count("inf_out"),
            inf_ref=count("inf_ref"),
            nonfinite_mismatch_count=count("nonfinite_mismatch"),
            first_nonfinite_mismatch_index=_unravel(first_bad, shape) if first_bad >= 0 else None,
            worst_index=worst_index,
            worst_out=worst_out,
            worst_ref=worst_ref,
            outlier_factor=None if outlier_factor is None else float(outlier_factor),
            outlier_count=count("outliers"),
            worst_bound_ratio=float(largest("ratio_max")),
            worst_bound_index=bound_index,
            worst_bound_out=bound_out,
            worst_bound_ref=bound_ref,
            bias=bias,
            bias_z=bias_z,
            abs_err_percentiles=distribution.percentiles(abs_zeros, abs_counts, max_abs),
            rel_err_percentiles=distribution.percentiles(rel_zeros, rel_counts, max_rel),
            abs_err_histogram=distribution.octaves(abs_zeros, abs_counts) if abs_zeros + sum(abs_counts) else None,
        )

def _unravel(flat_index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        flat_index, position = divmod(flat_index, size)
        index.append(position)
    return tuple(reversed(index))
