"""The lab's JSON formats: each one's version and its schema in ``bench/schemas/``.

They follow the package's convention (:mod:`parity.base.jsonformat`: ``"format"`` and ``"version"``
first, non-finite floats as ``$defs/float`` strings) but are not the package's: no installed code
writes or reads them, so their schemas stay beside the lab, out of the wheel.

==================================  =======  ==================================================
format                              version  written by
==================================  =======  ==================================================
``parity-benchmark-report``         1        ``python -m bench.benchmark --json``
``parity-decode-benchmark-report``  1        ``python -m bench.benchmark_decode --json``
``parity-benchmark-table-report``   1        ``python -m bench.benchmark_table --json``
``parity-harness-benchmark-report`` 2        ``python bench/harness/harness_benchmark.py --json``
``parity-capture-scale-report``     1        ``python -m bench.capture_scale_gpu`` (one per size)
==================================  =======  ==================================================
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BENCHMARK_REPORT = "parity-benchmark-report"
DECODE_BENCHMARK_REPORT = "parity-decode-benchmark-report"
BENCHMARK_TABLE_REPORT = "parity-benchmark-table-report"
HARNESS_BENCHMARK_REPORT = "parity-harness-benchmark-report"
CAPTURE_SCALE_REPORT = "parity-capture-scale-report"

# format -> (current version, schema file in SCHEMA_DIR)
FORMATS: dict[str, tuple[int, str]] = {
    BENCHMARK_REPORT: (1, "benchmark-report.schema.json"),
    DECODE_BENCHMARK_REPORT: (1, "decode-benchmark-report.schema.json"),
    BENCHMARK_TABLE_REPORT: (1, "benchmark-table-report.schema.json"),
    HARNESS_BENCHMARK_REPORT: (2, "harness-benchmark-report.schema.json"),
    CAPTURE_SCALE_REPORT: (1, "capture-scale-report.schema.json"),
}

SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"


def schema_for(format_name: str) -> dict[str, Any]:
    """The JSON Schema (a dict) of the lab's documents whose ``"format"`` is ``format_name``."""
    try:
        name = FORMATS[format_name][1]
    except KeyError:
        raise ValueError(f"unknown lab JSON format {format_name!r}; known: {', '.join(FORMATS)}") from None
    return json.loads((SCHEMA_DIR / name).read_text(encoding="utf-8"))
