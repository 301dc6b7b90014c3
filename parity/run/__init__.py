"""Running a subject: ``subjects`` (what runs, and the trust rule), ``recorder`` (per-layer
tensors from forward hooks), ``runtime`` (devices, the Triton interpreter, progress), ``platform``
(the numerics-aware fingerprint), ``fuzz`` (the space of attention cases), ``capture`` (a run
recorded into a bundle). May import: ``parity.bundle``, ``parity.base``, ``parity.kernels``.
"""
