"""The pytest plugin, driven through pytester: pass, fail (message content), missing goldens,
--parity-record, --parity-regen, obtained bundles, markers under --strict-markers, policies, the
summary and --parity-report, xdist; and assert_parity / check_subject without pytest."""
import json

import hypothesis  # noqa: F401
import pytest
import safetensors.torch  # noqa: F401
import tabulate  # noqa: F401
import torch
import triton  # noqa: F401  (conftest has chosen the interpreter before collection)

import parity.run.capture  # noqa: F401
import parity.judge.compare  # noqa: F401
import parity.report.text  # noqa: F401
from parity.bundle.reader import open_bundle
from parity.testing.goldens import ParityFailure, assert_parity, check_parity, default_golden_name

# The pytester fixture drops, at teardown, every module first imported while it was in use.
# Importing these here keeps them loaded for the whole session: re-importing Triton's native
# extension after that deadlocks, and Hypothesis' plugin imports hypothesis at every in-process
# run's terminal summary (3 s under assertion rewriting).
pytest_plugins = ["pytester"]

# The module every pytester run imports: X is the golden; BREAK (an env var) perturbs it.
TESTS = '''
import os

import pytest
import torch

X = torch.linspace(-1, 1, 1000).reshape(10, 100)


def obtained():
    y = X.clone()
    if os.environ.get("BREAK"):
        y[3, 7] += 0.5            # one element off by 0.5
    if os.environ.get("BREAK_NAN"):
        y[1, 1] = float("nan")    # one NaN where the golden is finite
    return y


def test_dict(parity_check):
    parity_check({"out": obtained(), "lse": X[:, 0].clone()}, name="pair")


@pytest.mark.parity(golden="single")
def test_single(parity_check):
    parity_check(X.to(torch.bfloat16))
'''


def _golden(pytester, name="pair", tensors=None):
    x = torch.linspace(-1, 1, 1000).reshape(10, 100)
    tensors = tensors if tensors is not None else {"out": x, "lse": x[:, 0].clone()}
    check_parity(name, tensors, golden_dir=pytester.path / "goldens", record=True)
    return pytester.path / "goldens" / name


def _text(result) -> str:
    return "\n".join(result.outlines + result.errlines)


@pytest.fixture
def suite(pytester):
    pytester.makepyfile(test_suite=TESTS)
    return pytester


def test_passing_checks_and_the_summary(suite):
    _golden(suite)
    _golden(suite, "single", torch.linspace(-1, 1, 1000).reshape(10, 100).to(torch.bfloat16))
    result = suite.runpytest("--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    # Passing tensors are folded into the count: the summary is the section and one line.
    lines = result.stdout.lines
    header = next(i for i, line in enumerate(lines) if "parity summary" in line)
    # (a blank line may follow the header: pytest's writer adds one after some sections, e.g.
    # after a warnings summary that an earlier import in the same process caused)
    assert [line for line in lines[header + 1:] if line.strip()][:1] == \
        ["parity: 3 tensors checked: 3 pass (-v lists them)"], lines[header:]
    assert "| tensor" not in result.stdout.str()
    assert "PytestUnknownMarkWarning" not in _text(result)
    verbose = suite.runpytest("-v", "-p", "no:cacheprovider")
    verbose.stdout.fnmatch_lines([
        "| test*| tensor*| dtype*| cosine*| max abs*| rel L2*| verdict*|",
        "|--*",
        "| test_suite.py::test_dict*| pair/lse*| fp32*| 1*| 0*| 0*| pass*|",
        "| test_suite.py::test_dict*| pair/out*| fp32*| 1*| 0*| 0*| pass*|",
        "| test_suite.py::test_single*| single*| bf16*| 1*| 0*| 0*| pass*|",
        "parity: 3 tensors checked: 3 pass",
    ], consecutive=True)


def test_failure_message_and_the_obtained_bundle(suite, monkeypatch):
    golden = _golden(suite)
    monkeypatch.setenv("BREAK", "1")
    monkeypatch.setenv("BREAK_NAN", "1")
    result = suite.runpytest("-k", "test_dict", "-p", "no:cacheprovider", "--basetemp", str(suite.path / "tmp"))
    result.assert_outcomes(failed=1)
    obtained = suite.path / "tmp" / "parity-obtained" / "pair.obtained"
    # The failing tensor in four lines (what failed; by how much against which bound; the worst
    # element once, with the failing aggregates; what would pass), the passing one only counted.
    result.stdout.fnmatch_lines([
        f"E  *ParityFailure: parity: 1 of 2 tensors differ from golden {golden} (policy: built-in defaults)",
        "E       pair/out: FAIL nan/inf,mismatch,outliers,cosine,rel_l2  float32 [[]10, 100[]]",
        "E         mismatched elements: 1 / 999 finite (0.1%, allowed 0.005%) outside atol 1.0e-5 + atol_rms 8.0e-5 x "
        "golden rms 5.8e-1 + rtol 1.3e-6 x |golden|; 1 beyond 4x that bound",
        "E         greatest |difference|: 5.0e-1 at [[]3, 7[]] (obtained 0.11461461, golden -0.38538539); cosine 1-3.8e-4 "
        "(min 1-2.0e-10); rel L2 2.7e-2 (max 2.0e-5); NaN/Inf positions differ at 1 of 1000 (0.1%), first at [[]1, 1[]]",
        "E         would pass with: nan_policy = \"ignore\", (mismatch, any one of) max_mismatch_fraction = 1.1e-3 or "
        "atol = 5.0e-1 or atol_rms = 8.7e-1 or rtol = 1.3e0, outlier_factor = 8.9e3, min_cosine = 0.99962, "
        "max_rel_l2 = 2.8e-2",
        f"E       obtained tensors kept in {obtained} (a parity bundle: python -m parity diff {golden} {obtained} "
        "compares them; --parity-regen accepts this run as the golden)",
    ], consecutive=True)
    assert "pair/lse" not in result.stdout.str()  # passing: counted in the head line, nowhere else
    result.stdout.fnmatch_lines([
        "| test*| tensor*| dtype*| cosine*| max abs*| rel L2*| verdict*|",
        "|--*",
        "| test_suite.py::test_dict*| pair/out*| fp32*| 1-3.8e-4*| 5.0e-1*| 2.7e-2*"
        "| FAIL nan/inf,mismatch,outliers,cosine,rel_l2*|",
        "parity: 2 tensors checked: 1 pass, 1 fail (1 passing not shown: -v lists them)",
    ], consecutive=True)
    # Nothing is written into the source tree: the obtained bundle is under pytest's basetemp.
    assert not (golden.parent / "pair.obtained").exists()
    with open_bundle(obtained) as bundle:
        out = bundle.load("out")
        assert out.isnan().sum() == 1 and out[3, 7].item() == pytest.approx(0.5 + (-1 + 2 * 307 / 999))
    # -v: failures first, then the passing tensors.
    verbose = suite.runpytest("-v", "-k", "test_dict", "-p", "no:cacheprovider")
    verbose.stdout.fnmatch_lines(["| test_suite.py::test_dict*| pair/out*| FAIL*|",
                                  "| test_suite.py::test_dict*| pair/lse*| pass*|"], consecutive=True)
    # --parity-obtained-dir: the bundle goes there; fixed again, the check passes and the stale
    # obtained bundle goes away.
    mine = suite.path / "mine"
    suite.runpytest("-k", "test_dict", "-p", "no:cacheprovider", "--parity-obtained-dir", "mine").stdout.fnmatch_lines(
        [f"E       obtained tensors kept in {mine / 'pair.obtained'} *"])
    monkeypatch.delenv("BREAK")
    monkeypatch.delenv("BREAK_NAN")
    suite.runpytest("-k", "test_dict", "-p", "no:cacheprovider", "--parity-obtained-dir", "mine").assert_outcomes(
        passed=1)
    assert not (mine / "pair.obtained").exists()


def test_a_missing_golden_is_written_and_the_test_still_fails(suite):
    result = suite.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([
        "*golden */goldens/pair was missing and has been recorded from this run (a dict of 2 tensors (out, lse)); "
        "the test fails so that a recording is never a pass*",
        "*| test_suite.py::test_single*| single*| bf16*| -*| recorded*|",
    ])
    with open_bundle(suite.path / "goldens" / "single") as bundle:
        assert bundle.manifest["parity_golden"]["kind"] == "tensor"
        assert bundle.manifest["parity_golden"]["test"] == "test_suite.py::test_single"
        assert bundle.load("tensor").dtype == torch.bfloat16
    suite.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=2)
    # the reference host re-records every golden it checks: the tests fail, saying so
    result = suite.runpytest("--parity-record", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*golden */goldens/pair was re-recorded (--parity-record) from this run*"])
    suite.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=2)


def test_regen_rewrites_only_failing_goldens_and_fails_saying_so(suite, monkeypatch):
    golden = _golden(suite)
    _golden(suite, "single", torch.linspace(-1, 1, 1000).reshape(10, 100).to(torch.bfloat16))
    single_manifest = (suite.path / "goldens" / "single" / "manifest.json").read_text()
    monkeypatch.setenv("BREAK", "1")
    suite.runpytest("-p", "no:cacheprovider").assert_outcomes(failed=1, passed=1)
    assert not (golden.parent / "pair.obtained").exists()  # under pytest's basetemp, not beside the golden

    result = suite.runpytest("--parity-regen", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines([
        f"*--parity-regen: golden {golden} has been rewritten from this run*",
        "*| pair/out*| FAIL mismatch,outliers,cosine,rel_l2 (regenerated)*|",
    ])
    # The passing golden was not rewritten (no churn); the failing one now holds this run.
    assert (suite.path / "goldens" / "single" / "manifest.json").read_text() == single_manifest
    suite.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=2)


def test_shape_dtype_and_structure_mismatches_are_failures_not_crashes(pytester):
    x = torch.ones(4, 4)
    _golden(pytester, "shape", {"a": x, "b": x, "gone": x})
    _golden(pytester, "structure", {"a": x})
    pytester.makepyfile('''
import torch

def test_shape(parity_check):
    parity_check({"a": torch.ones(4, 5), "b": torch.ones(4, 4, dtype=torch.float64), "new": torch.ones(1)},
                 name="shape")

def test_structure(parity_check):
    parity_check(torch.ones(4, 4), name="structure")
''')
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines_random([
        "*shape/a: FAIL shape  float32 [[]4, 5[]]",
        "*  shape mismatch: [[]4, 5[]] here, [[]4, 4[]] in the golden",
        "*shape/b: FAIL dtype  float64 [[]4, 4[]]",
        "*  dtype mismatch: float64 here, float32 in the golden",
        "*shape/new: FAIL missing in golden  float32 [[]1[]]",
        "*  obtained, but not in the golden",
        "*shape/gone: FAIL missing here  float32 [[]4, 4[]]",
        "*  in the golden, but not obtained",
        "*the golden holds a dict of 1 tensor (a), this run obtained a single tensor",
    ])


def test_policies_from_marker_option_and_pyproject(suite, monkeypatch):
    _golden(suite)
    loose = suite.path / "loose.toml"
    # The broken element is far beyond its bound: a looser mismatch fraction alone no longer
    # forgives it (bounded outliers), the policy must also say how far an element may be off.
    loose.write_text('[[layers]]\nmatch = "pair/*"\nmax_mismatch_fraction = 0.01\nmax_rel_l2 = 0.05\n'
                     'min_cosine = 0.999\noutlier_factor = 1e4\nreason = "test"\n')
    monkeypatch.setenv("BREAK", "1")
    suite.runpytest("-k", "test_dict", "-p", "no:cacheprovider").assert_outcomes(failed=1)
    result = suite.runpytest("-k", "test_dict", "--parity-tolerances", str(loose), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    (suite.path / "pyproject.toml").write_text("[tool.parity]\n" + loose.read_text().replace(
        "[[layers]]", "[[tool.parity.layers]]"))
    suite.runpytest("-k", "test_dict", "-p", "no:cacheprovider").assert_outcomes(passed=1)
    # The marker's policy is more specific than the run's.
    suite.makepyfile(test_marker='''
import pytest, torch
from test_suite import obtained, X

@pytest.mark.parity(policy="strict.toml")
def test_marked(parity_check):
    parity_check({"out": obtained(), "lse": X[:, 0].clone()}, name="pair")
''')
    (suite.path / "strict.toml").write_text("[defaults]\nnan_policy = \"positions\"\n")
    result = suite.runpytest("test_marker.py", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*(policy: strict.toml)*"])


def test_marker_misuse_and_bad_names_are_one_line_failures(pytester):
    pytester.makepyfile('''
import pytest, torch

@pytest.mark.parity(gold="x")
def test_unknown_kwarg(parity_check):
    parity_check(torch.ones(1))

def test_bad_name(parity_check):
    parity_check(torch.ones(1), name="../escape")

def test_twice(parity_check):
    with pytest.raises(AssertionError, match="has been recorded"):
        parity_check(torch.ones(1), name="a")
    parity_check(torch.ones(1), name="a")
''')
    result = pytester.runpytest("--strict-markers", "--parity-record", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=2, errors=1)  # the marker is checked when the fixture is set up
    result.stdout.fnmatch_lines_random([
        "*parity marker on *test_unknown_kwarg: unknown argument(s) gold; expected golden, policy*",
        "*parity: bad golden name '../escape'*",
        "*parity: golden 'a' checked twice in one test*",
    ])
    assert not (pytester.path / "escape").exists()


@pytest.mark.slow  # a pytest run with xdist workers in a real process
def test_xdist_summary_and_json_report(suite):
    _golden(suite)
    _golden(suite, "single", torch.linspace(-1, 1, 1000).reshape(10, 100).to(torch.bfloat16))
    report = suite.path / "parity-report.json"
    # Hypothesis' plugin is left out only to save each process importing it (seconds without .pyc files).
    result = suite.runpytest_subprocess("-n", "2", "-v", "-p", "xdist", "-p", "no:cacheprovider",
                                        "-p", "no:hypothesispytest", "--parity-report", str(report))
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines_random([
        "*parity summary*",
        "| test_suite.py::test_dict*| pair/lse*| pass*|",
        "| test_suite.py::test_dict*| pair/out*| pass*|",
        "| test_suite.py::test_single*| single*| pass*|",
        "parity: 3 tensors checked: 3 pass",
    ])
    data = json.loads(report.read_text())
    assert data["checked"] == 3 and data["passed"] == 3
    assert [(row["test"], row["tensor"]) for row in data["tensors"]] == [
        ("test_suite.py::test_dict", "pair/lse"), ("test_suite.py::test_dict", "pair/out"),
        ("test_suite.py::test_single", "single")]
    assert data["tensors"][1]["cosine"] == 1.0 and data["tensors"][1]["dtype"] == "float32"


# ---- without pytest's fixture ---------------------------------------------------------------------


def test_assert_parity_raises_an_assertion_error_with_the_message(tmp_path):
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ParityFailure, match="was missing and has been recorded"):
        assert_parity("x", x, golden_dir=tmp_path)
    assert assert_parity("x", x.clone(), golden_dir=tmp_path).passed
    with pytest.raises(ParityFailure, match=r"re-recorded \(--parity-record\)"):
        assert_parity("x", x, golden_dir=tmp_path, record=True)
    assert assert_parity("x", x.clone(), golden_dir=tmp_path).passed
    with pytest.raises(AssertionError, match=r"x: FAIL mismatch,outliers,rel_l2,biased ") as info:
        assert_parity("x", x * 1.01, golden_dir=tmp_path)
    result = info.value.result
    assert result.status == "fail" and result.obtained == tmp_path / "x.obtained"
    assert result.tensors[0].layer.metrics.cosine == pytest.approx(1.0)  # a scale error: cosine is blind


def test_default_golden_names_are_safe_paths():
    assert default_golden_name("tests/test_x.py::TestA::test_b[p-1]") == "test_x/TestA.test_b[p-1]"
    assert default_golden_name("t.py::test[a/b c]") == "t/test[a_b_c]"


def test_subject_checks_record_compare_and_detect_stale_goldens(tmp_path):
    from parity.testing.goldens import check_subject

    case = {"batch": 1, "heads_q": 2, "heads_kv": 1, "seq_q": 33, "seq_k": 33, "head_dim": 16,
            "layout": "causal", "dtype": "fp16", "seed": 0, "block_m": 16, "block_n": 16}
    golden = tmp_path / "attention"
    recorded = check_subject("attention", {"cases": [case]}, golden=golden, device="cpu")
    assert recorded.status == "recorded" and not recorded.passed and open_bundle(golden).impl == "reference"
    assert "was missing and has been captured" in recorded.message
    result = check_subject("attention", {"cases": [case]}, golden=golden, impl="triton", device="cpu")
    assert result.status == "pass", result.message
    assert [t.label for t in result.tensors] == ["B1-Hq2-Hkv1-Sq33-Sk33-D16-causal-bm16bn16-fp16-s0/out",
                                                 "B1-Hq2-Hkv1-Sq33-Sk33-D16-causal-bm16bn16-fp16-s0/lse"]
    stale = check_subject("attention", {"cases": [dict(case, seed=1)]}, golden=golden, device="cpu")
    assert stale.status == "fail" and "rerun with --parity-regen to re-capture it" in stale.message


def test_parity_device_auto_runs_subject_checks_where_torch_sees_a_device(pytester):
    # --parity-device auto is the CLI's --device auto: cuda when torch sees a GPU, else the CPU
    pytester.makepyfile(test_auto="""
        CASE = {"batch": 1, "heads_q": 2, "heads_kv": 1, "seq_q": 17, "seq_k": 17, "head_dim": 16,
                "layout": "causal", "dtype": "fp32", "seed": 0, "block_m": 16, "block_n": 16}

        def test_subject(parity_check):
            parity_check.subject("attention", {"cases": [CASE]}, impl="reference")
    """)
    first = pytester.runpytest("--parity-device", "auto", "-p", "no:cacheprovider")
    first.assert_outcomes(failed=1)  # the golden was missing: recorded, and the test fails saying so
    first.stdout.fnmatch_lines(["*was missing and has been captured*"])
    pytester.runpytest("--parity-device", "auto", "-p", "no:cacheprovider").assert_outcomes(passed=1)


# ---- broken subjects and unusable input: failures with one line, never passes ---------------------

BROKEN_SUBJECT = '''
import os

import torch
from torch import nn

from parity.base.errors import UsageError


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if os.environ.get("PARITY_TEST_BOOM"):
            raise ValueError("boom")  # BOOM-LINE
        return self.lin(x)


class Broken:
    name = "broken"

    def __init__(self, size=4):
        if size != 4:
            raise UsageError(f"broken subject: size must be 4, got {size}")
        self.args = {"size": size}

    def make_inputs(self):
        return {"x": torch.randn(2, 4, generator=torch.Generator().manual_seed(0))}

    def make_state(self):
        gen = torch.Generator().manual_seed(1)
        return {"lin.weight": torch.randn(4, 4, generator=gen), "lin.bias": torch.randn(4, generator=gen)}

    def build(self, impl):
        return Net()


def make(**args):
    return Broken(**args)
'''


def test_a_broken_subject_is_a_one_line_failure_never_a_pass(pytester, monkeypatch):
    pytester.makepyfile(broken_subject=BROKEN_SUBJECT)
    pytester.makepyfile(test_broken='''
def test_subject(parity_check):
    parity_check.subject("broken_subject:make", name="broken")


def test_bad_args(parity_check):
    parity_check.subject("broken_subject:make", {"size": 5}, name="bad-args")
''')
    written = (pytester.path / "broken_subject.py").read_text().splitlines()
    line = next(number for number, text in enumerate(written, 1) if "BOOM-LINE" in text)
    options = ("-p", "no:cacheprovider", "--parity-impl", "reference", "--parity-device", "cpu")
    monkeypatch.delenv("PARITY_DEBUG", raising=False)
    first = pytester.runpytest(*options)
    first.assert_outcomes(failed=2)  # recorded (never a pass) and the bad arguments
    first.stdout.fnmatch_lines_random(["*golden * was missing and has been captured*",
                                       "*parity: broken subject: size must be 4, got 5"])
    pytester.runpytest(*options, "-k", "test_subject").assert_outcomes(passed=1, deselected=1)
    monkeypatch.setenv("PARITY_TEST_BOOM", "1")
    broken = pytester.runpytest(*options, "-k", "test_subject")
    broken.assert_outcomes(failed=1, deselected=1)
    broken.stdout.fnmatch_lines([
        f"*parity: internal error in subject broken_subject:make (forward): ValueError: boom at "
        f"broken_subject.py:{line}; set PARITY_DEBUG=1 for the traceback"])
    assert "raise ValueError" not in broken.stdout.str()  # one line, not the subject's traceback
    monkeypatch.setenv("PARITY_DEBUG", "1")
    debug = pytester.runpytest(*options, "-k", "test_subject")
    debug.assert_outcomes(failed=1, deselected=1)
    assert 'raise ValueError("boom")' in debug.stdout.str()


def test_a_policy_path_that_is_a_fifo_fails_at_once(pytester, tmp_path):
    import os

    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    pytester.makepyfile('''
import torch

def test_fifo(parity_check):
    parity_check(torch.ones(3), name="x", policy=%r)
''' % str(fifo))
    result = pytester.runpytest("-p", "no:cacheprovider")  # before the check existed, this hung
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*parity: tolerance file */fifo.toml: is a FIFO, not a regular file*"])


# ---- a user's own subject, as the README writes one, with no flags -------------------------------

def test_a_user_subject_runs_its_own_reference_impl_without_flags(pytester, monkeypatch):
    from pathlib import Path

    # The README's example subject: impls ("reference", "tanh"), no reference_impl (so "reference").
    pytester.makepyfile(mysubject=(Path(__file__).parent / "user_subject_example.py").read_text())
    pytester.makepyfile(test_user='''
def test_tiny(parity_check):
    parity_check.subject("mysubject:make_subject", {"dim": 8}, name="tiny")
''')
    options = ("-p", "no:cacheprovider", "--parity-device", "cpu")
    first = pytester.runpytest(*options)
    first.assert_outcomes(failed=1)
    first.stdout.fnmatch_lines(["*golden */goldens/tiny was missing and has been captured (subject tiny-gated-mlp, "
                                "impl reference)*"])
    pytester.runpytest(*options).assert_outcomes(passed=1)  # the reference impl, run by default
    ported = pytester.runpytest(*options, "--parity-impl", "tanh", "--basetemp", str(pytester.path / "tmp"))
    ported.assert_outcomes(failed=1)
    obtained = pytester.path / "tmp" / "parity-obtained" / "tiny.obtained"
    ported.stdout.fnmatch_lines([f"E       this run (impl tanh) kept in {obtained} *"])
    assert obtained.is_dir() and not (pytester.path / "goldens" / "tiny.obtained").exists()
    # An impl the subject lacks names the option it came from, not the CLI's --impl.
    wrong = pytester.runpytest(*options, "--parity-impl", "triton")
    wrong.assert_outcomes(failed=1)
    wrong.stdout.fnmatch_lines(["*parity: subject tiny-gated-mlp has no implementation 'triton' (--parity-impl); "
                                "choose from reference, tanh"])
    assert "--impl " not in wrong.stdout.str()


def test_triton_on_a_cpu_without_the_interpreter_names_the_plugin_options(pytester, monkeypatch):
    pytester.makepyfile(test_triton='''
def test_attention(parity_check):
    parity_check.subject("attention", {"cases": "smoke"}, name="attention", impl="triton")
''')
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    result = pytester.runpytest("-p", "no:cacheprovider", "--parity-device", "cpu")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*parity: impl triton (impl= of parity_check.subject()) on device cpu (--parity-device) needs the Triton "
        "interpreter: run with TRITON_INTERPRET=1 in the environment (it must be set before Python starts)"])
    assert "--impl " not in result.stdout.str() and "--device " not in result.stdout.str()


SKEWED_SUBJECT = '''
import torch
from torch import nn


class Skewed(nn.Linear):
    """A linear map whose output is scaled by 1 + 1e-3: far beyond its rounding bound."""

    def forward(self, x):
        return super().forward(x) * (1 + 1e-3)


class Net(nn.Module):
    def __init__(self, skewed):
        super().__init__()
        self.inner = (Skewed if skewed else nn.Linear)(64, 64)
        self.outer = nn.Linear(64, 8)

    def forward(self, x):
        return self.outer(torch.relu(self.inner(x)))


class Pair:
    name = "pair"
    impls = ("reference", "skewed")
    reference_impl = "reference"

    def __init__(self):
        self.args = {}

    def make_inputs(self):
        return {"x": torch.randn(16, 64, generator=torch.Generator().manual_seed(0))}

    def make_state(self):
        gen = torch.Generator().manual_seed(1)
        return {name: torch.randn(t.shape, generator=gen) * 0.1 for name, t in Net(False).state_dict().items()}

    def build(self, impl):
        return Net(impl == "skewed")


def make(**args):
    return Pair(**args)
'''


def test_isolate_names_a_tensor_beyond_its_derived_bound_in_the_summary(pytester):
    """``--parity-isolate``: the golden records its modules' inputs, every module is replayed on
    them, and a linear map whose replayed error is far beyond its rounding bound is named in the
    summary (and by ``ParityResult.beyond_derived_bound``); the correct implementation is not."""
    pytester.makepyfile(skewed_subject=SKEWED_SUBJECT)
    pytester.makepyfile(test_skewed='''
import pytest


@pytest.mark.parametrize("impl", ["reference", "skewed"])
def test_pair(parity_check, impl):
    result = parity_check.subject("skewed_subject:make", name="pair", impl=impl)
    assert result.beyond_derived_bound == []  # reached only where the check passed
''')
    options = ("-p", "no:cacheprovider", "--parity-device", "cpu", "--parity-isolate")
    pytester.runpytest(*options, "-k", "reference").assert_outcomes(failed=1, deselected=1)  # recorded, never a pass
    golden = pytester.path / "goldens" / "pair"
    from parity.bundle.reader import open_bundle

    with open_bundle(golden) as bundle:
        assert bundle.entries_of("module_input"), "the golden records its modules' inputs"
    passing = pytester.runpytest(*options, "-v", "-k", "reference")
    passing.assert_outcomes(passed=1, deselected=1)
    assert "beyond derived bound" not in passing.stdout.str()
    skewed = pytester.runpytest(*options, "-k", "not reference")
    skewed.assert_outcomes(failed=1, deselected=1)
    skewed.stdout.fnmatch_lines(["beyond derived bound: test_skewed.py::test_pair[[]skewed[]] inner: *x of its op's "
                                 "rounding bound*"])
    assert "outer" not in [line.split(": ")[2].split(":")[0] for line in skewed.stdout.lines
                           if line.startswith("beyond derived bound: ")]
    # Without --parity-isolate no bound is derived: nothing is named.
    plain = pytester.runpytest("-p", "no:cacheprovider", "--parity-device", "cpu", "-k", "not reference")
    assert "beyond derived bound" not in plain.stdout.str()
