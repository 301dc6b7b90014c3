"""The ``attention`` subject: the block-sparse attention op over named sets of cases.

A case is a frozen dataclass with a readable id (``B2-Hq8-Hkv2-Sq1000-Sk1000-D64-causal-bf16-s0``)
that is both its layer name in a bundle and its pytest id. The module holds one
:class:`~parity.run.subjects.ops.SparseAttention` per case, registered under the case id, so each case
is one recorded layer with outputs ``<id>/out`` and ``<id>/lse``. Inputs (q, k, v) and the
layout's tensors are drawn on the CPU from the case's seed and stored in the bundle, under
``<id>/q``, ``<id>/k``, ``<id>/v`` and ``<id>/layout/<tensor>``; each layout's meta is in the
manifest's ``inputs_meta["layouts"][<id>]``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from parity.base import dtypes
from parity.base.errors import UsageError
from parity.run.subjects.base import Inputs, Subject, check_inputs_tensor, check_ints, check_memory, shown
from parity.run.subjects.ops import SparseAttention

LAYOUT_KINDS = ("causal", "window", "sink", "random", "dense", "emptyrow", "document", "padleft", "padright",
                "prefixlm")
# More cases than any set or fuzz run uses; a manifest listing millions would only waste time.
MAX_CASES = 10_000


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """One attention problem. ``layout`` is one of LAYOUT_KINDS:

    causal; window (causal sliding ``window``); sink (window plus ``sink_blocks`` always-visible
    first key blocks); random (causal, each tile kept with probability ``density``, drawn per
    batch and head from ``seed``); dense (every key visible; for decode-like Sq=1); emptyrow (a
    block-causal mask whose query block ``empty_block`` sees no key: output 0, LSE -inf).
    Causal diagonals are bottom-right aligned when Sq != Sk (kernels/layout.py).

    Element-mask kinds (masks inside partial blocks): document (``docs`` documents packed in one
    row, lengths drawn from ``seed``, causal within each; Sq = Sk); padleft / padright (causal
    with key padding, each batch element's key length drawn from ``seed``, the first full);
    prefixlm (the first ``prefix`` keys visible to every query, the rest causal; Sq = Sk).
    """

    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    head_dim: int
    layout: str = "causal"
    dtype: str = "bf16"
    seed: int = 0
    window: int = 0
    sink_blocks: int = 0
    density: float = 0.0
    empty_block: int = 0
    block_m: int = 64
    block_n: int = 64
    docs: int = 0
    prefix: int = 0

    def __post_init__(self):
        # Cases also come from a bundle's manifest: every field is checked for type and range
        # here, so nothing malformed reaches the kernels as a TypeError or a KeyError.
        sizes = ("batch", "heads_q", "heads_kv", "seq_q", "seq_k", "head_dim", "block_m", "block_n")
        check_ints("attention case", {name: getattr(self, name) for name in sizes}, 1)
        counts = ("window", "sink_blocks", "empty_block", "seed", "docs", "prefix")
        check_ints("attention case", {name: getattr(self, name) for name in counts}, 0)
        if self.heads_q % self.heads_kv:
            raise UsageError(f"attention case heads_q ({self.heads_q}) must be a multiple of heads_kv ({self.heads_kv})")
        density = self.density
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 <= density <= 1.0:
            raise UsageError(f"attention case density must be in [0, 1], got {shown(density)}")
        if not isinstance(self.layout, str) or self.layout not in LAYOUT_KINDS:
            raise UsageError(f"unknown attention layout {shown(self.layout)}; choose from {', '.join(LAYOUT_KINDS)}")
        if not isinstance(self.dtype, str) or self.dtype not in dtypes.KERNEL_DTYPES:
            raise UsageError(f"attention case dtype must be fp16, bf16 or fp32, got {shown(self.dtype)}")
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise UsageError(f"attention case {name} must be a power of two >= 16, got {value}")
        if self.layout == "emptyrow" and self.empty_block >= -(-self.seq_q // self.block_m):
            raise UsageError(f"attention case empty_block ({self.empty_block}) must name one of the "
                             f"{-(-self.seq_q // self.block_m)} query blocks")
        if self.layout in ("window", "sink") and self.window < 1:
            raise UsageError(f"a {self.layout} case needs window >= 1")
        if self.layout in ("document", "prefixlm") and self.seq_q != self.seq_k:
            raise UsageError(f"a {self.layout} case needs seq_q == seq_k, got {self.seq_q} and {self.seq_k}")
        if self.layout == "document" and not 1 <= self.docs <= self.seq_q:
            raise UsageError(f"a document case needs 1 <= docs <= seq_q ({self.seq_q}), got {self.docs}")
        if self.layout == "prefixlm" and self.prefix > self.seq_q:
            raise UsageError(f"a prefixlm case needs prefix <= seq_q ({self.seq_q}), got {self.prefix}")

    @property
    def layout_tag(self) -> str:
        tag = {
            "causal": "causal",
            "window": f"window{self.window}",
            "sink": f"window{self.window}-sink{self.sink_blocks}",
            "random": f"random{int(round(self.density * 100))}",
            "dense": "dense",
            "emptyrow": f"emptyrow{self.empty_block}",
            "document": f"docs{self.docs}",
            "padleft": "padleft",
            "padright": "padright",
            "prefixlm": f"prefixlm{self.prefix}",
        }[self.layout]
        if (self.block_m, self.block_n) != (64, 64):
            tag += f"-bm{self.block_m}bn{self.block_n}"
        return tag

    @property
    def id(self) -> str:
        return (f"B{self.batch}-Hq{self.heads_q}-Hkv{self.heads_kv}-Sq{self.seq_q}-Sk{self.seq_k}-"
                f"D{self.head_dim}-{self.layout_tag}-{self.dtype}-s{self.seed}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtypes.torch_dtype(self.dtype)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "AttentionCase":
        if not isinstance(data, dict):
            raise UsageError(f"bad attention case {shown(data)}: expected an object of case fields")
        try:
            return cls(**data)
        except TypeError as err:
            raise UsageError(f"bad attention case {shown(data)}: {err}") from None

    def memory(self) -> tuple[int, int]:
        """Estimated bytes (kept for the whole run, transient while this case runs).

        Kept: q, k, v and the layout, their fp64 copies for the reference run, and the recorded
        out and LSE with their fp64 references. Transient: the dense reference (``reference.py``)
        in fp64 with k and v expanded to every query head, and per chunk of at most 1024 query
        rows its score matrix three times over (scores, masked, probabilities) plus the mask.
        """
        elem = self.torch_dtype.itemsize
        q = self.batch * self.heads_q * self.seq_q * self.head_dim
        kv = self.batch * self.heads_kv * self.seq_k * self.head_dim
        rows = self.batch * self.heads_q * self.seq_q
        layout_bh = (self.batch * self.heads_q if self.layout == "random"
                     else self.batch if self.layout in ("padleft", "padright") else 1)
        blocks = -(-self.seq_q // self.block_m) * -(-self.seq_k // self.block_n)
        kept = (q + 2 * kv) * (elem + 8) + layout_bh * blocks * (2 * 4 * 2 + 1) + q * (elem + 8) + rows * (4 + 8)
        # element masks: document ids, or bits (prefixlm: Sq x Sk / 8 bytes), or 8 bytes a batch
        kept += {"document": 4 * (self.seq_q + self.seq_k), "prefixlm": self.seq_q * -(-self.seq_k // 32) * 4,
                 "padleft": 8 * self.batch, "padright": 8 * self.batch}.get(self.layout, 0)
        chunk = min(self.seq_q, 1024)
        scores = self.batch * self.heads_q * chunk * self.seq_k
        transient = (q + 2 * self.batch * self.heads_q * self.seq_k * self.head_dim) * 8 + scores * 8 * 3 \
            + layout_bh * chunk * self.seq_k
        return kept, transient

    def make_layout(self):
        """The case's BlockLayout, on the CPU (seeded where random)."""
        from parity import kernels

        blocks = dict(block_m=self.block_m, block_n=self.block_n)
        if self.layout == "causal":
            return kernels.causal_layout(self.seq_q, self.seq_k, **blocks)
        if self.layout == "window":
            return kernels.sliding_window_layout(self.seq_q, self.seq_k, window=self.window, **blocks)
        if self.layout == "sink":
            return kernels.sink_layout(self.seq_q, self.seq_k, window=self.window, sink_blocks=self.sink_blocks,
                                       **blocks)
        if self.layout == "random":
            return kernels.random_layout(self.seq_q, self.seq_k, density=self.density, seed=self.seed,
                                         batch=self.batch, heads=self.heads_q, causal=True, **blocks)
        if self.layout == "document":
            return kernels.document_layout(self._document_lengths(), **blocks)
        if self.layout in ("padleft", "padright"):
            return kernels.padding_layout(self.seq_q, self.seq_k, self._key_lengths(),
                                          side="left" if self.layout == "padleft" else "right", **blocks)
        if self.layout == "prefixlm":
            return kernels.prefix_lm_layout(self.seq_q, self.prefix, **blocks)
        num_q = -(-self.seq_q // self.block_m)
        num_k = -(-self.seq_k // self.block_n)
        if self.layout == "dense":
            mask = torch.ones(1, 1, num_q, num_k, dtype=torch.bool)
        else:  # emptyrow: block-causal, with one query block that sees nothing
            rows = torch.arange(num_q)[:, None] * self.block_m
            cols = torch.arange(num_k)[None, :] * self.block_n
            mask = (cols <= rows + self.block_m - 1)[None, None].clone()
            mask[..., self.empty_block, :] = False
        return kernels.layout_from_block_mask(mask, self.seq_q, self.seq_k, **blocks)

    def _document_lengths(self) -> list[int]:
        """``docs`` positive lengths summing to seq_q, from the case's seed (CPU generator)."""
        gen = torch.Generator().manual_seed(self.seed)
        cuts = (torch.randperm(self.seq_q - 1, generator=gen)[: self.docs - 1] + 1).sort().values.tolist()
        bounds = [0, *cuts, self.seq_q]
        return [end - start for start, end in zip(bounds, bounds[1:])]

    def _key_lengths(self) -> list[int]:
        """Per batch element key lengths in [0, seq_k] from the case's seed; the first is seq_k."""
        gen = torch.Generator().manual_seed(self.seed)
        drawn = torch.randint(0, self.seq_k + 1, (self.batch,), generator=gen).tolist()
        return [self.seq_k, *drawn[1:]]

    def make_qkv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, Hq, Sq, D], k and v [B, Hkv, Sk, D] in the case's dtype, a pure function of the case."""
        from parity.kernels.testing import random_qkv

        return random_qkv(self.batch, self.heads_q, self.heads_kv, self.seq_q, self.seq_k, self.head_dim,
                          self.torch_dtype, self.seed)


def _case(b, hq, hkv, sq, sk, d, layout="causal", dtype="bf16", seed=0, **kw) -> AttentionCase:
    return AttentionCase(b, hq, hkv, sq, sk, d, layout=layout, dtype=dtype, seed=seed, **kw)


# `default`: small enough that the Triton interpreter runs the whole set in a few seconds on a CPU;
# it still covers each layout kind, GQA, odd lengths, a single query row, an empty row and all
# three dtypes. `gpu`: production-like sizes for a capture host.
CASE_SETS: dict[str, tuple[AttentionCase, ...]] = {
    "smoke": (
        _case(1, 2, 1, 64, 64, 32, "causal", "fp16"),
        _case(1, 2, 2, 80, 80, 32, "window", "bf16", window=48),
    ),
    "default": (
        _case(1, 2, 2, 128, 128, 64, "causal", "fp16"),
        _case(1, 4, 2, 113, 113, 32, "causal", "bf16", seed=1),
        _case(1, 2, 2, 256, 256, 64, "window", "bf16", window=96),
        _case(1, 4, 1, 256, 256, 64, "sink", "fp16", window=64, sink_blocks=1, seed=2),
        _case(1, 2, 2, 256, 256, 64, "random", "fp32", density=0.5, seed=3),
        _case(1, 4, 2, 1, 200, 64, "dense", "bf16", seed=4),
        _case(2, 2, 2, 160, 160, 64, "emptyrow", "bf16", empty_block=1, seed=5),
        _case(1, 2, 2, 100, 100, 64, "causal", "fp32", seed=6),
    ),
    # Element masks inside partial blocks: packed documents, key padding on either side, a decode
    # step over a left-padded cache, prefix-LM at a prefix that is no block multiple. Small
    # enough for the interpreter.
    "masks": (
        _case(1, 2, 1, 256, 256, 64, "document", "bf16", docs=3, seed=7),
        _case(3, 2, 2, 96, 96, 32, "padleft", "fp16", seed=8, block_m=32, block_n=32),
        _case(3, 2, 1, 96, 96, 32, "padright", "fp32", seed=9, block_m=32, block_n=32),
        _case(2, 4, 1, 1, 300, 64, "padleft", "bf16", seed=11),
        _case(1, 2, 2, 100, 100, 64, "prefixlm", "fp16", prefix=23, seed=10, block_m=32, block_n=32),
    ),
    "gpu": (
        _case(2, 8, 2, 1000, 1000, 64, "causal", "bf16"),
        _case(2, 8, 2, 1000, 1000, 64, "causal", "fp16"),
        _case(2, 8, 2, 1000, 1000, 64, "causal", "fp32"),
        _case(1, 16, 16, 4096, 4096, 128, "causal", "bf16", block_m=128, block_n=128),
        _case(1, 16, 4, 4096, 4096, 128, "window", "bf16", window=1024, block_m=128, block_n=128, seed=1),
        _case(1, 16, 4, 4096, 4096, 128, "sink", "bf16", window=1024, sink_blocks=1, block_m=128, block_n=128,
              seed=2),
        _case(1, 16, 16, 4096, 4096, 128, "random", "bf16", density=0.25, block_m=128, block_n=128, seed=3),
        _case(4, 32, 8, 1, 4096, 128, "dense", "bf16", block_m=128, block_n=128, seed=4),
        _case(2, 8, 8, 1537, 1537, 64, "emptyrow", "fp16", empty_block=3, seed=5),
        _case(2, 8, 2, 2048, 2048, 256, "causal", "bf16", seed=6),
    ),
}


class AttentionCases(nn.Module):
    """One SparseAttention per case, each registered under the case id (its layer name)."""

    def __init__(self, case_ids: list[str], impl: str):
        super().__init__()
        for case_id in case_ids:
            self.add_module(case_id, SparseAttention(impl, return_lse=True))

    def forward(self, *args, **kwargs):
        raise TypeError("AttentionCases is run case by case through AttentionSubject.call")


class AttentionSubject(Subject):
    """The attention op over a named case set (``cases="default"``) or explicit case dicts.

    ``dtype`` (fp16/bf16/fp32), when given, replaces every case's dtype. ``args`` records the
    expanded list of cases, so the other host runs exactly these cases even if a named set
    changes later.
    """

    name = "attention"
    impls = ("reference", "triton")

    def __init__(self, cases: str | list[dict[str, Any]] = "default", dtype: str | None = None,
                 case_set: str | None = None):
        if isinstance(cases, str):
            if cases not in CASE_SETS:
                raise UsageError(f"unknown attention case set {shown(cases)}; choose from {', '.join(CASE_SETS)}")
            case_set, chosen = cases, list(CASE_SETS[cases])
        elif isinstance(cases, list):
            if len(cases) > MAX_CASES:
                raise UsageError(f"attention subject: {len(cases)} cases, at most {MAX_CASES} are supported")
            chosen = [case if isinstance(case, AttentionCase) else AttentionCase.from_json(case) for case in cases]
        else:
            raise UsageError(f"attention cases must be a set name or a list of cases, got {type(cases).__name__}")
        if case_set is not None and not isinstance(case_set, str):
            raise UsageError(f"attention case_set must be a set name or null, got {shown(case_set)}")
        if dtype is not None:
            if not isinstance(dtype, str) or dtype not in dtypes.KERNEL_DTYPES:
                raise UsageError(f"attention dtype must be fp16, bf16 or fp32, got {shown(dtype)}")
            chosen = [dataclasses.replace(case, dtype=dtype) for case in chosen]
        ids = [case.id for case in chosen]
        if len(set(ids)) != len(ids):
            raise UsageError("attention cases must have distinct ids")
        if not chosen:
            raise UsageError("attention subject needs at least one case")
        self.cases: tuple[AttentionCase, ...] = tuple(chosen)
        # Refuse sizes this host cannot hold before a single tensor is allocated (a case with
        # seq_q=10**6 would otherwise run out of memory, or swap, minutes later).
        check_memory(self.name, self.memory_needs(), named=self.sizes_text)
        super().__init__(cases=[case.to_json() for case in chosen], dtype=None, case_set=case_set)

    def memory_needs(self) -> list[tuple[str, int]]:
        """Estimated bytes: every case's tensors (kept), plus the largest case's reference run."""
        per_case = [case.memory() for case in self.cases]
        return [("inputs and recorded outputs", sum(kept for kept, _ in per_case)),
                ("attention scores", max(transient for _, transient in per_case))]

    @property
    def sizes_text(self) -> str:
        biggest = max(self.cases, key=lambda case: sum(case.memory()))
        return f"case {biggest.id}" + (f" (and {len(self.cases) - 1} more)" if len(self.cases) > 1 else "")

    def check_inputs(self, inputs: Inputs) -> None:
        """Every case's q, k, v and layout, as a bundle stores them, before anything runs: missing
        or malformed ones are a UsageError naming the case, never a KeyError mid-run."""
        layouts = inputs.meta.get("layouts") if isinstance(inputs.meta, dict) else None
        if not isinstance(layouts, dict):
            raise UsageError("subject attention: the inputs' metadata has no 'layouts' object "
                             "(manifest inputs_meta.layouts)")
        from parity.kernels import BlockLayout
        from parity.kernels.layout import LayoutError

        for case in self.cases:
            where = f"subject attention, case {case.id}"
            q_shape = (case.batch, case.heads_q, case.seq_q, case.head_dim)
            kv_shape = (case.batch, case.heads_kv, case.seq_k, case.head_dim)
            for name, shape in (("q", q_shape), ("k", kv_shape), ("v", kv_shape)):
                check_inputs_tensor(inputs, f"{case.id}/{name}", where, shape=shape, floating=True)
            prefix = f"{case.id}/layout/"
            tensors = {key[len(prefix):]: t for key, t in inputs.tensors.items() if key.startswith(prefix)}
            meta = layouts.get(case.id)
            if not isinstance(meta, dict):
                raise UsageError(f"{where}: no layout metadata (manifest inputs_meta.layouts[{case.id!r}])")
            expected = {"seq_q": case.seq_q, "seq_k": case.seq_k, "block_m": case.block_m, "block_n": case.block_n}
            for key, value in expected.items():
                if meta.get(key) != value or isinstance(meta.get(key), bool):
                    raise UsageError(f"{where}: layout metadata {key} is {shown(meta.get(key))}, the case has {value}")
            if not isinstance(meta.get("mask", {}), dict):
                raise UsageError(f"{where}: layout metadata mask must be an object, got {shown(meta.get('mask'))}")
            try:
                BlockLayout.from_tensors(tensors, meta)
            except (LayoutError, TypeError, ValueError) as err:
                raise UsageError(f"{where}: stored layout is unusable: {' '.join(str(err).split())[:300]}") from None

    def make_inputs(self) -> Inputs:
        tensors: dict[str, torch.Tensor] = {}
        layouts: dict[str, Any] = {}
        for case in self.cases:
            q, k, v = case.make_qkv()
            tensors.update({f"{case.id}/q": q, f"{case.id}/k": k, f"{case.id}/v": v})
            layout = case.make_layout()
            for name, tensor in layout.to_tensors().items():
                tensors[f"{case.id}/layout/{name}"] = tensor
            layouts[case.id] = layout.meta
        return Inputs(tensors, {"layouts": layouts})

    def build(self, impl: str) -> nn.Module:
        return AttentionCases([case.id for case in self.cases], impl)

    def call(self, module: nn.Module, inputs: Inputs) -> dict[str, Any]:
        outputs = {}
        for case in self.cases:
            prefix = f"{case.id}/layout/"
            layout = {name[len(prefix):]: t for name, t in inputs.tensors.items() if name.startswith(prefix)}
            t = inputs.tensors
            outputs[case.id] = module._modules[case.id](
                t[f"{case.id}/q"], t[f"{case.id}/k"], t[f"{case.id}/v"],
                layout=layout, layout_meta=inputs.meta["layouts"][case.id],
            )
        return outputs
