"""The install path: the Makefile's pip commands (default, and TORCH_INDEX for PyTorch's CPU index)
and a dry-run resolution of its pins with the project's requirements against a package index
(skipped, with pip's reason, where no index provides torch)."""
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # the URL the Makefile documents

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def _make_commands(tmp_path, *assignments):
    """The commands ``make venv`` would run for a fresh venv, each split as the shell would."""
    result = subprocess.run(["make", "-n", "-C", str(ROOT), "venv", f"VENV={tmp_path / 'venv'}", *assignments],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [shlex.split(line) for line in result.stdout.splitlines() if line.strip()]


def _pip_installs(commands):
    return [command[command.index("install") + 1:] for command in commands
            if command[1:4] == ["-m", "pip", "install"]]


def _requirements(args):
    """The requirement arguments of a pip install command (options and their values left out)."""
    out, value_next = [], False
    for arg in args:
        if value_next:
            value_next = False
        elif arg in ("--index-url", "-i", "--extra-index-url", "--find-links", "-f"):
            value_next = True
        elif not arg.startswith("-") and arg != ".[triton,test]":
            out.append(arg)
    return out


@needs_make
def test_default_installs_torch_and_triton_together_from_the_configured_index(tmp_path):
    installs = _pip_installs(_make_commands(tmp_path))
    assert len(installs) == 2
    first, project = installs
    assert "--index-url" not in first
    assert _requirements(first) == ["torch==2.13.0", 'triton==3.9.0; python_version >= "3.11"',
                                    'triton==3.8.0; python_version < "3.11"']
    assert project[-2:] == ["-e", ".[triton,test]"]


@needs_make
def test_torch_index_installs_torch_alone_from_it_first(tmp_path):
    installs = _pip_installs(_make_commands(tmp_path, f"TORCH_INDEX={CPU_INDEX}"))
    assert len(installs) == 3
    torch_only, triton, project = installs
    assert torch_only[torch_only.index("--index-url") + 1] == CPU_INDEX
    assert _requirements(torch_only) == ["torch==2.13.0"]  # nothing else may come from that index
    assert "--index-url" not in triton and _requirements(triton) == [
        'triton==3.9.0; python_version >= "3.11"', 'triton==3.8.0; python_version < "3.11"']
    assert "--index-url" not in project and project[-2:] == ["-e", ".[triton,test]"]


def test_pyproject_declares_tomli_before_311():
    try:
        import tomllib
    except ModuleNotFoundError:
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    from packaging.requirements import Requirement

    tomli = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "tomli"]
    assert len(tomli) == 1 and str(tomli[0].specifier) == ">=2"
    assert tomli[0].marker.evaluate({"python_version": "3.10"}) and not tomli[0].marker.evaluate(
        {"python_version": "3.11"})


def _dry_run(*args, timeout=900, isolated=False):
    """``pip install --dry-run --ignore-installed --report -`` in this interpreter: (ok, report or
    pip's last lines). ``isolated``: pip ignores its configuration and environment (find-links,
    extra indexes), so only the index named in ``args`` is asked."""
    command = [sys.executable, "-m", "pip", *(["--isolated", "--retries", "1", "--timeout", "30"] if isolated else []),
               "install", "--dry-run", "--ignore-installed", "--quiet", "--disable-pip-version-check",
               "--report", "-", *args]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                env={**os.environ, "PIP_NO_INPUT": "1"})
    except subprocess.TimeoutExpired:
        return False, "pip timed out"
    if result.returncode != 0:
        return False, " | ".join(line.strip() for line in result.stderr.splitlines()[-3:])
    return True, json.loads(result.stdout)


def _resolved(report):
    return {item["metadata"]["name"].lower(): item["metadata"] for item in report["install"]}


def _probe_or_skip(*args, isolated=False):
    ok, answer = _dry_run("--no-deps", *args, timeout=300, isolated=isolated)
    if not ok:
        pytest.skip(f"no index answered for {' '.join(args)}: {answer[-300:]}")


def _project_requirements():
    try:
        import tomllib
    except ModuleNotFoundError:
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return project["dependencies"] + extras["triton"] + extras["test"]


def _index_answers_or_skip(index):
    """Skip unless ``index`` serves torch's project page (PEP 503), e.g. offline or a blocked host."""
    import urllib.error
    import urllib.request

    url = f"{index.rstrip('/')}/torch/"
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            response.read(1)
    except (urllib.error.URLError, OSError, ValueError) as err:
        pytest.skip(f"index {index} does not answer ({url}: {getattr(err, 'reason', err)})")


def _check_torch_from(index, torch_pin):
    """torch resolved from ``index`` alone (pip's configuration ignored): a build without Triton."""
    _index_answers_or_skip(index)
    ok, report = _dry_run("--index-url", index, *torch_pin, isolated=True)
    assert ok, f"{' '.join(torch_pin)} does not resolve from {index}: {report}"
    torch_item = next(item for item in report["install"] if item["metadata"]["name"].lower() == "torch")
    assert torch_item["download_info"]["url"].startswith(index.rstrip("/").rsplit("/whl", 1)[0])
    assert not [r for r in torch_item["metadata"].get("requires_dist", []) if r.startswith("triton")]


def _check_rest(triton_pins):
    ok, report = _dry_run(*triton_pins, *[r for r in _project_requirements() if not r.startswith("torch")])
    assert ok, f"Triton and the project's requirements do not resolve: {report}"
    assert _resolved(report)["triton"]["version"] == ("3.9.0" if sys.version_info >= (3, 11) else "3.8.0")


@pytest.mark.install
@needs_make
def test_make_pins_resolve_with_the_project_requirements(tmp_path):
    """What ``make venv`` installs, resolved as pip here sees it: with the ``TORCH_INDEX`` of this
    environment if set (CI on the public index: TORCH_INDEX=https://download.pytorch.org/whl/cpu),
    else everything together from the configured index."""
    torch_index = os.environ.get("TORCH_INDEX", "").strip()
    if torch_index:
        torch_only, triton, _ = _pip_installs(_make_commands(tmp_path, f"TORCH_INDEX={torch_index}"))
        _check_torch_from(torch_index, _requirements(torch_only))
        _check_rest(_requirements(triton))
        return
    pins = _requirements(_pip_installs(_make_commands(tmp_path))[0])
    _probe_or_skip(pins[0])
    ok, report = _dry_run(*pins, *_project_requirements())
    assert ok, (f"the Makefile's pins do not resolve with the project's requirements from the configured index "
                f"(on the public index, set TORCH_INDEX={CPU_INDEX}): {report}")
    resolved = _resolved(report)
    assert resolved["torch"]["version"].split("+")[0] == "2.13.0"
    assert resolved["triton"]["version"] == ("3.9.0" if sys.version_info >= (3, 11) else "3.8.0")
    # the torch chosen is a CPU build: it asks for no Triton of its own (a CUDA build pins one)
    assert not [r for r in resolved["torch"].get("requires_dist", []) if r.startswith("triton")]


@pytest.mark.install
@needs_make
def test_documented_cpu_index_resolves(tmp_path):
    """The README's command (TORCH_INDEX=https://download.pytorch.org/whl/cpu, or
    PARITY_TEST_TORCH_INDEX): torch from there alone has no Triton requirement, and Triton with
    the project's other requirements resolves from the usual index."""
    index = os.environ.get("PARITY_TEST_TORCH_INDEX", CPU_INDEX)
    torch_only, triton, _ = _pip_installs(_make_commands(tmp_path, f"TORCH_INDEX={index}"))
    _check_torch_from(index, _requirements(torch_only))
    _check_rest(_requirements(triton))
