"""parity.speed.stats on synthetic timings with known answers."""
from __future__ import annotations

import math
import random

import pytest

from parity.speed import stats


def normal_sample(mean: float, sd: float, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.gauss(mean, sd) for _ in range(n)]


def test_quantiles_match_linear_interpolation():
    data = [5.0, 1.0, 4.0, 2.0, 3.0]  # sorted 1..5: positions q * 4
    assert stats.quantile(data, 0.5) == 3.0
    assert stats.quantile(data, 0.25) == 2.0
    assert stats.quantile(data, 0.2) == pytest.approx(1.8)
    assert stats.quantile(data, 0.8) == pytest.approx(4.2)
    summary = stats.summarize(data)
    assert (summary.n, summary.median, summary.iqr, summary.min, summary.max, summary.mean) == (5, 3.0, 2.0, 1.0, 5.0, 3.0)
    assert summary.rel_iqr == pytest.approx(2.0 / 3.0)
    assert stats.median([4.0, 1.0, 3.0, 2.0]) == 2.5


def test_known_ratio_of_1_5_is_faster_and_inside_the_interval():
    baseline = normal_sample(15.0, 0.3, 60, seed=1)
    candidate = normal_sample(10.0, 0.2, 60, seed=2)
    result = stats.compare(baseline, candidate, seed=0)
    assert result.verdict == stats.FASTER
    assert result.low <= result.speedup <= result.high
    assert 1.47 < result.speedup < 1.53
    assert result.high - result.low < 0.06
    # The other way round it is slower, by the reciprocal.
    reverse = stats.compare(candidate, baseline, seed=0)
    assert reverse.verdict == stats.SLOWER
    assert reverse.speedup == pytest.approx(1.0 / result.speedup)


def test_interval_covers_the_true_ratio_about_95_percent_of_the_time():
    # 40 independent pairs of samples whose true ratio of medians is exactly 1.5.
    covered = 0
    for replicate in range(40):
        baseline = normal_sample(15.0, 0.6, 40, seed=100 + 2 * replicate)
        candidate = normal_sample(10.0, 0.4, 40, seed=101 + 2 * replicate)
        _, low, high = stats.bootstrap_ratio(baseline, candidate, seed=replicate, resamples=500)
        covered += low <= 1.5 <= high
    assert 34 <= covered <= 40  # 95% nominal: 38 expected; fewer than 34 would mean a broken interval


def test_identical_samples_are_same():
    sample = normal_sample(10.0, 0.05, 40, seed=3)
    result = stats.compare(sample, list(sample))
    assert result.speedup == 1.0
    assert result.verdict == stats.SAME
    assert 0.98 <= result.low <= 1.0 <= result.high <= 1.02


def test_overlapping_noisy_samples_are_unclear():
    baseline = normal_sample(10.0, 3.0, 10, seed=4)
    candidate = normal_sample(10.3, 3.0, 10, seed=5)
    result = stats.compare(baseline, candidate)
    assert result.verdict == stats.UNCLEAR
    assert result.low < 0.98 and result.high > 1.02
    assert stats.noise_warning(stats.summarize(baseline), "baseline") is not None


def test_bootstrap_is_deterministic_per_seed():
    baseline, candidate = normal_sample(12, 1, 30, 6), normal_sample(10, 1, 30, 7)
    assert stats.bootstrap_ratio(baseline, candidate, seed=11) == stats.bootstrap_ratio(baseline, candidate, seed=11)
    assert stats.bootstrap_ratio(baseline, candidate, seed=11) != stats.bootstrap_ratio(baseline, candidate, seed=12)


def test_verdict_boundaries():
    assert stats.verdict(1.03, 1.2) == stats.FASTER
    assert stats.verdict(1.01, 1.2) == stats.UNCLEAR  # may be faster, but not by the minimum effect
    assert stats.verdict(0.99, 1.01) == stats.SAME
    assert stats.verdict(0.8, 0.97) == stats.SLOWER
    assert stats.verdict(1.06, 1.2, min_effect=0.05) == stats.FASTER
    assert stats.verdict(1.04, 1.2, min_effect=0.05) == stats.UNCLEAR


def test_warnings_for_noise_and_huge_speedups():
    quiet = stats.summarize([1.0, 1.01, 0.99, 1.0])
    assert stats.noise_warning(quiet, "x") is None
    noisy = stats.summarize([1.0, 1.5, 0.7, 1.2, 0.9])
    assert "IQR/median" in stats.noise_warning(noisy, "x")
    huge = stats.compare([100.0, 101.0, 99.0], [5.0, 5.1, 4.9])
    assert huge.speedup == pytest.approx(20.0)
    assert any("re-verify" in warning for warning in huge.warnings)


def test_amdahl():
    assert stats.amdahl(0.85) == pytest.approx(1 / 0.15)
    assert stats.amdahl(0.5, 2.0) == pytest.approx(1 / 0.75)
    assert stats.amdahl(1.0) == math.inf
    with pytest.raises(ValueError):
        stats.amdahl(1.5)


def test_bad_samples_are_refused():
    with pytest.raises(ValueError):
        stats.summarize([])
    with pytest.raises(ValueError):
        stats.summarize([1.0, float("nan")])
    with pytest.raises(ValueError):
        stats.bootstrap_ratio([1.0], [0.0])


def test_mann_whitney_p_matches_known_values():
    # Fully separated samples of 5 and 5: U = 0, z = (12.5 - 0.5) / sqrt(22.9167) = 2.5067, p = 0.01219.
    assert stats.mann_whitney_p([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]) == pytest.approx(0.012186, abs=1e-5)
    # Interleaved samples: rank sum 25, U = 10, z = (2.5 - 0.5) / 4.787 = 0.4178, p = 0.6761.
    assert stats.mann_whitney_p([1, 3, 5, 7, 9], [2, 4, 6, 8, 10]) == pytest.approx(0.6761, abs=1e-4)
    assert stats.mann_whitney_p([1.0, 1.0], [1.0, 1.0]) == 1.0  # all tied
    result = stats.compare(normal_sample(15, 0.3, 30, 1), normal_sample(10, 0.2, 30, 2))
    assert result.p_value < 1e-6


def test_equivalent_within_1_percent_and_its_90_percent_interval():
    # The candidate takes 1% longer than the baseline, with 0.5% noise: 1/1.01 = 0.990 speedup.
    baseline = normal_sample(10.0, 0.05, 40, seed=21)
    candidate = normal_sample(10.1, 0.05, 40, seed=22)
    result = stats.compare(baseline, candidate, seed=0)
    tost = result.equivalence
    assert result.speedup == pytest.approx(1 / 1.01, abs=0.004)
    assert tost.confidence == 0.90 and tost.margin == 0.02
    assert tost.equivalent and result.to_dict()["equivalence"]["verdict"] == "EQUIVALENT within \u00b12%"
    # The 90% interval comes from the same resamples as the 95% one, so it lies inside it.
    assert result.low <= tost.low <= result.speedup <= tost.high <= result.high
    assert tost.low > 0.98 and tost.high < 1.0
    # At a margin of 0.5% the same data are not shown equivalent (the point estimate is 1% off).
    assert not stats.compare(baseline, candidate, seed=0, equivalence=0.005).equivalence.equivalent


def test_not_equivalent_when_different_or_too_noisy():
    slower = stats.compare(normal_sample(10.0, 0.05, 40, seed=23), normal_sample(10.3, 0.05, 40, seed=24))
    assert slower.verdict == stats.SLOWER and not slower.equivalence.equivalent
    assert slower.equivalence.high < 0.98
    noisy = stats.compare(normal_sample(10.0, 1.0, 10, seed=25), normal_sample(10.0, 1.0, 10, seed=26))
    assert noisy.verdict == stats.UNCLEAR and not noisy.equivalence.equivalent  # same mean, too noisy to show
    assert noisy.to_dict()["equivalence"]["verdict"] == "not shown within \u00b12%"
    assert noisy.equivalence.low < 0.98 or noisy.equivalence.high > 1.02


def test_equivalence_boundaries_and_margin():
    assert stats.equivalent(0.98, 1.02) and stats.equivalent(0.99, 1.0)
    assert not stats.equivalent(0.9799, 1.0) and not stats.equivalent(1.0, 1.0201)
    assert stats.equivalent(0.96, 1.04, margin=0.05) and not stats.equivalent(0.94, 1.0, margin=0.05)
    for margin in (0.0, 1.0, float("nan")):
        with pytest.raises(ValueError):
            stats.equivalent(1.0, 1.0, margin)


def test_tost_claims_equivalence_at_the_margin_about_5_percent_of_the_time():
    # True ratio of medians exactly 1.02, the margin itself: equivalence must not be shown more
    # often than alpha = 5% (TOST's size); 40 replicates: 2 expected, more than 6 would be a broken rule.
    claimed = 0
    for replicate in range(40):
        baseline = normal_sample(10.2, 0.1, 40, seed=300 + 2 * replicate)
        candidate = normal_sample(10.0, 0.1, 40, seed=301 + 2 * replicate)
        claimed += stats.compare(baseline, candidate, seed=replicate, resamples=500).equivalence.equivalent
    assert claimed <= 6
