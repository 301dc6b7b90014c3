"""Tests of parity.metrics against hand-computed values."""
import json
import math

import pytest
import torch

from parity.metrics import LayerMetrics, compute_error_vs_reference, compute_metrics

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
