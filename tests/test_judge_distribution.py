"""Error distributions (parity.judge.distribution): percentiles from the chunked log histogram
against numpy's exact nearest-rank percentiles, independence of the chunk size, zeros and
non-finite elements, and the reports that show them (text --distribution, JSON, HTML)."""
import math

import numpy
import pytest
import torch

from parity.judge import distribution
from parity.judge.metrics import LayerMetrics, compute_metrics


def _exact(values: torch.Tensor, q: float) -> float:
    return float(numpy.percentile(values.numpy(), q, method="inverted_cdf"))


@pytest.mark.parametrize("chunk", [None, 1000, 2**20])
def test_percentiles_are_within_the_stated_resolution_above_the_exact_ones(chunk):
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(300_000, generator=g)
    out = ref + torch.randn(300_000, generator=g) * torch.logspace(-7, -1, 300_000)  # errors over 6 decades
    metrics = compute_metrics(out, ref, chunk_elements=chunk)
    error = (out.double() - ref.double()).abs()
    relative = error / ref.double().abs().clamp(min=metrics.rel_floor)
    for key, q in zip(("p50", "p90", "p99", "p99.9"), distribution.PERCENTILES):
        for reported, values in ((metrics.abs_err_percentiles[key], error), (metrics.rel_err_percentiles[key], relative)):
            exact = _exact(values, q)
            assert exact <= reported < distribution.RESOLUTION * exact, (key, reported, exact)


def test_chunk_size_does_not_change_the_distribution():
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(50_000, generator=g).to(torch.bfloat16)
    out = (ref.float() * (1 + 1e-2 * torch.randn(50_000, generator=g))).to(torch.bfloat16)
    small, large = compute_metrics(out, ref, chunk_elements=777), compute_metrics(out, ref)
    assert small.abs_err_percentiles == large.abs_err_percentiles
    assert small.abs_err_histogram == large.abs_err_histogram


def test_exact_zeros_and_non_finite_elements():
    ref = torch.arange(1000, dtype=torch.float32)
    out = ref.clone()
    out[990:] += 0.5  # 1% of the elements off by exactly 0.5
    out[0], ref[1] = math.nan, math.inf  # two positions not finite on a side: not counted
    metrics = compute_metrics(out, ref)
    histogram = metrics.abs_err_histogram
    assert histogram["zero"] == 988 and histogram["log2"] == [[-1, 10]]
    assert histogram["zero"] + sum(count for _, count in histogram["log2"]) == metrics.finite_count == 998
    assert metrics.abs_err_percentiles["p50"] == 0 and metrics.abs_err_percentiles["p90"] == 0
    assert metrics.abs_err_percentiles["p99.9"] == 0.5  # capped by the exact maximum
    assert metrics.abs_err_percentiles["p99"] == 0.5  # rank 989 of 998 is past the 988 zeros


def test_identical_and_empty_tensors():
    same = torch.randn(100)
    assert compute_metrics(same, same.clone()).abs_err_percentiles == {"p50": 0.0, "p90": 0.0, "p99": 0.0,
                                                                       "p99.9": 0.0}
    empty = compute_metrics(torch.zeros(0), torch.zeros(0))
    assert empty.abs_err_percentiles is None and empty.abs_err_histogram is None


def test_distribution_survives_json_and_reads_back():
    g = torch.Generator().manual_seed(2)
    ref = torch.randn(1000, generator=g)
    metrics = compute_metrics(ref + 1e-4 * torch.randn(1000, generator=g), ref)
    again = LayerMetrics.from_dict(metrics.to_dict())
    assert again.abs_err_percentiles == metrics.abs_err_percentiles
    assert again.abs_err_histogram == metrics.abs_err_histogram
    old = {key: value for key, value in metrics.to_dict().items() if "_err_" not in key}
    assert LayerMetrics.from_dict(old).abs_err_percentiles is None  # a report written before


def test_reports_show_the_distribution():
    from parity.judge.engine import compare_tensors
    from parity.judge.results import CompareReport
    from parity.judge.policy import Policy
    from parity.report.html import render_html
    from parity.base.numbers import format_number
    from parity.report.text import format_text

    g = torch.Generator().manual_seed(3)
    ref = torch.randn(4096, generator=g)
    result = compare_tensors("layers.0.mlp", ref + 1e-6 * torch.randn(4096, generator=g), ref)
    report = CompareReport(golden="g", subject={"name": "s"}, impl="triton", golden_impl="reference", device="cpu",
                           policy=Policy(), layers=[result], hosts={"golden": {}, "here": {}},
                           fingerprint_differences=[])
    plain, detailed = format_text(report), format_text(report, distribution=True)
    assert "rel p99.9" not in plain
    lines = format_text(report, distribution=True, width=120).splitlines()
    header = next(line for line in lines if "| p50 " in line)
    assert "rel p99.9" in header and max(len(line) for line in lines) <= 120
    row = lines[lines.index(header) + 2]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    percentiles = result.metrics.abs_err_percentiles
    assert cells[0] == "layers.0.mlp" and cells[1] == "7.2e-7" and percentiles["p50"] == pytest.approx(7.15e-7, rel=1e-2)
    assert cells[4] == format_number(percentiles["p99.9"])
    page = render_html(report.to_dict())
    assert '<section id="distribution">' in page and page.count('<svg class="hist"') == 1
    assert 'data-percentile="p99.9"' in page


def _percentiles_by_walking_every_bin(zeros, counts, largest, quantiles):
    """The nearest-rank definition written out: walk the bins in order until the rank is reached."""
    total = zeros + sum(counts)
    if total == 0:
        return None
    result = {}
    for q in quantiles:
        rank = max(1, math.ceil(q / 100 * total))
        seen = zeros
        if rank <= seen:
            result[distribution.percentile_key(q)] = 0.0
            continue
        for index, count in enumerate(counts):
            seen += count
            if seen >= rank:
                result[distribution.percentile_key(q)] = min(distribution.upper_edge(index), largest)
                break
    return result


def test_percentiles_and_octaves_agree_with_walking_every_bin():
    """The search over running counts of occupied bins gives the bin a walk over all 16384 gives,
    at the edges too (q 0 and 100, a rank landing exactly on a bin's last element, all zeros)."""
    import random

    rng = random.Random(0)
    quantiles = (0.0, 1.0, 50.0, 90.0, 99.0, 99.9, 100.0)
    for trial in range(200):
        counts = [0] * distribution.BINS
        for _ in range(rng.randint(0, 40)):  # finite values only: biased exponents below 2047
            counts[rng.randrange(1 << distribution.SUB_BITS, 2047 << distribution.SUB_BITS)] = rng.randint(1, 999)
        zeros, largest = rng.choice([0, 1, 10, 10**5]), rng.choice([1e300, 1e-3])
        assert distribution.percentiles(zeros, counts, largest, quantiles) == \
            _percentiles_by_walking_every_bin(zeros, counts, largest, quantiles), trial
        per_octave = {}
        for index, count in enumerate(counts):
            if count:
                exponent = (index >> distribution.SUB_BITS) - 1023
                per_octave[exponent] = per_octave.get(exponent, 0) + count
        assert distribution.octaves(zeros, counts) == \
            {"zero": zeros, "log2": [[e, n] for e, n in sorted(per_octave.items())]}
    counts = [0] * distribution.BINS
    counts[9000], counts[9001] = 2, 2  # p50 of 4 is the 2nd value: the first bin, not the next
    assert distribution.percentiles(0, counts, 1e300, (50.0,)) == {"p50": distribution.upper_edge(9000)}
