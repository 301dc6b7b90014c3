"""Determinism as a verdict: ``capture/compare --repeat N`` and the plugin's ``--parity-repeat``.

Known answers from ``tests/repeat_subject.py``: impl ``reference`` is deterministic; ``shuffled``
sums in an order drawn from an unseeded generator and ``noisy`` adds unseeded noise, both in
``mix`` only, so the first nondeterministic tensor in execution order is ``mix`` and ``pre``
stays bitwise equal, while ``post`` and the root output inherit the difference.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

import parity.cli.main
from parity.base.errors import UsageError
from parity.bundle.reader import open_bundle
from parity.run.repeats import RepeatTracker, check_runs, spread
from test_report_json_schemas import cli as run, validate  # the CLI in process: (status, out, err)

SUBJECT = "repeat_subject:make_subject"
pytest_plugins = ["pytester"]


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    path = tmp_path_factory.mktemp("repeat") / "ref"
    assert parity.cli.main.main(["capture", "--subject", SUBJECT, "--bundle", str(path), "--repeat", "3",
                                 "--quiet"]) == 0
    return path


# ---- the tracker ---------------------------------------------------------------------------------


def test_spread_is_max_abs_difference_and_non_finite_disagreements_are_infinite():
    base = torch.tensor([1.0, 2.0, 3.0, float("nan"), float("inf")])
    assert spread(base.clone(), base) == 0.0  # NaN against NaN, Inf against the same Inf: no spread
    assert spread(torch.tensor([1.0, 2.5, 3.0, float("nan"), float("inf")]), base) == 0.5
    assert spread(torch.tensor([1.0, 2.0, 3.0, 0.0, float("inf")]), base) == math.inf
    assert spread(torch.tensor([1.0, 2.0, 3.0, float("nan"), -float("inf")]), base) == math.inf


def test_tracker_names_the_first_differing_tensor_in_execution_order_with_its_spread():
    tracker = RepeatTracker(3, allowed=("c",))
    first = {"a": torch.ones(4), "b": torch.zeros(4), "c": torch.arange(4.0)}
    for name, tensor in first.items():
        tracker.baseline(name, tensor)
    later = [{"a": torch.ones(4), "b": torch.tensor([0.0, 0.25, 0.0, 0.0]), "c": torch.arange(4.0) + 1},
             {"a": torch.ones(4), "b": torch.zeros(4)}]  # the third run does not produce c
    for tensors in later:
        tracker.start_run()
        for name, tensor in tensors.items():
            tracker.observe(name, tensor)
    report = tracker.report()
    rows = {row.name: row for row in report.tensors}
    assert [row.name for row in report.tensors] == ["a", "b", "c"]
    assert rows["a"].bitwise_equal and rows["a"].spread is None
    assert (rows["b"].bitwise_equal, rows["b"].differing_runs, rows["b"].spread) == (False, 1, 0.25)
    assert (rows["c"].differing_runs, rows["c"].spread, rows["c"].allowed) == (2, math.inf, True)
    assert "did not produce it" in rows["c"].note
    assert report.first_nondeterministic == "b" and [r.name for r in report.failing] == ["b"]
    assert not report.passed and report.max_spread == math.inf


@pytest.mark.parametrize("value", [0, -1, "x", "1.5", 1.5, True, None])
def test_a_run_count_below_one_or_not_whole_is_a_usage_error(value):
    with pytest.raises(UsageError, match="whole number of runs >= 1"):
        check_runs(value)
    assert check_runs("3") == 3 and check_runs(1) == 1


# ---- the CLI -------------------------------------------------------------------------------------


def test_capture_repeat_records_a_bitwise_capture_in_the_manifest(golden):
    repeat = open_bundle(golden).capture_info["repeat"]
    assert repeat == {"runs": 3, "bitwise_equal": True, "first_nondeterministic": None, "nondeterministic": [],
                      "max_spread": None}


def _compare(capsys, golden, tmp_path, impl, *extra):
    report = tmp_path / f"{impl}.json"
    code, out, err = run(capsys, "compare", "--bundle", str(golden), "--subject", SUBJECT, "--impl", impl,
                         "--json", str(report), "--quiet", *extra)
    return code, out, json.loads(report.read_text())


def test_a_deterministic_impl_is_bitwise_equal_in_every_run(capsys, golden, tmp_path):
    code, out, report = _compare(capsys, golden, tmp_path, "reference", "--repeat", "3")
    assert code == 0 and report["passed"]
    determinism = report["determinism"]
    assert determinism["runs"] == 3 and determinism["bitwise_equal"] and determinism["first_nondeterministic"] is None
    assert [row["name"] for row in determinism["tensors"]] == ["pre", "mix", "post", "<root>"]
    assert "determinism: 3 runs, all 4 tensors bitwise equal" in out


@pytest.mark.parametrize("impl", ["shuffled", "noisy"])
def test_a_nondeterministic_impl_fails_naming_mix_first_with_its_spread(capsys, golden, tmp_path, impl):
    code, out, report = _compare(capsys, golden, tmp_path, impl, "--repeat", "3")
    assert code == 1 and not report["passed"]
    # Every tensor is within tolerance of the golden: the run fails on determinism alone.
    assert all(layer["passed"] for layer in report["layers"])
    determinism = report["determinism"]
    assert determinism["first_nondeterministic"] == "mix"
    assert determinism["nondeterministic"] == ["mix", "post", "<root>"]
    rows = {row["name"]: row for row in determinism["tensors"]}
    assert rows["pre"]["bitwise_equal"] and rows["pre"]["spread"] is None
    assert rows["mix"]["differing_runs"] == 2
    # The spread is rounding (shuffled: fp32 order, values of order 1) or the 1e-7 noise: small, not zero.
    assert 0 < rows["mix"]["spread"] < 1e-5
    assert report["verdict"].startswith("PARITY FAILS: not deterministic: first mix (3 of 4 tensors")
    assert "mix: differs in 2 of 2 later runs, spread max|run_i - run_0|" in out
    validate(report)  # the determinism object is in the compare report's schema


def test_allowed_tensors_are_reported_but_do_not_fail(capsys, golden, tmp_path):
    code, _, report = _compare(capsys, golden, tmp_path, "shuffled", "--repeat", "2",
                               "--allow-nondeterministic", "mix")
    assert code == 1 and report["determinism"]["first_nondeterministic"] == "mix"
    rows = {row["name"]: row for row in report["determinism"]["tensors"]}
    assert rows["mix"]["allowed"] and not rows["post"]["allowed"]
    code, _, report = _compare(capsys, golden, tmp_path, "shuffled", "--repeat", "2",
                               "--allow-nondeterministic", "*")
    assert code == 0 and report["passed"] and not report["determinism"]["bitwise_equal"]


def test_one_run_reports_no_determinism(capsys, golden, tmp_path):
    code, out, report = _compare(capsys, golden, tmp_path, "shuffled")
    assert code == 0 and "determinism" not in report and "determinism" not in out


def test_capture_repeat_of_a_nondeterministic_impl_records_where_it_differs(capsys, tmp_path):
    bundle = tmp_path / "shuffled"
    code, out, err = run(capsys, "capture", "--subject", SUBJECT, "--bundle", str(bundle), "--impl", "shuffled",
                         "--repeat", "3", "--quiet")
    assert code == 0, err
    assert "NOT deterministic: 3 tensor(s) differ over 3 runs, first mix" in out
    manifest = open_bundle(bundle)
    assert manifest.capture_info["repeat"]["bitwise_equal"] is False
    assert manifest.capture_info["repeat"]["nondeterministic"] == ["mix", "post", "<root>"]
    assert manifest.hooks_check["explained_by"].startswith("the subject is not deterministic")
    # Without --repeat the same capture is refused: the hooks check cannot tell a race from the hooks.
    code, _, err = run(capsys, "capture", "--subject", SUBJECT, "--bundle", str(tmp_path / "again"), "--impl",
                       "shuffled", "--quiet")
    assert code == 2 and "not deterministic run to run" in err and not (tmp_path / "again").exists()
    # compare says the golden itself was not repeatable
    code, out, err = run(capsys, "compare", "--bundle", str(bundle), "--subject", SUBJECT, "--impl", "reference",
                         "--quiet")
    assert "warning: the golden's capture was not bitwise repeatable over 3 runs: 3 tensor(s) differ" in out


@pytest.mark.parametrize("command", ["capture", "compare"])
@pytest.mark.parametrize("value", ["0", "-2", "x", "1.5"])
def test_a_bad_repeat_is_one_line_and_exit_2(capsys, golden, tmp_path, command, value):
    argv = (["capture", "--subject", SUBJECT, "--bundle", str(tmp_path / "b")] if command == "capture"
            else ["compare", "--bundle", str(golden), "--subject", SUBJECT])
    code, out, err = run(capsys, *argv, "--repeat", value)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--repeat" in err and "Traceback" not in err
    assert not (tmp_path / "b").exists()


# ---- the plugin ----------------------------------------------------------------------------------


def test_plugin_repeat_fails_a_nondeterministic_subject_and_passes_a_deterministic_one(pytester, golden):
    pytester.makepyfile(test_repeat=f'''
        import pytest

        @pytest.mark.parity(golden={golden.name!r}, subject={SUBJECT!r})
        def test_reference(parity_check):
            parity_check.subject(impl="reference")

        @pytest.mark.parity(golden={golden.name!r}, subject={SUBJECT!r})
        def test_shuffled(parity_check):
            parity_check.subject(impl="shuffled")

        @pytest.mark.parity(golden={golden.name!r}, subject={SUBJECT!r}, repeat=1)
        def test_shuffled_once(parity_check):
            parity_check.subject(impl="shuffled")
    ''')
    where = ("--parity-golden-dir", str(golden.parent))
    result = pytester.runpytest(*where, "--parity-repeat", "3", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*test_shuffled*", "*determinism: 3 runs, 3 of 4 tensors not bitwise equal; "
                                 "first in execution order: mix*"])
    allowed = pytester.runpytest(*where, "--parity-repeat", "3", "--parity-allow-nondeterministic", "*",
                                 "-p", "no:cacheprovider")
    allowed.assert_outcomes(passed=3)
