"""``parity bench`` on CPU: the parity gate on what was timed, refusals, cases and fast_p.

The subjects (tests/speed_subjects.py) have impls of known speed and correctness: ``fast`` is one
matmul where ``reference`` is 32, ``wrong`` skips the product (fastest, and wrong), ``slow`` is
the reference twice. The wrong impl is faulty from outside the code under test.
"""
from __future__ import annotations

import json

import pytest

from parity.cli.main import main
from parity.base.jsonformat import schema_for

import speed_subjects
from speed_subjects import CASES_SPEC, MATMUL_SPEC

jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(autouse=True)
def single_cpu_thread():
    yield from speed_subjects.one_thread()


def bench(tmp_path, *argv, capsys=None):
    out = tmp_path / "bench.json"
    status = main(["bench", "--quiet", "--reps", "8", "--warmup", "2", "--json", str(out), *argv])
    document = json.loads(out.read_text()) if out.exists() else None
    if document is not None:
        jsonschema.validate(document, schema_for("parity-bench-report"))
    return status, document


def by_impl(document):
    return {row["impl"]: row for row in document["impls"]}


def test_faster_but_wrong_is_refused_with_exit_1(tmp_path):
    status, document = bench(tmp_path, "--subject", MATMUL_SPEC, "--impls", "reference,wrong")
    assert status == 1
    wrong = by_impl(document)["wrong"]
    assert wrong["parity"]["status"] == "fails"
    assert wrong["valid"] is False
    assert wrong["validity"] == "not valid: parity fails at <root>"
    assert wrong["vs_baseline"]["speedup"] > 1.5  # it is faster: the gate, not the clock, refuses it
    assert document["fastest"] == "wrong" and document["passed"] is False
    assert document["verdict"].startswith("SPEEDUP NOT VALID: the fastest impl, wrong, fails parity at <root>")


def test_valid_speedup_and_slowdown(tmp_path, capsys):
    status, document = bench(tmp_path, "--subject", MATMUL_SPEC, "--impls", "reference,fast,slow,wrong")
    # wrong is the fastest here too, so the run exits 1; fast's speedup is still valid.
    rows = by_impl(document)
    assert rows["reference"]["parity"]["status"] == "baseline"
    assert rows["fast"]["valid"] is True and rows["fast"]["validity"] == "valid: parity holds"
    assert rows["fast"]["vs_baseline"]["verdict"] == "FASTER"
    assert rows["fast"]["vs_baseline"]["ci_low"] > 1.5
    assert rows["slow"]["valid"] is True and rows["slow"]["vs_baseline"]["verdict"] == "SLOWER"
    assert rows["slow"]["vs_baseline"]["ci_high"] < 0.9
    assert len(rows["fast"]["times_s"]) == 8
    assert status == 1


def test_fastest_correct_exits_0_and_prints_the_table(tmp_path, capsys):
    status = main(["bench", "--quiet", "--reps", "6", "--warmup", "1", "--subject", MATMUL_SPEC,
                   "--impls", "reference,fast", "--no-modules"])
    text = capsys.readouterr().out
    assert status == 0
    assert "SPEEDUP VALID: fast" in text
    assert "valid: parity holds" in text
    assert "a CPU has no cache flush" in text


def test_against_a_golden_bundle(tmp_path):
    from parity.run.capture import capture

    golden = tmp_path / "golden"
    capture(MATMUL_SPEC, golden, impl="reference", reference="fp64")
    status, document = bench(tmp_path, "--bundle", str(golden), "--impls", "reference,fast,wrong",
                             "--module", "proj")
    rows = by_impl(document)
    assert document["settings"]["judged_against"] == "the bundle's golden"
    assert rows["reference"]["parity"]["status"] == "holds"  # the baseline is judged too, against the golden
    assert rows["fast"]["parity"]["status"] == "holds"
    assert rows["wrong"]["validity"] == "not valid: parity fails at <root>"
    assert status == 1
    modules = document["modules"]
    assert modules["patterns"] == ["proj"]
    proj_fast = next(r for r in modules["rows"] if r["impl"] == "fast")
    assert proj_fast["vs_baseline"]["speedup"] > 1.5
    assert proj_fast["amdahl_whole_forward"] > 1.0


def test_cases_give_a_fast_p_line(tmp_path):
    status, document = bench(tmp_path, "--subject", CASES_SPEC, "--impls", "reference,fast,fast_but_one_wrong",
                             "--fast-p", "1.2")
    assert status == 1  # fast_but_one_wrong is the fastest and wrong on one case
    cases = document["cases"]
    assert cases["lines"] == [
        "fast_p fast: 3 of 3 cases hold parity and are >= 1.2x faster than reference",
        "fast_p fast_but_one_wrong: 2 of 3 cases hold parity and are >= 1.2x faster than reference",
    ]
    broken = [r for r in cases["rows"] if not r["parity_holds"]]
    assert [(r["impl"], r["case"]) for r in broken] == [("fast_but_one_wrong", "m48")]
    assert by_impl(document)["fast_but_one_wrong"]["validity"] == "not valid: parity fails at <root>/m48"


@pytest.mark.parametrize("argv, message", [
    (["--subject", MATMUL_SPEC, "--impls", "reference"], "at least two"),
    (["--subject", MATMUL_SPEC, "--impls", "reference,nope"], "no implementation 'nope'"),
    (["--subject", MATMUL_SPEC, "--impls", "reference,fast", "--reps", "1"], "--reps"),
    (["--subject", MATMUL_SPEC, "--impls", "reference,fast", "--warmup", "0"], "--warmup"),
    (["--subject", MATMUL_SPEC, "--impls", "reference,fast", "--min-effect", "nan"], "--min-effect"),
    (["--impls", "reference,fast"], "needs --subject"),
    (["--bundle", "/nonexistent/bundle", "--impls", "reference,fast"], "/nonexistent/bundle"),
    (["--subject", MATMUL_SPEC, "--impls", "reference,fast", "--json", "/nonexistent/dir/b.json"], "--json"),
])
def test_unusable_input_is_exit_2_with_one_line(argv, message, capsys):
    status = main(["bench", "--quiet", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert len([line for line in err if line.startswith("parity")]) == 1
    assert message in err[-1]


def test_subject_must_match_the_bundle(tmp_path, capsys):
    from parity.run.capture import capture

    golden = tmp_path / "golden"
    capture(MATMUL_SPEC, golden, impl="reference", reference="none")
    status = main(["bench", "--quiet", "--bundle", str(golden), "--subject", CASES_SPEC, "--impls", "reference,fast"])
    assert status == 2
    assert "does not match bundle" in capsys.readouterr().err


def test_group_names_and_glob_seconds():
    from parity.speed.bench import glob_seconds, group_name, hot_group

    assert group_name("layers.12.attn.core") == "layers.*.attn.core"
    assert group_name("<root>") == "<root>"
    calls = [({"<root>": 10.0, "layers.0": 6.0, "layers.0.attn": 5.0, "layers.1": 3.0, "layers.1.attn": 2.0},
              {"<root>": 1.0, "layers.0": 1.0, "layers.0.attn": 5.0, "layers.1": 1.0, "layers.1.attn": 2.0})]
    assert glob_seconds(calls, "layers.*.attn") == [7.0]
    assert glob_seconds(calls, "layers.*") == [9.0]  # nested matches counted once, at the outermost
    assert hot_group(calls) == "layers.*.attn"


def test_module_is_importable_from_tests():
    assert speed_subjects.MatmulSubject.impls == ("reference", "fast", "wrong", "slow")
