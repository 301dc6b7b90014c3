"""``parity bench --bundle`` of a bundle whose weights are by reference (captured with ``--weights-from``).

The same capture is made twice, one bundle storing its weights and one naming the checkpoint
file that holds them; bench must time, judge and gate both alike. The checkpoint is verified
(size and digest) before anything is built, and a missing or changed file is refused with one
line naming it, exit 2, no report of a run.

Subject: ``speed_subjects``' matmul (``reference`` sums 32 chunk products, ``fast`` is one matmul,
``wrong`` skips the product), on its virtual clock so the speed verdicts are known in advance.
"""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

import speed_subjects
from speed_subjects import MATMUL_SPEC
from speed_subjects import single_cpu_thread_fixture, virtual_clock_fixture  # noqa: F401 (fixtures)

from parity.base.errors import UsageError
from parity.base.jsonformat import schema_for
from parity.bundle.manifest import Entry
from parity.bundle.reader import open_bundle
from parity.cli.main import main
from parity.run.capture import capture
from parity.run.subjects import load_subject
from parity.run.subjects.base import SubjectRunner
from parity.speed import bench as bench_lib

import jsonschema  # a test dependency (pyproject's test extra): missing, the file errors, never skips

IMPLS = "reference,fast,wrong"
ENTRY = Entry(kind="output", name="", dtype="float32", shape=(1,), shard="s", key="k", checksum="", nbytes=4)


@pytest.fixture
def bundles(tmp_path):
    """(stored, by_reference, checkpoint file): one capture of the matmul with an fp64 reference,
    once storing its weights and once naming the checkpoint file that holds them."""
    state = load_subject(MATMUL_SPEC).make_state()
    checkpoint = tmp_path / "ckpt" / "model.safetensors"
    checkpoint.parent.mkdir()
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(checkpoint))
    stored = capture(MATMUL_SPEC, tmp_path / "stored", impl="reference", reference="fp64").path
    by_reference = capture(MATMUL_SPEC, tmp_path / "byref", impl="reference", reference="fp64",
                           weights_from=[checkpoint]).path
    named = open_bundle(by_reference)
    assert [file["name"] for file in named.weights["files"]] == ["model.safetensors"]
    assert not named.entries_of("state")  # every weight is in the file, none stored
    assert named.entries_of("reference") and open_bundle(stored).entries_of("reference")
    return stored, by_reference, checkpoint


def run_bench(tmp_path, bundle, *extra):
    out = tmp_path / "bench.json"
    out.unlink(missing_ok=True)
    status = main(["bench", "--quiet", "--reps", "6", "--warmup", "1", "--no-device-time", "--json", str(out),
                   "--bundle", str(bundle), "--impls", IMPLS, *extra])
    document = json.loads(out.read_text())
    jsonschema.validate(document, schema_for("parity-bench-report"))
    return status, document


def verdicts(document):
    return {row["impl"]: (row["parity"], row.get("valid"), row.get("validity"), row.get("vs_baseline", {}).get("verdict"))
            for row in document["impls"]}


def test_by_reference_bundle_gives_the_stored_bundles_verdicts(tmp_path, bundles, virtual_clock):
    stored, by_reference, _ = bundles
    stored_status, stored_doc = run_bench(tmp_path, stored)
    status, document = run_bench(tmp_path, by_reference)
    assert status == stored_status == 1  # wrong is the fastest and fails parity
    assert verdicts(document) == verdicts(stored_doc)
    rows = {row["impl"]: row for row in document["impls"]}
    assert rows["reference"]["parity"]["status"] == "holds"  # judged against the golden, not a baseline
    assert rows["fast"]["valid"] is True and rows["fast"]["validity"] == "valid: parity holds"
    assert rows["fast"]["vs_baseline"]["verdict"] == "FASTER"
    assert rows["wrong"]["validity"] == "not valid: parity fails at <root>"
    assert document["verdict"] == stored_doc["verdict"]
    assert document["verdict"].startswith("SPEEDUP NOT VALID: the fastest impl, wrong, fails parity at <root>")
    assert document["settings"]["judged_against"] == "the bundle's golden"
    assert all(row["parity"]["results"][0]["budget_checked"] for row in document["impls"])  # the fp64 reference's
    assert "1 checkpoint file(s) it names, size and digest verified" in document["inputs"]
    assert "checkpoint" not in stored_doc["inputs"]


def _prepared(bundle, **kwargs):
    return bench_lib.prepare(None, None, impls=IMPLS.split(","), device=torch.device("cpu"), bundle=open_bundle(bundle),
                             **kwargs)


def test_every_impl_is_built_with_the_checkpoints_weights_and_gives_the_same_outputs(bundles):
    stored, by_reference, checkpoint = bundles
    from safetensors.torch import load_file

    on_file = load_file(str(checkpoint))["proj.weight"]
    here, there = _prepared(by_reference), _prepared(stored)
    for impl in IMPLS.split(","):
        assert torch.equal(here.modules[impl].state_dict()["proj.weight"], on_file)
        with torch.no_grad():
            mine, theirs = (p.runner.call(p.modules[impl], p.inputs) for p in (here, there))
        assert torch.equal(mine, theirs), impl


def test_the_error_budget_judges_the_by_reference_bundle_as_the_stored_one(bundles):
    """The gate against the golden uses the bundle's fp64 reference (the error budget) for both
    bundles, with the same numbers: the weights' source changes nothing it measures."""
    stored, by_reference, _ = bundles
    outcomes = {}
    for name, bundle in (("stored", stored), ("byref", by_reference)):
        prepared = _prepared(bundle)
        with torch.no_grad():
            outputs = {impl: prepared.runner.call(prepared.modules[impl], prepared.inputs) for impl in IMPLS.split(",")}
        outcomes[name] = bench_lib.judge_outputs(outputs, impls=IMPLS.split(","), bundle=prepared.bundle, policy=None)
    for impl in IMPLS.split(","):
        (mine,), (theirs,) = outcomes["byref"][impl].results, outcomes["stored"][impl].results
        assert mine.budget is not None and theirs.budget is not None, impl  # the budget was checked
        assert mine.budget == theirs.budget and mine.metrics == theirs.metrics and mine.passed == theirs.passed
    assert [outcomes["byref"][impl].status for impl in IMPLS.split(",")] == ["holds", "holds", "fails"]
    assert outcomes["byref"]["fast"].to_dict()["results"][0]["budget_checked"] is True
    unjudged = bench_lib.judge_outputs(outputs, impls=IMPLS.split(","), bundle=None, policy=None)  # no reference
    assert unjudged["fast"].to_dict()["results"][0]["budget_checked"] is False


def _refused(capsys, tmp_path, bundle, *extra):
    """bench refused: (stderr's lines, what --json holds); asserts exit 2 and nothing on stdout."""
    out = tmp_path / "refused.json"
    status = main(["bench", "--quiet", "--reps", "3", "--warmup", "1", "--json", str(out), "--bundle", str(bundle),
                   "--impls", IMPLS, *extra])
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    return captured.err.strip().splitlines(), json.loads(out.read_text())


def _no_run(document):
    """The refused run's --json is the error report, no timings and no verdicts."""
    assert document["passed"] is False and document["error"]["status"] == 2
    assert document.get("impls") in (None, []) and document.get("verdict") is None
    jsonschema.validate(document, schema_for("parity-bench-report"))


@pytest.fixture
def builds(monkeypatch):
    """Every impl build of the test, by impl name."""
    built: list[str] = []
    original = SubjectRunner.build

    def counting(self, impl, **kwargs):
        built.append(impl)
        return original(self, impl, **kwargs)

    monkeypatch.setattr(SubjectRunner, "build", counting)
    return built


def test_a_changed_checkpoint_is_refused_before_any_build(tmp_path, bundles, capsys, builds):
    _, by_reference, checkpoint = bundles
    weight = load_subject(MATMUL_SPEC).make_state()["proj.weight"].clone()
    weight.view(-1)[0] += 1  # same size, other bytes: only the digest tells
    save_file({"proj.weight": weight}, str(checkpoint))
    before = sorted(path.name for path in by_reference.iterdir())
    err, document = _refused(capsys, tmp_path, by_reference)
    assert len(err) == 1, err
    assert "model.safetensors" in err[0] and "does not match the bundle's BLAKE3" in err[0]
    assert builds == []
    _no_run(document)
    assert "does not match the bundle's BLAKE3" in document["error"]["message"]
    assert sorted(path.name for path in by_reference.iterdir()) == before  # nothing written into the bundle


def test_a_checkpoint_of_another_size_is_refused_naming_it(tmp_path, bundles, capsys, builds):
    _, by_reference, checkpoint = bundles
    save_file({"proj.weight": torch.zeros(8, 8)}, str(checkpoint))
    err, document = _refused(capsys, tmp_path, by_reference)
    assert len(err) == 1 and "model.safetensors is" in err[0] and "bytes, the bundle was captured with" in err[0]
    assert builds == []
    _no_run(document)


def test_a_missing_checkpoint_names_weights_dir_and_weights_dir_finds_it(tmp_path, bundles, capsys, virtual_clock):
    stored, by_reference, checkpoint = bundles
    moved = tmp_path / "elsewhere"
    shutil.move(checkpoint.parent, moved)
    err, document = _refused(capsys, tmp_path, by_reference)
    assert len(err) == 1
    assert str(checkpoint) in err[0] and "is not there; pass --weights-dir DIR" in err[0]
    _no_run(document)
    status, found = run_bench(tmp_path, by_reference, "--weights-dir", str(moved))
    _, reference = run_bench(tmp_path, stored)
    assert status == 1 and verdicts(found) == verdicts(reference)
    capsys.readouterr()  # the two runs' text reports
    # a --weights-dir that lacks the file names the file where it was looked for
    empty = tmp_path / "empty"
    empty.mkdir()
    err, _ = _refused(capsys, tmp_path, by_reference, "--weights-dir", str(empty))
    assert len(err) == 1 and str(empty / "model.safetensors") in err[0] and "is not there" in err[0]


def test_weights_dir_is_refused_where_no_checkpoint_is_named(tmp_path, bundles, capsys, builds):
    stored, _, checkpoint = bundles
    err, document = _refused(capsys, tmp_path, stored, "--weights-dir", str(checkpoint.parent))
    assert len(err) == 1 and "--weights-dir:" in err[0] and "stores its weights; it names no checkpoint files" in err[0]
    assert builds == []
    _no_run(document)
    with pytest.raises(UsageError, match="--weights-dir applies only with --bundle"):
        bench_lib.prepare(MATMUL_SPEC, None, impls=["reference", "fast"], device=torch.device("cpu"),
                          weights_dir=checkpoint.parent)


# -------------------------------------------------------------------------------------------
# A Hugging Face model (the tiny Llama of tests/llama_subject.py): its call returns ``.logits``


LLAMA_SPEC = "llama_subject:make_subject"
LLAMA_ARGS = {"dtype": "bf16"}


@pytest.mark.slow  # two captures and two benches of a Llama, the kernel through the Triton interpreter
def test_a_hugging_face_llama_benches_alike_from_its_checkpoint_and_from_a_stored_bundle(tmp_path, capsys):
    """A bf16 Llama captured with an fp32 reference, once with its weights stored and once by
    reference: bench of ``sdpa,kernel`` judges each impl's logits against the golden's
    ``<root>/logits`` with the error budget, with the same verdicts from both bundles."""
    from parity.run.subjects.base import trusting

    with trusting(LLAMA_SPEC):
        state = load_subject(LLAMA_SPEC, LLAMA_ARGS).make_state()
        checkpoint = tmp_path / "ckpt" / "model.safetensors"
        checkpoint.parent.mkdir()
        save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(checkpoint))
        bundles = {}
        for name, weights_from in (("stored", None), ("byref", [checkpoint])):
            bundles[name] = capture(LLAMA_SPEC, tmp_path / name, subject_args=LLAMA_ARGS, impl="sdpa",
                                    reference="fp32", weights_from=weights_from).path
        assert open_bundle(bundles["byref"]).weights is not None and not open_bundle(bundles["byref"]).entries_of("state")
        documents = {}
        for name, bundle in bundles.items():
            out = tmp_path / f"{name}.json"
            status = main(["bench", "--quiet", "--reps", "3", "--warmup", "1", "--no-modules", "--no-device-time",
                           "--json", str(out), "--bundle", str(bundle), "--impls", "sdpa,kernel"])
            documents[name] = json.loads(out.read_text())
            assert status == bench_lib.exit_status(documents[name]), name
    capsys.readouterr()
    parity = {name: {row["impl"]: row["parity"] for row in document["impls"]} for name, document in documents.items()}
    assert parity["byref"] == parity["stored"]
    for impl in ("sdpa", "kernel"):
        judged = parity["byref"][impl]
        assert judged["status"] == "holds" and [r["name"] for r in judged["results"]] == ["<root>/logits"]
        assert judged["results"][0]["budget_checked"] is True  # the fp32 reference's budget gated it
    kernel = {row["impl"]: row for row in documents["byref"]["impls"]}["kernel"]
    assert kernel["valid"] is True  # parity holds: the speed claim stands (or falls) on its timing alone


class _Bundle:
    """What ``_golden_names`` reads of a bundle: its output entries."""

    path = "b"

    def __init__(self, *entries):
        self._entries = [dataclasses.replace(ENTRY, name=name, layer=layer) for name, layer in entries]

    def has(self, name):
        return any(entry.name == name for entry in self._entries)

    def entries_of(self, kind):
        return list(self._entries)


def test_a_bare_tensor_is_judged_against_the_roots_only_recorded_tensor():
    names = bench_lib._golden_names
    assert names(_Bundle(("<root>/logits", "<root>"), ("model", "model")), [""]) == {"": "<root>/logits"}
    assert names(_Bundle(("<root>", "<root>")), [""]) == {"": "<root>"}
    # two tensors of the root's output: which one the forward returned is not known, so it is refused
    with pytest.raises(UsageError, match="no golden of the forward's output '<root>'"):
        names(_Bundle(("<root>/logits", "<root>"), ("<root>/hidden", "<root>")), [""])
    with pytest.raises(UsageError, match="no golden of the forward's output '<root>/logits'"):
        names(_Bundle(("<root>/scores", "<root>")), ["logits"])
