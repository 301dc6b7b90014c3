"""The cross-vendor check: this machine's run of the Triton kernel against the goldens that were
captured on an NVIDIA H200 and committed under golden/ (CPU: through the interpreter)."""
import functools
from pathlib import Path

import pytest

from parity.bundle.reader import open_bundle
from parity.judge.compare import compare_bundle
from parity.report.text import format_text

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
BUNDLES = ("h200-attention", "h200-decoder")
# 150 attention cases drawn by parity.run.fuzz (corpus bounds, seed 2026: every dtype x layout, odd
# lengths) and captured on the H200 with the reference implementation and an fp64 reference.
FUZZ_CORPUS = "h200-fuzz"
# These goldens are the fp32-computed reference rounded once to bf16 (its error vs fp64 is
# output rounding only, rel L2 1.6e-3); a flash kernel also rounds P to bf16 before P.V, which
# measured 1.17-1.33x that here (parity/NUMERICS.md: an SDPA golden and the kernel both at 2.0e-3).
# Without the interpreter's rounding fix (truncation) the kernel showed ~2.7x. Allow 1.5x.
SAME_ERROR_FACTOR = 1.5


@pytest.mark.parametrize("name", BUNDLES + (FUZZ_CORPUS,))
def test_goldens_were_captured_on_an_nvidia_gpu(name):
    bundle = open_bundle(GOLDEN / name)
    assert bundle.platform["vendor"] == "nvidia"
    assert bundle.platform["arch"] == "sm_90"
    assert "H200" in bundle.platform["device_name"]
    assert bundle.impl == "reference"
    assert bundle.hooks_check["bitwise_equal"] is True


@pytest.fixture(scope="module")
def triton_report():
    """The compare of the Triton kernel here against a golden under the error budget, made once per
    bundle and module: the tests below only read the report, so a bundle's interpreter runs (the
    cost of this file) happen once however many of its properties are checked."""
    from parity.run import platform

    device = platform.default_device()
    return functools.cache(lambda name: compare_bundle(GOLDEN / name, impl="triton", device=device, budget=True))


@pytest.mark.parametrize("name", BUNDLES)
def test_triton_here_matches_the_nvidia_goldens(name, triton_report):
    report = triton_report(name)
    table = format_text(report)
    assert report.passed, table
    assert len(report.layers) >= 16
    assert all(layer.metrics is not None and layer.metrics.numel > 0 for layer in report.layers)
    # The attention bundle is the default case set (8 cases, each its own module); the decoder one model.
    assert report.independent_cases == {"h200-attention": 8, "h200-decoder": 0}[name]


def test_bf16_kernel_here_is_as_close_to_fp64_as_the_nvidia_golden(triton_report):
    report = triton_report("h200-attention")
    bf16_outputs = [layer for layer in report.layers if layer.dtype == "bfloat16"]
    assert len(bf16_outputs) >= 3
    for layer in bf16_outputs:
        here = layer.budget.host_vs_reference.rel_l2
        golden = layer.budget.capture_vs_reference.rel_l2
        assert golden > 1e-4, f"{layer.name}: the golden's own bf16 error should be visible, got {golden}"
        assert here <= SAME_ERROR_FACTOR * golden, (
            f"{layer.name}: this host's rel L2 vs fp64 {here:.3e} exceeds {SAME_ERROR_FACTOR} x the "
            f"H200 golden's own {golden:.3e}")


def test_the_h200_fuzz_corpus_holds_here_under_the_default_rule(device):
    """The cross-host verdict check of issue 10: a corpus this code did not produce (captured on
    the H200, cases drawn with a seed the suite uses nowhere else), compared with the Triton kernel
    here under the default rule: the error budget on every tensor (each has an fp64 reference),
    the fixed thresholds as a backstop. Before the rounding-aware floor, fp32 LSEs failed this."""
    bundle = open_bundle(GOLDEN / FUZZ_CORPUS)
    cases = bundle.subject["args"]["cases"]
    assert len(cases) >= 150
    assert {(case["dtype"], case["layout"]) for case in cases} >= {
        (dtype, layout) for dtype in ("fp16", "bf16", "fp32")
        for layout in ("dense", "causal", "window", "sink", "random", "emptyrow")}
    report = compare_bundle(bundle, impl="triton", device=device)
    assert report.passed, format_text(report, max_rows=40)
    assert report.rules == {"budget": 2 * len(cases)}  # out and lse of every case
