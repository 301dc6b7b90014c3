"""Tests of parity.judge.metrics against hand-computed values."""
import json
import math

import pytest
import torch

from parity.judge.metrics import LayerMetrics, compute_error_vs_reference, compute_metrics

NAN, INF = math.nan, math.inf


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def from_bits(bits, dtype):
    """16-bit floats from their unsigned bit patterns."""
    signed = [b - 0x10000 if b >= 0x8000 else b for b in bits]
    return torch.tensor(signed, dtype=torch.int16).view(dtype)


# --- every metric on a tiny example -----------------------------------------------------------

def test_hand_computed_example_counts_errors_on_both_sides():
    # d = out - ref = [-0.5, +1, 0, 0]: one element below its reference, one above.
    out, ref = t([1.0, 2.0, 3.0, 4.0]), t([1.5, 1.0, 3.0, 4.0])
    m = compute_metrics(out, ref, atol=0.25, rtol=0.0)
    assert m.numel == m.finite_count == 4
    assert m.max_abs == 1.0
    assert m.mean_abs == pytest.approx(1.5 / 4)
    assert m.rel_l2 == pytest.approx(math.sqrt(1.25) / math.sqrt(2.25 + 1 + 9 + 16))
    assert m.cosine == pytest.approx((1.5 + 2 + 9 + 16) / math.sqrt(30 * 28.25))
    assert m.max_rel == pytest.approx(1.0)  # 1/1 beats 0.5/1.5
    assert m.ref_max_abs == 4.0
    assert m.mismatch_count == 2 and m.mismatch_fraction == 0.5
    assert m.worst_index == (1,) and m.worst_out == 2.0 and m.worst_ref == 1.0


def test_largest_error_below_the_reference_is_found():
    out, ref = t([0.0, 5.0, 1.0]), t([3.0, 5.0, 1.5])
    m = compute_metrics(out, ref)
    assert m.max_abs == 3.0
    assert m.worst_index == (0,) and m.worst_out == 0.0 and m.worst_ref == 3.0


def test_needed_tolerances():
    out, ref = t([1.0, 2.0, 3.0, 4.0]), t([1.5, 1.0, 3.0, 4.0])
    m = compute_metrics(out, ref, atol=0.25, rtol=0.125)
    # atol for rtol 0.125: max(0.5 - 0.125*1.5, 1 - 0.125*1) = 0.875
    assert m.needed_atol == pytest.approx(0.875)
    # rtol for atol 0.25: max((0.5 - 0.25) / 1.5, (1 - 0.25) / 1) = 0.75
    assert m.needed_rtol == pytest.approx(0.75)
    assert m.mismatch_count == 2


def test_needed_tolerances_are_zero_for_identical_tensors():
    x = torch.randn(50)
    m = compute_metrics(x, x.clone(), atol=1e-3, rtol=1e-3)
    assert m.needed_atol == 0.0 and m.needed_rtol == 0.0 and m.mismatch_count == 0
    assert m.cosine == 1.0 and m.rel_l2 == 0.0


def test_needed_tolerances_really_pass():
    gen = torch.Generator().manual_seed(3)
    ref = torch.randn(2000, generator=gen)
    out = ref + 1e-3 * torch.randn(2000, generator=gen)
    m = compute_metrics(out, ref, atol=1e-4, rtol=1e-3)
    assert m.mismatch_count > 0
    just_enough_atol = compute_metrics(out, ref, atol=m.needed_atol * (1 + 1e-9), rtol=1e-3)
    just_enough_rtol = compute_metrics(out, ref, atol=1e-4, rtol=m.needed_rtol * (1 + 1e-9))
    assert just_enough_atol.mismatch_count == 0
    assert just_enough_rtol.mismatch_count == 0
    too_little = compute_metrics(out, ref, atol=m.needed_atol * (1 - 1e-6), rtol=1e-3)
    assert too_little.mismatch_count >= 1


def test_mismatch_agrees_with_torch_isclose():
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(3000, generator=gen)
    out = ref + 0.01 * torch.randn(3000, generator=gen)
    m = compute_metrics(out, ref, atol=5e-3, rtol=1e-2)
    expected = (~torch.isclose(out.double(), ref.double(), rtol=1e-2, atol=5e-3)).sum().item()
    assert 0 < m.mismatch_count == expected


def test_error_exactly_at_the_bound_is_not_a_mismatch():
    m = compute_metrics(t([1.25, -1.25]), t([1.0, -1.0]), atol=0.125, rtol=0.125)
    assert m.mismatch_count == 0


def test_needed_rtol_is_infinite_for_an_error_on_an_exact_zero_reference():
    m = compute_metrics(t([1e-3, 1.0]), t([0.0, 1.0]), atol=1e-4, rtol=0.0)
    assert m.needed_rtol == INF
    assert m.needed_atol == pytest.approx(1e-3)


def test_absolute_term_scales_with_the_reference_rms():
    # rms(ref) = sqrt((9 + 16) / 2) = 3.5355; A = 0.05 + 0.1 * 3.5355 = 0.40355
    out, ref = t([3.3, 4.45, NAN]), t([3.0, 4.0, INF])
    m = compute_metrics(out, ref, atol=0.05, atol_rms=0.1)
    assert m.ref_rms == pytest.approx(math.sqrt(12.5))  # the Inf is left out
    assert m.effective_atol == pytest.approx(0.05 + 0.1 * math.sqrt(12.5))
    assert m.mismatch_count == 1  # |d| 0.45 > A; 0.3 is not
    assert m.needed_atol == pytest.approx(0.45, rel=1e-6)  # the whole absolute term
    assert m.needed_rtol == pytest.approx((0.45 - m.effective_atol) / 4.0, rel=1e-5)
    assert (m.atol, m.atol_rms) == (0.05, 0.1)


def test_rms_of_a_reference_without_finite_elements_is_zero():
    m = compute_metrics(t([NAN, 1.0]), t([NAN, INF]), atol_rms=0.1)
    assert m.ref_rms == 0.0 and m.effective_atol == 0.0


def test_max_relative_error_uses_the_floor_for_near_zero_references():
    out, ref = t([1e-3, 2.0]), t([0.0, 1.0])
    assert compute_metrics(out, ref, rel_floor=1e-6).max_rel == pytest.approx(1e3, rel=1e-6)
    floored = compute_metrics(out, ref, rel_floor=1e-1)
    assert floored.max_rel == pytest.approx(1.0) and floored.rel_floor == 1e-1


# --- NaN / Inf --------------------------------------------------------------------------------

def test_nonfinite_positions_that_agree():
    out = t([NAN, INF, -INF, 1.0])
    m = compute_metrics(out, out.clone())
    assert m.nonfinite_positions_agree and m.nonfinite_mismatch_count == 0
    assert (m.nan_out, m.inf_out, m.nan_ref, m.inf_ref) == (1, 2, 1, 2)
    assert m.finite_count == 1 and m.max_abs == 0.0 and m.cosine == 1.0
    assert m.first_nonfinite_mismatch_index is None


def test_nonfinite_positions_that_disagree():
    out = t([NAN, INF, -INF, 1.0, NAN, 2.0])
    ref = t([NAN, INF, INF, NAN, 1.0, 2.0])
    m = compute_metrics(out, ref)
    # -Inf vs +Inf, 1 vs NaN, NaN vs 1
    assert m.nonfinite_mismatch_count == 3 and not m.nonfinite_positions_agree
    assert m.first_nonfinite_mismatch_index == (2,)
    assert (m.nan_out, m.nan_ref, m.inf_out, m.inf_ref) == (2, 2, 2, 2)
    assert m.finite_count == 1


def test_finite_statistics_skip_positions_where_either_side_is_not_finite():
    m = compute_metrics(t([1.0, NAN, 3.0, 100.0]), t([1.0, 5.0, 4.0, INF]), atol=0.5)
    assert m.finite_count == 2
    assert m.max_abs == 1.0 and m.mean_abs == 0.5
    assert m.mismatch_count == 1 and m.mismatch_fraction == 0.5
    assert m.worst_index == (2,)


def test_first_nonfinite_mismatch_index_is_in_the_original_shape():
    ref = torch.zeros(2, 3, 4)
    out = ref.clone()
    out[1, 0, 2] = NAN
    out[1, 2, 0] = INF
    m = compute_metrics(out, ref, chunk_elements=5)
    assert m.first_nonfinite_mismatch_index == (1, 0, 2)
    assert m.nonfinite_mismatch_count == 2


def test_all_positions_nonfinite_leaves_no_worst_element():
    m = compute_metrics(t([NAN, NAN]), t([1.0, 2.0]))
    assert m.finite_count == 0 and m.worst_index is None and m.worst_out is None
    assert m.mismatch_fraction == 0.0 and m.mean_abs == 0.0


# --- zeros and empty --------------------------------------------------------------------------

def test_two_zero_vectors_are_identical():
    m = compute_metrics(torch.zeros(5), torch.zeros(5))
    assert m.cosine == 1.0 and m.rel_l2 == 0.0 and m.max_abs == 0.0


def test_zero_output_against_nonzero_reference():
    m = compute_metrics(torch.zeros(3), t([1.0, 2.0, 2.0]))
    assert m.cosine == 0.0
    assert m.rel_l2 == pytest.approx(1.0)


def test_nonzero_output_against_zero_reference():
    m = compute_metrics(t([0.0, 1e-3]), torch.zeros(2), atol=1e-4)
    assert m.cosine == 0.0
    assert m.rel_l2 == INF
    assert m.needed_rtol == INF


@pytest.mark.parametrize("shape", [(0,), (3, 0, 2)])
def test_empty_tensors(shape):
    m = compute_metrics(torch.empty(shape), torch.empty(shape), atol=1e-3, rtol=1e-3)
    assert m.numel == 0 and m.finite_count == 0
    assert m.cosine == 1.0
    assert m.max_abs == m.mean_abs == m.rel_l2 == m.max_rel == 0.0
    assert m.mismatch_count == 0 and m.mismatch_fraction == 0.0
    assert m.worst_index is None and m.nonfinite_positions_agree


def test_zero_dimensional_tensor():
    m = compute_metrics(torch.tensor(2.0), torch.tensor(1.5))
    assert m.numel == 1 and m.max_abs == 0.5 and m.worst_index == ()


# --- ULP --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, one_bits", [(torch.bfloat16, 0x3F80), (torch.float16, 0x3C00)])
def test_ulp_distance_of_adjacent_values(dtype, one_bits):
    out = from_bits([one_bits + 1, one_bits - 1, 0x8000 | (one_bits + 1)], dtype)
    ref = from_bits([one_bits, one_bits, 0x8000 | one_bits], dtype)  # 1, 1, -1
    m = compute_metrics(out, ref)
    assert m.ulp_max == 1 and m.ulp_over_1_count == 0
    assert m.max_abs > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ulp_distance_across_zero(dtype):
    # +0 vs -0: 0 ULP. Smallest positive subnormal vs +0: 1. vs -0: 1. vs the smallest negative: 2.
    out = from_bits([0x0000, 0x0001, 0x0001, 0x0001], dtype)
    ref = from_bits([0x8000, 0x0000, 0x8000, 0x8001], dtype)
    pairs = [compute_metrics(out[i : i + 1], ref[i : i + 1]).ulp_max for i in range(4)]
    assert pairs == [0, 1, 1, 2]
    assert compute_metrics(out[:1], ref[:1]).max_abs == 0.0


def test_ulp_counts_elements_more_than_one_ulp_apart():
    ref = from_bits([0x3F80, 0x3F80, 0x3F80, 0x3F80, 0xBF80], torch.bfloat16)
    out = from_bits([0x3F80, 0x3F81, 0x3F82, 0x3F7B, 0x3F80], torch.bfloat16)  # 0, 1, 2, 5, 1.0 vs -1.0
    m = compute_metrics(out, ref)
    assert m.ulp_max == 2 * 0x3F80
    assert m.ulp_over_1_count == 3


def test_ulp_is_only_for_16_bit_floats_of_the_same_dtype():
    x = torch.randn(8)
    assert compute_metrics(x, x).ulp_max is None
    assert compute_metrics(x.bfloat16(), x.double()).ulp_max is None
    assert compute_metrics(x.half(), x.half()).ulp_max == 0


def test_ulp_ignores_nonfinite_positions():
    out = t([NAN, 1.0], torch.bfloat16)
    ref = t([1.0, 1.0], torch.bfloat16)
    assert compute_metrics(out, ref).ulp_max == 0


# --- chunking and shape -----------------------------------------------------------------------

def _messy_pair(dtype):
    gen = torch.Generator().manual_seed(1)
    ref = torch.randn(1000, generator=gen)
    out = ref + 0.05 * torch.randn(1000, generator=gen)
    out[[10, 500]] = NAN
    ref[[10, 777]] = NAN
    out[900] = INF
    ref[901] = -INF
    return out.to(dtype), ref.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_equals_unchunked(dtype):
    out, ref = _messy_pair(dtype)
    whole = compute_metrics(out, ref, atol=1e-3, atol_rms=1e-2, rtol=1e-2)
    assert 0 < whole.mismatch_count < whole.finite_count
    for chunk in (1, 7, 999, 1000, 4096):
        chunked = compute_metrics(out, ref, atol=1e-3, atol_rms=1e-2, rtol=1e-2, chunk_elements=chunk)
        for name, value in whole.to_dict().items():
            other = chunked.to_dict()[name]
            if isinstance(value, float):
                assert other == pytest.approx(value, rel=1e-12, abs=1e-300), (chunk, name)
            else:
                assert other == value, (chunk, name)


def test_worst_element_tie_goes_to_the_first_occurrence_in_every_chunking():
    ref = torch.zeros(1000)
    out = ref.clone()
    out[3] = 2.0
    out[500] = -2.0
    for chunk in (1, 7, 1000):
        assert compute_metrics(out, ref, chunk_elements=chunk).worst_index == (3,)


def test_worst_index_in_a_3d_tensor():
    gen = torch.Generator().manual_seed(2)
    ref = torch.randn(2, 3, 4, generator=gen)
    out = ref + 1e-3
    out[1, 2, 3] = ref[1, 2, 3] - 5.0
    m = compute_metrics(out, ref, chunk_elements=7)
    assert m.worst_index == (1, 2, 3)
    assert m.worst_out == pytest.approx(out[1, 2, 3].item())
    assert m.worst_ref == pytest.approx(ref[1, 2, 3].item())
    assert m.max_abs == pytest.approx(5.0)


def test_noncontiguous_input_reports_indices_of_its_own_shape():
    base = torch.arange(12.0).reshape(3, 4)
    out = base.t()  # (4, 3), not contiguous
    ref = out.contiguous().clone()
    ref[2, 1] += 1.0
    assert compute_metrics(out, ref).worst_index == (2, 1)


def test_cosine_is_accumulated_in_float64():
    # One element off by 2**-10 among 1000 ones: 1 - cosine is ~4.9e-10, below the float32
    # spacing near 1 (6e-8), so float32 accumulation would print 1.0 or 1 - 6e-8.
    ref = torch.ones(1000)
    out = ref.clone()
    out[0] = 1.0 + 2.0**-10
    n, e = 1000, 2.0**-10
    exact = 1.0 - (n - 1 + (1 + e)) / math.sqrt((n - 1 + (1 + e) ** 2) * n)
    m = compute_metrics(out, ref, chunk_elements=64)
    assert 1.0 - m.cosine == pytest.approx(exact, rel=1e-4)
    fp32_cosine = torch.nn.functional.cosine_similarity(out, ref, dim=0).item()
    assert abs((1.0 - fp32_cosine) - exact) > 0.5 * exact


def test_shape_mismatch_is_a_value_error():
    with pytest.raises(ValueError, match=r"shape mismatch: out \(2, 3\) vs ref \(3, 2\)"):
        compute_metrics(torch.zeros(2, 3), torch.zeros(3, 2))


@pytest.mark.parametrize(
    "kwargs", [{"atol": -1.0}, {"rtol": NAN}, {"atol_rms": INF}, {"rel_floor": 0.0}, {"chunk_elements": 0}]
)
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        compute_metrics(torch.zeros(2), torch.zeros(2), **kwargs)


def test_complex_tensors_are_refused():
    with pytest.raises(ValueError, match="complex"):
        compute_metrics(torch.zeros(2, dtype=torch.complex64), torch.zeros(2, dtype=torch.complex64))


# --- dtypes -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_float_dtypes(dtype):
    out, ref = t([1.0, 2.0], dtype), t([1.0, 2.5], dtype)
    m = compute_metrics(out, ref)
    assert m.max_abs == 0.5 and m.out_dtype == str(dtype).removeprefix("torch.")


def test_integers_are_compared_exactly_whatever_the_tolerance():
    m = compute_metrics(t([1, 2, 3], torch.int32), t([1, 2, 4], torch.int32), atol=10.0, rtol=1.0)
    assert m.mismatch_count == 1 and m.max_abs == 1.0
    # 2**53 + 1 and 2**53 are equal in float64, but not as integers.
    big = compute_metrics(t([2**53 + 1], torch.int64), t([2**53], torch.int64), atol=10.0)
    assert big.mismatch_count == 1


def test_bool_tensors():
    m = compute_metrics(t([True, False], torch.bool), t([True, True], torch.bool))
    assert m.mismatch_count == 1
    assert m.cosine == pytest.approx(1 / math.sqrt(2))


def test_error_vs_high_precision_reference():
    ref64 = torch.linspace(-1, 1, 101, dtype=torch.float64)
    m = compute_error_vs_reference(ref64.bfloat16(), ref64)
    assert m.ref_dtype == "float64" and m.ulp_max is None
    # Round to nearest: at most half a bf16 ULP (2**-9 relative) from the reference.
    assert 0 < m.max_abs <= 2.0**-9
    with pytest.raises(ValueError, match="less precise"):
        compute_error_vs_reference(ref64.float(), ref64.bfloat16())


# --- serialization ----------------------------------------------------------------------------

def test_to_dict_is_json_safe_and_round_trips():
    m = compute_metrics(t([NAN, 0.0, 1e-3]), t([NAN, 0.0, 0.0]), atol=1e-4)
    data = m.to_dict()
    assert data["rel_l2"] == "inf" and data["needed_rtol"] == "inf"
    assert data["worst_index"] == [2] and data["ulp_max"] is None
    text = json.dumps(data, allow_nan=False)
    assert LayerMetrics.from_dict(json.loads(text)) == m


# --- the chunked scan against a straightforward whole-tensor float64 computation --------------

def _straightforward(out, ref, *, atol=0.0, rtol=0.0, atol_rms=0.0, rel_floor=1e-6, outlier_factor=None):
    """Every LayerMetrics field the plain way: whole tensors in float64, masks by indexing."""
    shape = tuple(out.shape)
    o, r = out.reshape(-1).double(), ref.reshape(-1).double()
    exact = not out.is_floating_point() and not ref.is_floating_point()
    out_nan, ref_nan, out_inf, ref_inf = o.isnan(), r.isnan(), o.isinf(), r.isinf()
    both = o.isfinite() & r.isfinite()
    disagree = ~(both | (out_nan & ref_nan) | (out_inf & (o == r)))
    finite_ref = r[r.isfinite()]
    ref_rms = math.sqrt((finite_ref * finite_ref).sum().item() / max(finite_ref.numel(), 1))
    absolute = atol + atol_rms * ref_rms
    where = both.nonzero().flatten()
    of, rf = o[both], r[both]
    d, ra = (of - rf).abs(), rf.abs()
    finite = int(both.sum())

    def largest(values):
        return max(0.0, values.max().item()) if values.numel() else 0.0

    def index_of(flat):
        return None if flat is None else tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), shape))

    dot, out_sq, ref_sq, diff_sq = ((a * b).sum().item() for a, b in ((of, rf), (of, of), (rf, rf), (d, d)))
    if diff_sq == 0:
        cosine = 1.0
    elif out_sq == 0 or ref_sq == 0:
        cosine = 0.0
    else:
        cosine = min(1.0, max(-1.0, dot / (math.sqrt(out_sq) * math.sqrt(ref_sq))))
    rel_l2 = (0.0 if diff_sq == 0 else math.inf) if ref_sq == 0 else math.sqrt(diff_sq) / math.sqrt(ref_sq)
    bound = absolute + rtol * ra
    if exact:
        mismatch = (out.reshape(-1) != ref.reshape(-1))[both]
        ratio = torch.zeros_like(d)
    else:
        mismatch = d > bound
        ratio = torch.where(mismatch, d / bound, 0.0)
    worst_flat = int(where[d.argmax()]) if finite else None
    ratio_flat = int(where[ratio.argmax()]) if finite and ratio.max() > 0 else None
    excess = d - absolute
    ulp_max = ulp_over_1 = None
    if out.dtype == ref.dtype and out.dtype in (torch.float16, torch.bfloat16):
        def ordered(x):
            bits = x.reshape(-1).view(torch.int16).to(torch.int64)
            return torch.where(bits < 0, -(bits & 0x7FFF), bits)[both]
        ulp = (ordered(out) - ordered(ref)).abs()
        ulp_max, ulp_over_1 = (int(ulp.max()) if ulp.numel() else 0), int((ulp > 1).sum())
    first_bad = int(disagree.nonzero()[0, 0]) if disagree.any() else None
    return {
        "numel": o.numel(), "finite_count": finite, "cosine": cosine,
        "max_abs": largest(d), "mean_abs": d.sum().item() / finite if finite else 0.0, "rel_l2": rel_l2,
        "max_rel": largest(d / ra.clamp_min(rel_floor)), "ref_max_abs": largest(ra), "ref_rms": ref_rms,
        "effective_atol": absolute, "mismatch_count": int(mismatch.sum()),
        "mismatch_fraction": int(mismatch.sum()) / finite if finite else 0.0,
        "needed_atol": largest(d - rtol * ra),
        "needed_rtol": largest(torch.where(excess > 0, excess / ra, 0.0)),
        "ulp_max": ulp_max, "ulp_over_1_count": ulp_over_1,
        "nan_out": int(out_nan.sum()), "nan_ref": int(ref_nan.sum()), "inf_out": int(out_inf.sum()),
        "inf_ref": int(ref_inf.sum()), "nonfinite_mismatch_count": int(disagree.sum()),
        "first_nonfinite_mismatch_index": index_of(first_bad),
        "worst_index": index_of(worst_flat),
        "worst_out": None if worst_flat is None else o[worst_flat].item(),
        "worst_ref": None if worst_flat is None else r[worst_flat].item(),
        "outlier_count": int((ratio > outlier_factor).sum()) if outlier_factor is not None else 0,
        "worst_bound_ratio": largest(ratio), "worst_bound_index": index_of(ratio_flat),
        "worst_bound_out": None if ratio_flat is None else o[ratio_flat].item(),
        "worst_bound_ref": None if ratio_flat is None else r[ratio_flat].item(),
    }


def _random_pair(seed, shape, out_dtype, ref_dtype, nonfinite):
    gen = torch.Generator().manual_seed(seed)
    size = math.prod(shape)
    ref = torch.randn(size, generator=gen, dtype=torch.float64) * 3
    out = ref + 1e-3 * torch.randn(size, generator=gen, dtype=torch.float64)
    out[torch.randint(0, size, (max(1, size // 500),), generator=gen)] *= 1.5  # a few real outliers
    ref[torch.randint(0, size, (3,), generator=gen)] = 0.0
    if nonfinite:
        for tensor, count in ((out, 7), (ref, 5)):
            places = torch.randint(0, size, (count,), generator=gen)
            tensor[places] = torch.tensor([NAN, INF, -INF, NAN, INF, -INF, NAN], dtype=torch.float64)[:count]
        shared = torch.randint(0, size, (2,), generator=gen)
        out[shared], ref[shared] = NAN, NAN  # agreeing NaN positions too
    return out.to(out_dtype).reshape(shape), ref.to(ref_dtype).reshape(shape)


_FAST_PATH_CASES = [
    # (shape, out dtype, ref dtype, NaN/Inf, tolerances: the built-in policy's, none, others)
    ((1,), torch.float32, torch.float32, False, {}),
    ((7,), torch.float16, torch.float16, True, {"atol": 1e-5, "rtol": 2e-3, "atol_rms": 1.2e-2, "outlier_factor": 4.0}),
    ((7, 11, 13), torch.bfloat16, torch.bfloat16, True,
     {"atol": 1e-5, "rtol": 1.6e-2, "atol_rms": 0.1, "outlier_factor": 4.0}),
    ((3, 10923), torch.float32, torch.float32, True,
     {"atol": 1e-5, "rtol": 1.3e-6, "atol_rms": 8e-5, "outlier_factor": 4.0}),
    ((7, 10001), torch.float32, torch.float32, False, {"atol": 1e-5, "rtol": 1.3e-6, "atol_rms": 8e-5}),
    ((7, 10001), torch.float32, torch.float64, True, {}),  # against an fp64 reference, as the budget does
    ((40003,), torch.bfloat16, torch.float64, False, {}),
    ((40003,), torch.float16, torch.float16, False, {"atol": 1e-3}),
    ((5003,), torch.float64, torch.float64, True, {"atol": 1e-4, "rtol": 1e-3, "outlier_factor": 1.0}),
]


@pytest.mark.parametrize("chunk_elements", [None, 1000])
@pytest.mark.parametrize("shape, out_dtype, ref_dtype, nonfinite, tolerances", _FAST_PATH_CASES,
                         ids=lambda v: "tol" if isinstance(v, dict) else str(v).removeprefix("torch."))
def test_chunked_scan_equals_a_straightforward_float64_computation(shape, out_dtype, ref_dtype, nonfinite,
                                                                   tolerances, chunk_elements):
    """Every field of LayerMetrics, from the chunked scan (fast chunks without NaN/Inf, masked
    chunks with them, the tolerance pass over only the chunks that can mismatch), equals the
    plain whole-tensor computation: counts and indices exactly, floats up to float64 rounding."""
    out, ref = _random_pair(math.prod(shape), shape, out_dtype, ref_dtype, nonfinite)
    m = compute_metrics(out, ref, chunk_elements=chunk_elements, **tolerances)
    expected = _straightforward(out, ref, **tolerances)
    got = m.to_dict()
    for name, value in expected.items():
        other = got[name]
        other = tuple(other) if isinstance(other, list) else other
        if isinstance(value, float):
            other = float(other)
            assert other == pytest.approx(value, rel=1e-12, abs=1e-300, nan_ok=True), (name, other, value)
        else:
            assert other == value, (name, other, value)
    if nonfinite:
        assert m.nonfinite_mismatch_count > 0 and m.finite_count < m.numel
    if tolerances.get("atol_rms") and m.numel >= 1000:
        assert 0 < m.mismatch_count < m.finite_count, "the case should exercise the tolerance pass"


@pytest.mark.parametrize("nonfinite", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_metrics_and_errors_in_one_scan_equal_the_three_separate_calls(dtype, nonfinite):
    from parity.judge.metrics import compute_metrics_and_errors

    reference, _ = _random_pair(7, (3, 10923), torch.float64, torch.float64, nonfinite)
    golden = reference.to(dtype)
    out, _ = _random_pair(8, (3, 10923), dtype, dtype, nonfinite)
    tolerances = {"atol": 1e-5, "rtol": 1.3e-6, "atol_rms": 8e-5, "outlier_factor": 4.0}
    for chunk_elements in (None, 1000):
        together = compute_metrics_and_errors(out, golden, reference, chunk_elements=chunk_elements, **tolerances)
        apart = (compute_metrics(out, golden, chunk_elements=chunk_elements, **tolerances),
                 compute_error_vs_reference(out, reference, chunk_elements=chunk_elements),
                 compute_error_vs_reference(golden, reference, chunk_elements=chunk_elements))
        assert [m.to_dict() for m in together] == [m.to_dict() for m in apart]


def test_metrics_and_errors_refuse_what_the_separate_calls_refuse():
    from parity.judge.metrics import compute_metrics_and_errors

    x = torch.zeros(4)
    with pytest.raises(ValueError, match="less precise"):
        compute_metrics_and_errors(x, x, x.bfloat16())
    with pytest.raises(ValueError, match="shape mismatch"):
        compute_metrics_and_errors(x, x, torch.zeros(5, dtype=torch.float64))


# --- differential: the fused scan against the per-function results and the plain computation ----

# Unit roundoff of float64. A float64 sum of n terms, in any order or blocking, is within
# gamma_n * sum|terms| of the exact sum, gamma_n = n*u / (1 - n*u) (Higham, Accuracy and
# Stability of Numerical Algorithms, 2nd ed., eq. 4.4); the scan and the plain computation each
# make that error, so two results of a sum of n non-negative terms differ by at most
# 2 * gamma_n relative, and a cosine (|dot| <= |o| |r| by Cauchy-Schwarz) by 4 * gamma_n absolute.
_U64 = 2.0**-53
_EXACT_FIELDS = ("numel", "finite_count", "mismatch_count", "nan_out", "nan_ref", "inf_out", "inf_ref",
                 "nonfinite_mismatch_count", "first_nonfinite_mismatch_index", "worst_index", "worst_out",
                 "worst_ref", "max_abs", "ref_max_abs", "max_rel", "needed_atol", "ulp_max", "ulp_over_1_count",
                 "outlier_count", "worst_bound_ratio", "worst_bound_index", "worst_bound_out", "worst_bound_ref",
                 "needed_rtol")


def _gamma(n: int) -> float:
    return n * _U64 / (1 - n * _U64)


def _differential_case(case_id: str, seed: int, size: int, dtype: torch.dtype, nonfinite: str, golden_kind: str,
                       chunk: int):
    """(out, golden, fp64-or-fp32 reference) drawn on the CPU from the case and its seed."""
    gen = torch.Generator().manual_seed(seed)
    reference = torch.randn(size, generator=gen, dtype=torch.float64) * 2
    noise = 10 * torch.finfo(dtype).eps if dtype != torch.float64 else 1e-12
    out = (reference * (1 + noise * torch.randn(size, generator=gen, dtype=torch.float64))).to(dtype)
    if golden_kind == "zeros":  # an all-zero golden and reference; this host's output is not zero
        reference.zero_()
    golden = reference.to(dtype)
    if size > 10:
        out[torch.randint(0, size, (max(1, size // 300),), generator=gen)] *= 1.01  # a few mismatches
    if nonfinite != "none":
        # the first and last elements, both sides of every chunk boundary, and random places
        places = {0, size - 1} | {b for k in range(chunk, size, chunk) for b in (k - 1, k)}
        places |= set(torch.randint(0, size, (5,), generator=gen).tolist())
        values = [NAN, INF, -INF]
        for i, place in enumerate(sorted(places)):
            value = values[(i + seed) % 3]
            if nonfinite == "agree" or (i % 3 == 0 and len(places) > 2):
                out[place] = value
                golden[place] = value
                reference[place] = value
            elif i % 3 == 1:
                out[place] = value  # only this host
            else:
                golden[place] = value  # only the golden (the reference keeps its finite value)
    ref_dtype = torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32
    return out, golden, reference.to(ref_dtype)


_DIFFERENTIAL_CASES = []
for _dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
    for _size, _chunk in ((1, 1), (2, 1), (7, 3), (1000, 17), (4099, 1024), (10007, 4096), (65537, None)):
        for _nonfinite in ("none", "agree", "disagree"):
            for _golden_kind in ("random", "zeros"):
                if _golden_kind == "zeros" and _size not in (7, 4099):
                    continue
                _name = str(_dtype).removeprefix("torch.")
                _DIFFERENTIAL_CASES.append(
                    (f"{_name}-n{_size}-c{_chunk}-{_nonfinite}-{_golden_kind}", _dtype, _size, _chunk,
                     _nonfinite, _golden_kind))

_DIFFERENTIAL_TOLERANCES = [
    {},
    {"atol": 1e-5, "rtol": 1.3e-6, "atol_rms": 8e-5, "outlier_factor": 4.0},
    {"atol": 0.0, "rtol": 1e-3, "outlier_factor": 1.0},
]


@pytest.mark.slow  # an exhaustive differential check: seconds per case
@pytest.mark.parametrize("tolerances", _DIFFERENTIAL_TOLERANCES, ids=["none", "atol-rms", "rtol-only"])
@pytest.mark.parametrize("case_id, dtype, size, chunk, nonfinite, golden_kind", _DIFFERENTIAL_CASES,
                         ids=[case[0] for case in _DIFFERENTIAL_CASES])
def test_fused_scan_equals_the_separate_calls_and_the_plain_computation(case_id, dtype, size, chunk, nonfinite,
                                                                        golden_kind, tolerances):
    """compute_metrics_and_errors against compute_metrics + compute_error_vs_reference (identical,
    field by field: they share the per-chunk work, not the arithmetic order) and against the plain
    whole-tensor float64 computation (counts, maxima, indices and the values at them exactly; sums
    within the float64 bound above)."""
    from parity.judge.metrics import compute_metrics_and_errors

    seed = sum(map(ord, case_id)) + len(tolerances)
    out, golden, reference = _differential_case(case_id, seed, size, dtype, nonfinite, golden_kind, chunk or size)
    together = compute_metrics_and_errors(out, golden, reference, chunk_elements=chunk, **tolerances)
    apart = (compute_metrics(out, golden, chunk_elements=chunk, **tolerances),
             compute_error_vs_reference(out, reference, chunk_elements=chunk),
             compute_error_vs_reference(golden, reference, chunk_elements=chunk))
    for fused, separate in zip(together, apart):
        assert json.dumps(fused.to_dict(), sort_keys=True) == json.dumps(separate.to_dict(), sort_keys=True)

    bound = _gamma(size)
    pairs = ((out, golden, tolerances), (out, reference, {}), (golden, reference, {}))
    for got, (first, second, tol) in zip(together, pairs):
        expected = _straightforward(first, second, **tol)
        # The absolute term atol + atol_rms * RMS(ref) holds a sum; the fields that depend on it are
        # compared exactly given the scan's own term (the term itself within the sum's bound).
        plain_rms = expected.pop("effective_atol")
        assert abs(got.effective_atol - plain_rms) <= 4 * bound * plain_rms, (got.effective_atol, plain_rms)
        exact_tol = {**tol, "atol": got.effective_atol, "atol_rms": 0.0}
        expected.update({name: value for name, value in _straightforward(first, second, **exact_tol).items()
                         if name in _EXACT_FIELDS})
        for name, value in expected.items():
            other = getattr(got, name)
            if name in _EXACT_FIELDS:
                if isinstance(value, float) and math.isnan(value):
                    assert math.isnan(other), (name, other, value)
                else:
                    assert other == value, (name, other, value)
            elif name == "cosine":
                assert abs(float(other) - value) <= 4 * bound, (name, other, value)
            elif name in ("mean_abs", "rel_l2", "ref_rms", "mismatch_fraction"):
                if math.isinf(value) or value == 0.0:
                    assert float(other) == value, (name, other, value)
                else:
                    assert abs(float(other) - value) <= 4 * bound * abs(value), (name, other, value)
            else:
                raise AssertionError(f"field {name} not classified ({other!r}, {value!r})")
    if golden_kind == "zeros" and nonfinite == "none":
        assert together[0].rel_l2 == math.inf and together[0].cosine == 0.0
    if nonfinite == "disagree":
        assert together[0].nonfinite_mismatch_count > 0
