"""Where a recorded tensor lives on a 1-D device mesh, and rebuilding the full tensor from the ranks' pieces.

A placement is DTensor's: ``Shard(dim)`` (each rank holds a slice along ``dim``, in rank order;
uneven slices as ``torch.chunk`` makes them, trailing ranks possibly empty), ``Replicate`` (every
rank holds the whole tensor) or ``Partial(sum)`` (the full tensor is the sum of the ranks' tensors).
Its text form, used on the command line and in placement maps, is ``shard(DIM)``, ``replicate``
or ``partial``; in a manifest it is ``{"kind": "shard", "dim": 2}``.

Where a recorded tensor's placement comes from, first match wins:

1. a DTensor output carries its own (:func:`unwrap_dtensor`; the recorder stores the local shard);
2. the user's placement map (``module glob -> placement``, later entries winning), for plain tensors
   of a manual (Megatron-style) split;
3. the subject's parallelize plan: a ``ColwiseParallel``/``RowwiseParallel``/... style whose output
   is converted to a local tensor (``use_local_output``) places it at the style's output layout
   (:meth:`PlacementMap.from_plan`);
4. otherwise ``Replicate``: a module that was not split computes the same tensor on every rank,
   and rebuilding checks that the copies agree.

Rebuilding (:func:`rebuild`) reads one rank's piece at a time: a shard is copied into its slice of
the full tensor, a partial is added to an accumulator in the accumulation dtype (fp32 for 16-bit
and fp32 tensors, fp64 for fp64) and rounded once, a replicate's copies are compared bit for bit
with rank 0's. So at most one full tensor (plus one piece) is held.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from parity.base import dtypes
from parity.base.errors import BundleError, UsageError
from parity.base.text import printable

KINDS = ("shard", "replicate", "partial")
_TEXT = re.compile(r"\s*(shard|replicate|partial)\s*(?:\(\s*([^)]*?)\s*\))?\s*", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Placement:
    """A tensor's placement on a 1-D mesh: ``kind`` is ``shard`` (with ``dim``), ``replicate`` or
    ``partial`` (a sum)."""

    kind: str
    dim: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown placement kind {self.kind!r}")
        if (self.kind == "shard") != (self.dim is not None):
            raise ValueError("a shard placement has a dim, the others none")

    @property
    def text(self) -> str:
        return f"shard({self.dim})" if self.kind == "shard" else "partial(sum)" if self.kind == "partial" else "replicate"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "dim": self.dim} if self.kind == "shard" else {"kind": self.kind}

    def normalized(self, ndim: int, *, what: str) -> "Placement":
        """The same placement with a non-negative dim for a tensor of ``ndim`` dimensions."""
        if self.kind != "shard":
            return self
        assert self.dim is not None
        if not -ndim <= self.dim < ndim:
            raise UsageError(f"{what}: placement {self.text} does not fit a tensor of {ndim} dimensions")
        return Placement("shard", self.dim % ndim)


REPLICATE = Placement("replicate")
PARTIAL = Placement("partial")


def shard(dim: int) -> Placement:
    return Placement("shard", dim)


def parse_placement(text: str, *, what: str = "placement") -> Placement:
    """``"shard(-1)"``, ``"Shard(2)"``, ``"replicate"``, ``"partial"`` or ``"partial(sum)"``."""
    match = _TEXT.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise UsageError(f"{what}: {printable(str(text))!r} is not a placement; use shard(DIM), replicate or partial")
    kind, argument = match.group(1).lower(), match.group(2)
    if kind == "shard":
        try:
            return Placement("shard", int(argument))
        except (TypeError, ValueError):
            raise UsageError(f"{what}: shard needs an integer dim, as in shard(-1); got {printable(text)!r}") from None
    if kind == "partial":
        if argument not in (None, "", "sum"):
            raise UsageError(f"{what}: only partial(sum) is supported, got {printable(text)!r}")
        return PARTIAL
    if argument:
        raise UsageError(f"{what}: replicate takes no argument, got {printable(text)!r}")
    return REPLICATE


def placement_from_json(value: Any, where: str) -> Placement:
    """A placement from a manifest (data): a BundleError naming ``where`` for anything malformed."""
    if not isinstance(value, dict) or value.get("kind") not in KINDS:
        raise BundleError(f"{where}: expected a placement object with kind shard, replicate or partial")
    dim = value.get("dim")
    if value["kind"] == "shard":
        if not isinstance(dim, int) or isinstance(dim, bool) or not -64 <= dim < 64:
            raise BundleError(f"{where}: a shard placement needs a dim from -64 to 63")
        return Placement("shard", dim)
    if dim is not None:
        raise BundleError(f"{where}: a {value['kind']} placement has no dim")
    return Placement(value["kind"])


def from_torch(placement: Any, *, what: str) -> Placement:
    """A torch.distributed.tensor placement (``Shard``, ``Replicate``, ``Partial``) as a Placement."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if isinstance(placement, Shard):
        return Placement("shard", int(placement.dim))
    if isinstance(placement, Replicate):
        return REPLICATE
    if isinstance(placement, Partial):
        if getattr(placement, "reduce_op", "sum") != "sum":
            raise UsageError(f"{what}: partial placement with reduce op {placement.reduce_op!r}; only sum is supported")
        return PARTIAL
    raise UsageError(f"{what}: placement {type(placement).__name__} is not supported (Shard, Replicate, Partial)")


def unwrap_dtensor(tensor: torch.Tensor, *, what: str = "tensor") -> tuple[torch.Tensor, Placement | None]:
    """``(local tensor, placement)`` of a DTensor on a 1-D mesh; ``(tensor, None)`` for a plain tensor.

    No DTensor can exist before ``torch.distributed.tensor`` was imported, so a plain run never
    imports it here.
    """
    module = sys.modules.get("torch.distributed.tensor")
    if module is None or not isinstance(tensor, module.DTensor):
        return tensor, None
    placements = tensor.placements
    if len(placements) != 1:
        raise UsageError(f"{what}: a DTensor on a {len(placements)}-D device mesh; parity records 1-D meshes only")
    placement = from_torch(placements[0], what=what).normalized(tensor.ndim, what=what)
    return tensor.to_local(), placement


def style_output_placement(style: Any) -> Placement | None:
    """The placement of a module's plain output under a parallel style (``ColwiseParallel`` gives
    ``Shard(-1)``, ``RowwiseParallel`` ``Replicate``); None when the style returns DTensors (they
    carry their own) or says nothing about its output."""
    if not getattr(style, "use_local_output", False):
        return None
    layouts = getattr(style, "output_layouts", None)
    if layouts is None:
        return None
    layout = layouts[0] if isinstance(layouts, (tuple, list)) else layouts
    if layout is None:
        return None
    return from_torch(layout, what=f"parallel style {type(style).__name__}")


@dataclasses.dataclass(frozen=True)
class PlacementRule:
    pattern: str
    placement: Placement
    source: str  # "map" (the user's) or "plan" (derived from a parallelize plan)


class PlacementMap:
    """Module (or tensor name) globs -> placements; the last matching rule wins.

    A rule matches a recorded tensor when its glob (``fnmatch``) matches the tensor's module path
    (``layers.0.mlp.up_proj``) or its full name (``layers.0.attn/0``).
    """

    def __init__(self, rules: Iterable[PlacementRule] = ()):
        self.rules = list(rules)

    def __add__(self, other: "PlacementMap") -> "PlacementMap":
        return PlacementMap(self.rules + other.rules)

    def __bool__(self) -> bool:
        return bool(self.rules)

    @classmethod
    def parse(cls, items: Iterable[str] | Mapping[str, str], *, flag: str = "--placement") -> "PlacementMap":
        """From ``GLOB=PLACEMENT`` strings (the CLI) or a mapping ``{glob: placement text}``."""
        pairs: list[tuple[str, str]] = []
        if isinstance(items, Mapping):
            pairs = [(str(key), value) for key, value in items.items()]
        else:
            for item in items:
                glob, sep, text = str(item).rpartition("=")
                if not sep or not glob.strip():
                    raise UsageError(f"{flag} {printable(str(item))!r}: expected GLOB=PLACEMENT, as in "
                                     "'layers.*.mlp.up_proj=shard(-1)'")
                pairs.append((glob.strip(), text))
        return cls(PlacementRule(glob, parse_placement(text, what=f"{flag} {glob}"), "map") for glob, text in pairs)

    @classmethod
    def from_plan(cls, plan: Mapping[str, Any]) -> "PlacementMap":
        """The placements of the plain outputs a ``parallelize_module`` plan produces."""
        rules = []
        for pattern, style in plan.items():
            placement = style_output_placement(style)
            if placement is not None:
                rules.append(PlacementRule(pattern, placement, "plan"))
        return cls(rules)

    def lookup(self, module: str, name: str) -> PlacementRule | None:
        for rule in reversed(self.rules):
            if fnmatch.fnmatchcase(module, rule.pattern) or fnmatch.fnmatchcase(name, rule.pattern):
                return rule
        return None

    def to_json(self) -> list[dict[str, Any]]:
        return [{"match": rule.pattern, "placement": rule.placement.text, "source": rule.source} for rule in self.rules]


# --------------------------------------------------------------------------------------------
# Rebuilding


@dataclasses.dataclass(frozen=True)
class Disagreement:
    """A replicated tensor whose copy on ``rank`` is not rank 0's, bit for bit."""

    rank: int
    max_abs: float | None  # None where the shapes or dtypes differ

    @property
    def text(self) -> str:
        size = f" (max abs difference {self.max_abs:.3g})" if self.max_abs is not None else ""
        return f"rank {self.rank}'s copy differs from rank 0's{size}"


@dataclasses.dataclass
class Rebuilt:
    tensor: torch.Tensor
    disagreements: list[Disagreement]


def full_shape(name: str, placement: Placement, shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """The full tensor's shape from each rank's local shape; a BundleError where they do not fit."""
    first = tuple(shapes[0])
    if placement.kind != "shard":
        for rank, local in enumerate(shapes):
            if tuple(local) != first:
                raise BundleError(f"tensor '{printable(name, limit=120)}' is {placement.text} but rank {rank} holds "
                                  f"shape {list(local)}, rank 0 {list(first)}")
        return first
    dim = placement.dim
    assert dim is not None
    for rank, local in enumerate(shapes):
        if len(local) != len(first) or dim >= len(local) or any(
                a != b for index, (a, b) in enumerate(zip(local, first)) if index != dim):
            raise BundleError(f"tensor '{printable(name, limit=120)}' is {placement.text} but rank {rank}'s shard "
                              f"{list(local)} does not fit rank 0's {list(first)}")
    return first[:dim] + (sum(local[dim] for local in shapes),) + first[dim + 1:]


def shard_offsets(placement: Placement, shapes: Sequence[tuple[int, ...]]) -> list[tuple[int, int]]:
    """``(start, length)`` of each rank's slice along the shard dim."""
    assert placement.kind == "shard" and placement.dim is not None
    offsets, start = [], 0
    for local in shapes:
        offsets.append((start, local[placement.dim]))
        start += local[placement.dim]
    return offsets


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def rebuild(name: str, placement: Placement, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype,
            load: Callable[[int], torch.Tensor]) -> Rebuilt:
    """The full tensor from the ranks' pieces, ``load(rank)`` reading one at a time (module docstring).

    ``shapes`` are the ranks' local shapes as recorded (checked here to fit the placement).
    """
    shape = full_shape(name, placement, shapes)
    if placement.kind == "shard":
        full = torch.empty(shape, dtype=dtype)
        dim = placement.dim
        for rank, (start, length) in enumerate(shard_offsets(placement, shapes)):
            piece = load(rank)
            full.narrow(dim, start, length).copy_(piece)
            del piece
        return Rebuilt(full, [])
    if placement.kind == "partial":
        wide = dtypes.accumulation_dtype(dtype) if dtype.is_floating_point else torch.int64
        total = load(0).to(wide, copy=True)
        for rank in range(1, len(shapes)):
            total += load(rank).to(wide)
        return Rebuilt(total.to(dtype), [])
    first = load(0)
    disagreements = []
    for rank in range(1, len(shapes)):
        other = load(rank)
        if not _bitwise_equal(first, other):
            max_abs = None
            if first.shape == other.shape and first.dtype == other.dtype:
                max_abs = float((first.double() - other.double()).abs().nan_to_num(float("inf")).max()) \
                    if first.numel() else 0.0
            disagreements.append(Disagreement(rank, max_abs))
        del other
    return Rebuilt(first, disagreements)
