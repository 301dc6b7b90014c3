"""bench/h200_run.sh, the one call a device session spends, dry-run on CPU with a stand-in for
Python that records its arguments: the steps asked for run with the arguments given, the others
do not, and the results archive carries every step's status. (The device runs are costly and
rare; a typo here would waste one.)"""
import json
import os
import re
import stat
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _dry_run(tmp_path, env_extra):
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    # Records its arguments; as the table benchmark, writes its --json file; as --pick, prints a choice.
    fake.write_text(f"""#!/bin/sh
echo "$*" >> {calls}
echo "$PWD $PYTHONPATH" > {tmp_path / "where.txt"}
case "$*" in
  "-c import "*) case " ${{FAKE_LACKS:-}} " in *" ${{2#import }} "*) exit 1 ;; esac ;;
  *"--pick "*) echo "--config d64:block_n=128,num_warps=8" ;;
  *benchmark_table*--json*) prev=""; for a in "$@"; do [ "$prev" = "--json" ] && echo '{{}}' > "$a"; prev="$a"; done ;;
esac
exit 0
""")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": str(fake), "OUT": str(out), "PATH": os.environ["PATH"], **env_extra}
    proc = subprocess.run(["bash", "bench/h200_run.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    with tarfile.open(out / "results.tgz") as tar:
        status = tar.extractfile("r/status.txt").read().decode()
    return calls.read_text().splitlines(), status


def test_table_step_runs_with_its_arguments(tmp_path):
    calls, status = _dry_run(tmp_path, {"STEPS": "table",
                                        "TABLE_ARGS": "--cases d64-s4k-causal,d128-s4k-causal --repeats 3 "
                                                      "--config d64:block_n=128"})
    table = [c for c in calls if "benchmark_table" in c]
    assert len(table) == 1
    assert table[0].startswith("-m bench.benchmark_table --json ")
    assert table[0].endswith("table.json --cases d64-s4k-causal,d128-s4k-causal --repeats 3 --config d64:block_n=128")
    assert not [c for c in calls if "benchmark_decode" in c or "pytest" in c]  # steps not asked for
    assert [line.split()[:2] for line in status.splitlines()] == [["install", "rc=0"], ["table", "rc=0"]]


def test_the_lab_runs_from_the_checkout_wherever_the_script_is_called(tmp_path):
    """bench/ is not installed: the script makes the checkout's root the working directory and puts
    it first on PYTHONPATH, so ``python -m bench.benchmark_table`` resolves to this checkout's lab."""
    _dry_run(tmp_path, {"STEPS": "table", "PYTHONPATH": "/elsewhere"})
    cwd, pythonpath = (tmp_path / "where.txt").read_text().split()
    assert Path(cwd).resolve() == REPO
    assert [Path(p).resolve() for p in pythonpath.split(":")] == [REPO, Path("/elsewhere").resolve()]


def test_decode_and_gpu_tests_steps(tmp_path):
    calls, status = _dry_run(tmp_path, {"STEPS": "decode gpu-tests", "DECODE_ARGS": "--threshold",
                                        "GPU_TESTS": "tests/test_kernels_decode.py tests/test_kernels_op.py"})
    decode = next(c for c in calls if "benchmark_decode" in c)
    assert decode.endswith("decode.json --threshold")
    tests = next(c for c in calls if c.startswith("-m pytest -m gpu"))
    assert tests.endswith("tests/test_kernels_decode.py tests/test_kernels_op.py")
    assert not [c for c in calls if "benchmark_table" in c]
    assert [line.split()[0] for line in status.splitlines()] == ["install", "decode", "gpu-tests"]


def test_gpu_tests_leave_out_the_modules_a_host_without_the_test_extra_cannot_import(tmp_path):
    calls, _ = _dry_run(tmp_path, {"STEPS": "gpu-tests", "FAKE_LACKS": "jsonschema xmlschema transformers"})
    tests = next(c for c in calls if c.startswith("-m pytest -m gpu")).split()
    ignored = {arg.removeprefix("--ignore=") for arg in tests if arg.startswith("--ignore=")}
    assert {"tests/test_report_json_schemas.py", "tests/test_report_junit.py", "tests/test_speed_bench.py",
            "tests/test_integrations_transformers.py", "tests/test_bench_harness.py",
            # these import the schema test's validator, so they import jsonschema through it
            "tests/test_run_repeats.py", "tests/test_run_seeds.py", "tests/test_judge_structure.py"} <= ignored
    for module in ignored:  # none of them holds a GPU test, and each imports a test-only dependency at the top
        text = (REPO / module).read_text()
        assert "mark.gpu" not in text and "pytestmark" not in text
        assert any(f"\nimport {dep}" in text or f"\nfrom {dep} " in text
                   for dep in ("jsonschema", "xmlschema", "transformers", "test_report_json_schemas"))
    (tmp_path / "with").mkdir()
    calls, _ = _dry_run(tmp_path / "with", {"STEPS": "gpu-tests"})
    assert "--ignore" not in next(c for c in calls if c.startswith("-m pytest -m gpu"))
    # one package missing: only the modules that import it are left out
    (tmp_path / "one").mkdir()
    calls, _ = _dry_run(tmp_path / "one", {"STEPS": "gpu-tests", "FAKE_LACKS": "xmlschema"})
    tests = next(c for c in calls if c.startswith("-m pytest -m gpu")).split()
    assert [arg for arg in tests if arg.startswith("--ignore=")] == ["--ignore=tests/test_report_junit.py"]


def test_warp_specialize_probe_verdicts(monkeypatch):
    """The probe's verdict logic on stand-in compile results (the real compile is
    ``python -m bench.probe_warp_specialize``, recorded in bench/BENCHMARK.md)."""
    from bench import probe_warp_specialize as probe

    answers = {(False, 4): {"ptx_sha256": "a"}, (True, 4): {"status": "aborted", "detail": "Assertion `false'"},
               (False, 8): {"ptx_sha256": "b"}, (True, 8): {"ptx_sha256": "b"},
               (False, 16): {"ptx_sha256": "c"}, (True, 16): {"ptx_sha256": "d"}}
    monkeypatch.setattr(probe, "_compile", lambda ws, warps: answers[(ws, warps)])
    rows = probe.probe([4, 8, 16])
    assert [(r["num_warps"], r["verdict"]) for r in rows] == [(4, "aborted"), (8, "same code"), (16, "specialized")]
    assert rows[0]["detail"] == "Assertion `false'"


def test_sweep_then_table_with_the_pick(tmp_path):
    calls, status = _dry_run(tmp_path, {"STEPS": "table-sweep table", "TABLE_ARGS": "--repeats 5",
                                        "SWEEP_CASES": "d64-s4k-causal", "SWEEP_ARGS": "--config d64:block_n=128"})
    sweep = next(c for c in calls if "sweep.json" in c and "--pick" not in c)
    assert sweep.endswith("sweep.json --repeats 3 --cases d64-s4k-causal --config d64:block_n=128")
    assert any(c.startswith("-m bench.benchmark_table --pick ") for c in calls)
    table = next(c for c in calls if "table.json" in c)
    assert table.endswith("table.json --repeats 5 --config d64:block_n=128,num_warps=8")  # the pick, appended
    assert [line.split()[0] for line in status.splitlines()] == ["install", "table-sweep", "table"]


def test_default_sweep_names_real_cases_and_fields():
    """The default SWEEP_CASES and SWEEP_ARGS of h200_run.sh parse as the table benchmark reads
    them: a typo would cost a device call."""
    import shlex

    from bench import benchmark_table

    text = (REPO / "bench" / "h200_run.sh").read_text()
    cases = re.search(r'SWEEP_CASES=\$\{SWEEP_CASES:-([^}]*)\}', text).group(1).split(",")
    assert set(cases) <= {c.name for c in benchmark_table.CASES} and len(cases) == 6
    args = shlex.split(re.search(r'SWEEP_ARGS=\$\{SWEEP_ARGS:-"(.*?)"\}', text, re.S).group(1).replace("\\\n", " "))
    specs = [args[i + 1] for i, a in enumerate(args) if a == "--config"]
    assert len(specs) == args.count("--config") == 6
    parsed = [benchmark_table.parse_variant(spec) for spec in specs]  # raises on a bad key or value
    assert {head for head, _ in parsed} == {64, 128}


def test_launch_time_and_ncu_steps(tmp_path):
    ncu = tmp_path / "ncu"  # a stand-in for Nsight Compute that records its arguments too
    ncu.write_text(f"#!/bin/sh\necho \"ncu $*\" >> {tmp_path / 'calls.txt'}\n")
    ncu.chmod(ncu.stat().st_mode | stat.S_IEXEC)
    calls, status = _dry_run(tmp_path, {"STEPS": "launch-time host-parts ncu", "NCU": str(ncu),
                                        "LAUNCH_CASES": "d64-s4k-causal", "NCU_CASES": "d128-s16k-causal"})
    assert "-m bench.launch_time --cases d64-s4k-causal" in calls
    assert "-m bench.launch_time --host-parts --cases d64-s4k-causal" in calls
    profiled = next(c for c in calls if c.startswith("ncu "))
    assert profiled.startswith("ncu --clock-control none --profile-from-start off --section SpeedOfLight")
    assert "--section ComputeWorkloadAnalysis --csv --page details " in profiled  # nothing more unless asked
    assert profiled.endswith("-m bench.launch_time --ncu-target --cases d128-s16k-causal")
    assert [line.split()[:2] for line in status.splitlines()] == [["install", "rc=0"], ["launch-time", "rc=0"],
                                                                   ["host-parts", "rc=0"], ["ncu", "rc=0"]]


def test_ncu_step_takes_more_sections_metrics_and_a_limit(tmp_path):
    ncu = tmp_path / "ncu"
    ncu.write_text(f"#!/bin/sh\necho \"ncu $*\" >> {tmp_path / 'calls.txt'}\nsleep 3\n")
    ncu.chmod(ncu.stat().st_mode | stat.S_IEXEC)
    calls, status = _dry_run(tmp_path, {"STEPS": "ncu", "NCU": str(ncu), "NCU_CASES": "d128-s16k-documents",
                                        "NCU_SECTIONS": "WarpStateStats InstructionStats", "NCU_LIMIT": "1",
                                        "NCU_METRICS": "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"})
    profiled = next(c for c in calls if c.startswith("ncu "))
    assert ("--section ComputeWorkloadAnalysis --section WarpStateStats --section InstructionStats "
            "--metrics sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active --csv --page details") in profiled
    assert status.splitlines()[-1].split()[:2] == ["ncu", "rc=124"]  # NCU_LIMIT=1 cut the 3 s stand-in short


def test_launch_time_arguments_are_checked_before_the_gpu(capsys):
    from bench import launch_time

    assert launch_time.main(["--cases", "d64-s4k-causal,nope"]) == 2
    assert capsys.readouterr().err.startswith("launch_time: unknown case 'nope'; the cases: d128-s4k-causal")
    assert launch_time.main([]) == 2
    assert capsys.readouterr().err == "launch_time: --cases: name at least one case\n"


def test_host_parts_runs_without_a_gpu(capsys):
    """``--host-parts`` times the Python parts of a call on any device (here the CPU, against the
    sm_90 pins); its argument errors are one line."""
    import torch

    from bench import benchmark_table, launch_time

    rows = launch_time.host_parts(benchmark_table.cases_named("d64-s4k-window1024"), torch.device("cpu"), calls=5)
    assert [(r["case"], r["arch"], r["runtime_arguments"]) for r in rows] == [("d64-s4k-window1024", "sm_90", 61)]
    assert rows[0]["torch"] == torch.__version__ and rows[0]["python"].count(".") == 2
    assert set(rows[0]["us_per_call"]) == {"checks", "config", "build_launch", "triton_binder", "launch_key",
                                              "cached_hit"}
    assert all(us > 0 for us in rows[0]["us_per_call"].values())
    assert json.loads(capsys.readouterr().out) == rows[0]
    assert launch_time.main(["--host-parts", "--cases", "d64-s4k-causal", "--device", "gpu"]) == 2
    assert capsys.readouterr().err == "launch_time: --device must be cpu or cuda, got 'gpu'\n"
    assert launch_time.main(["--host-parts", "--cases", "nope"]) == 2
    assert capsys.readouterr().err.startswith("launch_time: unknown case 'nope'")


def test_launch_time_summary_says_what_bounds_each_call():
    from bench.launch_time import summary

    rows = [{"case": "c", "impl": "ours", "call_ms": [0.40, 0.41, 0.39], "graph_ms": [0.16, 0.15, 0.16],
             "host_ms": [0.25, 0.24, 0.26]},
            {"case": "c", "impl": "theirs", "call_ms": [0.16, 0.17, 0.16], "graph_ms": [0.16, 0.16, 0.15],
             "host_ms": [0.10, 0.09, 0.10]},
            {"case": "c", "impl": "no graph", "call_ms": [1.0, 1.0, 1.0], "graph_error": "RuntimeError: x",
             "host_ms": [0.1, 0.1, 0.1]}]
    assert summary(rows) == [
        {"case": "c", "impl": "ours", "call_ms": 0.40, "graph_ms": 0.16, "host_ms": 0.25, "bound": "host"},
        {"case": "c", "impl": "theirs", "call_ms": 0.16, "graph_ms": 0.16, "host_ms": 0.10, "bound": "device"},
        {"case": "c", "impl": "no graph", "call_ms": 1.0, "host_ms": 0.1, "bound": None}]


def _plan_calls() -> list[dict[str, str]]:
    """The environment of each ``bash bench/h200_run.sh`` call in bench/BENCHMARK.md's plan for
    the next device session (the code block whose first line is ``# call 1: ...``)."""
    import shlex

    text = (REPO / "bench" / "BENCHMARK.md").read_text()
    block = re.search(r"```sh\n(# call 1:.*?)```", text, re.S).group(1)
    calls = []
    for command in re.split(r"\n(?=# call )", block):
        words = shlex.split(command.replace("\\\n", " "), comments=True)
        at = words.index("bash")
        assert words[at + 1] == "bench/h200_run.sh", words
        calls.append(dict(word.split("=", 1) for word in words[:at]))
    return calls


def _step_limits(env: dict[str, str]) -> dict[str, int]:
    """Each step's time limit in h200_run.sh as ``env`` sets it (``step NAME LIMIT ...``)."""
    limits = {}
    for name, limit in re.findall(r'^\s*step ([\w-]+) ("?\$\{\w+:-\d+\}"?|\d+) ', (REPO / "bench" / "h200_run.sh")
                                  .read_text(), re.M):
        variable = re.match(r'"?\$\{(\w+):-(\d+)\}"?', limit)
        limits[name] = int(env.get(variable.group(1), variable.group(2))) if variable else int(limit)
    return limits


def test_the_plan_for_the_next_device_session_fits_and_parses(tmp_path):
    """Every call of BENCHMARK's plan: its steps exist and run in a dry run, their limits and the
    install's add up to at most the 600 s a device command may run, and its cases and config
    variants are ones the table benchmark accepts (a typo or an overrun would cost a device call)."""
    from bench import benchmark_table

    calls = _plan_calls()
    assert len(calls) >= 1
    names = {case.name for case in benchmark_table.CASES}
    flags = {key: set(re.findall(r'add_argument\("(--[\w-]+)"', (REPO / "bench" / module).read_text()))
             for key, module in (("SWEEP_ARGS", "benchmark_table.py"), ("TABLE_ARGS", "benchmark_table.py"),
                                 ("DECODE_ARGS", "benchmark_decode.py"))}
    for index, env in enumerate(calls):
        steps = env["STEPS"].split()
        limits = _step_limits(env)
        assert set(steps) <= set(limits), steps
        assert limits["install"] + sum(limits[step] for step in steps) <= 600, (env, limits)
        for key in ("SWEEP_CASES", "LAUNCH_CASES", "NCU_CASES"):
            if key in env:
                assert set(env[key].split(",")) <= names, env[key]
        for key, known in flags.items():  # a flag the benchmark no longer has would end the step at once
            assert {word for word in env.get(key, "").split() if word.startswith("--")} <= known, (key, env[key])
        for key in ("SWEEP_ARGS", "TABLE_ARGS"):
            words = env.get(key, "").split()
            for spec in (words[i + 1] for i, word in enumerate(words) if word == "--config"):
                benchmark_table.parse_variant(spec)  # raises on a bad key or value
        (tmp_path / str(index)).mkdir()
        _, status = _dry_run(tmp_path / str(index), env)
        ran = [line.split()[0] for line in status.splitlines()]
        assert ran[0] == "install" and sorted(ran[1:]) == sorted(steps), (ran, steps)


def test_capture_scale_step_runs_the_gpu_measurement_within_its_limit(tmp_path):
    calls, status = _dry_run(tmp_path, {"STEPS": "capture-scale", "CAPTURE_SCALE_ARGS": "--seq 4096 --sizes 8b,10b",
                                        "CAPTURE_SCALE_LIMIT": "400"})
    (call,) = [line for line in calls if "capture_scale_gpu" in line]
    words = call.split()
    assert words[:2] == ["-m", "bench.capture_scale_gpu"]
    assert words[words.index("--out") + 1].endswith("/r/capture-scale")
    assert words[words.index("--deadline-s") + 1] == "380"  # the step's limit less the JSON's last write
    assert words[-4:] == ["--seq", "4096", "--sizes", "8b,10b"]
    assert [line.split()[0] for line in status.splitlines()] == ["install", "capture-scale"]
    assert _step_limits({})["capture-scale"] + _step_limits({})["install"] <= 600


def test_hf_bench_step_runs_parity_bench_of_the_hf_subject(tmp_path):
    calls, status = _dry_run(tmp_path, {"STEPS": "hf-bench"})
    bench = [c for c in calls if c.startswith("-m parity bench")]
    assert len(bench) == 1
    words = bench[0].split()
    assert words[words.index("--subject") + 1] == "bench.hf_subject:make_subject"
    assert words[words.index("--impls") + 1] == "sdpa,parity_sdpa,parity_sparse"
    assert words[words.index("--device") + 1] == "cuda"
    assert words[words.index("--json") + 1].endswith("/hf-bench.json")
    assert bench[0].endswith("--set size=llama8b --set seq=4096 --set batch=1 --warmup 2 --reps 5 "
                             "--module model.layers.*.self_attn")
    assert [line.split()[:2] for line in status.splitlines()] == [["install", "rc=0"], ["hf-bench", "rc=0"]]
    (tmp_path / "args").mkdir()
    calls, _ = _dry_run(tmp_path / "args", {"STEPS": "hf-bench", "HF_BENCH_ARGS": "--set size=tiny --reps 3"})
    assert next(c for c in calls if c.startswith("-m parity bench")).endswith("--set size=tiny --reps 3")


def test_hf_bench_step_default_arguments_are_ones_the_cli_and_the_subject_take():
    """The step's default command parses as ``parity bench`` and its --set values make the subject
    (a typo would end the step at once, after the device's start-up)."""
    from parity.base.overrides import json_value, parse_overrides
    from parity.cli.main import build_parser
    from parity.run.subjects import load_subject

    text = (REPO / "bench" / "h200_run.sh").read_text()
    block = re.search(r'^step hf-bench .*?-m parity (bench .*?)\$\{HF_BENCH_ARGS:-(.*?)\}$', text, re.M | re.S)
    fixed = [word for word in block.group(1).replace("\\\n", " ").split() if word]
    fixed = ["/dev/null" if word.startswith('"$R/') else word for word in fixed]
    args = build_parser().parse_args(fixed + block.group(2).split())
    assert (args.subject, args.impls, args.device, args.reps, args.warmup) == (
        "bench.hf_subject:make_subject", "sdpa,parity_sdpa,parity_sparse", "cuda", 5, 2)
    assert args.modules == ["model.layers.*.self_attn"]
    subject = load_subject(args.subject, parse_overrides(args.arg, flag="--set", convert=json_value(max_int=2**63 - 1)))
    assert subject.args == {"size": "llama8b", "seq": 4096, "batch": 1, "dtype": "bf16", "seed": 0, "layers": 0}


def test_hf_logit_spread_step_and_its_distances(tmp_path):
    """The step runs the script with its JSON in the results and the caller's arguments; the
    distances it reports are known answers; without a GPU it refuses with one line."""
    import pytest
    import torch

    from bench.hf_logit_spread import distance, main

    calls, status = _dry_run(tmp_path, {"STEPS": "hf-logit-spread", "HF_SPREAD_ARGS": "--layers 4 --seq 1024"})
    spread = next(c for c in calls if "bench.hf_logit_spread" in c).split()
    assert spread[spread.index("--json") + 1].endswith("/hf-logit-spread.json")
    assert spread[-4:] == ["--layers", "4", "--seq", "1024"]
    assert [line.split()[0] for line in status.splitlines()] == ["install", "hf-logit-spread"]
    ref = torch.tensor([3.0, 4.0])
    same = distance(ref.clone(), ref)
    assert same == {"rel_l2": 0.0, "cosine": 1.0, "max_abs": 0.0}
    off = distance(torch.tensor([3.0, 4.5]), ref)
    assert off["rel_l2"] == pytest.approx(0.1) and off["max_abs"] == pytest.approx(0.5)
    assert off["cosine"] == pytest.approx((9 + 18) / (5 * (9 + 20.25) ** 0.5))
    if not torch.cuda.is_available():
        assert main(["--seq", "16"]) == 2
