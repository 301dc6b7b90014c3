"""``bench --baseline``: the time ratio now / then, the REGRESSED rule, the same-setup check and
the saved report read as data, on synthetic timings with known answers and end to end on the
virtual clock of tests/speed_subjects.py."""
from __future__ import annotations

import copy
import json
import random

import pytest

from parity.base.errors import UsageError
from parity.cli.main import main
from parity.speed import regression

import speed_subjects
from speed_subjects import MATMUL_SPEC
from speed_subjects import single_cpu_thread_fixture, virtual_clock_fixture  # noqa: F401 (fixtures)


def sample(scale: float, n: int = 20, spread: float = 0.002, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [scale * (1 + rng.uniform(-spread, spread)) for _ in range(n)]


PLATFORM = {"vendor": "nvidia", "arch": "sm_90", "device": "cuda", "device_name": "NVIDIA H200",
            "multiprocessors": 132, "torch": "2.11.0+cu130", "triton": "3.6.0", "driver": "580.159.04"}


def saved(times: dict[str, list[float]], **changes) -> dict:
    document = {"format": "parity-bench-report", "version": 1,
                "subject": {"spec": "decoder", "name": "decoder", "args": {"seq_len": 4096}},
                "device": "cuda", "platform": dict(PLATFORM), "settings": {"cache_flush": "flush"},
                "input_shapes": {"tokens": {"dtype": "int64", "shape": [1, 4096]}},
                "impls": [{"impl": impl, "times_s": values} for impl, values in times.items()], "seconds": 1.0}
    document.update(changes)
    return document


def test_regressed_by_5_percent_at_a_4_percent_threshold_and_by_8_at_the_default():
    then = sample(0.100, seed=1)
    now = {"same": sample(0.100, seed=2), "five": sample(0.105, seed=3), "eight": sample(0.108, seed=4),
           "faster": sample(0.090, seed=5)}
    previous = saved({impl: then for impl in now})
    section = regression.compare_runs(now, previous, path="then.json")
    rows = {row["impl"]: row for row in section["rows"]}
    assert rows["five"]["ratio"] == pytest.approx(1.05, abs=0.003)
    assert rows["five"]["ci_low"] <= rows["five"]["ratio"] <= rows["five"]["ci_high"]
    # 5% slower against a 5% threshold: the interval straddles 1.05, so the rule cannot call it.
    assert rows["five"]["ci_low"] < 1.05 < rows["five"]["ci_high"] and rows["five"]["status"] == regression.UNCLEAR
    assert rows["eight"]["status"] == regression.REGRESSED and rows["eight"]["ci_low"] > 1.05
    assert rows["same"]["status"] == regression.SAME
    assert rows["faster"]["status"] == regression.IMPROVED and rows["faster"]["ratio"] == pytest.approx(0.9, abs=0.003)
    assert section["regressed"] == ["eight"]
    eight = rows["eight"]
    assert eight["ratio"] == pytest.approx(1.08, abs=0.003)
    assert section["line"] == (f"REGRESSED against then.json: eight {100 * (eight['ratio'] - 1):.1f}% slower "
                               f"[{100 * (eight['ci_low'] - 1):.1f}%, {100 * (eight['ci_high'] - 1):.1f}%]")
    at_4 = regression.compare_runs(now, previous, path="then.json", threshold=0.04)
    assert at_4["regressed"] == ["five", "eight"]


def test_status_boundaries():
    assert regression.regression_status(1.051, 1.2) == regression.REGRESSED
    assert regression.regression_status(1.05, 1.2) == regression.UNCLEAR  # at the threshold: not beyond it
    assert regression.regression_status(0.95, 1.05) == regression.SAME
    assert regression.regression_status(0.8, 0.949) == regression.IMPROVED
    assert regression.regression_status(1.03, 1.08, threshold=0.02) == regression.REGRESSED
    with pytest.raises(ValueError):
        regression.regression_status(1.0, 1.0, threshold=0.0)


NOW = {"subject": {"spec": "decoder", "name": "decoder", "args": {"seq_len": 4096}}, "device": "cuda",
       "platform": dict(PLATFORM), "input_shapes": {"tokens": {"dtype": "int64", "shape": [1, 4096]}}}


def test_same_setup_passes_without_warnings():
    assert regression.check_same_setup(NOW, saved({"ref": [1.0]}), path="p.json", impls=["ref"]) == []


@pytest.mark.parametrize("change, message", [
    ({"platform": {**PLATFORM, "device_name": "NVIDIA H100 80GB HBM3"}},
     "--baseline p.json ran on another device (device_name: \"NVIDIA H100 80GB HBM3\" then, \"NVIDIA H200\" now)"),
    ({"platform": {**PLATFORM, "multiprocessors": 66}}, "ran on another device (multiprocessors: 66 then, 132 now)"),
    ({"device": "cpu"}, "ran on another device (--device: \"cpu\" then, \"cuda\" now)"),
    ({"subject": {"spec": "attention", "name": "attention", "args": {}}}, "timed subject 'attention', this run 'decoder'"),
    ({"subject": {"spec": "decoder", "name": "decoder", "args": {"seq_len": 1024}}},
     "timed other subject arguments (seq_len: 1024 then, 4096 now)"),
    ({"input_shapes": {"tokens": {"dtype": "int32", "shape": [1, 4096]}}}, "timed other inputs (tokens: an object then"),
    ({"impls": [{"impl": "other", "times_s": [1.0]}]}, "no implementation in common"),
])
def test_another_device_subject_or_shapes_is_refused(change, message):
    # `saved` puts the given fields over a same-setup report: the change is on the "then" side.
    with pytest.raises(UsageError) as info:
        regression.check_same_setup(NOW, saved({"ref": [1.0]}, **change), path="p.json", impls=["ref"])
    assert message in str(info.value) and "\n" not in str(info.value)


def test_other_software_and_missing_impls_are_warned():
    previous = saved({"ref": [1.0], "old": [1.0]}, platform={**PLATFORM, "triton": "3.5.0", "driver": "570.1"})
    warnings = regression.check_same_setup(NOW, previous, path="p.json", impls=["ref", "new"])
    assert warnings == [
        '--baseline p.json ran with other software or settings (driver "570.1" -> "580.159.04"; triton "3.5.0" -> '
        '"3.6.0"): a change of speed may come from them',
        "--baseline p.json: compared ref only; not in the saved run: new; not in this run: old",
    ]
    unshaped = saved({"ref": [1.0]}, input_shapes=None)
    assert regression.check_same_setup(NOW, unshaped, path="p.json", impls=["ref"]) == [
        "--baseline p.json does not record its input shapes: only the subject's arguments were checked"]


@pytest.mark.parametrize("content, message", [
    (None, "--baseline {path}: no such file"),
    ("{not json", "--baseline {path}: not a JSON document: Expecting property name"),
    ('{"format": "parity-profile-report", "version": 1}', "not a parity bench report (format parity-bench-report)"),
    ('{"format": "parity-bench-report", "version": 9}', "bench report version 9, this parity reads 1"),
    ('{"format": "parity-bench-report", "version": 1, "passed": false, "error": {"status": 2, "kind": "usage", '
     '"message": "no such subject"}}', "the report of a run that ended without timings (no such subject)"),
    (json.dumps(saved({"ref": [1.0, "nan"]})), "impls[0].times_s[1] must be a finite number > 0, got \"nan\""),
    (json.dumps(saved({"ref": [1.0, 0.0]})), "impls[0].times_s[1] must be a finite number > 0, got 0.0"),
    (json.dumps(saved({"ref": [1.0]}, impls=[])), "impls must be a non-empty array, got an array"),
    (json.dumps(saved({"ref": [1.0]}, subject="decoder")), "subject must be an object, got \"decoder\""),
])
def test_a_bad_saved_report_is_one_line(tmp_path, content, message):
    path = tmp_path / "previous.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UsageError) as info:
        regression.load_previous(path)
    assert message.format(path=path) in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------
# End to end, on the virtual clock


def bench(tmp_path, name, *argv):
    out = tmp_path / name
    status = main(["bench", "--quiet", "--reps", "12", "--warmup", "1", "--no-modules", "--no-device-time",
                   "--subject", MATMUL_SPEC, "--impls", "reference,fast", "--json", str(out), *argv])
    return status, (json.loads(out.read_text()) if out.exists() else None)


def test_end_to_end_same_then_regressed_then_refused(tmp_path, capsys, virtual_clock):
    import jsonschema

    from parity.base.jsonformat import schema_for

    status, first = bench(tmp_path, "then.json")
    assert status == 0 and first["input_shapes"]
    then = tmp_path / "then.json"
    status, again = bench(tmp_path, "now.json", "--baseline", str(then))
    jsonschema.validate(again, schema_for("parity-bench-report"))
    assert status == 0 and again["passed"] is True
    assert [row["status"] for row in again["baseline_run"]["rows"]] == ["SAME", "SAME"]  # one virtual cost, +-3%
    assert again["verdict"].endswith(f"; no regression against {then} (2 impls compared)")

    # The saved run made 20% faster: this run's fast impl is 1.2x slower than then, beyond 5%.
    faster = copy.deepcopy(first)
    for row in faster["impls"]:
        if row["impl"] == "fast":
            row["times_s"] = [value / 1.2 for value in row["times_s"]]
    then.write_text(json.dumps(faster))
    status, regressed = bench(tmp_path, "now.json", "--baseline", str(then))
    rows = {row["impl"]: row for row in regressed["baseline_run"]["rows"]}
    assert status == 1 and regressed["passed"] is False
    assert rows["fast"]["status"] == "REGRESSED" and rows["fast"]["ratio"] == pytest.approx(1.2, rel=0.07)
    assert rows["reference"]["status"] == "SAME"
    assert f"; REGRESSED against {then}: fast " in regressed["verdict"]
    from parity.speed.pages import render_bench

    page = render_bench(regressed)
    assert '<tr class="fail"><td class="name">fast</td>' in page[page.index('id="baseline-run"'):]
    assert 'data-name="fast (then)"' in page and page.count('<g class="row then"') == 2  # the saved run, grey
    jsonschema.validate(regressed, schema_for("parity-bench-report"))

    # Saved on another device: refused before any timing, one line, exit 2.
    other = copy.deepcopy(first)
    other["platform"]["device_name"] = "NVIDIA H200"
    then.write_text(json.dumps(other))
    capsys.readouterr()
    status, refused = bench(tmp_path, "refused.json", "--baseline", str(then))
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "ran on another device (device_name:" in err
    assert refused["error"]["status"] == 2


def test_threshold_without_a_baseline_is_refused(tmp_path, capsys):
    status, _ = bench(tmp_path, "x.json", "--regression-threshold", "0.1")
    assert status == 2 and "--regression-threshold applies only with --baseline" in capsys.readouterr().err
