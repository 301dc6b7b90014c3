"""``parity profile``: the accounting on synthetic events with known answers, a CPU run, the
importers on files written in the vendors' documented formats, and the side-by-side view."""
from __future__ import annotations

import sys
import json
import re
import warnings
from pathlib import Path

import pytest

from parity.cli.main import main
from parity.base.jsonformat import schema_for
from parity.speed.importers import NSYS, ROCPROF_V1, ROCPROFV3, import_profile, read_kernel_table
from parity.speed.profile import ProfileError, account, against, kernel_key

import speed_subjects
from speed_subjects import MATMUL_SPEC, cpu, gpu

import jsonschema  # a test dependency (pyproject's test extra): missing, the file errors, never skips


@pytest.fixture(autouse=True)
def single_cpu_thread():
    yield from speed_subjects.one_thread()
DATA = Path(__file__).parent / "data" / "profiles"


def synthetic_step(offset=0):
    """One step, as kineto reports it: <root> holds two layers' attention. An aten::linear's addmm
    launches a GEMM; attention's Triton kernel is launched by Python code inside each layer's
    range; an aten::copy_ outside every module launches a memcpy. Runtime calls carry the OS's
    thread id (99), not torch's (1), and, like the device events, link to the op or range that
    issued them. The device also reports a gpu_user_annotation span, which must not count."""
    o, c = offset, offset // 10  # correlation ids are unique over a profile
    return [
        cpu("ProfilerStep#3", "user_annotation", o + 0, 10_000, correlation=c + 500),
        cpu("parity/<root>", "user_annotation", o + 10, 8_000, correlation=c + 501),
        cpu("aten::linear", "cpu_op", o + 20, 500, correlation=c + 502),
        cpu("aten::addmm", "cpu_op", o + 30, 400, correlation=c + 503),
        cpu("cudaLaunchKernel", "cuda_runtime", o + 40, 50, correlation=c + 11, thread=99, linked=c + 503),
        cpu("parity/layers.0.attn", "user_annotation", o + 600, 2_000, correlation=c + 504),
        cpu("cuLaunchKernel", "cuda_driver", o + 700, 50, correlation=c + 12, thread=99, linked=c + 504),
        cpu("parity/layers.1.attn", "user_annotation", o + 3_000, 2_000, correlation=c + 505),
        cpu("cuLaunchKernel", "cuda_driver", o + 3_100, 50, correlation=c + 13, thread=99, linked=c + 505),
        cpu("aten::copy_", "cpu_op", o + 9_000, 100, correlation=c + 506),
        cpu("cudaMemcpyAsync", "cuda_runtime", o + 9_010, 50, correlation=c + 14, thread=99, linked=c + 506),
        gpu("gemm_kernel", "kernel", o + 100, 1_000, correlation=c + 11, linked=c + 503),
        gpu("attn_fwd", "kernel", o + 1_200, 3_000, correlation=c + 12, linked=c + 504),
        gpu("attn_fwd", "kernel", o + 4_300, 5_000, correlation=c + 13, linked=c + 505),
        gpu("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", o + 9_400, 1_000, correlation=c + 14, linked=c + 506),
        gpu("parity/<root>", "gpu_user_annotation", o + 100, 9_000, linked=c + 501),
    ]


def test_accounting_charges_device_time_to_the_innermost_module_once():
    result = account(synthetic_step())
    totals = result["totals"]
    assert totals["device_ns"] == 10_000  # 1000 + 3000 + 5000 + 1000; the annotation span is not counted
    assert totals["wall_ns"] == 10_000 and totals["steps"] == 1 and totals["events_per_step"] == [4]
    modules = {row["name"]: row for row in result["modules"]}
    assert modules["layers.*.attn"]["total_ns"] == 8_000 and modules["layers.*.attn"]["calls"] == 2
    assert modules["layers.*.attn"]["median_ns"] == 4_000 and modules["layers.*.attn"]["max_ns"] == 5_000
    assert modules["<root>"]["total_ns"] == 1_000
    assert modules["(outside modules)"]["total_ns"] == 1_000
    assert sum(row["share"] for row in result["modules"]) == pytest.approx(1.0)
    assert modules["layers.*.attn"]["share"] == pytest.approx(0.8)
    calls = {row["name"]: row for row in result["module_calls"]}
    assert calls["layers.1.attn"]["total_ns"] == 5_000
    assert calls["<root>"]["inclusive_ns"] == 9_000
    ops = {row["name"]: row["total_ns"] for row in result["ops"]}
    assert ops == {"aten::linear": 1_000, "(launched from Python)": 8_000, "aten::copy_": 1_000}  # not addmm too
    kernels = {row["name"]: row for row in result["kernels"]}
    assert set(kernels) == {"gemm_kernel", "attn_fwd", "Memcpy DtoH (Device -> Pinned)"}
    assert kernels["Memcpy DtoH (Device -> Pinned)"]["kind"] == "memcpy"
    assert kernels["attn_fwd"]["calls"] == 2 and kernels["attn_fwd"]["stddev_ns"] == pytest.approx(1414.2, abs=0.1)
    assert result["hot"] == {"module": "layers.*.attn", "share": pytest.approx(0.8), "amdahl_bound": pytest.approx(5.0)}
    assert result["warnings"] == []


def test_unattributed_device_time_and_uneven_steps_are_warned():
    second = [e for e in synthetic_step(offset=20_000) if not e.name.startswith("Memcpy")]  # no memcpy this step
    events = synthetic_step() + second + [gpu("orphan", "kernel", 20_500, 500, correlation=999)]
    result = account(events)
    assert result["totals"]["events_per_step"] == [4, 4]
    lost = {row["name"]: row for row in result["modules"]}["(unattributed)"]
    assert lost["total_ns"] == 500
    assert any("could not be traced" in warning for warning in result["warnings"])
    uneven = account(synthetic_step() + second)
    assert uneven["totals"]["events_per_step"] == [4, 3]
    assert any("differs between active steps" in warning for warning in uneven["warnings"])


def test_no_device_events_and_graphs_are_refused():
    only_cpu = [e for e in synthetic_step() if not e.on_device]
    with pytest.raises(ProfileError, match="no kernel, memcpy or memset"):
        account(only_cpu)
    graph = synthetic_step() + [cpu("cudaGraphLaunch", "cuda_runtime", 9_500, 20, correlation=77, thread=99,
                                    linked=500)]
    with pytest.raises(ProfileError, match="CUDA/HIP graph"):
        account(graph)


def test_cpu_accounting_uses_self_time():
    events = [cpu("ProfilerStep#0", "user_annotation", 0, 1_000), cpu("parity/<root>", "user_annotation", 0, 900),
              cpu("aten::linear", "cpu_op", 10, 500), cpu("aten::addmm", "cpu_op", 20, 400),
              cpu("parity/act", "user_annotation", 600, 200), cpu("aten::tanh", "cpu_op", 610, 100)]
    result = account(events, cpu_only=True)
    kernels = {row["name"]: row["total_ns"] for row in result["kernels"]}
    assert kernels == {"aten::linear": 100, "aten::addmm": 400, "aten::tanh": 100}
    ops = {row["name"]: row["total_ns"] for row in result["ops"]}
    assert ops == {"aten::linear": 500, "aten::tanh": 100}
    assert result["hot"]["module"] == "<root>" and result["hot"]["share"] == pytest.approx(500 / 600)


def test_profile_command_on_cpu(tmp_path, capsys):
    out, trace, page = tmp_path / "p.json", tmp_path / "trace.json", tmp_path / "p.html"
    status = main(["profile", "--quiet", "--subject", MATMUL_SPEC, "--impl", "reference", "--skip", "0",
                   "--warmup", "1", "--active", "2", "--json", str(out), "--trace", str(trace), "--html", str(page)])
    text = capsys.readouterr().out
    assert status == 0
    document = json.loads(out.read_text())
    jsonschema.validate(document, schema_for("parity-profile-report"))
    assert document["totals"]["steps"] == 2
    assert sum(row["share"] for row in document["modules"]) == pytest.approx(1.0)
    # Times are measured, so what is asserted is what does not depend on them: the ops each module
    # ran (per step, 32 chunk products and adds in proj, one tanh in act), and that the hot module
    # and its Amdahl bound are the report's own largest module share and 1 / (1 - share).
    ops = {row["name"]: row["calls"] for row in document["ops"]}
    assert (ops["aten::matmul"], ops["aten::add"], ops["aten::tanh"]) == (2 * 32, 2 * 32, 2)
    modules = {row["name"]: row for row in document["modules"]}
    assert set(modules) == {"<root>", "proj", "act"} and all(row["calls"] == 2 for row in modules.values())
    hot = max(modules.values(), key=lambda row: row["total_ns"])
    assert document["hot"]["module"] == hot["name"] and document["hot"]["share"] == hot["share"]
    assert document["hot"]["amdahl_bound"] == pytest.approx(1 / (1 - hot["share"]))
    assert f"hot module {hot['name']}" in text and "% wall" in text
    assert "traceEvents" in json.loads(trace.read_text())
    assert "<svg" in page.read_text()


def test_against_two_parity_profiles_is_by_module(tmp_path, capsys):
    # The other profile is a parity profile whose module times are known (a reference run's JSON,
    # its totals then set by hand); this run's are measured, so the rows are checked against both.
    other = tmp_path / "reference.json"
    assert main(["profile", "--quiet", "--subject", MATMUL_SPEC, "--impl", "reference", "--skip", "1", "--warmup", "1",
                 "--active", "6", "--json", str(other)]) == 0
    written = json.loads(other.read_text())
    known = {"proj": 3_200_000, "act": 100_000, "<root>": 0}
    for row in written["modules"]:
        row["total_ns"] = known[row["name"]]
        row["share"] = known[row["name"]] / sum(known.values())
    other.write_text(json.dumps(written))
    capsys.readouterr()
    # This run has 2 active steps, the other 6: b / a is of the times per step, not of the totals.
    assert main(["profile", "--quiet", "--subject", MATMUL_SPEC, "--impl", "fast", "--skip", "1", "--warmup", "1",
                 "--active", "2", "--against", str(other), "--json", str(tmp_path / "fast.json"),
                 "--html", str(tmp_path / "fast.html")]) == 0
    text = capsys.readouterr().out
    document = json.loads((tmp_path / "fast.json").read_text())
    jsonschema.validate(document, schema_for("parity-profile-report"))
    side = document["against"]
    assert (side["by"], side["compared"], side["a_steps"], side["b_steps"]) == ("module", "per step", 2, 6)
    mine = {row["name"]: row for row in document["modules"]}
    rows = {row["name"]: row for row in side["rows"]}
    assert set(rows) == {"proj", "act", "<root>"}
    for name in ("proj", "act"):  # a: this run, b: the other profile; the ratio is b / a
        assert rows[name]["a_ns"] == mine[name]["total_ns"] and rows[name]["b_ns"] == known[name]
        assert rows[name]["a_step_ns"] == mine[name]["total_ns"] / 2 and rows[name]["b_step_ns"] == known[name] / 6
        assert rows[name]["ratio"] == pytest.approx((known[name] / 6) / (mine[name]["total_ns"] / 2))
        assert (rows[name]["a_calls"], rows[name]["b_calls"]) == (2, 6)  # one call of each module per step
        assert rows[name]["call_ratio"] == pytest.approx(rows[name]["ratio"])
    assert not any("side by side" in warning for warning in document["warnings"])  # like for like: no warning
    assert re.search(r"side by side, by module, per step \(a: matmul fast on cpu, 2 steps; b: matmul reference on "
                     r"cpu, 6 steps\)", text)
    assert re.search(r"\| module +\| a \w+ per step +\| b \w+ per step +\| b / a +\| a \w+ per call", text)
    assert re.search(r"<th[^>]*>a \w+ per step</th><th[^>]*>b \w+ per step</th><th[^>]*>b / a</th>",
                     (tmp_path / "fast.html").read_text())
    assert rows["proj"]["b_share"] == pytest.approx(32 / 33)
    assert rows["<root>"]["ratio"] is None  # no time in this run: no ratio, not a division by zero
    assert side["b_label"].startswith("matmul") and "reference" in side["b_label"]


# nsys's totals, as written in both nsys files (ns in one, us with 3 decimals in the other).
EXPECTED_NS = {"sparse_attention_fwd_kernel": 728_432_117,
               "at::native::(anonymous namespace)::vectorized_layer_norm_kernel": 16_288_000}


@pytest.mark.parametrize("name, fmt, calls, first_total, has_median", [
    ("rocprofv3_kernel_stats.csv", ROCPROFV3, [80, 640, 160, 320], 851_200_000, False),
    ("rocprof_v1_results.stats.csv", ROCPROF_V1, [80, 640, 160, 320], 851_200_000, False),
    ("nsys_cuda_gpu_kern_sum.csv", NSYS, [80, 640, 160, 320], 728_432_117, True),
    ("nsys_stdout_usec.csv", NSYS, [80, 640, 160, 320], 728_432_117, True),
])
def test_importers_read_the_documented_formats(name, fmt, calls, first_total, has_median):
    detected, rows = read_kernel_table(DATA / name)
    assert detected == fmt
    assert [row["calls"] for row in rows] == calls
    assert rows[0]["total_ns"] == pytest.approx(first_total, rel=1e-9)
    assert (rows[0]["median_ns"] is not None) == has_median
    assert rows[2]["name"].count(",") >= 5 and rows[2]["name"].endswith(")" if fmt != ROCPROF_V1 else "[clone .kd]")
    document = import_profile(DATA / name)
    jsonschema.validate(document, schema_for("parity-profile-report"))
    assert document["kernels"][0]["share"] == pytest.approx(0.85, abs=0.001)
    assert sum(row["share"] for row in document["kernels"]) == pytest.approx(1.0)


def test_nsys_units_are_converted_to_ns():
    _, ns_rows = read_kernel_table(DATA / "nsys_cuda_gpu_kern_sum.csv")
    _, us_rows = read_kernel_table(DATA / "nsys_stdout_usec.csv")
    for rows in (ns_rows, us_rows):
        totals = {kernel_key(row["name"]): row["total_ns"] for row in rows}
        assert {key: totals[key] for key in EXPECTED_NS} == pytest.approx(EXPECTED_NS, abs=0.5001)
    for a, b in zip(ns_rows, us_rows):
        assert a["name"] == b["name"]
        for key in ("total_ns", "avg_ns", "median_ns", "min_ns", "max_ns"):
            assert b[key] == pytest.approx(a[key], abs=0.5001)  # the us file has 3 decimals: 0.5 ns


def test_kernel_keys_match_across_vendors():
    assert kernel_key("sparse_attention_fwd_kernel(float const*, int) [clone .kd]") == "sparse_attention_fwd_kernel"
    assert kernel_key("void at::native::vectorized_elementwise_kernel<(int)4, F<float>>(int, T2, T3)") == \
        "at::native::vectorized_elementwise_kernel"
    assert kernel_key("void at::native::(anonymous namespace)::ln_kernel<float, true>(int, float)") == \
        "at::native::(anonymous namespace)::ln_kernel"


def test_import_against_import_is_by_kernel(capsys):
    status = main(["profile", "--import", str(DATA / "nsys_cuda_gpu_kern_sum.csv"),
                   "--against", str(DATA / "rocprofv3_kernel_stats.csv"), "--json", "-"])
    document = json.loads(capsys.readouterr().out)
    jsonschema.validate(document, schema_for("parity-profile-report"))
    side = document["against"]
    assert status == 0 and side["by"] == "kernel"
    # Vendor tables have no step count: the totals of the two captures are compared as given, and said so.
    assert (side["compared"], side["a_steps"], side["b_steps"]) == ("total", None, None)
    assert [w for w in document["warnings"] if w.startswith("side by side: the step count of")] == [
        f"side by side: the step count of {DATA / 'nsys_cuda_gpu_kern_sum.csv'} and of "
        f"{DATA / 'rocprofv3_kernel_stats.csv'} is unknown, so b / a compares the totals of the two captures as "
        "given, which is like for like only if both captured the same work; b / a per call does not depend on it"]
    attention = next(r for r in document["against"]["rows"] if r["name"] == "sparse_attention_fwd_kernel")
    assert attention["ratio"] == pytest.approx(851_200_000 / 728_432_117)
    assert (attention["a_calls"], attention["b_calls"]) == (80, 80)
    assert attention["a_call_ns"] == pytest.approx(728_432_117 / 80)
    assert attention["call_ratio"] == pytest.approx((851_200_000 / 80) / (728_432_117 / 80))
    assert attention["a_step_ns"] is None and attention["b_step_ns"] is None
    assert main(["profile", "--import", str(DATA / "nsys_cuda_gpu_kern_sum.csv"),
                 "--against", str(DATA / "rocprofv3_kernel_stats.csv")]) == 0
    text = capsys.readouterr().out
    assert "side by side, by kernel, totals of the captures as given (a: " in text and "steps unknown" in text
    assert re.search(r"\| kernel +\| a \w+ total +\| b \w+ total +\| b / a +\| a \w+ per call", text)


def _module_rows(steps, rows):
    return {"totals": {"steps": steps}, "modules": [{"name": name, "total_ns": total, "share": share, "calls": calls}
                                                    for name, total, share, calls in rows]}


def test_against_compares_per_step_and_per_call_with_known_answers():
    # a: 2 steps, b: 10 steps. attn: 4000 ns a step in a, 2000 in b (b / a 0.5, where the totals
    # would say 2.5); mlp: 1000 and 2000 (b / a 2.0, the totals 10.0).
    a = _module_rows(2, [("attn", 8_000, 0.8, 4), ("mlp", 2_000, 0.2, 2)])
    b = _module_rows(10, [("attn", 20_000, 0.5, 20), ("mlp", 20_000, 0.5, 10), ("new", 0, 0.0, 10)])
    side = against(a, b, a_label="a", b_label="b")
    assert (side["by"], side["compared"], side["a_steps"], side["b_steps"]) == ("module", "per step", 2, 10)
    rows = {row["name"]: row for row in side["rows"]}
    assert rows["attn"] == {"name": "attn", "a_ns": 8_000, "b_ns": 20_000, "a_step_ns": 4_000, "b_step_ns": 2_000,
                            "ratio": 0.5, "a_calls": 4, "b_calls": 20, "a_call_ns": 2_000, "b_call_ns": 1_000,
                            "call_ratio": 0.5, "a_share": 0.8, "b_share": 0.5}
    assert (rows["mlp"]["ratio"], rows["mlp"]["call_ratio"]) == (2.0, 2.0)
    assert rows["new"]["ratio"] is None and rows["new"]["a_ns"] is None and rows["new"]["b_step_ns"] == 0
    assert [row["name"] for row in side["rows"]] == ["attn", "mlp", "new"]  # by the larger time per step
    # From the accounting itself: the same step once, and twice: the same per step (b / a 1), twice the total.
    one, two = account(synthetic_step()), account(synthetic_step() + synthetic_step(offset=20_000))
    rows = {row["name"]: row for row in against(one, two, a_label="one", b_label="two")["rows"]}
    assert rows["layers.*.attn"]["b_ns"] / rows["layers.*.attn"]["a_ns"] == 2.0
    assert rows["layers.*.attn"]["ratio"] == 1.0 and rows["layers.*.attn"]["call_ratio"] == 1.0
    assert rows["(outside modules)"]["ratio"] == 1.0


def test_against_with_one_step_count_unknown_compares_totals_and_warns(tmp_path, capsys):
    # b, a parity profile's JSON with a step count (10), against an imported table (no steps): the
    # totals are compared as given, and the warning names the side whose steps are unknown.
    other = import_profile(DATA / "rocprofv3_kernel_stats.csv")
    other["totals"]["steps"] = 10
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert main(["profile", "--import", str(DATA / "nsys_cuda_gpu_kern_sum.csv"), "--against",
                 str(tmp_path / "other.json"), "--json", "-"]) == 0
    document = json.loads(capsys.readouterr().out)
    side = document["against"]
    assert (side["compared"], side["a_steps"], side["b_steps"]) == ("total", None, 10)
    attention = next(r for r in side["rows"] if r["name"] == "sparse_attention_fwd_kernel")
    assert attention["ratio"] == pytest.approx(851_200_000 / 728_432_117) and attention["b_step_ns"] == 85_120_000
    assert any(w.startswith(f"side by side: the step count of {DATA / 'nsys_cuda_gpu_kern_sum.csv'} is unknown, so")
               for w in document["warnings"])


@pytest.mark.parametrize("content, message", [
    ('"Name","Calls","TotalDurationNs","AverageNs","Percentage","MinNs","MaxNs","StdDev"\n'
     'void kernel<4, float>(int),10,1000,100,100,90,110,5\n', "unquoted comma"),
    ('"Name","Calls","TotalDurationNs","AverageNs","Percentage"\n', "no kernel rows"),
    ("a,b,c\n1,2,3\n", "no header of a known kernel summary"),
    ('"Name","Calls","TotalDurationNs","AverageNs","Percentage"\n"k",ten,100,10,100\n', "not a number"),
    ("Time (%),Total Time (fortnights),Instances,Name\n1,2,3,k\n", "unknown time unit"),
])
def test_bad_imports_are_exit_2(tmp_path, capsys, content, message):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    assert main(["profile", "--import", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_profile_refusals(tmp_path, capsys):
    assert main(["profile", "--subject", MATMUL_SPEC, "--impl", "nope", "--quiet"]) == 2
    assert "no implementation 'nope'" in capsys.readouterr().err
    assert main(["profile", "--subject", MATMUL_SPEC, "--active", "0", "--quiet"]) == 2
    assert "--active" in capsys.readouterr().err
    assert main(["profile", "--import", str(DATA / "nsys_cuda_gpu_kern_sum.csv"), "--trace", str(tmp_path / "t")]) == 2
    assert "--trace needs a run" in capsys.readouterr().err


def test_a_device_event_without_a_link_is_placed_through_its_runtime_call():
    events = synthetic_step() + [cpu("cuLaunchKernel", "cuda_driver", 800, 20, correlation=42, thread=99, linked=504),
                                 gpu("late_kernel", "kernel", 9_600, 200, correlation=42)]
    calls = {row["name"]: row["total_ns"] for row in account(events)["module_calls"]}
    assert calls["layers.0.attn"] == 3_200  # attn_fwd (3000) and the kernel whose launch links to that range


@pytest.mark.parametrize("argv, message", [
    (["--import", "{tmp}"], "--import {tmp}: is a directory, not a kernel summary CSV file"),
    (["--import", "{tmp}/missing.csv"], "--import {tmp}/missing.csv: no such file"),
    (["--import", str(DATA / "nsys_cuda_gpu_kern_sum.csv"), "--against", "{tmp}/bad.csv"],
     "--against {tmp}/bad.csv: no header of a known kernel summary"),
    (["--import", str(DATA / "nsys_cuda_gpu_kern_sum.csv"), "--against", "{tmp}/bad.json"],
     "--against {tmp}/bad.json: not a JSON document"),
    (["--import", str(DATA / "nsys_cuda_gpu_kern_sum.csv"), "--against", "{tmp}/other.json"],
     "--against {tmp}/other.json: not a parity profile"),
    (["--import", str(DATA / "nsys_cuda_gpu_kern_sum.csv"), "--against", "{tmp}/dir.json"],
     "--against {tmp}/dir.json: is a directory, not a profile JSON file"),
    (["--subject", "no_such_module:factory"], "no_such_module"),
    (["--subject", MATMUL_SPEC, "--rows", "-1"], "--rows must be 0 (all) or more"),
    (["--import", str(DATA / "nsys_cuda_gpu_kern_sum.csv"), "--set", "dim=3"], "--set applies to --subject"),
])
def test_unusable_input_is_exit_2_with_one_line(tmp_path, capsys, argv, message):
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"format": "parity-compare-report"}')
    (tmp_path / "dir.json").mkdir()
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    assert main(["profile", "--quiet", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("parity: error: ")
    assert message.replace("{tmp}", str(tmp_path)) in err[0]


def _valid_other():
    """A valid --against document: an imported kernel table, with a module row added."""
    document = import_profile(DATA / "nsys_cuda_gpu_kern_sum.csv")
    document["modules"] = [{"name": "attn", "calls": 2, "total_ns": 10.0, "avg_ns": 5.0, "median_ns": 5.0,
                            "min_ns": 4.0, "max_ns": 6.0, "stddev_ns": 1.0, "share": 1.0, "wall_share": None}]
    return document


def _set(path, value):
    """A change to the valid document: ``value`` at ``path`` (keys and indices); a value DELETE removes it."""
    def change(document):
        *parents, last = path
        for key in parents:
            document = document[key]
        if value is DELETE:
            del document[last]
        else:
            document[last] = value
    return change


DELETE = object()


@pytest.mark.parametrize("change, message", [
    (_set(["kernels"], "abc"), 'kernels must be an array, got "abc"'),
    (_set(["kernels"], [1, 2]), "kernels[0] must be an object, got 1"),
    (_set(["kernels", 2, "name"], DELETE), "kernels[2].name is missing"),
    (_set(["kernels", 1, "total_ns"], DELETE), "kernels[1].total_ns is missing"),
    (_set(["kernels", 0, "share"], DELETE), "kernels[0].share is missing"),
    (_set(["kernels", 3, "total_ns"], "abc"), 'kernels[3].total_ns must be a finite number >= 0, got "abc"'),
    (_set(["kernels", 3, "total_ns"], None), "kernels[3].total_ns must be a finite number >= 0, got null"),
    (_set(["kernels", 3, "total_ns"], -1), "kernels[3].total_ns must be a finite number >= 0, got -1"),
    (_set(["kernels", 3, "total_ns"], "nan"), 'kernels[3].total_ns must be a finite number >= 0, got "nan"'),
    (_set(["kernels", 3, "total_ns"], "inf"), 'kernels[3].total_ns must be a finite number >= 0, got "inf"'),
    (_set(["kernels", 3, "total_ns"], True), "kernels[3].total_ns must be a finite number >= 0, got true"),
    (_set(["kernels", 3, "total_ns"], 10**400), "kernels[3].total_ns must be at most 10^18 ns (31 years), got 1000"),
    (_set(["kernels", 3, "total_ns"], 1e300), "kernels[3].total_ns must be at most 10^18 ns (31 years), got 1e+300"),
    (_set(["kernels", 0, "share"], {}), "kernels[0].share must be a number from 0 to 1, got an object"),
    (_set(["kernels", 0, "share"], 1.5), "kernels[0].share must be a number from 0 to 1, got 1.5"),
    (_set(["kernels", 0, "calls"], 2.5), "kernels[0].calls must be a whole number >= 0, got 2.5"),
    (_set(["kernels", 0, "calls"], 1e300), "kernels[0].calls must be at most 10^12, got 1e+300"),
    (_set(["kernels", 0, "name"], 5), "kernels[0].name must be a string, got 5"),
    (_set(["kernels", 0, "name"], ["k"]), "kernels[0].name must be a string, got an array"),
    (_set(["modules", 0, "total_ns"], DELETE), "modules[0].total_ns is missing"),
    (_set(["modules", 0, "name"], DELETE), "modules[0].name is missing"),
    (_set(["modules"], None), "modules must be an array, got null"),
    (_set(["subject"], "decoder"), 'subject must be an object or null, got "decoder"'),
    (_set(["subject"], {"name": 3}), "subject.name must be a string or null, got 3"),
    (_set(["impl"], ["x"]), "impl must be a string or null, got an array"),
    (_set(["settings"], "x"), 'settings must be an object, got "x"'),
    (_set(["settings", "file"], 1), "settings.file must be a string or null, got 1"),
    (_set(["totals"], None), "totals must be an object, got null"),
    (_set(["totals", "steps"], 0), "totals.steps must be a whole number from 1 to 10^12 or null, got 0"),
    (_set(["totals", "steps"], True), "totals.steps must be a whole number from 1 to 10^12 or null, got true"),
    (_set(["totals", "steps"], 2.0), "totals.steps must be a whole number from 1 to 10^12 or null, got 2.0"),
    (_set(["version"], True), "profile version true, this parity reads 1"),
    (_set(["version"], 1.0), "profile version 1.0, this parity reads 1"),
])
def test_a_malformed_against_profile_is_exit_2_naming_the_field(tmp_path, capsys, change, message):
    document = _valid_other()
    change(document)
    other = tmp_path / "other.json"
    other.write_text(json.dumps(document))
    status = main(["profile", "--import", str(DATA / "rocprofv3_kernel_stats.csv"), "--against", str(other)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1
    assert err[0].startswith(f"parity: error: --against {other}: {message}")


@pytest.mark.parametrize("text, message", [
    ('{"format": "parity-profile-report", "version": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
     "not a JSON document: nested too deeply"),
    ("[" * 100_000 + "]" * 100_000, "not a JSON document: nested too deeply"),
    (None, "kernels[0].total_ns must be at most 10^18 ns (31 years), got Infinity"),  # 1e400: inf once parsed
    ("NaN", "kernels[0].total_ns must be a finite number >= 0, got NaN"),
])
def test_against_json_text_that_parses_badly_is_exit_2(tmp_path, capsys, text, message):
    other = tmp_path / "other.json"
    valid = json.dumps(_valid_other())
    total = json.dumps(_valid_other()["kernels"][0]["total_ns"])
    if text is None or text == "NaN":
        text = valid.replace(f'"total_ns": {total}', f'"total_ns": {text or "1e400"}', 1)
    other.write_text(text)
    status = main(["profile", "--import", str(DATA / "rocprofv3_kernel_stats.csv"), "--against", str(other)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and err == [f"parity: error: --against {other}: {message}"]


def test_a_valid_against_profile_is_read():
    assert main(["profile", "--quiet", "--import", str(DATA / "rocprofv3_kernel_stats.csv"), "--against",
                 str(DATA / "nsys_cuda_gpu_kern_sum.csv")]) == 0


_ROCPROFV3_HEADER = '"Name","Calls","TotalDurationNs","AverageNs","Percentage","MinNs","MaxNs","StdDev"\n'


@pytest.mark.parametrize("content, message", [
    (_ROCPROFV3_HEADER + '"a",1,1e308,1,50,1,1,0\n"b",1,1e308,1,50,1,1,0\n',
     "{path} line 2: TotalDurationNs '1e308' must be at most 10^18 ns (31 years)"),
    (_ROCPROFV3_HEADER + '"a",1,inf,1,50,1,1,0\n', "{path} line 2: TotalDurationNs 'inf' must be at most 10^18 ns (31 years)"),
    (_ROCPROFV3_HEADER + '"a",1,-5,1,50,1,1,0\n', "{path} line 2: TotalDurationNs '-5' must be a finite number >= 0"),
    (_ROCPROFV3_HEADER + '"a",1e300,100,1,50,1,1,0\n', "{path} line 2: Calls '1e300' must be at most 10^12"),
    (_ROCPROFV3_HEADER + '"a",2.5,100,1,50,1,1,0\n', "{path} line 2: Calls '2.5' must be a whole number >= 0"),
    ("Time (%),Total Time (fortnights),Instances,Name\n1,2,3,k\n",
     "{path} line 1: unknown time unit 'fortnights' in column 'Total Time (fortnights)' (known: ns, us, ms, s)"),
    ('"Name","Calls","TotalDurationNs","AverageNs","Percentage","Name"\n"a",1,100,1,50,"b"\n',
     "{path} line 1: the header has two name columns ('Name' and 'Name')"),
    ("Time (%),Total Time (ns),Total Time (us),Instances,Name\n1,2,3,4,k\n",
     "{path} line 1: the header has two total columns ('Total Time (ns)' and 'Total Time (us)')"),
    (_ROCPROFV3_HEADER + '"a,1,100,1,50,1,1,0\n"b",1,100,1,50,1,1,0\n',
     "{path} line 2: unterminated quote (the quoted field runs on to line 3)"),
    (_ROCPROFV3_HEADER + '"b",1,100,1,50,1,1,0\n"a,1,100,1,50,1,1,0\n',
     "{path} line 3: unterminated quote (the quoted field runs to the end of the file)"),
    (_ROCPROFV3_HEADER + '"a"x,1,100,1,50,1,1,0\n', "{path} line 2: not valid CSV: ',' expected after '\"'"),
])
def test_bad_import_values_are_exit_2_naming_file_line_and_column(tmp_path, capsys, content, message):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    assert main(["profile", "--import", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"parity: error: --import {message.replace('{path}', str(path))}"]


def test_a_kernel_name_longer_than_the_csv_field_limit_is_read(tmp_path, capsys):
    name = "k" * 200_000 + "(float const*)"
    path = tmp_path / "long.csv"
    path.write_text(_ROCPROFV3_HEADER + f'"{name}",3,300,100,100,90,110,5\n"short",1,100,100,100,100,100,0\n')
    _, rows = read_kernel_table(path)
    assert [row["name"] for row in rows] == [name, "short"] and rows[0]["total_ns"] == 300
    assert main(["profile", "--import", str(path), "--against", str(path)]) == 0
    text = capsys.readouterr().out
    assert max(len(line) for line in text.splitlines() if line.startswith("|")) < 300  # the name shortened


def test_profile_with_warmup_0_warns_nothing_of_torch(capsys, monkeypatch):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["profile", "--quiet", "--subject", MATMUL_SPEC, "--skip", "0", "--warmup", "0",
                     "--active", "1"]) == 0
    assert [str(w.message) for w in caught] == []
    assert "warmup" not in capsys.readouterr().err
    # Only torch's warmup advice is silenced: any other warning of the schedule still reaches the user.
    from parity.speed import profile

    def schedule(**kwargs):
        warnings.warn("Profiler won't be using warmup, this can skew profiler results", UserWarning)
        warnings.warn("some other problem of the schedule", UserWarning)
        return lambda step: None

    monkeypatch.setattr(profile, "schedule", schedule)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile._schedule(0, 0, 1)
    assert [str(w.message) for w in caught] == ["some other problem of the schedule"]


def test_the_profilers_usdt_lines_stay_off_the_terminal(capfd):
    # Kineto writes "USDT:... profiler_start/stop" to descriptor 2 from C++ at each profiler run.
    import os

    from parity.speed.quiet import profiler_chatter_filtered

    with profiler_chatter_filtered():
        os.write(2, b"USDT:2026-01-01 00:00:00 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a line of the run's own\n")
        print("parity profile: python's stderr too", file=sys.stderr)
    # (in order on a real stderr; under capfd Python's stderr is captured apart from descriptor 2)
    assert sorted(capfd.readouterr().err.splitlines()) == ["a line of the run's own",
                                                           "parity profile: python's stderr too"]
    status = main(["profile", "--subject", MATMUL_SPEC, "--impl", "reference", "--skip", "0", "--warmup", "1",
                   "--active", "1"])
    err = capfd.readouterr().err
    assert status == 0 and "USDT" not in err and "profiler_start" not in err
    assert "parity profile: " in err  # the command's own progress still comes through
