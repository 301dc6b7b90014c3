"""The repository's kernels/ folder never shadows the PyPI package ``kernels``.

kernels/ is installed as ``parity.kernels``. Run from a checkout (``python -m pytest``,
``python -m parity``), the repository root is on sys.path and a top-level ``import kernels``
would find the folder first; transformers >= 5.25 imports Hugging Face's ``kernels`` that way.
A stand-in package on the path plays the installed one here, so this holds whatever version of
transformers is installed.
"""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _import_kernels_from_the_checkout(extra_path: Path | None) -> str:
    code = "import kernels, sys; print(kernels.__name__, getattr(kernels, 'SOURCE', kernels.__file__))"
    env = {"PATH": "/usr/bin:/bin"}
    if extra_path is not None:
        env["PYTHONPATH"] = str(extra_path)
    # `python -c` puts the working directory first on sys.path, as `python -m` does.
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_an_installed_kernels_package_wins_over_the_checkout_folder(tmp_path):
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("SOURCE = 'installed'\n")
    assert _import_kernels_from_the_checkout(site) == "kernels installed"


def test_without_an_installed_one_the_folder_still_imports(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = _import_kernels_from_the_checkout(empty)
    # Either the venv has Hugging Face's kernels (transformers >= 5.25) or the folder loads as
    # itself; never an ImportError from a half-loaded package.
    name, where = out.split(" ", 1)
    assert name == "kernels"
    assert where.endswith("kernels/__init__.py")


def test_parity_kernels_is_the_folder():
    import parity.kernels

    assert Path(parity.kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"
    assert callable(parity.kernels.block_sparse_attention)
