"""The wheel's packages, discovered: parity/ as ``parity`` and kernels/ as ``parity.kernels``.

Everything else about the project is in pyproject.toml. A hand-kept list can leave a sub-package
out of the wheel while an editable install (which reads the folders) hides it; tests/test_wheel.py
builds the wheel and compares its files with the package folders'.
"""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["parity", "parity.*"])
      + ["parity." + name for name in find_packages(include=["kernels", "kernels.*"])])
