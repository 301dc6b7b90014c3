"""Statistics of timing samples: pure functions on lists of seconds, no torch, no clock.

A sample is summarised by its median, IQR (q3 - q1), p20/p80, min, max and mean (quantiles by
linear interpolation between order statistics, numpy's default). Two samples are compared by the
ratio of their medians, ``speedup = median(baseline) / median(candidate)`` (above 1: the
candidate is faster), with a percentile bootstrap 95% interval: each sample is resampled with
replacement, independently, ``resamples`` times from a ``random.Random(seed)``, so the interval
is a pure function of the samples and the seed.

Verdict (NVBench's compare is the anchor: a difference is named only when it clears a gap):

- ``FASTER`` when the interval's lower bound is above ``1 + min_effect``;
- ``SLOWER`` when its upper bound is below ``1 - min_effect``;
- ``SAME`` when the whole interval lies inside ``[1 - min_effect, 1 + min_effect]``;
- ``UNCLEAR`` otherwise (the data cannot tell; more repetitions or a quieter machine may).

Equivalence (two one-sided tests, TOST; Schuirmann 1987, J. Pharmacokinet. Biopharm. 15:657):
``EQUIVALENT within +-m`` when the ``1 - 2*alpha`` interval of the same bootstrap (90% for
alpha = 0.05) lies inside ``[1 - m, 1 + m]``. Each one-sided test at level alpha rejects "slower
by more than m" (resp. "faster by more than m") exactly when that interval's bound clears it, so
both reject together when the whole 90% interval is inside the margin. Not shown equivalent is
not a difference: the interval may straddle the margin because the data are too few or noisy.
The band is --min-effect's (``1 +- m`` on the speedup), so with equal margins a SAME verdict
(its 95% interval inside) implies EQUIVALENT.

The Mann-Whitney U test's two-sided p-value is reported next to the interval (informational).

Warnings: a sample whose IQR/median exceeds :data:`NOISY_REL_IQR` (0.10, torch.utils.benchmark's
"could indicate system fluctuation"), and a speedup above :data:`SUSPICIOUS_SPEEDUP` (10x,
KernelBench's ``excessive_speedup_threshold``: re-verify the output before believing it).
"""
from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence

DEFAULT_MIN_EFFECT = 0.02
DEFAULT_RESAMPLES = 2000
DEFAULT_CONFIDENCE = 0.95
DEFAULT_EQUIVALENCE = 0.02  # the margin of --equivalence: --min-effect's 2%, so SAME implies EQUIVALENT
EQUIVALENCE_CONFIDENCE = 0.90  # TOST at alpha = 0.05: two one-sided 5% tests = one two-sided 90% interval
NOISY_REL_IQR = 0.10
SUSPICIOUS_SPEEDUP = 10.0

FASTER, SLOWER, SAME, UNCLEAR = "FASTER", "SLOWER", "SAME", "UNCLEAR"
VERDICTS = (FASTER, SLOWER, SAME, UNCLEAR)


def _checked(values: Sequence[float], what: str = "sample") -> list[float]:
    data = [float(value) for value in values]
    if not data:
        raise ValueError(f"{what} is empty")
    if not all(math.isfinite(value) for value in data):
        raise ValueError(f"{what} holds a non-finite value")
    return data


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation between order statistics."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    data = sorted(_checked(values))
    position = q * (len(data) - 1)
    low = math.floor(position)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (position - low)


def median(values: Sequence[float]) -> float:
    return quantile(values, 0.5)


@dataclasses.dataclass(frozen=True)
class Summary:
    """One sample's statistics (in the sample's unit)."""

    n: int
    median: float
    q1: float
    q3: float
    p20: float
    p80: float
    min: float
    max: float
    mean: float

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    @property
    def rel_iqr(self) -> float:
        """IQR / median (0 for a zero median, which no timing has)."""
        return self.iqr / self.median if self.median else 0.0

    def to_dict(self) -> dict[str, float | int]:
        return {"n": self.n, "median": self.median, "q1": self.q1, "q3": self.q3, "iqr": self.iqr,
                "rel_iqr": self.rel_iqr, "p20": self.p20, "p80": self.p80, "min": self.min, "max": self.max,
                "mean": self.mean}


def summarize(values: Sequence[float]) -> Summary:
    data = _checked(values)
    return Summary(n=len(data), median=quantile(data, 0.5), q1=quantile(data, 0.25), q3=quantile(data, 0.75),
                   p20=quantile(data, 0.2), p80=quantile(data, 0.8), min=min(data), max=max(data),
                   mean=math.fsum(data) / len(data))


def noise_warning(summary: Summary, what: str) -> str | None:
    """A warning when a sample's IQR/median exceeds :data:`NOISY_REL_IQR`, else None."""
    if summary.rel_iqr > NOISY_REL_IQR:
        return (f"{what}: IQR/median {summary.rel_iqr:.2f} > {NOISY_REL_IQR:.2f}: noisy timings (other load, "
                "clock changes); more repetitions or a quieter machine")
    return None


def _median_sorted(data: list[float]) -> float:
    n = len(data)
    middle = n // 2
    return data[middle] if n % 2 else 0.5 * (data[middle - 1] + data[middle])


def bootstrap_ratios(baseline: Sequence[float], candidate: Sequence[float], *, seed: int = 0,
                     resamples: int = DEFAULT_RESAMPLES) -> tuple[float, list[float]]:
    """``(ratio, resampled)``: median(baseline) / median(candidate) and the sorted ratios of
    ``resamples`` bootstrap resamples; deterministic for a given ``seed``."""
    base, cand = _checked(baseline, "baseline sample"), _checked(candidate, "candidate sample")
    if resamples < 10:
        raise ValueError(f"resamples must be at least 10, got {resamples}")
    if min(base) <= 0 or min(cand) <= 0:
        raise ValueError("timings must be positive")
    ratio = median(base) / median(cand)
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        resampled_base = sorted(rng.choices(base, k=len(base)))
        resampled_cand = sorted(rng.choices(cand, k=len(cand)))
        ratios.append(_median_sorted(resampled_base) / _median_sorted(resampled_cand))
    return ratio, sorted(ratios)


def percentile_interval(resampled: Sequence[float], confidence: float) -> tuple[float, float]:
    """The central ``confidence`` interval of a bootstrap distribution (percentile method)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    tail = (1.0 - confidence) / 2.0
    return quantile(resampled, tail), quantile(resampled, 1.0 - tail)


def bootstrap_ratio(baseline: Sequence[float], candidate: Sequence[float], *, seed: int = 0,
                    resamples: int = DEFAULT_RESAMPLES,
                    confidence: float = DEFAULT_CONFIDENCE) -> tuple[float, float, float]:
    """``(ratio, low, high)``: median(baseline) / median(candidate) and its percentile bootstrap
    interval at ``confidence``; deterministic for a given ``seed``."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    ratio, ratios = bootstrap_ratios(baseline, candidate, seed=seed, resamples=resamples)
    return (ratio, *percentile_interval(ratios, confidence))


def mann_whitney_p(first: Sequence[float], second: Sequence[float]) -> float:
    """Two-sided p-value of the Mann-Whitney U test that the two samples come from one distribution
    (normal approximation with tie correction and continuity correction; google-benchmark's
    ``compare.py`` test). Informational: the verdict rests on the bootstrap interval."""
    a, b = _checked(first, "first sample"), _checked(second, "second sample")
    n1, n2 = len(a), len(b)
    pooled = sorted([(value, 0) for value in a] + [(value, 1) for value in b])
    ranks = [0.0] * len(pooled)
    ties = 0.0
    index = 0
    while index < len(pooled):
        end = index
        while end + 1 < len(pooled) and pooled[end + 1][0] == pooled[index][0]:
            end += 1
        for k in range(index, end + 1):
            ranks[k] = (index + end) / 2 + 1
        size = end - index + 1
        ties += size ** 3 - size
        index = end + 1
    rank_sum = sum(rank for rank, (_, group) in zip(ranks, pooled) if group == 0)
    u = rank_sum - n1 * (n1 + 1) / 2
    n = n1 + n2
    variance = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1))) if n > 1 else 0.0
    if variance <= 0:
        return 1.0
    z = (abs(u - n1 * n2 / 2) - 0.5) / math.sqrt(variance)
    return min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2)))


def verdict(low: float, high: float, min_effect: float = DEFAULT_MIN_EFFECT) -> str:
    """FASTER / SLOWER / SAME / UNCLEAR of a speedup interval ``[low, high]`` (module docstring)."""
    if not 0.0 <= min_effect < 1.0:
        raise ValueError(f"min_effect must be in [0, 1), got {min_effect}")
    if low > 1.0 + min_effect:
        return FASTER
    if high < 1.0 - min_effect:
        return SLOWER
    if low >= 1.0 - min_effect and high <= 1.0 + min_effect:
        return SAME
    return UNCLEAR


def equivalent(low: float, high: float, margin: float = DEFAULT_EQUIVALENCE) -> bool:
    """TOST: whether the ``1 - 2*alpha`` interval ``[low, high]`` of a speedup lies inside
    ``[1 - margin, 1 + margin]`` (both one-sided tests reject a difference beyond the margin)."""
    if not (math.isfinite(margin) and 0.0 < margin < 1.0):
        raise ValueError(f"equivalence margin must be in (0, 1), got {margin}")
    return low >= 1.0 - margin and high <= 1.0 + margin


def equivalence_text(margin: float, holds: bool) -> str:
    """``EQUIVALENT within +-2%`` or ``not shown within +-2%`` (a verdict cell, not a difference)."""
    return f"{'EQUIVALENT' if holds else 'not shown'} within \u00b1{100 * margin:g}%"


@dataclasses.dataclass(frozen=True)
class Equivalence:
    """The TOST verdict of one comparison: the 90% interval and whether it lies inside the margin."""

    margin: float
    confidence: float
    low: float
    high: float
    equivalent: bool

    def to_dict(self) -> dict[str, object]:
        return {"margin": self.margin, "confidence": self.confidence, "ci_low": self.low, "ci_high": self.high,
                "equivalent": self.equivalent, "verdict": equivalence_text(self.margin, self.equivalent)}


@dataclasses.dataclass(frozen=True)
class Comparison:
    """A candidate sample against a baseline sample."""

    speedup: float  # median(baseline) / median(candidate)
    low: float
    high: float
    verdict: str
    min_effect: float
    confidence: float
    warnings: tuple[str, ...] = ()
    p_value: float | None = None  # Mann-Whitney U, two-sided
    equivalence: Equivalence | None = None

    def to_dict(self) -> dict[str, object]:
        document: dict[str, object] = {
            "speedup": self.speedup, "ci_low": self.low, "ci_high": self.high, "verdict": self.verdict,
            "min_effect": self.min_effect, "confidence": self.confidence, "warnings": list(self.warnings),
            "mann_whitney_p": self.p_value}
        if self.equivalence is not None:
            document["equivalence"] = self.equivalence.to_dict()
        return document


def suspicious_speedup(ratio: float | None, what: str, kind: str = "speedup") -> str | None:
    """The warning for a speedup above ``SUSPICIOUS_SPEEDUP`` (re-verify), else None."""
    if ratio is None or not ratio > SUSPICIOUS_SPEEDUP:
        return None
    return (f"{what}: {kind} {ratio:.1f}x > {SUSPICIOUS_SPEEDUP:g}x: re-verify that it computes the same thing "
            "(a speedup this large is more often a skipped computation than a faster one)")


def compare(baseline: Sequence[float], candidate: Sequence[float], *, min_effect: float = DEFAULT_MIN_EFFECT,
            seed: int = 0, resamples: int = DEFAULT_RESAMPLES, confidence: float = DEFAULT_CONFIDENCE,
            what: str = "candidate", equivalence: float = DEFAULT_EQUIVALENCE) -> Comparison:
    """The speedup of ``candidate`` over ``baseline`` with its interval, verdict, equivalence
    (TOST, from the same resamples at :data:`EQUIVALENCE_CONFIDENCE`) and warnings."""
    ratio, ratios = bootstrap_ratios(baseline, candidate, seed=seed, resamples=resamples)
    low, high = percentile_interval(ratios, confidence)
    eq_low, eq_high = percentile_interval(ratios, EQUIVALENCE_CONFIDENCE)
    tost = Equivalence(equivalence, EQUIVALENCE_CONFIDENCE, eq_low, eq_high, equivalent(eq_low, eq_high, equivalence))
    suspicious = suspicious_speedup(ratio, what)
    warnings = [suspicious] if suspicious else []
    return Comparison(speedup=ratio, low=low, high=high, verdict=verdict(low, high, min_effect),
                      min_effect=min_effect, confidence=confidence, warnings=tuple(warnings),
                      p_value=mann_whitney_p(baseline, candidate), equivalence=tost)


def amdahl(share: float, speedup: float = math.inf) -> float:
    """Whole-program speedup when a part taking ``share`` (0..1) of the time gets ``speedup``
    faster: ``1 / ((1 - share) + share / speedup)``; with the default, the bound if it took no time."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {share}")
    if speedup <= 0:
        raise ValueError(f"speedup must be positive, got {speedup}")
    rest = (1.0 - share) + (share / speedup if math.isfinite(speedup) else 0.0)
    return math.inf if rest == 0 else 1.0 / rest


__all__ = ["Comparison", "DEFAULT_CONFIDENCE", "DEFAULT_EQUIVALENCE", "DEFAULT_MIN_EFFECT", "DEFAULT_RESAMPLES",
           "EQUIVALENCE_CONFIDENCE", "Equivalence", "FASTER", "NOISY_REL_IQR", "SAME", "SLOWER", "SUSPICIOUS_SPEEDUP",
           "Summary", "UNCLEAR", "VERDICTS", "amdahl", "bootstrap_ratio", "bootstrap_ratios", "compare", "equivalence_text",
           "equivalent", "mann_whitney_p", "median", "noise_warning", "percentile_interval", "quantile", "summarize",
           "suspicious_speedup", "verdict"]
