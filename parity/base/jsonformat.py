"""The convention every JSON output of parity follows: format names, versions, schemas, non-finite numbers.

Every document parity writes for machines starts with ``"format"`` (what it is, always
``parity-<kind>-report``) and ``"version"`` (an integer). The version goes up when a field is
removed or changes meaning; a field may be added within a version (readers ignore what they do
not know). Each format has a JSON Schema (draft 2020-12) in ``parity/schemas/``, shipped with the
package: :func:`schema_for` loads it.

============================  =======  =========================================================
format                        version  written by
============================  =======  =========================================================
``parity-compare-report``     1        ``compare --json`` and ``diff --json`` (``candidate`` set),
                                       and in their place, when they end with exit status 2 or
                                       3, the error report (``error`` set, no results)
``parity-pytest-report``      1        the pytest plugin's ``--parity-report``
``parity-show-report``        2        ``show --json`` (version 1 named the digests ``sha256``)
``parity-inspect-report``     1        ``inspect --json``
``parity-profile-report``     1        ``profile --json`` (parity.speed.profile)
``parity-bench-report``       1        ``bench --json`` (parity.speed.bench)
============================  =======  =========================================================

The lab beside the package (``bench/``, not installed) writes formats of its own in the same
convention, with their schemas beside it (``bench/formats.py``).

Non-finite numbers: JSON has none, so a float field holds a number or one of the strings
``"nan"``, ``"inf"``, ``"-inf"`` (:func:`parity.judge.metrics.json_safe_float` writes them,
:func:`read_float` reads them back); every schema names this type ``$defs/float``. Documents are
written with ``allow_nan=False``, so a bare ``NaN``/``Infinity`` can never appear.

This module imports nothing heavy (the pytest plugin and the CLI load it before torch).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COMPARE_REPORT = "parity-compare-report"
PYTEST_REPORT = "parity-pytest-report"
SHOW_REPORT = "parity-show-report"
INSPECT_REPORT = "parity-inspect-report"
PROFILE_REPORT = "parity-profile-report"
BENCH_REPORT = "parity-bench-report"

# format -> (current version, schema file in SCHEMA_DIR)
FORMATS: dict[str, tuple[int, str]] = {
    COMPARE_REPORT: (1, "compare-report.schema.json"),
    PYTEST_REPORT: (1, "pytest-report.schema.json"),
    SHOW_REPORT: (2, "show-report.schema.json"),
    INSPECT_REPORT: (1, "inspect-report.schema.json"),
    PROFILE_REPORT: (1, "profile-report.schema.json"),
    BENCH_REPORT: (1, "bench-report.schema.json"),
}

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas"

NON_FINITE = ("nan", "inf", "-inf")


def version_of(format_name: str) -> int:
    return FORMATS[format_name][0]


def envelope(format_name: str) -> dict[str, Any]:
    """``{"format": ..., "version": ...}``: the first two keys of every document."""
    return {"format": format_name, "version": version_of(format_name)}


def schema_path(format_name: str) -> Path:
    try:
        return SCHEMA_DIR / FORMATS[format_name][1]
    except KeyError:
        raise ValueError(f"unknown JSON format {format_name!r}; known: {', '.join(FORMATS)}") from None


def schema_for(format_name: str) -> dict[str, Any]:
    """The JSON Schema (a dict) of documents whose ``"format"`` is ``format_name``."""
    return json.loads(schema_path(format_name).read_text(encoding="utf-8"))


def read_float(value: Any) -> float | None:
    """A ``$defs/float`` value as a Python float: a number, or "nan"/"inf"/"-inf"; None stays None."""
    if value is None:
        return None
    if isinstance(value, str):
        if value not in NON_FINITE:
            raise ValueError(f"not a float of a parity JSON document: {value!r}")
        return float(value)
    return float(value)


def finite(value: Any) -> Any:
    """``value`` (nested dicts, lists, tuples) with every non-finite float as its ``$defs/float``
    string, for documents assembled from raw measurements."""
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def dumps(document: Any, *, indent: int | None = 1, ensure_ascii: bool = False) -> str:
    """The document as JSON text (a bare NaN or Infinity is a bug: ValueError, never written)."""
    return json.dumps(document, indent=indent, ensure_ascii=ensure_ascii, allow_nan=False)


__all__ = ["BENCH_REPORT", "PROFILE_REPORT", "COMPARE_REPORT", "FORMATS", "INSPECT_REPORT",
           "NON_FINITE", "PYTEST_REPORT", "SCHEMA_DIR", "SHOW_REPORT", "dumps", "envelope", "finite", "read_float",
           "schema_for", "schema_path", "version_of"]
