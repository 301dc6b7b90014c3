"""The safetensors shard format of a bundle: the dtype codes, the bytes of a shard file, tensor digests.

A shard is a safetensors file: an 8-byte little-endian header length, a JSON header (padded with
spaces to a multiple of 8) naming each tensor's dtype, shape and byte range, then the tensors'
bytes in order. The writer produces it with :func:`shard_chunks`; the reader parses it
(:mod:`parity.bundle.reader`). Imports :mod:`parity.bundle.manifest` and :mod:`parity.bundle.checksums`.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from parity.base.errors import UsageError
from parity.bundle import checksums
from parity.bundle.manifest import DTYPES, SCHEMA_VERSION

DEFAULT_SHARD_BYTES = 256 * 1024 * 1024
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

# safetensors' dtype codes for the dtypes a bundle stores.
ST_CODES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}
ST_NAMES = {code: name for name, code in ST_CODES.items()}
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit

# What a new bundle's tensors and shard headers are hashed with (schema 4: BLAKE3, parity.bundle.checksums).
WRITE_CHECKSUM = checksums.ALGORITHM_OF_VERSION[SCHEMA_VERSION]


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name for a torch dtype (``"bfloat16"``)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise UsageError(f"tensors of dtype {dtype} cannot be stored in a bundle") from None


def tensor_checksum(tensor: torch.Tensor) -> str:
    """The digest a new bundle records for a tensor (:data:`WRITE_CHECKSUM`)."""
    return checksums.of_tensor(WRITE_CHECKSUM, tensor)


def shard_chunks(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> Iterator[Any]:
    """A safetensors file: 8-byte little-endian header length, JSON header padded with spaces
    to a multiple of 8, then each tensor's bytes in order (the format's contiguous layout)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": ST_CODES[dtype_name(tensor.dtype)], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    yield struct.pack("<Q", len(text))
    yield text
    for tensor in tensors.values():
        yield tensor.reshape(-1).view(torch.uint8).numpy()

