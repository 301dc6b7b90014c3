"""The ``decoder`` subject: a small decoder-only language model whose attention is the block-sparse op.

Embedding, then ``layers`` blocks of (RMSNorm, attention with RoPE and GQA, RMSNorm, SwiGLU MLP)
with residuals, a final RMSNorm and an LM head. Each layer's attention has its own block layout,
cycling through ``layer_layouts`` (causal, sliding window, sliding window with sink blocks): the
mixed layouts of a long-context model. A layout is a property of the architecture, so its
tensors are persistent buffers: they travel in the bundle's state with the weights.

Weights are drawn on the CPU from ``seed`` by :meth:`DecoderSubject.make_state` and stored in
the bundle; the compare host loads them from there. The input is token ids ``tokens [B, S]``.
"""
from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import nn

from parity.base import dtypes
from parity.base.errors import UsageError
from parity.run.subjects.base import (
    Inputs,
    Subject,
    check_inputs_tensor,
    check_ints,
    check_memory,
    describe_sizes,
    shown,
)
from parity.run.subjects.ops import SparseAttention

LAYER_LAYOUTS = ("causal", "window", "sink")
_LAYOUT_BUFFERS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms and RoPE are computed in fp32, or in fp64 during a high-precision reference run."""
    return dtypes.accumulation_dtype(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x_wide = x.to(_compute_dtype(x.dtype))
        normed = x_wide * torch.rsqrt(x_wide.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def apply_rope(x: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary position embedding (rotate-half form) of x [B, H, S, D], computed in fp32 or fp64."""
    wide = _compute_dtype(x.dtype)
    seq, dim = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=x.device, dtype=wide) / dim))
    angles = torch.arange(seq, device=x.device, dtype=wide)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    xw = x.to(wide)
    first, second = xw[..., : dim // 2], xw[..., dim // 2:]
    rotated = torch.cat([-second, first], dim=-1)
    return (xw * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """q/k/v/o projections with GQA, RoPE, and block-sparse attention over this layer's layout."""

    def __init__(self, d_model: int, heads: int, kv_heads: int, head_dim: int, rope_base: float,
                 layout, impl: str):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.rope_base = heads, kv_heads, head_dim, rope_base
        self.q_proj = nn.Linear(d_model, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, d_model, bias=False)
        self.core = SparseAttention(impl)
        self.layout_meta: dict[str, Any] = layout.meta
        for name, tensor in layout.to_tensors().items():
            self.register_buffer(f"layout_{name}", tensor)

    def forward(self, x):
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, self.rope_base), apply_rope(k, self.rope_base)
        layout = {name: getattr(self, f"layout_{name}") for name in _LAYOUT_BUFFERS}
        out = self.core(q.contiguous(), k.contiguous(), v.contiguous(), layout=layout, layout_meta=self.layout_meta)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, d_model, heads, kv_heads, head_dim, ffn_dim, rope_base, layout, impl):
        super().__init__()
        self.attn_norm = RMSNorm(d_model)
        self.attn = Attention(d_model, heads, kv_heads, head_dim, rope_base, layout, impl)
        self.mlp_norm = RMSNorm(d_model)
        self.mlp = SwiGLU(d_model, ffn_dim)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class DecoderLM(nn.Module):
    """tokens [B, S] int64 -> logits [B, S, vocab]."""

    def __init__(self, *, vocab, d_model, heads, kv_heads, head_dim, ffn_dim, rope_base, layouts, impl, dtype):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(
            DecoderLayer(d_model, heads, kv_heads, head_dim, ffn_dim, rope_base, layout, impl) for layout in layouts
        )
        self.norm = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.to(dtype)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class DecoderSubject(Subject):
    """A small block-sparse decoder LM; the defaults run in a few seconds in the Triton interpreter."""

    name = "decoder"
    impls = ("reference", "triton")

    def __init__(self, vocab: int = 256, d_model: int = 128, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                 head_dim: int = 32, ffn_dim: int = 256, seq_len: int = 128, batch: int = 2,
                 layer_layouts: list[str] | tuple[str, ...] = ("causal", "window", "sink", "window"),
                 window: int = 48, sink_blocks: int = 1, block: int = 32, rope_base: float = 10000.0,
                 dtype: str = "bf16", seed: int = 0):
        from parity.kernels.attention import SUPPORTED_HEAD_DIMS

        # The arguments also come from a bundle's manifest: types first, so that a wrong one is a
        # UsageError naming it rather than a TypeError from a comparison further down.
        check_ints("decoder", dict(vocab=vocab, d_model=d_model, layers=layers, heads=heads, kv_heads=kv_heads,
                                   head_dim=head_dim, ffn_dim=ffn_dim, seq_len=seq_len, batch=batch,
                                   block=block, window=window), 1)
        check_ints("decoder", dict(sink_blocks=sink_blocks, seed=seed), 0)
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise UsageError(f"decoder head_dim must be one the kernel supports "
                             f"({', '.join(map(str, SUPPORTED_HEAD_DIMS))}), got {head_dim}")
        if block < 16 or block & (block - 1):
            raise UsageError(f"decoder block must be a power of two >= 16, got {block}")
        if isinstance(rope_base, bool) or not isinstance(rope_base, (int, float)) or not 0 < rope_base < math.inf:
            raise UsageError(f"decoder rope_base must be a positive finite number, got {shown(rope_base)}")
        if not isinstance(dtype, str) or dtype not in dtypes.KERNEL_DTYPES:  # the kernel's own
            raise UsageError(f"decoder dtype must be fp16, bf16 or fp32, got {shown(dtype)}")
        if heads % kv_heads:
            raise UsageError(f"decoder heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
        if not isinstance(layer_layouts, (list, tuple)) or not layer_layouts or not all(
                isinstance(kind, str) and kind in LAYER_LAYOUTS for kind in layer_layouts):
            raise UsageError(f"decoder layer_layouts must be a non-empty list drawn from {', '.join(LAYER_LAYOUTS)}, "
                             f"got {shown(layer_layouts)}")
        super().__init__(vocab=vocab, d_model=d_model, layers=layers, heads=heads, kv_heads=kv_heads,
                         head_dim=head_dim, ffn_dim=ffn_dim, seq_len=seq_len, batch=batch,
                         layer_layouts=list(layer_layouts), window=window, sink_blocks=sink_blocks, block=block,
                         rope_base=rope_base, dtype=dtype, seed=seed)
        # Before anything is allocated: seq_len=10**5 or heads=10**6 would otherwise exhaust
        # memory (or swap for an hour) instead of saying so.
        check_memory(self.name, self.memory_needs(), named=self.sizes_text)

    @property
    def sizes_text(self) -> str:
        sizes = ("vocab", "d_model", "layers", "heads", "kv_heads", "head_dim", "ffn_dim", "seq_len", "batch", "block")
        defaults = {name: p.default for name, p in inspect.signature(DecoderSubject.__init__).parameters.items()}
        return describe_sizes({name: self.args[name] for name in sizes}, defaults)

    def memory_needs(self) -> list[tuple[str, int]]:
        """Estimated bytes of a capture (the largest user of memory; compare needs less).

        Weights: drawn in fp32, stored in the model dtype, plus the fp64 reference model. Recorded
        activations: every module's output for each layer, and the logits, each with its fp64
        reference. Attention scores: the reference attention's chunks of at most 1024 query rows,
        in fp64, three score-sized temporaries. Layouts: two index lists per layer.
        """
        a = self.args
        elem = dtypes.torch_dtype(a["dtype"]).itemsize
        d, hq, hkv, hd, ffn = a["d_model"], a["heads"], a["kv_heads"], a["head_dim"], a["ffn_dim"]
        tokens = a["batch"] * a["seq_len"]
        params = 2 * a["vocab"] * d + a["layers"] * (2 * d * hd * (hq + hkv) + 3 * d * ffn + 2 * d) + d
        per_layer = tokens * (6 * d + 2 * hd * (hq + hkv) + 3 * ffn)
        activations = (a["layers"] * per_layer + 2 * tokens * a["vocab"]) * (elem + 8)
        chunk = min(a["seq_len"], 1024)
        scores = a["batch"] * hq * chunk * a["seq_len"] * 8 * 3
        blocks = -(-a["seq_len"] // a["block"])
        layouts = a["layers"] * blocks * blocks * (2 * 4 * 2 + 1)
        return [("weights", params * (4 + elem + 8)), ("recorded activations", activations),
                ("attention scores", scores), ("layouts", layouts)]

    def check_inputs(self, inputs: Inputs) -> None:
        """``tokens`` must be integer ids of shape [batch, seq_len] within the vocabulary."""
        a = self.args
        tokens = check_inputs_tensor(inputs, "tokens", "subject decoder", shape=(a["batch"], a["seq_len"]),
                                     floating=False)
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= a["vocab"]):
            raise UsageError(f"subject decoder: input 'tokens' holds ids in [{int(tokens.min())}, {int(tokens.max())}], "
                             f"outside the vocabulary [0, {a['vocab']})")

    def check_state(self, state: dict[str, torch.Tensor]) -> None:
        """Each layer's stored layout must be a valid layout for this decoder's sequence length
        (its indices drive the kernel's memory accesses)."""
        from parity.kernels import BlockLayout
        from parity.kernels.layout import LayoutError

        for index, layout in enumerate(self._layouts()):
            prefix = f"layers.{index}.attn.layout_"
            tensors = {name: state[prefix + name] for name in _LAYOUT_BUFFERS if prefix + name in state}
            if len(tensors) != len(_LAYOUT_BUFFERS):
                continue  # missing keys: loading the state names them
            try:
                BlockLayout.from_tensors(tensors, layout.meta)
            except (LayoutError, TypeError, ValueError) as err:
                raise UsageError(f"subject decoder: stored layout of layers.{index}.attn is unusable: "
                                 f"{' '.join(str(err).split())[:300]}") from None

    def _layouts(self) -> list:
        from parity import kernels

        a = self.args
        seq, blocks = a["seq_len"], dict(block_m=a["block"], block_n=a["block"])
        made = {
            "causal": lambda: kernels.causal_layout(seq, seq, **blocks),
            "window": lambda: kernels.sliding_window_layout(seq, seq, window=a["window"], **blocks),
            "sink": lambda: kernels.sink_layout(seq, seq, window=a["window"], sink_blocks=a["sink_blocks"], **blocks),
        }
        kinds = a["layer_layouts"]
        return [made[kinds[index % len(kinds)]]() for index in range(a["layers"])]

    def build(self, impl: str, device: torch.device | str = "cpu") -> nn.Module:
        """The model for ``impl`` with its weights made on ``device`` (``meta``: no memory, for a
        module that is then given its tensors). The layouts are computed on the CPU from their
        data either way (the layout code reads what it builds), then travel as buffers."""
        a = self.args
        layouts = self._layouts()
        with torch.device(device):
            return DecoderLM(vocab=a["vocab"], d_model=a["d_model"], heads=a["heads"], kv_heads=a["kv_heads"],
                             head_dim=a["head_dim"], ffn_dim=a["ffn_dim"], rope_base=a["rope_base"],
                             layouts=layouts, impl=impl, dtype=dtypes.torch_dtype(a["dtype"]))

    def make_state(self) -> dict[str, torch.Tensor]:
        """Seeded weights: embeddings N(0, 1), projections N(0, 1/fan_in), norm gains 1 + N(0, 0.1²).

        Drawn in fp32 in state_dict order with one CPU generator, then cast to the model dtype.
        """
        model = self.build("reference")
        gen = torch.Generator().manual_seed(self.args["seed"])
        state = {}
        for name, tensor in model.state_dict().items():
            if not tensor.is_floating_point():  # layout buffers
                state[name] = tensor.clone()
                continue
            noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.1 * noise
            elif name == "embed.weight":
                value = noise
            else:
                value = noise / math.sqrt(tensor.shape[-1])
            state[name] = value.to(tensor.dtype)
        return state

    def make_inputs(self) -> Inputs:
        gen = torch.Generator().manual_seed(self.args["seed"] + 1)
        tokens = torch.randint(0, self.args["vocab"], (self.args["batch"], self.args["seq_len"]), generator=gen)
        return Inputs({"tokens": tokens})

    def call(self, module: nn.Module, inputs: Inputs):
        return module(inputs.tensors["tokens"])
