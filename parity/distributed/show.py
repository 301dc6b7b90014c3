"""What ``parity show`` reports of a rank set: the set from its top manifest, each rank's bundle and
its checksums, and each recorded tensor's placement with the full shape the set rebuilds.

The description is a ``parity-show-report`` document of its own variant (``rank_set`` in place of
``bundle``); :func:`parity.report.show.render_show` turns either into text. Nothing named in the
set is imported or run.
"""
from __future__ import annotations

import os
from typing import Any

from parity.bundle.manifest import DIGEST_FIELD
from parity.bundle.reader import BundleReader
from parity.report.show import SHOW_FORMAT, SHOW_VERSION
from .rankset import open_rank_set, rank_dir, verify_ranks
from .views import FullView


def describe_rank_set(path: str | os.PathLike, *, verify: bool = True) -> dict[str, Any]:
    """Everything ``show`` reports about the rank set at ``path``, opened whole (a BundleError names
    the rank otherwise); ``verify``: every rank's checksums checked first (:func:`verify_ranks`)."""
    rank_set = open_rank_set(path)
    try:
        if verify:
            verify_ranks(rank_set)
        view = FullView(rank_set)
        raw = rank_set.raw
        return {
            "format": SHOW_FORMAT,
            "version": SHOW_VERSION,
            "rank_set": str(rank_set.path),
            "set_id": rank_set.set_id,
            "world_size": rank_set.world_size,
            "mesh": rank_set.mesh,
            "backend": rank_set.backend,
            "parity_version": raw.get("parity_version"),
            "created": raw.get("created"),
            "subject": view.subject,
            "impl": view.impl,
            "device": view.device,
            "checksums": {"algorithm": rank_set.rank0.checksum, "verified": verify, "ok": True if verify else None},
            "ranks": [_describe_rank(rank, reader, verify) for rank, reader in enumerate(rank_set.ranks)],
            "placements": [{"name": entry.name, "placement": view.placement(entry.name).text, "dtype": entry.dtype,
                            "shape": list(entry.shape)} for entry in view.entries_of("output")],
            "placement_rules": raw.get("placement_rules"),
        }
    finally:
        rank_set.close()


def _describe_rank(rank: int, reader: BundleReader, verified: bool) -> dict[str, Any]:
    """One rank's row: its bundle, manifest digest, what it stores and whether its checksums were checked."""
    return {
        "rank": rank,
        "bundle": rank_dir(rank),
        "manifest_sha256": reader.manifest.get(DIGEST_FIELD),
        "tensors": len(reader.entries),
        "bytes": sum(entry.nbytes for entry in reader.entries),
        "shards": len(reader.shards),
        "holds_subject": bool(reader.entries_of("input") or reader.entries_of("state")),
        "checksums_verified": verified,
    }
