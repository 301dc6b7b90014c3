"""JUnit XML against the JUnit (xunit2) schema, tests/data/junit.xsd, which CI servers and pytest
itself target: compare's --junit-xml (holds, fails, the error report), diff's, and pytest's own
--junit-xml with the plugin checking tensors (passing and failing); and the negative controls: the
schema rejects a test case with <properties> (what the plugin used to produce) and a <testsuites>
with a ``skipped`` attribute (what compare used to write)."""
from __future__ import annotations

import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
import xmlschema

from parity.run.capture import capture
from parity.cli.main import main
from test_judge_diff import rewrite_tensor  # the same outside edit of a stored tensor as diff's tests
from plugin_suite import make_plugin_suite

pytest_plugins = ["pytester"]

XSD = Path(__file__).resolve().parent / "data" / "junit.xsd"
FIRST_OUT = "B1-Hq2-Hkv1-Sq64-Sk64-D32-causal-fp16-s0/out"


@pytest.fixture(scope="module")
def schema() -> xmlschema.XMLSchema:
    return xmlschema.XMLSchema(XSD)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> Path:
    """Two captures of the attention smoke cases and a copy of the second with one output scaled by
    1.01 (a valid bundle that fails against the first)."""
    root = tmp_path_factory.mktemp("junit")
    for name in ("a", "b"):
        capture("attention", root / name, subject_args={"cases": "smoke"}, impl="reference")
    shutil.copytree(root / "b", root / "perturbed")
    rewrite_tensor(root / "perturbed", "output", FIRST_OUT, lambda t: t * 1.01)
    return root


def cli(capsys, *argv) -> int:
    code = main([str(arg) for arg in argv])
    capsys.readouterr()
    return code


def cases(path: Path) -> list[ET.Element]:
    return ET.parse(path).getroot().findall("./testsuite/testcase")


@pytest.mark.parametrize("golden, status, failures", [("a", 0, "0"), ("perturbed", 1, "1")])
def test_compare_junit_validates(bundles, schema, tmp_path, capsys, golden, status, failures):
    junit = tmp_path / "compare.xml"
    assert cli(capsys, "compare", "--golden", bundles / golden, "--impl", "reference", "--device", "cpu",
               "--quiet", "--junit-xml", junit) == status
    schema.validate(str(junit))
    root = ET.parse(junit).getroot()
    assert "skipped" not in root.attrib and root.get("failures") == failures
    suite = root.find("testsuite")
    assert suite.get("tests") == "4" and suite.get("failures") == failures and float(suite.get("time")) >= 0
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props["verdict"].startswith("PARITY HOLDS" if status == 0 else "PARITY FAILS")
    # Tensors are not timed one by one: no time at all rather than a made-up 0.
    assert all("time" not in case.attrib and case.find("properties") is None for case in cases(junit))
    failing = [case.get("name") for case in cases(junit) if case.find("failure") is not None]
    assert failing == ([] if status == 0 else [FIRST_OUT])


def test_any_name_and_message_stays_valid(schema):
    from parity.judge.results import CompareReport
    from parity.judge.engine import compare_tensors
    from parity.judge.policy import Policy
    from parity.report.junit import to_junit_xml

    odd = "weird\x01<name> & \"quotes\" \ud800"
    results = [compare_tensors(odd, torch.ones(8), torch.zeros(8)), compare_tensors("ok", torch.ones(8), torch.ones(8))]
    report = CompareReport(golden="g\x07", subject={"name": "<demo>"}, impl="triton", golden_impl=None, device="cpu",
                           policy=Policy(), layers=results, hosts={"golden": {}, "here": {}},
                           fingerprint_differences=[], warnings=["bell \x07"])
    schema.validate(to_junit_xml(report))


def test_diff_junit_validates(bundles, schema, tmp_path, capsys):
    junit = tmp_path / "diff.xml"
    assert cli(capsys, "diff", bundles / "a", bundles / "perturbed", "--quiet", "--junit-xml", junit) == 1
    schema.validate(str(junit))
    assert [case.get("name") for case in cases(junit) if case.find("failure") is not None] == [FIRST_OUT]


def test_error_junit_validates(bundles, schema, tmp_path, capsys):
    damaged = tmp_path / "damaged"
    shutil.copytree(bundles / "a", damaged)
    (damaged / "manifest.json").write_text("{")
    junit = tmp_path / "error.xml"
    assert cli(capsys, "compare", "--golden", damaged, "--impl", "reference", "--device", "cpu",
               "--junit-xml", junit) == 2
    schema.validate(str(junit))
    (case,) = cases(junit)
    assert case.find("error") is not None


# ---- pytest's own --junit-xml with the plugin ---------------------------------------------------------




@pytest.fixture
def plugin_suite(pytester):
    return make_plugin_suite(pytester)


@pytest.mark.parametrize("broken", [False, True], ids=["passing", "failing"])
def test_pytest_junit_with_the_plugin_validates(plugin_suite, schema, monkeypatch, broken):
    if broken:
        monkeypatch.setenv("BREAK", "1")
    junit = plugin_suite.path / "junit.xml"
    report = plugin_suite.path / "parity.json"
    result = plugin_suite.runpytest("-p", "no:cacheprovider", "--junit-xml", str(junit),
                                    "--parity-report", str(report))
    result.assert_outcomes(passed=1, failed=1) if broken else result.assert_outcomes(passed=2)
    schema.validate(str(junit))
    assert all(case.find("properties") is None for case in cases(junit))
    suite = ET.parse(junit).getroot().find("testsuite")
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props == {"parity.tensors": "2", "parity.tensors_passing": "1" if broken else "2",
                     "parity.report": str(report)}
    # The per-tensor results are still in the plugin's own report and summary.
    assert report.is_file()
    result.stdout.fnmatch_lines(["parity: 2 tensors checked: 1 pass, 1 fail (1 passing not shown: -v lists them)"
                                 if broken else "parity: 2 tensors checked: 2 pass (-v lists them)"])


def test_pytest_junit_without_parity_checks_has_no_parity_properties(pytester, schema):
    pytester.makepyfile(test_plain="def test_plain():\n    assert True\n")
    junit = pytester.path / "junit.xml"
    pytester.runpytest("-p", "no:cacheprovider", "--junit-xml", str(junit)).assert_outcomes(passed=1)
    schema.validate(str(junit))
    assert ET.parse(junit).getroot().find("testsuite/properties") is None


# ---- negative controls: the schema rejects what parity used to write ---------------------------------


def test_schema_rejects_properties_on_a_test_case(pytester, schema):
    """What the plugin did before: per-tensor JSON in user_properties, which pytest writes as
    <properties> of the test case."""
    pytester.makepyfile(test_old='''
def test_old(request):
    request.node.user_properties.append(("parity", '{"tensor": "out", "status": "pass"}'))
''')
    junit = pytester.path / "junit.xml"
    pytester.runpytest("-p", "no:cacheprovider", "--junit-xml", str(junit)).assert_outcomes(passed=1)
    assert cases(junit)[0].find("properties") is not None
    with pytest.raises(xmlschema.XMLSchemaValidationError):
        schema.validate(str(junit))


def test_schema_rejects_what_compare_used_to_write(schema):
    valid = ('<testsuites name="parity compare" tests="1" failures="0" errors="0" time="0.1">'
             '<testsuite name="s" tests="1" failures="0" errors="0" skipped="0" time="0.1">'
             '<testcase classname="c" name="t"/></testsuite></testsuites>')
    schema.validate(valid)
    with pytest.raises(xmlschema.XMLSchemaValidationError):  # skipped is a suite's attribute only
        schema.validate(valid.replace('errors="0" time="0.1">', 'errors="0" skipped="0" time="0.1">', 1))
    with pytest.raises(xmlschema.XMLSchemaValidationError):
        schema.validate(valid.replace('name="t"/>', 'name="t"><properties><property name="p" value="v"/>'
                                                    '</properties></testcase>'))
