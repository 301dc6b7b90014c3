"""Block layouts for block-sparse attention: which key blocks each query block visits, and the
element masks applied inside the partially visible ones.

The layout follows FlexAttention's BlockMask: for every (batch, head, query block) a count and a
sorted list of key/value block indices, split into *partial* blocks (the element mask is applied
inside the block) and *full* blocks (every element is visible, the mask is skipped). Batch and
head dimensions may be 1 and then broadcast.

The element mask of a partial block is the AND of a small parametric predicate (``MaskSpec``)
that the kernel evaluates in registers::

    k < seq_k
    and (not causal or k <= q + offset)
    and (window == 0 or k > q + offset - window or k < sink_tokens)

and of the optional element-mask tensors the layout carries, each broadcast over the batch
(leading dim 1 or B) and consulted only in partial blocks:

* document ids ``q_doc`` [Bd, Sq], ``k_doc`` [Bd, Sk] (int32 >= 0): visible only where
  ``q_doc[b, q] == k_doc[b, k]`` (packed sequences, varlen);
* key padding ``k_start``, ``k_end`` [Bp] (int32): visible only where
  ``k_start[b] <= k < k_end[b]`` (left padding: start > 0; right padding: end < Sk);
* bit-packed element mask ``mask_bits`` [Bm, Hm, Sq, ceil(Sk / 32)] (int32): bit ``k % 32`` of
  word ``k // 32`` set = visible. It can express any mask (FlexAttention's mask_mod included)
  and costs Sq * Sk / 8 bytes per (batch, head) entry: 32 MiB at Sq = Sk = 16384.

The semantics of a layout (what the kernel and the dense reference both compute) are: an element
is visible iff its block is full, or its block is partial and every mask present holds. The
builders classify a block as full only where every element is visible, so full blocks never
need a mask.

Alignment of the causal diagonal when Sq != Sk: the builders default to ``align="bottom_right"``
(FlashAttention 2 >= 2.1, SDPA with a KV cache, decode loops): ``offset = Sk - Sq``, so the last
query sees every key and a one-token decode step (Sq = 1) sees the whole cache.
``align="top_left"`` (``offset = 0``) is the older convention; ``offset=`` sets the diagonal
explicitly (key ``k`` visible to query ``q`` when ``k <= q + offset``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch

__all__ = [
    "MaskSpec",
    "BlockLayout",
    "LayoutError",
    "ALIGNMENTS",
    "causal_layout",
    "sliding_window_layout",
    "with_keys",
    "sink_layout",
    "random_layout",
    "layout_from_block_mask",
    "layout_from_dense_mask",
    "layout_from_mask_mod",
    "document_layout",
    "varlen_layout",
    "padding_layout",
    "prefix_lm_layout",
    "pack_mask_bits",
    "unpack_mask_bits",
]

SKIP, PARTIAL, FULL = 0, 1, 2
ALIGNMENTS = ("bottom_right", "top_left")
_TENSOR_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
# Optional element-mask tensors, in the order bundles list them (BlockLayout.meta).
_ELEMENT_FIELDS = ("q_doc", "k_doc", "k_start", "k_end", "mask_bits")
# Elements of one row chunk of a dense visibility evaluated while building a layout (bool bytes).
_CHUNK_ELEMENTS = 1 << 25


class LayoutError(ValueError):
    """A block layout is malformed or does not fit the tensors it is used with."""


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """The element-level predicate applied inside partial blocks (see the module docstring)."""

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


# ---- bit packing -------------------------------------------------------------------------------
def pack_mask_bits(visible: torch.Tensor) -> torch.Tensor:
    """bool [..., Sk] -> int32 [..., ceil(Sk / 32)]: bit ``k % 32`` of word ``k // 32`` = visible."""
    seq_k = visible.shape[-1]
    words = math.ceil(seq_k / 32)
    # uint8, padded by a pad rather than a bool slice assignment: Inductor's CPU code generator
    # cannot compile a masked load of bools fused into the shifts below (torch 2.13).
    padded = torch.nn.functional.pad(visible.to(torch.uint8), (0, words * 32 - seq_k))
    # One bit position at a time: peak memory is the int64 words, not 64 bits per element.
    packed = torch.zeros(*visible.shape[:-1], words, dtype=torch.int64, device=visible.device)
    for bit in range(32):
        packed |= padded[..., bit::32].to(torch.int64) << bit
    # int32 words hold the 32 bits two's-complement: bit 31 set is a negative word.
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_mask_bits(words: torch.Tensor, seq_k: int, k_idx: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [..., ceil(Sk / 32)] -> bool [..., Sk] (or [..., len(k_idx)] for the keys ``k_idx``)."""
    k_idx = torch.arange(seq_k, device=words.device) if k_idx is None else k_idx
    # An arithmetic shift of a negative word still leaves bit (k % 32) in the lowest place.
    return ((words[..., k_idx // 32].to(torch.int64) >> (k_idx % 32)) & 1).bool()


@dataclasses.dataclass(frozen=True, eq=False)
class BlockLayout:
    """Per (batch, head, query block) lists of key blocks, plus optional element masks.

    kv_num_blocks:      [Bl, Hl, num_q_blocks] int32, partial blocks per query block
    kv_indices:         [Bl, Hl, num_q_blocks, max_kv_blocks] int32, sorted, first count valid
    full_kv_num_blocks: [Bl, Hl, num_q_blocks] int32, full blocks per query block
    full_kv_indices:    [Bl, Hl, num_q_blocks, max_kv_blocks] int32
    Bl is 1 or the batch size, Hl is 1 or the number of query heads.

    Element masks (None when absent; consulted in partial blocks only, module docstring):
    q_doc: [Bd, Sq] int32 >= 0 and k_doc: [Bd, Sk] int32 >= 0, document ids (both or neither);
    k_start, k_end: [Bp] int32, 0 <= start <= end <= Sk, the visible key range (both or neither);
    mask_bits: [Bm, Hm, Sq, ceil(Sk / 32)] int32, bit-packed visibility, Sq * Sk / 8 bytes per
    (Bm, Hm) entry; bits past Sk are 0. Bd, Bp, Bm are 1 or the batch size and Hm 1 or the number
    of query heads; every dim that is not 1 must agree with the other tensors'.
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
    q_doc: torch.Tensor | None = None
    k_doc: torch.Tensor | None = None
    k_start: torch.Tensor | None = None
    k_end: torch.Tensor | None = None
    mask_bits: torch.Tensor | None = None

    def __post_init__(self):
        self._check_structure()
        self._check_element_structure()

    # ---- shape facts -------------------------------------------------------------------------
    @property
    def num_q_blocks(self) -> int:
        return math.ceil(self.seq_q / self.block_m)

    @property
    def num_kv_blocks(self) -> int:
        return math.ceil(self.seq_k / self.block_n)

    @property
    def batch_heads(self) -> tuple[int, int]:
        """(Bl, Hl) of the block tensors."""
        return tuple(self.kv_num_blocks.shape[:2])

    @property
    def broadcast_batch_heads(self) -> tuple[int, int]:
        """(batch, heads) over the block tensors and every element mask: each is 1 or the
        problem's batch / query heads."""
        batches, heads = self._leading_dims()
        return max(batches), max(heads)

    @property
    def device(self) -> torch.device:
        return self.kv_num_blocks.device

    @property
    def has_doc(self) -> bool:
        return self.q_doc is not None

    @property
    def has_padding(self) -> bool:
        return self.k_start is not None

    @property
    def has_bits(self) -> bool:
        return self.mask_bits is not None

    @property
    def element_masks(self) -> tuple[str, ...]:
        """Names of the element-mask tensors present, in ``_ELEMENT_FIELDS`` order."""
        return tuple(name for name in _ELEMENT_FIELDS if getattr(self, name) is not None)

    def version(self) -> tuple[int, ...] | None:
        """How many in-place edits each of the layout's tensors has seen (torch's version counter,
        shared by a tensor and its views), or None where that is not known: a tensor made under
        ``torch.inference_mode`` has no counter. A layout is meant as a value, but an edit in place
        does not change the object: the launch cache (kernels/launch_cache.py) reuses an entry only
        while this is unchanged, and does not cache calls on a layout whose version is None. (An
        edit through ``.data`` or from outside torch is not counted; such edits are not supported.)"""
        try:  # read on every cached call: one pass, no check per tensor
            return tuple(getattr(self, name)._version for name in _TENSOR_FIELDS + self.element_masks)
        except RuntimeError:  # "Inference tensors do not track version counter"
            return None

    def _leading_dims(self) -> tuple[list[int], list[int]]:
        batches, heads = [self.kv_num_blocks.shape[0]], [self.kv_num_blocks.shape[1]]
        for name in ("q_doc", "k_start", "mask_bits"):
            tensor = getattr(self, name)
            if tensor is not None:
                batches.append(tensor.shape[0])
        if self.mask_bits is not None:
            heads.append(self.mask_bits.shape[1])
        return batches, heads

    # ---- validation --------------------------------------------------------------------------
    def _check_structure(self) -> None:
        if self.seq_q < 1 or self.seq_k < 1:
            raise LayoutError(f"sequence lengths must be positive, got seq_q={self.seq_q}, seq_k={self.seq_k}")
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if not _is_pow2(value) or value < 16:
                raise LayoutError(f"{name} must be a power of two >= 16, got {value}")
        counts = self.kv_num_blocks
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

    def _check_element_structure(self) -> None:
        """Types, shapes and devices of the element masks (no data is read)."""
        for name in _ELEMENT_FIELDS:
            tensor = getattr(self, name)
            if tensor is None:
                continue
            if not isinstance(tensor, torch.Tensor):
                raise LayoutError(f"{name} must be a torch.Tensor or None, got {type(tensor).__name__}")
            if tensor.dtype != torch.int32:
                raise LayoutError(f"{name} must be int32, got {tensor.dtype}")
            if tensor.device != self.device:
                raise LayoutError(f"{name} is on {tensor.device} but kv_num_blocks is on {self.device}")
        for first, second in (("q_doc", "k_doc"), ("k_start", "k_end")):
            if (getattr(self, first) is None) != (getattr(self, second) is None):
                raise LayoutError(f"{first} and {second} must be given together")
        if self.q_doc is not None:
            if self.q_doc.dim() != 2 or self.q_doc.shape[1] != self.seq_q:
                raise LayoutError(f"q_doc must have shape [Bd, {self.seq_q}], got {list(self.q_doc.shape)}")
            if self.k_doc.dim() != 2 or tuple(self.k_doc.shape) != (self.q_doc.shape[0], self.seq_k):
                raise LayoutError(f"k_doc must have shape [{self.q_doc.shape[0]}, {self.seq_k}], "
                                  f"got {list(self.k_doc.shape)}")
        if self.k_start is not None:
            if self.k_start.dim() != 1 or self.k_end.shape != self.k_start.shape:
                raise LayoutError(f"k_start and k_end must have one shape [Bp], got {list(self.k_start.shape)} "
                                  f"and {list(self.k_end.shape)}")
        if self.mask_bits is not None:
            words = math.ceil(self.seq_k / 32)
            if self.mask_bits.dim() != 4 or tuple(self.mask_bits.shape[2:]) != (self.seq_q, words):
                raise LayoutError(f"mask_bits must have shape [Bm, Hm, {self.seq_q}, {words}], "
                                  f"got {list(self.mask_bits.shape)}")
        for axis, dims in zip(("batch", "head"), self._leading_dims()):
            if len(set(dims) - {1}) > 1 or 0 in dims:
                raise LayoutError(f"layout {axis} dims {dims} must each be 1 or one common size")

    def validate(self) -> "BlockLayout":
        """Check the contents (counts, ranges, sorting, disjointness, element-mask ranges);
        raises LayoutError.

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
        self._validate_element_masks()
        return self

    def _validate_element_masks(self) -> None:
        if self.q_doc is not None:
            for name in ("q_doc", "k_doc"):
                ids = getattr(self, name)
                if ids.numel() and int(ids.min()) < 0:
                    raise LayoutError(f"{name} must hold document ids >= 0, got {int(ids.min())}")
        if self.k_start is not None:
            start, end = self.k_start.cpu().long(), self.k_end.cpu().long()
            if ((start < 0) | (start > end) | (end > self.seq_k)).any():
                raise LayoutError(f"key padding ranges must satisfy 0 <= k_start <= k_end <= {self.seq_k}, "
                                  f"got k_start={start.tolist()}, k_end={end.tolist()}")
        if self.mask_bits is not None and self.seq_k % 32:
            last = self.mask_bits[..., -1].cpu().long() & 0xFFFFFFFF
            if (last >> (self.seq_k % 32)).any():
                raise LayoutError(f"mask_bits sets bits of keys past seq_k={self.seq_k}")

    # ---- conversion --------------------------------------------------------------------------
    def to(self, device: torch.device | str, non_blocking: bool = False) -> "BlockLayout":
        moved = {name: getattr(self, name).to(device, non_blocking=non_blocking)
                 for name in _TENSOR_FIELDS + self.element_masks}
        return dataclasses.replace(self, **moved)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The block tensors (int32) and the element masks present, contiguous on the CPU."""
        tensors = {name: getattr(self, name).to(torch.int32).contiguous().cpu() for name in _TENSOR_FIELDS}
        tensors.update({name: getattr(self, name).contiguous().cpu() for name in self.element_masks})
        return tensors

    @property
    def meta(self) -> dict[str, Any]:
        meta = {
            "seq_q": self.seq_q,
            "seq_k": self.seq_k,
            "block_m": self.block_m,
            "block_n": self.block_n,
            "kind": self.kind,
            "mask": dataclasses.asdict(self.mask),
        }
        # Only when present, so the meta of a layout without element masks is what it always was.
        if self.element_masks:
            meta["element_masks"] = list(self.element_masks)
        return meta

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
        listed = meta.get("element_masks", [])
        if (not isinstance(listed, list) or any(name not in _ELEMENT_FIELDS for name in listed)
                or len(set(listed)) != len(listed)):
            raise LayoutError(f"layout metadata: element_masks must be a list of distinct names from "
                              f"{', '.join(_ELEMENT_FIELDS)}, got {listed!r}")
        # The tensors must be exactly those the metadata lists: a dropped mask tensor would
        # otherwise load as a silently different (less masked) layout.
        present = [name for name in _ELEMENT_FIELDS if name in tensors]
        if set(present) != set(listed):
            raise LayoutError(f"layout element masks {sorted(present)} do not match the metadata's {sorted(listed)}")
        unknown = sorted(set(tensors) - set(_TENSOR_FIELDS) - set(_ELEMENT_FIELDS))
        if unknown:
            raise LayoutError(f"unknown layout tensors: {', '.join(unknown)}")
        try:
            mask = MaskSpec(**mask_meta)
            layout = cls(
                seq_q=int(meta["seq_q"]),
                seq_k=int(meta["seq_k"]),
                block_m=int(meta["block_m"]),
                block_n=int(meta["block_n"]),
                mask=mask,
                kind=str(meta.get("kind", "custom")),
                **{name: tensors[name] for name in _TENSOR_FIELDS + tuple(present)},
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

    def element_visible(self, q_start: int = 0, q_end: int | None = None) -> torch.Tensor:
        """The AND of the predicate and every element mask for query rows [q_start, q_end), block
        classes ignored: bool [B', H', rows, seq_k] with B', H' each 1 or the broadcast size."""
        q_end = self.seq_q if q_end is None else q_end
        q_idx = torch.arange(q_start, q_end, device=self.device)
        k_idx = torch.arange(self.seq_k, device=self.device)
        visible = self.mask.visible(q_idx[:, None], k_idx[None, :], self.seq_k)[None, None]
        if self.q_doc is not None:
            same_doc = self.q_doc[:, q_start:q_end, None] == self.k_doc[:, None, :]
            visible = visible & same_doc[:, None]
        if self.k_start is not None:
            in_range = (k_idx >= self.k_start[:, None]) & (k_idx < self.k_end[:, None])
            visible = visible & in_range[:, None, None, :]
        if self.mask_bits is not None:
            visible = visible & unpack_mask_bits(self.mask_bits[:, :, q_start:q_end], self.seq_k)
        return visible

    def dense_mask(self, q_start: int = 0, q_end: int | None = None) -> torch.Tensor:
        """Element visibility (bool) of query rows [q_start, q_end): [B', H', rows, seq_k], where
        B' and H' are 1 or the broadcast batch / heads (``broadcast_batch_heads``)."""
        q_end = self.seq_q if q_end is None else q_end
        classes = self.block_classes()
        q_idx = torch.arange(q_start, q_end, device=self.device)
        k_idx = torch.arange(self.seq_k, device=self.device)
        per_elem = classes[:, :, q_idx // self.block_m][..., k_idx // self.block_n]
        return (per_elem == FULL) | ((per_elem == PARTIAL) & self.element_visible(q_start, q_end))

    def tile_order(self, block_m: int) -> torch.Tensor:
        """The kernel's query tiles of ``block_m`` rows, heaviest first: int32 [ceil(Sq / block_m)].

        Work per tile is the number of key blocks it visits, summed over the layout's batch and
        head dims. Causal layouts run their tiles last to first without this (the kernel's
        default order is exactly that); documents and arbitrary masks are not monotone (the
        heaviest tile is the end of the longest document, wherever it lies), and starting the
        longest tiles first shortens the tail of the launch. Ties keep the default order. The
        order is computed once per layout object and tile size (one device-to-host copy).
        """
        cache = self.__dict__.setdefault("_tile_orders", {})
        if block_m not in cache:
            if self.block_m % block_m:
                raise LayoutError(f"tile rows {block_m} must divide the layout's block_m {self.block_m}")
            work = (self.kv_num_blocks + self.full_kv_num_blocks).sum(dim=(0, 1)).to("cpu", torch.int64)
            work = work.repeat_interleave(self.block_m // block_m)[: math.ceil(self.seq_q / block_m)]
            tiles = torch.arange(work.numel())
            # heaviest first; among equals the later tile first, as the default order runs
            order = sorted(tiles.tolist(), key=lambda t: (-int(work[t]), -t))
            cache[block_m] = torch.tensor(order, dtype=torch.int32, device=self.device)
        return cache[block_m]

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


# ---- classifying tiles from their formula ---------------------------------------------------------
# Every builder whose mask follows from a formula classifies a (query block, key block) tile from
# the tile's corner indices: O(number of tiles) tensor ops on the layout's device, with no
# per-element evaluation. A tile's rows are [q0, q1] (q1 the last row inside seq_q: rows past it
# are never stored, so they never make a tile partial) and its keys [k0, k1] (k1 = k0 + block_n - 1;
# keys past seq_k are hidden, so a tile that runs past seq_k is never full and is partial wherever
# one of its keys [k0, k_last] inside seq_k is visible). ``_classify`` (below) evaluates the same
# classes element by element and is what tests compare these formulas with.
def _tile_spans(seq: int, block: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, last index inside ``seq``) of each tile of ``block``: int64 [ceil(seq / block)] each."""
    first = torch.arange(0, seq, block, device=device)
    return first, (first + block).clamp(max=seq) - 1


def _spec_any(mask: MaskSpec, q0, q1, a, b) -> torch.Tensor:
    """Whether some query in [q0, q1] sees some key in [a, b] under ``mask`` (an empty key range
    a > b sees nothing); broadcasting int64 tensors. Keys below seq_k are the caller's business."""
    nonempty = a <= b
    if not mask.causal:
        return nonempty
    off = mask.offset
    if not mask.window:
        return nonempty & (a <= q1 + off)
    # A window splits the keys into the sinks [a, min(b, sinks - 1)], visible to every query at
    # or past them, and the rest, where query q sees (q + off - window, q + off].
    sinks = mask.sink_tokens
    sink_any = (a <= b.clamp(max=sinks - 1)) & (a <= q1 + off)
    first = a.clamp(min=sinks)
    window_any = (first <= b) & (torch.maximum(q0, first - off) <= torch.minimum(q1, b + mask.window - 1 - off))
    return sink_any | window_any


def _spec_all(mask: MaskSpec, q0, q1, k0, k1) -> torch.Tensor | bool:
    """Whether every query in [q0, q1] sees every key in [k0, k1] under ``mask``'s predicate
    (keys past seq_k are the caller's business)."""
    if not mask.causal:
        return True
    every = k1 <= q0 + mask.offset
    if mask.window:
        first = k0.clamp(min=mask.sink_tokens)  # the tile's first key that is not a sink
        every = every & ((first > k1) | (first > q1 + mask.offset - mask.window))
    return every


def _classes(any_visible: torch.Tensor, all_visible: torch.Tensor) -> torch.Tensor:
    full = torch.tensor(FULL, dtype=torch.int8, device=any_visible.device)
    partial = torch.tensor(PARTIAL, dtype=torch.int8, device=any_visible.device)
    skip = torch.tensor(SKIP, dtype=torch.int8, device=any_visible.device)
    return torch.where(all_visible, full, torch.where(any_visible, partial, skip))


def _spec_classes(mask: MaskSpec, seq_q: int, seq_k: int, block_m: int, block_n: int, device=None,
                  k_start: torch.Tensor | None = None, k_end: torch.Tensor | None = None) -> torch.Tensor:
    """Tile classes of the predicate, AND the key ranges [k_start[b], k_end[b]) when given:
    [nQ, nK] int8, or [Bp, 1, nQ, nK] with key ranges."""
    if k_start is not None:
        device = k_start.device
    q0, q1 = _tile_spans(seq_q, block_m, device)
    k0, k_last = _tile_spans(seq_k, block_n, device)
    q0, q1, k0, k_last = q0[:, None], q1[:, None], k0[None, :], k_last[None, :]
    k1 = k0 + block_n - 1
    if k_start is None:
        classes = _classes(_spec_any(mask, q0, q1, k0, k_last), (k1 < seq_k) & _spec_all(mask, q0, q1, k0, k1))
    else:
        start, end = k_start.long().view(-1, 1, 1, 1), k_end.long().view(-1, 1, 1, 1)
        any_visible = _spec_any(mask, q0, q1, torch.maximum(k0, start), torch.minimum(k_last, end - 1))
        all_visible = (k0 >= start) & (k1 < end) & (k1 < seq_k) & _spec_all(mask, q0, q1, k0, k1)
        classes = _classes(any_visible, all_visible)
    # a predicate that ignores the rows (no causal diagonal) gives one row of classes: every row's
    return classes.expand(*classes.shape[:-2], q0.shape[0], k0.shape[1])


def _document_classes(mask: MaskSpec, q_doc: torch.Tensor, k_doc: torch.Tensor, lens_q: torch.Tensor,
                      lens_k: torch.Tensor, block_m: int, block_n: int) -> torch.Tensor:
    """Tile classes of documents laid end to end (ids non-decreasing along q and k, lengths
    lens_q, lens_k [Bd, n]) under ``mask`` (not causal, or causal with one diagonal for every
    document that has queries and keys: ``document_layout``): [Bd, 1, nQ, nK] int8.

    Only *live* documents (queries and keys both) make a pair visible. The live documents among a
    tile's rows are the live ids between the documents of its first and last row, a range of
    ranks among live documents; likewise for its keys. A tile sees something iff the two ranges
    meet and, causally, the first shared document's first key lies at or before the last row's
    diagonal (every later shared document starts later; each ends on the diagonal). It is full
    iff its rows and keys all lie in one document and its last key is at or before its first
    row's diagonal."""
    device = q_doc.device
    seq_q, seq_k = q_doc.shape[1], k_doc.shape[1]
    q0, q1 = _tile_spans(seq_q, block_m, device)
    k0, k_last = _tile_spans(seq_k, block_n, device)
    k1 = k0 + block_n - 1
    live = (lens_q > 0) & (lens_k > 0)
    before = live.cumsum(1) - live.long()  # live documents with a smaller id

    def rank_range(doc: torch.Tensor, first: torch.Tensor, last: torch.Tensor):
        doc_first, doc_last = doc[:, first].long(), doc[:, last].long()
        return before.gather(1, doc_first), before.gather(1, doc_last) + live.gather(1, doc_last).long() - 1

    q_lo, q_hi = rank_range(q_doc, q0, q1)
    k_lo, k_hi = rank_range(k_doc, k0, k_last)
    lo = torch.maximum(q_lo[:, :, None], k_lo[:, None, :])
    any_visible = lo <= torch.minimum(q_hi[:, :, None], k_hi[:, None, :])
    if mask.causal:
        docs = lens_k.shape[1]
        # first key of each live document, by rank; the spare last column takes the others
        starts = torch.full((lens_k.shape[0], docs + 1), seq_k, dtype=torch.long, device=device)
        starts.scatter_(1, torch.where(live, before, docs), lens_k.cumsum(1) - lens_k)
        shared_start = starts.gather(1, lo.clamp(max=docs).flatten(1)).view_as(lo)
        last_diagonal = (q1 + mask.offset)[None, :, None]
        any_visible = any_visible & (k0[None, None, :] <= last_diagonal) & (shared_start <= last_diagonal)
    doc_q0, doc_k0 = q_doc[:, q0], k_doc[:, k0]
    one_doc = ((doc_q0 == q_doc[:, q1])[:, :, None] & (doc_k0 == k_doc[:, k_last])[:, None, :]
               & (doc_q0[:, :, None] == doc_k0[:, None, :]))
    all_visible = one_doc & (k1 < seq_k)[None, None, :]
    if mask.causal:
        all_visible = all_visible & (k1[None, :] <= (q0 + mask.offset)[:, None])[None]
    return _classes(any_visible, all_visible)[:, None]


def _dense_classes(visible: torch.Tensor, block_m: int, block_n: int, *,
                   traceable: bool = False) -> tuple[torch.Tensor, bool]:
    """Tile classes of an element mask bool [B, H, Sq, Sk], by a reshape into tiles and a max /
    min per tile on the mask's device: ([B, H, nQ, nK] int8, whether some partial tile hides a
    key inside seq_k: only then does the layout need the mask's bits). ``traceable``: that
    question (a host read) is not asked, and the answer is True."""
    batch, heads, seq_q, seq_k = visible.shape
    nq, nk = math.ceil(seq_q / block_m), math.ceil(seq_k / block_n)
    row_pad, key_pad = nq * block_m - seq_q, nk * block_n - seq_k
    tiles = visible
    if row_pad:  # rows past seq_q repeat the last row: they must not make a tile partial
        tiles = torch.cat([tiles, tiles[:, :, -1:].expand(-1, -1, row_pad, -1)], dim=2)
    if key_pad:  # keys past seq_k are hidden
        tiles = torch.cat([tiles, tiles.new_zeros(batch, heads, nq * block_m, key_pad)], dim=3)
    # max / min over uint8 tiles: ~17x faster than bool any() / all() on the CPU.
    # Inductor cannot lower a bool -> uint8 view (torch.iinfo(torch.bool)); a cast traces cleanly.
    tiles = tiles.to(torch.uint8) if traceable else tiles.contiguous().view(torch.uint8)
    tiles = tiles.reshape(batch, heads, nq, block_m, nk, block_n)
    any_visible, all_visible = tiles.amax(dim=(3, 5)).bool(), tiles.amin(dim=(3, 5)).bool()
    classes = _classes(any_visible, all_visible)
    if traceable:
        return classes, True
    partial = any_visible & ~all_visible
    # A tile that is partial only because it runs past seq_k is masked by the kernel's k < seq_k
    # test: bits are needed only where a partial tile hides a key inside seq_k.
    needed = bool(partial[..., : nk - 1].any()) if key_pad else bool(partial.any())
    if key_pad and not needed:
        tail = tiles[..., nk - 1, : block_n - key_pad].amin(dim=(3, 4)).bool()
        needed = bool((partial[..., nk - 1] & ~tail).any())
    return classes, needed


# ---- classifying tiles from an element visibility ------------------------------------------------
@dataclasses.dataclass
class _Classified:
    classes: torch.Tensor  # [B', H', nQ, nK] int8
    bits: torch.Tensor | None  # [B', H', Sq, ceil(Sk / 32)] int32, when asked for
    # Whether some partial tile hides an element inside (seq_q, seq_k): only then does a mask
    # given as bits need its bits.
    bits_needed: bool


def _classify(visible_rows: Callable[[int, int], torch.Tensor], seq_q: int, seq_k: int, block_m: int,
              block_n: int, *, keep_bits: bool = False, rows_per_chunk: int | None = None) -> _Classified:
    """Classify each (query block, key block) tile from a dense element visibility.

    visible_rows(q_start, q_end) -> bool [B', H', q_end - q_start or 1, seq_k] (B', H' the same
    for every chunk) is evaluated over chunks of whole query blocks, so peak memory is one chunk.
    A tile is FULL when every element is visible, SKIP when none is, PARTIAL otherwise; keys
    past seq_k count as hidden, which makes the tail block partial, as the kernel requires.
    With ``keep_bits`` the visibility is also bit-packed (``mask_bits``).
    """
    nq, nk = math.ceil(seq_q / block_m), math.ceil(seq_k / block_n)
    if rows_per_chunk is None:
        rows_per_chunk = max(block_m, _CHUNK_ELEMENTS // (nk * block_n) // block_m * block_m)
    chunk_blocks = max(1, rows_per_chunk // block_m)
    classes = bits = None
    bits_needed = False
    for qb0 in range(0, nq, chunk_blocks):
        qb1 = min(nq, qb0 + chunk_blocks)
        q0, q1 = qb0 * block_m, min(qb1 * block_m, seq_q)
        vis = visible_rows(q0, q1)
        if vis.dtype != torch.bool or vis.dim() != 4 or vis.shape[2] not in (1, q1 - q0) or vis.shape[3] != seq_k:
            raise LayoutError(f"visibility rows {q0}:{q1} must be bool [B, H, {q1 - q0}, {seq_k}], "
                              f"got {vis.dtype} {list(vis.shape)}")
        vis = vis.cpu().expand(*vis.shape[:2], q1 - q0, seq_k)
        if classes is None:
            classes = torch.empty(*vis.shape[:2], nq, nk, dtype=torch.int8)
            if keep_bits:
                bits = torch.empty(*vis.shape[:2], seq_q, math.ceil(seq_k / 32), dtype=torch.int32)
        if keep_bits:
            bits[:, :, q0:q1] = pack_mask_bits(vis)
        # Pad the (possibly short) last query block with copies of its last row: rows past seq_q
        # are never stored, so they must not make a block partial. Keys past seq_k are hidden.
        row_pad = (qb1 - qb0) * block_m - (q1 - q0)
        if row_pad:
            vis = torch.cat([vis, vis[:, :, -1:].expand(-1, -1, row_pad, -1)], dim=2)
        in_range = torch.arange(nk * block_n) < seq_k
        padded = torch.zeros(*vis.shape[:3], nk * block_n, dtype=torch.bool)
        padded[..., :seq_k] = vis
        tile_shape = (*vis.shape[:2], qb1 - qb0, block_m, nk, block_n)
        # max / min over uint8 tiles: ~17x faster than bool any() / all() on the CPU.
        tiles = padded.view(torch.uint8).view(tile_shape)
        any_vis = tiles.amax(dim=(3, 5)).bool()
        all_vis = tiles.amin(dim=(3, 5)).bool()
        classes[:, :, qb0:qb1] = torch.where(all_vis, FULL, torch.where(any_vis, PARTIAL, SKIP)).to(torch.int8)
        if keep_bits and not bits_needed:
            # A tile that is partial only because it runs past seq_k is masked by the kernel's
            # k < seq_k test; bits are needed only where a partial tile hides an in-range key.
            in_range_vis = (padded | ~in_range).view(torch.uint8).view(tile_shape).amin(dim=(3, 5)).bool()
            bits_needed = bool((any_vis & ~all_vis & ~in_range_vis).any())
    return _Classified(classes, bits, bits_needed)


def _classes_from_mask(mask: MaskSpec, seq_q: int, seq_k: int, block_m: int, block_n: int, device=None) -> torch.Tensor:
    """Classify each (query block, key block) tile by the element predicate: [nQ, nK] int8."""
    return _spec_classes(mask, seq_q, seq_k, block_m, block_n, device)


def _layout_from_classes(classes: torch.Tensor, seq_q: int, seq_k: int, block_m: int, block_n: int,
                         mask: MaskSpec, kind: str, *, traceable: bool = False, **element_masks) -> BlockLayout:
    """Build count/index tensors from a [Bl, Hl, nQ, nK] class tensor, on its device.

    The builders' layouts are valid by construction (tests/test_kernels_layout_formula.py
    compares every builder with the element-by-element classification), so they are not
    re-validated here: ``validate`` reads every index on the host, which costs more than
    building the layout (2.4 of 3.4 ms for a causal 16k x 16k layout of 64 x 64 tiles).

    ``traceable``: index lists nK wide instead of as wide as the longest list, so nothing is read
    on the host and every shape follows from (Sq, Sk, blocks): what torch.compile and CUDA graphs
    need. Slots past the count are never read by the kernel, so the extra width changes no result."""
    partial_counts, partial_indices, full_counts, full_indices = _pack_classes(classes, traceable=traceable)
    return BlockLayout(
        seq_q=seq_q, seq_k=seq_k, block_m=block_m, block_n=block_n,
        kv_num_blocks=partial_counts, kv_indices=partial_indices,
        full_kv_num_blocks=full_counts, full_kv_indices=full_indices,
        mask=mask, kind=kind, **element_masks,
    )


def _pack_classes(classes: torch.Tensor, *, traceable: bool = False) -> tuple[torch.Tensor, ...]:
    """(partial counts, partial indices, full counts, full indices) of a [Bl, Hl, nQ, nK] class
    tensor, on its device (``_layout_from_classes``, which says what ``traceable`` does)."""
    nk = classes.shape[-1]
    if not traceable and classes.device.type == "cpu" and classes.numel() <= _SMALL_GRID:
        return _pack_small(classes)
    # 2-D [tile rows, nK]: torch's cumsum over the last dim of a 4-D tensor is several times slower
    rows = classes.reshape(-1, nk)
    block_ids = torch.arange(nk, dtype=torch.int32, device=classes.device).expand(rows.shape)

    def pack(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = selected.sum(-1, dtype=torch.int32)
        if traceable:
            width = nk
        else:
            width = max(1, int(counts.max()) if counts.numel() else 1)  # the one host read
        # Each selected block goes to its rank among the selected (increasing block order); the
        # others to a spare last slot that is dropped. Slots past the count stay 0.
        slot = torch.where(selected, selected.cumsum(-1) - 1, width)
        indices = torch.zeros(selected.shape[0], width + 1, dtype=torch.int32, device=selected.device)
        indices.scatter_(-1, slot, block_ids)
        return counts.view(classes.shape[:-1]), indices[:, :width].reshape(*classes.shape[:-1], width).contiguous()

    partial_counts, partial_indices = pack(rows == PARTIAL)
    full_counts, full_indices = pack(rows == FULL)
    return partial_counts, partial_indices, full_counts, full_indices


# Tiles up to which a CPU class grid is packed in Python lists: a decode step's grid (one query
# block over 33 key blocks) is packed in 40 us instead of the ~20 small tensor ops' 145 us on the
# project's 2-core CPU, and the whole layout (`python bench/layout_time.py`'s integration-decode row)
# in about half the time. Both give the same tensors (tests/test_kernels_layout_formula.py).
_SMALL_GRID = 4096


def _pack_small(classes: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``_pack_classes`` of a small CPU class grid, from its values as Python lists: the same
    int32 tensors (counts [Bl, Hl, nQ], indices [Bl, Hl, nQ, width], width the longest list or 1,
    slots past a count 0)."""
    lead, nk = classes.shape[:-1], classes.shape[-1]
    rows = classes.reshape(-1, nk).tolist()
    packed = []
    for wanted in (PARTIAL, FULL):
        lists = [[block for block, kind in enumerate(row) if kind == wanted] for row in rows]
        width = max([1, *map(len, lists)])
        packed.append(torch.tensor([len(blocks) for blocks in lists], dtype=torch.int32).view(lead))
        packed.append(torch.tensor([blocks + [0] * (width - len(blocks)) for blocks in lists],
                                   dtype=torch.int32).view(*lead, width))
    return tuple(packed)


def _mask_layout(mask: MaskSpec, seq_q, seq_k, block_m, block_n, kind, device=None, traceable=False) -> BlockLayout:
    if not traceable and device is not None and torch.device(device).type != "cpu":
        # Made on the CPU and copied without waiting: on a GPU the index lists' width is read on
        # the host (``_pack_classes``), a synchronization with every kernel queued before it (a
        # model builds its mask-less layout in the first layer of each forward, behind the
        # embedding). A CPU build of O(tiles) costs less than the wait; the copy of a pageable
        # buffer is staged at once, so the CPU tensors may go.
        return _mask_layout(mask, seq_q, seq_k, block_m, block_n, kind).to(device, non_blocking=True)
    classes = _classes_from_mask(mask, seq_q, seq_k, block_m, block_n, device)[None, None]
    return _layout_from_classes(classes, seq_q, seq_k, block_m, block_n, mask, kind, traceable=traceable)


def _diagonal_offset(seq_q: int, seq_k: int, align: str, offset: int | None) -> int:
    """The causal offset (key k visible to query q when k <= q + offset): ``offset`` when given,
    else Sk - Sq for bottom-right alignment, 0 for top-left."""
    if offset is not None:
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise LayoutError(f"offset must be an integer or None, got {offset!r}")
        return offset
    if align == "bottom_right":
        return seq_k - seq_q
    if align == "top_left":
        return 0
    raise LayoutError(f"align must be one of {', '.join(ALIGNMENTS)}, got {align!r}")


# ---- builders: predicates ------------------------------------------------------------------------
def causal_layout(seq_q: int, seq_k: int, *, block_m: int = 128, block_n: int = 128,
                  align: str = "bottom_right", offset: int | None = None, device=None,
                  traceable: bool = False) -> BlockLayout:
    """Causal mask: key k visible to query q when k <= q + offset.

    align: "bottom_right" (default, FlashAttention 2 >= 2.1: offset = Sk - Sq, the last query sees
    every key; a decode step Sq = 1 sees the whole cache) or "top_left" (offset = 0).
    offset: an explicit diagonal; when given it replaces the one ``align`` implies.
    device: where the layout's tensors are made (default the CPU). Like every predicate layout it
    is classified from each tile's corners, in O(number of tiles).
    traceable: no host read, shapes from the arguments alone (index lists num_kv_blocks wide), so
    torch.compile(fullgraph=True) can trace the builder.
    """
    mask = MaskSpec(causal=True, offset=_diagonal_offset(seq_q, seq_k, align, offset))
    return _mask_layout(mask, seq_q, seq_k, block_m, block_n, "causal", device, traceable)


def sliding_window_layout(seq_q: int, seq_k: int, window: int, *, block_m: int = 128,
                          block_n: int = 128, align: str = "bottom_right", offset: int | None = None, device=None,
                          traceable: bool = False) -> BlockLayout:
    """Causal sliding window: each query sees its diagonal key and the ``window - 1`` keys before
    it. The diagonal is aligned as in ``causal_layout`` (bottom-right by default); ``traceable``
    as there."""
    if window < 1:
        raise LayoutError(f"window must be >= 1, got {window}")
    mask = MaskSpec(causal=True, window=window, offset=_diagonal_offset(seq_q, seq_k, align, offset))
    return _mask_layout(mask, seq_q, seq_k, block_m, block_n, f"window{window}", device, traceable)


def with_keys(layout: BlockLayout, seq_k: int, offset: int) -> BlockLayout | None:
    """``layout`` at key length ``seq_k`` and causal diagonal ``offset``, sharing its tensors,
    where its tiles provably stay what its builder would make; None otherwise (build it).

    A decode step's layout is the previous step's with one key more and the diagonal one key
    further: its tiles change only when a key block starts or fills (every ``block_n`` steps),
    so a model that keeps the layout object for as long as they stay (the same tensors, so the
    launcher's plan for it is found again) pays for neither the build nor the plan per step.
    Applies to a layout that ``causal_layout`` or ``sliding_window_layout`` built (the caller's
    contract: its tensors are the builder's for its mask), of one query block, without sink
    tokens or element masks: the tile classes then follow from a few integers
    (``_one_block_tiles``), compared for the old and the new geometry. Checked against the
    builders step by step (tests/test_kernels_layout_formula.py)."""
    mask = layout.mask
    if (not mask.causal or mask.sink_tokens or layout.element_masks or layout.batch_heads != (1, 1)
            or layout.kind != ("causal" if not mask.window else f"window{mask.window}")
            or isinstance(seq_k, bool) or not isinstance(seq_k, int) or seq_k < 1
            or isinstance(offset, bool) or not isinstance(offset, int) or layout.seq_q > layout.block_m):
        return None
    if seq_k == layout.seq_k and offset == mask.offset:
        return layout
    moved = MaskSpec(causal=True, window=mask.window, offset=offset)
    if (_one_block_tiles(mask, layout.seq_q, layout.seq_k, layout.block_n)
            != _one_block_tiles(moved, layout.seq_q, seq_k, layout.block_n)):
        return None
    # the same tiles, so the structure checks a new layout runs (indices below the key blocks'
    # count, widths) hold as they held for ``layout``: copied without them (10 of the 15 us)
    moved_layout = object.__new__(BlockLayout)
    moved_layout.__dict__.update(layout.__dict__)
    object.__setattr__(moved_layout, "seq_k", seq_k)
    object.__setattr__(moved_layout, "mask", moved)
    return moved_layout


def _one_block_tiles(mask: MaskSpec, seq_q: int, seq_k: int, block_n: int) -> tuple:
    """The tile classes of one query block (rows 0 .. seq_q - 1) under a causal predicate
    without sinks, as integers: (key blocks, [first, end) of the visible tiles, [first, end) of
    the full ones), from ``_spec_classes``'s comparisons solved for the tile index: tile j spans
    keys [j * block_n, k1 = (j + 1) * block_n - 1], clipped to seq_k - 1 (k_last).
    Equal tuples mean equal classes (a tile is full in the second range, else partial in the
    first, else skipped)."""
    off, last_row = mask.offset, seq_q - 1
    tiles = -(-seq_k // block_n)

    def clip(lo: int, hi: int) -> tuple[int, int]:
        lo, hi = max(0, lo), min(tiles, hi)
        return (lo, hi) if lo < hi else (0, 0)

    # visible: some row sees the tile's first key (k0 <= last_row + off)...
    visible_end = (last_row + off) // block_n + 1
    # full: its last key is real and row 0 sees it (k1 <= min(seq_k - 1, off))
    full_end = (min(seq_k - 1, off) + 1) // block_n
    if not mask.window:
        return tiles, clip(0, visible_end), clip(0, full_end)
    # ...and, with a window, row 0's window reaches its last key: k_last >= off - window + 1
    reach = off - mask.window + 1
    visible = clip(-(-(reach + 1) // block_n) - 1, visible_end) if seq_k - 1 >= reach else (0, 0)
    # full also needs the last row's window to start at or before its first key:
    # k0 >= last_row + off - window + 1
    full_start = -(-(last_row + off - mask.window + 1) // block_n)
    return tiles, visible, clip(full_start, full_end)


def sink_layout(seq_q: int, seq_k: int, window: int, sink_blocks: int = 1, *, block_m: int = 128,
                block_n: int = 128, align: str = "bottom_right", offset: int | None = None, device=None) -> BlockLayout:
    """Causal sliding window plus global (sink) key blocks that every query sees (StreamingLLM).
    The diagonal is aligned as in ``causal_layout`` (bottom-right by default)."""
    if window < 1 or sink_blocks < 0:
        raise LayoutError(f"need window >= 1 and sink_blocks >= 0, got {window}, {sink_blocks}")
    mask = MaskSpec(causal=True, window=window, sink_tokens=sink_blocks * block_n,
                    offset=_diagonal_offset(seq_q, seq_k, align, offset))
    return _mask_layout(mask, seq_q, seq_k, block_m, block_n, f"window{window}-sink{sink_blocks}", device)


def random_layout(seq_q: int, seq_k: int, density: float, seed: int, *, batch: int = 1, heads: int = 1,
                  causal: bool = True, keep_diagonal: bool = True, block_m: int = 128,
                  block_n: int = 128, align: str = "bottom_right") -> BlockLayout:
    """Each allowed (query block, key block) tile kept with probability ``density``.

    Drawn with a seeded CPU generator, so the layout is the same on every host. With ``causal``
    only tiles that hold a visible causal element (diagonal aligned by ``align``, as in
    ``causal_layout``) are candidates, and the causal predicate is applied in the diagonal tiles.
    ``keep_diagonal`` keeps the tile of each query block's first diagonal key so no row that
    the predicate lets see a key is left empty by chance.
    """
    if not 0.0 <= density <= 1.0:
        raise LayoutError(f"density must be in [0, 1], got {density}")
    offset = _diagonal_offset(seq_q, seq_k, align, None) if causal else 0
    mask = MaskSpec(causal=causal, offset=offset)
    base = _classes_from_mask(mask, seq_q, seq_k, block_m, block_n)
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(batch, heads, *base.shape, generator=gen) < density
    if keep_diagonal:
        nq, nk = base.shape
        qb = torch.arange(nq)
        diag = torch.clamp((qb * block_m + offset) // block_n, min=0, max=nk - 1)
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


# ---- builders: element masks ---------------------------------------------------------------------
def layout_from_dense_mask(mask: torch.Tensor, *, block_m: int = 128, block_n: int = 128,
                           traceable: bool = False) -> BlockLayout:
    """Any element mask, exactly: mask bool [B or 1, H or 1, Sq, Sk] (or [Sq, Sk]), True = visible.

    Tiles with no visible element are skipped, all-visible tiles are full, the rest partial; the
    mask is kept as ``mask_bits`` [B or 1, H or 1, Sq, ceil(Sk / 32)] (Sq * Sk / 8 bytes per
    (batch, head) entry) only when some partial tile hides an element (a mask that is
    block-aligned up to the sequence end needs none). Rows with no visible key give 0 and LSE
    -inf. Classified on the mask's device (a reshape into tiles, a max and min per tile); the
    layout is on that device.

    ``traceable``: nothing is read on the host and every shape follows from the mask's: the bits
    are always kept, the tiles keep the mask's batch and head dims (no check whether they could
    broadcast) and the index lists are num_kv_blocks wide. The same elements are visible as
    without it; what torch.compile(fullgraph=True) and CUDA graphs need.
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise LayoutError(f"mask must be a torch.bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
    if mask.dim() == 2:
        mask = mask[None, None]
    if mask.dim() != 4 or mask.shape[2] < 1 or mask.shape[3] < 1:
        raise LayoutError(f"mask must have shape [B or 1, H or 1, Sq, Sk], got {list(mask.shape)}")
    seq_q, seq_k = mask.shape[2], mask.shape[3]
    classes, bits_needed = _dense_classes(mask, block_m, block_n, traceable=traceable)
    if traceable:
        return _layout_from_classes(classes, seq_q, seq_k, block_m, block_n, MaskSpec(), "densemask",
                                    traceable=True, mask_bits=pack_mask_bits(mask))
    bits = pack_mask_bits(mask) if bits_needed else None
    return _broadcast_layout(classes, seq_q, seq_k, block_m, block_n, "densemask", bits)


def dense_mask_arguments(mask: torch.Tensor, *, block_m: int = 128, block_n: int = 128) -> tuple:
    """``layout_from_dense_mask(mask, traceable=True)`` as the kernel operator's layout arguments
    (``kernels.op``: kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_doc, k_doc,
    k_start, k_end, mask_bits, block_m, block_n, causal, window, sink_tokens, offset), made of
    tensor operations alone, with no ``BlockLayout`` or ``MaskSpec`` object: what a graph
    traced by an older Dynamo holds (torch 2.11 cannot build those dataclasses inside a graph).
    mask: bool [B or 1, H or 1, Sq, Sk]."""
    if mask.dim() != 4 or mask.dtype != torch.bool:
        raise LayoutError(f"mask must be a torch.bool tensor [B or 1, H or 1, Sq, Sk], got {mask.dtype} "
                          f"{list(mask.shape)}")
    classes, _ = _dense_classes(mask, block_m, block_n, traceable=True)
    counts_indices = _pack_classes(classes, traceable=True)
    return (*counts_indices, None, None, None, None, pack_mask_bits(mask), block_m, block_n, False, 0, 0, 0)


def layout_from_mask_mod(mask_mod: Callable, B: int | None, H: int | None, Sq: int, Sk: int, *,
                         block_m: int = 128, block_n: int = 128) -> BlockLayout:
    """A FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``, exactly.

    The mask_mod is called with broadcasting index tensors b [B, 1, 1, 1], h [1, H, 1, 1],
    q_idx [1, 1, rows, 1], kv_idx [1, 1, 1, Sk] (int64, on the CPU, rows a chunk of the queries;
    indices stay inside [0, Sq) and [0, Sk)), as torch broadcasting evaluates it; a result that
    does not depend on b or h keeps that dim 1 and the layout broadcasts over it. B or H None
    means 1 (broadcast), as in ``create_block_mask``. Then as ``layout_from_dense_mask``; no
    FlexAttention import is needed.
    """
    batch, heads = B or 1, H or 1
    if min(batch, heads, Sq, Sk) < 1:
        raise LayoutError(f"B, H, Sq, Sk must be >= 1, got {B}, {H}, {Sq}, {Sk}")
    b = torch.arange(batch).view(batch, 1, 1, 1)
    h = torch.arange(heads).view(1, heads, 1, 1)
    kv_idx = torch.arange(Sk).view(1, 1, 1, Sk)

    def rows(q0: int, q1: int) -> torch.Tensor:
        out = mask_mod(b, h, torch.arange(q0, q1).view(1, 1, -1, 1), kv_idx)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            raise LayoutError(f"mask_mod must return a bool tensor, got {getattr(out, 'dtype', type(out).__name__)}")
        while out.dim() < 4:
            out = out[None]
        try:
            shape = torch.broadcast_shapes(out.shape, (1, 1, q1 - q0, Sk))
        except RuntimeError:
            shape = None
        if shape is None or len(shape) != 4 or shape[0] not in (1, batch) or shape[1] not in (1, heads):
            raise LayoutError(f"mask_mod returned shape {list(out.shape)}, not broadcastable to "
                              f"[{batch}, {heads}, {q1 - q0}, {Sk}]")
        return out.expand(shape)

    return _layout_from_visibility(rows, Sq, Sk, block_m, block_n, "maskmod")


def _layout_from_visibility(visible_rows, seq_q, seq_k, block_m, block_n, kind) -> BlockLayout:
    """A general element mask given by rows (``_classify``): classes plus bits where needed."""
    classified = _classify(visible_rows, seq_q, seq_k, block_m, block_n, keep_bits=True)
    bits = classified.bits if classified.bits_needed else None
    return _broadcast_layout(classified.classes, seq_q, seq_k, block_m, block_n, kind, bits)


def _broadcast_layout(classes, seq_q, seq_k, block_m, block_n, kind, bits) -> BlockLayout:
    """An element-mask layout; tiles that are the same for every batch and head are kept once."""
    if bits is None and bool((classes == classes[:1, :1]).all()):
        classes = classes[:1, :1]  # the same tiles for every batch and head: broadcast them
    return _layout_from_classes(classes, seq_q, seq_k, block_m, block_n, MaskSpec(), kind, mask_bits=bits)


def _lengths(values, name: str, *, allow_zero: bool = True) -> torch.Tensor:
    """A 1-D or 2-D list / tensor of non-negative ints -> int64 tensor (2-D: [batch, n])."""
    try:
        tensor = torch.as_tensor(values)
    except (TypeError, ValueError, RuntimeError) as err:
        raise LayoutError(f"{name} must be a list of integers or an integer tensor: {err}") from None
    if tensor.dtype.is_floating_point or tensor.dtype == torch.bool or tensor.dtype.is_complex:
        raise LayoutError(f"{name} must hold integers, got {tensor.dtype}")
    if tensor.dim() not in (1, 2) or tensor.shape[-1] < 1:
        raise LayoutError(f"{name} must be a non-empty 1-D or 2-D list, got shape {list(tensor.shape)}")
    tensor = tensor.long().cpu()
    if (tensor < (0 if allow_zero else 1)).any():
        raise LayoutError(f"{name} must be >= {0 if allow_zero else 1}, got {tensor.tolist()}")
    return tensor


def document_layout(doc_lens_q, doc_lens_k=None, *, block_m: int = 128, block_n: int = 128,
                    causal: bool = True) -> BlockLayout:
    """Packed sequences: documents laid end to end; each query sees only its own document's keys.

    doc_lens_q: document lengths along the queries, a list of ints (one packing for the whole
    batch: element masks with Bd = 1) or a list of B lists (one packing per batch element, each
    summing to the same Sq; Bd = B). Zero lengths are allowed (a document with no query or no key
    in this call). doc_lens_k: the same along the keys, with as many documents (default
    doc_lens_q: self-attention). Sq = sum(doc_lens_q), Sk = sum(doc_lens_k).
    causal: within each document, key j visible to query i when j <= i + (Lk - Lq) in document
    coordinates: bottom-right per document (FlashAttention 2 varlen), so the last query of a
    document sees all its keys.

    Carried as document ids q_doc [Bd, Sq], k_doc [Bd, Sk] with the causal predicate; when the
    per-document diagonals differ (Lk - Lq not the same for every document), the global predicate
    cannot express them and the mask is carried as ``mask_bits`` instead (Sq * Sk / 8 bytes per
    batch entry).
    """
    lens_q = _lengths(doc_lens_q, "doc_lens_q")
    lens_k = lens_q if doc_lens_k is None else _lengths(doc_lens_k, "doc_lens_k")
    if lens_q.dim() == 1:
        lens_q = lens_q[None]
    if lens_k.dim() == 1:
        lens_k = lens_k[None]
    if lens_q.shape[1] != lens_k.shape[1]:
        raise LayoutError(f"doc_lens_q and doc_lens_k must list as many documents, got {lens_q.shape[1]} and "
                          f"{lens_k.shape[1]}")
    if lens_q.shape[0] != lens_k.shape[0] and 1 not in (lens_q.shape[0], lens_k.shape[0]):
        raise LayoutError(f"doc_lens_q and doc_lens_k batch sizes differ: {lens_q.shape[0]} and {lens_k.shape[0]}")
    batch = max(lens_q.shape[0], lens_k.shape[0])
    lens_q, lens_k = lens_q.expand(batch, -1), lens_k.expand(batch, -1)
    seq_q, seq_k = _common_sum(lens_q, "doc_lens_q"), _common_sum(lens_k, "doc_lens_k")
    # the document of index i is the number of documents that end at or before i
    q_doc = torch.searchsorted(lens_q.cumsum(1), torch.arange(seq_q).repeat(batch, 1), right=True)
    k_doc = torch.searchsorted(lens_k.cumsum(1), torch.arange(seq_k).repeat(batch, 1), right=True)
    q_doc, k_doc = q_doc.to(torch.int32), k_doc.to(torch.int32)
    # Document d's diagonal in global indices: k <= q + (end_k[d] - end_q[d]).
    diagonal = lens_k.cumsum(1) - lens_q.cumsum(1)
    seen = (lens_q > 0) & (lens_k > 0)
    offsets = diagonal[seen].unique()
    if not causal or offsets.numel() <= 1:
        offset = int(offsets[0]) if offsets.numel() else 0
        mask = MaskSpec(causal=causal, offset=offset if causal else 0)
        classes = _document_classes(mask, q_doc, k_doc, lens_q, lens_k, block_m, block_n)
        return _layout_from_classes(classes, seq_q, seq_k, block_m, block_n, mask, "document", q_doc=q_doc,
                                    k_doc=k_doc)
    q_diag = diagonal.gather(1, q_doc.long())

    def rows(q0, q1):
        q_idx, k_idx = torch.arange(q0, q1), torch.arange(seq_k)
        same = q_doc[:, q0:q1, None] == k_doc[:, None, :]
        return (same & (k_idx <= q_idx[:, None] + q_diag[:, q0:q1, None]))[:, None]

    return _layout_from_visibility(rows, seq_q, seq_k, block_m, block_n, "document")


def _common_sum(lens: torch.Tensor, name: str) -> int:
    sums = lens.sum(1).unique()
    if sums.numel() != 1 or int(sums[0]) < 1:
        raise LayoutError(f"{name} must sum to one positive length in every batch row, got sums {lens.sum(1).tolist()}")
    return int(sums[0])


def varlen_layout(cu_seqlens_q, cu_seqlens_k=None, *, block_m: int = 128, block_n: int = 128,
                  causal: bool = True) -> BlockLayout:
    """Packed variable-length sequences as FlashAttention's varlen API describes them.

    cu_seqlens_q: [n + 1] cumulative sequence starts (0, l0, l0 + l1, ..., Sq), non-decreasing;
    cu_seqlens_k: the same along the keys (default cu_seqlens_q). q, k, v are then one packed row
    [1, H, total, D]. Causal alignment is bottom-right per sequence, as in FlashAttention 2 (a
    decode step with one query per sequence sees its whole cache). See ``document_layout``.
    """
    lens_q = _cu_lengths(cu_seqlens_q, "cu_seqlens_q")
    lens_k = lens_q if cu_seqlens_k is None else _cu_lengths(cu_seqlens_k, "cu_seqlens_k")
    layout = document_layout(lens_q, lens_k, block_m=block_m, block_n=block_n, causal=causal)
    return dataclasses.replace(layout, kind="varlen")


def _cu_lengths(cu_seqlens, name: str) -> torch.Tensor:
    cu = _lengths(cu_seqlens, name)
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or (cu[1:] < cu[:-1]).any():
        raise LayoutError(f"{name} must be 1-D [n + 1], start at 0 and never decrease, got {cu.tolist()}")
    return cu[1:] - cu[:-1]


def padding_layout(seq_q: int, seq_k: int, lengths, *, side: str = "right", causal: bool = True,
                   align: str = "bottom_right", block_m: int = 128, block_n: int = 128, offset: int | None = None,
                   device=None) -> BlockLayout:
    """Key padding per batch element: only ``lengths[b]`` of the Sk keys are real.

    lengths: [B] ints in [0, Sk]. side "right": keys [0, lengths[b]) are visible (padding at the
    end); "left": keys [Sk - lengths[b], Sk) (padding at the start, as in batched generation).
    causal: also the causal predicate on the padded Sq x Sk grid, aligned by ``align`` as in
    ``causal_layout`` (bottom-right by default: with left padding or a decode step the last
    query sees every real key; ``offset=`` sets the diagonal explicitly, as in ``causal_layout``:
    a static KV cache has more key slots than the diagonal reaches). Query rows are not masked: a
    query that sees no real key gives 0 and LSE -inf. Carried as k_start, k_end [B] (8 bytes per
    batch element), made on ``device`` (default: the lengths' device, or the CPU for a list).
    """
    if side not in ("right", "left"):
        raise LayoutError(f"side must be 'right' or 'left', got {side!r}")
    if device is None:
        device = lengths.device if isinstance(lengths, torch.Tensor) else "cpu"
    lens = _lengths(lengths, "lengths")
    if lens.dim() != 1 or (lens > seq_k).any():
        raise LayoutError(f"lengths must be 1-D [B] with values in [0, {seq_k}], got {lens.tolist()}")
    lens = lens.to(device)
    k_start = torch.zeros_like(lens) if side == "right" else seq_k - lens
    k_end = lens if side == "right" else torch.full_like(lens, seq_k)
    mask = MaskSpec(causal=True, offset=_diagonal_offset(seq_q, seq_k, align, offset)) if causal else MaskSpec()
    return _key_range_layout(seq_q, seq_k, k_start, k_end, mask, f"padding-{side}", block_m, block_n)


def _key_range_layout(seq_q: int, seq_k: int, k_start: torch.Tensor, k_end: torch.Tensor, mask: MaskSpec,
                      kind: str, block_m: int, block_n: int) -> BlockLayout:
    """Key padding [k_start[b], k_end[b]) [Bp] under ``mask``, on the ranges' device (the
    ranges are trusted: ``padding_layout`` checks them; the layout's validation reads them)."""
    classes = _spec_classes(mask, seq_q, seq_k, block_m, block_n, k_start=k_start, k_end=k_end)
    return _layout_from_classes(classes, seq_q, seq_k, block_m, block_n, mask, kind,
                                k_start=k_start.to(torch.int32), k_end=k_end.to(torch.int32))


def prefix_lm_layout(seq: int, prefix_len, *, block_m: int = 128, block_n: int = 128) -> BlockLayout:
    """Prefix-LM: the first ``prefix_len`` keys are visible to every query (bidirectional
    prefix), the rest causally (k <= q). Any prefix length in [0, seq].

    prefix_len: an int, or [B] ints (one prefix per batch element). The OR of a prefix and the
    causal predicate is not a MaskSpec, so the mask is carried as ``mask_bits``
    [1 or B, 1, seq, ceil(seq / 32)] (seq^2 / 8 bytes per batch entry); the bits are consulted
    only in the partial tiles (the diagonal and the prefix boundary).
    """
    prefix = _lengths([prefix_len] if isinstance(prefix_len, int) else prefix_len, "prefix_len")
    if prefix.dim() != 1 or (prefix > seq).any():
        raise LayoutError(f"prefix_len must be an int or [B] ints in [0, {seq}], got {prefix.tolist()}")

    # Query q sees the keys [0, last[b, q]]: its own causal prefix or the whole prefix.
    q_idx = torch.arange(seq)
    q0, q1 = _tile_spans(seq, block_m, None)
    k0, k_last = _tile_spans(seq, block_n, None)
    k1 = k0 + block_n - 1
    first_prefix_key = (prefix - 1).view(-1, 1, 1, 1)
    last_q0 = torch.maximum(q0[:, None], first_prefix_key)  # the least of the tile's rows' last keys
    any_visible = k0[None, :] <= torch.maximum(q1[:, None], first_prefix_key)
    all_visible = (k1[None, :] < seq) & (k1[None, :] <= last_q0)
    classes = _classes(any_visible, all_visible)
    # Bits are needed only where a partial tile hides a key inside seq (module docstring).
    bits = None
    if bool((any_visible & ~all_visible & (k_last[None, :] > last_q0)).any()):
        last = torch.maximum(q_idx[None, :], prefix[:, None] - 1)  # [B', seq]
        word_first = torch.arange(0, seq, 32)
        ones = (last[..., None] - word_first + 1).clamp(0, 32)  # visible bits of each word, low first
        words = torch.bitwise_left_shift(torch.ones_like(ones), ones) - 1
        bits = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)[:, None]
    kind = f"prefixlm{int(prefix[0])}" if prefix.numel() == 1 else "prefixlm"
    return _broadcast_layout(classes, seq, seq, block_m, block_n, kind, bits)
