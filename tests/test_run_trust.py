"""Bundles are data, never code: the compare host builds only subjects it trusts.

Trusted: the built-ins, a spec named with ``compare --subject`` (equal to the bundle's), the
``trust`` list of the user's tolerance file or ``[tool.parity]``, and specs trusted by code on
this host (``trust_subject``). Everything else is refused with exit 2 before any import, and
these tests prove that nothing ran: hostile modules write marker files on import and when their
factory is called. Also: the bundle directory is never on ``sys.path``, a module inside it is
never the subject, subject arguments and inputs from a manifest are validated (exit 2, never a
KeyError), and sizes that cannot fit this host's memory are refused up front.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import parity.run.subjects.base as subjects_base
from parity.run.capture import capture
from parity.cli.main import main
from parity.base.errors import UsageError
from parity.testing.goldens import check_subject
from parity.run.subjects import (
    check_trusted, is_builtin, load_subject, runner_from_manifest, trust_subject, trusting,
)

EXAMPLE = "user_subject_example:make_subject"
TESTS_DIR = Path(__file__).resolve().parent
TRUST_HINT = ("add it to trust = [...] under [tool.parity] in ./pyproject.toml (read by default) or in the "
              "file given to --tolerances")

# A hostile module: importing it writes IMPORTED next to it, calling its factory writes CALLED.
EVIL = '''
import pathlib
pathlib.Path(__file__).with_name("IMPORTED").write_text("imported")


def make(**args):
    pathlib.Path(__file__).with_name("CALLED").write_text("called")
    raise SystemExit(0)
'''


@pytest.fixture(autouse=True)
def _restore_sys_path():
    """compare and capture put the current directory on sys.path for user subjects; keep the
    test process's path as it was."""
    saved = list(sys.path)
    yield
    sys.path[:] = saved


@pytest.fixture(scope="module")
def example_bundle(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("trust") / "example"
    capture(EXAMPLE, path, reference="none")
    return path


def edit(bundle: Path, change) -> None:
    """Rewrite a bundle's manifest the way an attacker would: consistently (re-sealed)."""
    try:
        from parity.bundle.writer import edit_manifest
    except ImportError:  # older bundle module: manifests are not sealed
        file = bundle / "manifest.json"
        manifest = json.loads(file.read_text())
        change(manifest)
        file.write_text(json.dumps(manifest))
        return
    edit_manifest(bundle, change)


def hostile_copy(example_bundle: Path, where: Path, spec: str, args: dict | None = None) -> Path:
    bundle = where / "hostile"
    shutil.copytree(example_bundle, bundle)
    edit(bundle, lambda m: m["subject"].update(spec=spec, args=args or {}))
    return bundle


def compare_cli(capsys, golden: Path, *extra: str) -> tuple[int, str, str]:
    code = main(["compare", "--golden", str(golden), "--impl", "reference", "--device", "cpu", "--quiet", *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def refusal(bundle: Path, spec: str) -> str:
    return (f"parity: error: bundle {bundle} names subject {spec!r}, which this host does not trust; "
            f"pass --subject {spec} or {TRUST_HINT}\n")


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PARITY_DEBUG")}


def _entry_points() -> list[list[str]]:
    entries = [[sys.executable, "-m", "parity"]]
    script = Path(sys.executable).parent / "parity"
    if script.exists():
        entries.append([str(script)])
    return entries


# ---- hostile bundles run nothing ---------------------------------------------------------------


def test_os_system_in_a_manifest_is_refused_and_runs_nothing(example_bundle, tmp_path, capsys):
    marker = tmp_path / "PWNED"
    bundle = hostile_copy(example_bundle, tmp_path, "os:system", {"command": f"touch {marker}"})
    code, out, err = compare_cli(capsys, bundle)
    assert code == 2 and out == "" and err == refusal(bundle, "os:system")
    assert not marker.exists()


def test_a_module_named_by_a_bundle_is_never_imported(example_bundle, tmp_path, capsys, monkeypatch):
    # The module is importable (on sys.path, in the current directory): only trust stops it.
    evil_dir = tmp_path / "evil"
    evil_dir.mkdir()
    (evil_dir / "evil_mod.py").write_text(EVIL)
    monkeypatch.syspath_prepend(str(evil_dir))
    monkeypatch.chdir(evil_dir)
    bundle = hostile_copy(example_bundle, tmp_path, "evil_mod:make")
    code, _, err = compare_cli(capsys, bundle)
    assert code == 2 and err == refusal(bundle, "evil_mod:make")
    assert not (evil_dir / "IMPORTED").exists() and not (evil_dir / "CALLED").exists()
    assert "evil_mod" not in sys.modules


@pytest.mark.parametrize("entry", _entry_points(), ids=lambda e: "python -m parity" if "-m" in e else "parity")
def test_hostile_bundles_through_both_entry_points_run_nothing(example_bundle, tmp_path, entry):
    """A real process, started in the directory that holds the hostile module: `python -m` would
    put it on sys.path; parity takes it off and refuses the spec anyway. (A spec importable from
    anywhere, ``os:system``, does not depend on the entry point's sys.path: it is refused in
    process, by test_os_system_in_a_manifest_is_refused_and_runs_nothing.)"""
    (tmp_path / "evil_mod.py").write_text(EVIL)
    spec = "evil_mod:make"
    bundle = tmp_path / "evil_mod_make"
    shutil.copytree(example_bundle, bundle)
    edit(bundle, lambda m: m["subject"].update(spec=spec, args={}))
    proc = subprocess.run([*entry, "compare", "--golden", bundle.name, "--impl", "reference", "--device", "cpu"],
                          cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == refusal(Path(bundle.name), spec) and proc.stdout == ""
    assert not any((tmp_path / name).exists() for name in ("IMPORTED", "CALLED"))


def _payload_bundle(example_bundle: Path, tmp_path: Path) -> Path:
    bundle = tmp_path / "b"
    shutil.copytree(example_bundle, bundle)
    (bundle / "payload.py").write_text(EVIL)
    edit(bundle, lambda m: m["subject"].update(spec="payload:make", args={}))
    return bundle


def test_a_module_inside_the_bundle_is_never_the_subject(example_bundle, tmp_path):
    """``payload.py`` shipped in the bundle, compare run from inside it by `python -m` (which puts
    that directory first on sys.path) with --subject naming it: refused, because it lies in the
    bundle. A real process: only `python -m` itself puts the directory there."""
    bundle = _payload_bundle(example_bundle, tmp_path)
    proc = subprocess.run([sys.executable, "-m", "parity", "compare", "--golden", ".", "--impl", "reference",
                           "--device", "cpu", "--subject", "payload:make"], cwd=bundle, env=_clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (f"parity: error: bundle .: subject 'payload:make': module 'payload' is inside the bundle "
                           f"directory "
                           f"{bundle.resolve()}; parity never imports code from a bundle (keep the subject's code "
                           "outside the bundle and run from another directory)\n")
    assert not (bundle / "IMPORTED").exists() and not (bundle / "CALLED").exists()


def test_a_module_inside_the_bundle_is_refused_untrusted(example_bundle, tmp_path, capsys, monkeypatch):
    """Without --subject the spec is refused as untrusted before any import, whatever sys.path
    holds: in process, with the bundle directory first on sys.path as `python -m` would put it."""
    bundle = _payload_bundle(example_bundle, tmp_path)
    monkeypatch.chdir(bundle)
    monkeypatch.syspath_prepend(str(bundle))
    code, out, err = compare_cli(capsys, Path("."))
    assert code == 2 and out == "" and err == refusal(Path("."), "payload:make")
    assert not (bundle / "IMPORTED").exists() and not (bundle / "CALLED").exists()
    assert "payload" not in sys.modules


def test_a_policy_file_inside_the_bundle_cannot_grant_trust(example_bundle, tmp_path, capsys, monkeypatch):
    marker = tmp_path / "PWNED"
    bundle = hostile_copy(example_bundle, tmp_path, "os:system", {"command": f"touch {marker}"})
    (bundle / "pyproject.toml").write_text('[tool.parity]\ntrust = ["os:system"]\n')
    monkeypatch.chdir(bundle)
    code, _, err = compare_cli(capsys, Path("."))
    assert code == 2
    assert err.startswith(f"parity: error: tolerance file {bundle / 'pyproject.toml'} is inside the bundle directory")
    code, _, err = compare_cli(capsys, bundle, "--tolerances", str(bundle / "pyproject.toml"))
    assert code == 2 and "a bundle cannot set its own tolerances or trust" in err
    assert not marker.exists()


def test_the_bundle_directory_is_taken_off_sys_path(example_bundle, tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(example_bundle))
    code, _, err = compare_cli(capsys, example_bundle, "--subject", EXAMPLE)
    assert code == 0, err
    assert all(Path(entry or ".").resolve() != example_bundle.resolve() for entry in sys.path)


# ---- what is trusted ----------------------------------------------------------------------------


def test_subject_on_the_command_line_must_match_the_bundle(example_bundle, capsys):
    code, out, err = compare_cli(capsys, example_bundle, "--subject", EXAMPLE)
    assert code == 0 and out.rstrip().endswith("PARITY HOLDS: 10/10 tensors"), err
    code, out, err = compare_cli(capsys, example_bundle, "--subject", "decoder")
    assert code == 2 and out == ""
    assert err == (f"parity: error: --subject 'decoder' does not match bundle {example_bundle}, which was captured "
                   f"from subject {EXAMPLE!r}\n")
    code, _, err = compare_cli(capsys, example_bundle)
    assert code == 2 and err == refusal(example_bundle, EXAMPLE)


def test_trust_lists_in_a_tolerance_file_and_in_pyproject(example_bundle, tmp_path, capsys, monkeypatch):
    toml = tmp_path / "parity.toml"
    toml.write_text(f'trust = ["{EXAMPLE}"]\n')
    code, out, err = compare_cli(capsys, example_bundle, "--tolerances", str(toml))
    assert code == 0 and out.rstrip().endswith("PARITY HOLDS: 10/10 tensors"), err
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text(f'[tool.parity]\ntrust = ["{EXAMPLE}"]\n')
    monkeypatch.chdir(project)
    code, _, err = compare_cli(capsys, example_bundle)
    assert code == 0, err
    toml.write_text('trust = ["some.other:spec"]\n')  # a list that does not name it trusts nothing more
    code, _, err = compare_cli(capsys, example_bundle, "--tolerances", str(toml))
    assert code == 2 and err == refusal(example_bundle, EXAMPLE)


def test_check_trusted_rules():
    for spec in ("attention", "decoder", "parity.run.subjects.decoder:DecoderSubject"):
        assert is_builtin(spec)
        check_trusted(spec)
    check_trusted("pkg.mod:make", ["pkg.mod:make"])
    for spec, message in (("pkg.mod:make", r"which this host does not trust; pass --subject pkg\.mod:make"),
                          ("nope", r"names unknown subject 'nope'"),
                          ("../x:y", r"bad subject spec '\.\./x:y'"),
                          ("a:b:c", r"bad subject spec 'a:b:c'"),
                          ("os:system\n\x1b[2J", r"bad subject spec 'os:system\\\\x0a\\\\x1b\[2J'"),
                          (None, r"names no usable subject spec"),
                          (["os:system"], r"names no usable subject spec")):
        with pytest.raises(UsageError, match=message) as info:
            check_trusted(spec, bundle="b")
        assert "\n" not in str(info.value) and "\x1b" not in str(info.value)


def test_trust_subject_is_for_code_on_this_host(example_bundle):
    from parity.bundle.reader import open_bundle

    manifest_subject = open_bundle(example_bundle).subject
    with pytest.raises(UsageError, match="does not trust"):
        runner_from_manifest(manifest_subject)
    with trusting(EXAMPLE):
        assert runner_from_manifest(manifest_subject).spec == EXAMPLE
    with pytest.raises(UsageError, match="does not trust"):  # only inside the block
        runner_from_manifest(manifest_subject)
    with pytest.raises(UsageError, match="bad subject spec"):
        trust_subject("not a spec")


def test_plugin_never_imports_a_spec_read_from_a_golden(example_bundle, tmp_path):
    """The test names the subject; a golden naming another spec is a failure, and nothing of the
    golden's spec is imported."""
    evil_dir = tmp_path / "evil"
    evil_dir.mkdir()
    (evil_dir / "evil_mod.py").write_text(EVIL)
    sys.path.insert(0, str(evil_dir))
    golden = hostile_copy(example_bundle, tmp_path, "evil_mod:make")
    result = check_subject(EXAMPLE, golden=golden, impl="reference", device="cpu")
    assert result.status == "fail" and "captured from subject 'evil_mod:make'" in result.message
    assert not (evil_dir / "IMPORTED").exists() and not (evil_dir / "CALLED").exists()
    # ...and a golden of the named user subject compares without any trust configuration.
    assert check_subject(EXAMPLE, golden=example_bundle, impl="reference", device="cpu").passed


# ---- the current directory: console script and python -m alike ----------------------------------


@pytest.mark.parametrize("entry", _entry_points(), ids=lambda e: "python -m parity" if "-m" in e else "parity")
def test_user_subject_in_the_current_directory_works_with_both_entry_points(tmp_path, entry):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    shutil.copy(TESTS_DIR / "user_subject_example.py", package / "subjects.py")
    spec = "mypkg.subjects:make_subject"

    def run(*args):
        return subprocess.run([*entry, *args], cwd=tmp_path, env=_clean_env(), capture_output=True, text=True,
                              timeout=300)

    proc = run("capture", "--subject", spec, "--out", "golden", "--reference", "none", "--quiet")
    assert proc.returncode == 0, proc.stderr
    proc = run("compare", "--golden", "golden", "--subject", spec, "--impl", "reference", "--device", "cpu", "--quiet")
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("PARITY HOLDS: 10/10 tensors"), proc.stderr


def test_a_user_subject_in_the_current_directory_named_only_by_the_bundle_is_refused(example_bundle, tmp_path, capsys,
                                                                                      monkeypatch):
    """Only the bundle names it: refused, although the module is right there in the directory
    (the refusal comes before any import, so in process, with the directory on sys.path)."""
    package = tmp_path / "mypkg_bundle_only"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "subjects.py").write_text(EVIL.replace("def make", "def make_subject"))
    spec = "mypkg_bundle_only.subjects:make_subject"
    hostile_copy(example_bundle, tmp_path, spec)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = compare_cli(capsys, Path("hostile"))
    assert code == 2 and out == "" and err == refusal(Path("hostile"), spec)
    assert not (package / "IMPORTED").exists() and "mypkg_bundle_only" not in sys.modules


# ---- manifest arguments and inputs are validated -------------------------------------------------


@pytest.fixture(scope="module")
def attention_bundle(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("trust-attention") / "attention"
    capture("attention", path, subject_args={"cases": "smoke"}, reference="none")
    return path


def _fake_memory(monkeypatch, gib: float) -> None:
    monkeypatch.setattr(subjects_base, "host_memory_bytes", lambda device=None: int(gib * 2**30))


@pytest.mark.parametrize("change, message", [
    (lambda m: m.pop("inputs_meta"),
     r"subject attention: the inputs' metadata has no 'layouts' object \(manifest inputs_meta\.layouts\)"),
    (lambda m: m["inputs_meta"]["layouts"].popitem(),
     r"subject attention, case B1-Hq2-Hkv2-Sq80-Sk80-D32-window48-bf16-s0: no layout metadata"),
    (lambda m: next(iter(m["inputs_meta"]["layouts"].values())).update(seq_k=10**12),
     r"layout metadata seq_k is 1000000000000, the case has 64"),
    (lambda m: next(iter(m["inputs_meta"]["layouts"].values())).update(mask=[1]),
     r"layout metadata mask must be an object"),
    (lambda m: m["subject"]["args"]["cases"][0].update(batch="x"),
     r"bundle .*: attention case batch must be a positive integer, got 'x'"),
    (lambda m: m["subject"]["args"]["cases"][0].update(layout={"x": 1}),
     r"bundle .*: unknown attention layout \{'x': 1\}"),
    (lambda m: m["subject"]["args"].update(cases=7),
     r"bundle .*: attention cases must be a set name or a list of cases, got int"),
    (lambda m: m["subject"]["args"].update(dtype=["fp16"]),
     r"bundle .*: attention dtype must be fp16, bf16 or fp32, got \['fp16'\]"),
    (lambda m: m["subject"]["args"]["cases"][0].update(seq_q=10**6, seq_k=10**6, heads_q=64, heads_kv=64),
     r"subject attention: case B1-Hq64-Hkv64-Sq1000000-Sk1000000-D32-causal-fp16-s0 \(and 1 more\) needs about "
     r"[\d.]+ GiB of memory \([\d.]+ GiB for attention scores\), this host has 16\.0 GiB"),
    (lambda m: m["subject"].update(spec="decoder", args={"seq_len": 10**6}),
     r"bundle .*: subject decoder: seq_len=1000000 needs about [\d.]+ GiB of memory \([\d.]+ GiB for attention "
     r"scores\), this host has 16\.0 GiB"),
], ids=["no-inputs-meta", "no-layout-meta", "layout-seq-k", "layout-mask", "case-type", "case-layout-type",
        "cases-type", "dtype-type", "case-too-big", "decoder-too-big"])
def test_manifest_arguments_and_inputs_are_validated(attention_bundle, tmp_path, capsys, monkeypatch, change, message):
    import re

    _fake_memory(monkeypatch, 16)
    bundle = tmp_path / "b"
    shutil.copytree(attention_bundle, bundle)
    edit(bundle, change)
    code, out, err = compare_cli(capsys, bundle)
    assert code == 2 and out == "", err
    assert err.count("\n") == 1 and re.search(message, err), err


def test_sizes_that_do_not_fit_are_refused_before_anything_is_allocated(monkeypatch):
    _fake_memory(monkeypatch, 23.4)
    with pytest.raises(UsageError, match=r"^subject decoder: seq_len=100000 needs about 34\.2 GiB of memory "
                                         r"\(18\.3 GiB for attention scores\), this host has 23\.4 GiB$"):
        load_subject("decoder", {"seq_len": 100000})
    with pytest.raises(UsageError, match=r"^subject decoder: heads=1000000 needs about [\d.]+ GiB of memory"):
        load_subject("decoder", {"heads": 10**6})
    with pytest.raises(UsageError, match=r"^subject decoder: vocab=1000000000000 "):
        load_subject("decoder", {"vocab": 10**12})
    with pytest.raises(UsageError, match=r"^subject attention: case B1-Hq1000000-"):
        load_subject("attention", {"cases": [dict(batch=1, heads_q=10**6, heads_kv=1, seq_q=64, seq_k=64,
                                                  head_dim=32)]})
    load_subject("attention", {"cases": "gpu"})  # production sizes fit
    load_subject("decoder", {"seq_len": 4096})


def test_real_host_memory_is_read():
    total = subjects_base.host_memory_bytes()
    assert total is None or total > 2**28


def test_decoder_checks_its_inputs_and_stored_layouts():
    runner = load_subject("decoder", {"layers": 1, "seq_len": 64})
    state = runner.make_state()
    inputs = runner.make_inputs()
    bad = {"tokens": inputs.tensors["tokens"].clone()}
    bad["tokens"][0, 0] = 256  # outside the vocabulary: an IndexError deep in nn.Embedding otherwise
    module = runner.build("reference", state=state)
    from parity.run.subjects import Inputs

    for tensors, message in ((bad, r"holds ids in \[\d+, 256\], outside the vocabulary \[0, 256\)"),
                             ({}, r"input 'tokens' is missing"),
                             ({"tokens": inputs.tensors["tokens"].float()}, r"must be an integer tensor"),
                             ({"tokens": inputs.tensors["tokens"][:, :10]}, r"has shape \[2, 10\], expected \[2, 64\]")):
        with pytest.raises(UsageError, match=message):
            runner.run(module, Inputs(tensors))
    broken = dict(state)
    broken["layers.0.attn.layout_kv_indices"] = torch.full_like(state["layers.0.attn.layout_kv_indices"], 99)
    broken["layers.0.attn.layout_kv_num_blocks"] = torch.ones_like(state["layers.0.attn.layout_kv_num_blocks"])
    with pytest.raises(UsageError, match=r"stored layout of layers\.0\.attn is unusable: .*outside"):
        runner.build("reference", state=broken)


def test_python_m_does_not_import_modules_from_the_current_directory(attention_bundle, tmp_path):
    """`python -m` puts the current directory first on sys.path; parity takes it off, so a
    `tabulate.py` lying there (imported lazily to print the report) is never picked up."""
    (tmp_path / "tabulate.py").write_text(EVIL.replace("def make", "def tabulate"))
    proc = subprocess.run([sys.executable, "-m", "parity", "compare", "--golden", str(attention_bundle), "--impl",
                           "reference", "--device", "cpu", "--quiet"], cwd=tmp_path, env=_clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("PARITY HOLDS: 4/4 tensors"), proc.stderr
    assert not (tmp_path / "IMPORTED").exists()


def test_gpu_memory_is_checked_before_a_build_on_the_gpu(monkeypatch):
    runner = load_subject("decoder", {"seq_len": 4096})

    def memory(device=None):
        return 2**30 if device is not None and torch.device(device).type == "cuda" else 2**40

    monkeypatch.setattr(subjects_base, "host_memory_bytes", memory)
    with pytest.raises(UsageError, match=r"^subject decoder: seq_len=4096 needs about [\d.]+ GiB of memory "
                                         r"\([\d.]+ GiB for [a-z ]+\), cuda has 1\.0 GiB$"):
        runner.build("reference", state=None, device="cuda")
