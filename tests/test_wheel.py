"""What ``pip install`` gives is what the checkout tests: the wheel, built and installed.

An editable install (``make venv``) reads the folders, so a package or data file left out of the
wheel goes unseen there. Here the wheel is built once (``pip wheel --no-deps
--no-build-isolation`` from a copy of the checkout), installed without editable mode (``pip
install --no-deps --target``) and run from a directory outside the checkout:

- its files are exactly the package's: every file under parity/ and kernels/ (as parity/kernels/),
  nothing of the lab (bench/) or the tests, no top-level ``kernels``;
- a wheel with a sub-package left out fails that check, and its commands fail too;
- the README's commands on the built-in subjects work from it: ``make demo``'s first command
  (``python -m parity compare``) in a process of its own; capture, compare, diff, verify, show,
  profile, bench and inspect one after another in one process of the installed copy (through
  ``parity.cli.main.main``, as both entry points call it); and a two-rank gloo capture and
  compare under torchrun.

The installed copy runs in a scratch interpreter (a venv without pip) whose only view of the test
environment is its site-packages directory named in a ``.pth`` file: torch, Triton and the other
dependencies come from there, but the test environment's own ``.pth`` files are not processed, so
its editable ``parity`` (a finder that would fill any module missing from the wheel from this
checkout) is not there. The installed copy is found through ``PYTHONPATH`` alone.
"""
from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Folder in the checkout -> where its files go in the wheel (pyproject.toml, setup.py).
PACKAGE_FOLDERS = {"parity": "parity", "kernels": "parity/kernels"}
# What a copy of the checkout to build from leaves out: build outputs, caches, the environment,
# and the goldens (data the commands read from the checkout, never installed).
NOT_COPIED = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.pyc",
                                    ".pytest_cache", ".hypothesis", "golden", ".devrun", "out")


def package_files() -> set[str]:
    """The files the wheel must hold: every file of the package folders, at its installed path."""
    found = set()
    for folder, installed in PACKAGE_FOLDERS.items():
        for path in (REPO / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                found.add(f"{installed}/{path.relative_to(REPO / folder).as_posix()}")
    return found


def wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {name for name in archive.namelist() if ".dist-info/" not in name}


def differences(wheel: Path) -> tuple[set[str], set[str]]:
    """(package files the wheel lacks, files the wheel holds that are no package file)."""
    expected, held = package_files(), wheel_files(wheel)
    return expected - held, held - expected


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    shutil.copytree(REPO, source, ignore=NOT_COPIED)  # a fresh build: no stale build/ of an earlier one
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--disable-pip-version-check", "-q", "-w", str(root / "out"), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = (root / "out").glob("parity-*.whl")
    return built


def _scratch_python(root: Path) -> Path:
    """A venv without pip that sees the test environment's site-packages, not its .pth files."""
    env_dir = root / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    own_site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                              capture_output=True, text=True, check=True).stdout.strip()
    (Path(own_site) / "test-environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def _install(wheel: Path, target: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                           "--disable-pip-version-check", "--target", str(target), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


class Installed:
    """The scratch interpreter with one installed copy on PYTHONPATH, run in a folder outside the checkout."""

    def __init__(self, python: Path, target: Path, work: Path):
        self.python, self.target, self.work = python, target, work
        self.env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(work), "PYTHONPATH": str(target),
                    "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
                    "PYTHONDONTWRITEBYTECODE": "1"}

    def run(self, *argv: str, expect: int = 0, timeout: int = 300) -> subprocess.CompletedProcess:
        done = subprocess.run([str(self.python), *argv], cwd=self.work, env=self.env, capture_output=True,
                              text=True, timeout=timeout)
        assert done.returncode == expect, f"{' '.join(argv)}: exit {done.returncode}\n{done.stdout[-2000:]}\n" \
                                          f"{done.stderr[-3000:]}"
        return done

    def parity(self, *argv: str, expect: int = 0, timeout: int = 300) -> str:
        return self.run("-m", "parity", *argv, expect=expect, timeout=timeout).stdout

    def parity_in_one_process(self, *commands: list[str], timeout: int = 600) -> list[str]:
        """Each command's standard output, the commands run one after another in one process of
        the installed copy through ``parity.cli.main.main`` (what both entry points call), each
        required to return 0."""
        results = self.work / "in-one-process.json"
        done = self.run("-c", ONE_PROCESS, json.dumps([list(argv) for argv in commands]), str(results), timeout=timeout)
        for argv, (status, out) in zip(commands, json.loads(results.read_text())):
            assert status == 0, f"{' '.join(argv)}: exit {status}\n{out[-2000:]}\n{done.stderr[-3000:]}"
        return [out for _, out in json.loads(results.read_text())]


# The driver of Installed.parity_in_one_process. A Python start that imports torch costs 2-3
# CPU-seconds; one process for the README's commands saves nine of them. The process entry points
# themselves run here too (make demo's command below, torchrun) and in
# test_cli_exit_status.py::test_every_exit_status_in_a_real_process.
ONE_PROCESS = """
import contextlib, io, json, sys
from parity.cli.main import main
results = []
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(argv)
    results.append([status, out.getvalue()])
    if status != 0:
        break
with open(sys.argv[2], "w") as file:
    json.dump(results, file)
"""


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Installed:
    root = tmp_path_factory.mktemp("installed")
    _install(wheel, root / "site")
    (root / "work").mkdir()
    return Installed(_scratch_python(root), root / "site", root / "work")


def test_the_wheel_holds_the_package_and_nothing_else(wheel):
    missing, extra = differences(wheel)
    assert missing == set() and extra == set()
    held = wheel_files(wheel)
    assert {"parity/NUMERICS.md", "parity/schemas/compare-report.schema.json",
            "parity/distributed/rankset.py", "parity/speed/bench.py", "parity/kernels/triton_attention.py",
            "parity/kernels/sass_schedule.py", "parity/cli/commands/_distributed.py"} <= held
    assert not [name for name in held if not name.startswith("parity/")]  # no bench/, tests/, top-level kernels/
    assert not [name for name in held if "benchmark" in name or "probe_" in name or "roofline" in name]
    with zipfile.ZipFile(wheel) as archive:
        top_level = next(name for name in archive.namelist() if name.endswith(".dist-info/top_level.txt"))
        assert archive.read(top_level).decode().split() == ["parity"]


def test_a_wheel_without_a_sub_package_is_caught(wheel, tmp_path):
    """The failure this test exists for: a sub-package left out of the wheel, which an editable
    install hides. The file check names every missing file, and the installed copy's commands that
    need it end with exit 3 (so the scratch interpreter fills nothing in from the checkout)."""
    broken = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as good, zipfile.ZipFile(broken, "w") as bad:
        for item in good.infolist():
            if not item.filename.startswith("parity/speed/"):
                bad.writestr(item, good.read(item))
    missing, extra = differences(broken)
    assert missing == {name for name in package_files() if name.startswith("parity/speed/")} and len(missing) >= 9
    assert extra == set()
    _install(broken, tmp_path / "site")
    (tmp_path / "work").mkdir()
    scratch = Installed(_scratch_python(tmp_path), tmp_path / "site", tmp_path / "work")
    done = scratch.run("-m", "parity", "profile", "--subject", "attention", "--set", "cases=smoke", expect=3)
    assert "parity.speed" in done.stderr


def test_the_installed_copy_is_the_one_that_runs(installed):
    code = ("import importlib.util, json, parity, parity.kernels, parity.distributed, parity.speed; "
            "print(json.dumps([parity.__file__, parity.kernels.__file__, "
            "importlib.util.find_spec('bench') is None]))")
    parity_file, kernels_file, no_lab = json.loads(installed.run("-c", code).stdout)
    assert Path(parity_file).is_relative_to(installed.target)
    assert Path(kernels_file) == installed.target / "parity" / "kernels" / "__init__.py"
    assert no_lab  # the lab is nowhere on this interpreter's path


def test_the_readme_commands_run_from_the_installed_wheel(installed):
    # make demo's first command, through `python -m parity` of the installed copy: the Triton
    # kernel (interpreted) against the committed H200 goldens
    out = installed.parity("compare", "--bundle", str(REPO / "golden" / "h200-attention"), "--impl", "triton")
    assert "PARITY HOLDS: 16/16 tensors" in out
    smoke = ["--subject", "attention", "--cases", "smoke", "--impl", "reference"]
    outs = installed.parity_in_one_process(
        ["--version"],
        ["capture", *smoke, "--bundle", "bundles/a"],
        ["capture", *smoke, "--bundle", "bundles/b"],
        ["compare", "--bundle", "bundles/a", "--impl", "reference", "--json", "compare.json"],
        ["diff", "bundles/a", "bundles/b", "--html", "diff.html"],
        ["verify", "bundles/a"],
        ["show", "bundles/a", "--json", "show.json"],
        ["profile", "--subject", "attention", "--set", "cases=smoke", "--impl", "reference", "--skip", "0",
         "--warmup", "0", "--active", "1", "--json", "profile.json"],
        ["bench", "--bundle", "bundles/a", "--impls", "reference,triton", "--reps", "3", "--warmup", "1",
         "--json", "bench.json"],
        ["inspect", "--target", "gfx942", "--dtype", "fp16", "--head-dim", "64", "--jobs", "1", "--quiet",
         "--json", "inspect.json"])
    version, _, _, compared, diffed, _, _, profiled, _, _ = outs
    assert version.split() == ["parity", "0.1.0"]
    assert "PARITY HOLDS" in compared and "PARITY HOLDS" in diffed and "hot module" in profiled
    assert (installed.work / "diff.html").stat().st_size > 0
    for report, kind in (("compare", "compare"), ("show", "show"), ("profile", "profile"), ("bench", "bench"),
                         ("inspect", "inspect")):
        assert json.loads((installed.work / f"{report}.json").read_text())["format"] == f"parity-{kind}-report"


def test_torchrun_two_ranks_from_the_installed_wheel(installed):
    launch = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "parity")
    installed.run(*launch, "capture", "--subject", "attention", "--cases", "smoke", "--impl", "reference",
                  "--bundle", "bundles/set", timeout=300)
    assert (installed.work / "bundles" / "set" / "rankset.json").is_file()
    done = installed.run(*launch, "compare", "--bundle", "bundles/set", "--impl", "reference", timeout=300)
    assert "PARITY HOLDS: 8/8 tensors" in done.stdout
