"""``parity bench`` on CPU: the parity gate on what was timed, refusals, cases and fast_p.

The subjects (tests/speed_subjects.py) have impls of known speed and correctness: ``fast`` is one
matmul where ``reference`` is 32, ``wrong`` skips the product (fastest, and wrong), ``slow`` is
the reference twice. The wrong impl is faulty from outside the code under test.

Speeds are not measured here (numbers belong in benchmarks): the tests that assert a speedup, a
verdict or a fast_p line run on ``speed_subjects``' virtual clock, which each module advances by
the known cost of its work (reference 32 units + 1 for the tanh, fast 1 + 1, wrong 0.1 + 1, slow
64 + 1; +-3% jitter), so the expected numbers are derived, not observed.
"""
from __future__ import annotations

import json

import pytest

from parity.cli.main import main
from parity.base.jsonformat import schema_for

import speed_subjects
from speed_subjects import BUFFERS_SPEC, CASES_SPEC, MATMUL_SPEC
from speed_subjects import single_cpu_thread_fixture, virtual_clock_fixture  # noqa: F401 (fixtures)

import jsonschema  # a test dependency (pyproject's test extra): missing, the file errors, never skips

# Virtual costs (speed_subjects.cost_units) of one whole forward, and the speedups they give.
REFERENCE, FAST, WRONG, SLOW = 32 + 1, 1 + 1, 0.1 + 1, 64 + 1
JITTER = 0.07  # the ratio of two medians, each within +-3% of its cost


def bench(tmp_path, *argv, capsys=None):
    out = tmp_path / "bench.json"
    status = main(["bench", "--quiet", "--reps", "8", "--warmup", "2", "--json", str(out), *argv])
    document = json.loads(out.read_text()) if out.exists() else None
    if document is not None:
        jsonschema.validate(document, schema_for("parity-bench-report"))
    return status, document


def by_impl(document):
    return {row["impl"]: row for row in document["impls"]}


def test_faster_but_wrong_is_refused_with_exit_1(tmp_path, virtual_clock):
    status, document = bench(tmp_path, "--subject", MATMUL_SPEC, "--impls", "reference,wrong")
    assert status == 1
    wrong = by_impl(document)["wrong"]
    assert wrong["parity"]["status"] == "fails"
    assert wrong["valid"] is False
    assert wrong["validity"] == "not valid: parity fails at <root>"
    # it is faster (33 units against 1.1): the gate, not the clock, refuses it
    assert wrong["vs_baseline"]["speedup"] == pytest.approx(REFERENCE / WRONG, rel=JITTER)
    assert document["fastest"] == "wrong" and document["passed"] is False
    assert document["verdict"].startswith("SPEEDUP NOT VALID: the fastest impl, wrong, fails parity at <root>")


def test_valid_speedup_and_slowdown(tmp_path, capsys, virtual_clock):
    status, document = bench(tmp_path, "--subject", MATMUL_SPEC, "--impls", "reference,fast,slow,wrong",
                             "--reps", "16")
    # wrong is the fastest here too, so the run exits 1; fast's speedup is still valid.
    rows = by_impl(document)
    assert rows["reference"]["parity"]["status"] == "baseline"
    assert rows["fast"]["valid"] is True and rows["fast"]["validity"] == "valid: parity holds"
    fast, slow = rows["fast"]["vs_baseline"], rows["slow"]["vs_baseline"]
    assert fast["verdict"] == "FASTER" and fast["speedup"] == pytest.approx(REFERENCE / FAST, rel=JITTER)
    assert REFERENCE / FAST * (1 - JITTER) < fast["ci_low"] <= fast["speedup"] <= fast["ci_high"]
    assert rows["slow"]["valid"] is True and slow["verdict"] == "SLOWER"
    assert slow["speedup"] == pytest.approx(REFERENCE / SLOW, rel=JITTER)
    assert slow["ci_high"] < REFERENCE / SLOW * (1 + JITTER)
    assert len(rows["fast"]["times_s"]) == 16
    assert status == 1


def test_fastest_correct_exits_0_and_prints_the_table(tmp_path, capsys, virtual_clock):
    status = main(["bench", "--quiet", "--reps", "6", "--warmup", "1", "--subject", MATMUL_SPEC,
                   "--impls", "reference,fast", "--no-modules"])
    text = capsys.readouterr().out
    assert status == 0
    assert "SPEEDUP VALID: fast" in text
    assert "valid: parity holds" in text
    assert "a CPU has no cache flush" in text


def test_against_a_golden_bundle(tmp_path, virtual_clock):
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
    assert proj_fast["vs_baseline"]["speedup"] == pytest.approx(32 / 1, rel=JITTER)  # proj alone: 32 units against 1
    # proj is 32 of the reference's 33 units; Amdahl's bound for the whole forward, 1 / ((1 - s) + s / k),
    # is 16.5 without jitter, and very sensitive to s near 1: checked as that formula of the reported numbers.
    share, speedup = modules["baseline_share"]["proj"], proj_fast["vs_baseline"]["speedup"]
    assert share == pytest.approx(32 / 33, rel=JITTER)
    assert proj_fast["amdahl_whole_forward"] == pytest.approx(1 / ((1 - min(1.0, share)) + min(1.0, share) / speedup))
    assert 10 < proj_fast["amdahl_whole_forward"] < speedup


def test_cases_give_a_fast_p_line(tmp_path, virtual_clock):
    status, document = bench(tmp_path, "--subject", CASES_SPEC, "--impls", "reference,fast,fast_but_one_wrong",
                             "--fast-p", "1.2")
    assert status == 1  # fast_but_one_wrong is the fastest and wrong on one case
    cases = document["cases"]
    assert cases["lines"] == [
        "fast_p fast: 3 of 3 cases hold parity and are >= 1.2x faster than reference",
        "fast_p fast_but_one_wrong: 2 of 3 cases hold parity and are >= 1.2x faster than reference",
    ]
    speedups = [r["speedup"] for r in cases["rows"] if r["impl"] == "fast"]
    assert speedups == pytest.approx([32.0] * 3, rel=JITTER)  # each case: 32 units against 1
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
    (["--subject", MATMUL_SPEC, "--impls", "reference,,fast"], "--impls must be a comma-separated list"),
    (["--subject", MATMUL_SPEC, "--impls", "reference,fast,reference"], "names an implementation twice"),
    (["--subject", MATMUL_SPEC, "--impls", "reference,fast", "--fast-p", "0"], "--fast-p"),
    (["--subject", "no_such_module:factory", "--impls", "reference,fast"], "no_such_module"),
    (["--bundle", __file__, "--impls", "reference,fast"], "is not a directory"),
    # an empty directory of the test's own: /tmp would hold the checkout when it is cloned there
    (["--bundle", "{empty_dir}", "--impls", "reference,fast"], "not a complete parity bundle"),
    (["--subject", MATMUL_SPEC, "--impls", "reference,fast", "--json", "-", "--html", "-"], "only one report"),
])
def test_unusable_input_is_exit_2_with_one_line(argv, message, capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    status = main(["bench", "--quiet", *(a.replace("{empty_dir}", str(tmp_path / "empty")) for a in argv)])
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
    from parity.speed.timing import glob_seconds, group_name, hot_group

    assert group_name("layers.12.attn.core") == "layers.*.attn.core"
    assert group_name("<root>") == "<root>"
    calls = [({"<root>": 10.0, "layers.0": 6.0, "layers.0.attn": 5.0, "layers.1": 3.0, "layers.1.attn": 2.0},
              {"<root>": 1.0, "layers.0": 1.0, "layers.0.attn": 5.0, "layers.1": 1.0, "layers.1.attn": 2.0})]
    assert glob_seconds(calls, "layers.*.attn") == [7.0]
    assert glob_seconds(calls, "layers.*") == [9.0]  # nested matches counted once, at the outermost
    assert hot_group(calls) == "layers.*.attn"


def test_device_time_next_to_wall_time(tmp_path, capsys):
    # The profiled time is measured (CPU ops' self time), so only its arithmetic is asserted here.
    status, document = bench(tmp_path, "--subject", MATMUL_SPEC, "--impls", "reference,fast", "--no-modules")
    rows = by_impl(document)
    for impl in ("reference", "fast"):
        measured = rows[impl]["device_time"]
        assert measured["counted"] == "CPU ops' self time" and measured["calls"] == 3 and measured["note"] is None
        # On a CPU the profiled ops carry the profiler's overhead: their time may exceed the wall time.
        assert measured["per_call_s"] > 0
        assert measured["wall_share"] == pytest.approx(measured["per_call_s"] / rows[impl]["summary"]["median"])
    ref, fast = rows["reference"]["device_time"]["per_call_s"], rows["fast"]["device_time"]["per_call_s"]
    assert rows["fast"]["device_time"]["speedup"] == pytest.approx(ref / fast)
    assert "speedup" not in rows["reference"]["device_time"]
    assert document["settings"]["device_time"].startswith("3 profiled calls per impl")
    assert status == 0
    assert "device speedup" in capsys.readouterr().out
    assert main(["bench", "--quiet", "--reps", "3", "--warmup", "1", "--subject", MATMUL_SPEC, "--impls",
                 "reference,fast", "--no-modules", "--no-device-time"]) == 0
    text = capsys.readouterr().out
    assert "device speedup" not in text


def test_a_cached_output_fails_parity_and_a_rewritten_buffer_holds(tmp_path):
    # cached returns the product of its first (warm-up) call again: right in value and no work, so
    # without the poisoning of the previous output it would pass as a valid speedup.
    status, document = bench(tmp_path, "--subject", BUFFERS_SPEC, "--impls", "reference,cached,out_buffer",
                             "--no-modules")
    rows = by_impl(document)
    assert {impl: row["fresh_outputs"] for impl, row in rows.items()} == {
        "reference": {"reused_calls": 0, "poisoned_calls": 7, "calls": 8},
        "cached": {"reused_calls": 7, "poisoned_calls": 7, "calls": 8},
        "out_buffer": {"reused_calls": 7, "poisoned_calls": 7, "calls": 8},
    }
    assert rows["cached"]["parity"]["status"] == "fails"
    assert rows["cached"]["validity"] == "not valid: parity fails at <root>"
    assert rows["out_buffer"]["parity"]["status"] == "holds" and rows["out_buffer"]["valid"] is True
    reused = [w for w in document["warnings"] if "not a fresh output" in w]
    assert [w.split(":")[0] for w in reused] == ["cached", "out_buffer"]
    assert reused[0].startswith("cached: 7 of 7 timed calls returned an output in the memory of the previous call's")
    assert status == (1 if document["fastest"] == "cached" else 0)


def test_poison_spares_the_inputs_and_weights():
    import torch

    from parity.speed.timing import poison, protected_memory

    x, weight = torch.ones(4), torch.nn.Linear(2, 2)
    fresh, counts, flags = torch.ones(3), torch.arange(3), torch.ones(2, dtype=torch.bool)
    protected = protected_memory({"x": x}, [weight])
    output = {"out": fresh, "x_view": x[1:], "w": weight.weight, "counts": counts, "flags": flags}
    assert poison(output, protected) == 2
    assert torch.isnan(fresh).all()
    assert counts.tolist() == [2**63 - 1] * 3
    assert x.tolist() == [1.0] * 4 and not torch.isnan(weight.weight).any() and flags.all()


def outcome(status, failing=()):
    from parity.speed.bench import ParityOutcome

    return ParityOutcome(status, 1, list(failing), "values differ" if failing else None, [])


def test_rows_and_warnings_on_synthetic_timings():
    from parity.speed.bench import impl_rows

    times = {
        "ref": [10.0] * 5,
        "ten": [1.0] * 5,  # exactly 10x: no re-verify warning (the limit is above 10x)
        "skip": [0.5] * 5,  # 20x and wrong
        "edge": [90.0, 95.0, 100.0, 105.0, 110.0],  # IQR 10 / median 100 = 0.10: not above the limit
        "noisy": [90.0, 94.0, 100.0, 106.0, 110.0],  # IQR 12 / median 100 = 0.12
    }
    outcomes = {"ref": outcome("baseline"), "ten": outcome("holds"), "skip": outcome("fails", ["<root>/logits"]),
                "edge": outcome("holds"), "noisy": outcome("holds")}
    rows, warnings = impl_rows(times, outcomes, list(times), min_effect=0.02, seed=0)
    rows = {row["impl"]: row for row in rows}
    assert "vs_baseline" not in rows["ref"]
    assert rows["ten"]["vs_baseline"]["speedup"] == 10.0
    assert (rows["ten"]["vs_baseline"]["ci_low"], rows["ten"]["vs_baseline"]["ci_high"]) == (10.0, 10.0)
    assert rows["ten"]["vs_baseline"]["verdict"] == "FASTER" and rows["ten"]["valid"] is True
    assert rows["skip"]["vs_baseline"]["speedup"] == 20.0 and rows["skip"]["valid"] is False
    assert rows["skip"]["validity"] == "not valid: parity fails at <root>/logits"
    assert rows["edge"]["vs_baseline"]["speedup"] == 0.1 and rows["edge"]["vs_baseline"]["verdict"] == "SLOWER"
    assert rows["noisy"]["summary"]["rel_iqr"] == pytest.approx(0.12)
    assert warnings == [
        "skip: speedup 20.0x > 10x: re-verify that it computes the same thing (a speedup this large is more often a "
        "skipped computation than a faster one)",
        "noisy (whole forward): IQR/median 0.12 > 0.10: noisy timings (other load, clock changes); more repetitions "
        "or a quieter machine",
    ]


def test_a_failing_baseline_makes_every_speedup_unverified():
    from parity.speed.bench import impl_rows

    rows, _ = impl_rows({"ref": [2.0, 2.0, 2.0], "new": [1.0, 1.0, 1.0]},
                        {"ref": outcome("fails", ["<root>"]), "new": outcome("holds")}, ["ref", "new"])
    assert rows[1]["valid"] is False
    assert rows[1]["validity"] == "not valid: the baseline ref fails parity at <root> (unverified)"


@pytest.mark.parametrize("command, argv", [
    ("bench", ["--subject", "no_such_module:factory", "--impls", "reference,fast"]),
    ("profile", ["--subject", "no_such_module:factory"]),
])
def test_refused_run_replaces_a_stale_json_report(command, argv, tmp_path, capsys):
    """A refused run (exit 2) leaves --json saying so, never a report of an earlier run: CI that
    reads the file sees the error, not a stale pass."""
    report = tmp_path / "report.json"
    report.write_text('{"passed": true}')
    assert main([command, "--quiet", *argv, "--json", str(report)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    document = json.loads(report.read_text())
    expected = {"bench": "parity-bench-report", "profile": "parity-profile-report"}[command]
    assert document["format"] == expected and document["passed"] is False
    assert document["error"]["status"] == 2 and "no_such_module" in document["error"]["message"]
    jsonschema.validate(document, schema_for(expected))


def test_module_share_comes_from_the_same_calls_and_noisy_modules_are_warned():
    from types import SimpleNamespace

    from parity.speed.bench import _modules_section

    def call(root, attn):
        return ({"<root>": root, "layers.0.attn": attn / 2, "layers.1.attn": attn / 2}, {})

    # The baseline's attention is 8 of 10 in every call; the new impl's attention is noisy.
    calls = {"ref": [call(10.0, 8.0)] * 5,
             "new": [call(4.0, a) for a in (1.0, 1.5, 2.0, 2.5, 3.0)]}
    warnings: list[str] = []
    section = _modules_section(calls, ["layers.*.attn"], ["ref", "new"],
                               SimpleNamespace(min_effect=0.02, seed=0, equivalence=0.02), warnings)
    assert section["baseline_share"] == {"layers.*.attn": 0.8}
    new = next(row for row in section["rows"] if row["impl"] == "new")
    assert new["vs_baseline"]["speedup"] == 4.0  # median 8 / median 2
    assert new["amdahl_whole_forward"] == pytest.approx(1 / (0.2 + 0.8 / 4))
    assert warnings == ["new layers.*.attn: IQR/median 0.50 > 0.10: noisy timings (other load, clock changes); more "
                        "repetitions or a quieter machine"]


def test_a_device_speedup_above_10x_is_warned(monkeypatch):
    from parity.speed import bench as bench_module

    per_call = iter([1e-3, 5e-5, 5e-4])  # ref, then 20x and 2x faster
    monkeypatch.setattr(bench_module, "device_time_per_call",
                        lambda fn, device: {"per_call_s": next(per_call), "note": None})
    rows = [{"impl": impl, "summary": {"median": 1e-3}} for impl in ("ref", "skip", "half")]
    warnings: list[str] = []
    bench_module._add_device_times(rows, None, ["ref", "skip", "half"], "cpu", warnings)
    assert [row["device_time"].get("speedup") for row in rows] == [None, pytest.approx(20.0), pytest.approx(2.0)]
    assert warnings == ["skip: device speedup 20.0x > 10x: re-verify that it computes the same thing (a speedup "
                        "this large is more often a skipped computation than a faster one)"]


def test_a_slower_row_is_never_called_valid():
    from parity.speed.bench import _validity

    holds = {"base": outcome("holds"), "port": outcome("holds")}
    assert _validity(holds, "port", "base", "SLOWER") == "parity holds; slower"
    assert _validity(holds, "port", "base", "FASTER") == "valid: parity holds"
    fails = {"base": outcome("holds"), "port": outcome("fails", ["layers.0"])}
    assert _validity(fails, "port", "base", "SLOWER") == "not valid: parity fails at layers.0"


def test_bench_page_shows_the_spread_and_a_slower_row_as_slower(tmp_path, virtual_clock):
    from parity.speed.pages import render_bench

    status, document = bench(tmp_path, "--subject", MATMUL_SPEC, "--impls", "reference,slow", "--reps", "16")
    slow = by_impl(document)["slow"]
    assert slow["vs_baseline"]["verdict"] == "SLOWER" and slow["validity"] == "parity holds; slower"
    page = render_bench(document)
    assert "min\u2013max" in page and "valid: parity holds" not in page
    # the speedup, its verdict and whether it counts come before the spread (a 1024 px window
    # shows them without scrolling the table sideways)
    import re

    impls = page[page.index('<section id="impls">'):]
    headers = re.findall(r"<th[^>]*>([^<]*)</th>", impls[:impls.index("</thead>")])
    assert headers[:7] == ["impl", "median ms", "speedup [95% CI]", "verdict", "speedup valid?", "parity",
                           "equivalence [90% CI]"], headers
    slow_row = impls[impls.index('<td class="name">slow</td>'):]
    cells = re.findall(r"<td[^>]*>(.*?)</td>", slow_row[:slow_row.index("</tr>")])
    assert cells[3] == "SLOWER" and cells[4] == "parity holds; slower" and cells[5] == "holds"
    low, high = min(slow["times_s"]), max(slow["times_s"])
    assert low < high  # the virtual clock's jitter: a spread to show


def test_bench_page_draws_each_impls_timings_and_the_equivalence_verdict(tmp_path, virtual_clock):
    import re

    from parity.speed.pages import render_bench
    from parity.speed.tables import bench_text

    status, document = bench(tmp_path, "--subject", MATMUL_SPEC, "--impls", "reference,fast,wrong", "--reps", "9",
                             "--no-modules", "--no-device-time")
    page = render_bench(document)
    plot = page[page.index('<section id="distribution">'):]
    plot = plot[:plot.index("</section>")]
    rows = re.findall(r'<g class="row ([a-z]*)" data-name="([^"]+)" data-n="(\d+)"', plot)
    assert rows == [("", "reference", "9"), ("", "fast", "9"), ("fail", "wrong", "9")]  # wrong fails parity: red
    assert plot.count("<circle") == 27 and plot.count('class="box"') == 3
    assert "<script" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    fast = by_impl(document)["fast"]["vs_baseline"]["equivalence"]
    assert fast["equivalent"] is False and fast["margin"] == 0.02 and fast["confidence"] == 0.9  # 16x faster
    assert "not shown within \u00b12% [" in page and "equivalence [90% CI]" in bench_text(document)


def test_equivalence_margin_from_the_cli_and_an_equivalent_row_in_the_verdict_line(tmp_path, virtual_clock):
    from parity.speed.bench import _verdict_line

    status, document = bench(tmp_path, "--subject", MATMUL_SPEC, "--impls", "reference,fast", "--reps", "12",
                             "--no-modules", "--no-device-time", "--equivalence", "0.5")
    fast = by_impl(document)["fast"]["vs_baseline"]["equivalence"]
    assert document["settings"]["equivalence"] == 0.5 and fast["margin"] == 0.5
    assert not fast["equivalent"] and fast["ci_low"] > 1.5  # 16.5x faster is far outside +-50%
    rows = [{"impl": "ref"}, {"impl": "twin", "vs_baseline": {"equivalence": {"equivalent": True, "margin": 0.02}}}]
    outcomes = {"ref": outcome("baseline"), "twin": outcome("holds")}
    assert _verdict_line("ref", outcomes, rows, "ref") == ("NO SPEEDUP: the baseline ref is the fastest; twin "
                                                           "EQUIVALENT within \u00b12% of it")


def test_every_table_of_the_bench_page_scrolls_in_its_box_and_an_unnamed_subject_reads_as_its_spec(tmp_path,
                                                                                                    virtual_clock):
    """Whole forward and modules (and cases, the saved run where present): each table scrolls
    sideways in its own box, so a narrow window never cuts columns off; a subject without a name
    is titled by its spec, never ``parity bench: subject``."""
    import re

    from parity.speed.pages import render_bench

    status, document = bench(tmp_path, "--subject", MATMUL_SPEC, "--impls", "reference,fast", "--reps", "6")
    page = render_bench(document)
    tables = re.findall(r'(<div class="table-scroll">)?<table class="view', page)
    assert len(tables) >= 2 and all(tables), tables  # the whole forward's and the modules'
    document["subject"]["name"] = "subject"
    unnamed = render_bench(document)
    spec = document["subject"]["spec"]
    assert f"<title>parity bench: {spec}</title>" in unnamed and "parity bench: subject<" not in unnamed


@pytest.mark.parametrize("low, high, scale, expected", [
    (0.0, 3.49e-3, 1e3, [0.0, 1.0, 2.0, 3.0]),            # ms: fifths of the range were 0.698, 1.4, 2.09, ...
    (0.1e-3, 0.2e-3, 1e3, [0.1, 0.12, 0.14, 0.16, 0.18, 0.2]),
    (1.23e-6, 9.9e-6, 1e6, [2.0, 4.0, 6.0, 8.0]),          # us, the first tick past the axis's start
    (5.0, 5.0, 1.0, [5.0]),                                # one timing: one tick
])
def test_the_strip_plots_axis_has_round_ticks(low, high, scale, expected):
    from parity.speed.pages import nice_ticks

    ticks = nice_ticks(low, high, scale)
    assert [round(t * scale, 9) for t in ticks] == expected
    assert all(low - 1e-15 <= t <= high + 1e-15 for t in ticks)
