"""Exit statuses mean one thing each: 0 holds, 1 fails, 2 unusable input, 3 internal error, 130
interrupted. Checked in-process (``parity.cli.main``) and in real processes through both entry
points (``python -m parity`` and the ``parity`` console script); 2 and 3 print one line (3 names
the failing place), ``--debug`` / ``PARITY_DEBUG=1`` add the traceback, and ``--json`` /
``--junit-xml`` reports are written for 2 and 3 too. Then ~60 bad argument combinations across
capture, compare and inspect: each exit 2 with one line, no traceback, no hang.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import parity.cli.main
from parity.run.capture import capture
from parity.cli.main import main
from parity.base.errors import EXIT_INTERNAL, EXIT_USAGE, SubjectError, UsageError, classify, describe_exception

EXAMPLE = "user_subject_example:make_subject"
TESTS_DIR = Path(__file__).resolve().parent

# A user package whose forward raises when PARITY_TEST_BOOM is set: the exit-3 subject.
FLAKY = '''

import os as _os


def make_flaky(**args):
    subject = ExampleSubject(**args)
    original = subject.call

    def call(module, inputs):
        if _os.environ.get("PARITY_TEST_BOOM"):
            raise ValueError("boom")  # FLAKY-LINE
        return original(module, inputs)

    subject.call = call
    return subject
'''


@pytest.fixture(autouse=True)
def _isolated(monkeypatch):
    """Restore sys.path (user subjects put the current directory on it) and clear PARITY_DEBUG."""
    saved = list(sys.path)
    monkeypatch.delenv("PARITY_DEBUG", raising=False)
    yield
    sys.path[:] = saved


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A user's project directory: ``mypkg/subjects.py`` (the example subject plus make_flaky) and
    a golden of make_flaky captured there."""
    root = tmp_path_factory.mktemp("project")
    (root / "mypkg").mkdir()
    (root / "mypkg" / "__init__.py").write_text("")
    (root / "mypkg" / "subjects.py").write_text((TESTS_DIR / "user_subject_example.py").read_text() + FLAKY)
    saved, cwd = list(sys.path), os.getcwd()
    try:
        sys.path.insert(0, str(root))
        capture("mypkg.subjects:make_flaky", root / "golden", reference="none")
    finally:
        sys.path[:] = saved
        for name in [name for name in sys.modules if name == "mypkg" or name.startswith("mypkg.")]:
            del sys.modules[name]
        os.chdir(cwd)
    return root


FLAKY_SPEC = "mypkg.subjects:make_flaky"


def flaky_line(project: Path) -> int:
    lines = (project / "mypkg" / "subjects.py").read_text().splitlines()
    return next(number for number, line in enumerate(lines, 1) if "FLAKY-LINE" in line)


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def compare_args(golden: Path | str, *extra: str) -> list[str]:
    return ["compare", "--golden", str(golden), "--subject", FLAKY_SPEC, "--device", "cpu", "--quiet", *extra]


# ---- in-process: every status ----------------------------------------------------------------------


def test_every_exit_status_in_process(project, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(project)
    code, out, err = cli(capsys, *compare_args("golden", "--impl", "reference"))
    assert code == 0 and out.rstrip().endswith("PARITY HOLDS: 10/10 tensors") and err == ""
    code, out, err = cli(capsys, *compare_args("golden", "--impl", "tanh"))
    assert code == 1 and "PARITY FAILS: first failing tensor" in out.rstrip().splitlines()[-1]
    code, out, err = cli(capsys, *compare_args("nowhere", "--impl", "reference"))
    assert code == 2 and out == "" and err == "parity: error: bundle nowhere does not exist\n"
    monkeypatch.setenv("PARITY_TEST_BOOM", "1")
    code, out, err = cli(capsys, *compare_args("golden", "--impl", "reference"))
    assert code == 3 and out == ""
    assert err == (f"parity: internal error in subject {FLAKY_SPEC} (forward): ValueError: boom at "
                   f"mypkg/subjects.py:{flaky_line(project)}; rerun with --debug for the traceback\n")


def test_interrupt_is_130(tmp_path, capsys):
    code, _, err = cli(capsys, "capture", "--subject", "user_subject_example:raises_interrupt_on_recorded_run",
                       "--out", str(tmp_path / "b"), "--quiet")
    assert code == 130 and err == "parity: interrupted\n"
    assert not (tmp_path / "b").exists()


def test_argparse_errors_and_help(capsys):
    code, out, err = cli(capsys, "compare")
    assert code == 2 and err == "parity: error: the following arguments are required: --bundle/--golden\n"
    code, out, err = cli(capsys)  # no command at all: the commands, not one terse line (test_cli.py)
    assert code == 2 and err.startswith("usage: python -m parity") and out == ""
    code, out, err = cli(capsys, "--debug")  # options but no command: argparse's one line
    assert code == 2 and err.startswith("parity: error: the following arguments are required: command")
    code, out, err = cli(capsys, "--help")
    assert code == 0 and "capture" in out and "--debug" in out


@pytest.mark.parametrize("where", ["before", "after", "env"])
def test_debug_prints_the_traceback(project, capsys, monkeypatch, where):
    monkeypatch.chdir(project)
    monkeypatch.setenv("PARITY_TEST_BOOM", "1")
    argv = compare_args("golden", "--impl", "reference")
    if where == "before":
        argv = ["--debug", *argv]
    elif where == "after":
        argv = [*argv, "--debug"]
    else:
        monkeypatch.setenv("PARITY_DEBUG", "1")
    code, _, err = cli(capsys, *argv)
    assert code == 3
    assert err.startswith("Traceback (most recent call last):")
    assert 'raise ValueError("boom")' in err  # the subject's own frame, through the chained original
    assert err.rstrip().splitlines()[-1] == (f"parity: internal error in subject {FLAKY_SPEC} (forward): ValueError: "
                                             f"boom at mypkg/subjects.py:{flaky_line(project)}")


def test_a_bug_in_parity_is_exit_3_naming_the_place(capsys, monkeypatch, tmp_path):
    import parity.cli.commands.compare as command

    def broken(args):
        return {}["layers"]

    monkeypatch.setattr(command, "_run", broken)
    code, out, err = cli(capsys, "compare", "--golden", str(tmp_path), "--json", str(tmp_path / "r.json"))
    line = broken.__code__.co_firstlineno + 1
    assert code == 3 and out == ""
    assert err == (f"parity: internal error: KeyError: 'layers' at tests/test_cli_exit_status.py:{line}; "
                   "rerun with --debug for the traceback\n")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["error"] == {"status": 3, "kind": "internal",
                               "message": f"internal error: KeyError: 'layers' at tests/test_cli_exit_status.py:{line}"}


def test_subject_errors_keep_usage_errors_apart():
    """Inside subject code, parity's own UsageError stays exit 2; anything else is exit 3."""
    from parity.run.subjects import SubjectRunner

    class Subject:
        args: dict = {}

        def __init__(self, error):
            self.error = error

        def make_inputs(self):
            raise self.error

        def build(self, impl):
            raise self.error

    with pytest.raises(UsageError, match="bad size"):
        SubjectRunner("s:t", Subject(UsageError("bad size"))).make_inputs()
    with pytest.raises(SubjectError) as info:
        SubjectRunner("s:t", Subject(TypeError("oops"))).make_inputs()
    assert info.value.stage == "make_inputs" and isinstance(info.value.__cause__, TypeError)
    assert classify(info.value)[:2] == (EXIT_INTERNAL, "internal")
    with pytest.raises(UsageError, match=r"subject s:t \(build\) ran out of memory: MemoryError"):
        SubjectRunner("s:t", Subject(MemoryError())).build("x", state=None)
    with pytest.raises(SubjectError, match=r"\(build\): SystemExit: 0"):  # exit(0) is not a verdict
        SubjectRunner("s:t", Subject(SystemExit(0))).build("x", state=None)


def test_one_line_descriptions_are_cut_and_escaped():
    try:
        raise ValueError("first line \x1b[31mred\nsecond line " + "x" * 1000)
    except ValueError as err:
        text = describe_exception(err)
    assert "\n" not in text and "\x1b" not in text and "second line" not in text
    assert text.startswith("ValueError: first line \\x1b[31mred at tests/test_cli_exit_status.py:")
    assert classify(ModuleNotFoundError("No module named 'triton'", name="triton")) == (
        EXIT_USAGE, "usage", "this command needs Triton: pip install 'parity[triton]'")


# ---- reports for 2 and 3 -------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [2, 3])
def test_reports_are_written_when_compare_cannot_judge(project, tmp_path, capsys, monkeypatch, status):
    monkeypatch.chdir(project)
    json_file, junit_file = tmp_path / "r.json", tmp_path / "r.xml"
    json_file.write_text('{"passed": true}')  # a stale passing report must not survive
    if status == 3:
        monkeypatch.setenv("PARITY_TEST_BOOM", "1")
        argv = compare_args("golden", "--impl", "reference")
    else:
        argv = ["compare", "--golden", "golden", "--impl", "reference", "--device", "cpu", "--quiet"]  # untrusted
    code, _, err = cli(capsys, *argv, "--json", str(json_file), "--junit-xml", str(junit_file))
    assert code == status
    report = json.loads(json_file.read_text())
    message = err.removeprefix("parity: error: " if status == 2 else "parity: ").rstrip("\n")
    message = message.removesuffix("; rerun with --debug for the traceback")
    assert report == {"format": "parity-compare-report", "version": report["version"], "passed": False,
                      "golden": "golden",
                      "error": {"status": status, "kind": "usage" if status == 2 else "internal", "message": message}}
    suite = ET.parse(junit_file).getroot().find("testsuite")
    assert suite.get("tests") == "1" and suite.get("errors") == "1" and suite.get("failures") == "0"
    error = suite.find("testcase").find("error")
    assert error.get("type") == ("usage" if status == 2 else "internal") and error.get("message") == message


# ---- real processes, both entry points ---------------------------------------------------------------


def _entry_points() -> list[list[str]]:
    entries = [[sys.executable, "-m", "parity"]]
    script = Path(sys.executable).parent / "parity"
    if script.exists():
        entries.append([str(script)])
    return entries


@pytest.mark.parametrize("entry", _entry_points(), ids=lambda e: "python -m parity" if "-m" in e else "parity")
def test_every_exit_status_in_a_real_process(project, entry):
    """``python -m parity`` runs every case here. The console script runs those where the entry
    point's own ``sys.path`` matters (the user's package in the current directory: holds, is
    refused unless named, names its file in the exit-3 line); the rest (exit 1, ``--debug``, an
    argparse error) take the same ``entry()`` -> ``main()`` path in both, checked in-process above.
    Each case is a Python start with torch (2-3 CPU-seconds)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PARITY_DEBUG", "PARITY_TEST_BOOM")}
    every_case = "-m" in entry

    def run(*args, **extra_env):
        return subprocess.run([*entry, *args], cwd=project, env={**env, **extra_env}, capture_output=True, text=True,
                              timeout=300)

    proc = run(*compare_args("golden", "--impl", "reference"))
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("PARITY HOLDS: 10/10 tensors"), proc.stderr
    if every_case:
        proc = run(*compare_args("golden", "--impl", "tanh"))
        assert proc.returncode == 1, proc.stderr
    proc = run("compare", "--golden", "golden", "--impl", "reference", "--device", "cpu")
    assert proc.returncode == 2 and proc.stdout == ""
    assert re.fullmatch(r"parity: error: bundle golden names subject .* which this host does not trust; .*\n",
                        proc.stderr)
    proc = run(*compare_args("golden", "--impl", "reference"), PARITY_TEST_BOOM="1")
    assert proc.returncode == 3 and proc.stdout == ""
    assert proc.stderr == (f"parity: internal error in subject {FLAKY_SPEC} (forward): ValueError: boom at "
                           f"mypkg/subjects.py:{flaky_line(project)}; rerun with --debug for the traceback\n")
    if not every_case:
        return
    proc = run("--debug", *compare_args("golden", "--impl", "reference"), PARITY_TEST_BOOM="1")
    assert proc.returncode == 3 and "Traceback (most recent call last)" in proc.stderr
    proc = run("capture", "--subject", "decoder", "--out", "x", "--shard-mib", "nan")
    assert proc.returncode == 2 and proc.stderr == "parity: error: --shard-mib must be a positive finite number, got nan\n"


def test_missing_triton_is_exit_2_with_the_install_hint(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # how an absent package looks to importlib
    hint = "needs Triton: pip install 'parity[triton]'\n"
    code, _, err = cli(capsys, "capture", "--subject", "attention", "--impl", "triton", "--out", str(tmp_path / "b"))
    assert code == 2 and err == "parity: error: --impl triton " + hint
    code, _, err = cli(capsys, "compare", "--golden", str(tmp_path))  # --impl triton is compare's default
    assert code == 2 and err == "parity: error: --impl triton " + hint
    code, _, err = cli(capsys, "inspect")
    assert code == 2 and err == "parity: error: inspect " + hint
    assert not (tmp_path / "b").exists()


# ---- bad arguments: exit 2, one line, no traceback, no hang ---------------------------------------------

LONG_NUMBER = "1" * 5000  # more digits than Python will parse as an int by default

BAD_ARGUMENTS = {
    # capture
    "capture-no-args": ["capture"],
    "capture-unknown-subject": ["capture", "--subject", "nope"],
    "capture-spec-two-colons": ["capture", "--subject", "a:b:c"],
    "capture-spec-path": ["capture", "--subject", "../evil:make"],
    "capture-spec-not-a-subject": ["capture", "--subject", "os.path:join"],
    "capture-spec-missing-module": ["capture", "--subject", "no_such_module_xyz:make"],
    "seq-len-expression": ["capture", "--subject", "decoder", "--arg", "seq_len=10**5"],
    "heads-expression": ["capture", "--subject", "decoder", "--arg", "heads=10**6"],
    "seq-len-huge": ["capture", "--subject", "decoder", "--arg", "seq_len=10000000"],
    "heads-huge": ["capture", "--subject", "decoder", "--arg", "heads=100000000"],
    "vocab-float": ["capture", "--subject", "decoder", "--arg", "vocab=1e12"],
    "layers-zero": ["capture", "--subject", "decoder", "--arg", "layers=0"],
    "layers-bool": ["capture", "--subject", "decoder", "--arg", "layers=true"],
    "decoder-dtype-fp64": ["capture", "--subject", "decoder", "--arg", "dtype=\"fp64\""],
    "rope-base-nan": ["capture", "--subject", "decoder", "--arg", "rope_base=nan"],
    "rope-base-inf": ["capture", "--subject", "decoder", "--arg", "rope_base=1e999"],
    "layer-layouts-unknown": ["capture", "--subject", "decoder", "--arg", 'layer_layouts=["diagonal"]'],
    "layer-layouts-object": ["capture", "--subject", "decoder", "--arg", 'layer_layouts={"a": 1}'],
    "arg-no-value": ["capture", "--subject", "decoder", "--arg", "novalue"],
    "arg-no-key": ["capture", "--subject", "decoder", "--arg", "=5"],
    "arg-unknown-key": ["capture", "--subject", "decoder", "--arg", "x y=1"],
    "arg-5000-digits": ["capture", "--subject", "decoder", "--arg", f"seq_len={LONG_NUMBER}"],
    "cases-unknown-set": ["capture", "--subject", "attention", "--cases", "huge"],
    "cases-incomplete": ["capture", "--subject", "attention", "--arg", 'cases=[{"batch": 1}]'],
    "cases-not-objects": ["capture", "--subject", "attention", "--arg", "cases=[5]"],
    "cases-object": ["capture", "--subject", "attention", "--arg", "cases={}"],
    "cases-empty": ["capture", "--subject", "attention", "--arg", "cases=[]"],
    "case-huge-heads": ["capture", "--subject", "attention", "--arg",
                        'cases=[{"batch": 1, "heads_q": 1000000000, "heads_kv": 1, "seq_q": 64, "seq_k": 64, '
                        '"head_dim": 32}]'],
    "fuzz-zero": ["capture", "--subject", "attention", "--fuzz", "0"],
    "fuzz-huge": ["capture", "--subject", "attention", "--fuzz", "1000000000"],
    "fuzz-not-attention": ["capture", "--subject", "decoder", "--fuzz", "3"],
    "capture-dtype": ["capture", "--subject", "attention", "--dtype", "fp8"],
    "shard-mib-inf": ["capture", "--subject", "decoder", "--shard-mib", "inf"],
    "shard-mib-nan": ["capture", "--subject", "decoder", "--shard-mib", "nan"],
    "shard-mib-negative": ["capture", "--subject", "decoder", "--shard-mib", "-1"],
    "shard-mib-zero": ["capture", "--subject", "decoder", "--shard-mib", "0"],
    "shard-mib-huge": ["capture", "--subject", "decoder", "--shard-mib", "1e300"],
    "shard-mib-text": ["capture", "--subject", "decoder", "--shard-mib", "abc"],
    "capture-reference": ["capture", "--subject", "decoder", "--reference", "fp16"],
    "capture-device": ["capture", "--subject", "decoder", "--device", "tpu"],
    "capture-impl": ["capture", "--subject", "decoder", "--impl", "cuda-original"],
    "capture-layers": ["capture", "--subject", "decoder", "--layers", "zzz*"],
    # compare
    "compare-no-golden": ["compare"],
    "compare-missing-bundle": ["compare", "--golden", "{tmp}/nowhere"],
    "compare-golden-is-a-file": ["compare", "--golden", "{tmp}/plain.txt"],
    "tolerances-fifo": ["compare", "--golden", "{golden}", "--tolerances", "{tmp}/fifo"],
    "tolerances-directory": ["compare", "--golden", "{golden}", "--tolerances", "{tmp}"],
    "tolerances-missing": ["compare", "--golden", "{golden}", "--tolerances", "{tmp}/missing.toml"],
    "tolerances-device-file": ["compare", "--golden", "{golden}", "--tolerances", "/dev/zero"],
    "tolerances-max-rel-l2-inf": ["compare", "--golden", "{golden}", "--subject", EXAMPLE, "--tolerances",
                                  "{tmp}/inf.toml"],
    "tolerances-bad-toml": ["compare", "--golden", "{golden}", "--tolerances", "{tmp}/bad.toml"],
    "tolerances-bad-trust": ["compare", "--golden", "{golden}", "--tolerances", "{tmp}/trust.toml"],
    "max-rows-zero": ["compare", "--golden", "{golden}", "--max-rows", "0"],
    "compare-device": ["compare", "--golden", "{golden}", "--device", "tpu"],
    "compare-subject-mismatch": ["compare", "--golden", "{golden}", "--subject", "decoder"],
    "compare-untrusted": ["compare", "--golden", "{golden}"],
    "compare-json-dir-missing": ["compare", "--golden", "{golden}", "--json", "{tmp}/missing/r.json"],
    "compare-isolate": ["compare", "--golden", "{golden}", "--subject", EXAMPLE, "--isolate"],
    "compare-budget": ["compare", "--golden", "{golden}", "--subject", EXAMPLE, "--budget"],
    "compare-impl": ["compare", "--golden", "{golden}", "--subject", EXAMPLE, "--impl", "cuda-original"],
    # inspect
    "inspect-target": ["inspect", "--target", "gfx000"],
    "inspect-dtype": ["inspect", "--dtype", "fp8"],
    "inspect-head-dim": ["inspect", "--head-dim", "48"],
    "inspect-head-dim-text": ["inspect", "--head-dim", "abc"],
    "inspect-set-key": ["inspect", "--set", "tiles=3"],
    "inspect-set-negative": ["inspect", "--set", "num_warps=-1"],
    "inspect-set-huge": ["inspect", "--set", "block_m=99999999"],
    "inspect-set-no-value": ["inspect", "--set", "num_warps"],
    "inspect-jobs-zero": ["inspect", "--jobs", "0"],
    # the top level (no command at all prints the commands instead: test_argparse_errors_and_help)
    "unknown-command": ["frobnicate"],
}


@pytest.fixture(scope="module")
def bad_argument_files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bad-arguments")
    golden = root / "golden"
    capture(EXAMPLE, golden, reference="none")
    os.mkfifo(root / "fifo")
    (root / "plain.txt").write_text("not a bundle")
    (root / "inf.toml").write_text("[defaults.fp32]\nmax_rel_l2 = inf\n")
    (root / "bad.toml").write_text("[defaults\n")
    (root / "trust.toml").write_text('trust = "everything"\n')
    return {"tmp": str(root), "golden": str(golden)}


class _Hang(Exception):
    pass


@pytest.mark.parametrize("argv", list(BAD_ARGUMENTS.values()), ids=list(BAD_ARGUMENTS))
def test_bad_arguments_are_exit_2_with_one_line(argv, bad_argument_files, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [arg.replace("{tmp}", bad_argument_files["tmp"]).replace("{golden}", bad_argument_files["golden"])
            for arg in argv]
    if argv[:1] == ["capture"] and "--subject" in argv:
        argv += ["--out", str(tmp_path / "out"), "--quiet"]
    if argv[:1] == ["compare"] and "--golden" in argv:
        for option, value in (("--impl", "reference"), ("--device", "cpu")):
            if option not in argv:  # the case's own value is the point of the case
                argv += [option, value]
        argv.append("--quiet")

    def hang(signum, frame):
        raise _Hang(f"parity {' '.join(argv)} did not return within 60 s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(60)  # a FIFO opened for reading blocks forever: fail the test instead
    try:
        code = main(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert captured.err.count("\n") == 1 and captured.err.startswith("parity: error: "), captured.err
    assert "Traceback" not in captured.out + captured.err and "\x1b" not in captured.err
    assert not (tmp_path / "out").exists()
