"""bench/tile_costs.py: the per-tile / per-block fit of a table run (CPU only, no timing).

The fit is checked on times made from known costs (it must give them back), on the layouts'
own counts (computed here independently, from the block masks), and on a committed device
result whose numbers bench/BENCHMARK.md quotes."""
import json
import math
from pathlib import Path

import pytest

from bench import tile_costs
from bench.benchmark_table import plain_layout

REPO = Path(__file__).resolve().parent.parent
H100_TABLE = REPO / "bench" / "results" / "h100-table-2.json"


def test_work_counts_tiles_and_computed_blocks_of_each_layout():
    # 1k keys in 128-row blocks: 8 query tiles; causal 8*9/2 blocks, dense 64, a window of 1024
    # keys covers the whole causal triangle at this length.
    assert tile_costs.work(1024, "causal", 2, 3) == (6 * 8, 6 * 36)
    assert tile_costs.work(1024, "dense", 1, 1) == (8, 64)
    assert tile_costs.work(1024, "window1024", 1, 1) == (8, 36)
    lay = plain_layout(4096, "random25", 128)
    assert tile_costs.work(4096, "random25", 1, 1) == (32, int((lay.block_classes() > 0).sum()))
    with pytest.raises(ValueError, match="unknown block layout 'documents'"):
        tile_costs.work(4096, "documents", 1, 1)


def test_fit_gives_back_the_costs_that_made_the_times():
    sms, per_tile, per_block = 132, 7.5, 2.0
    points = [(t, b, (t * per_tile + b * per_block) / sms / 1e3) for t, b in [(2048, 33792), (8192, 71424), (2048, 10112),
                                                                           (8192, 1048576)]]
    a, b, worst = tile_costs.fit(points, sms)
    assert math.isclose(a, per_tile, rel_tol=1e-9) and math.isclose(b, per_block, rel_tol=1e-9)
    assert worst < 1e-9
    # 10% more time on one row: the fit moves and says how far the model is from that row
    noisy = points[:1] + [(points[1][0], points[1][1], points[1][2] * 1.1)] + points[2:]
    assert tile_costs.fit(noisy, sms)[2] > 0.02


def test_fit_refuses_what_cannot_separate_the_costs():
    with pytest.raises(ValueError, match="at least 2 rows"):
        tile_costs.fit([(10, 100, 1.0)], 132)
    with pytest.raises(ValueError, match="same blocks per tile"):
        tile_costs.fit([(10, 100, 1.0), (20, 200, 2.0)], 132)
    with pytest.raises(ValueError, match="must be positive"):
        tile_costs.fit([(10, 100, 0.0), (20, 300, 2.0)], 132)


def test_fit_of_the_committed_h100_table():
    """The numbers BENCHMARK.md quotes from table 4 (bench/results/h100-table-2.json)."""
    doc = json.loads(H100_TABLE.read_text())
    found = {(f.impl, f.head_dim): f for f in tile_costs.fits(doc)}
    ours, flex = found[("parity triton", 128)], found[("FlexAttention", 128)]
    assert (ours.per_tile_us, ours.per_block_us) == (pytest.approx(7.49, abs=0.01), pytest.approx(1.974, abs=0.001))
    assert (flex.per_tile_us, flex.per_block_us) == (pytest.approx(5.35, abs=0.01), pytest.approx(2.567, abs=0.001))
    assert ours.rows == flex.rows == 8 and max(ours.worst_error, flex.worst_error) < 0.04
    d64, flex64 = found[("parity triton", 64)], found[("FlexAttention", 64)]
    assert abs(d64.per_block_us / flex64.per_block_us - 1) < 0.04  # D=64: the same inner loop cost
    assert found[("SDPA", 128)].rows == 4  # causal and dense only
    text = tile_costs.markdown(doc)
    assert "| d128-s4k-window1024 | 7.9 | 33% | 1.11x | 1.07x |" in text
    assert "| d128-s16k-causal | 64.5 | 6% | 1.27x | 1.30x |" in text


def test_fit_of_the_table_with_host_made_descriptors():
    """The numbers BENCHMARK.md and docs/kernel.md quote from table 5 (bench/results/h100-table-5.json,
    timed in turns): a tile set-up cheaper than FlexAttention's, the block still 1.19x cheaper."""
    doc = json.loads((H100_TABLE.parent / "h100-table-5.json").read_text())
    found = {(f.impl, f.head_dim): f for f in tile_costs.fits(doc)}
    ours, flex, before = (found[(impl, 128)] for impl in ("parity triton", "FlexAttention",
                                                           "parity 128x128 w8 s3 +tma +one_loop"))
    assert (ours.per_tile_us, ours.per_block_us) == (pytest.approx(5.32, abs=0.01), pytest.approx(2.113, abs=0.001))
    assert (flex.per_tile_us, flex.per_block_us) == (pytest.approx(5.88, abs=0.01), pytest.approx(2.504, abs=0.001))
    assert before.per_tile_us == pytest.approx(6.95, abs=0.01)
    assert found[("SDPA", 128)].per_block_us == pytest.approx(1.795, abs=0.001)
    assert ours.worst_error < 0.026
    d64, flex64 = found[("parity triton", 64)], found[("FlexAttention", 64)]
    assert (d64.per_tile_us, flex64.per_tile_us) == (pytest.approx(3.30, abs=0.01), pytest.approx(3.84, abs=0.01))
    assert "| d128-s16k-causal | 64.5 | 4% | 1.18x | 1.19x |" in tile_costs.markdown(doc)


def test_command_line_reads_a_result_and_says_what_is_wrong_in_one_line(tmp_path, capsys):
    assert tile_costs.main([str(H100_TABLE)]) == 0
    assert "| parity triton | 128 | 7.49 | 1.974 | 3.8 | 3.6% | 8 |" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert tile_costs.main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tile_costs: cannot read {bad}: ") and err.count("\n") == 1
    few = tmp_path / "few.json"
    doc = json.loads(H100_TABLE.read_text())
    doc["rows"] = [row for row in doc["rows"] if row["layout"] == "causal"]
    few.write_text(json.dumps(doc))
    assert tile_costs.main([str(few)]) == 2
    assert "no implementation has 4 rows of the plain layouts" in capsys.readouterr().err
    assert tile_costs.main([str(tmp_path / "absent.json")]) == 2
    assert "No such file" in capsys.readouterr().err
