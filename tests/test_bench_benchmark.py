"""The benchmark's CPU-side pieces: variant parsing and the document's tables from a result."""
import dataclasses
import json

import pytest

import math
from pathlib import Path

import torch
from jsonschema import Draft202012Validator, ValidationError

from bench import benchmark, formats
from parity.base.jsonformat import dumps
from parity.kernels import configs

REPO = Path(__file__).resolve().parents[1]


def strict_loads(text: str):
    """json.loads that refuses NaN/Infinity tokens (Python's json accepts them; JSON does not)."""
    def refuse(token):
        raise ValueError(f"bare {token} in a parity JSON document")

    return json.loads(text, parse_constant=refuse)


def validate(document, format_name: str | None = None):
    """Validate against the lab schema of the document's own format (or ``format_name``); return it."""
    Draft202012Validator(formats.schema_for(format_name or document["format"])).validate(document)
    return document


def test_variant_spec_replaces_fields_of_the_pinned_config():
    base = configs.config_for("sm_90", 128, "bf16")
    cfg = benchmark.parse_variant("block_n=128, num_stages=2,one_loop=0", base)
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.one_loop) == (128, 128, 8, 2, False)
    # tma=0 turns the host-made descriptors off with it; asked for both ways, it is an error
    assert benchmark._label(benchmark.parse_variant("tma=0", base)) == "128x128 w8 s3 +one_loop"
    assert benchmark._label(benchmark.parse_variant("host_tma=0", base)) == "128x128 w8 s3 +tma +one_loop"
    with pytest.raises(ValueError, match="host_tma makes the TMA descriptors on the host: it needs tma=1"):
        benchmark.parse_variant("tma=0,host_tma=1", base)
    assert benchmark._label(base) == "128x128 w8 s3 +tma +one_loop +host_tma"  # the pinned sm_90 D=128 tiles (issue 26)
    with pytest.raises(ValueError, match="--config 'warps=8': unknown config key 'warps'; use one of block_m, "):
        benchmark.parse_variant("warps=8", base)
    with pytest.raises(ValueError, match="--config 'block_n=big': expected an integer"):
        benchmark.parse_variant("block_n=big", base)
    with pytest.raises(ValueError, match="'block_n' is given twice"):
        benchmark.parse_variant("block_n=64,block_n=128", base)
    with pytest.raises(ValueError, match="unknown config key 'waves_per_eu'"):  # an AMD knob: not here
        benchmark.parse_variant("waves_per_eu=2", base)


@pytest.mark.parametrize("spec, needle", [
    ("block_n=big", "--config 'block_n=big': expected an integer from 1 to 65536"),
    ("num_warps=inf", "--config 'num_warps=inf': expected an integer"),
    ("block_m=1048576", "expected an integer from 1 to 65536, got 1048576"),
    ("one_loop=2", "--config 'one_loop=2': expected 0 or 1"),
    ("block_n", "--config 'block_n' must look like KEY=VALUE"),
    (",", "--config ',' names no KEY=VALUE"),
])
def test_bad_config_is_one_line_and_exit_2_before_looking_for_a_gpu(capsys, spec, needle):
    assert benchmark.main(["--config", spec]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("benchmark: ") and needle in err, err


def _row(seq, impl, mask, ms, tflops, **extra):
    return {"seq": seq, "impl": impl, "mask": mask, "density": 0.5, "ms": ms, "eff_tflops": tflops,
            "rel_l2_vs_fp32_ref": 2e-3 if seq == 4096 else None, **extra}


def test_markdown_tables_from_a_result(tmp_path, capsys):
    result = {"rows": [
        _row(4096, "parity triton", "causal", 0.7, 410.0, config="128x64 w8 s3 +one_loop"),
        _row(4096, "FlexAttention", "causal", 0.76, 373.0),
        _row(4096, "SDPA", "causal", 0.52, 539.0),
        _row(4096, "parity 128x128 w8 s3 +one_loop", "causal", 0.69, 412.0),
        {"seq": 4096, "impl": "parity 256x128 w8 s3", "mask": "causal", "error": "OutOfResources"},
        _row(4096, "SDPA dense", "dense", 0.9, 605.0),
    ]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(result))
    assert benchmark.main(["--markdown", str(path)]) == 0
    text = capsys.readouterr().out
    assert "| 4096 | causal | 0.500 | 0.7 | 410 | 0.76 | 373 | 1.10 | 0.52 (539) | 2.00e-03 / 2.00e-03 |" in text
    assert "| 4096 | dense, SDPA | 1.000 |" in text
    assert "| parity triton (128x64 w8 s3 +one_loop) | 410 |" in text
    assert "| parity 128x128 w8 s3 +one_loop | 412 |" in text
    assert "256x128" not in text  # a variant that did not fit has no timing row


def test_markdown_of_a_missing_file_is_one_line_and_exit_2(tmp_path, capsys):
    assert benchmark.main(["--markdown", str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("benchmark: cannot read") and err.count("\n") == 1


def test_the_kernel_benchmarks_write_the_format_the_harness_registers():
    # The kernel layer writes its report without importing the harness; the harness holds the schema.
    from bench import benchmark

    assert (benchmark.FORMAT, benchmark.VERSION) == (formats.BENCHMARK_REPORT,
                                                      formats.FORMATS[formats.BENCHMARK_REPORT][0])


def test_the_decode_benchmark_writes_the_format_the_harness_registers_and_its_runs_validate():
    import jsonschema  # a test dependency: missing, the test errors, never skips
    from pathlib import Path

    from bench import benchmark_decode

    assert (benchmark_decode.FORMAT, benchmark_decode.VERSION) == (
        formats.DECODE_BENCHMARK_REPORT, formats.FORMATS[formats.DECODE_BENCHMARK_REPORT][0])
    schema = formats.schema_for(formats.DECODE_BENCHMARK_REPORT)
    results = Path(__file__).resolve().parent.parent / "bench" / "results"
    runs = sorted(results.glob("h200-decode-*.json"))
    assert [path.name for path in runs] == ["h200-decode-final.json", "h200-decode-tuning-1.json",
                                            "h200-decode-tuning-2.json"]
    for path in runs:
        jsonschema.validate(json.loads(path.read_text()), schema)
    bad = json.loads(runs[0].read_text())
    bad["dense"][0]["graph_us"] = "fast"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_autotune_candidates_on_sm_90_are_valid_and_toggle_tma():
    """The pinned config first; every tile candidate with and without TMA, host-made descriptors
    only where TMA is on (tma=0 turns them off, configs.with_overrides), no config twice."""
    pinned = configs.config_for("sm_90", 128, "bf16")
    found = configs.candidates("sm_90", 128, "bf16")
    assert found[0] == pinned and len(found) == len(set(found))
    assert all(cfg.tma or not cfg.host_tma for cfg in found)
    pointer = [cfg for cfg in found if not cfg.tma]
    assert pointer and all(dataclasses.replace(cfg, tma=True) in found or
                           dataclasses.replace(cfg, tma=True, host_tma=True) in found for cfg in pointer)


def test_median_spread_of_repeats():
    from bench import roofline

    assert roofline.median_spread([3.0, 1.0, 2.0]) == (2.0, 1.0)
    assert roofline.median_spread([4.0]) == (4.0, 0.0)
    assert roofline.median_spread([0.0, 0.0]) == (0.0, 0.0)


def test_benchmark_document_validates():
    """The GPU run itself cannot happen here: its document is built by the same function from rows
    shaped as the run writes them (a NaN error included), and the committed H200 results (written
    before the format had a name) still validate."""
    from parity.run import platform

    ref = torch.ones(8)
    rows = [{"seq": 4096, "impl": "parity triton", "mask": "causal", "density": 0.5156, "ms": 0.69,
             "eff_tflops": 410.8, "rel_l2_vs_fp32_ref": benchmark.rel_l2(ref * 1.001, ref), "config": "128x64 w8 s3"},
            {"seq": 4096, "impl": "FlexAttention", "mask": "causal", "density": 0.5156, "ms": 0.8,
             "eff_tflops": 350.2, "rel_l2_vs_fp32_ref": benchmark.rel_l2(torch.full((8,), math.nan), ref)},
            {"seq": 4096, "impl": "parity 128x128 w8 s3", "mask": "causal", "error": "OutOfResources"}]
    pinned = configs.config_for("cpu", 128, torch.bfloat16)
    document = benchmark.result_document(platform.fingerprint("cpu"), pinned, 4, 16, 128, rows, [], [])
    text = dumps(document, indent=2, ensure_ascii=True)
    document = validate(strict_loads(text))
    assert (document["format"], document["version"]) == ("parity-benchmark-report", 1)
    assert document["rows"][1]["rel_l2_vs_fp32_ref"] == "nan"
    assert benchmark.markdown(document).splitlines()[2].endswith("| 1.00e-03 / nan |")  # read back as a float
    for name in ("h200-final-2.json", "h200-variants-1.json", "h200-masks-1.json"):
        validate(strict_loads((REPO / "bench" / "results" / name).read_text()), formats.BENCHMARK_REPORT)
    document["rows"][0]["ms"] = "fast"
    with pytest.raises(ValidationError):
        validate(document)


def test_every_lab_format_has_a_valid_schema_beside_the_lab():
    """The lab's schemas (bench/schemas/, out of the wheel) are complete, valid, and encode
    non-finite numbers as the package's do."""
    from parity.base import jsonformat

    files = sorted(path.name for path in formats.SCHEMA_DIR.glob("*.schema.json"))
    assert files == sorted(name for _, name in formats.FORMATS.values())
    package_float = jsonformat.schema_for(jsonformat.COMPARE_REPORT)["$defs"]["float"]
    for format_name in formats.FORMATS:
        schema = formats.schema_for(format_name)
        Draft202012Validator.check_schema(schema)
        assert schema["$defs"]["float"] == package_float
        assert format_name not in jsonformat.FORMATS  # the package knows none of them
    with pytest.raises(ValueError, match="unknown lab JSON format 'parity-compare-report'"):
        formats.schema_for(jsonformat.COMPARE_REPORT)


def test_decode_variant_labels_name_the_merge_settings_that_differ():
    """Rows of ``benchmark_decode --variant`` that change only the merge must be told apart."""
    from bench import benchmark_decode

    pinned = configs.decode_config_for("sm_90", 128, torch.bfloat16)
    assert benchmark_decode.label(pinned) == "n32 w4 s3 ppu4 min8"
    for variant, named in (("merge_lse_tile=0", "merge_lse_tile=0"), ("fused_combine=0", "fused_combine=False"),
                           ("max_splits=16", "max_splits=16")):
        changed = dataclasses.replace(pinned, **benchmark_decode.parse_variant(variant))
        assert benchmark_decode.label(changed) == f"n32 w4 s3 ppu4 min8 {named}", variant
