"""Judging: ``metrics`` (errors of a tensor against its golden), ``policy`` (tolerances, their
loading, and the "would pass with" arithmetic), ``checks`` (one tensor's verdict, the error
budget), ``engine`` (the Judge over a bundle's tensors), ``results`` (the result model and the
verdict line), ``compare`` (run a bundle's subject here and judge it), ``diff`` (judge two bundles).
May import: ``parity.run``, ``parity.bundle``, ``parity.base``, ``parity.kernels``.
"""
