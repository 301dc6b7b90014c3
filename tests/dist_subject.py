"""A small decoder with tensor parallelism, for the distributed tests (tests/test_distributed.py).

Embedding, ``layers`` blocks of (RMSNorm, causal attention, RMSNorm, SwiGLU MLP) with residuals,
a final norm and an LM head, all plain PyTorch (SDPA), so it runs anywhere. Heads are taken from
the projections' width (``view(..., -1, head_dim)``), so the same code runs whole or split.

``split`` chooses how :meth:`TPDecoderSubject.parallelize` splits it over a 1-D mesh:

- ``"dtensor"``: ``parallelize_module`` with ``ColwiseParallel`` on q/k/v and gate/up and
  ``RowwiseParallel`` on o and down (attention heads and the MLP's hidden dim split), and the LM
  head split over the vocabulary with DTensor logits (``vocab`` 66 splits unevenly over 4 ranks,
  17/17/17/15, as DTensor does);
- ``"megatron"``: a manual split of the MLP alone, plain tensors: gate/up rows and down columns
  sliced per rank, the MLP all-reduces down's partial sums itself (so ``mlp.down_proj``'s output
  is a partial sum and ``mlp``'s is replicated); the placements come from the user's map.

``pipeline`` places the embedding and the first block on the CPU and the rest on the device it
is given (:meth:`TPDecoderSubject.place`): on a GPU host, one model over two devices in one process.

Faults, as other implementations (injected from outside parity, after the split): ``fault-rank1``
scales rank 1's local shard of ``layers.1.mlp.up_proj.weight`` by 1.01; ``die-rank1`` kills rank
1's process with SIGKILL in the middle of the recorded run; ``observed-rank1`` is a model whose
output on rank 1 alone changes when forward hooks watch it (rank 1's logits move by 1e-3), which
the hooks-on/off check of that rank must catch.
"""
from __future__ import annotations

import math
import os
import signal

import torch
from torch import nn

from parity.run.subjects import Inputs
from parity.run.subjects.base import Subject


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, d_model, heads, kv_heads, head_dim):
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(d_model, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, d_model, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, d_model, ffn_dim):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.up_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, d_model, bias=False)
        self.reduce = False  # the manual split's all-reduce of down's partial sums
        self.die_on_call = 0  # die-rank1: SIGKILL at this call (0: never)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.die_on_call and self.calls == self.die_on_call:
            os.kill(os.getpid(), signal.SIGKILL)
        out = self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.reduce:
            import torch.distributed as dist

            dist.all_reduce(out)
        return out


class Block(nn.Module):
    def __init__(self, d_model, heads, kv_heads, head_dim, ffn_dim):
        super().__init__()
        self.attn_norm = RMSNorm(d_model)
        self.attn = Attention(d_model, heads, kv_heads, head_dim)
        self.mlp_norm = RMSNorm(d_model)
        self.mlp = MLP(d_model, ffn_dim)

    def forward(self, x):
        x = x.to(self.attn_norm.weight.device)  # pipeline stages: the activation follows the block
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TPDecoder(nn.Module):
    def __init__(self, vocab, d_model, layers, heads, kv_heads, head_dim, ffn_dim, impl):
        super().__init__()
        self.impl = impl
        self.embed = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(Block(d_model, heads, kv_heads, head_dim, ffn_dim) for _ in range(layers))
        self.norm = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x.to(self.norm.weight.device)))
        if self.impl == "observed-rank1" and _rank() == 1 and self._forward_hooks:
            logits = logits + 1e-3  # elementwise on rank 1's local shard: no collective, rank 0 unchanged
        return logits


class TPDecoderSubject(Subject):
    name = "tp-decoder"
    impls = ("reference", "fault-rank1", "die-rank1", "observed-rank1")

    def __init__(self, vocab=66, d_model=32, layers=2, heads=4, kv_heads=4, head_dim=8, ffn_dim=64, seq_len=16,
                 batch=2, dtype="fp32", seed=0, split="dtensor", pipeline=False):
        super().__init__(vocab=vocab, d_model=d_model, layers=layers, heads=heads, kv_heads=kv_heads,
                         head_dim=head_dim, ffn_dim=ffn_dim, seq_len=seq_len, batch=batch, dtype=dtype, seed=seed,
                         split=split, pipeline=pipeline)

    def build(self, impl):
        a = self.args
        model = TPDecoder(a["vocab"], a["d_model"], a["layers"], a["heads"], a["kv_heads"], a["head_dim"],
                          a["ffn_dim"], impl)
        return model.to({"fp32": torch.float32, "bf16": torch.bfloat16}[a["dtype"]])

    def make_state(self):
        gen = torch.Generator().manual_seed(self.args["seed"])
        state = {}
        for name, tensor in self.build("reference").state_dict().items():
            noise = torch.randn(tensor.shape, generator=gen)
            value = 1 + 0.1 * noise if name.endswith("norm.weight") else noise / math.sqrt(tensor.shape[-1])
            state[name] = value.to(tensor.dtype)
        return state

    def make_inputs(self):
        gen = torch.Generator().manual_seed(self.args["seed"] + 1)
        return Inputs({"tokens": torch.randint(0, self.args["vocab"], (self.args["batch"], self.args["seq_len"]),
                                               generator=gen)})

    def call(self, module, inputs):
        return module(inputs.tensors["tokens"].to(module.embed.weight.device))

    def place(self, module, device):
        """``pipeline``: two stages in one process, the embedding and the first block on the CPU, the
        rest on ``device`` (on a GPU host: modules on two devices); else all of it on ``device``."""
        if not self.args["pipeline"]:
            return module.to(device)
        module.to(device)
        module.embed.to("cpu")
        module.layers[0].to("cpu")
        return module

    def parallelize(self, module, mesh):
        rank, world = mesh.get_local_rank(), mesh.size()
        plan = None
        if self.args["split"] == "dtensor":
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            plan = {}
            for index in range(len(module.layers)):
                prefix = f"layers.{index}"
                for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                    plan[f"{prefix}.{name}"] = ColwiseParallel()
                plan[f"{prefix}.attn.o_proj"] = RowwiseParallel()
                plan[f"{prefix}.mlp.down_proj"] = RowwiseParallel()
            # The logits stay split over the vocabulary, as a DTensor (its placement travels with it).
            plan["lm_head"] = ColwiseParallel(use_local_output=False)
            parallelize_module(module, mesh, plan)
        else:
            with torch.no_grad():
                for layer in module.layers:
                    mlp = layer.mlp
                    for linear in (mlp.gate_proj, mlp.up_proj):
                        linear.weight = nn.Parameter(torch.chunk(linear.weight, world, dim=0)[rank].clone())
                    mlp.down_proj.weight = nn.Parameter(torch.chunk(mlp.down_proj.weight, world, dim=1)[rank].clone())
                    mlp.reduce = world > 1
        if module.impl == "fault-rank1" and rank == 1:
            with torch.no_grad():
                weight = module.layers[1].mlp.up_proj.weight
                local = weight.to_local() if hasattr(weight, "to_local") else weight
                local.mul_(1.01)
        if module.impl == "die-rank1" and rank == 1:
            module.layers[1].mlp.die_on_call = 2  # the recorded run (the first call is the run without hooks)
        return plan
