"""How often ``bench --baseline`` calls a true slowdown REGRESSED, and how far apart two runs of
one build were on the H200: the measurements behind parity.speed.regression's default threshold.

    .venv/bin/python bench/regression_power.py

Part 1 simulates pairs of 20-round runs (normal timings, IQR/median 0.02, 0.05, 0.10; the later
run slower by 0-15%) and counts REGRESSED at the default 5% threshold in 100 pairs each. Part 2
compares the two bench runs of the H200 story (bench/results/h200-story-2: bench.json, then
bench-wrong.json minutes later, the same reference and Triton forward) impl by impl.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from parity.speed import regression, stats

ROUNDS, TRIALS = 20, 100
RESULTS = Path(__file__).parent / "results" / "h200-story-2"


def simulate() -> None:
    for rel_iqr in (0.02, 0.05, 0.10):
        sd = rel_iqr / 1.349  # a normal sample's IQR is 1.349 sd
        for slowdown in (0.0, 0.05, 0.08, 0.10, 0.15):
            hits = 0
            for trial in range(TRIALS):
                rng = random.Random(1000 * trial + 7)
                then = [max(1e-3, rng.gauss(1.0, sd)) for _ in range(ROUNDS)]
                now = [max(1e-3, rng.gauss(1.0 + slowdown, sd * (1 + slowdown))) for _ in range(ROUNDS)]
                _, low, high = stats.bootstrap_ratio(now, then, seed=trial, resamples=500)
                hits += regression.regression_status(low, high) == regression.REGRESSED
            print(f"IQR/median {rel_iqr:.2f}, {slowdown:.0%} slower: REGRESSED in {hits} of {TRIALS}")


def h200_drift() -> None:
    first = json.loads((RESULTS / "bench.json").read_text())
    later = json.loads((RESULTS / "bench-wrong.json").read_text())
    times = {row["impl"]: row["times_s"] for row in later["impls"]}
    for row in first["impls"]:
        ratio, low, high = stats.bootstrap_ratio(times[row["impl"]], row["times_s"])
        # the faster run as "then": the drift as a slowdown
        if ratio < 1:
            ratio, low, high = 1 / ratio, 1 / high, 1 / low
        print(f"H200, two runs of one build, {row['impl']}: {100 * (ratio - 1):.1f}% apart, 95% interval "
              f"{100 * (low - 1):.1f}% to {100 * (high - 1):.1f}%; status at 5%: "
              f"{regression.regression_status(low, high)}, at 3%: {regression.regression_status(low, high, 0.03)}")


if __name__ == "__main__":
    simulate()
    h200_drift()
