"""The lab beside the package: the programs that measured the kernel and the harness, not installed.

Run from the checkout (its root on the path): ``python -m bench.benchmark_table``, ``python -m
bench.benchmark_decode``, ``bash bench/h200_run.sh``, ``python bench/harness/harness_benchmark.py``.
What they found, with the commands and the raw results, is ``bench/BENCHMARK.md`` (the lab
notebook), ``bench/results/`` and ``bench/harness/``. Nothing in ``parity`` imports this folder:
a wheel of parity holds none of it.
"""
