"""Kernel tables written by the vendors' profilers, read into the profile's kernel view.

Formats (recognised by their header row; the file is data, read as CSV text and nothing else):

- ``rocprofv3 --kernel-trace --stats``: ``<pid>_kernel_stats.csv``, header
  ``"Name","Calls","TotalDurationNs","AverageNs","Percentage","MinNs","MaxNs","StdDev"``
  (ROCm/rocprofiler-sdk docs; there is no median);
- rocprof v1 ``--stats``: ``results.stats.csv``, header
  ``"Name","Calls","TotalDurationNs","AverageNs","Percentage"`` (``bin/tblextr.py``);
- ``nsys stats --report cuda_gpu_kern_sum --format csv``: header ``Time (%),Total Time (ns),
  Instances,Avg (ns),Med (ns),Min (ns),Max (ns),StdDev (ns),Name``; with ``--timeunit`` the unit
  in the headers changes (``(us)``, ``(ms)``, ``(s)``) and is converted back to ns. Lines before
  the header (nsys prints ``Processing [...] with [...]...`` when writing to standard output)
  are skipped.

Kernel names are kept as written (quoted names may hold commas and quotes). The share of each
kernel is recomputed from the totals (the files' own percentages are rounded).
"""
from __future__ import annotations

import csv
import io
import math
import os
from pathlib import Path
from typing import Any

from parity.base.errors import UsageError, check_readable_file
from parity.base.jsonformat import PROFILE_REPORT, envelope, finite
from parity.base.text import printable
from .tables import fmt_time, time_unit

MAX_BYTES = 256 * 2**20

ROCPROFV3 = "rocprofv3 kernel_stats.csv"
ROCPROF_V1 = "rocprof v1 results.stats.csv"
NSYS = "nsys stats cuda_gpu_kern_sum"

_UNITS = {"ns": 1.0, "us": 1e3, "\u00b5s": 1e3, "ms": 1e6, "s": 1e9}


def _norm(header: str) -> str:
    return header.strip().strip('"').strip().lower()


def _detect(header: list[str]) -> tuple[str, dict[str, Any]] | None:
    names = [_norm(h) for h in header]
    if {"name", "calls", "totaldurationns", "averagens", "percentage"} <= set(names):
        fmt = ROCPROFV3 if {"minns", "maxns"} <= set(names) else ROCPROF_V1
        columns = {"name": "name", "calls": "calls", "total": "totaldurationns", "avg": "averagens",
                   "min": "minns", "max": "maxns", "stddev": "stddev"}
        return fmt, {"columns": {key: names.index(col) for key, col in columns.items() if col in names},
                     "scale": {key: 1.0 for key in columns}}
    if "name" in names and "instances" in names and any(n.startswith("total time (") for n in names):
        columns, scale = {}, {}
        for index, name in enumerate(names):
            key = {"name": "name", "instances": "calls"}.get(name)
            if key is None:
                for prefix, k in (("total time (", "total"), ("avg (", "avg"), ("med (", "median"), ("min (", "min"),
                                  ("max (", "max"), ("stddev (", "stddev")):
                    if name.startswith(prefix) and name.endswith(")"):
                        unit = name[len(prefix):-1]
                        if unit not in _UNITS:
                            raise UsageError(f"unknown time unit {unit!r} in column {header[index]!r}")
                        key, scale[k] = k, _UNITS[unit]
            if key is not None:
                columns[key] = index
        return NSYS, {"columns": columns, "scale": scale}
    return None


def _number(text: str, *, where: str) -> float:
    cleaned = text.strip().strip('"').replace(",", "").replace("\u202f", "").strip()
    try:
        value = float(cleaned)
    except ValueError:
        raise UsageError(f"{where}: {printable(text, limit=60)!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"{where}: {printable(text, limit=60)!r} is not a non-negative finite number")
    return value


def read_kernel_table(path: str | os.PathLike, flag: str = "--import") -> tuple[str, list[dict[str, Any]]]:
    """``(format, rows)``: the kernel rows of a rocprofv3, rocprof v1 or nsys CSV, times in ns;
    ``flag`` (the option that named the file) starts every error message."""
    check_readable_file(path, flag, expected="a kernel summary CSV file", max_bytes=MAX_BYTES)
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise UsageError(f"{flag} {file}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    reader = csv.reader(io.StringIO(text))
    detected = None
    line = 0
    for line, row in enumerate(reader, start=1):
        if row and (detected := _detect(row)) is not None:
            width = len(row)
            break
    if detected is None:
        raise UsageError(f"{flag} {file}: no header of a known kernel summary (rocprofv3 kernel_stats.csv, rocprof "
                         "results.stats.csv, nsys stats cuda_gpu_kern_sum CSV)")
    fmt, layout = detected
    columns, scale = layout["columns"], layout["scale"]
    for needed in ("name", "calls", "total"):
        if needed not in columns:
            raise UsageError(f"{flag} {file}: the {fmt} header has no {needed} column")
    rows: list[dict[str, Any]] = []
    for line, row in enumerate(reader, start=line + 1):
        if not row or all(not cell.strip() for cell in row):
            continue
        if len(row) != width:
            raise UsageError(f"{flag} {file} line {line}: {len(row)} fields, the header has {width} "
                             "(an unquoted comma in a kernel name?)")
        where = f"{flag} {file} line {line}"
        calls = _number(row[columns["calls"]], where=where)
        if calls != int(calls):
            raise UsageError(f"{where}: calls {row[columns['calls']]!r} is not a whole number")

        def field(key: str) -> float | None:
            if key not in columns:
                return None
            return _number(row[columns[key]], where=where) * scale.get(key, 1.0)

        rows.append({"name": row[columns["name"]], "kind": "kernel", "calls": int(calls), "total_ns": field("total"),
                     "avg_ns": field("avg"), "median_ns": field("median"), "min_ns": field("min"),
                     "max_ns": field("max"), "stddev_ns": field("stddev")})
    if not rows:
        raise UsageError(f"{flag} {file}: the {fmt} table has no kernel rows; refusing to show an empty table")
    return fmt, rows


def import_profile(path: str | os.PathLike, flag: str = "--import") -> dict[str, Any]:
    """A profile document (kernel view only) of a vendor profiler's kernel summary."""
    fmt, rows = read_kernel_table(path, flag)
    total = sum(row["total_ns"] for row in rows)
    if total <= 0:
        raise UsageError(f"{flag} {path}: every kernel has zero time; refusing to show an empty table")
    for row in rows:
        row["share"] = row["total_ns"] / total
        row["wall_share"] = None
    rows.sort(key=lambda row: (-row["total_ns"], row["name"]))
    top = rows[0]
    unit, scale = time_unit([total / 1e9])
    document = {
        **envelope(PROFILE_REPORT), "source": f"import:{fmt}", "subject": None, "impl": None, "device": None,
        "platform": None,
        "settings": {"counted": "kernel time, as the file reports it", "schedule": None, "file": str(path),
                     "file_format": fmt},
        "totals": {"device_ns": total, "wall_ns": None, "busy_ns": None, "busy_share": None, "steps": None,
                   "events_per_step": []},
        "modules": [], "module_calls": [], "ops": [], "kernels": rows, "hot": None,
        "headline": (f"top kernel {printable(top['name'], limit=120)}: {100 * top['share']:.1f}% of "
                     f"{fmt_time(total / 1e9, scale)} {unit} of kernel time ({len(rows)} kernels, {fmt})"),
        "trace": None, "against": None, "warnings": [],
    }
    return finite(document)


__all__ = ["NSYS", "ROCPROFV3", "ROCPROF_V1", "import_profile", "read_kernel_table"]
