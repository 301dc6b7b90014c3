"""A verdict over several input draws: each tensor's error over the seeds, judged on the worst.

``compare`` judges every draw a bundle holds (``capture --seeds N``, :mod:`parity.run.seeds`) with
the same engine and policy. :func:`combine` keeps, for each tensor, the result of its worst draw
(a failing draw before any passing one, then the largest rel L2), so the table, the verdict and
every report judge the worst seed, and a :class:`SeedsReport` with each tensor's rel L2 and max
abs over the seeds (worst and median), the seed of the worst, and the seeds on which it fails.
One failing seed fails the tensor: a port that is wrong only for some inputs is wrong.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import Any

from parity.judge.metrics import json_safe_float
from parity.judge.results import TensorResult


@dataclasses.dataclass(frozen=True)
class SeedSpread:
    """One tensor over the seeds it was judged on."""

    name: str
    seeds: tuple[int, ...]
    failing_seeds: tuple[int, ...]
    worst_seed: int
    rel_l2_worst: float | None
    rel_l2_median: float | None
    max_abs_worst: float | None
    max_abs_median: float | None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "seeds": len(self.seeds), "failing_seeds": list(self.failing_seeds),
                "worst_seed": self.worst_seed,
                "rel_l2": {"worst": json_safe_float(self.rel_l2_worst), "median": json_safe_float(self.rel_l2_median)},
                "max_abs": {"worst": json_safe_float(self.max_abs_worst),
                            "median": json_safe_float(self.max_abs_median)}}


@dataclasses.dataclass(frozen=True)
class SeedsReport:
    """Every tensor over the seeds; ``values``: the seeds every verdict rests on."""

    values: tuple[int, ...]
    tensors: tuple[SeedSpread, ...]

    @property
    def failing_seeds(self) -> list[int]:
        failing = {seed for spread in self.tensors for seed in spread.failing_seeds}
        return [seed for seed in self.values if seed in failing]

    def to_dict(self) -> dict[str, Any]:
        return {"count": len(self.values), "values": list(self.values), "failing_seeds": self.failing_seeds,
                "tensors": [spread.to_dict() for spread in self.tensors]}


def _worst_key(result: TensorResult) -> tuple[int, float]:
    rel_l2 = result.metrics.rel_l2 if result.metrics is not None else math.inf
    return (0 if result.passed else 1, math.inf if rel_l2 is None or math.isnan(rel_l2) else rel_l2)


def _numbers(results: Sequence[TensorResult], quantity: str) -> tuple[float | None, float | None]:
    values = [getattr(r.metrics, quantity) for r in results if r.metrics is not None]
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    finite = [v for v in values if not math.isnan(v)]
    worst = math.nan if len(finite) < len(values) else max(finite)
    return worst, (statistics.median(finite) if finite else math.nan)


def combine(draws: Sequence[tuple[int, Sequence[TensorResult]]]) -> tuple[list[TensorResult], SeedsReport]:
    """Each tensor's worst result over the draws (in the first draw's order, then any tensor only a
    later draw has), and the spread over the seeds."""
    order: list[str] = []
    by_name: dict[str, list[tuple[int, TensorResult]]] = {}
    for seed, results in draws:
        for result in results:
            if result.name not in by_name:
                order.append(result.name)
                by_name[result.name] = []
            by_name[result.name].append((seed, result))
    worst_results, spreads = [], []
    for name in order:
        pairs = by_name[name]
        worst_seed, worst = max(pairs, key=lambda pair: _worst_key(pair[1]))
        results = [result for _, result in pairs]
        rel_worst, rel_median = _numbers(results, "rel_l2")
        abs_worst, abs_median = _numbers(results, "max_abs")
        worst_results.append(worst)
        spreads.append(SeedSpread(
            name=name, seeds=tuple(seed for seed, _ in pairs),
            failing_seeds=tuple(seed for seed, result in pairs if not result.passed), worst_seed=worst_seed,
            rel_l2_worst=rel_worst, rel_l2_median=rel_median, max_abs_worst=abs_worst, max_abs_median=abs_median))
    return worst_results, SeedsReport(values=tuple(seed for seed, _ in draws), tensors=tuple(spreads))
