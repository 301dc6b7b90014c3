"""The wheel's packages, discovered: parity/ as ``parity`` and kernels/ as ``parity.kernels``.

Everything else about the project is in pyproject.toml. Discovery replaces a hand-kept list, which
once left sub-packages out of the wheel while an editable install (which reads the folders) hid it.
"""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["parity", "parity.*"])
      + ["parity." + name for name in find_packages(include=["kernels", "kernels.*"])])
