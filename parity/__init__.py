"""parity: numerical parity verification for GPU kernels ported across vendors.

The pipeline, one folder per stage: ``run`` a subject and record it into a ``bundle``; ``judge``
it against another run or bundle; ``report`` the result; the ``cli`` and the pytest side
(``testing``) on top; ``base`` below them all, and the kernel layer (``parity.kernels``) below
the harness.

The public API, listed here and nowhere else; each name is imported when first used, so that
``import parity`` stays cheap (no torch):

- :func:`capture`: run a subject and record its inputs and per-layer outputs into a bundle.
- :func:`compare_bundle`: run a bundle's subject here and judge every recorded tensor.
- :func:`diff_bundles`: judge bundle B against golden bundle A without running anything.
- :class:`Subject` and :class:`Inputs`: what a user's own subject (``--subject pkg.mod:factory``)
  is written with (the protocol: :mod:`parity.run.subjects`).
- the pytest plugin's fixture ``parity_check`` and marker ``parity`` (registered through the
  ``pytest11`` entry point, :mod:`parity.testing.plugin`), and the golden lifecycle's
  :func:`check_parity`, :func:`assert_parity`, :class:`ParityFailure`.
- ``parity.kernels``: the Triton block-sparse attention kernel, its reference and layouts.
"""
import importlib

__version__ = "0.1.0"

# name -> the module that defines it
_API = {
    "capture": "parity.run.capture",
    "compare_bundle": "parity.judge.compare",
    "diff_bundles": "parity.judge.diff",
    "Subject": "parity.run.subjects.base",
    "Inputs": "parity.run.subjects.base",
    "check_parity": "parity.testing.goldens",
    "assert_parity": "parity.testing.goldens",
    "ParityFailure": "parity.testing.goldens",
    "kernels": "parity.kernels",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'parity' has no attribute {name!r}")
    module = importlib.import_module(_API[name])
    value = module if module.__name__ == f"parity.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
