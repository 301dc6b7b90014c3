"""Profiles read from files: the vendors' kernel tables (``--import``, ``--against``) in the
profile's kernel view, and a parity profile's ``--json`` file (``--against``), checked field by field.

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

Kernel names are kept as written (quoted names may hold commas and quotes; the csv module's
131072-character field limit is raised to the file-size cap). The share of each kernel is
recomputed from the totals (the files' own percentages are rounded).

Refused (UsageError, exit 2, one line naming the file, line or field): malformed CSV (an
unterminated quote named as such), a header that names a column twice, a time unit parity does not
know, and values no profile holds, in CSV and JSON alike (:func:`time_problem`,
:func:`calls_problem`): a time that is not a finite number from 0 to 10^18 ns, a call count that
is not a whole number from 0 to 10^12. A JSON document is data: every field the side by side
reads is checked before it is used (:func:`check_profile_document`).
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from parity.base.errors import UsageError, check_readable_file
from parity.base.jsonformat import PROFILE_REPORT, envelope, finite, version_of
from parity.base.text import printable
from .tables import fmt_time, time_unit

MAX_BYTES = 256 * 2**20
# The largest values a profile may hold: 10^18 ns is 31 years of device time, and 10^12 calls of
# a kernel would take weeks at a microsecond each. Larger values are corrupt, never measured, and
# would overflow the sums (1e308 + 1e308 is inf).
MAX_NS = 1e18  # the messages say 10^18
MAX_CALLS = 10**12

ROCPROFV3 = "rocprofv3 kernel_stats.csv"
ROCPROF_V1 = "rocprof v1 results.stats.csv"
NSYS = "nsys stats cuda_gpu_kern_sum"

_UNITS = {"ns": 1.0, "us": 1e3, "\u00b5s": 1e3, "ms": 1e6, "s": 1e9}
_ROCPROF_COLUMNS = {"name": "name", "calls": "calls", "totaldurationns": "total", "averagens": "avg",
                    "minns": "min", "maxns": "max", "stddev": "stddev"}
_NSYS_COLUMNS = {"name": "name", "instances": "calls"}
_NSYS_TIMED = {"total time (": "total", "avg (": "avg", "med (": "median", "min (": "min", "max (": "max",
               "stddev (": "stddev"}


# ---------------------------------------------------------------------------------------------
# The values a profile may hold (CSV rows and --against JSON alike)


def _real(value: Any) -> float | None:
    """``value`` as a float if it is a number (a bool is not; an int too large for a float is inf)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf


def time_problem(value: Any) -> str | None:
    """Why ``value`` is not a time of a profile in ns (a finite number from 0 to MAX_NS), or None."""
    number = _real(value)
    if number is None or math.isnan(number) or number < 0:
        return "must be a finite number >= 0"
    if number > MAX_NS:  # inf included
        return "must be at most 10^18 ns (31 years)"
    return None


def calls_problem(value: Any) -> str | None:
    """Why ``value`` is not a count of calls (a whole number from 0 to MAX_CALLS), or None."""
    number = _real(value)
    if number is None or not math.isfinite(number) or number < 0 or not number.is_integer():
        return "must be a whole number >= 0"
    if number > MAX_CALLS:
        return "must be at most 10^12"
    return None


# ---------------------------------------------------------------------------------------------
# Vendor kernel tables (CSV)


def _norm(header: str) -> str:
    return header.strip().strip('"').strip()


def _rocprof_column(name: str, where: str) -> tuple[str, float] | None:
    key = _ROCPROF_COLUMNS.get(name.lower())
    return None if key is None else (key, 1.0)


def _nsys_column(name: str, where: str) -> tuple[str, float] | None:
    """``(key, ns per unit)`` of an nsys column; UsageError for a time unit parity does not know."""
    lower = name.lower()
    if lower in _NSYS_COLUMNS:
        return _NSYS_COLUMNS[lower], 1.0
    for prefix, key in _NSYS_TIMED.items():
        if lower.startswith(prefix) and lower.endswith(")"):
            unit = lower[len(prefix):-1]
            if unit not in _UNITS:
                raise UsageError(f"{where}: unknown time unit {printable(unit, limit=40)!r} in column "
                                 f"{printable(name, limit=60)!r} (known: ns, us, ms, s)")
            return key, _UNITS[unit]
    return None


def _layout(header: list[str], column: Callable[[str, str], tuple[str, float] | None],
            where: str) -> dict[str, Any]:
    """Column index and ns-per-unit scale of each known column; UsageError for a duplicate."""
    columns: dict[str, int] = {}
    scale: dict[str, float] = {}
    for index, cell in enumerate(header):
        found = column(_norm(cell), where)
        if found is None:
            continue
        key, factor = found
        if key in columns:
            first, second = (printable(_norm(header[i]), limit=60) for i in (columns[key], index))
            raise UsageError(f"{where}: the header has two {key} columns ({first!r} and {second!r})")
        columns[key], scale[key] = index, factor
    return {"columns": columns, "scale": scale, "labels": [_norm(cell) for cell in header]}


def _detect(header: list[str], where: str) -> tuple[str, dict[str, Any]] | None:
    """The format and layout of a header row, or None for a row that is not a known header."""
    names = {_norm(h).lower() for h in header}
    if {"name", "calls", "totaldurationns", "averagens", "percentage"} <= names:
        fmt = ROCPROFV3 if {"minns", "maxns"} <= names else ROCPROF_V1
        return fmt, _layout(header, _rocprof_column, where)
    if "name" in names and "instances" in names and any(n.startswith("total time (") for n in names):
        return NSYS, _layout(header, _nsys_column, where)
    return None


@contextlib.contextmanager
def _field_limit(limit: int) -> Iterator[None]:
    """The csv module's field size limit (131072 by default; a templated kernel name can exceed it)
    raised for the block, then restored."""
    previous = csv.field_size_limit(limit)
    try:
        yield
    finally:
        csv.field_size_limit(previous)


def _malformed(err: csv.Error | None, first: int, last: int) -> str:
    """What is wrong with the record on lines ``first`` to ``last``: a quote left open where it runs
    past its line (a kernel name holds no line break), else the csv module's complaint."""
    if err is not None and "end of data" in str(err):
        return "unterminated quote (the quoted field runs to the end of the file)"
    if last > first:
        return f"unterminated quote (the quoted field runs on to line {last})"
    return f"not valid CSV: {printable(str(err), limit=100)}"


def _records(text: str, where: str) -> list[tuple[int, list[str]]]:
    """``(line, cells)`` of each CSV record (strict CSV); UsageError naming the line of a
    malformed record (:func:`_malformed`)."""
    reader = csv.reader(io.StringIO(text), strict=True)
    records, line = [], 1
    with _field_limit(MAX_BYTES):
        while True:
            try:
                row = next(reader)
            except StopIteration:
                return records
            except csv.Error as err:
                raise UsageError(f"{where} line {line}: {_malformed(err, line, reader.line_num)}") from None
            if reader.line_num > line and any("\n" in cell or "\r" in cell for cell in row):
                raise UsageError(f"{where} line {line}: {_malformed(None, line, reader.line_num)}")
            records.append((line, row))
            line = reader.line_num + 1


def _number(text: str, *, where: str) -> float:
    cleaned = text.strip().strip('"').replace(",", "").replace("\u202f", "").strip()
    try:
        return float(cleaned)
    except ValueError:
        raise UsageError(f"{where} {printable(text, limit=60)!r} is not a number") from None


def _row(cells: list[str], layout: dict[str, Any], where: str) -> dict[str, Any]:
    """One kernel row, times in ns; UsageError for a value :func:`time_problem` or
    :func:`calls_problem` refuses, naming the column as the header writes it."""
    columns, scale, labels = layout["columns"], layout["scale"], layout["labels"]

    def value(key: str, problem: Callable[[Any], str | None]) -> float | None:
        if key not in columns:
            return None
        text = cells[columns[key]]
        number = _number(text, where=f"{where}: {labels[columns[key]]}") * scale[key]
        reason = problem(number)
        if reason is not None:
            raise UsageError(f"{where}: {labels[columns[key]]} {printable(text, limit=60)!r} {reason}")
        return number

    calls = value("calls", calls_problem)
    return {"name": cells[columns["name"]], "kind": "kernel", "calls": int(calls),
            "total_ns": value("total", time_problem),
            **{f"{key}_ns": value(key, time_problem) for key in ("avg", "median", "min", "max", "stddev")}}


def _read_text(path: str | os.PathLike, flag: str, expected: str) -> str:
    """The file's UTF-8 text, checked first (:func:`check_readable_file`)."""
    check_readable_file(path, flag, expected=expected, max_bytes=MAX_BYTES)
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise UsageError(f"{flag} {path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise UsageError(f"{flag} {path}: cannot read: {err.strerror or err}") from None


def read_kernel_table(path: str | os.PathLike, flag: str = "--import") -> tuple[str, list[dict[str, Any]]]:
    """``(format, rows)``: the kernel rows of a rocprofv3, rocprof v1 or nsys CSV, times in ns;
    ``flag`` (the option that named the file) starts every error message."""
    where = f"{flag} {Path(path)}"
    records = _records(_read_text(path, flag, "a kernel summary CSV file"), where)
    detected = next(((index, found) for index, (line, row) in enumerate(records)
                     if row and (found := _detect(row, f"{where} line {line}")) is not None), None)
    if detected is None:
        raise UsageError(f"{where}: no header of a known kernel summary (rocprofv3 kernel_stats.csv, rocprof "
                         "results.stats.csv, nsys stats cuda_gpu_kern_sum CSV)")
    index, (fmt, layout) = detected
    width = len(records[index][1])
    for needed in ("name", "calls", "total"):
        if needed not in layout["columns"]:
            raise UsageError(f"{where}: the {fmt} header has no {needed} column")
    rows: list[dict[str, Any]] = []
    for line, cells in records[index + 1:]:
        if not cells or all(not cell.strip() for cell in cells):
            continue
        if len(cells) != width:
            raise UsageError(f"{where} line {line}: {len(cells)} fields, the header has {width} "
                             "(an unquoted comma in a kernel name?)")
        rows.append(_row(cells, layout, f"{where} line {line}"))
    if not rows:
        raise UsageError(f"{where}: the {fmt} table has no kernel rows; refusing to show an empty table")
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


# ---------------------------------------------------------------------------------------------
# A parity profile's --json file (the other side of --against)


def shown_json(value: Any) -> str:
    """A JSON value as a message shows it: scalars as JSON text, containers by their kind."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    return printable(json.dumps(value), limit=60)


def _bad(field: str, expected: str, value: Any) -> ValueError:
    return ValueError(f"{field} {expected}, got {shown_json(value)}")


def _member(mapping: dict[str, Any], key: str, field: str) -> Any:
    if key not in mapping:
        raise ValueError(f"{field} is missing")
    return mapping[key]


def _check_row(row: Any, field: str) -> None:
    """A module or kernel row as the side by side reads it: name, total_ns, share and calls."""
    if not isinstance(row, dict):
        raise _bad(field, "must be an object", row)
    name = _member(row, "name", f"{field}.name")
    if not isinstance(name, str):
        raise _bad(f"{field}.name", "must be a string", name)
    for key, problem in (("total_ns", time_problem), ("calls", calls_problem)):
        value = _member(row, key, f"{field}.{key}")
        if (reason := problem(value)) is not None:
            raise _bad(f"{field}.{key}", reason, value)
    share = _member(row, "share", f"{field}.share")
    number = _real(share)
    if number is None or not 0 <= number <= 1:
        raise _bad(f"{field}.share", "must be a number from 0 to 1", share)


def _check_object(document: dict[str, Any], key: str, *, nullable: bool) -> dict[str, Any]:
    """``document[key]``, an object (or null where ``nullable``; then an empty dict)."""
    value = document.get(key)
    if value is None and nullable:
        return {}
    if not isinstance(value, dict):
        raise _bad(key, "must be an object" + (" or null" if nullable else ""), value)
    return value


def _check_text(mapping: dict[str, Any], key: str, field: str) -> None:
    value = mapping.get(key)
    if value is not None and not isinstance(value, str):
        raise _bad(field, "must be a string or null", value)


def check_profile_document(document: dict[str, Any]) -> None:
    """ValueError naming the first field that the side by side reads and cannot use: labels
    (subject.name, impl, device, settings.file), totals.steps, and every modules and kernels row."""
    subject = _check_object(document, "subject", nullable=True)
    for mapping, key, field in ((subject, "name", "subject.name"), (document, "impl", "impl"),
                                (document, "device", "device")):
        _check_text(mapping, key, field)
    _check_text(_check_object(document, "settings", nullable=False), "file", "settings.file")
    steps = _check_object(document, "totals", nullable=False).get("steps")
    if steps is not None and (type(steps) is not int or calls_problem(steps) is not None or steps < 1):  # 2.0: no
        raise _bad("totals.steps", "must be a whole number from 1 to 10^12 or null", steps)
    for key in ("modules", "kernels"):
        rows = _member(document, key, key)
        if not isinstance(rows, list):
            raise _bad(key, "must be an array", rows)
        for index, row in enumerate(rows):
            _check_row(row, f"{key}[{index}]")


def load_json_file(path: str | os.PathLike, flag: str, expected: str = "a profile JSON file") -> Any:
    """The JSON document in the file at ``path`` (checked first, UTF-8); UsageError with one line
    starting with ``flag`` where it is not readable or not JSON. ``expected``: what the file
    should be, for the refusal of a file that is not one (a directory, a FIFO, too large)."""
    try:
        return json.loads(_read_text(path, flag, expected))
    except RecursionError:
        raise UsageError(f"{flag} {path}: not a JSON document: nested too deeply") from None
    except ValueError as err:  # JSONDecodeError is a ValueError; so is an int of too many digits
        raise UsageError(f"{flag} {path}: not a JSON document: {printable(str(err), limit=200)}") from None


def check_report_header(document: Any, flag: str, shown: Any, fmt: str, kind: str) -> dict[str, Any]:
    """``document`` if it is a parity report of format ``fmt`` (``kind`` names it in the message) at
    the version this parity reads; else a UsageError naming ``flag`` and the file ``shown``."""
    if not isinstance(document, dict) or document.get("format") != fmt:
        raise UsageError(f"{flag} {shown}: not a parity {kind} (format {fmt})")
    version = document.get("version")
    if type(version) is not int or version != version_of(fmt):
        raise UsageError(f"{flag} {shown}: {kind} version {shown_json(version)}, this parity reads {version_of(fmt)}")
    return document


def read_profile_json(path: str | os.PathLike, flag: str) -> dict[str, Any]:
    """A parity profile's ``--json`` file, its format, version and the fields a side by side
    reads checked (:func:`check_profile_document`); UsageError naming the first bad field."""
    document = check_report_header(load_json_file(path, flag), flag, path, PROFILE_REPORT, "profile")
    try:
        check_profile_document(document)
    except ValueError as err:
        raise UsageError(f"{flag} {path}: {err}") from None
    return document


def read_profile(path: str | os.PathLike, flag: str) -> dict[str, Any]:
    """A profile document from a file: a parity profile's ``.json``, else a vendor kernel table."""
    if os.fspath(path).lower().endswith(".json"):
        return read_profile_json(path, flag)
    return import_profile(path, flag)


__all__ = ["MAX_CALLS", "MAX_NS", "NSYS", "ROCPROFV3", "ROCPROF_V1", "calls_problem", "check_profile_document",
           "import_profile", "read_kernel_table", "read_profile", "read_profile_json", "time_problem"]
