"""A bench run against a saved one (``bench --baseline previous.json``): the saved report read and
checked as data, the check that both runs timed the same subject on the same device, and per
implementation the time ratio now / then with its interval and a regression status.

Rule (the bench verdict's, NVBench's anchor: a change is named only when its interval clears a
gap): per implementation in both runs, ``ratio = median(now) / median(then)`` of the whole
forward's times, with the seeded percentile bootstrap 95% interval of :mod:`parity.speed.stats`.

- ``REGRESSED`` when the interval's lower bound is above ``1 + threshold`` (slower by more than
  the threshold, and the data exclude anything less);
- ``IMPROVED`` when its upper bound is below ``1 - threshold``;
- ``SAME`` when the whole interval lies inside ``[1 - threshold, 1 + threshold]``;
- ``UNCLEAR`` otherwise.

The default threshold, 5% (measured by ``bench/regression_power.py``): two runs of the same
build on the H200, minutes apart (bench/results/h200-story-2), put the reference decoder 2.8%
apart (interval 0.6% to 3.6%: SAME) and the noisy Triton forward (IQR/median 0.08 and 0.19) 20%
apart with an interval from 3.1% to 23%: a threshold of 3% calls that drift REGRESSED, 5% says
UNCLEAR. What it still catches, in 100 simulated pairs of 20-round runs: an 8% slowdown at
IQR/median 0.02 every time, 10% at 0.05 in 86, 15% at 0.10 in 86; a true 5% slowdown is called
REGRESSED 5 times in 100, no change never.

Same setup: a different subject (spec or arguments), different input shapes or dtypes, or a
different device (vendor, arch, device type, device name, multiprocessor count: a MIG slice is
another device) is refused with exit 2: such timings are not a regression check. Any other
difference of the platform fingerprint (torch, Triton, driver, CUDA/ROCm, numerics flags, the
host's OS) is a warning naming each: checking a software upgrade is one of the reasons to
compare with a saved run, so it is allowed and said. A different cache-flush setting is warned
too. Implementations in one run only are named and skipped; none in common is refused.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from parity.base.errors import UsageError
from parity.base.jsonformat import BENCH_REPORT
from parity.base.text import printable
from . import stats
from .importers import check_report_header, load_json_file, shown_json

DEFAULT_THRESHOLD = 0.05
REGRESSED, IMPROVED, SAME, UNCLEAR = "REGRESSED", "IMPROVED", "SAME", "UNCLEAR"
STATUSES = (REGRESSED, IMPROVED, SAME, UNCLEAR)

# Platform fingerprint keys that say which device ran: a difference refuses the comparison.
DEVICE_KEYS = ("vendor", "arch", "device", "device_name", "multiprocessors")
# Keys that change between two runs of one setup without changing what runs.
IGNORED_KEYS = ("numerics_env",)


# ---------------------------------------------------------------------------------------------
# Reading the saved run


def _positive_time(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def check_previous_document(document: Mapping[str, Any]) -> None:
    """ValueError naming the first field a comparison reads and cannot use: subject (spec, args),
    device, platform, settings, input_shapes, and every impl's name and times."""
    subject = document.get("subject")
    if not isinstance(subject, dict):
        raise ValueError(f"subject must be an object, got {shown_json(subject)}")
    if not isinstance(subject.get("spec"), str):
        raise ValueError(f"subject.spec must be a string, got {shown_json(subject.get('spec'))}")
    if not isinstance(subject.get("args"), dict):
        raise ValueError(f"subject.args must be an object, got {shown_json(subject.get('args'))}")
    if not isinstance(document.get("device"), str):
        raise ValueError(f"device must be a string, got {shown_json(document.get('device'))}")
    for key in ("platform", "settings"):
        if not isinstance(document.get(key), dict):
            raise ValueError(f"{key} must be an object, got {shown_json(document.get(key))}")
    if document.get("input_shapes") is not None and not isinstance(document["input_shapes"], dict):
        raise ValueError(f"input_shapes must be an object or absent, got {shown_json(document['input_shapes'])}")
    impls = document.get("impls")
    if not isinstance(impls, list) or not impls:
        raise ValueError(f"impls must be a non-empty array, got {shown_json(impls)}")
    seen = set()
    for index, row in enumerate(impls):
        if not isinstance(row, dict):
            raise ValueError(f"impls[{index}] must be an object, got {shown_json(row)}")
        name = row.get("impl")
        if not isinstance(name, str) or not name:
            raise ValueError(f"impls[{index}].impl must be a non-empty string, got {shown_json(name)}")
        if name in seen:
            raise ValueError(f"impls[{index}].impl names {printable(name)!r} a second time")
        seen.add(name)
        times = row.get("times_s")
        if not isinstance(times, list) or not times:
            raise ValueError(f"impls[{index}].times_s must be a non-empty array, got {shown_json(times)}")
        for k, value in enumerate(times):
            if not _positive_time(value):
                raise ValueError(f"impls[{index}].times_s[{k}] must be a finite number > 0, got {shown_json(value)}")


def load_previous(path: str | os.PathLike, flag: str = "--baseline") -> dict[str, Any]:
    """The saved ``bench --json`` report at ``path``, checked (:func:`check_previous_document`);
    UsageError with one line naming the problem."""
    shown = printable(os.fspath(path), limit=200)
    document = check_report_header(load_json_file(path, flag, expected="a bench JSON report"), flag, shown,
                                   BENCH_REPORT, "bench report")
    if "error" in document:
        message = (document.get("error") or {}).get("message") if isinstance(document.get("error"), dict) else None
        raise UsageError(f"{flag} {shown}: the report of a run that ended without timings "
                         f"({printable(str(message), limit=200)})")
    try:
        check_previous_document(document)
    except ValueError as err:
        raise UsageError(f"{flag} {shown}: {err}") from None
    return document


# ---------------------------------------------------------------------------------------------
# Same setup


def _first_difference(then: Mapping[str, Any], now: Mapping[str, Any]) -> str | None:
    for key in sorted(set(then) | set(now)):
        if then.get(key) != now.get(key):
            return f"{key}: {shown_json(then.get(key))} then, {shown_json(now.get(key))} now"
    return None


def check_same_setup(now: Mapping[str, Any], previous: Mapping[str, Any], *, path: str,
                     impls: Sequence[str], flag: str = "--baseline") -> list[str]:
    """The warnings of comparing this run (``now``: subject, device, platform, input_shapes as
    the report records them) with ``previous``; UsageError where they are not the same setup
    (module docstring)."""
    where = f"{flag} {printable(path, limit=200)}"
    then_subject, now_subject = previous["subject"], now["subject"]
    if then_subject["spec"] != now_subject["spec"]:
        raise UsageError(f"{where} timed subject {printable(then_subject['spec'])!r}, this run "
                         f"{printable(str(now_subject['spec']))!r}: a regression check compares the same subject")
    args = _first_difference(then_subject["args"], now_subject.get("args") or {})
    if args is not None:
        raise UsageError(f"{where} timed other subject arguments ({printable(args, limit=200)}): a regression "
                         "check compares the same subject")
    then_shapes, now_shapes = previous.get("input_shapes"), now.get("input_shapes")
    if then_shapes is not None and now_shapes is not None:
        shapes = _first_difference(then_shapes, now_shapes)
        if shapes is not None:
            raise UsageError(f"{where} timed other inputs ({printable(shapes, limit=200)}): a regression check "
                             "compares the same shapes and dtypes")
    then_platform, now_platform = previous["platform"], now["platform"]
    device = _first_difference({"--device": previous["device"], **{k: then_platform.get(k) for k in DEVICE_KEYS}},
                               {"--device": now["device"], **{k: now_platform.get(k) for k in DEVICE_KEYS}})
    if device is not None:
        raise UsageError(f"{where} ran on another device ({printable(device, limit=200)}): timings of two "
                         "devices are not a regression check")
    then_impls = [row["impl"] for row in previous["impls"]]
    common = [impl for impl in impls if impl in then_impls]
    if not common:
        raise UsageError(f"{where} timed {', '.join(printable(i) for i in then_impls)}, this run "
                         f"{', '.join(impls)}: no implementation in common")
    warnings = []
    software = [f"{key} {shown_json(then_platform.get(key))} -> {shown_json(now_platform.get(key))}"
                for key in sorted(set(then_platform) | set(now_platform))
                if key not in DEVICE_KEYS and key not in IGNORED_KEYS and then_platform.get(key) != now_platform.get(key)]
    if software:
        warnings.append(f"{where} ran with other software or settings ({printable('; '.join(software), limit=600)}): "
                        "a change of speed may come from them")
    if then_shapes is None:
        warnings.append(f"{where} does not record its input shapes: only the subject's arguments were checked")
    missing = [impl for impl in impls if impl not in then_impls]
    gone = [impl for impl in then_impls if impl not in impls]
    if missing or gone:
        warnings.append(f"{where}: compared {', '.join(common)} only"
                        + (f"; not in the saved run: {', '.join(missing)}" if missing else "")
                        + (f"; not in this run: {', '.join(printable(i) for i in gone)}" if gone else ""))
    return warnings


# ---------------------------------------------------------------------------------------------
# The comparison


def regression_status(low: float, high: float, threshold: float = DEFAULT_THRESHOLD) -> str:
    """REGRESSED / IMPROVED / SAME / UNCLEAR of an interval ``[low, high]`` of median(now) /
    median(then) (module docstring)."""
    if not (math.isfinite(threshold) and 0.0 < threshold < 1.0):
        raise ValueError(f"regression threshold must be in (0, 1), got {threshold}")
    # stats.verdict's rule on the ratio now / then: above the band is slower now
    return {stats.FASTER: REGRESSED, stats.SLOWER: IMPROVED, stats.SAME: SAME,
            stats.UNCLEAR: UNCLEAR}[stats.verdict(low, high, threshold)]


def compare_runs(now_times: Mapping[str, Sequence[float]], previous: Mapping[str, Any], *, path: str,
                 threshold: float = DEFAULT_THRESHOLD, seed: int = 0,
                 confidence: float = stats.DEFAULT_CONFIDENCE) -> dict[str, Any]:
    """Per implementation in both runs (this run's order): the medians then and now, the ratio
    now / then with its bootstrap interval and its status; ``regressed`` lists the REGRESSED ones.
    A pure function of the timings, the saved report and the seed."""
    then_times = {row["impl"]: row["times_s"] for row in previous["impls"]}
    rows = []
    for impl, times in now_times.items():
        if impl not in then_times:
            continue
        ratio, low, high = stats.bootstrap_ratio(times, then_times[impl], seed=seed, confidence=confidence)
        rows.append({"impl": impl, "then_median_s": stats.median(then_times[impl]), "now_median_s": stats.median(times),
                     "then_n": len(then_times[impl]), "then_times_s": list(then_times[impl]), "ratio": ratio, "ci_low": low, "ci_high": high,
                     "status": regression_status(low, high, threshold)})
    regressed = [row["impl"] for row in rows if row["status"] == REGRESSED]
    return {"path": path, "threshold": threshold, "confidence": confidence,
            "rule": (f"REGRESSED when the {100 * confidence:g}% interval of median(now) / median(then) lies above "
                     f"1 + {threshold:g}; IMPROVED below 1 - {threshold:g}; SAME inside; else UNCLEAR"),
            "then": {"platform": dict(previous["platform"]), "device": previous["device"],
                     "seconds": previous.get("seconds")},
            "rows": rows, "regressed": regressed, "line": regression_line(rows, path)}


def regression_line(rows: Sequence[Mapping[str, Any]], path: str) -> str:
    """One line: the regressed implementations with how much slower, or that none regressed."""
    shown = printable(path, limit=200)
    regressed = [row for row in rows if row["status"] == REGRESSED]
    if not regressed:
        return f"no regression against {shown} ({len(rows)} impl{'s' if len(rows) != 1 else ''} compared)"
    parts = [f"{printable(row['impl'])} {100 * (row['ratio'] - 1):.1f}% slower "
             f"[{100 * (row['ci_low'] - 1):.1f}%, {100 * (row['ci_high'] - 1):.1f}%]" for row in regressed]
    return f"REGRESSED against {shown}: " + ", ".join(parts)


__all__ = ["DEFAULT_THRESHOLD", "DEVICE_KEYS", "IMPROVED", "REGRESSED", "SAME", "STATUSES", "UNCLEAR",
           "check_previous_document", "check_same_setup", "compare_runs", "load_previous", "regression_line",
           "regression_status"]
