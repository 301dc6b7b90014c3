"""Every JSON output against its JSON Schema (parity/schemas/, draft 2020-12): real documents written
by compare (holds, fails, non-finite numbers), diff, the error report of a damaged bundle, the
pytest plugin's --parity-report, inspect --json, show --json and the kernel benchmark's document;
the schemas themselves; one convention (format, version, non-finite numbers as strings) for all;
and schemas that reject what they should (a wrong type, a bare NaN token, an unknown format)."""
from __future__ import annotations

import gzip
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from jsonschema import Draft202012Validator, ValidationError

from parity.base import jsonformat
from parity.run.capture import capture
from parity.cli.main import main
from parity.judge.results import CompareReport
from parity.judge.engine import compare_tensors
from parity.judge.policy import Policy
from parity.report.json_report import to_json
from parity.judge.results import verdict_line
from test_judge_diff import rewrite_tensor  # the same outside edit of a stored tensor as diff's tests
from plugin_suite import make_plugin_suite

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[1]
FIRST_OUT = "B1-Hq2-Hkv1-Sq64-Sk64-D32-causal-fp16-s0/out"


def strict_loads(text: str):
    """json.loads that refuses NaN/Infinity tokens (Python's json accepts them; JSON does not)."""
    def refuse(token):
        raise ValueError(f"bare {token} in a parity JSON document")

    return json.loads(text, parse_constant=refuse)


def validate(document, format_name: str | None = None):
    """Validate against the schema of the document's own format (or ``format_name``); return it."""
    schema = jsonformat.schema_for(format_name or document["format"])
    Draft202012Validator(schema).validate(document)
    return document


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> Path:
    """Two captures of the attention smoke cases (with their fp64 references) and a copy of the
    second with one output scaled by 1.01 (a valid bundle that fails against the first)."""
    root = tmp_path_factory.mktemp("schemas")
    for name in ("a", "b"):
        capture("attention", root / name, subject_args={"cases": "smoke"}, impl="reference")
    shutil.copytree(root / "b", root / "perturbed")
    rewrite_tensor(root / "perturbed", "output", FIRST_OUT, lambda t: t * 1.01)
    return root


# ---- the schemas themselves ------------------------------------------------------------------


def test_every_format_has_a_valid_schema_shipped_in_the_package():
    files = sorted(path.name for path in jsonformat.SCHEMA_DIR.glob("*.schema.json"))
    assert files == sorted(name for _, name in jsonformat.FORMATS.values())
    floats = set()
    for format_name, (version, _) in jsonformat.FORMATS.items():
        schema = jsonformat.schema_for(format_name)
        Draft202012Validator.check_schema(schema)
        assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        floats.add(json.dumps(schema["$defs"]["float"], sort_keys=True))
        assert jsonformat.envelope(format_name) == {"format": format_name, "version": version}
    assert len(floats) == 1  # one documented encoding of non-finite numbers, the same everywhere
    float_schema = Draft202012Validator({"$defs": jsonformat.schema_for(jsonformat.COMPARE_REPORT)["$defs"],
                                         "$ref": "#/$defs/float"})
    assert all(float_schema.is_valid(value) for value in (0, 1.5, -2e-300, "nan", "inf", "-inf"))
    assert not any(float_schema.is_valid(value) for value in ("NaN", "Infinity", "1.0", None, [1.0]))
    with pytest.raises(ValueError, match="unknown JSON format 'parity-show'"):
        jsonformat.schema_for("parity-show")
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"schemas/*.json"' in pyproject  # shipped as package data (tests/test_wheel.py: in the wheel)


def test_read_float_reads_what_json_safe_float_writes():
    from parity.judge.metrics import json_safe_float

    for value in (0.0, -1.25, 3e-7, math.inf, -math.inf):
        assert jsonformat.read_float(json_safe_float(value)) == value
    assert math.isnan(jsonformat.read_float(json_safe_float(math.nan)))
    assert jsonformat.read_float(None) is None
    with pytest.raises(ValueError, match="'Infinity'"):
        jsonformat.read_float("Infinity")


# ---- compare, diff, the error report ---------------------------------------------------------------


def test_compare_json_holds_and_fails_validate(bundles, tmp_path, capsys):
    holds, fails = tmp_path / "holds.json", tmp_path / "fails.json"
    code, out, _ = cli(capsys, "compare", "--golden", bundles / "a", "--impl", "reference", "--device", "cpu",
                       "--json", holds)
    assert code == 0
    document = validate(strict_loads(holds.read_text()))
    assert (document["format"], document["version"], document["passed"]) == ("parity-compare-report", 1, True)
    assert document["verdict"] == out.rstrip().splitlines()[-1] == "PARITY HOLDS: 4/4 tensors"

    code, out, _ = cli(capsys, "compare", "--golden", bundles / "perturbed", "--impl", "reference", "--device",
                       "cpu", "--json", fails)
    assert code == 1
    document = validate(strict_loads(fails.read_text()))
    assert not document["passed"] and document["verdict"] == out.rstrip().splitlines()[-1]
    assert document["verdict"] == f"PARITY FAILS: first failing tensor {FIRST_OUT} (1 of 4 tensors fail)"
    assert document["budget"]["checked"] and "candidate" not in document


def test_diff_json_validates_with_its_candidate(bundles, tmp_path, capsys):
    target = tmp_path / "diff.json"
    code, out, _ = cli(capsys, "diff", bundles / "a", bundles / "perturbed", "--quiet", "--json", target)
    assert code == 1
    document = validate(strict_loads(target.read_text()))
    assert document["format"] == "parity-compare-report" and document["candidate"] == str(bundles / "perturbed")
    assert document["verdict"] == out.rstrip().splitlines()[-1]


def test_non_finite_numbers_are_the_documented_strings():
    golden = torch.zeros(4)
    results = [compare_tensors("zeros", torch.ones(4), golden),  # rel L2 against zero: inf
               compare_tensors("nan", torch.tensor([1.0, math.nan, 3.0, 4.0]), torch.ones(4))]
    report = CompareReport(golden="g", subject={"name": "demo", "spec": "demo"}, impl="triton", golden_impl=None,
                           device="cpu", policy=Policy(), layers=results, hosts={"golden": {}, "here": {}},
                           fingerprint_differences=[])
    text = to_json(report)
    document = validate(strict_loads(text))
    assert document["layers"][0]["metrics"]["rel_l2"] == "inf"
    assert document["layers"][0]["failed_checks"]["max_rel_l2"] == "inf"
    assert document["summary"]["error_growth"]["peak"] == ["zeros", "inf"]
    assert document["layers"][1]["failed_checks"]["nan_policy"] == "ignore"
    assert document["verdict"] == verdict_line(report)
    # The schema is what catches a drift: the same document with a bare float where "inf" belongs
    # would be fine for json.loads, so the type itself is checked.
    document["layers"][0]["metrics"]["rel_l2"] = "Infinity"
    with pytest.raises(ValidationError):
        validate(document)


def test_isolated_report_validates(tmp_path):
    """--isolate: each result nests its replay on golden inputs (``isolated``, ``attribution``)."""
    import fault_models

    bundle = fault_models.capture_model(tmp_path, "res", "bf16")
    case = next(c for c in fault_models.CASES if c.id == "bf16-zerorow-block3")
    document = validate(strict_loads(to_json(fault_models.run_case(bundle, case))))
    assert document["isolate"] and document["summary"]["introducing_layers"] == ["blocks.3"]
    isolated = [layer for layer in document["layers"] if layer["isolated"] is not None]
    assert isolated and {layer["attribution"] for layer in isolated} >= {"introduced"}
    isolated[0]["attribution"] = "blamed"
    with pytest.raises(ValidationError):
        validate(document)


def test_error_report_of_a_damaged_bundle_validates(bundles, tmp_path, capsys):
    damaged = tmp_path / "damaged"
    shutil.copytree(bundles / "a", damaged)
    (damaged / "manifest.json").write_text('{"format": "parity-bundle", "schema_version": ')
    target = tmp_path / "error.json"
    code, _, err = cli(capsys, "compare", "--golden", damaged, "--impl", "reference", "--device", "cpu",
                       "--json", target)
    assert code == 2 and err.count("\n") == 1
    document = validate(strict_loads(target.read_text()))
    assert document["error"]["status"] == 2 and document["error"]["kind"] == "usage"
    assert (document["format"], document["version"]) == ("parity-compare-report", 1)
    document["error"]["status"] = 0  # an error report is only ever 2 or 3
    with pytest.raises(ValidationError):
        validate(document)


@pytest.mark.parametrize("name", sorted(path.name for path in (REPO / "golden" / "results").glob("*.json.gz")))
def test_committed_compare_reports_still_validate(name):
    """Reports written before ``verdict`` and ``integrity`` existed (same version: fields are only
    added within a version) still validate, and the HTML page still gets their verdict line."""
    from parity.report.html import verdict_line as html_verdict

    with gzip.open(REPO / "golden" / "results" / name, "rt") as handle:
        document = validate(strict_loads(handle.read()))
    assert "verdict" not in document
    summary = document["summary"]
    total = summary["layers"]
    assert html_verdict(document) == (
        f"PARITY HOLDS: {total}/{total} tensors" if document["passed"] else
        f"PARITY FAILS: first failing tensor {summary['first_failing_layer']} ({summary['failing']} of {total} "
        "tensors fail)")


# ---- the plugin, show, inspect, the benchmark ----------------------------------------------------------




def test_plugin_report_validates_passing_and_failing(pytester, monkeypatch):
    make_plugin_suite(pytester)
    report = pytester.path / "report.json"
    pytester.runpytest("-p", "no:cacheprovider", "--parity-report", str(report)).assert_outcomes(passed=2)
    document = validate(strict_loads(report.read_text()))
    assert (document["format"], document["version"], document["checked"], document["passed"]) == (
        "parity-pytest-report", 1, 2, 2)
    monkeypatch.setenv("BREAK", "1")
    pytester.runpytest("-p", "no:cacheprovider", "--parity-report", str(report)).assert_outcomes(passed=1, failed=1)
    document = validate(strict_loads(report.read_text()))
    assert document["not_passed"] == 1
    failing = next(row for row in document["tensors"] if row["status"] == "fail")
    assert failing["tensor"] == "pair/out" and failing["verdict"].startswith("FAIL") and failing["reasons"]
    document["checked"] = "2"
    with pytest.raises(ValidationError):
        validate(document)


@pytest.fixture(scope="module")
def small_bundle(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("show") / "attention"
    capture("attention", path, subject_args={"cases": "smoke"}, impl="reference", reference="none")
    return path


def test_show_json_validates(small_bundle, capsys):
    code, out, _ = cli(capsys, "show", small_bundle, "--json", "-")
    assert code == 0
    document = validate(strict_loads(out))
    assert (document["format"], document["version"]) == ("parity-show-report", 2)
    assert document["checksums"]["verified"] is True and document["outputs"] == 4
    document["tensors"][0]["shape"] = "64x32"
    with pytest.raises(ValidationError):
        validate(document)


@pytest.mark.slow  # compiles the kernel ahead of time
def test_inspect_json_validates(tmp_path, capsys):
    pytest.importorskip("triton")
    target = tmp_path / "inspect.json"
    code, _, _ = cli(capsys, "inspect", "--target", "gfx942", "--dtype", "bf16", "--head-dim", "64", "--json", target)
    document = validate(strict_loads(target.read_text()))
    assert (document["format"], document["version"]) == ("parity-inspect-report", 1)
    assert code == (0 if document["passed"] else 1) and document["results"][0]["target"] == "gfx942"
    # The result committed from an H200 before the format had a name: accepted as it is.
    committed = strict_loads((REPO / "bench" / "results" / "h200-inspect-sm90.json").read_text())
    validate(committed, jsonformat.INSPECT_REPORT)
    assert "format" not in committed
    with pytest.raises(ValidationError):  # a name without a version is neither old nor new
        validate({"format": jsonformat.INSPECT_REPORT, **committed})
