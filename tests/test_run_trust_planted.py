"""A trusted spec whose module, or a parent package of it, lies inside a bundle directory is
refused before anything is imported: planted modules that write a marker file when run prove
that none ran, for a direct module, a regular package's ``__init__`` and a namespace package.

The spec is trusted the way a user would trust it (``trust = [...]`` under ``[tool.parity]`` of
the current directory's pyproject.toml), so only the location check stands between the bundle's
files and an import.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from parity.cli.main import main
from parity.run.capture import capture
from parity.run.subjects.loading import module_locations

EXAMPLE = "user_subject_example:make_subject"

# Running this file (importing it, or calling its factory) leaves a marker beside it.
PLANTED = '''
import pathlib
pathlib.Path(__file__).with_name("RAN-" + pathlib.Path(__file__).stem).write_text("ran")


def make(**args):
    pathlib.Path(__file__).with_name("CALLED").write_text("called")
    raise SystemExit(0)
'''


@pytest.fixture(scope="module")
def example_bundle(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("planted") / "example"
    capture(EXAMPLE, path, reference="none")
    return path


@pytest.fixture(autouse=True)
def _isolated_imports():
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    yield
    sys.path[:] = saved_path
    for name in set(sys.modules) - saved_modules:
        del sys.modules[name]


def _bundle_at(example_bundle: Path, where: Path, spec: str) -> Path:
    shutil.copytree(example_bundle, where)
    from parity.bundle.writer import edit_manifest

    edit_manifest(where, lambda manifest: manifest["subject"].update(spec=spec, args={}))
    return where


def _namespace(tmp_path, example_bundle):
    """The issue's case: ``golden/`` (no __init__) in the working directory, the bundle a
    directory below it, ``payload.py`` planted in the bundle."""
    bundle = _bundle_at(example_bundle, tmp_path / "work" / "golden" / "h200_attention",
                        "golden.h200_attention.payload:make")
    (bundle / "payload.py").write_text(PLANTED)
    return bundle, "golden.h200_attention.payload:make", "parent package 'golden.h200_attention'", bundle


def _package_init(tmp_path, example_bundle):
    """A regular package outside the bundle; the bundle is a subpackage of it whose
    ``__init__.py`` (planted) would run before the module."""
    package = tmp_path / "work" / "outerpkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    bundle = _bundle_at(example_bundle, package / "bundled", "outerpkg.bundled.payload:make")
    (bundle / "__init__.py").write_text(PLANTED)
    (bundle / "payload.py").write_text(PLANTED)
    return bundle, "outerpkg.bundled.payload:make", "parent package 'outerpkg.bundled'", bundle / "__init__.py"


def _direct_module(tmp_path, example_bundle):
    """A package outside the bundle whose module file is a link into the bundle: the module
    itself would be read from the bundle."""
    bundle = _bundle_at(example_bundle, tmp_path / "bundle", "linkedpkg.payload:make")
    (bundle / "payload.py").write_text(PLANTED)
    package = tmp_path / "work" / "linkedpkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "payload.py").symlink_to(bundle / "payload.py")
    return bundle, "linkedpkg.payload:make", "module 'linkedpkg.payload'", bundle / "payload.py"


@pytest.mark.parametrize("layout", [_namespace, _package_init, _direct_module],
                         ids=["namespace-package", "package-init", "direct-module"])
def test_a_trusted_spec_resolving_into_the_bundle_runs_nothing(tmp_path, example_bundle, layout, capsys,
                                                                 monkeypatch):
    bundle, spec, what, place = layout(tmp_path, example_bundle)
    work = tmp_path / "work"
    (work / "pyproject.toml").write_text(f'[tool.parity]\ntrust = ["{spec}"]\n')
    monkeypatch.chdir(work)
    code = main(["compare", "--bundle", str(bundle), "--impl", "reference", "--device", "cpu", "--quiet"])
    err = capsys.readouterr().err
    ran = [path.name for path in tmp_path.rglob("*") if path.name.startswith("RAN-") or path.name == "CALLED"]
    assert ran == []
    assert code == 2
    assert err == (f"parity: error: bundle {bundle}: subject {spec!r}: {what} would be loaded from "
                   f"{place.resolve()}, inside the bundle directory {bundle.resolve()}; "
                   "parity never runs code from a bundle\n")
    assert not any(name == spec.partition(":")[0] or name.startswith(spec.split(".")[0] + ".")
                   for name in sys.modules)


def test_module_locations_imports_nothing(tmp_path, monkeypatch):
    """Each level's files, found without running any of them; an unknown level ends the walk."""
    root = tmp_path / "root"
    (root / "nspkg" / "regular").mkdir(parents=True)
    (root / "nspkg" / "regular" / "__init__.py").write_text(PLANTED)
    (root / "nspkg" / "regular" / "leaf.py").write_text(PLANTED)
    monkeypatch.syspath_prepend(str(root))
    locations = module_locations("nspkg.regular.leaf")
    assert [(loc.name, loc.places, loc.loaded) for loc in locations] == [
        ("nspkg", (root.resolve() / "nspkg",), False),
        ("nspkg.regular", (root.resolve() / "nspkg" / "regular" / "__init__.py",
                           root.resolve() / "nspkg" / "regular"), False),
        ("nspkg.regular.leaf", (root.resolve() / "nspkg" / "regular" / "leaf.py",), False),
    ]
    assert [loc.name for loc in module_locations("nspkg.nothing.here")] == ["nspkg"]
    assert not any(path.name.startswith("RAN-") for path in root.rglob("*"))
    assert "nspkg" not in sys.modules
    assert [loc.loaded for loc in module_locations("os.path")] == [True, True]
