"""What a judge reads from a rank set: its full tensors, rebuilt from the ranks' shards on demand.

:class:`FullView` presents a rank set (or a plain bundle, a set of one rank) with the reading side
of :class:`parity.bundle.BundleReader` that :class:`parity.engine.Judge` uses (``entries_of``,
``has``, ``entry``, ``load``), so every existing rule (thresholds, error budget, fused modules,
strict structure) judges rebuilt full tensors unchanged. Entries carry the full shape; ``load``
rebuilds one tensor (:func:`parity.distributed.placement.rebuild`: one piece in memory besides it) and
verifies every piece's checksum as the bundle reader does. Replicated copies that disagree are
kept in :attr:`FullView.disagreements` for the caller to report.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from parity.bundle.reader import BundleReader, Entry
from parity.judge.engine import integrity
from parity.base.errors import BundleError
from parity.bundle.manifest import ITEMSIZE
from parity.base.text import printable
from .placement import REPLICATE, Disagreement, Placement, full_shape, rebuild, shard_offsets
from .rankset import RankSet

RECORDED_KINDS = ("output", "reference")


class FullView:
    """Full tensors of a rank set, or of a plain bundle (world size 1)."""

    def __init__(self, source: RankSet | BundleReader):
        if isinstance(source, RankSet):
            self.rank_set: RankSet | None = source
            self.readers = list(source.ranks)
            self.placements = dict(source.placements)
            self.path = source.path
        else:
            self.rank_set = None
            self.readers = [source]
            self.placements = {entry.name: REPLICATE for entry in source.entries_of("output")}
            self.path = source.path
        self.world_size = len(self.readers)
        self.disagreements: dict[tuple[str, str], list[Disagreement]] = {}
        self._entries: dict[str, list[Entry]] = {}
        self._index: dict[tuple[str, str], Entry] = {}
        self._local: dict[tuple[str, str], list[Entry]] = {}
        for kind in RECORDED_KINDS:
            per_rank = [{entry.name: entry for entry in reader.entries_of(kind)} for reader in self.readers]
            full_entries = []
            for entry in self.readers[0].entries_of(kind):
                pieces = [table[entry.name] for table in per_rank]
                placement = self.placement(entry.name)
                for rank, piece in enumerate(pieces):
                    if piece.dtype != entry.dtype:
                        raise BundleError(f"{printable(str(self.path))}: tensor '{printable(entry.name, limit=120)}' "
                                          f"is {piece.dtype} on rank {rank}, {entry.dtype} on rank 0")
                shape = full_shape(entry.name, placement, [piece.shape for piece in pieces])
                numel = 1
                for size in shape:
                    numel *= size
                full = dataclasses.replace(entry, shape=shape, nbytes=numel * ITEMSIZE[entry.dtype])
                full_entries.append(full)
                self._index[(kind, entry.name)] = full
                self._local[(kind, entry.name)] = pieces
            self._entries[kind] = full_entries

    # what the judge and the reports read ------------------------------------------------------
    @property
    def rank0(self) -> BundleReader:
        return self.readers[0]

    @property
    def subject(self) -> dict[str, Any]:
        return self.rank0.subject

    @property
    def impl(self) -> str | None:
        return self.rank0.impl

    @property
    def device(self) -> str | None:
        return self.rank0.device

    @property
    def platform(self) -> dict[str, Any]:
        return self.rank0.platform

    @property
    def kernel_configs(self) -> dict[str, Any] | None:
        return self.rank0.kernel_configs

    @property
    def capture_layers(self) -> list[str] | None:
        return self.rank0.capture_layers

    def placement(self, name: str) -> Placement:
        return self.placements.get(name, REPLICATE)

    def entries_of(self, kind: str) -> list[Entry]:
        return list(self._entries.get(kind, []))

    def has(self, name: str, kind: str = "output") -> bool:
        return (kind, name) in self._index

    def entry(self, name: str, kind: str = "output") -> Entry:
        try:
            return self._index[(kind, name)]
        except KeyError:
            raise BundleError(f"{printable(str(self.path))}: no {kind} tensor named '{printable(name, limit=120)}'") \
                from None

    def load(self, entry: Entry | str, kind: str = "output", *, device: torch.device | str | None = None) -> torch.Tensor:
        """The full tensor, rebuilt (each piece's checksum verified); replicated copies that differ
        from rank 0's are recorded in :attr:`disagreements`."""
        name = entry if isinstance(entry, str) else entry.name
        full = self.entry(name, kind)
        pieces = self._local[(kind, name)]
        def load_piece(rank: int) -> torch.Tensor:
            try:
                return self.readers[rank].load(pieces[rank])
            except BundleError as err:
                if self.rank_set is None:
                    raise
                raise BundleError(f"rank set {printable(str(self.path))}: rank {rank}: {err}") from None

        rebuilt = rebuild(name, self.placement(name), [piece.shape for piece in pieces], full.torch_dtype, load_piece)
        if rebuilt.disagreements:
            self.disagreements[(kind, name)] = rebuilt.disagreements
        return rebuilt.tensor if device is None else rebuilt.tensor.to(device)

    def slices(self, name: str) -> list[tuple[int, int, int]] | None:
        """``(rank, start, length)`` along the shard dim of a sharded output; None otherwise."""
        placement = self.placement(name)
        if placement.kind != "shard":
            return None
        pieces = self._local[("output", name)]
        return [(rank, start, length)
                for rank, (start, length) in enumerate(shard_offsets(placement, [p.shape for p in pieces]))]

    def integrity(self) -> dict[str, Any]:
        """Every rank bundle's :func:`parity.judge.engine.integrity`, added up."""
        total: dict[str, Any] = {"tensors": 0, "verified": 0, "not_read": {}}
        for reader in self.readers:
            part = integrity(reader)
            total["tensors"] += part["tensors"]
            total["verified"] += part["verified"]
            for kind, count in part["not_read"].items():
                total["not_read"][kind] = total["not_read"].get(kind, 0) + count
        return total


def describe(view: FullView) -> str:
    if view.rank_set is None:
        return f"bundle {printable(str(view.path))}"
    return f"rank set {printable(str(view.path))} ({view.world_size} ranks)"


__all__ = ["FullView", "describe"]
