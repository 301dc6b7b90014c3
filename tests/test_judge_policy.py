"""Tests of parity.judge.policy: defaults, overrides, config loading, the judge and the error budget."""
import dataclasses
import json
import math

import pytest
import torch

import parity.judge.policy as policy_module
from parity.base.errors import UsageError
from parity.kernels.layout import layout_from_block_mask
from parity.kernels.reference import reference_attention
from parity.kernels.testing import random_qkv
from parity.judge.metrics import compute_error_vs_reference, compute_metrics
from parity.judge.policy import DEFAULT_TOLERANCES, LayerOverride, Policy, Tolerance, dtype_class, load_policy
from parity.judge.checks import ErrorBudget, budget_floors, judge, measure, ulp_at


def judged(out, ref, tol, **kwargs):
    return judge(measure(out, ref, tol), tol, **kwargs)


def loose(**changes):
    """A tolerance that passes everything except what the test sets."""
    base = Tolerance(atol=0.0, rtol=0.0, max_mismatch_fraction=1.0, min_cosine=-1.0, max_rel_l2=math.inf)
    return dataclasses.replace(base, **changes)


# --- defaults ---------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "dtype, expected",
    [
        (torch.bfloat16, "bf16"), ("bfloat16", "bf16"), ("torch.bfloat16", "bf16"), ("bf16", "bf16"),
        (torch.float16, "fp16"), ("half", "fp16"), (torch.float32, "fp32"), ("float", "fp32"),
        (torch.float64, "fp64"), ("double", "fp64"),
        (torch.int32, "integer"), (torch.uint8, "integer"), (torch.bool, "integer"), ("int64", "integer"),
        (torch.float8_e4m3fn, "other"), ("float8_e5m2", "other"),
    ],
)
def test_dtype_class(dtype, expected):
    assert dtype_class(dtype) == expected


def test_unknown_dtype_name():
    with pytest.raises(ValueError, match="unknown dtype 'fp12'"):
        dtype_class("fp12")


def test_defaults_resolve_per_dtype():
    policy = Policy()
    assert policy.resolve("model.layers.0.attn", torch.bfloat16) == DEFAULT_TOLERANCES["bf16"]
    assert policy.resolve("x", "float16") == DEFAULT_TOLERANCES["fp16"]
    assert policy.resolve("x", torch.float32).atol == 1e-5
    exact = policy.resolve("token_ids", torch.int64)
    assert (exact.atol, exact.rtol, exact.max_mismatch_fraction) == (0.0, 0.0, 0.0)


# The cross-implementation differences behind the defaults (policy module docstring): "op" from
# parity/NUMERICS.md (cosine, rel_l2, max abs; attention output RMS 0.126), "decoder" the worst layer of
# parity's decoder subject, reference vs triton (rel_l2, 1 - cosine, atol_rms for no mismatch).
MEASURED = {
    "bf16": dict(op_cosine=0.9999995, op_rel_l2=9.8e-4, op_max_abs=3.9e-3,
                 decoder_rel_l2=1.31e-2, decoder_1_minus_cosine=8.6e-5, decoder_atol_rms=6.3e-2),
    "fp16": dict(op_cosine=0.99999999, op_rel_l2=1.2e-4, op_max_abs=2.4e-4,
                 decoder_rel_l2=1.64e-3, decoder_1_minus_cosine=1.35e-6, decoder_atol_rms=8.6e-3),
    "fp32": dict(op_cosine=1 - 7e-14, op_rel_l2=5.2e-7, op_max_abs=1.4e-6,
                 decoder_rel_l2=7.4e-7, decoder_1_minus_cosine=2.7e-13, decoder_atol_rms=0.0),
}
OP_RMS = 0.126
# The mildest real bugs rel_l2 and cosine must catch: a dropped key block (S=1000, keys 768-831).
BUG_REL_L2, BUG_1_MINUS_COSINE = 5.2e-2, 1.4e-3


@pytest.mark.parametrize("dtype", sorted(MEASURED))
def test_defaults_have_headroom_over_measured_differences_and_catch_bugs(dtype):
    tol, measured = DEFAULT_TOLERANCES[dtype], MEASURED[dtype]
    assert tol.max_rel_l2 >= 20 * measured["op_rel_l2"]
    assert tol.max_rel_l2 >= 1.5 * measured["decoder_rel_l2"]
    assert tol.max_rel_l2 <= BUG_REL_L2 / 2
    assert 1 - tol.min_cosine >= 10 * (1 - measured["op_cosine"])
    assert 1 - tol.min_cosine >= 1.5 * measured["decoder_1_minus_cosine"]
    assert 1 - tol.min_cosine <= BUG_1_MINUS_COSINE / 2
    assert tol.atol + tol.atol_rms * OP_RMS >= 2.5 * measured["op_max_abs"]
    assert tol.atol_rms >= 1.25 * measured["decoder_atol_rms"]


# --- overrides --------------------------------------------------------------------------------

def test_glob_overrides_apply_in_order_and_later_ones_win():
    policy = Policy(overrides=[
        LayerOverride("model.*", {"max_rel_l2": 3e-2, "atol": 2e-2}),
        LayerOverride("model.layers.3.*", {"max_rel_l2": 5e-2}),
    ])
    deep = policy.resolve("model.layers.3.attn", torch.bfloat16)
    assert deep.max_rel_l2 == 5e-2 and deep.atol == 2e-2
    assert deep.min_cosine == DEFAULT_TOLERANCES["bf16"].min_cosine
    assert policy.resolve("model.layers.1.attn", torch.bfloat16).max_rel_l2 == 3e-2
    assert policy.resolve("lm_head", torch.bfloat16) == DEFAULT_TOLERANCES["bf16"]

    reversed_order = Policy(overrides=list(reversed(policy.overrides)))
    assert reversed_order.resolve("model.layers.3.attn", torch.bfloat16).max_rel_l2 == 3e-2


def test_glob_star_crosses_dots_and_matching_is_case_sensitive():
    policy = Policy(overrides=[LayerOverride("*.attn", {"atol": 0.5})])
    assert policy.resolve("model.layers.0.attn", "bf16").atol == 0.5
    assert policy.resolve("model.layers.0.ATTN", "bf16").atol == DEFAULT_TOLERANCES["bf16"].atol


def test_override_with_unknown_field_is_refused():
    with pytest.raises(ValueError, match="min_cos"):
        LayerOverride("*", {"min_cos": 0.9})


def test_tolerance_validates_its_fields():
    with pytest.raises(ValueError, match="Tolerance.atol: must be >= 0"):
        dataclasses.replace(DEFAULT_TOLERANCES["bf16"], atol=-1e-3)
    with pytest.raises(ValueError, match="Tolerance.nan_policy"):
        dataclasses.replace(DEFAULT_TOLERANCES["bf16"], nan_policy="sometimes")


# --- loading ----------------------------------------------------------------------------------

CONFIG = """
[defaults]
nan_policy = "ignore"

[defaults.bf16]
min_cosine = 0.9999
atol = 3e-2

[defaults.float32]
max_abs = 1e-4

[budget]
k = 2.0

[[layers]]
match = "model.layers.*"
max_rel_l2 = 3e-2
max_ulp = 2

[[layers]]
match = "model.layers.3.*"
max_rel_l2 = 5e-2
max_ulp = "off"
reason = "deepest layer: error grows with depth"
"""


def _check_config(policy):
    bf16 = policy.resolve("lm_head", torch.bfloat16)
    assert bf16.min_cosine == 0.9999 and bf16.atol == 3e-2 and bf16.nan_policy == "ignore"
    assert bf16.rtol == DEFAULT_TOLERANCES["bf16"].rtol
    assert bf16.budget_k == 2.0 and bf16.budget_floor == 0.0 and bf16.budget_ulps == 64
    assert policy.resolve("lm_head", torch.float32).max_abs == 1e-4
    assert policy.resolve("lm_head", torch.float16).max_abs is None
    assert policy.resolve("lm_head", torch.float16).nan_policy == "ignore"
    layer1 = policy.resolve("model.layers.1.mlp", torch.bfloat16)
    assert (layer1.max_rel_l2, layer1.max_ulp, layer1.min_cosine) == (3e-2, 2, 0.9999)
    layer3 = policy.resolve("model.layers.3.mlp", torch.bfloat16)
    assert (layer3.max_rel_l2, layer3.max_ulp) == (5e-2, None)
    assert policy.overrides[1].reason == "deepest layer: error grows with depth"


def test_load_from_toml(tmp_path):
    path = tmp_path / "parity.toml"
    path.write_text(CONFIG)
    policy = load_policy(path)
    _check_config(policy)
    assert policy.source == str(path)


def test_load_from_pyproject(tmp_path):
    tables = CONFIG.replace("[defaults", "[tool.parity.defaults").replace("[budget]", "[tool.parity.budget]")
    tables = tables.replace("[[layers]]", "[[tool.parity.layers]]")
    path = tmp_path / "pyproject.toml"
    path.write_text('[project]\nname = "someone"\n' + tables)
    _check_config(load_policy(path))
    _check_config(Policy.from_pyproject(path))


def test_pyproject_without_tool_parity(tmp_path):
    path = tmp_path / "pyproject.toml"
    path.write_text('[project]\nname = "someone"\n[tool.black]\nline-length = 100\n')
    with pytest.raises(UsageError, match=r"pyproject.toml: tool.parity: no \[tool.parity\] table"):
        load_policy(path)


def test_empty_config_is_the_builtin_defaults(tmp_path):
    path = tmp_path / "parity.toml"
    path.write_text("")
    assert dict(load_policy(path).dtype_defaults) == dict(DEFAULT_TOLERANCES)


BAD_CONFIGS = [
    ("[default]\natol = 1e-3\n", "default: unknown key"),
    ("[defaults.bf16]\nmin_cos = 0.9\n", "defaults.bf16.min_cos: unknown key"),
    ('[defaults.fp32]\natol = "small"\n', "defaults.fp32.atol: expected a number, got str 'small'"),
    ("[defaults.fp32]\natol = true\n", "defaults.fp32.atol: expected a number, got bool"),
    ("[defaults.fp32]\natol = nan\n", "defaults.fp32.atol: expected a number, got nan"),
    ("[defaults.fp32]\natol = inf\n", "defaults.fp32.atol: must be finite"),
    ("[defaults.fp8]\natol = 1e-3\n", "defaults.fp8: unknown dtype"),
    ("[defaults.bf16]\natol = 1\n[defaults.bfloat16]\natol = 2\n", "defaults.bfloat16: given twice"),
    ('[defaults]\nnan_policy = "sometimes"\n', "defaults.nan_policy: must be one of 'positions', 'ignore'"),
    ("[defaults]\nmax_mismatch_fraction = 2\n", "defaults.max_mismatch_fraction: is a fraction"),
    ("[defaults]\nmin_cosine = 1.5\n", "defaults.min_cosine: must be between -1 and 1"),
    ("[defaults]\nbudget_k = 2.0\n[budget]\nk = 3.0\n", "defaults.budget_k: also set in [budget]"),
    ("[budget]\nkk = 2.0\n", "budget.kk: unknown key"),
    ("[budget]\nk = -2.0\n", "budget.k: must be >= 0"),
    ("[defaults]\nbf16 = 3\n", "defaults.bf16: expected a table"),
    ("budget = 2\n", "budget: expected a table"),
    ('[[layers]]\nmatch = "a.*"\nrtol = -1e-3\n', "layers[0].rtol: must be >= 0"),
    ('[[layers]]\nmatch = "a"\n[[layers]]\nmatch = "b"\nmax_ulp = 1.5\n',
     "layers[1].max_ulp: expected an integer"),
    ('[[layers]]\nmax_rel_l2 = 1e-2\n', "layers[0].match: required"),
    ('[[layers]]\nmatch = "a"\nreason = 3\n', "layers[0].reason: expected a string"),
    ('[[layers]]\nmatch = "a"\nmin_cos = 0.9\n', "layers[0].min_cos: unknown key"),
    ("layers = 3\n", "layers: expected an array of tables"),
    ("[defaults\natol = 1\n", "invalid TOML"),
]


@pytest.mark.parametrize("text, expected", BAD_CONFIGS)
def test_bad_config_names_the_file_and_the_key(tmp_path, text, expected):
    path = tmp_path / "parity.toml"
    path.write_text(text)
    with pytest.raises(UsageError) as info:
        load_policy(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert expected in message
    assert "\n" not in message


def test_bad_pyproject_names_the_full_key(tmp_path):
    path = tmp_path / "pyproject.toml"
    path.write_text('[tool.parity.defaults.bf16]\natol = "x"\n')
    expected = r"pyproject.toml: tool.parity.defaults.bf16.atol: expected a number"
    with pytest.raises(UsageError, match=expected):
        load_policy(path)


def test_missing_file(tmp_path):
    path = tmp_path / "nowhere.toml"
    with pytest.raises(UsageError, match=rf"{path}: policy file not found"):
        load_policy(path)


def test_without_a_toml_reader(tmp_path, monkeypatch):
    path = tmp_path / "parity.toml"
    path.write_text("")
    monkeypatch.setattr(policy_module, "tomllib", None)
    with pytest.raises(UsageError, match="needs Python >= 3.11 or the 'tomli' package"):
        load_policy(path)


def test_policy_to_dict_is_json_safe(tmp_path):
    path = tmp_path / "parity.toml"
    path.write_text(CONFIG)
    data = load_policy(path).to_dict()
    json.dumps(data, allow_nan=False)
    assert data["layers"][1] == {
        "match": "model.layers.3.*", "max_rel_l2": 5e-2, "max_ulp": None,
        "reason": "deepest layer: error grows with depth",
    }


# --- judge ------------------------------------------------------------------------------------

def test_identical_tensors_pass_with_needed_values():
    x = torch.randn(100, generator=torch.Generator().manual_seed(0))
    tol = dataclasses.replace(DEFAULT_TOLERANCES["fp32"], budget_k=None)
    verdict = judged(x, x.clone(), tol)
    assert verdict.passed and verdict.reasons == [] and verdict.notes == []
    assert verdict.needed == {
        "max_mismatch_fraction": 0.0, "atol": 0.0, "atol_rms": 0.0, "rtol": 0.0, "outlier_factor": 0.0,
        "min_cosine": 1.0, "max_rel_l2": 0.0, "max_bias": 0.0,
    }


def test_the_default_budget_without_reference_metrics_is_noted():
    """The defaults configure the budget for floating dtypes; judge() called without an
    ErrorBudget says it could not check it (compare drops the budget where the bundle has no
    reference, so this never reaches a report from a bundle without references)."""
    x = torch.randn(10, generator=torch.Generator().manual_seed(0))
    verdict = judged(x, x.clone(), DEFAULT_TOLERANCES["bf16"])
    assert verdict.passed and verdict.notes == ["error budget not checked: no metrics against a high-precision reference"]


def test_scale_error_fails_rel_l2_and_mismatch_but_not_cosine():
    ref = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    out = ref * 1.1
    tol = DEFAULT_TOLERANCES["fp32"]
    verdict = judged(out, ref, tol)
    assert not verdict.passed
    assert len(verdict.reasons) == 4
    assert verdict.reasons[0].startswith("mismatch_fraction 1.0e0 > 5.0e-5 (998 of 1000 elements outside")
    # 10% of an element is far beyond 4x an fp32 bound for all but the elements nearest zero
    assert verdict.reasons[1].startswith("outliers: 9") and "beyond 4x their bound" in verdict.reasons[1]
    assert verdict.reasons[2] == "rel_l2 1.0e-1 > 2.0e-5"
    # a pure scale: all of the error lies along the reference
    assert verdict.reasons[3].startswith("biased: error projected on the reference +0.1 (|bias| 1.0e-1 > 1.0e-6")
    assert verdict.needed["max_rel_l2"] == pytest.approx(0.1, rel=1e-6)
    assert verdict.needed["min_cosine"] == pytest.approx(1.0)
    metrics = measure(out, ref, tol)
    assert verdict.needed["rtol"] == metrics.needed_rtol
    assert verdict.needed["atol"] == pytest.approx(metrics.needed_atol - tol.atol_rms * metrics.ref_rms)
    assert verdict.needed["atol_rms"] == pytest.approx((metrics.needed_atol - tol.atol) / metrics.ref_rms)


def test_reason_for_each_failed_check():
    ref = torch.tensor([1.0, 2.0, 0.5, -1.0])
    out = ref + torch.tensor([0.03125, 0.0, 0.0, 0.0])
    assert judged(out, ref, loose(max_abs=1e-2)).reasons == ["max_abs 3.1e-2 > 1.0e-2"]
    # just enough digits that the two numbers differ
    assert judged(out, ref, loose(max_abs=3.1e-2)).reasons == ["max_abs 3.12e-2 > 3.10e-2"]
    # 0.03125 / ||ref|| (2.5) = 1.25e-2, which float64 holds a hair above the tie
    assert judged(out, ref, loose(max_rel_l2=1e-3)).reasons == ["rel_l2 1.3e-2 > 1.0e-3"]
    # 6.28125 / sqrt(6.3134765625 * 6.25) = 0.999935: near 1 a cosine is written 1-x, as in the table
    assert judged(out, ref, loose(min_cosine=0.99999)).reasons == ["cosine 1-6.5e-5 < 1-1.0e-5"]
    mismatch = judged(out, ref, loose(atol=1e-2, max_mismatch_fraction=0.2)).reasons
    assert mismatch == [
        "mismatch_fraction 2.5e-1 > 2.0e-1 (1 of 4 elements outside atol 1.0e-2 + rtol 0.0e0*|ref|; "
        "largest |out - ref| at (0,): out 1.03125, ref 1.0)"
    ]


def test_mismatch_bound_scales_with_the_reference_rms():
    ref = torch.tensor([3.0, 4.0, 0.0, 0.0])  # rms 2.5
    out = ref + torch.tensor([0.0, 0.0, 0.2, 0.3])
    tol = loose(atol=1e-3, atol_rms=0.1, max_mismatch_fraction=0.0)
    verdict = judged(out, ref, tol)
    assert verdict.reasons == [
        "mismatch_fraction 2.5e-1 > 0.0e0 (1 of 4 elements outside 2.5e-1 (atol 1.0e-3 + atol_rms 1.0e-1 "
        "x ref rms 2.5e0) + rtol 0.0e0*|ref|; largest |out - ref| at (3,): out 0.30000001192092896, ref 0.0)"
    ]
    assert verdict.needed["atol_rms"] == pytest.approx((0.3 - 1e-3) / 2.5, rel=1e-6)
    assert verdict.needed["atol"] == pytest.approx(0.3 - 0.25, rel=1e-6)
    # the same error on a reference ten times larger is benign
    assert judged(ref * 10 + (out - ref), ref * 10, tol).passed


def test_needed_values_would_pass():
    gen = torch.Generator().manual_seed(5)
    ref = torch.randn(500, generator=gen)
    out = ref + 1e-2 * torch.randn(500, generator=gen)
    tol = loose(atol=1e-3, rtol=1e-3, max_mismatch_fraction=0.0, min_cosine=0.99999999,
                max_rel_l2=1e-4, max_abs=1e-4)
    verdict = judged(out, ref, tol)
    assert len(verdict.reasons) == 4
    relaxed_by_rms_term = dataclasses.replace(tol, atol_rms=verdict.needed["atol_rms"] * (1 + 1e-9))
    assert judged(out, ref, relaxed_by_rms_term).reasons[0].startswith("cosine")
    verdict = judged(out, ref, tol)
    assert len(verdict.reasons) == 4
    relaxed = dataclasses.replace(
        tol,
        atol=verdict.needed["atol"] * (1 + 1e-9),
        atol_rms=0.0,
        min_cosine=verdict.needed["min_cosine"],
        max_rel_l2=verdict.needed["max_rel_l2"],
        max_abs=verdict.needed["max_abs"],
    )
    assert judged(out, ref, relaxed).passed


def test_nonfinite_positions_fail_under_positions_and_pass_under_ignore():
    ref = torch.tensor([1.0, 2.0, float("inf"), 4.0])
    out = torch.tensor([1.0, float("nan"), float("inf"), 4.0])
    verdict = judged(out, ref, loose(nan_policy="positions"))
    assert not verdict.passed
    assert verdict.reasons == [
        "NaN/Inf positions differ at 1 of 4 elements (out: 1 NaN, 1 Inf; ref: 0 NaN, 1 Inf); first at (1,)"
    ]
    assert judged(out, ref, loose(nan_policy="ignore")).passed
    # Agreeing NaN/Inf positions pass.
    assert judged(out, out.clone(), loose(nan_policy="positions")).passed


def test_max_ulp_for_bf16():
    ref = torch.tensor([1.0, 1.0, 1.0], dtype=torch.bfloat16)
    one_ulp = 2.0**-7
    out = torch.tensor([1.0, 1.0 + one_ulp, 1.0 + 2 * one_ulp], dtype=torch.bfloat16)
    verdict = judged(out, ref, loose(max_ulp=1))
    assert verdict.reasons == ["ulp_max 2 > 1 (1 elements more than 1 ULP apart)"]
    assert verdict.needed["max_ulp"] == 2
    assert judged(out, ref, loose(max_ulp=2)).passed


def test_max_ulp_on_fp32_is_a_note_not_a_failure():
    x = torch.randn(10)
    verdict = judged(x, x + 1.0, loose(max_ulp=1))
    assert verdict.passed and "max_ulp" not in verdict.needed
    assert verdict.notes and verdict.notes[0].startswith("max_ulp not checked")


def test_judge_refuses_metrics_computed_with_other_tolerances():
    x = torch.randn(10)
    metrics = compute_metrics(x, x, atol=1e-3, rtol=0.0)
    with pytest.raises(ValueError, match=r"compute them with measure\(out, ref, tol\)"):
        judge(metrics, loose(atol=1e-2))
    with pytest.raises(ValueError, match="atol_rms"):
        judge(compute_metrics(x, x, atol=1e-3), loose(atol=1e-3, atol_rms=0.1))


def test_verdict_to_dict_is_json_safe():
    verdict = judged(torch.tensor([1e-3, 0.0]), torch.zeros(2), loose(atol=1e-4, max_rel_l2=1.0))
    data = verdict.to_dict()
    assert data["passed"] is False
    assert data["needed"]["max_rel_l2"] == "inf" and data["needed"]["rtol"] == "inf"
    assert data["reasons"] == ["rel_l2 inf > 1.0e0"]
    json.dumps(data, allow_nan=False)


# --- error budget -----------------------------------------------------------------------------

def _budget(capture_noise, host_noise):
    gen = torch.Generator().manual_seed(7)
    reference = torch.randn(4000, generator=gen, dtype=torch.float64)
    noise = torch.randn(4000, generator=gen, dtype=torch.float64)
    capture = (reference + capture_noise * noise).float()
    host = (reference + host_noise * noise.flip(0)).float()
    return ErrorBudget(
        capture_vs_reference=compute_error_vs_reference(capture, reference),
        host_vs_reference=compute_error_vs_reference(host, reference),
    )


def test_budget_passes_within_k_times_the_capture_hosts_own_error():
    budget = _budget(1e-3, 1.5e-3)
    tol = loose(budget_k=2.0, budget_floor=0.0)
    x = torch.zeros(3)
    verdict = judged(x, x, tol, budget=budget)
    assert verdict.passed
    assert verdict.needed["budget_k"] == pytest.approx(1.5, rel=1e-2)


def test_budget_fails_beyond_k_times_the_capture_hosts_own_error():
    budget = _budget(1e-3, 2.5e-3)
    tol = loose(budget_k=2.0, budget_floor=1e-5)
    x = torch.zeros(3)
    verdict = judged(x, x, tol, budget=budget)
    assert not verdict.passed
    assert [r.split(" vs ")[0] for r in verdict.reasons] == ["error budget: rel_l2", "error budget: max_abs"]
    # floor = 64 fp32 ulps (relative) + the extra 1e-5
    rel_floor = 64 * 2.0**-23 + 1e-5
    assert "(= 2 x capture host's 1.0e-3 + floor 1.8e-5)" in verdict.reasons[0]
    host, capture = budget.host_vs_reference, budget.capture_vs_reference
    abs_floor = max(64 * 2.0**-23 * capture.ref_max_abs, ulp_at(torch.float32, capture.ref_max_abs)) + 1e-5
    assert budget_floors(tol, torch.float32, capture.ref_max_abs) == {"rel_l2": rel_floor, "max_abs": abs_floor}
    expected_k = max((host.rel_l2 - rel_floor) / capture.rel_l2, (host.max_abs - abs_floor) / capture.max_abs)
    assert verdict.needed["budget_k"] == pytest.approx(expected_k)
    just_enough = dataclasses.replace(tol, budget_k=verdict.needed["budget_k"] * 1.001)
    assert judged(x, x, just_enough, budget=budget).passed


def _exact_capture_budget(host_ulps: int, dtype=torch.float32) -> ErrorBudget:
    """A reference exactly representable in ``dtype`` (so the capture host's error is 0) and a
    host whose first element is ``host_ulps`` ulps of ``dtype`` away from it."""
    reference = torch.linspace(-1, 1, 9, dtype=torch.float64)  # exact in fp32, fp16 and bf16
    host = reference.to(dtype)
    host[0] = -1 + host_ulps * torch.finfo(dtype).eps / 2  # ulp just above -1 (magnitude below 1)
    return ErrorBudget(
        capture_vs_reference=compute_error_vs_reference(reference.to(dtype), reference),
        host_vs_reference=compute_error_vs_reference(host, reference),
    )


def test_budget_floor_covers_rounding_where_the_capture_host_has_zero_error():
    """k x 0 = 0: only the floor can pass a correct host here, and it must be a few ulps of the
    tensor's own arithmetic at its scale, not a fixed number (the fp32 LSE false failure)."""
    x = torch.zeros(1)
    tol = loose(budget_k=2.0)
    for ulps in (1, 8, 40):
        verdict = judged(x, x, tol, budget=_exact_capture_budget(ulps))
        assert verdict.passed, (ulps, verdict.reasons)
    verdict = judged(x, x, tol, budget=_exact_capture_budget(400))
    assert not verdict.passed and verdict.needed["budget_k"] == math.inf
    # no floor at all: the same 1-ulp host fails
    assert not judged(x, x, loose(budget_k=2.0, budget_ulps=0), budget=_exact_capture_budget(1)).passed


def test_budget_passes_a_bf16_host_that_rounds_some_values_the_other_way():
    """The golden is the reference rounded to nearest; a correct host lands on the other bf16
    neighbour for 10% of the elements: within 2x the golden's own (storage) error. A host
    that truncates everything (the Triton interpreter's fp32->bf16 cast, parity/NUMERICS.md) is not."""
    gen = torch.Generator().manual_seed(5)
    reference = torch.randn(20_000, generator=gen, dtype=torch.float64)
    golden = reference.to(torch.bfloat16)
    up = golden.nextafter(torch.full_like(golden, math.inf))
    down = golden.nextafter(torch.full_like(golden, -math.inf))
    other = torch.where(golden.double() > reference, down, up)  # the neighbour on the other side
    flip = torch.rand(20_000, generator=gen) < 0.1
    truncated = torch.where(golden.double().abs() > reference.abs(), other, golden)
    tol = loose(budget_k=2.0)
    x = torch.zeros(1)

    def budget(host):
        return ErrorBudget(compute_error_vs_reference(golden, reference), compute_error_vs_reference(host, reference))

    assert judged(x, x, tol, budget=budget(torch.where(flip, other, golden))).passed
    assert not judged(x, x, tol, budget=budget(other)).passed
    assert budget(truncated).host_vs_reference.rel_l2 > 1.5 * budget(golden).capture_vs_reference.rel_l2


def test_budget_floor_scales_with_the_reference():
    """The max_abs floor is in ulps at the reference's magnitude: a tensor of scale 1e4 gets a
    floor 1e4 times larger than one of scale 1 (a fixed fp32 1e-9 was below one ulp of both)."""
    tol = loose(budget_k=2.0)
    small = budget_floors(tol, torch.float32, 1.0)
    large = budget_floors(tol, torch.float32, 1.0e4)
    assert small["rel_l2"] == large["rel_l2"] == 64 * 2.0**-23
    assert small["max_abs"] == 64 * 2.0**-23 and large["max_abs"] == pytest.approx(64 * 2.0**-23 * 1e4)
    assert budget_floors(tol, torch.bfloat16, 3.0)["max_abs"] == ulp_at(torch.bfloat16, 3.0) == 2.0**-6
    assert budget_floors(tol, torch.float64, 1.0)["rel_l2"] == 64 * 2.0**-52
    assert ulp_at(torch.float32, 0.0) == 0.0 and ulp_at(torch.float16, 1.0) == 2.0**-10


def test_outliers_fail_whatever_the_tensor_size():
    """One element 100x off in a 4M-element bf16 tensor: within the mismatch allowance (1 of
    4M < 5e-5), but 60x beyond its bound, so the outlier rule fails it and names it."""
    gen = torch.Generator().manual_seed(3)
    ref = torch.randn(4, 1024, 1024, generator=gen).to(torch.bfloat16)
    # An element below the tensor's RMS (1), so that rel_l2 (1.5e-2) and cosine stay within
    # their limits: only the outlier rule can see it.
    ref[2, 100, 7] = 0.375
    out = ref.clone()
    out[2, 100, 7] = 37.5
    tol = DEFAULT_TOLERANCES["bf16"]
    verdict = judged(out, ref, tol)
    assert not verdict.passed
    assert [r.split(" ")[0] for r in verdict.reasons] == ["outliers:"]
    assert "worst at (2, 100, 7)" in verdict.reasons[0]
    metrics = measure(out, ref, tol)
    assert metrics.outlier_count == 1 and metrics.mismatch_count == 1 and metrics.worst_bound_ratio > 4
    # within 4x of its bound the same single element is forgiven by the mismatch allowance
    near = ref.clone()
    bound = tol.atol + tol.atol_rms * metrics.ref_rms + tol.rtol * ref[2, 100, 7].abs().item()
    near[2, 100, 7] = ref[2, 100, 7].float() + 2 * bound
    assert judged(near, ref, tol).passed
    assert judged(out, ref, dataclasses.replace(tol, outlier_factor=None)).passed  # the old rule


def test_budget_without_reference_metrics_is_a_note():
    x = torch.zeros(3)
    verdict = judged(x, x, loose(budget_k=2.0))
    assert verdict.passed
    assert verdict.notes == ["error budget not checked: no metrics against a high-precision reference"]


def test_budget_is_off_unless_budget_k_is_set():
    x = torch.zeros(3)
    verdict = judged(x, x, loose(), budget=_budget(1e-3, 1e-1))
    assert verdict.passed and "budget_k" not in verdict.needed


# --- the defaults on real attention -----------------------------------------------------------

SEQ, BLOCK = 512, 64


@pytest.fixture(scope="module")
def attention_case():
    """bf16 causal (block-granular) attention: the golden is computed in fp32 and rounded."""
    q, k, v = random_qkv(1, 4, 4, SEQ, SEQ, 64, torch.bfloat16, seed=0)
    blocks = SEQ // BLOCK
    block_mask = torch.ones(blocks, blocks, dtype=torch.bool).tril()

    def attention(mask=block_mask, precision="fp32", **kwargs):
        layout = layout_from_block_mask(mask, SEQ, SEQ, block_m=BLOCK, block_n=BLOCK)
        return reference_attention(q, k, v, layout, precision=precision, **kwargs).to(torch.bfloat16)

    return attention, block_mask


def test_defaults_pass_bf16_attention_computed_in_bf16_against_an_fp32_golden(attention_case):
    attention, _ = attention_case
    golden = attention()
    out = attention(precision="same")  # every intermediate rounded to bf16: rel_l2 ~5e-3
    tol = Policy().resolve("attention", torch.bfloat16)
    metrics = measure(out, golden, tol)
    assert metrics.rel_l2 > 1e-3  # a real discrepancy, not a copy
    verdict = judge(metrics, tol)
    assert verdict.passed, verdict.reasons


@pytest.mark.parametrize("dropped_block", [(7, 3), (4, 0)])
def test_defaults_fail_a_dropped_key_block(attention_case, dropped_block):
    attention, block_mask = attention_case
    broken_mask = block_mask.clone()
    broken_mask[dropped_block] = False
    tol = Policy().resolve("attention", torch.bfloat16)
    verdict = judged(attention(broken_mask), attention(), tol)
    assert not verdict.passed
    assert any(r.startswith("rel_l2") for r in verdict.reasons)
    assert any(r.startswith("mismatch_fraction") for r in verdict.reasons)


def test_defaults_fail_a_wrong_softmax_scale(attention_case):
    attention, _ = attention_case
    tol = Policy().resolve("attention", torch.bfloat16)
    verdict = judged(attention(sm_scale=1.1 * 64**-0.5), attention(), tol)
    assert not verdict.passed and any(r.startswith("rel_l2") for r in verdict.reasons)


@pytest.mark.parametrize("bug", ["zero row", "last 32 rows of one head scaled by 0.9"])
def test_defaults_catch_a_localized_error_that_rel_l2_and_cosine_miss(attention_case, bug):
    attention, _ = attention_case
    golden = attention()
    out = golden.clone()
    if bug == "zero row":
        out[0, 0, 500] = 0  # one row of 2048 never written
    else:
        out[0, 0, -32:] *= 0.9  # e.g. a wrong normalizer in the last, partial query block
    tol = Policy().resolve("attention", torch.bfloat16)
    verdict = judged(out, golden, tol)
    assert not verdict.passed
    reasons = [r.split(" ")[0] for r in verdict.reasons]
    # a zeroed row is also 4x beyond its bound in most elements; a 0.9 scale is not
    assert reasons == (["mismatch_fraction", "outliers:"] if bug == "zero row" else ["mismatch_fraction"])
