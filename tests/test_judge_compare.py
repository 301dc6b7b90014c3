"""Compare: same-host parity (reference and Triton through the interpreter), a perturbed layer named
as the first failing one and told apart from the layers that inherit its error (--isolate),
per-layer missing/extra/shape/dtype failures, the error budget, fingerprint warnings, and the CLI:
exit statuses, one-line errors for every unusable input, JSON and JUnit files."""
import json
import math
import os
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from torch import nn

import parity.cli.main
from parity.bundle.writer import edit_manifest
from parity.bundle.reader import open_bundle
from parity.run.capture import capture
from parity.judge.policy import DEFAULT_BUDGET_K, policy_for_cli
from parity.judge.compare import compare_bundle
from parity.judge.engine import compare_tensors
from parity.run.runtime import enable_triton_interpreter
from parity.base.errors import UsageError
from parity.judge.policy import LayerOverride, Policy
from parity.run.subjects import Inputs, Subject, trusting
from parity.run.subjects.attention import CASE_SETS

EXAMPLE = "user_subject_example:make_subject"
SMALL_DECODER = {"layers": 2, "seq_len": 64, "batch": 1}


@pytest.fixture(autouse=True)
def _trust_test_subjects():
    """This module's bundles name its own subjects; compare builds only trusted ones."""
    with trusting(STACK, EXAMPLE):
        yield


# ---- a user subject whose compare-side impls perturb one layer or change what is recorded ----


class Probe(nn.Module):
    """A side output of a block (a row sum): recorded, never used downstream."""

    def __init__(self, mode: str = "normal"):
        super().__init__()
        self.mode = mode

    def forward(self, h):
        if self.mode == "keepdim":
            return h.sum(-1, keepdim=True)
        if self.mode == "double":
            return h.sum(-1).double()
        return h.sum(-1)


class Extra(nn.Module):
    def forward(self, h):
        return h * 2


class NoisyLinear(nn.Linear):
    """A Linear with a deterministic "porting bug" of relative size ~noise."""

    def __init__(self, dim: int, noise: float):
        super().__init__(dim, dim)
        self.noise = noise

    def forward(self, x):
        y = super().forward(x)
        return y + self.noise * torch.sin(torch.arange(y.numel(), dtype=y.dtype)).reshape(y.shape)


class Block(nn.Module):
    def __init__(self, dim: int, noise: float = 0.0, probe: str = "normal", skip_probe: bool = False,
                 extra: bool = False):
        super().__init__()
        self.linear = NoisyLinear(dim, noise) if noise else nn.Linear(dim, dim)
        self.probe = Probe(probe)
        self.skip_probe = skip_probe
        self.extra = Extra() if extra else None

    def forward(self, x):
        h = x + torch.tanh(self.linear(x))
        if not self.skip_probe:
            self.probe(h)
        if self.extra is not None:
            self.extra(h)
        return h


class Stack(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return x


class StackSubject(Subject):
    """``depth`` residual blocks; impl ``perturbed`` adds noise in the linear of block ``perturb``; impl
    ``mismatch`` skips block 0's probe, adds a module to block 1, changes block 2's probe shape
    and block 3's probe dtype."""

    name = "stack"
    impls = ("reference", "perturbed", "mismatch")

    def __init__(self, depth: int = 5, dim: int = 16, perturb: int = 2, seed: int = 0):
        super().__init__(depth=depth, dim=dim, perturb=perturb, seed=seed)

    def make_inputs(self):
        gen = torch.Generator().manual_seed(self.args["seed"])
        return Inputs({"x": torch.randn(3, 7, self.args["dim"], generator=gen)})

    def make_state(self):
        gen = torch.Generator().manual_seed(self.args["seed"] + 1)
        model = self.build("reference")
        return {name: torch.randn(t.shape, generator=gen) * 0.3 for name, t in model.state_dict().items()}

    def build(self, impl):
        depth, dim = self.args["depth"], self.args["dim"]
        if impl == "perturbed":
            return Stack([Block(dim, noise=1e-3 if i == self.args["perturb"] else 0.0) for i in range(depth)])
        if impl == "mismatch":
            return Stack([Block(dim, skip_probe=i == 0, extra=i == 1,
                                probe={2: "keepdim", 3: "double"}.get(i, "normal")) for i in range(depth)])
        return Stack([Block(dim) for _ in range(depth)])

    def call(self, module, inputs):
        return module(inputs.tensors["x"])


def make_stack(**args):
    return StackSubject(**args)


STACK = f"{__name__}:make_stack"


def _by_name(report):
    return {result.name: result for result in report.layers}


# ---- bundles ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    root = tmp_path_factory.mktemp("golden")
    capture(STACK, root / "stack", layers=["layers.*"], record_inputs=True, shard_bytes=4096)
    capture(STACK, root / "stack-plain", layers=["layers.*"], reference="none")
    capture(EXAMPLE, root / "example", record_inputs=True)
    capture("decoder", root / "decoder", subject_args=SMALL_DECODER)
    return root


# ---- same host: parity holds ---------------------------------------------------------------


def test_same_host_reference_is_bitwise_and_holds(bundles):
    report = compare_bundle(bundles / "example", impl="reference", device="cpu", isolate=True)
    assert report.passed and report.first_failing_layer is None
    assert [r.name for r in report.layers] == [
        "block.norm", "block.proj", "block", "block.norm#1", "block.proj#1", "block#1", "head",
        "<root>/logits", "<root>/stats/0", "<root>/stats/1"]
    for result in report.layers:
        assert result.status == "pass" and result.metrics.rel_l2 == 0 and result.metrics.max_abs == 0
        assert result.metrics.cosine == 1.0
        assert result.isolated.status == "pass" and result.isolated.metrics.max_abs == 0
        assert result.attribution == "none"
    assert report.fingerprint_differences == [] and report.warnings == []
    assert report.error_growth.largest_jump is None


def test_decoder_same_host_holds_with_the_budget(bundles):
    report = compare_bundle(bundles / "decoder", impl="reference", device="cpu", budget=True)
    assert report.passed, [r.verdict.reasons for r in report.failing]
    assert len(report.layers) == len(open_bundle(bundles / "decoder").entries_of("output"))
    assert report.budget_checked
    logits = _by_name(report)["<root>"]
    assert logits.tolerance.budget_k == DEFAULT_BUDGET_K
    # Same host, same impl: this host's error against fp64 is the capture host's own, exactly.
    assert logits.budget.host_rel_l2 == logits.budget.capture_rel_l2
    assert 1e-3 < logits.budget.host_rel_l2 < 2e-2  # bf16 rounding, not zero and not a bug
    assert logits.budget.reference_dtype == "float64"


def test_triton_smoke_against_a_reference_golden(tmp_path):
    """The ported kernel (through the interpreter on this CPU) against goldens of the original."""
    capture("attention", tmp_path / "b", subject_args={"cases": "smoke"}, record_inputs=True)
    report = compare_bundle(tmp_path / "b", impl="triton", device="cpu", isolate=True, budget=True)
    assert report.passed, [(r.name, r.verdict.reasons) for r in report.failing]
    ids = [case.id for case in CASE_SETS["smoke"]]
    assert [r.name for r in report.layers] == [f"{i}/{k}" for i in ids for k in ("out", "lse")]
    by_name = _by_name(report)
    fp16_out, bf16_out = by_name[f"{ids[0]}/out"], by_name[f"{ids[1]}/out"]
    # A different implementation: not bitwise, but within the measured cross-implementation error.
    assert 0 < fp16_out.metrics.rel_l2 < 1e-3 and 0 < bf16_out.metrics.rel_l2 < 5e-3
    assert fp16_out.metrics.cosine > 0.99999
    # The kernel's own error against fp64 stays within twice the original's (flash-attention rule).
    assert bf16_out.budget.host_rel_l2 <= 2 * bf16_out.budget.capture_rel_l2
    assert report.kernel_configs["here"] and not report.kernel_configs["golden"]
    # Replayed on the golden inputs, the kernel's out is within the attention op's derived
    # rounding bound of the original's (both hosts' roundings: 2 B); the LSE has no bound.
    for result in (fp16_out, bf16_out):
        check = result.isolated.derived
        assert check.op.startswith("attention D=") and check.sides == 2
        assert 0 < check.ratio < 1 and not check.beyond, check
    assert all(by_name[f"{i}/lse"].isolated.derived is None for i in ids)
    assert report.beyond_derived_bound == []


# ---- a perturbed layer --------------------------------------------------------------------------


def test_perturbed_layer_is_the_first_failing_and_isolate_attributes_it(bundles):
    report = compare_bundle(bundles / "stack", impl="perturbed", device="cpu", isolate=True)
    assert not report.passed
    assert report.first_failing_layer == "layers.2.linear"
    names = [r.name for r in report.layers]
    upstream = ["layers.0.linear", "layers.0.probe", "layers.0", "layers.1.linear", "layers.1.probe", "layers.1"]
    assert names[:7] == upstream + ["layers.2.linear"]
    assert all(r.passed for r in report.layers[:6])
    assert all(r.status == "fail" for r in report.layers[6:])  # everything from the bug on
    # --isolate: only the perturbed module (and the block that contains it) introduces error;
    # every downstream layer passes on its golden inputs, bit for bit.
    assert report.introducing_layers == ["layers.2.linear"]
    attribution = {r.name: r.attribution for r in report.layers}
    assert attribution["layers.2.linear"] == "introduced" and attribution["layers.2"] == "introduced"
    for result in report.layers:
        if result.name in ("layers.2.linear", "layers.2"):
            assert result.isolated.status == "fail"
        else:
            assert result.isolated.status == "pass", result.name
            assert result.isolated.metrics.max_abs == 0, result.name
    downstream = report.layers[names.index("layers.2.probe"):]
    assert {r.attribution for r in downstream if r.name != "layers.2"} == {"inherited"}
    perturbed = _by_name(report)["layers.2.linear"]
    assert perturbed.isolated.metrics.rel_l2 == perturbed.metrics.rel_l2  # its inputs are exact
    assert 1e-4 < perturbed.metrics.rel_l2 < 1e-2
    assert "max_rel_l2" in perturbed.failed_checks()
    # Error growth: zero, then a jump where the bug is, then it is carried on.
    growth = report.error_growth
    assert growth.first == ("layers.0.linear", 0.0)
    assert growth.largest_jump[0] == "layers.2.linear" and growth.largest_jump[1] == 0
    assert growth.last[1] > 0


def test_error_budget_fails_the_perturbed_layer_and_reports_both_numbers(bundles):
    report = compare_bundle(bundles / "stack", impl="perturbed", device="cpu", budget=True)
    perturbed = _by_name(report)["layers.2.linear"]
    assert perturbed.budget.k == DEFAULT_BUDGET_K
    assert perturbed.budget.host_rel_l2 > 100 * perturbed.budget.capture_rel_l2 > 0
    assert any(reason.startswith("error budget: rel_l2 vs reference") for reason in perturbed.verdict.reasons)
    assert perturbed.failed_checks()["budget_k"] > 100
    clean = _by_name(report)["layers.1"]
    assert clean.passed and clean.budget.host_rel_l2 == clean.budget.capture_rel_l2


def test_budget_mode_follows_the_policy_unless_told(bundles, tmp_path):
    toml = tmp_path / "parity.toml"
    toml.write_text("[budget]\nk = 3.0\n")
    by_policy = compare_bundle(bundles / "stack", impl="reference", device="cpu", policy=toml)
    assert by_policy.passed and by_policy.budget_checked
    assert _by_name(by_policy)["layers.1"].tolerance.budget_k == 3.0
    off = compare_bundle(bundles / "stack", impl="reference", device="cpu", policy=toml, budget=False)
    assert not off.budget_checked and all(r.budget is None for r in off.layers)
    assert set(off.rules) == {"thresholds"}
    # By default the budget (k = 2) judges every tensor the bundle holds a reference of.
    default = compare_bundle(bundles / "stack", impl="reference", device="cpu")
    assert default.budget_checked and default.rules == {"budget": len(default.layers)}
    assert _by_name(default)["layers.1"].tolerance.budget_k == DEFAULT_BUDGET_K
    # A bundle without references is judged by the thresholds alone, silently by default ...
    plain = compare_bundle(bundles / "stack-plain", impl="reference", device="cpu", policy=toml)
    assert plain.passed and plain.rules == {"thresholds": len(plain.layers)}
    assert not any("error budget" in w for w in plain.warnings)
    # ... and --budget insists on references.
    with pytest.raises(UsageError, match=r"--budget needs high-precision references .* --reference none"):
        compare_bundle(bundles / "stack-plain", impl="reference", device="cpu", budget=True)


# ---- layers that do not line up -----------------------------------------------------------------


def test_missing_extra_shape_and_dtype_mismatches_are_per_layer_failures(bundles):
    report = compare_bundle(bundles / "stack", impl="mismatch", device="cpu", isolate=True)
    statuses = [(r.name, r.status) for r in report.layers]
    assert statuses[:7] == [
        ("layers.0.linear", "pass"), ("layers.0.probe", "fused-here"), ("layers.0", "pass"),
        ("layers.1.linear", "pass"), ("layers.1.probe", "pass"), ("layers.1.extra", "missing-in-golden"),
        ("layers.1", "pass")]
    by_name = _by_name(report)
    assert by_name["layers.2.probe"].status == "shape-mismatch"
    assert by_name["layers.2.probe"].metrics is None
    assert by_name["layers.2.probe"].here_shape == (3, 7, 1) and by_name["layers.2.probe"].shape == (3, 7)
    dtype = by_name["layers.3.probe"]
    assert dtype.status == "dtype-mismatch" and (dtype.here_dtype, dtype.dtype) == ("float64", "float32")
    assert dtype.metrics is not None and dtype.metrics.rel_l2 < 1e-6  # the values agree; the dtype does not
    assert dtype.verdict.reasons[0] == "dtype mismatch: float64 here, float32 in the golden"
    assert report.first_failing_layer == "layers.1.extra"
    assert len(report.failing) == 3 and by_name["layers.4"].passed
    # The probe that did not run here still replays on its golden inputs (the module exists).
    assert by_name["layers.0.probe"].isolated.status == "pass"
    assert by_name["layers.1.extra"].isolated is None
    assert report.to_dict()["summary"]["statuses"] == {
        "pass": len(report.layers) - 4, "fused-here": 1, "missing-in-golden": 1, "shape-mismatch": 1,
        "dtype-mismatch": 1}
    # layers.0.probe never ran here, but layers.0, which encloses it, was compared: fused here,
    # not a failure; with strict structure it is missing-here again.
    assert by_name["layers.0.probe"].passed and by_name["layers.0.probe"].attribution == "none"
    assert "layers.0" in by_name["layers.0.probe"].note
    assert any("fused here" in w and "layers.0.probe" in w for w in report.warnings)
    strict = compare_bundle(bundles / "stack", impl="mismatch", device="cpu", policy=Policy(strict_structure=True))
    assert _by_name(strict)["layers.0.probe"].status == "missing-here"
    assert strict.first_failing_layer == "layers.0.probe" and len(strict.failing) == 4
    json.dumps(report.to_dict(), allow_nan=False)


def test_the_example_subjects_ported_activation_is_the_first_failing_layer(bundles):
    report = compare_bundle(bundles / "example", impl="tanh", device="cpu")
    assert [(r.name, r.status) for r in report.layers][:3] == [
        ("block.norm", "pass"), ("block.proj", "pass"), ("block", "fail")]
    assert report.first_failing_layer == "block"  # the tanh GELU approximation is the change


def test_progress_lines_give_the_total_and_count_in_words(bundles, monkeypatch):
    from parity.judge import compare as compare_module
    from parity.run.runtime import Progress

    # every tick emitted (the real interval is 2 s), so that the running line can be read
    monkeypatch.setattr(compare_module, "Progress", lambda emit: Progress(emit, every_s=0.0))
    lines: list[str] = []
    report = compare_bundle(bundles / "example", impl="tanh", device="cpu", progress=lines.append)
    total = len(report.layers)
    ticks = [line for line in lines if line.startswith("compared ") and " of " in line]
    assert ticks[0] == "compared 1 of 10 tensors (0 failing)" and total == 10
    assert ticks[-1] == f"compared 10 of 10 tensors ({len(report.failing)} failing)"
    assert re.fullmatch(rf"compared 10 tensors in \d+\.\d s: {len(report.failing)} failing", lines[-1])


def test_progress_is_written_one_line_per_write():
    # torchrun's ranks share stderr unbuffered: a line and its newline must be one write.
    import io

    from parity.base.text import plural, write_line
    from parity.cli.commands._output import stderr_progress

    class Recording(io.StringIO):
        writes: list[str] = []

        def write(self, text):
            self.writes.append(text)
            return super().write(text)

    stream = Recording()
    write_line(stream, "parity capture [rank 1]: recorded 28 tensors")
    assert stream.writes == ["parity capture [rank 1]: recorded 28 tensors\n"]
    stderr = Recording()
    stderr.writes = []
    original = sys.stderr
    sys.stderr = stderr
    try:
        stderr_progress("compare")("compared 1 tensor")
    finally:
        sys.stderr = original
    assert stderr.writes == ["parity compare: compared 1 tensor\n"]
    assert (plural(1, "tensor"), plural(0, "tensor"), plural(19, "tensor")) == ("1 tensor", "0 tensors", "19 tensors")


# ---- fingerprint ----------------------------------------------------------------------------------


def test_numerics_fingerprint_difference_is_a_warning_not_a_failure(bundles, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(bundles / "stack", copy)
    edit_manifest(copy, lambda manifest: manifest["platform"].update({
        "tf32_matmul": True, "vendor": "nvidia", "arch": "sm_90", "device_name": "NVIDIA H200",
        "triton_default_fp_fusion": "1"}))
    report = compare_bundle(copy, impl="reference", device="cpu")
    assert report.passed
    assert [(d.key, d.golden, d.here) for d in report.fingerprint_differences] == [
        ("tf32_matmul", True, False), ("triton_default_fp_fusion", "1", None)]
    assert report.warnings[0].startswith("tf32_matmul differs: golden host True, this host False")
    assert report.hosts["golden"]["device_name"] == "NVIDIA H200" and report.hosts["here"]["vendor"] == "cpu"
    data = report.to_dict()
    assert data["fingerprint_differences"][0]["key"] == "tf32_matmul"


# ---- single tensors (the plugin's assertion) -------------------------------------------------


def test_compare_tensors_single():
    gen = torch.Generator().manual_seed(0)
    golden = torch.randn(64, 64, generator=gen).to(torch.bfloat16)
    same = compare_tensors("t", golden.clone(), golden)
    assert same.passed and same.metrics.ulp_max == 0 and same.dtype == "bfloat16"
    noisy = golden.float() + 0.05 * torch.randn(64, 64, generator=gen)
    bad = compare_tensors("t", noisy.to(torch.bfloat16), golden)
    assert bad.status == "fail" and bad.failed_checks()["max_rel_l2"] > 2.5e-2
    loose = Policy(overrides=(LayerOverride("t", {"max_rel_l2": 0.2, "min_cosine": 0.9, "atol": 1.0}),))
    assert compare_tensors("t", noisy.to(torch.bfloat16), golden, policy=loose).passed
    assert compare_tensors("t", golden[:32], golden).status == "shape-mismatch"
    cast = compare_tensors("t", golden.float(), golden)
    assert cast.status == "dtype-mismatch" and cast.metrics.max_abs == 0
    reference = golden.double() + 1e-3
    # With a reference the budget judges by default (k = 2), with the thresholds as backstop.
    with_ref = compare_tensors("t", golden.clone(), golden, reference=reference)
    assert with_ref.budget.k == DEFAULT_BUDGET_K and with_ref.rule == "budget" and with_ref.passed
    assert with_ref.budget.host_rel_l2 == with_ref.budget.capture_rel_l2
    assert same.rule == "thresholds" and same.budget is None  # no reference: thresholds alone
    off = compare_tensors("t", golden.clone(), golden, reference=reference, budget=False)
    assert off.rule == "thresholds" and off.budget.k is None and off.budget.host_rel_l2 is not None
    assert compare_tensors("t", golden.clone(), golden, reference=reference, budget=True).passed
    ints = compare_tensors("ids", torch.arange(5), torch.arange(5), budget=True)
    assert ints.passed and ints.tolerance.budget_k is None and ints.budget is None
    assert compare_tensors("ids", torch.tensor([0, 1, 2]), torch.tensor([0, 1, 3])).status == "fail"


# ---- usage errors (library) -----------------------------------------------------------------


def test_isolate_without_recorded_inputs_is_a_usage_error(bundles):
    with pytest.raises(UsageError, match=r"--isolate needs a bundle captured with --record-inputs"):
        compare_bundle(bundles / "decoder", impl="reference", device="cpu", isolate=True)


def test_triton_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setitem(sys.modules, "triton", sys.modules.get("triton") or object())
    # Triton already imported: a non-Triton impl is left alone, impl "triton" cannot run.
    assert enable_triton_interpreter("reference", "cpu") is False
    assert enable_triton_interpreter("triton", "cuda") is False
    with pytest.raises(UsageError, match=r"needs the Triton interpreter"):
        enable_triton_interpreter("triton", "cpu")  # too late: triton is imported
    monkeypatch.delitem(sys.modules, "triton")
    assert enable_triton_interpreter("triton", "cpu") is True
    assert os.environ["TRITON_INTERPRET"] == "1"
    assert enable_triton_interpreter("triton", "cpu") is False  # already on
    # Any impl on a CPU device switches it on while it still can (a user's "kernel" impl).
    monkeypatch.delenv("TRITON_INTERPRET")
    assert enable_triton_interpreter("kernel", "cpu") is True and os.environ["TRITON_INTERPRET"] == "1"


def test_policy_for_cli_reads_pyproject_tool_parity(tmp_path):
    assert policy_for_cli(None, cwd=tmp_path).source == "built-in defaults"
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    assert policy_for_cli(None, cwd=tmp_path).source == "built-in defaults"
    (tmp_path / "pyproject.toml").write_text("[tool.parity.defaults.bf16]\nmax_rel_l2 = 0.03\n")
    policy = policy_for_cli(None, cwd=tmp_path)
    assert policy.resolve("x", torch.bfloat16).max_rel_l2 == 0.03
    (tmp_path / "pyproject.toml").write_text("[tool.parity\n")
    with pytest.raises(UsageError, match=r"pyproject.toml: invalid TOML"):
        policy_for_cli(None, cwd=tmp_path)


# ---- CLI ----------------------------------------------------------------------------------------


@pytest.fixture
def cli(capsys):
    def run(args):
        code = parity.cli.main.main(["compare", *args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


def test_cli_parity_holds(bundles, cli, tmp_path):
    code, out, err = cli(["--golden", str(bundles / "stack"), "--impl", "reference", "--device", "cpu",
                          "--isolate", "--json", str(tmp_path / "r.json"), "--junit-xml", str(tmp_path / "r.xml")])
    assert code == 0, err
    assert out.rstrip().splitlines()[-1] == "PARITY HOLDS: 15/15 tensors"
    # at 120 columns the isolated rel L2 and attribution share one column, beside measured / derived
    assert "| tensor " in out and "| isolated " in out and "| iso/bound " in out
    assert "parity compare: " in err  # progress
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["passed"] is True and data["summary"]["layers"] == 15
    suite = ET.parse(tmp_path / "r.xml").getroot().find("testsuite")
    assert suite.get("tests") == "15" and suite.get("failures") == "0"


def test_cli_parity_fails_names_the_layer_and_writes_reports(bundles, cli, tmp_path):
    json_file, junit_file = tmp_path / "r.json", tmp_path / "r.xml"
    code, out, err = cli(["--golden", str(bundles / "stack"), "--impl", "perturbed", "--device", "cpu", "--quiet",
                          "--isolate", "--budget", "--json", str(json_file), "--junit-xml", str(junit_file)])
    assert code == 1 and err == ""
    lines = out.rstrip().splitlines()
    assert re.fullmatch(r"PARITY FAILS: first failing tensor layers\.2\.linear \(9 of 15 tensors fail\)", lines[-1])
    assert "error introduced by (fails on its golden inputs, innermost modules): layers.2.linear\n" in out
    assert re.search(r"^    would pass with: .*max_rel_l2 = \d\.\de-\d+", out, re.M)
    assert "inherited" in out and "| isolated " in out  # the narrow table: --wide has "ref rel L2 here"
    assert max(len(line) for line in out.splitlines() if line.startswith("|")) <= 120

    data = json.loads(json_file.read_text())
    assert data["passed"] is False and data["summary"]["first_failing_layer"] == "layers.2.linear"
    assert data["summary"]["introducing_layers"] == ["layers.2.linear"]
    layers = {layer["name"]: layer for layer in data["layers"]}
    library = _by_name(compare_bundle(bundles / "stack", impl="perturbed", device="cpu", budget=True))
    bug = layers["layers.2.linear"]
    assert bug["metrics"]["rel_l2"] == library["layers.2.linear"].metrics.rel_l2
    assert bug["budget"]["host_rel_l2"] == library["layers.2.linear"].budget.host_rel_l2
    assert bug["isolated"]["status"] == "fail" and layers["layers.3"]["attribution"] == "inherited"
    assert bug["failed_checks"]["max_rel_l2"] == bug["metrics"]["rel_l2"]

    suite = ET.parse(junit_file).getroot().find("testsuite")
    cases = suite.findall("testcase")
    assert len(cases) == 15 and suite.get("failures") == str(data["summary"]["failing"])
    failed = {case.get("name"): case.find("failure") for case in cases if case.find("failure") is not None}
    assert list(failed)[0] == "layers.2.linear" and "layers.1" not in failed
    assert "would pass with: " in failed["layers.2.linear"].text and failed["layers.2.linear"].get("type") == "fail"


def test_cli_triton_on_cpu(tmp_path, cli):
    capture("attention", tmp_path / "b", subject_args={"cases": "smoke"}, reference="none")
    code, out, err = cli(["--golden", str(tmp_path / "b"), "--quiet"])  # --impl triton is the default
    assert code == 0, err
    assert "this host:   cpu x86_64" in out or "this host:   cpu" in out
    assert "; impl triton on cpu" in out and out.rstrip().endswith("PARITY HOLDS: 4/4 tensors")


def _corrupt_output(bundle: Path, name: str) -> None:
    """Flip one byte inside the stored tensor ``name`` (its data, not the shard's header)."""
    entry = open_bundle(bundle).entry(name)
    shard = bundle / entry.shard
    data = bytearray(shard.read_bytes())
    header_size = int.from_bytes(data[:8], "little")
    start, _ = json.loads(data[8:8 + header_size])[entry.key]["data_offsets"]
    data[8 + header_size + start] ^= 0xFF
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("case, message", [
    ("missing", r"bundle .*nowhere does not exist"),
    ("corrupt", r"shard-\d+\.safetensors: checksum mismatch for output 'layers\.3\.probe': the shard is corrupted"),
    ("tolerances", r"bad\.toml: defaults\.bf16\.max_rel: unknown key"),
    ("isolate", r"--isolate needs a bundle captured with --record-inputs"),
    ("impl", r"subject stack has no implementation 'cuda-original'; choose from reference, perturbed, mismatch"),
    ("device", r"bad device 'tpu'"),
    ("budget", r"--budget needs high-precision references"),
    ("json", r"--json .*missing-dir/r\.json: directory .* does not exist"),
    ("max-rows", r"--max-rows must be at least 1"),
    ("manifest", r"manifest\.json: invalid JSON"),
])
def test_cli_unusable_input_is_one_line_and_exit_2(bundles, cli, tmp_path, case, message):
    golden = bundles / "stack"
    args = ["--impl", "reference", "--device", "cpu", "--quiet"]
    if case == "missing":
        golden = tmp_path / "nowhere"
    elif case in ("corrupt", "manifest"):
        golden = tmp_path / "copy"
        shutil.copytree(bundles / "stack", golden)
        if case == "corrupt":
            _corrupt_output(golden, "layers.3.probe")  # found mid-run, when its counterpart arrives
        else:
            (golden / "manifest.json").write_text("{not json")
    elif case == "tolerances":
        (tmp_path / "bad.toml").write_text("[defaults.bf16]\nmax_rel = 1\n")
        args += ["--tolerances", str(tmp_path / "bad.toml")]
    elif case == "isolate":
        golden = bundles / "stack-plain"
        args += ["--isolate"]
    elif case == "impl":
        args = ["--impl", "cuda-original", "--quiet"]
    elif case == "device":
        args = ["--device", "tpu"]
    elif case == "budget":
        golden = bundles / "stack-plain"
        args += ["--budget"]
    elif case == "json":
        args += ["--json", str(tmp_path / "missing-dir" / "r.json")]
    elif case == "max-rows":
        args += ["--max-rows", "0"]
    code, out, err = cli(["--golden", str(golden), *args])
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("parity: error: "), err
    assert re.search(message, err), err


def test_cli_missing_golden_argument_is_exit_2(capsys):
    # argparse's own usage errors come back from main() as exit status 2, like every user error
    assert parity.cli.main.main(["compare", "--impl", "reference"]) == 2
    err = capsys.readouterr().err
    assert err == "parity: error: the following arguments are required: --bundle/--golden\n"


def test_cli_long_tables_collapse_passing_runs(bundles, cli):
    code, out, _ = cli(["--golden", str(bundles / "decoder"), "--impl", "reference", "--device", "cpu",
                        "--quiet", "--max-rows", "8"])
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert any("passing ..." in row for row in rows)
    assert len(rows) - 1 <= 8  # minus the header row
    assert rows[1].startswith("| embed ") and rows[-1].startswith("| <root> ")  # a terminal table: no Markdown escapes


def test_budget_numbers_are_in_golden_order_and_finite(bundles):
    report = compare_bundle(bundles / "decoder", impl="reference", device="cpu", budget=True)
    for result in report.layers:
        assert math.isfinite(result.budget.host_rel_l2) and result.budget.capture_rel_l2 >= 0


# --- reading goldens ahead (issue 16) -------------------------------------------------------------

def _bench_bundle(tmp_path):
    """A bundle of the harness benchmark's subject (a stack of fp32 blocks, bench/harness)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "harness"))
    try:
        import harness_benchmark as benchmark
    finally:
        sys.path.pop(0)
    from parity.run.subjects import load_subject

    runner = load_subject(benchmark.SPEC, {"layers": 3, "width": 8, "tokens": 4})
    capture(runner, tmp_path / "b", impl="reference", device="cpu", reference="fp64", shard_bytes=512)
    return open_bundle(tmp_path / "b")


def _record_load_threads(bundle, monkeypatch):
    import threading

    threads: list[tuple[str, str, str]] = []
    load = type(bundle).load

    def recording_load(self, entry, kind="output", **kwargs):
        name = entry if isinstance(entry, str) else entry.name
        threads.append((kind, name, threading.current_thread().name))
        return load(self, entry, kind, **kwargs)

    monkeypatch.setattr(type(bundle), "load", recording_load)
    return threads


def test_the_judge_reads_every_golden_and_reference_ahead_on_its_thread_and_judges_as_without(tmp_path, monkeypatch):
    from parity.judge.engine import Judge, Obtained

    bundle = _bench_bundle(tmp_path)
    names = [entry.name for entry in bundle.entries_of("output")]
    outputs = {name: bundle.load(name) * 1.0000001 for name in names}  # near, not equal
    plain = [Judge(bundle)(Obtained(name, outputs[name])) for name in names]
    threads = _record_load_threads(bundle, monkeypatch)
    judge = Judge(bundle, read_ahead=names)
    try:
        ahead = [judge(Obtained(name, outputs[name])) for name in names]
    finally:
        judge.close()
    assert [r.to_dict() for r in ahead] == [r.to_dict() for r in plain]
    assert all(r.budget is not None and r.budget.host_vs_reference is not None for r in ahead)
    loaded = [(kind, name) for kind, name, _ in threads]
    assert sorted(loaded) == sorted([(kind, name) for name in names for kind in ("output", "reference")])
    on_main = [(kind, name) for kind, name, thread in threads if not thread.startswith("parity-read")]
    assert on_main == [], f"read on the main thread, not ahead: {on_main}"


def test_read_ahead_out_of_order_and_damage_are_as_without_it(tmp_path):
    from parity.base.errors import BundleError
    from parity.judge.engine import ReadAhead

    bundle = _bench_bundle(tmp_path)
    names = [entry.name for entry in bundle.entries_of("output")]
    reader = ReadAhead(bundle, [("output", name) for name in names])
    try:
        # the last first, then the first: both read, each equal to a direct read
        for name in (names[-1], names[0], names[1]):
            assert torch.equal(reader.load("output", name, "cpu"), bundle.load(name))
    finally:
        reader.close()
    entry = bundle.entry(names[2])
    shard = tmp_path / "b" / entry.shard
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # the last byte of the shard: some tensor's data
    os.chmod(shard, 0o644)
    shard.write_bytes(bytes(data))
    reader = ReadAhead(open_bundle(tmp_path / "b"), [(k, n) for n in names for k in ("reference", "output")])
    try:
        with pytest.raises(BundleError, match="checksum mismatch"):  # raised by load, as a direct read would
            for name in names:
                reader.load("reference", name, None)
                reader.load("output", name, None)
    finally:
        reader.close()


def test_isolate_names_a_linear_beyond_its_derived_bound_without_changing_the_verdict(bundles):
    report = compare_bundle(bundles / "stack", impl="perturbed", device="cpu", isolate=True)
    by_name = _by_name(report)
    perturbed = by_name["layers.2.linear"].isolated.derived
    assert perturbed is not None and perturbed.op.startswith("linear K=")
    assert perturbed.beyond and perturbed.ratio > 100  # a sin-shaped offset is no rounding
    assert [result.name for result in report.beyond_derived_bound] == ["layers.2.linear"]
    # every other Linear replays bit for bit: measured 0 against a positive bound
    exact = by_name["layers.0.linear"].isolated.derived
    assert exact.ratio == 0 and exact.derived_max > 0 and not exact.beyond
    # blocks (several ops) have no bound; end-to-end results never do
    assert by_name["layers.0"].isolated.derived is None
    assert all(result.derived is None for result in report.layers)
    summary = report.to_dict()["summary"]
    assert summary["beyond_derived_bound"] == ["layers.2.linear"]
    assert report.to_dict()["layers"][names_index(report, "layers.2.linear")]["isolated"]["derived_bound"]["beyond"]


def names_index(report, name):
    return [result.name for result in report.layers].index(name)


def test_reports_show_measured_over_derived_for_isolated_known_ops(bundles):
    from parity.report.html import render_html
    from parity.report.junit import to_junit_xml
    from parity.report.text import format_text
    report = compare_bundle(bundles / "stack", impl="perturbed", device="cpu", isolate=True)
    text = format_text(report)
    assert "iso/bound" in text
    assert "beyond derived bound: layers.2.linear (linear K=" in text
    row = next(line for line in text.splitlines() if line.startswith("| layers.2.linear "))
    assert "x!" in row
    html = render_html(report.to_dict())
    assert "iso/bound" in html and 'class="beyond"' in html
    assert "beyond derived bound</th><td>layers.2.linear" in html
    xml = to_junit_xml(report)
    assert 'name="beyond_derived_bound" value="layers.2.linear"' in xml
    assert "isolated measured/derived bound: 0.0 (linear K=" in xml
