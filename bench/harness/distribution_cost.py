"""What the error distribution (parity.judge.distribution) adds to the metrics' time, on the CPU.

Times ``compute_metrics`` on one fp32 pair with the histogram on and with its per-chunk work
switched off, interleaved, on one thread, and prints the medians and minima of ``--repeats``
runs each. The machine's cores may be shared: read the medians of one run of this command.

    .venv/bin/python bench/harness/distribution_cost.py --log2-elements 22 --repeats 15
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from parity.judge import distribution
from parity.judge.metrics import compute_metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log2-elements", type=int, default=22)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    ref = torch.randn(2 ** args.log2_elements, generator=generator)
    out = ref + 1e-3 * torch.randn(ref.numel(), generator=generator)
    counting = distribution.LogHistogram.add
    times: dict[str, list[float]] = {"with": [], "without": []}
    for _ in range(args.repeats):
        for variant in times:
            distribution.LogHistogram.add = counting if variant == "with" else (lambda self, *a, **k: None)
            start = time.perf_counter()
            compute_metrics(out, ref, atol=1e-5, rtol=1e-3)
            times[variant].append(time.perf_counter() - start)
    distribution.LogHistogram.add = counting
    with_, without = (statistics.median(times[v]) for v in ("with", "without"))
    print(f"2^{args.log2_elements} fp32 pair, 1 thread, medians of {args.repeats} interleaved runs: with the "
          f"distribution {with_:.3f} s, without {without:.3f} s ({with_ / without:.2f}x); minima "
          f"{min(times['with']):.3f} / {min(times['without']):.3f} s")


if __name__ == "__main__":
    main()
