"""The checksums a bundle records: which algorithm each schema version uses, and how to take one.

A bundle records one digest per tensor and one per shard header (:mod:`parity.bundle.manifest`). Schema
versions 1 to 3 used sha256; versions 4 to 6 use BLAKE3 (the ``blake3`` package, the reference Rust
implementation's binding). Both are cryptographic hashes with 256-bit digests. BLAKE3 is chosen
for speed: 4.6 GB/s per core on the 2-core CPU machine against 1.8 GB/s for sha256 with the SHA
extensions (``python bench/harness/harness_benchmark.py --primitives``, bench/harness/BENCHMARK.md), and at the rate a
capture writes, the checksum was what bounded the writer there. Both release the GIL, so the
writer's and the reader's threads hash in parallel. Everything that hashes bundle bytes goes
through this module; the manifest's own seal (``manifest_sha256``) stays sha256 in every version.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable, Protocol

import blake3
import torch

SHA256 = "sha256"
BLAKE3 = "blake3"
# What each manifest schema version records its tensors' and shard headers' digests with.
ALGORITHM_OF_VERSION = {1: SHA256, 2: SHA256, 3: SHA256, 4: BLAKE3, 5: BLAKE3, 6: BLAKE3}


class Hasher(Protocol):
    def update(self, data: Any, /) -> Any: ...

    def hexdigest(self) -> str: ...


_NEW: dict[str, Callable[[], Hasher]] = {SHA256: hashlib.sha256, BLAKE3: blake3.blake3}


def new(algorithm: str) -> Hasher:
    """An incremental hasher of ``algorithm`` (``update``, ``hexdigest``)."""
    return _NEW[algorithm]()


def of_buffer(algorithm: str, data: Any) -> str:
    """Hex digest of a bytes-like object (hashed in place, no copy)."""
    hasher = new(algorithm)
    hasher.update(data)
    return hasher.hexdigest()


def of_tensor(algorithm: str, tensor: torch.Tensor) -> str:
    """Hex digest of a tensor's bytes in C order (native little-endian), independent of its strides."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return of_buffer(algorithm, flat.view(torch.uint8).numpy())
