"""``parity show``: a bundle's subject, platform and every tensor, checksums verified, on a bundle
captured here and on the committed H200 goldens; damage and bad arguments are one line, exit 2."""
import argparse
import json
import sys
from pathlib import Path

import pytest


import fault_models
from parity.bundle.writer import edit_manifest
from parity.bundle.reader import open_bundle
from parity.cli.main import report_error
from parity.cli.commands import show as show_command
from parity.report.show import describe_bundle, render_show

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
GOLDENS = ("h200-attention", "h200-decoder", "h200-fuzz")


def _show(argv):
    """Parse and run ``show`` as the CLI does (an exception becomes its one line and exit status)."""
    parser = argparse.ArgumentParser(prog="parity")
    show_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["show", *argv])
    try:
        return args.func(args)
    except Exception as err:  # noqa: BLE001 - what parity.cli.main does
        return report_error(err, debug=False)


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """A small bundle captured here: fp64 references and recorded module inputs."""
    return fault_models.capture_model(tmp_path_factory.mktemp("show"), "res", "fp32")


def test_description_matches_the_bundle(captured):
    description = describe_bundle(captured)
    with open_bundle(captured) as bundle:
        entries = bundle.entries
        outputs = [entry.name for entry in bundle.entries_of("output")]
        references = {entry.name for entry in bundle.entries_of("reference")}
        inputs_of = {}
        for entry in bundle.entries_of("module_input"):
            inputs_of[entry.layer] = inputs_of.get(entry.layer, 0) + 1
        platform = bundle.platform
    assert description["checksums"] == {"algorithm": "blake3", "verified": True, "tensors": len(entries), "ok": True}
    assert [(t["kind"], t["name"], t["dtype"], t["shape"], t["bytes"], t["checksum"]) for t in description["tensors"]] == [
        (e.kind, e.name, e.dtype, list(e.shape), e.nbytes, e.checksum) for e in entries]
    shown_outputs = [t for t in description["tensors"] if t["kind"] == "output"]
    assert [t["name"] for t in shown_outputs] == outputs and len(outputs) > 10
    assert all(t["has_reference"] == (t["name"] in references) for t in shown_outputs)
    assert description["outputs_with_reference"] == len(references) > 0
    assert [t["module_inputs"] for t in shown_outputs] == [inputs_of.get(t["layer"], 0) for t in shown_outputs]
    assert sum(t["module_inputs"] for t in shown_outputs) == len([e for e in entries if e.kind == "module_input"])
    assert description["total_bytes"] == sum(e.nbytes for e in entries) == sum(
        total["bytes"] for total in description["totals"].values())
    assert description["subject"]["spec"] == fault_models.SPEC
    assert {"model": "res", "dtype": "fp32"}.items() <= description["subject"]["args"].items()
    # a bundle captured now carries the GPU-library fields of the fingerprint (null on a CPU)
    assert description["platform"] == platform and "blas_library" in platform and "numerics_env" in platform


def test_text_lists_every_tensor_and_the_checksums(captured, capsys):
    assert _show([str(captured)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"parity show: {captured}\n")
    assert "checksums (blake3): verified, all " in out
    description = describe_bundle(captured, verify=False)
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| #")]
    assert len(rows) == len(description["tensors"])
    for tensor in description["tensors"]:  # names as they are: a terminal table, not Markdown
        assert f"| {tensor['name']} " in out
    assert "| <root>/args/0 " in out and "\\<" not in out
    output_rows = [line for line in rows if "| yes " in line or "| no " in line]
    assert len(output_rows) == description["outputs"]
    assert f"(spec {fault_models.SPEC}); args {{\"model\": \"res\"" in out
    assert "platform: cpu" in out


def test_json_file_and_stdout(captured, tmp_path, capsys):
    target = tmp_path / "show.json"
    assert _show([str(captured), "--json", str(target), "--no-verify"]) == 0
    printed = capsys.readouterr().out
    assert "checksums (blake3): not verified" in printed
    assert json.loads(target.read_text()) == json.loads(json.dumps(describe_bundle(captured, verify=False)))
    assert _show([str(captured), "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)  # stdout holds the JSON alone
    assert (data["format"], data["version"]) == ("parity-show-report", 2) and data["checksums"]["verified"] is True


@pytest.mark.parametrize("name", GOLDENS)
def test_committed_goldens(name, capsys):
    description = describe_bundle(GOLDEN / name)
    manifest = json.loads((GOLDEN / name / "manifest.json").read_text())
    assert description["checksums"]["verified"] and description["checksums"]["tensors"] == len(manifest["entries"])
    assert description["checksums"]["algorithm"] == "sha256"  # schema 1 and 2 goldens
    assert [t["checksum"] for t in description["tensors"]] == [e["sha256"] for e in manifest["entries"]]
    assert [t["name"] for t in description["tensors"]] == [e["name"] for e in manifest["entries"]]
    assert description["platform"]["device_name"] == "NVIDIA H200"
    assert description["shards"][0]["bytes"] == (GOLDEN / name / manifest["shards"][0]["file"]).stat().st_size
    text = render_show(description)
    assert "platform: nvidia sm_90 NVIDIA H200" in text
    # captured before the GPU-library fields existed: said so, not shown as null
    assert "not recorded (bundle older than these fields): blas_library" in text


def test_damaged_bundle_is_one_line_exit_2(captured, tmp_path, capsys):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(captured, damaged)
    shard = next(damaged.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # inside the last tensor's bytes
    shard.write_bytes(bytes(data))
    target = tmp_path / "out.json"
    assert _show([str(damaged), "--json", str(target)]) == 2
    captured_io = capsys.readouterr()
    err = captured_io.err.strip()
    assert err.startswith("parity: error: ") and "checksum" in err and "\n" not in err
    assert "Traceback" not in captured_io.err and captured_io.out == ""
    assert not target.exists()  # nothing half-written
    # without verification the manifest is still shown, and says the checksums were not checked
    assert _show([str(damaged), "--no-verify"]) == 0
    assert "checksums (blake3): not verified" in capsys.readouterr().out


@pytest.mark.parametrize("argv, fragment", [
    (["{missing}"], "does not exist"),
    (["{bundle}", "--json", "{tmp}"], "is a directory"),
    (["{bundle}", "--json", "{tmp}/no/such/dir/x.json"], "does not exist"),
])
def test_bad_arguments_are_one_line_exit_2(captured, tmp_path, capsys, argv, fragment):
    argv = [a.format(missing=tmp_path / "nope", bundle=captured, tmp=tmp_path) for a in argv]
    assert _show(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("parity: error: ") and fragment in err and "\n" not in err


def test_names_in_the_bundle_are_never_imported_and_print_safely(captured, tmp_path, capsys):
    import shutil

    copy = tmp_path / "hostile"
    shutil.copytree(captured, copy)
    module = "parity_show_must_not_import_this"
    edit_manifest(copy, lambda m: m["subject"].update({"spec": f"{module}:make", "name": "x\x1b[2J\nPARITY HOLDS"}))
    assert _show([str(copy)]) == 0
    out = capsys.readouterr().out
    assert module not in sys.modules
    assert "\x1b" not in out and "x\\x1b[2J\\x0aPARITY HOLDS" in out
    assert f"(spec {module}:make)" in out
