"""The harness benchmark (``python -m parity.benchmark``): its CI preset runs and reports sane
numbers, its subject round-trips through capture and compare, and its baseline computes what
parity's metrics compute. Timing ratios are never asserted: they go into parity/BENCHMARK.md."""
import json
import math
import subprocess
import sys

import pytest
import torch

from parity import benchmark
from parity.metrics import compute_metrics


def test_small_preset_produces_a_sane_table_and_json(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "-m", "parity.benchmark", "--small", "--quiet", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| size" in done.stdout and "compare" in done.stdout and "write rate" in done.stdout
    result = json.loads(out.read_text())
    rows = {(row["multiplier"], row["what"]): row for row in result["rows"]}
    assert set(rows) == {(m, what) for m in (1, 2) for what in ("compare", "compare vs read", "capture",
                                                                 "write rate")}
    for multiplier in (1, 2):
        compare, capture = rows[(multiplier, "compare")], rows[(multiplier, "capture")]
        assert compare["passed"], "the bundle's own impl must hold against its golden"
        assert compare["compared"] == 4 * compare["layers"] + 1
        for row in (compare, capture):
            for side in ("parity", "raw"):
                assert row[side]["seconds"] > 0 and row[side]["cpu_seconds"] >= 0
            assert row["parity"]["peak_rss_bytes"] >= row["parity"]["streaming_peak_rss_bytes"] > 0
            assert row["streaming_growth_bytes"] is not None
            assert math.isfinite(row["ratio"]) and row["ratio"] > 0
        write = rows[(multiplier, "write rate")]
        assert write["parity_rate"] > 0 and write["raw_rate"] > 0 and write["raw_fsync_rate"] > 0
    assert rows[(2, "compare")]["bundle_bytes"] > rows[(1, "compare")]["bundle_bytes"]
    assert rows[(2, "compare")]["layers"] == 2 * rows[(1, "compare")]["layers"]
    assert not list(tmp_path.glob("parity-bench-*")), "the temporary work directory is removed"


def test_bare_metrics_compute_what_parity_metrics_compute():
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(300, 7, generator=gen, dtype=torch.float64)
    out = (ref + 1e-3 * torch.randn(ref.shape, generator=gen, dtype=torch.float64)).float()
    cosine, max_abs, rel_l2 = benchmark.bare_metrics(out, ref)
    m = compute_metrics(out, ref)
    assert cosine == pytest.approx(m.cosine, rel=1e-12)
    assert max_abs == m.max_abs
    assert rel_l2 == pytest.approx(m.rel_l2, rel=1e-12)


def test_the_subject_records_four_modules_per_layer_and_holds_against_itself(tmp_path):
    from parity.capture import capture
    from parity.compare import compare_bundle
    from parity.subjects import load_subject, trusting

    runner = load_subject(benchmark.SPEC, {"layers": 2, "width": 8, "tokens": 4})
    result = capture(runner, tmp_path / "b", impl="reference", device="cpu", reference="fp64")
    assert result.layers == 2 * 4 + 1  # block, norm, fc, act per layer, and the root
    with trusting(benchmark.SPEC):
        report = compare_bundle(tmp_path / "b", impl="reference", device="cpu")
    assert report.passed and report.budget_checked and len(report.layers) == result.layers
    assert benchmark.model_bytes(runner.args) == sum(
        t.numel() * t.element_size() for t in runner.make_state().values())


def test_profile_categories_from_a_cprofile_of_the_main_thread():
    import cProfile
    import pstats

    from parity.metrics import compute_metrics_and_errors

    key = "metrics (compute_metrics, compute_metrics_and_errors)"
    profiler = cProfile.Profile()
    profiler.enable()
    compute_metrics(torch.ones(10), torch.ones(10))
    profiler.disable()
    alone = benchmark._profile_categories(pstats.Stats(profiler))[key]
    assert alone > 0
    profiler.enable()
    compute_metrics_and_errors(torch.ones(10), torch.ones(10), torch.ones(10, dtype=torch.float64))
    profiler.disable()
    categories = benchmark._profile_categories(pstats.Stats(profiler))
    assert categories[key] > alone  # the fused scan is counted as metrics too
    assert "model forward (subject runs minus hooks)" in categories
