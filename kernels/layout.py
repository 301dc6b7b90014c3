"""Block layouts for block-sparse attention: which key blocks each query block visits.

The layout follows FlexAttention's BlockMask: for every (batch, head, query block) a count and a
sorted list of key/value block indices, split into *partial* blocks (the element mask is applied
inside the block) and *full* blocks (every element is visible, the mask is skipped). Batch and
head dimensions may be 1 and then broadcast.

The element mask is a small parametric predicate (``MaskSpec``) that the kernel evaluates in
registers; a key ``k`` is visible to a query ``q`` in a partial block when::

    k < seq_k
    and (not causal or k <= q + offset)
    and (window == 0 or k > q + offset - window or k < sink_tokens)

The semantics of a layout (what the kernel and the reference both compute) are: an element is
visible iff its block is full, or its block is partial and the predicate holds.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

__all__ = [
    "MaskSpec",
    "BlockLayout",
    "LayoutError",
    "causal_layout",
    "sliding_window_layout",
    "sink_layout",
    "random_layout",
    "layout_from_block_mask",
]

SKIP, PARTIAL, FULL = 0, 1, 2
_TENSOR_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


class LayoutError(ValueError):
    """A block layout is malformed or does not fit the tensors it is used with."""


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """The element-level mask applied inside partial blocks (see the module docstring)."""

    causal: bool = False
    window: int = 0
    sink_tokens: int = 0
    offset: int = 0

    def __post_init__(self):
        # Layout metadata travels in bundles: a re-typed field (causal = {}) must be an error,
        # not a silently different mask.
        if not isinstance(self.causal, bool):
            raise LayoutError(f"mask causal must be true or false, got {self.causal!r}")
        for name in ("window", "sink_tokens", "offset"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise LayoutError(f"mask {name} must be an integer, got {value!r}")
        if self.window < 0 or self.sink_tokens < 0:
            raise LayoutError(f"window and sink_tokens must be >= 0, got {self}")
        if self.window and not self.causal:
            raise LayoutError("a sliding window needs causal=True (the window trails the query)")

    def visible(self, q_idx: torch.Tensor, k_idx: torch.Tensor, seq_k: int) -> torch.Tensor:
        """Boolean visibility for broadcastable query and key index tensors."""
        vis = k_idx < seq_k
        if self.causal:
            vis = vis & (k_idx <= q_idx + self.offset)
        if self.window:
            vis = vis & ((k_idx > q_idx + self.offset - self.window) | (k_idx < self.sink_tokens))
        return vis


def _is_pow2(value: int) -> bool:
    return value >= 1 and (value & (value - 1)) == 0


@dataclasses.dataclass(frozen=True, eq=False)
class BlockLayout:
    """Per (batch, head, query block) lists of key blocks.

    kv_num_blocks:      [Bl, Hl, num_q_blocks] int32, partial blocks per query block
    kv_indices:         [Bl, Hl, num_q_blocks, max_kv_blocks] int32, sorted, first count valid
    full_kv_num_blocks: [Bl, Hl, num_q_blocks] int32, full blocks per query block
    full_kv_indices:    [Bl, Hl, num_q_blocks, max_kv_blocks] int32
    Bl is 1 or the batch size, Hl is 1 or the number of query heads.
    """

    seq_q: int
    seq_k: int
    block_m: int
    block_n: int
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor
    mask: MaskSpec = MaskSpec()
    kind: str = "custom"

    def __post_init__(self):
        self._check_structure()

    # ---- shape facts -------------------------------------------------------------------------
    @property
    def num_q_blocks(self) -> int:
        return math.ceil(self.seq_q / self.block_m)

    @property
    def num_kv_blocks(self) -> int:
        return math.ceil(self.seq_k / self.block_n)

    @property
    def batch_heads(self) -> tuple[int, int]:
        return tuple(self.kv_num_blocks.shape[:2])

    @property
    def device(self) -> torch.device:
        return self.kv_num_blocks.device

    # ---- validation --------------------------------------------------------------------------
    def _check_structure(self) -> None:
        if self.seq_q < 1 or self.seq_k < 1:
            raise LayoutError(f"sequence lengths must be positive, got seq_q={self.seq_q}, seq_k={self.seq_k}")
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if not _is_pow2(value) or value < 16:
                raise LayoutError(f"{name} must be a power of two >= 16, got {value}")
        counts, indices = self.kv_num_blocks, self.kv_indices
        for name in _TENSOR_FIELDS:
            tensor = getattr(self, name)
            if not isinstance(tensor, torch.Tensor):
                raise LayoutError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
            if tensor.dtype not in (torch.int32, torch.int64):
                raise LayoutError(f"{name} must be int32 or int64, got {tensor.dtype}")
            if tensor.device != counts.device:
                raise LayoutError(f"{name} is on {tensor.device} but kv_num_blocks is on {counts.device}")
        expected_counts = (self.num_q_blocks,)
        for cname, iname in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
            c, i = getattr(self, cname), getattr(self, iname)
            if c.dim() != 3 or tuple(c.shape[2:]) != expected_counts:
                raise LayoutError(
                    f"{cname} must have shape [Bl, Hl, {self.num_q_blocks}] for seq_q={self.seq_q}, "
                    f"block_m={self.block_m}; got {list(c.shape)}"
                )
            if i.dim() != 4 or tuple(i.shape[:3]) != tuple(c.shape):
                raise LayoutError(f"{iname} must have shape {list(c.shape)} + [max_kv_blocks]; got {list(i.shape)}")
        if counts.shape != self.full_kv_num_blocks.shape:
            raise LayoutError(
                f"kv_num_blocks {list(counts.shape)} and full_kv_num_blocks "
                f"{list(self.full_kv_num_blocks.shape)} must have the same shape"
            )
        del indices

    def validate(self) -> "BlockLayout":
        """Check the contents (counts, ranges, sorting, disjointness); raises LayoutError.

        Reads the index tensors (a device synchronisation on GPU), so launchers call it only
        when asked; every builder and ``from_tensors`` call it.
        """
        nkv = self.num_kv_blocks
        classes = torch.zeros(*self.batch_heads, self.num_q_blocks, nkv, dtype=torch.int8)
        for cname, iname, cls in (
            ("kv_num_blocks", "kv_indices", PARTIAL),
            ("full_kv_num_blocks", "full_kv_indices", FULL),
        ):
            counts = getattr(self, cname).cpu().long()
            indices = getattr(self, iname).cpu().long()
            width = indices.shape[-1]
            if counts.numel() and (counts.min() < 0 or counts.max() > min(width, nkv)):
                raise LayoutError(
                    f"{cname} values must be in [0, {min(width, nkv)}], got [{int(counts.min())}, {int(counts.max())}]"
                )
            slot = torch.arange(width)
            valid = slot < counts[..., None]
            used = torch.where(valid, indices, torch.zeros_like(indices))
            if valid.any() and (used[valid].min() < 0 or used[valid].max() >= nkv):
                raise LayoutError(f"{iname} holds block indices outside [0, {nkv}) for seq_k={self.seq_k}")
            if width > 1:
                pair_valid = valid[..., 1:]
                if (pair_valid & (used[..., 1:] <= used[..., :-1])).any():
                    raise LayoutError(f"{iname} must be strictly increasing within each query block's count")
            sel = _selected(used, valid, nkv)
            if (sel & (classes != SKIP)).any():
                raise LayoutError("a key block is listed as both partial and full for the same query block")
            classes[sel] = cls
        tail_full = classes[..., -1] == FULL
        if self.seq_k % self.block_n and tail_full.any():
            raise LayoutError(
                f"the last key block is only partly inside seq_k={self.seq_k}; it must be partial, not full"
            )
        return self

    # ---- conversion --------------------------------------------------------------------------
    def to(self, device: torch.device | str) -> "BlockLayout":
        moved = {name: getattr(self, name).to(device) for name in _TENSOR_FIELDS}
        return dataclasses.replace(self, **moved)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name).to(torch.int32).contiguous().cpu() for name in _TENSOR_FIELDS}

    @property
    def meta(self) -> dict[str, Any]:
        return {
            "seq_q": self.seq_q,
            "seq_k": self.seq_k,
            "block_m": self.block_m,
            "block_n": self.block_n,
            "kind": self.kind,
            "mask": dataclasses.asdict(self.mask),
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> "BlockLayout":
        missing = [name for name in _TENSOR_FIELDS if name not in tensors]
        if missing:
            raise LayoutError(f"layout tensors missing: {', '.join(missing)}")
        fields = {field.name for field in dataclasses.fields(MaskSpec)}
        mask_meta = meta.get("mask")
        if not isinstance(mask_meta, dict) or set(mask_meta) != fields:
            raise LayoutError(f"layout metadata: mask must be an object with exactly {', '.join(sorted(fields))}, "
                              f"got {mask_meta!r}")
        try:
            mask = MaskSpec(**mask_meta)
            layout = cls(
                seq_q=int(meta["seq_q"]),
                seq_k=int(meta["seq_k"]),
                block_m=int(meta["block_m"]),
                block_n=int(meta["block_n"]),
                mask=mask,
                kind=str(meta.get("kind", "custom")),
                **{name: tensors[name] for name in _TENSOR_FIELDS},
            )
        except (KeyError, TypeError) as err:
            raise LayoutError(f"layout metadata is incomplete or malformed: {err}") from None
        return layout.validate()

    def block_classes(self) -> torch.Tensor:
        """[Bl, Hl, num_q_blocks, num_kv_blocks] int8: 0 skipped, 1 partial, 2 full."""
        classes = torch.zeros(*self.batch_heads, self.num_q_blocks, self.num_kv_blocks, dtype=torch.int8,
                              device=self.device)
        for cname, iname, cls in (
            ("kv_num_blocks", "kv_indices", PARTIAL),
            ("full_kv_num_blocks", "full_kv_indices", FULL),
        ):
            counts = getattr(self, cname).long()
            indices = getattr(self, iname).long()
            valid = torch.arange(indices.shape[-1], device=self.device) < counts[..., None]
            classes[_selected(indices, valid, self.num_kv_blocks)] = cls
        return classes

    def dense_mask(self, q_start: int = 0, q_end: int | None = None) -> torch.Tensor:
        """Element visibility [Bl, Hl, q_end - q_start, seq_k] (bool) of query rows [q_start, q_end)."""
        q_end = self.seq_q if q_end is None else q_end
        classes = self.block_classes()
        q_idx = torch.arange(q_start, q_end, device=self.device)
        k_idx = torch.arange(self.seq_k, device=self.device)
        per_elem = classes[:, :, q_idx // self.block_m][..., k_idx // self.block_n]
        predicate = self.mask.visible(q_idx[:, None], k_idx[None, :], self.seq_k)
        return (per_elem == FULL) | ((per_elem == PARTIAL) & predicate)

    def density(self) -> float:
        """Fraction of (query block, key block) tiles that are computed (partial or full)."""
        classes = self.block_classes()
        return float((classes != SKIP).float().mean())

    def computed_elements(self) -> int:
        """Number of query x key elements in computed blocks, per (batch, head), summed over the
        layout's broadcast dims (used to count the FLOPs of computed blocks)."""
        classes = self.block_classes()
        rows = torch.full((self.num_q_blocks,), self.block_m, device=self.device)
        rows[-1] = self.seq_q - self.block_m * (self.num_q_blocks - 1)
        cols = torch.full((self.num_kv_blocks,), self.block_n, device=self.device)
        cols[-1] = self.seq_k - self.block_n * (self.num_kv_blocks - 1)
        area = rows[:, None] * cols[None, :]
        return int(((classes != SKIP) * area).sum())


def _selected(indices: torch.Tensor, valid: torch.Tensor, num_kv_blocks: int) -> torch.Tensor:
    """Dense [..., num_kv_blocks] bool of the listed blocks; slots past the count are ignored."""
    # Invalid slots scatter into a spare column that is dropped, so padding never overwrites
    # a listed block.
    target = torch.where(valid, indices.clamp(0, num_kv_blocks - 1), num_kv_blocks)
    sel = torch.zeros(*indices.shape[:-1], num_kv_blocks + 1, dtype=torch.bool, device=indices.device)
    sel.scatter_(-1, target, True)
    return sel[..., :num_kv_blocks]


# ---- builders ----------------------------------------------------------------------------------
def _classes_from_mask(mask: MaskSpec, seq_q: int, seq_k: int, block_m: int, block_n: int,
                       rows_per_chunk: int = 4096) -> torch.Tensor:
    """Classify each (query block, key block) tile by the element predicate: [nQ, nK] int8."""
    nq, nk = math.ceil(seq_q / block_m), math.ceil(seq_k / block_n)
    classes = torch.empty(nq, nk, dtype=torch.int8)
    # Key positions padded to whole blocks; padded keys are invisible (k >= seq_k), which makes
    # the tail block partial, as the kernel requires.
    k_idx = torch.arange(nk * block_n)
    chunk_blocks = max(1, rows_per_chunk // block_m)
    for qb0 in range(0, nq, chunk_blocks):
        qb1 = min(nq, qb0 + chunk_blocks)
        q_idx = torch.arange(qb0 * block_m, min(qb1 * block_m, seq_q))
        vis = mask.visible(q_idx[:, None], k_idx[None, :], seq_k)
        # pad the (possibly short) last query block with copies of its last row: rows past
        # seq_q are never stored, so they must not make a block partial.
        pad = (qb1 - qb0) * block_m - vis.shape[0]
        if pad:
            vis = torch.cat([vis, vis[-1:].expand(pad, -1)])
        tiles = vis.view(qb1 - qb0, block_m, nk, block_n)
        any_vis = tiles.any(dim=3).any(dim=1)
        all_vis = tiles.all(dim=3).all(dim=1)
        chunk = torch.where(all_vis, FULL, torch.where(any_vis, PARTIAL, SKIP)).to(torch.int8)
        classes[qb0:qb1] = chunk
    return classes


def _layout_from_classes(classes: torch.Tensor, seq_q: int, seq_k: int, block_m: int, block_n: int,
                         mask: MaskSpec, kind: str) -> BlockLayout:
    """Build count/index tensors from a [Bl, Hl, nQ, nK] class tensor."""
    nk = classes.shape[-1]
    block_ids = torch.arange(nk, dtype=torch.int32).expand_as(classes)

    def pack(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = selected.sum(-1).to(torch.int32)
        # stable sort puts selected blocks first, in increasing block order
        order = torch.sort((~selected).to(torch.int8), dim=-1, stable=True).indices
        indices = torch.gather(block_ids, -1, order).to(torch.int32)
        width = max(1, int(counts.max()) if counts.numel() else 1)
        indices = indices[..., :width].contiguous()
        slot = torch.arange(width, dtype=torch.int32)
        indices = torch.where(slot < counts[..., None], indices, torch.zeros_like(indices))
        return counts.contiguous(), indices

    partial_counts, partial_indices = pack(classes == PARTIAL)
    full_counts, full_indices = pack(classes == FULL)
    return BlockLayout(
        seq_q=seq_q, seq_k=seq_k, block_m=block_m, block_n=block_n,
        kv_num_blocks=partial_counts, kv_indices=partial_indices,
        full_kv_num_blocks=full_counts, full_kv_indices=full_indices,
        mask=mask, kind=kind,
    ).validate()


def _mask_layout(mask: MaskSpec, seq_q, seq_k, block_m, block_n, kind) -> BlockLayout:
    classes = _classes_from_mask(mask, seq_q, seq_k, block_m, block_n)[None, None]
    return _layout_from_classes(classes, seq_q, seq_k, block_m, block_n, mask, kind)


def causal_layout(seq_q: int, seq_k: int, *, block_m: int = 128, block_n: int = 128,
                  offset: int = 0) -> BlockLayout:
    """Causal mask, key k visible to query q when k <= q + offset (top-left aligned at 0)."""
    return _mask_layout(MaskSpec(causal=True, offset=offset), seq_q, seq_k, block_m, block_n, "causal")


def sliding_window_layout(seq_q: int, seq_k: int, window: int, *, block_m: int = 128,
                          block_n: int = 128, offset: int = 0) -> BlockLayout:
    """Causal sliding window: each query sees itself and the ``window - 1`` keys before it."""
    if window < 1:
        raise LayoutError(f"window must be >= 1, got {window}")
    mask = MaskSpec(causal=True, window=window, offset=offset)
    return _mask_layout(mask, seq_q, seq_k, block_m, block_n, f"window{window}")


def sink_layout(seq_q: int, seq_k: int, window: int, sink_blocks: int = 1, *, block_m: int = 128,
                block_n: int = 128, offset: int = 0) -> BlockLayout:
    """Causal sliding window plus global (sink) key blocks that every query sees (StreamingLLM)."""
    if window < 1 or sink_blocks < 0:
        raise LayoutError(f"need window >= 1 and sink_blocks >= 0, got {window}, {sink_blocks}")
    mask = MaskSpec(causal=True, window=window, sink_tokens=sink_blocks * block_n, offset=offset)
    return _mask_layout(mask, seq_q, seq_k, block_m, block_n, f"window{window}-sink{sink_blocks}")


def random_layout(seq_q: int, seq_k: int, density: float, seed: int, *, batch: int = 1, heads: int = 1,
                  causal: bool = True, keep_diagonal: bool = True, block_m: int = 128,
                  block_n: int = 128) -> BlockLayout:
    """Each allowed (query block, key block) tile kept with probability ``density``.

    Drawn with a seeded CPU generator, so the layout is the same on every host. With ``causal``
    only tiles that hold a visible causal element are candidates, and the causal predicate is
    applied in the diagonal tiles. ``keep_diagonal`` keeps each query block's diagonal tile so
    no row is left empty by chance.
    """
    if not 0.0 <= density <= 1.0:
        raise LayoutError(f"density must be in [0, 1], got {density}")
    mask = MaskSpec(causal=causal)
    base = _classes_from_mask(mask, seq_q, seq_k, block_m, block_n)
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(batch, heads, *base.shape, generator=gen) < density
    if keep_diagonal:
        nq, nk = base.shape
        qb = torch.arange(nq)
        diag = torch.clamp((qb * block_m) // block_n, max=nk - 1)
        keep[..., qb, diag] = True
    classes = torch.where(keep, base.expand_as(keep), torch.zeros((), dtype=torch.int8))
    return _layout_from_classes(classes, seq_q, seq_k, block_m, block_n, mask,
                                f"random{int(round(density * 100))}")


def layout_from_block_mask(block_mask: torch.Tensor, seq_q: int, seq_k: int, *, block_m: int = 128,
                           block_n: int = 128) -> BlockLayout:
    """From a dense boolean block mask [Bl, Hl, num_q_blocks, num_kv_blocks] (or 2-D / 3-D).

    Selected tiles are full, except the last key block when seq_k is not a multiple of block_n,
    which is partial so the kernel masks the keys past the end.
    """
    if not isinstance(block_mask, torch.Tensor) or block_mask.dtype != torch.bool:
        raise LayoutError("block_mask must be a torch.bool tensor")
    while block_mask.dim() < 4:
        block_mask = block_mask[None]
    nq, nk = math.ceil(seq_q / block_m), math.ceil(seq_k / block_n)
    if block_mask.dim() != 4 or tuple(block_mask.shape[2:]) != (nq, nk):
        raise LayoutError(
            f"block_mask must have shape [Bl, Hl, {nq}, {nk}] for seq_q={seq_q}, seq_k={seq_k}, "
            f"block_m={block_m}, block_n={block_n}; got {list(block_mask.shape)}"
        )
    mask = MaskSpec()
    base = _classes_from_mask(mask, seq_q, seq_k, block_m, block_n)
    classes = torch.where(block_mask.cpu(), base.expand(block_mask.shape), torch.zeros((), dtype=torch.int8))
    return _layout_from_classes(classes, seq_q, seq_k, block_m, block_n, mask, "blockmask")
