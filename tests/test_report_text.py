"""Reports: compact numbers, the table and its columns, collapsed long tables, the verdict line,
"would pass with" values that really pass, JSON that round-trips, and valid JUnit XML for any name."""
import json
import math
import re
import xml.etree.ElementTree as ET

import pytest
import torch

from parity.judge.results import CompareReport
from parity.judge.engine import compare_tensors
from parity.judge.metrics import LayerMetrics
from parity.judge.policy import LayerOverride, Policy
from parity.base.numbers import format_cosine, format_number, format_percent, format_shape
from parity.report.text import format_table, format_text, growth_line
from parity.judge.policy import passing_value
from parity.report.json_report import to_json, write_json
from parity.report.junit import to_junit_xml
from parity.judge.results import verdict_line, would_pass_text
from parity.base.errors import UsageError

HOST = {"vendor": "nvidia", "arch": "sm_90", "device_name": "NVIDIA H200", "torch": "2.11.0+cu130",
        "triton": "3.6.0", "triton_interpreter": False}
HERE = {"vendor": "cpu", "arch": "cpu", "device_name": "x86_64", "torch": "2.13.0+cpu", "triton": "3.9.0",
        "triton_interpreter": True}


def _tensor(seed, shape=(64, 64), dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _report(results, **fields):
    return CompareReport(golden="golden/x", subject={"name": "demo", "spec": "demo"}, impl="triton",
                         golden_impl="reference", device="cpu", policy=Policy(), layers=list(results),
                         hosts={"golden": HOST, "here": HERE}, fingerprint_differences=[], **fields)


def _chain(depth=6, bad_at=None, scale=1e-3):
    """Results of a chain of tensors whose error appears at ``bad_at`` and is carried on."""
    results = []
    for index in range(depth):
        golden = _tensor(index)
        out = golden.clone()
        if bad_at is not None and index >= bad_at:
            out = golden + scale * (index - bad_at + 1) * _tensor(100 + index)
        results.append(compare_tensors(f"layers.{index}", out, golden))
    return results


def test_compact_numbers():
    assert format_number(0.0) == "0" and format_number(None) == "-"
    assert format_number(3.14159e-3) == "3.1e-3" and format_number(12345.0) == "1.2e4"
    assert format_number(math.inf) == "inf" and format_number(math.nan) == "nan"
    assert format_cosine(1.0) == "1" and format_cosine(0.999998) == "1-2.0e-6"
    assert format_cosine(1 - 7e-14) == "1-7.0e-14" and format_cosine(0.97312) == "0.9731"
    assert format_percent(0) == "0" and format_percent(1.2345e-4) == "0.012" and format_percent(1.0) == "100"
    assert format_shape((2, 4, 64)) == "2x4x64" and format_shape(()) == "scalar"


def test_table_holds_every_column_and_escapes_pipes():
    results = _chain(3, bad_at=2)
    results.append(compare_tensors("out/dict|key", _tensor(9), _tensor(9)))
    results.append(compare_tensors("\x1b[2J\nPARITY HOLDS: 99/99 layers", _tensor(9), _tensor(9),
                                   reference=_tensor(9).double()))
    text = format_table(_report(results))
    header, rule, *rows = text.splitlines()
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "tensor", "dtype", "shape", "cosine", "max abs", "rel L2", "mismatch %", "rule", "verdict",
        "ref rel L2 here", "ref rel L2 golden"]  # the budget's columns: one tensor has a reference
    assert set(rule) <= set("|-: ")
    assert rows[0].startswith("| layers.0 ") and "| thresh | pass " in rows[0]
    assert re.search(r"\| FAIL [a-z_,]*rel_l2", rows[2])
    assert "out/dict\\|key" in rows[3]  # a Markdown table survives a "|" in a name
    # A name from a manifest cannot drive the terminal or fake a line of the report.
    assert "\x1b" not in text and rows[4].startswith("| \\x1b[2J\\x0aPARITY HOLDS") and "| budget | pass" in rows[4]
    assert len(rows) == 5


def test_verdict_line():
    assert verdict_line(_report(_chain(12))) == "PARITY HOLDS: 12/12 tensors"
    failing = _report(_chain(12, bad_at=4))
    assert verdict_line(failing) == "PARITY FAILS: first failing tensor layers.4 (8 of 12 tensors fail)"
    assert verdict_line(_report([])) == "PARITY FAILS: nothing was compared (0 tensors)"
    text = format_text(failing)
    assert text.splitlines()[-1] == verdict_line(failing)
    assert "golden host: nvidia sm_90 NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0; impl reference" in text
    assert "this host:   cpu x86_64, torch 2.13.0+cpu, triton 3.9.0 (interpreter); impl triton on cpu" in text
    assert "largest jump at layers.4 (0 -> " in text
    assert "and 3 more (every number is in the JSON report): layers.9, layers.10, layers.11" in text


def test_long_tables_collapse_passing_runs_but_keep_failures():
    results = _chain(40, bad_at=30)
    report = _report(results)
    rows = format_table(report, max_rows=10).splitlines()[2:]
    names = [row.split("|")[1].strip() for row in rows]
    assert names[0] == "layers.0" and names[1] == "... 28 passing ..." and names[2] == "layers.29"
    assert names[3:] == [f"layers.{i}" for i in range(30, 40)]  # every failing row is kept
    assert len(format_table(report).splitlines()) == 42


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("choice", ["max_mismatch_fraction", "atol", "atol_rms", "rtol"])
def test_would_pass_values_really_pass(dtype, choice):
    """Paste the printed values into an override and the same tensor passes."""
    golden = _tensor(0, dtype=dtype)
    out = (golden.double() * 1.05 + 0.05 * _tensor(1).double()).to(dtype)  # rel L2 ~7e-2: fails all
    failing = compare_tensors("layers.3.attn", out, golden)
    checks = failing.failed_checks()
    assert not failing.passed and "max_mismatch_fraction" in checks and "max_rel_l2" in checks
    text = would_pass_text(failing)
    assert text.startswith("(mismatch, any one of) max_mismatch_fraction = ")
    changes = {key: float(passing_value(key, value)) for key, value in checks.items()
               if key not in ("max_mismatch_fraction", "atol", "atol_rms", "rtol")}
    changes[choice] = float(passing_value(choice, checks[choice]))
    policy = Policy(overrides=(LayerOverride("layers.3.*", changes, reason="printed by the report"),))
    assert compare_tensors("layers.3.attn", out, golden, policy=policy).passed, changes
    # The printed values are not looser than needed by more than the 2-digit rounding.
    for key, value in changes.items():
        needed = checks[key]
        if key == "min_cosine":
            assert value <= needed and (1 - value) <= 1.1 * (1 - needed)
        else:
            assert needed <= value <= 1.1 * needed


def test_failures_without_a_passing_tolerance():
    golden = _tensor(0)
    shape = compare_tensors("x", golden[:3], golden)
    assert would_pass_text(shape) is None
    text = format_text(_report([shape]))
    assert "shape mismatch: [3, 64] here, [64, 64] in the golden" in text and "no tolerance makes this pass" in text
    nan = golden.clone()
    nan[0, 0] = math.nan
    result = compare_tensors("x", nan, golden)
    assert result.failed_checks()["nan_policy"] == "ignore"
    assert 'nan_policy = "ignore"' in would_pass_text(result)


def test_json_report_round_trips_the_numbers(tmp_path):
    results = _chain(4, bad_at=2)
    report = _report(results, warnings=["tf32_matmul differs"])
    write_json(report, tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data == json.loads(to_json(report))
    assert data["format"] == "parity-compare-report" and data["summary"]["first_failing_layer"] == "layers.2"
    assert data["verdict"] == verdict_line(report) == format_text(report).splitlines()[-1]
    for layer, result in zip(data["layers"], results):
        assert LayerMetrics.from_dict(layer["metrics"]) == result.metrics
        assert layer["verdict"]["passed"] == result.passed
    growth = data["summary"]["error_growth"]
    assert growth["largest_jump"]["layer"] == "layers.2" and growth["largest_jump"]["from"] == 0
    assert [name for name, _ in growth["rel_l2"]] == [r.name for r in results]
    with pytest.raises(UsageError, match=r"--json .*: directory .* does not exist"):
        write_json(report, tmp_path / "no" / "r.json")


def test_independent_cases_have_a_peak_and_no_growth(tmp_path):
    # Three cases that do not feed one another (a subject's case set): errors 1e-6, 1e-3, 1e-5.
    results = []
    for index, scale in enumerate((1e-6, 1e-3, 1e-5)):
        golden = _tensor(index)
        results.append(compare_tensors(f"case{index}/out", golden + scale * _tensor(50 + index), golden))
    peak = results[1].metrics.rel_l2
    report = _report(results, independent_cases=3)
    assert growth_line(report) == (f"error (rel L2) over 3 independent cases, so no growth to follow: peak "
                                   f"{format_number(peak)} at case1/out")
    growth = json.loads(to_json(report))["summary"]["error_growth"]
    assert growth["independent_cases"] == 3 and growth["peak"] == ["case1/out", peak]
    assert growth["largest_jump"] is None and growth["last_over_first"] is None
    # The same tensors as one model: the jump from case0 to case1 is the largest.
    chained = json.loads(to_json(_report(results)))["summary"]["error_growth"]
    assert chained["independent_cases"] == 0 and chained["largest_jump"]["layer"] == "case1/out"
    assert growth_line(_report(results)).startswith("error growth (rel L2, execution order): ")


def test_non_finite_numbers_stay_valid_json():
    golden = torch.zeros(4)
    result = compare_tensors("zeros", torch.ones(4), golden)  # rel L2 against zero is inf
    assert result.metrics.rel_l2 == math.inf
    data = json.loads(to_json(_report([result])))
    assert data["layers"][0]["metrics"]["rel_l2"] == "inf"


def test_junit_xml_is_valid_for_any_name():
    results = _chain(3, bad_at=1)
    odd = "weird\x01<name> & \"quotes\" \ud800"
    results.append(compare_tensors(odd, _tensor(7), _tensor(8)))
    root = ET.fromstring(to_junit_xml(_report(results, warnings=["bell \x07 in a warning"])))
    suite = root.find("testsuite")
    assert suite.get("tests") == "4" and suite.get("failures") == "3"
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases][:3] == ["layers.0", "layers.1", "layers.2"]
    assert cases[3].get("name") == "weird\ufffd<name> & \"quotes\" \ufffd"
    assert cases[0].find("failure") is None and "cosine: 1.0" in cases[0].find("system-out").text
    failure = cases[1].find("failure")
    assert failure.get("message").startswith(("mismatch_fraction", "cosine", "rel_l2"))
    assert "would pass with: " in failure.text
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props["verdict"].startswith("PARITY FAILS: first failing tensor layers.1")
    assert props["golden_host"].startswith("nvidia sm_90 NVIDIA H200")


def test_header_counts_what_the_run_did_not_read():
    from parity.report.text import header_lines

    report = _report(_chain(2), integrity={"tensors": 6, "verified": 3, "not_read": {"module_input": 2, "reference": 1}})
    line = next(line for line in header_lines(report) if line.startswith("  bundle:"))
    assert line == ("  bundle: checksums verified for the 3 of 6 stored tensors this run read; not read: 2 module "
                    "inputs, 1 reference (python -m parity verify checks every one)")


def test_ratios_have_one_formatter_and_never_read_7_3e0x():
    from parity.base.numbers import format_ratio

    assert [format_ratio(value) for value in (7.3, 1.0, 0.5, 123.4, 2.1e4, 0.001, None)] == [
        "7.3x", "1x", "0.5x", "123x", "2.1e4x", "1.0e-3x", "-"]


def test_header_wording_one_tensor_a_placeholder_subject_name_and_a_cpu_host():
    from parity.report.text import header_lines

    report = _report(_chain(1))
    report.subject = {"name": "subject", "spec": "pkg.mod:make"}  # a Subject subclass that named nothing
    lines = header_lines(report)
    assert lines[0] == "parity compare: golden/x (subject pkg.mod:make, 1 tensor)"
    assert lines[2].startswith("  this host:   cpu x86_64, torch 2.13.0+cpu")  # not "cpu cpu x86_64"
    report.candidate = "bundles/b"
    assert "(subject pkg.mod:make, 1 tensor; nothing was run)" in header_lines(report)[0]
    report.layers = _chain(3)
    assert "(subject pkg.mod:make, 3 tensors; nothing was run)" in header_lines(report)[0]


def test_a_subject_class_that_sets_no_name_is_named_by_its_spec():
    from parity.run.subjects.base import Subject, SubjectRunner

    class Unnamed(Subject):
        def make_inputs(self):
            return {}

        def build(self, impl, device="cpu"):
            return None

    class Named(Unnamed):
        name = "decoder"

    assert SubjectRunner("pkg.mod:make", Unnamed()).name == "pkg.mod:make"
    assert SubjectRunner("pkg.mod:make", Named()).name == "decoder"


def test_amdahl_bound_in_words_never_infx_or_7_3e0x():
    from parity.speed.profile import headline
    from parity.speed.tables import amdahl_text

    assert amdahl_text(7.3) == "at most 7.3x faster" and amdahl_text(1.0) == "at most 1x faster"
    line = headline({"module": "proj", "share": 1.0, "amdahl_bound": math.inf}, {"device_ns": 2_000_000, "steps": 2})
    assert line == ("hot module proj: 100.0% of 2 ms of device time over 2 steps; porting it could make the forward "
                    "faster without bound (it holds all of the counted time) (Amdahl)")
    assert "at most 8.06x faster (Amdahl)" in headline({"module": "a", "share": 0.876, "amdahl_bound": 8.0645}, {"device_ns": 1})
