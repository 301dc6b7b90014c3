"""The bias check: the error projected on the reference and its significance, computed in the
metrics' chunked pass, and a systematic scale error that every other check lets through caught
at the block it was injected into (the fault as an impl of a user subject, fault_models)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from fault_models import capture_model

from parity.cli.main import main
from parity.judge.checks import judge, measure
from parity.judge.metrics import compute_metrics
from parity.judge.policy import DEFAULT_TOLERANCES


def _reference() -> torch.Tensor:
    return torch.randn(300, 500, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def test_bias_is_the_scale_error_and_does_not_depend_on_the_chunks():
    ref = _reference()
    scaled = ref * 1.005
    metrics = compute_metrics(scaled, ref, chunk_elements=4096)
    assert metrics.bias == pytest.approx(5e-3, rel=1e-12)
    # A pure scale: every d_i ref_i = s ref_i^2, so z = sum r^2 / sqrt(sum r^4), about sqrt(n / 3).
    expected_z = float((ref ** 2).sum() / (ref ** 4).sum().sqrt())
    assert metrics.bias_z == pytest.approx(expected_z, rel=1e-12)
    whole = compute_metrics(scaled, ref, chunk_elements=ref.numel())
    assert whole.bias == pytest.approx(metrics.bias, rel=1e-12)
    assert whole.bias_z == pytest.approx(metrics.bias_z, rel=1e-12)


def test_rounding_is_unbiased_and_a_wrong_scale_is_not():
    ref = _reference().float()
    rounded = compute_metrics(ref.bfloat16().float(), ref)
    faulty = compute_metrics((ref.bfloat16() * 1.005).float(), ref)
    assert abs(rounded.bias) < 1e-5 and abs(rounded.bias_z) < 4
    assert faulty.bias > 5e-3 and faulty.bias_z > 100
    assert compute_metrics(torch.zeros(3), torch.zeros(3)).bias == 0.0
    assert compute_metrics(torch.ones(3), torch.zeros(3)).bias == 0.0  # nothing to project on


def test_bias_fails_only_when_large_and_significant():
    tol = DEFAULT_TOLERANCES["fp32"]
    ref = _reference().float()
    verdict = judge(measure(ref * (1 + 2e-6), ref, tol), tol)
    assert verdict.failed == ("max_bias",)
    assert verdict.reasons[0].startswith("biased: error projected on the reference +2.0")
    assert "(|bias| 2.0e-6 > 1.0e-6; significance +" in verdict.reasons[0]
    # One element: however large its bias, it cannot be significant (|z| <= sqrt(n)).
    one = torch.tensor([0.023])
    small = judge(measure(one * (1 + 5e-6), one, tol), tol)
    assert "max_bias" not in small.failed and small.needed["max_bias"] == pytest.approx(5e-6, rel=1e-2)


@pytest.mark.slow
def test_a_bf16_block_scaled_by_1_005_fails_at_that_block_in_every_report(tmp_path, capsys):
    """The issue's fault: every element of blocks.3 one bf16 step up; default policy, end to end."""
    bundle = capture_model(tmp_path, "res", "bf16")
    json_file, junit, page = tmp_path / "r.json", tmp_path / "r.xml", tmp_path / "r.html"
    code = main(["compare", "--bundle", str(bundle), "--impl", "scale1.005-block3", "--device", "cpu",
                 "--json", str(json_file), "--junit-xml", str(junit), "--html", str(page)])
    out = capsys.readouterr().out
    assert code == 1
    report = json.loads(json_file.read_text())
    assert report["summary"]["first_failing_layer"] == "blocks.3"
    block = next(layer for layer in report["layers"] if layer["name"] == "blocks.3")
    bias = block["metrics"]["bias"]
    assert 5e-3 < bias < 6e-3 and block["metrics"]["bias_z"] > 40
    assert block["verdict"]["reasons"][0].startswith(f"biased: error projected on the reference +{bias:.3g}")
    assert all(layer["passed"] for layer in report["layers"][:report["layers"].index(block)])
    assert "FAIL biased" in out and f"+{bias:.3g}" in out
    assert "biased: error projected on the reference" in junit.read_text()
    assert "biased: error projected on the reference" in page.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["fp32-compute", "splitk", "tp4-allreduce"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_correct_ports_are_not_biased(tmp_path, dtype, impl):
    from parity.judge.compare import compare_bundle

    report = compare_bundle(capture_model(tmp_path, "res", dtype), impl=impl, device="cpu")
    assert report.passed, [(r.name, r.verdict.reasons) for r in report.failing]
    tol = DEFAULT_TOLERANCES[dtype]
    worst = max(abs(r.metrics.bias) for r in report.layers if r.metrics is not None)
    assert 0 < worst < tol.max_bias / 2.5, worst
    assert not math.isnan(worst)
