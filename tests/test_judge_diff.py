"""``parity diff A B``: two captures judged against each other without running anything.

On real captured pairs: the same subject captured twice here (holds, every tensor bitwise equal);
the committed H200 goldens against a capture of the same subject on this CPU (holds: real numbers
from another host); a copy with one tensor scaled by 1.01, rewritten from outside (fails, naming
that tensor); bundles of other arguments, inputs or weights, damaged bundles and bundles with
nothing in common (refused, exit 2, one line). Then structure (tensors on one side only) and the
error budget across two bundles' references.
"""
from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from parity.bundle import checksums
from parity.bundle.writer import edit_manifest
from parity.bundle.reader import open_bundle
from parity.run.capture import capture
from parity.cli.main import main
from parity.judge.diff import diff_bundles, same_arguments
from parity.judge.policy import Policy
from parity.report.text import growth_line

from bundle_versions import as_version

REPO = Path(__file__).resolve().parents[1]
H200_ATTENTION = REPO / "golden" / "h200-attention"
SMALL_DECODER = {"layers": 2, "seq_len": 64, "batch": 1, "d_model": 64, "ffn_dim": 128, "vocab": 64}
FIRST_OUT = "B1-Hq2-Hkv1-Sq64-Sk64-D32-causal-fp16-s0/out"


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("diff")
    for name in ("att-a", "att-b"):
        capture("attention", root / name, subject_args={"cases": "smoke"}, impl="reference")
    capture("attention", root / "att-noref", subject_args={"cases": "smoke"}, impl="reference", reference="none")
    capture("attention", root / "att-fp32ref", subject_args={"cases": "smoke"}, impl="reference", reference="fp32")
    capture("decoder", root / "dec", subject_args=SMALL_DECODER, impl="reference", reference="none")
    capture("decoder", root / "dec-head", subject_args=SMALL_DECODER, impl="reference", reference="none",
            layers=["lm_head"])
    capture("decoder", root / "dec-embed", subject_args=SMALL_DECODER, impl="reference", reference="none",
            layers=["embed"])
    capture("decoder", root / "dec-seed1", subject_args={**SMALL_DECODER, "seed": 1}, impl="reference",
            reference="none", layers=["lm_head"])
    return root


@pytest.fixture
def cli(capsys):
    def run(*args: str) -> tuple[int, str, str]:
        code = main(["diff", *map(str, args)])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


def rewrite_tensor(bundle: Path, kind: str, name: str, change) -> None:
    """Replace one stored tensor by ``change(tensor)`` from outside the library (safetensors
    directly), then fix the shard's and the entry's checksums through ``edit_manifest``."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    entry = next(e for e in manifest["entries"] if e["kind"] == kind and e["name"] == name)
    shard = bundle / entry["shard"]
    with safe_open(str(shard), framework="pt") as handle:
        metadata = handle.metadata()
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    tensors[entry["key"]] = change(tensors[entry["key"]])
    save_file(tensors, str(shard), metadata=metadata)
    data = shard.read_bytes()

    header = data[:8 + int.from_bytes(data[:8], "little")]

    def fix(m):
        algorithm = checksums.ALGORITHM_OF_VERSION[m["schema_version"]]
        for item in m["shards"]:
            if item["file"] == entry["shard"]:
                item["bytes"], item[f"header_{algorithm}"] = len(data), checksums.of_buffer(algorithm, header)
        for item in m["entries"]:
            if item["kind"] == kind and item["name"] == name:
                item[algorithm] = checksums.of_tensor(algorithm, tensors[entry["key"]])

    edit_manifest(bundle, fix)


# ---- captured pairs -----------------------------------------------------------------------------


def test_equal_captures_hold_with_every_tensor_bitwise_equal(bundles, cli, tmp_path):
    report_file = tmp_path / "r.json"
    code, out, err = cli(bundles / "att-a", bundles / "att-b", "--quiet", "--json", report_file)
    assert code == 0 and err == "", err
    assert out.rstrip().splitlines()[-1] == "PARITY HOLDS: 4/4 tensors"
    assert out.startswith(f"parity diff: golden {bundles / 'att-a'} vs candidate {bundles / 'att-b'}")
    report = json.loads(report_file.read_text())
    assert report["passed"] and report["candidate"] == str(bundles / "att-b")
    assert report["rules"] == {"budget": 4}  # both hold fp64 references
    assert all(layer["metrics"]["max_abs"] == 0 and layer["metrics"]["cosine"] == 1 for layer in report["layers"])
    assert all(layer["budget"]["rel_l2_ratio"] == 1 for layer in report["layers"])  # the same arithmetic


@pytest.mark.slow  # a CPU capture of the decoder
def test_h200_goldens_against_a_cpu_capture_hold(tmp_path):
    """Real material from another host: the committed H200 capture of the attention cases against
    the same subject captured here on the CPU (inputs drawn on the CPU, so their checksums agree)."""
    cpu = tmp_path / "cpu-attention"
    capture("attention", cpu, impl="reference", reference="fp64")
    report = diff_bundles(H200_ATTENTION, cpu)
    assert report.passed, [r.verdict.reasons for r in report.failing]
    assert len(report.layers) == 16 and report.rules == {"budget": 16}
    assert report.hosts["golden"]["vendor"] == "nvidia" and report.hosts["here"]["vendor"] == "cpu"
    # Different hardware, different numbers: the fp16 and bf16 outputs are not bitwise equal, but
    # within twice the H200's own error against the fp64 reference.
    outs = {r.name: r for r in report.layers if r.name.endswith("/out")}
    assert sum(r.metrics.max_abs > 0 for r in outs.values()) >= 4
    assert all(r.budget.host_rel_l2 <= 2 * r.budget.capture_rel_l2 + 1e-6 for r in report.layers)
    assert not any("reference differs" in w for w in report.warnings)  # both fp64 on a CPU
    # The default case set: 8 independent cases, so the report gives the peak error, not a growth.
    assert report.independent_cases == 8
    assert growth_line(report).startswith("error (rel L2) over 8 independent cases, so no growth to follow: peak ")


def test_one_tensor_scaled_by_1_01_fails_and_is_named(bundles, cli, tmp_path):
    perturbed = tmp_path / "perturbed"
    shutil.copytree(bundles / "att-b", perturbed)
    rewrite_tensor(perturbed, "output", FIRST_OUT, lambda t: t * 1.01)
    open_bundle(perturbed).verify()  # a valid bundle: only the numbers changed
    junit = tmp_path / "r.xml"
    code, out, err = cli(bundles / "att-a", perturbed, "--quiet", "--junit-xml", junit)
    assert code == 1 and err == ""
    assert out.rstrip().splitlines()[-1] == f"PARITY FAILS: first failing tensor {FIRST_OUT} (1 of 4 tensors fail)"
    report = diff_bundles(bundles / "att-a", perturbed)
    (failing,) = report.failing
    assert failing.name == FIRST_OUT and failing.metrics.rel_l2 == pytest.approx(0.01, rel=0.05)
    assert set(failing.failed_checks()) >= {"max_rel_l2", "budget_k"}
    assert 'failures="1"' in junit.read_text()


def test_other_arguments_are_refused(bundles, cli):
    code, out, err = cli(bundles / "dec-head", bundles / "dec-seed1")
    assert code == 2 and out == ""
    assert err.strip() == (f"parity: error: cannot diff {bundles / 'dec-head'} and {bundles / 'dec-seed1'}: their "
                           "subject arguments differ (first at seed: 0 vs 1)")


@pytest.mark.parametrize("kind, name, what", [("input", f"{FIRST_OUT.rsplit('/', 1)[0]}/q", "inputs"),
                                              ("state", None, "weights")])
def test_other_inputs_or_weights_are_refused(bundles, cli, tmp_path, kind, name, what):
    source = bundles / ("att-b" if kind == "input" else "dec")
    other = tmp_path / "other"
    shutil.copytree(source, other)
    name = name or open_bundle(other).entries_of("state")[0].name
    rewrite_tensor(other, kind, name, lambda t: t + 1)
    code, out, err = cli(source, other)
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert f"their {what} differ (blake3 checksums of {name})" in err


@pytest.mark.parametrize("changed", [False, True])
def test_inputs_are_compared_across_checksum_algorithms(bundles, cli, tmp_path, changed):
    """A golden written by an older parity (schema 3: sha256) against a capture of this one
    (BLAKE3): the candidate's inputs are read and hashed with the golden's algorithm, so equal
    inputs pass and changed ones are still refused."""
    old = tmp_path / "old"
    shutil.copytree(bundles / "att-b", old)
    as_version(old, 3)
    name = f"{FIRST_OUT.rsplit('/', 1)[0]}/q"
    candidate = bundles / "att-a"
    if changed:
        candidate = tmp_path / "changed"
        shutil.copytree(bundles / "att-a", candidate)
        rewrite_tensor(candidate, "input", name, lambda t: t + 1)
    code, out, err = cli(old, candidate, "--quiet")
    if changed:
        assert code == 2 and f"their inputs differ (sha256 checksums of {name})" in err
    else:
        assert code == 0 and err == "", err


def test_damaged_bundles_are_refused_in_one_line(bundles, cli, tmp_path):
    truncated = tmp_path / "truncated"
    shutil.copytree(bundles / "att-b", truncated)
    shard = next(truncated.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:1000])
    bad_manifest = tmp_path / "bad-manifest"
    shutil.copytree(bundles / "att-b", bad_manifest)
    (bad_manifest / "manifest.json").write_text("{not json")
    for damaged in (truncated, bad_manifest):
        report_file = tmp_path / f"{damaged.name}.json"
        code, out, err = cli(bundles / "att-a", damaged, "--json", report_file)
        assert code == 2 and out == "" and len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert str(damaged) in err
        written = json.loads(report_file.read_text())  # a report saying so, never a half-written one
        assert written["passed"] is False and written["error"]["status"] == 2


def test_nothing_in_common_is_refused(bundles, cli):
    code, out, err = cli(bundles / "dec-head", bundles / "dec-embed")
    assert code == 2 and "they have no recorded tensor in common" in err


# ---- structure ------------------------------------------------------------------------------------


def test_tensors_only_in_the_candidate_are_a_warning_unless_strict(bundles, cli):
    code, out, err = cli(bundles / "dec-head", bundles / "dec", "--quiet")
    assert code == 0 and out.rstrip().endswith("PARITY HOLDS: 1/1 tensors")
    extra = len(open_bundle(bundles / "dec").entries_of("output")) - 1
    assert f"warning: {extra} recorded tensors only in the candidate, not judged" in out
    code, out, _ = cli(bundles / "dec-head", bundles / "dec", "--quiet", "--strict-structure")
    assert code == 1 and f"({extra} of {extra + 1} tensors fail)" in out and "FAIL missing in golden" in out


def test_tensors_only_in_the_golden_are_missing(bundles, cli):
    code, out, _ = cli(bundles / "dec", bundles / "dec-head", "--quiet")
    assert code == 1
    report = diff_bundles(bundles / "dec", bundles / "dec-head")
    statuses = {r.name: r.status for r in report.layers}
    assert statuses["lm_head"] == "pass" and statuses["embed"] == "missing-here"
    # Each golden-only tensor sits where the golden recorded it (execution order).
    assert [r.name for r in report.layers] == [e.name for e in open_bundle(bundles / "dec").entries_of("output")]
    assert sum(r.status == "missing-here" for r in report.layers) == len(report.layers) - 1
    assert "missing in the candidate bundle" in report.failing[0].verdict.reasons[0]


# ---- the error budget across two bundles -----------------------------------------------------------


def test_budget_needs_references_in_both(bundles, cli):
    report = diff_bundles(bundles / "att-a", bundles / "att-noref")
    assert report.passed and report.rules == {"thresholds": 4}  # default: budget only where both have one
    code, out, err = cli(bundles / "att-a", bundles / "att-noref", "--budget")
    assert code == 2 and f"{bundles / 'att-noref'} was captured with --reference none" in err
    code, out, _ = cli(bundles / "att-a", bundles / "att-b", "--no-budget", "--quiet")
    assert code == 0 and "fixed thresholds alone on 4 (--no-budget)" in out


def test_a_reference_computed_otherwise_is_a_warning(bundles):
    report = diff_bundles(bundles / "att-a", bundles / "att-fp32ref")  # fp64 golden refs, fp32 candidate refs
    assert report.passed and report.rules == {"budget": 4}
    (warning,) = [w for w in report.warnings if "reference differs" in w]
    assert "for 4 tensors" in warning and "the budget used the golden's reference" in warning


def test_policy_applies_as_in_compare(bundles, tmp_path):
    tight = Policy.from_mapping({"layers": [{"match": "*/lse", "max_rel_l2": 0.0}]}, source="test")
    perturbed = tmp_path / "p"
    shutil.copytree(bundles / "att-b", perturbed)
    rewrite_tensor(perturbed, "output", FIRST_OUT.replace("/out", "/lse"), lambda t: t * (1 + 1e-6))
    assert diff_bundles(bundles / "att-a", perturbed, budget=False).passed  # 1e-6 is within fp32's 2e-5
    report = diff_bundles(bundles / "att-a", perturbed, policy=tight, budget=False)
    assert [r.name for r in report.failing] == [FIRST_OUT.replace("/out", "/lse")]


def test_same_arguments_treats_absent_fields_as_neutral_defaults():
    assert same_arguments({"cases": [{"seed": 0}]}, {"cases": [{"seed": 0, "prefix": 0, "docs": 0}]})
    assert not same_arguments({"cases": [{"seed": 0}]}, {"cases": [{"seed": 0, "prefix": 3}]})
    assert not same_arguments({"flag": True}, {"flag": 1}) and not same_arguments([1, 2], [1])


# ---- layout ----------------------------------------------------------------------------------------


def test_no_module_imports_another_modules_private_name():
    offenders = []
    for file in (REPO / "parity").rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            internal = node.level > 0 or (node.module or "").split(".")[0] == "parity"
            if internal and any(
                    alias.name.startswith("_") and not alias.name.startswith("__") for alias in node.names):
                offenders.append(f"{file.relative_to(REPO)}:{node.lineno}")
    assert offenders == []
