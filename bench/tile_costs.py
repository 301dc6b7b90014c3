"""What a query tile costs apart from its key blocks: a fit of one table run's times.

    python -m bench.tile_costs table.json [--kernel LABEL] [--other LABEL]

For each implementation and head dim, the rows of the plain layouts (causal, window 1024,
random 25% and dense at every length; MHA, bf16) are fitted with

    time x SMs  =  tiles x per_tile  +  blocks x per_block

``tiles`` counts 128-row query tiles and ``blocks`` counts computed 128x128 layout blocks (full
and partial) over all batches and heads. Both costs are in SM-microseconds: how much of one
SM's time a tile or a block takes, whatever the number of CTAs resident on an SM. ``per_block`` is
the inner loop's cost. ``per_tile`` is everything a tile pays once: launching the CTA, loading Q,
the block list and the first K/V tiles, filling and draining the pipeline, normalizing and
storing the output. The fit weighs each row by its own time (it minimizes relative errors), so the
16k rows do not drown the 4k ones. Two costs against eight rows; ``worst_error`` says how well
the model holds.

The layouts' counts come from the same builders the table uses (``benchmark_table.plain_layout``),
with the table's 128-row blocks. Pure arithmetic on a result: no GPU, nothing timed here.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from typing import Any

from .benchmark import render_result
from .benchmark_table import PLAIN_LAYOUTS, plain_layout

BLOCK = 128  # the table's layout block (benchmark_table.Sizes.block)


@dataclasses.dataclass(frozen=True)
class Fit:
    """Per-tile and per-block cost (SM-microseconds) of one implementation at one head dim."""

    impl: str
    head_dim: int
    per_tile_us: float
    per_block_us: float
    worst_error: float  # the largest |model - measured| / measured over the fitted rows
    rows: int


@functools.lru_cache(maxsize=64)  # a table's rows share problems; a 16k layout takes a moment to build
def work(seq: int, layout: str, batch: int, heads: int) -> tuple[int, int]:
    """(query tiles, computed blocks) of a plain-layout case, all batches and heads counted."""
    lay = plain_layout(seq, layout, BLOCK)
    blocks = int(lay.kv_num_blocks.sum())
    if lay.full_kv_num_blocks is not None:
        blocks += int(lay.full_kv_num_blocks.sum())
    return batch * heads * lay.num_q_blocks, batch * heads * blocks


def fit(points: list[tuple[int, int, float]], sms: int) -> tuple[float, float, float]:
    """Least squares in relative error of ``ms x 1000 x sms = tiles x a + blocks x b`` over
    ``points`` of (tiles, blocks, ms): returns (a, b, worst relative error)."""
    if len(points) < 2:
        raise ValueError(f"need at least 2 rows to fit two costs, got {len(points)}")
    # Each equation divided by its measured SM-time: minimize sum((a u + b v - 1)^2).
    uu = uv = vv = su = sv = 0.0
    for tiles, blocks, ms in points:
        if ms <= 0:
            raise ValueError(f"a time must be positive, got {ms} ms")
        sm_us = ms * 1e3 * sms
        u, v = tiles / sm_us, blocks / sm_us
        uu, uv, vv, su, sv = uu + u * u, uv + u * v, vv + v * v, su + u, sv + v
    det = uu * vv - uv * uv
    if det <= 1e-12 * uu * vv:
        raise ValueError("the rows do not separate the two costs (every row has the same blocks per tile)")
    a, b = (su * vv - sv * uv) / det, (sv * uu - su * uv) / det
    worst = max(abs((tiles * a + blocks * b) / (ms * 1e3 * sms) - 1.0) for tiles, blocks, ms in points)
    return a, b, worst


def _plain_rows(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [row for row in document["rows"]
            if row["layout"] in PLAIN_LAYOUTS and row["heads_q"] == row["heads_kv"] and row["dtype"] == "bf16"
            and row.get("ms") and row.get("check") != "FAILED"]


def fits(document: dict[str, Any]) -> list[Fit]:
    """One ``Fit`` per (implementation, head dim) with at least 4 plain-layout rows in ``document``
    (a ``benchmark_table --json`` result)."""
    sms = int(document["environment"]["multiprocessors"])
    groups: dict[tuple[str, int], list[tuple[int, int, float]]] = {}
    for row in _plain_rows(document):
        counts = work(row["seq"], row["layout"], row["batch"], row["heads_q"])
        groups.setdefault((row["impl"], row["head_dim"]), []).append((*counts, row["ms"]))
    out = []
    for (impl, head_dim), points in groups.items():
        if len(points) >= 4:
            a, b, worst = fit(points, sms)
            out.append(Fit(impl, head_dim, round(a, 3), round(b, 4), round(worst, 4), len(points)))
    if not out:
        raise ValueError("no implementation has 4 rows of the plain layouts (causal, window1024, random25, dense)")
    return out


def markdown(document: dict[str, Any], kernel: str = "parity triton", other: str = "FlexAttention") -> str:
    """The fits as a table, then per row of the plain layouts: blocks per tile, the share of the
    kernel's time the fit gives to per-tile costs, and the kernel-over-``other`` speedup the fit
    predicts next to the measured one."""
    found = fits(document)
    by = {(f.impl, f.head_dim): f for f in found}
    sms = int(document["environment"]["multiprocessors"])
    lines = [f"Fitted on {document['environment'].get('device', '?')} ({sms} SMs): time x SMs = tiles x per tile "
             "+ blocks x per block (128-row tiles, 128x128 blocks).", "",
             "| implementation | D | per tile (SM-us) | per block (SM-us) | per tile in blocks | worst error | rows |",
             "|---|---|---|---|---|---|---|"]
    for f in sorted(found, key=lambda f: (-f.head_dim, f.impl)):
        lines.append(f"| {f.impl} | {f.head_dim} | {f.per_tile_us:.2f} | {f.per_block_us:.3f} | "
                     f"{f.per_tile_us / f.per_block_us:.1f} | {f.worst_error:.1%} | {f.rows} |")
    times = {(row["case"], row["impl"]): row["ms"] for row in _plain_rows(document)}
    lines += ["", f"| case | blocks per tile | {kernel}: per-tile share | vs {other}: fit | measured |",
              "|---|---|---|---|---|"]
    for row in _plain_rows(document):
        mine, theirs = by.get((kernel, row["head_dim"])), by.get((other, row["head_dim"]))
        if row["impl"] != kernel or mine is None or theirs is None or (row["case"], other) not in times:
            continue
        tiles, blocks = work(row["seq"], row["layout"], row["batch"], row["heads_q"])
        ours = tiles * mine.per_tile_us + blocks * mine.per_block_us
        model = (tiles * theirs.per_tile_us + blocks * theirs.per_block_us) / ours
        lines.append(f"| {row['case']} | {blocks / tiles:.1f} | {tiles * mine.per_tile_us / ours:.0%} | "
                     f"{model:.2f}x | {times[(row['case'], other)] / row['ms']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", metavar="RESULT.json", help="a benchmark_table --json result")
    parser.add_argument("--kernel", default="parity triton", help="the implementation looked at (default: %(default)s)")
    parser.add_argument("--other", default="FlexAttention", help="the one it is compared with (default: %(default)s)")
    args = parser.parse_args(argv)
    return render_result(args.result, "tile_costs", lambda doc: markdown(doc, args.kernel, args.other))


if __name__ == "__main__":
    sys.exit(main())
