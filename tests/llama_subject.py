"""A tiny Llama (random weights, built from a config: no download) as a parity user subject.

``llama_subject:make_subject`` with impls ``sdpa`` (transformers dispatches to
``parity_sdpa``: PyTorch SDPA on the mask) and ``kernel`` (``parity_sparse``: the Triton
block-sparse kernel), both registered by ``parity.integrations.transformers.register()`` and
both doing their math in ``model.layers.N.self_attn.attn_core``. Cases:

- ``padded_left`` / ``padded_right``: a batch of 3 sequences of lengths 20, 13, 7, padded to 20
  (transformers passes a 4-D mask; left-padding query rows see no key);
- ``packed``: 3 sequences of odd lengths 7, 13, 11 in one row, told apart by ``position_ids``
  that restart at 0 (transformers turns them into a document mask);
- ``decode``: a prompt of 12 tokens for a batch of 2 (``padding="left"``: the second one has 8
  real tokens), then 4 single-token steps with a ``DynamicCache``. The step tokens are part of
  the inputs (teacher forcing), so a different argmax on the compare host cannot change what
  is run. Returns the prefill logits and the 4 steps' logits stacked.

``sliding_window > 0`` builds a Mistral (the same module names) whose layers attend to that
many tokens.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from parity.base.errors import UsageError
from parity.integrations import transformers as parity_tf
from parity.run.subjects import Inputs, Subject

CASES = ("padded_left", "padded_right", "packed", "decode")
PAD_LENGTHS = (20, 13, 7)
PACKED_LENGTHS = (7, 13, 11)
PROMPT, STEPS = 12, 4
VOCAB = 128
IMPL_NAMES = {"sdpa": parity_tf.REFERENCE_NAME, "kernel": parity_tf.KERNEL_NAME}


class LlamaSubject(Subject):
    name = "tiny-llama"
    impls = ("sdpa", "kernel")
    reference_impl = "sdpa"

    def __init__(self, case: str = "padded_left", seed: int = 0, dtype: str = "fp32", padding: str = "none",
                 sliding_window: int = 0, layers: int = 2):
        if case not in CASES:
            raise UsageError(f"case must be one of {', '.join(CASES)}, got {case!r}")
        if padding not in ("none", "left"):
            raise UsageError(f"padding must be none or left, got {padding!r}")
        if dtype not in ("fp32", "fp16", "bf16"):
            raise UsageError(f"dtype must be fp32, fp16 or bf16, got {dtype!r}")
        super().__init__(case=case, seed=seed, dtype=dtype, padding=padding, sliding_window=sliding_window,
                         layers=layers)

    @property
    def dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[self.args["dtype"]]

    def config(self, attn_implementation: str | None = None):
        common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=self.args["layers"], num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0,
                      rms_norm_eps=1e-6)
        if self.args["sliding_window"]:
            from transformers import MistralConfig

            config = MistralConfig(sliding_window=self.args["sliding_window"], **common)
        else:
            from transformers import LlamaConfig

            config = LlamaConfig(**common)
        if attn_implementation is not None:
            config._attn_implementation = attn_implementation
        return config

    def _model(self, attn_implementation: str) -> nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(self.config(), attn_implementation=attn_implementation)

    def make_state(self) -> dict[str, torch.Tensor]:
        # Drawn from a seeded CPU generator, not from transformers' initialisation (which uses the
        # global RNG and may change between versions). Linear weights of std 0.15 (about 1.2 /
        # sqrt(hidden)) keep the attention peaked, so a wrong mask shows.
        parity_tf.register()
        gen = torch.Generator().manual_seed(self.args["seed"])
        state = {}
        for name, tensor in self._model(parity_tf.REFERENCE_NAME).state_dict().items():
            noise = torch.randn(tensor.shape, generator=gen)
            state[name] = (1 + 0.05 * noise if "norm" in name else 0.15 * noise).to(self.dtype)
        return state

    def build(self, impl: str) -> nn.Module:
        parity_tf.register()
        model = self._model(IMPL_NAMES[impl]).to(self.dtype).eval()
        parity_tf.attach(model)
        return model

    def make_inputs(self) -> Inputs:
        gen = torch.Generator().manual_seed(self.args["seed"] + 1)
        case = self.args["case"]
        if case == "packed":
            total = sum(PACKED_LENGTHS)
            ids = torch.randint(1, VOCAB, (1, total), generator=gen)
            position_ids = torch.cat([torch.arange(length) for length in PACKED_LENGTHS])[None]
            return Inputs({"input_ids": ids, "position_ids": position_ids}, {"case": case})
        if case == "decode":
            lengths = (PROMPT, PROMPT - 4) if self.args["padding"] == "left" else (PROMPT, PROMPT)
            total = PROMPT + STEPS
            ids = torch.randint(1, VOCAB, (len(lengths), total), generator=gen)
            mask = torch.ones(len(lengths), total, dtype=torch.long)
            for row, length in enumerate(lengths):
                mask[row, :PROMPT - length] = 0
                ids[row, :PROMPT - length] = 0
            return Inputs({"input_ids": ids, "attention_mask": mask}, {"case": case})
        width = max(PAD_LENGTHS)
        ids = torch.randint(1, VOCAB, (len(PAD_LENGTHS), width), generator=gen)
        mask = torch.zeros(len(PAD_LENGTHS), width, dtype=torch.long)
        for row, length in enumerate(PAD_LENGTHS):
            real = slice(width - length, width) if case == "padded_left" else slice(0, length)
            mask[row, real] = 1
        ids = ids * mask
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        return Inputs({"input_ids": ids, "attention_mask": mask, "position_ids": position_ids}, {"case": case})

    def call(self, module: nn.Module, inputs: Inputs):
        tensors = inputs.tensors
        if self.args["case"] != "decode":
            return module(**tensors, use_cache=False).logits
        from transformers import DynamicCache

        ids, mask = tensors["input_ids"], tensors["attention_mask"]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=module.config)
        # transformers 5.2x renamed past_key_values to cache (the old name still works, with a warning)
        cache_arg = "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"
        out = module(input_ids=ids[:, :PROMPT], attention_mask=mask[:, :PROMPT], position_ids=positions[:, :PROMPT],
                     use_cache=True, **{cache_arg: cache})
        prefill = out.logits
        steps = []
        for step in range(STEPS):
            end = PROMPT + step + 1
            out = module(input_ids=ids[:, end - 1:end], attention_mask=mask[:, :end],
                         position_ids=positions[:, end - 1:end], use_cache=True, **{cache_arg: cache})
            steps.append(out.logits[:, -1])
        return {"prefill": prefill, "steps": torch.stack(steps, dim=1)}


def make_subject(**args) -> LlamaSubject:
    return LlamaSubject(**args)
