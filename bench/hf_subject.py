"""A Hugging Face causal LM built from a config as a parity subject: one prefill forward, timed by ``parity bench``.

``bench.hf_subject:make_subject`` builds a Llama (or Mistral) from a config with random weights
(no download) and runs one forward over a prompt of ``batch`` x ``seq`` random token ids,
without a cache, returning the logits of every position. Its implementations are attention
implementations of transformers, all on the same weights:

- ``sdpa``: transformers' own SDPA attention (the reference);
- ``parity_sdpa``: PyTorch SDPA on the mask, inside parity's integration
  (:mod:`parity.integrations.transformers`);
- ``parity_sparse``: the Triton block-sparse kernel through the same integration.

Sizes (``size``): ``tiny`` (2 layers, hidden 128, for the CPU and the Triton interpreter) and the
shapes of :data:`bench.hf_generate.MODELS`: ``llama8b`` (Llama-3-8B's: 32 layers, hidden 4096, 32
heads, 8 K/V heads, MLP 14336, vocabulary 128256) and ``mistral7b`` (a 4096-token sliding
window). ``layers`` overrides the size's layer count (a quick check of a big shape).

Weights: the module's own initialisation (transformers' ``initializer_range``), drawn on the device
it is built on from ``seed`` (``build`` takes ``device``), with the caller's random state left as
it was. There is no ``make_state``: drawing 8 billion weights on the host would take longer than
the benchmark, so ``parity bench`` gives every implementation the first build's weights and
``parity capture`` stores them (``--weights`` of a bundle, as for any subject without
``make_state``)::

    python -m parity bench --subject bench.hf_subject:make_subject --impls sdpa,parity_sdpa,parity_sparse \\
        --device cuda --set size=llama8b --set seq=4096 --warmup 2 --reps 5 --module 'model.layers.*.self_attn'
    python -m parity bench --subject bench.hf_subject:make_subject --impls sdpa,parity_sdpa,parity_sparse \\
        --set size=tiny --set seq=64 --set dtype=fp32 --reps 3     # CPU: the kernel interpreted

Needs transformers (``pip install -e '.[transformers]'``).
"""
from __future__ import annotations

import torch
from torch import nn

from bench.hf_generate import MODELS
from parity.base.errors import UsageError
from parity.integrations import transformers as parity_tf
from parity.run.subjects import Inputs, Subject

# A Llama small enough for the Triton interpreter: head dim 32 (the kernel's tiles need >= 16),
# GQA 4:2 as the big shapes have 32:8.
TINY = dict(family="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
            rope_theta=10000.0)
SIZES = {"tiny": TINY, **MODELS}
IMPLS = ("sdpa", parity_tf.REFERENCE_NAME, parity_tf.KERNEL_NAME)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class HFSubject(Subject):
    name = "hf-prefill"
    impls = IMPLS
    reference_impl = "sdpa"

    def __init__(self, size: str = "llama8b", seq: int = 4096, batch: int = 1, dtype: str = "bf16", seed: int = 0,
                 layers: int = 0):
        if size not in SIZES:
            raise UsageError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
        if dtype not in DTYPES:
            raise UsageError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        for key, value, least in (("seq", seq, 1), ("batch", batch, 1), ("seed", seed, 0), ("layers", layers, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise UsageError(f"{key} must be an integer >= {least}, got {value!r}")
        limit = SIZES[size]["max_position_embeddings"]
        if seq > limit:
            raise UsageError(f"seq must be at most {limit} for size {size} (its max_position_embeddings), got {seq}")
        super().__init__(size=size, seq=seq, batch=batch, dtype=dtype, seed=seed, layers=layers)

    def config(self):
        from transformers import LlamaConfig, MistralConfig

        spec = dict(SIZES[self.args["size"]])
        family = spec.pop("family")
        if self.args["layers"]:
            spec["num_hidden_layers"] = self.args["layers"]
        return (LlamaConfig if family == "llama" else MistralConfig)(**spec, pad_token_id=0)

    def build(self, impl: str, device: torch.device | str = "cpu") -> nn.Module:
        from transformers import AutoModelForCausalLM

        parity_tf.register()  # parity_sdpa and parity_sparse, known to transformers from here on
        device = torch.device(device)
        # Seeded where the weights are drawn, without moving the caller's random state: two builds
        # on one device give the same weights, whatever ran between them.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(self.args["seed"])
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(self.config(), attn_implementation=impl,
                                                         dtype=DTYPES[self.args["dtype"]])
        if impl != "sdpa":
            parity_tf.attach(model)  # model.layers.N.self_attn.attn_core, where both parity impls compute
        return model.eval()

    def make_inputs(self) -> Inputs:
        gen = torch.Generator().manual_seed(self.args["seed"] + 1)
        vocab = SIZES[self.args["size"]]["vocab_size"]
        ids = torch.randint(1, vocab, (self.args["batch"], self.args["seq"]), generator=gen)
        return Inputs({"input_ids": ids})

    def call(self, module: nn.Module, inputs: Inputs) -> torch.Tensor:
        # A prefill without a KV cache: no padding, so transformers hands the attention function no
        # mask (pure causal) and every implementation sees the same causal call.
        return module(input_ids=inputs.tensors["input_ids"], use_cache=False).logits


def make_subject(**args) -> HFSubject:
    return HFSubject(**args)
