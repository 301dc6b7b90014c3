"""Recorder, capture and the capture CLI: names, streaming, hooks-on = hooks-off, references,
interrupted captures, the compare host's rebuild from a bundle, and the triton impl under the
interpreter (in a subprocess with TRITON_INTERPRET=1)."""
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parity.bundle.reader import open_bundle
from parity.run.capture import CaptureError, capture
from parity.base.errors import UsageError
from parity.run.recorder import ROOT, Recorder, flatten, replay, select_modules
from parity.run.subjects import Inputs, load_subject, runner_from_manifest
from parity.run.subjects.attention import CASE_SETS

EXAMPLE = "user_subject_example:make_subject"
SMALL_DECODER = {"layers": 2, "seq_len": 64, "batch": 1}
TESTS_DIR = Path(__file__).parent


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _record(runner, module, inputs, **kwargs):
    records = []
    with Recorder(module, records.append, **kwargs) as recorder:
        output = runner.run(module, inputs)
    return records, recorder, output


# ---- recorder ---------------------------------------------------------------------------------


def test_recorder_names_repeated_calls_and_nested_outputs():
    runner = load_subject(EXAMPLE)
    module = runner.build("reference", state=runner.make_state())
    records, recorder, _ = _record(runner, module, runner.make_inputs())
    assert [call.name for call in recorder.calls] == [
        "block.norm", "block.proj", "block", "block.norm#1", "block.proj#1", "block#1", "head", ROOT]
    assert [r.name for r in records if r.layer == ROOT] == ["<root>/logits", "<root>/stats/0", "<root>/stats/1"]
    block1 = next(call for call in recorder.calls if call.name == "block#1")
    assert (block1.module, block1.call_index) == ("block", 1)
    assert all(r.tensor.device.type == "cpu" for r in records)


def test_recorder_streams_copies_not_views():
    class InPlace(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Identity()

        def forward(self, x):
            y = self.inner(x.clone())
            y.add_(1)  # changes the inner output after its hook ran
            return y

    records = []
    module = InPlace()
    with Recorder(module, records.append):
        module(torch.zeros(3))
    assert records[0].name == "inner" and records[0].tensor.tolist() == [0.0, 0.0, 0.0]
    assert records[1].name == ROOT and records[1].tensor.tolist() == [1.0, 1.0, 1.0]


def test_layer_globs_select_modules_and_a_glob_matching_nothing_is_a_usage_error():
    runner = load_subject(EXAMPLE)
    module = runner.build("reference", state=None)
    assert list(select_modules(module, ["block*"])) == ["block", "block.norm", "block.proj"]
    assert list(select_modules(module, ["<root>", "head"])) == [ROOT, "head"]
    with pytest.raises(UsageError, match=r"--layers 'blocks\.\*' matches no module; modules are: <root>, block"):
        select_modules(module, ["head", "blocks.*"])


def test_recorded_inputs_replay_a_single_layer_bitwise():
    runner = load_subject(EXAMPLE)
    module = runner.build("reference", state=runner.make_state())
    records, recorder, _ = _record(runner, module, runner.make_inputs(), record_inputs=True)
    layer = next(call for call in recorder.calls if call.name == "block#1").to_json()
    layer = json.loads(json.dumps(layer))  # as compare reads it from the manifest
    assert layer["inputs"]["dict"][1][1] == {"dict": [["scale", {"value": 0.5}]]}
    inputs = {r.path: r.tensor for r in records if r.kind == "module_input" and r.layer == "block#1"}
    assert list(inputs) == ["args/0"]
    with torch.no_grad():
        output = replay(module, layer, inputs)
    recorded = next(r.tensor for r in records if r.kind == "output" and r.name == "block#1")
    assert _same_bits(flatten(output)[1][0][1], recorded)


# ---- capture (library) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def decoder_bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("capture") / "decoder"
    result = capture("decoder", out, subject_args=SMALL_DECODER, record_inputs=True, shard_bytes=1 << 20)
    return out, result


def test_decoder_capture_manifest(decoder_bundle):
    out, result = decoder_bundle
    bundle = open_bundle(out)
    manifest = bundle.manifest
    assert manifest["subject"]["spec"] == "decoder" and manifest["subject"]["args"]["layers"] == 2
    assert manifest["impl"] == "reference" and manifest["device"] == "cpu"
    assert manifest["hooks_check"] == {"bitwise_equal": True, "tensors_compared": 1, "first_difference": None}
    assert manifest["platform"]["torch"] == torch.__version__
    assert manifest["capture"]["reference"]["precision"] == "fp64"
    assert manifest["capture"]["reference"]["outputs_without_reference"] == []
    assert len(manifest["shards"]) > 1  # rotated at 1 MiB
    assert bundle.verify() == result.tensors
    names = [e.name for e in bundle.entries_of("output")]
    assert names[:3] == ["embed", "layers.0.attn_norm", "layers.0.attn.q_proj"] and names[-1] == ROOT
    assert [layer["name"] for layer in bundle.layers()] == names  # one tensor per decoder layer call
    references = bundle.entries_of("reference")
    assert [e.name for e in references] == names
    assert all(e.dtype == "float64" for e in references)
    assert bundle.entry("tokens", "input").dtype == "int64"
    assert bundle.entry("layers.0.attn.q_proj.weight", "state").dtype == "bfloat16"


def test_reference_is_close_to_the_bf16_output(decoder_bundle):
    bundle = open_bundle(decoder_bundle[0])
    logits = bundle.load(ROOT).double()
    truth = bundle.load(ROOT, "reference")
    rel_l2 = float((logits - truth).norm() / truth.norm())
    assert 0 < rel_l2 < 0.05  # bf16 rounding, not a different function


def test_compare_host_rebuilds_from_the_bundle_and_reproduces_it(decoder_bundle):
    """What compare does: subject from the manifest, inputs and state from the bundle, stream."""
    bundle = open_bundle(decoder_bundle[0])
    runner = runner_from_manifest(bundle.subject)
    module = runner.build(bundle.impl, state=bundle.subject_state(), device="cpu")
    mismatches = []

    def check(record):
        if record.kind == "output" and not _same_bits(record.tensor, bundle.load(record.name)):
            mismatches.append(record.name)

    with Recorder(module, check):
        runner.run(module, Inputs.of_bundle(bundle))
    assert mismatches == []

    layer = next(layer for layer in bundle.layers() if layer["name"] == "layers.1.attn")
    inputs = bundle.module_inputs(layer["name"])
    assert list(inputs) == ["args/0"]
    with torch.no_grad():
        output = replay(module, layer, inputs)
    assert _same_bits(output, bundle.load("layers.1.attn"))


def test_attention_capture_names_layers_by_case_id(tmp_path):
    capture("attention", tmp_path / "b", subject_args={"cases": "smoke"}, reference="fp32")
    bundle = open_bundle(tmp_path / "b")
    expected = [c.id for c in CASE_SETS["smoke"]]
    assert bundle.subject["args"]["cases"] == [c.to_json() for c in CASE_SETS["smoke"]]
    assert [layer["name"] for layer in bundle.layers()] == expected
    assert [e.name for e in bundle.entries_of("output")] == [f"{i}/{k}" for i in expected for k in ("out", "lse")]
    assert {e.dtype for e in bundle.entries_of("reference")} == {"float32"}
    assert f"{expected[0]}/layout/kv_num_blocks" in {e.name for e in bundle.entries_of("input")}
    assert bundle.manifest["inputs_meta"]["layouts"][expected[1]]["kind"] == "window48"
    assert bundle.manifest["kernel_configs"] == {"used": {}, "provided": None}


def test_user_subject_capture_with_layer_globs(tmp_path):
    capture(EXAMPLE, tmp_path / "b", layers=["block", "<root>"], reference="none",
            kernel_configs={"note": "pinned"})
    bundle = open_bundle(tmp_path / "b")
    assert [e.name for e in bundle.entries_of("output")] == [
        "block", "block#1", "<root>/logits", "<root>/stats/0", "<root>/stats/1"]
    assert bundle.entries_of("reference") == []
    assert bundle.manifest["capture"]["layers"] == ["block", "<root>"]
    assert bundle.manifest["kernel_configs"]["provided"] == {"note": "pinned"}


def test_the_reference_run_leaves_cores_for_the_writer_on_a_many_core_host(tmp_path, monkeypatch):
    from parity.run import runtime

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(16)
        monkeypatch.setattr(runtime.os, "cpu_count", lambda: 16)
        with runtime.cores_left_for(5) as used:  # at most a quarter of the cores given up
            assert used == torch.get_num_threads() == 12
        assert torch.get_num_threads() == 16
        with runtime.cores_left_for(2) as used:
            assert used == torch.get_num_threads() == 14
        monkeypatch.setattr(runtime.os, "cpu_count", lambda: 2)
        with runtime.cores_left_for(5) as used:  # a 2-core machine keeps every thread
            assert used == torch.get_num_threads() == 16
        with pytest.raises(RuntimeError), runtime.cores_left_for(5):
            raise RuntimeError("restored on the way out")
        assert torch.get_num_threads() == 16

        monkeypatch.setattr(runtime.os, "cpu_count", lambda: 16)
        seen = []
        real_run = load_subject(EXAMPLE).__class__.run

        def run(self, module, inputs):
            seen.append((next(module.parameters()).dtype, torch.get_num_threads()))
            return real_run(self, module, inputs)

        monkeypatch.setattr(load_subject(EXAMPLE).__class__, "run", run)
        capture(EXAMPLE, tmp_path / "b", reference="fp64")
        # hooks off and hooks on with every thread (the golden), the fp64 reference beside the writer
        assert seen == [(torch.float32, 16), (torch.float32, 16), (torch.float64, 12)]
    finally:
        torch.set_num_threads(before)


def test_hooks_changing_the_result_fails_the_capture(tmp_path):
    with pytest.raises(CaptureError, match=r"recorded run's output differs from the run without hooks"):
        capture("user_subject_example:nondeterministic", tmp_path / "b", reference="none")
    assert os.listdir(tmp_path) == []


def test_interrupted_capture_leaves_no_bundle_and_spares_an_existing_one(tmp_path):
    spec = "user_subject_example:raises_interrupt_on_recorded_run"
    with pytest.raises(KeyboardInterrupt):
        capture(spec, tmp_path / "new", shard_bytes=64)  # shards were on disk when it stopped
    assert os.listdir(tmp_path) == []

    existing = tmp_path / "old"
    capture(EXAMPLE, existing, reference="none")
    before = {name: (existing / name).read_bytes() for name in os.listdir(existing)}
    with pytest.raises(KeyboardInterrupt):
        capture(spec, existing, shard_bytes=64, force=True)
    assert {name: (existing / name).read_bytes() for name in os.listdir(existing)} == before
    assert os.listdir(tmp_path) == ["old"]
    open_bundle(existing).verify()


def test_force_is_needed_to_replace_and_replaces(tmp_path):
    capture(EXAMPLE, tmp_path / "b", reference="none")
    with pytest.raises(UsageError, match="already exists; pass --force"):
        capture(EXAMPLE, tmp_path / "b", subject_args={"seed": 1}, reference="none")
    assert open_bundle(tmp_path / "b").subject["args"]["seed"] == 0
    capture(EXAMPLE, tmp_path / "b", subject_args={"seed": 1}, reference="none", force=True)
    assert open_bundle(tmp_path / "b").subject["args"]["seed"] == 1
    assert os.listdir(tmp_path) == ["b"]


def test_triton_on_cpu_without_the_interpreter_is_a_clear_usage_error(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UsageError, match=r"--impl triton on --device cpu needs the Triton interpreter: .*TRITON_INTERPRET=1"):
        capture("decoder", tmp_path / "b", impl="triton")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kwargs, message", [
    ({"device": "meta"}, r"unsupported device 'meta'; use cpu or cuda"),
    ({"device": "tpu"}, r"bad device 'tpu'; use cpu or cuda"),
    ({"reference": "fp16"}, r"unknown --reference 'fp16'"),
    ({"layers": ["nothing*"]}, r"--layers 'nothing\*' matches no module"),
    ({"impl": "cuda-original"}, r"has no implementation 'cuda-original'"),
])
def test_capture_usage_errors_leave_nothing(tmp_path, kwargs, message):
    with pytest.raises(UsageError, match=message):
        capture(EXAMPLE, tmp_path / "b", **kwargs)
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a host without a GPU")
def test_cuda_without_a_gpu_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match=r"device 'cuda' requested but no GPU is available"):
        capture(EXAMPLE, tmp_path / "b", device="cuda")


_TRITON_SCRIPT = """
import json, sys
from parity.run.capture import capture
from parity.bundle.reader import open_bundle
report = {}
for name, spec, args in [("attention", "attention", {"cases": "default"}),
                         ("decoder", "decoder", %(decoder)r)]:
    capture(spec, sys.argv[1] + "/" + name, subject_args=args, impl="triton")
    bundle = open_bundle(sys.argv[1] + "/" + name)
    report[name] = {"hooks": bundle.hooks_check,
                    "configs": bundle.kernel_configs, "interpreter": bundle.platform["triton_interpreter"],
                    "verified": bundle.verify()}
print(json.dumps(report))
""" % {"decoder": SMALL_DECODER}


@pytest.mark.slow
def test_triton_impl_under_the_interpreter(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(TESTS_DIR)}
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("attention", "decoder"):
        assert report[name]["hooks"]["bitwise_equal"] is True
        assert report[name]["interpreter"] is True
        assert report[name]["configs"]["used"]  # the pinned launch configs were recorded
    # (that the default case set stays interpreter-sized is a bound on its sizes: test_run_subjects)
    assert set(report["decoder"]["configs"]["used"]) == {"layers.0.attn.core", "layers.1.attn.core"}


# ---- CLI --------------------------------------------------------------------------------------


@pytest.fixture
def cli(monkeypatch, capsys):
    """``parity.cli.main.main(["capture", ...])`` -> (exit status, stdout, stderr)."""
    import parity.cli.main

    def run(args):
        code = parity.cli.main.main(["capture", *args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


def test_cli_capture_and_force(tmp_path, cli):
    out = str(tmp_path / "b")
    code, stdout, stderr = cli(["--subject", EXAMPLE, "--out", out, "--reference", "none"])
    assert code == 0, stderr
    assert stdout.startswith(f"wrote {out}: 8 layers") and "hooks on/off bitwise equal" in stdout
    assert "parity capture: " in stderr  # progress
    code, _, stderr = cli(["--subject", EXAMPLE, "--out", out, "--quiet"])
    assert code == 2 and stderr == f"parity: error: output {out} already exists; pass --force to replace it\n"
    code, _, stderr = cli(["--subject", EXAMPLE, "--out", out, "--quiet", "--force", "--arg", "seed=3",
                            "--layers", "head", "--record-inputs", "--shard-mib", "0.001"])
    assert code == 0 and stderr == ""
    bundle = open_bundle(out)
    assert bundle.subject["args"]["seed"] == 3 and bundle.manifest["capture"]["record_inputs"] is True
    assert [e.name for e in bundle.entries_of("output")] == ["head"]


def test_cli_no_fsync_writes_the_same_bundle_without_syncing_its_files(tmp_path, cli, monkeypatch):
    from parity.bundle import commit as bundle_module

    synced = []
    real = os.fsync
    monkeypatch.setattr(bundle_module.os, "fsync",
                        lambda fd: (synced.append(stat.S_ISREG(os.fstat(fd).st_mode)), real(fd))[1])
    for flags, name in (([], "durable"), (["--no-fsync"], "fast")):
        synced.clear()
        code, _, stderr = cli(["--subject", EXAMPLE, "--bundle", str(tmp_path / name), "--quiet", *flags])
        assert code == 0, stderr
        files_synced = sum(synced)
        assert files_synced == (len(open_bundle(tmp_path / name).shards) + 1 if not flags else 0)
    durable, fast = open_bundle(tmp_path / "durable"), open_bundle(tmp_path / "fast")
    assert durable.manifest["capture"]["durable"] is True and fast.manifest["capture"]["durable"] is False
    assert fast.verify() == durable.verify()
    assert [(e.name, e.checksum) for e in fast.entries] == [(e.name, e.checksum) for e in durable.entries]


def test_cli_creates_the_parent_directories_of_out(tmp_path, cli):
    out = tmp_path / "bundles" / "nested" / "b"
    code, _, stderr = cli(["--subject", EXAMPLE, "--out", str(out), "--reference", "none", "--quiet"])
    assert code == 0, stderr
    assert open_bundle(out).entries_of("output")
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, stderr = cli(["--subject", EXAMPLE, "--bundle", str(blocker / "b"), "--quiet"])
    assert code == 2 and stderr.startswith(f"parity: error: cannot create the directory {blocker} for --bundle")


def test_cli_decoder_and_attention_options(tmp_path, cli):
    code, _, stderr = cli(["--subject", "attention", "--cases", "smoke", "--dtype", "fp32", "--quiet",
                            "--out", str(tmp_path / "a")])
    assert code == 0, stderr
    assert {e.dtype for e in open_bundle(tmp_path / "a").entries_of("input") if e.name.endswith("/q")} == {"float32"}
    code, _, stderr = cli(["--subject", "decoder", "--arg", "layers=1", "--arg", "seq_len=64", "--dtype", "fp16",
                            "--quiet", "--out", str(tmp_path / "d")])
    assert code == 0, stderr
    assert open_bundle(tmp_path / "d").entry("embed.weight", "state").dtype == "float16"


@pytest.mark.parametrize("args, message", [
    (["--subject", "nope"], r"unknown subject 'nope'"),
    (["--subject", "user_subject_example:missing"], r"has no attribute 'missing'"),
    (["--subject", EXAMPLE, "--dtype", "fp8"], r"unknown --dtype 'fp8'; use one of fp16, bf16, fp32"),
    (["--subject", EXAMPLE, "--device", "tpu"], r"bad device 'tpu'"),
    (["--subject", EXAMPLE, "--layers", "zzz*"], r"--layers 'zzz\*' matches no module"),
    (["--subject", EXAMPLE, "--reference", "fp16"], r"unknown --reference 'fp16'"),
    (["--subject", "decoder", "--cases", "default"], r"subject 'decoder' takes no argument cases; it takes vocab, d_model, layers, "),
    (["--subject", EXAMPLE, "--arg", "novalue"], r"--set 'novalue' must look like KEY=VALUE"),  # --arg: old --set
    (["--subject", EXAMPLE, "--shard-mib", "0"], r"--shard-mib must be a positive finite number, got 0.0"),
    (["--subject", EXAMPLE, "--shard-mib", "inf"], r"--shard-mib must be a positive finite number, got inf"),
])
def test_cli_user_errors_are_one_line_and_exit_2(tmp_path, cli, args, message):
    code, stdout, stderr = cli([*args, "--out", str(tmp_path / "b")])
    assert code == 2
    assert stderr.count("\n") == 1 and stderr.startswith("parity: error: ")
    assert re.search(message, stderr), stderr
    assert os.listdir(tmp_path) == []


def test_capture_fuzz_records_the_drawn_cases(tmp_path, capsys):
    from parity.cli.main import main
    from parity.run.fuzz import draw_cases

    out = tmp_path / "fuzz"
    assert main(["capture", "--subject", "attention", "--fuzz", "3", "--fuzz-seed", "7", "--out", str(out), "--quiet"]) == 0
    assert open_bundle(out).subject["args"]["cases"] == draw_cases(3, seed=7)
    assert main(["capture", "--subject", "attention", "--fuzz", "2", "--cases", "smoke", "--out", str(tmp_path / "x")]) == 2
    assert "do not combine" in capsys.readouterr().err


def test_subject_arguments_that_do_not_fit_are_exit_2_not_a_traceback(tmp_path, capsys):
    from parity.cli.main import main

    for arg, message in (("layers=abc", "decoder layers must be a positive integer, got 'abc'"),
                         ("layers=-1", "decoder layers must be a positive integer, got -1"),
                         ("sink_blocks=-2", "decoder sink_blocks must be a non-negative integer, got -2"),
                         ("head_dim=12", "decoder head_dim must be one the kernel supports"),
                         ("rope_base=\"x\"", "decoder rope_base must be a positive finite number, got 'x'"),
                         ("layer_layouts=5", "decoder layer_layouts must be a non-empty list"),
                         ("dtype=[1]", "decoder dtype must be fp16, bf16 or fp32, got [1]"),
                         ("seq_len=10**5", "decoder seq_len must be a positive integer, got '10**5'"),
                         ("block=48", "decoder block must be a power of two >= 16, got 48")):
        assert main(["capture", "--subject", "decoder", "--out", str(tmp_path / "d"), "--arg", arg,
                     "--quiet"]) == 2, arg
        err = capsys.readouterr().err
        assert err.startswith(f"parity: error: {message}") and err.count("\n") == 1, err
        assert not (tmp_path / "d").exists()
