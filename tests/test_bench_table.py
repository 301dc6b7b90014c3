"""The prefill table benchmark (bench/benchmark_table.py) and its roofline (bench/roofline.py):
counts and fractions with known answers, argument errors, the document's table from synthetic
rows, and the whole flow at toy sizes on CPU through the interpreter (a smoke run: its times are
not measurements)."""
import json

import pytest
import torch

from bench import formats
from bench import benchmark_table, roofline
from parity.kernels.layout import causal_layout


def test_flops_of_a_causal_layout_match_the_issue_table():
    # causal 4k, 128 blocks: 32 * 33 / 2 = 528 computed blocks of 128 x 128 per (batch, head)
    layout = causal_layout(4096, 4096, block_m=128, block_n=128)
    assert layout.computed_elements() == 528 * 128 * 128
    flops = roofline.attention_flops(layout.computed_elements() * 4 * 16, 128)
    assert flops == 4 * 128 * 528 * 16384 * 64 == 283_467_841_536
    # 0.7 ms for this is 405 TFLOP/s: the issue's "408" row at 0.695 ms
    assert round(flops / 0.695e-3 / 1e12) == 408


def test_least_bytes_count_each_tensor_once():
    # Q and O over 32 query heads, K and V over 8 K/V heads, 2 bytes each
    assert roofline.min_hbm_bytes(2, 32, 8, 1000, 3000, 64, 2) == 2 * 64 * 2 * (2 * 32 * 1000 + 2 * 8 * 3000)
    with pytest.raises(ValueError):
        roofline.min_hbm_bytes(0, 1, 1, 1, 1, 1, 2)
    with pytest.raises(ValueError):
        roofline.attention_flops(-1, 64)


def test_limits_fractions_and_bound():
    got = roofline.limits(10**12, 10**9, 1e-2, {"matmul_tflops": 800.0, "copy_tbps": 4.0})
    assert got == {"tflops": 100.0, "fraction_of_matmul": 0.125, "min_tbps": 0.1, "fraction_of_hbm": 0.025,
                   "flops_per_byte": 1000.0, "ridge_flops_per_byte": 200.0, "bound": "compute"}
    low = roofline.limits(10**10, 10**9, 1e-3, {"matmul_tflops": 800.0, "copy_tbps": 4.0})
    assert low["bound"] == "memory" and low["fraction_of_hbm"] == 0.25 and low["flops_per_byte"] == 10.0
    with pytest.raises(ValueError):
        roofline.limits(1, 1, 0.0, {"matmul_tflops": 1.0, "copy_tbps": 1.0})


def test_cases_cover_the_issue_table():
    names = {c.name for c in benchmark_table.CASES}
    for d in (64, 128):
        for s in ("4k", "16k"):
            for lay in ("causal", "window1024", "random25", "dense"):
                assert f"d{d}-s{s}-{lay}" in names
    assert {"gqa32:8-d128-s8k-causal", "gqa32:8-d128-s8k-window1024", "fp16-d128-s8k-causal",
            "d128-s16k-documents", "d128-s16k-padding"} <= names
    gqa = next(c for c in benchmark_table.CASES if c.name == "gqa32:8-d128-s8k-causal")
    assert (gqa.heads_q, gqa.heads_kv, gqa.seq) == (32, 8, 8192)


@pytest.mark.parametrize("spec, expected", [
    ("d64:block_n=128,num_warps=8", (64, {"block_n": 128, "num_warps": 8})),
    ("one_loop=1", (None, {"one_loop": True})),
])
def test_variant_prefixes(spec, expected):
    assert benchmark_table.parse_variant(spec) == expected


@pytest.mark.parametrize("argv, message", [
    (["--config", "x64:block_n=128"], "a prefix must look like d64: or d128:"),
    (["--config", "d64:tiles=3"], "unknown config key 'tiles'"),
    (["--cases", "d96-s4k-causal"], "unknown case 'd96-s4k-causal'"),
    (["--repeats", "0"], "--repeats must be at least 1"),
])
def test_bad_arguments_are_one_line(argv, message, capsys):
    assert benchmark_table.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def _row(case, impl, ms, tflops, **extra):
    return {"case": case, "impl": impl, "density": 0.516, "ms": ms, "spread": 0.01, "tflops": tflops,
            "fraction_of_matmul": tflops / 790, "fraction_of_hbm": 0.01, "check": "ok",
            "rel_l2_vs_fp32_ref": 3e-3, **extra}


def test_markdown_ratios_only_where_both_outputs_pass():
    result = {"ceilings": {"matmul_tflops": 790.0, "copy_tbps": 4.27}, "rows": [
        _row("d64-s4k-causal", "parity triton", 1.0, 200.0, config="128x64 w8 s3"),
        _row("d64-s4k-causal", "parity 128x128 w8 s3", 0.6, 333.0),
        _row("d64-s4k-causal", "FlexAttention", 0.8, 250.0),
        _row("d64-s4k-causal", "SDPA", 0.5, 400.0, check="FAILED", rel_l2_vs_fp32_ref=0.5),
    ]}
    text = benchmark_table.markdown(result)
    assert "matmul 790.0 TFLOP/s, copy 4.27 TB/s" in text
    line = next(l for l in text.splitlines() if l.startswith("| d64-s4k-causal"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2:6] == ["1.0 (1.0%)", "200", "0.80x", "-"]  # SDPA failed its check: no ratio
    assert cells[6] == "25%" and cells[8] == "3.0e-03 / 3.0e-03 / 5.0e-01!"
    as_variant = benchmark_table.markdown(result, kernel="parity 128x128 w8 s3")
    line = next(l for l in as_variant.splitlines() if l.startswith("| d64-s4k-causal"))
    assert "| 1.33x |" in line  # Flex 0.8 ms / 0.6 ms
    assert "| parity 128x128 w8 s3 | 333 |" in as_variant


def test_smoke_run_on_cpu_through_the_interpreter(tmp_path, monkeypatch):
    """The whole flow at toy sizes: ceilings, the check against the reference, the rows and their
    roofline fields, a variant on one head dim only, SDPA next to dense layouts, the schema."""
    import jsonschema  # a test dependency: missing, the test errors, never skips
    sizes = benchmark_table.Sizes(block=64, repeats=1, matmul_n=64, copy_elements=2**12, seq_cap=192,
                                  batch_cap=1, heads_cap=4)
    names = ["d64-s4k-dense", "gqa32:8-d128-s8k-causal", "d128-s16k-documents"]
    seen = []
    result = benchmark_table.run(names, [(64, {"block_n": 32})], device=torch.device("cpu"), flex=False,
                                 sizes=sizes, after_case=lambda doc: seen.append(len(doc["rows"])),
                                 uncached=True)
    assert seen == [4, 7, 9]  # the document after each case, as the command writes it
    jsonschema.validate(json.loads(json.dumps(result, allow_nan=False)),
                        formats.schema_for(benchmark_table.FORMAT))
    rows = result["rows"]
    by = {(r["case"], r["impl"]): r for r in rows}
    uncached = benchmark_table.UNCACHED
    assert set(by) == {("d64-s4k-dense", "parity triton"), ("d64-s4k-dense", "parity 64x32 w4 s1"),
                       ("d64-s4k-dense", "SDPA"), ("gqa32:8-d128-s8k-causal", "parity triton"),
                       ("gqa32:8-d128-s8k-causal", "SDPA"), ("d128-s16k-documents", "parity triton"),
                       ("d64-s4k-dense", uncached), ("gqa32:8-d128-s8k-causal", uncached),
                       ("d128-s16k-documents", uncached)}
    for case in names:  # the uncached call computes what the default call does (the interpreter ignores the cache)
        assert by[(case, uncached)]["rel_l2_vs_fp32_ref"] == by[(case, "parity triton")]["rel_l2_vs_fp32_ref"]
        assert by[(case, uncached)]["config"] == by[(case, "parity triton")]["config"]
    ceilings = result["ceilings"]
    for row in rows:
        assert row["check"] == "ok" and row["rel_l2_vs_fp32_ref"] < 1e-2, row
        # The roofline fields from the row's own counts and time (the time is measured; what is
        # checked is the arithmetic that turns it into the fields, against the formulas' counts).
        flops = 4 * row["head_dim"] * row["density"] * row["batch"] * row["heads_q"] * row["seq"] ** 2
        hbm = 2 * row["head_dim"] * row["batch"] * (2 * row["heads_q"] + 2 * row["heads_kv"]) * row["seq"]  # bf16
        assert row["flops_per_byte"] == pytest.approx(flops / hbm, abs=0.06), row
        tflops = flops / (row["ms"] * 1e-3) / 1e12  # ms is rounded to 4 decimals in the row
        assert row["tflops"] == pytest.approx(tflops, rel=1e-3, abs=0.06), row
        assert row["fraction_of_matmul"] == pytest.approx(tflops / ceilings["matmul_tflops"], rel=1e-2, abs=6e-4)
        assert row["fraction_of_hbm"] == pytest.approx(hbm / (row["ms"] * 1e-3) / 1e12 / ceilings["copy_tbps"],
                                                       rel=1e-2, abs=6e-4)
        assert row["ridge_flops_per_byte"] == round(ceilings["matmul_tflops"] / ceilings["copy_tbps"], 1)
        assert row["bound"] == ("compute" if row["flops_per_byte"] >= row["ridge_flops_per_byte"] else "memory")
    dense = by[("d64-s4k-dense", "parity triton")]
    # 4 query and 4 K/V heads at 192 x 192, D 64, bf16: 4 * 64 * (4 * 192^2) FLOPs over 2 * 64 * (2*4*192 + 2*4*192) bytes
    assert dense["flops_per_byte"] == 4 * 64 * (4 * 192 * 192) / (2 * 64 * (2 * 4 * 192 + 2 * 4 * 192)) == 96.0
    gqa = by[("gqa32:8-d128-s8k-causal", "parity triton")]
    assert (gqa["seq"], gqa["heads_q"], gqa["heads_kv"]) == (192, 4, 1)  # capped, the 4:1 ratio kept
    assert by[("d64-s4k-dense", "parity triton")]["density"] == 1.0
    assert "| d64-s4k-dense | 1.000 |" in benchmark_table.markdown(result)


def test_the_harness_registers_the_format():
    assert (benchmark_table.FORMAT, benchmark_table.VERSION) == (
        formats.BENCHMARK_TABLE_REPORT, formats.FORMATS[formats.BENCHMARK_TABLE_REPORT][0])


def test_json_is_replaced_whole(tmp_path):
    path = tmp_path / "table.json"
    benchmark_table.write_json(str(path), {"rows": [1]})
    benchmark_table.write_json(str(path), {"rows": [1, 2]})
    assert json.loads(path.read_text()) == {"rows": [1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["table.json"]


def _sweep(rows, variants):
    return {"ceilings": {"matmul_tflops": 790.0, "copy_tbps": 4.27}, "check_rel_l2": 2e-2,
            "variants": variants, "rows": rows}


def test_pick_takes_the_best_checked_variant_per_head_dim(capsys, tmp_path):
    w8 = {"block_n": 128, "num_warps": 8}
    tma = {"block_n": 128, "tma": True}
    two_stages = {"num_stages": 2}
    rows = [
        # D=64: the w8 variant wins on the geometric mean (300 x 300 vs pinned 200 x 220); the tma
        # one is faster in one case but failed its check in the other, so it is not a candidate
        _row("d64-s4k-causal", "parity triton", 1.0, 200.0, head_dim=64),
        _row("d64-s4k-causal", "parity 128x128 w8 s3", 0.7, 300.0, head_dim=64, config_changes=w8),
        _row("d64-s4k-causal", "parity 128x128 w8 s3 +tma", 0.5, 400.0, head_dim=64, config_changes=tma),
        _row("d64-s16k-causal", "parity triton", 1.0, 220.0, head_dim=64),
        _row("d64-s16k-causal", "parity 128x128 w8 s3", 0.7, 300.0, head_dim=64, config_changes=w8),
        _row("d64-s16k-causal", "parity 128x128 w8 s3 +tma", 0.5, 410.0, head_dim=64, config_changes=tma,
             check="FAILED"),
        # D=128: the two-stage variant is slower than the pinned config: nothing is picked
        _row("d128-s4k-causal", "parity triton", 1.0, 400.0, head_dim=128),
        _row("d128-s4k-causal", "parity 128x64 w8 s2 +one_loop", 1.1, 390.0, head_dim=128,
             config_changes=two_stages),
        # the pinned config without the launch cache is faster here, but it is not a variant to pin
        _row("d128-s4k-causal", benchmark_table.UNCACHED, 0.9, 440.0, head_dim=128),
    ]
    result = _sweep(rows, [{"head_dim": 64, "changes": w8}, {"head_dim": 64, "changes": tma},
                           {"head_dim": None, "changes": two_stages}])
    best = benchmark_table.pick(result)
    assert list(best) == [64]
    assert best[64]["impl"] == "parity 128x128 w8 s3" and best[64]["changes"] == w8
    assert best[64]["geomean_tflops"] == 300.0 and best[64]["pinned_geomean_tflops"] == round((200 * 220) ** 0.5, 1)
    assert benchmark_table.pick_arguments(best) == ["--config", "d64:block_n=128,num_warps=8"]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(result))
    assert benchmark_table.main(["--pick", str(path)]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == "--config d64:block_n=128,num_warps=8"
    assert "D=64: parity 128x128 w8 s3 300.0 vs pinned 209.8" in out.err
    # the table shows, per case, the first kernel label present
    text = benchmark_table.markdown(result, ["parity 128x128 w8 s3", "parity triton"])
    assert "| d64-s4k-causal | 0.516 | 0.7 (1.0%) | 300 |" in text
    assert "| d128-s4k-causal | 0.516 | 1.0 (1.0%) | 400 |" in text


def test_pick_takes_a_variant_as_its_changes_whatever_tiles_they_changed():
    """A case with its own pinned tiles (the documents row) gives the same changes another label:
    still one variant, scored over every case of its head dim."""
    host = {"tma": True, "host_tma": True}
    rows = [
        _row("d128-s4k-causal", "parity triton", 1.0, 400.0, head_dim=128),
        _row("d128-s4k-causal", "parity 128x128 w8 s3 +tma +host_tma", 0.9, 440.0, head_dim=128, config_changes=host),
        _row("d128-s16k-documents", "parity triton", 1.0, 330.0, head_dim=128),
        _row("d128-s16k-documents", "parity 64x64 w4 s3 +tma +host_tma", 0.9, 350.0, head_dim=128,
             config_changes=host),
    ]
    best = benchmark_table.pick(_sweep(rows, [{"head_dim": None, "changes": host}]))
    assert best[128]["impl"] == "parity 128x128 w8 s3 +tma +host_tma / parity 64x64 w4 s3 +tma +host_tma"
    assert best[128]["changes"] == host
    assert best[128]["geomean_tflops"] == round((440 * 350) ** 0.5, 1)
    assert best[128]["pinned_geomean_tflops"] == round((400 * 330) ** 0.5, 1)
    assert benchmark_table.pick_arguments(best) == ["--config", "d128:tma=1,host_tma=1"]
    # slower where it has to be, in the documents row, and it loses on the mean: nothing picked
    rows[3] = _row("d128-s16k-documents", "parity 64x64 w4 s3 +tma +host_tma", 1.5, 220.0, head_dim=128,
                   config_changes=host)
    assert benchmark_table.pick(_sweep(rows, [{"head_dim": None, "changes": host}])) == {}


def test_pick_of_a_bad_file_is_one_line(tmp_path, capsys):
    path = tmp_path / "sweep.json"
    path.write_text("{not json")
    assert benchmark_table.main(["--pick", str(path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_flex_may_recompile_for_every_case():
    """21 cases of other shapes and masks: past dynamo's default 8 recompiles FlexAttention would
    run unfused, and the table would time that."""
    import torch._dynamo.config as dynamo_config

    from bench import benchmark

    # dynamo's own patch restores its config afterwards (monkeypatch's restore of a config module
    # attribute left `recompile_limit` missing for every later compile in the same process)
    with dynamo_config.patch(recompile_limit=8):
        benchmark.allow_recompiles()
        assert dynamo_config.recompile_limit >= 2 * len(benchmark_table.CASES)


def test_the_committed_h200_tables_validate_and_render():
    import jsonschema  # a test dependency: missing, the test errors, never skips
    from pathlib import Path

    results = Path(__file__).resolve().parent.parent / "bench" / "results"
    runs = sorted(results.glob("h200-table*.json"))
    assert [path.name for path in runs] == ["h200-table-1.json", "h200-table-2.json", "h200-table-sweep-1.json",
                                            "h200-table-sweep-2.json"]
    for path in runs:
        document = json.loads(path.read_text())
        jsonschema.validate(document, formats.schema_for(benchmark_table.FORMAT))
        assert document["environment"]["device"] == "NVIDIA H200"
        assert all(row.get("check") == "ok" for row in document["rows"] if "ms" in row)  # every timed output checked
    table = benchmark_table.markdown(json.loads(runs[0].read_text()), kernel="parity 128x64 w8 s3 +tma")
    assert "| d64-s16k-causal |" in table


def test_implementations_are_timed_in_turns():
    """One run of each per round, the first one moved along each round, so no implementation is
    always timed last (on a GPU that heats up, last is slowest); medians and spreads per name,
    and one that runs out of resources keeps its error and is not run again."""
    from triton.runtime.errors import OutOfResources

    order = []
    samples = {"a": iter([3.0, 1.0, 2.0]), "b": iter([10.0, 14.0, 12.0])}

    def timer(fn):
        name = fn()
        order.append(name)
        if name == "c":
            raise OutOfResources(300000, 232448, "shared memory")
        return next(samples[name])

    result = benchmark_table.timed_in_turns({n: (lambda n=n: n) for n in "abc"}, 3, timer)
    assert order == ["a", "b", "c", "b", "a", "a", "b"]  # round 2 starts at b (c already failed), round 3 at c: skipped
    assert result["a"] == (2.0, (3.0 - 1.0) / 2.0)
    assert result["b"] == (12.0, (14.0 - 10.0) / 12.0)
    assert isinstance(result["c"], OutOfResources)
