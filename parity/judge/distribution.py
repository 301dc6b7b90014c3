"""Error distributions accumulated over chunks: a fixed log-spaced histogram and the percentiles it gives.

Exact percentiles need every element at once (a sort); the metrics see a tensor one chunk at a
time (parity/NUMERICS.md, section 6). A histogram with fixed bin edges adds over chunks exactly,
so the percentiles it gives depend on nothing but the values, to a stated resolution:

- Bins: 8 per octave, read straight off the float64 bit pattern (``bits >> 49`` is the biased
  exponent followed by the top 3 mantissa bits: one shift and one ``bincount`` per chunk, no
  logarithm), so the bins of ``[2^e, 2^(e+1))`` are ``2^e (1 + m/8) .. 2^e (1 + (m+1)/8)``,
  m = 0..7: each bin's upper edge is at most ``RESOLUTION = 1.125`` times its lower edge. Every
  octave of float64 has its bins (16384 in all), so nothing is clamped.
- Exact zeros are counted apart (most elements of a same-arithmetic port differ by exactly 0):
  they are the bins of biased exponent 0, which also hold float64 subnormals (below 2^-1022),
  counted as 0 too.
- A percentile is the nearest-rank one (the smallest value at or below which at least q% of the
  elements lie), reported as the upper edge of its bin, never above the largest value (which the
  metrics know exactly): ``p <= reported < 1.125 p``, and 0 exactly when at least q% of the
  errors are 0.

Pure functions and one accumulator; no printing, no decisions.
"""
from __future__ import annotations

import bisect
import itertools
import math

import torch

SUB_BITS = 3  # 2^3 bins per octave
RESOLUTION = 1 + 2 ** -SUB_BITS
BINS = 2048 << SUB_BITS  # every biased exponent of float64
_SHIFT = 52 - SUB_BITS  # float64: 52 mantissa bits
_BIAS = 1023
PERCENTILES = (50.0, 90.0, 99.0, 99.9)


def percentile_key(q: float) -> str:
    """``50.0 -> "p50"``, ``99.9 -> "p99.9"``: the JSON keys."""
    return f"p{q:g}"


class LogHistogram:
    """Counts of non-negative float64 values in the module's fixed bins, added chunk by chunk on
    the values' device (no host synchronisation until :meth:`counts`)."""

    def __init__(self, device: torch.device | str):
        self.bins = torch.zeros(BINS, dtype=torch.int64, device=device)
        self.excluded = 0

    def add(self, values: torch.Tensor, scratch: torch.Tensor, ones: torch.Tensor, *, excluded: int = 0) -> None:
        """Count ``values`` (float64, >= 0, finite); ``scratch``: an int64 array at least as long,
        ``ones``: an int64 array of ones at least as long. ``excluded``: how many of the zeros are
        placeholders (positions where a side was not finite, zeroed by the caller), not counted."""
        n = values.numel()
        keys = torch.bitwise_right_shift(values.view(torch.int64), _SHIFT, out=scratch[:n])
        # Straight into the bins: a bincount of all 16384 bins, then an add, cost 2.4x as much
        # (measured on the CPU, 32768 elements a chunk). Integer sums: exact in any order.
        self.bins.scatter_add_(0, keys, ones[:n])
        self.excluded += excluded

    def counts(self) -> tuple[int, list[int]]:
        """``(zeros, counts per bin)``, the zeros (and float64 subnormals) no longer in the bins."""
        counts = self.bins.tolist()
        zeros = sum(counts[:1 << SUB_BITS]) - self.excluded
        counts[:1 << SUB_BITS] = [0] * (1 << SUB_BITS)
        return zeros, counts


def lower_edge(index: int) -> float:
    """The smallest value in bin ``index``."""
    exponent, mantissa = divmod(index, 1 << SUB_BITS)
    return math.ldexp(1 + mantissa / (1 << SUB_BITS), exponent - _BIAS)


def upper_edge(index: int) -> float:
    """The smallest value above bin ``index`` (at most ``RESOLUTION`` times its lower edge)."""
    exponent, mantissa = divmod(index, 1 << SUB_BITS)
    return math.ldexp(1 + (mantissa + 1) / (1 << SUB_BITS), exponent - _BIAS)


def percentiles(zeros: int, counts: list[int], largest: float,
                quantiles: tuple[float, ...] = PERCENTILES) -> dict[str, float] | None:
    """Nearest-rank percentiles (module docstring) from :meth:`LogHistogram.counts`; ``largest``:
    the exact largest value (caps the last bin's edge). None where nothing was counted."""
    total = zeros + sum(counts)
    if total == 0:
        return None
    # Running counts of the occupied bins once, then a binary search per quantile: a Python loop
    # over all 16384 bins per quantile cost 3.5 ms per histogram (two per tensor compared), more
    # than the chunked scan that filled them for a small tensor.
    occupied = list(itertools.compress(range(len(counts)), counts))
    running = list(itertools.accumulate(counts[index] for index in occupied))
    result = {}
    for q in quantiles:
        rank = max(1, math.ceil(q / 100 * total))  # the rank-th smallest value, 1-based
        if rank <= zeros:
            result[percentile_key(q)] = 0.0
            continue
        at = bisect.bisect_left(running, rank - zeros)  # the first bin where the count reaches rank
        if at < len(running):
            result[percentile_key(q)] = min(upper_edge(occupied[at]), largest)
    return result


def octaves(zeros: int, counts: list[int]) -> dict:
    """The histogram by octave for reports: ``{"zero": n, "log2": [[e, n], ...]}`` where ``n``
    values lie in ``[2^e, 2^(e+1))``, octaves without values left out."""
    per_octave: dict[int, int] = {}
    for index in itertools.compress(range(len(counts)), counts):  # the occupied bins alone
        exponent = (index >> SUB_BITS) - _BIAS
        per_octave[exponent] = per_octave.get(exponent, 0) + counts[index]
    return {"zero": zeros, "log2": [[exponent, count] for exponent, count in sorted(per_octave.items())]}
