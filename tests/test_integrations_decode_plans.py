"""A decode loop through the transformers integration keeps its launch plan across steps.

Each decode step's key length grows by one, so its layout and its launch plan used to be made anew
in every step's first layer. The integration now keeps a step's layout tensors while their tiles
stay (``kernels.layout.with_keys``) and the decode plan takes the key length, the causal offset and
K/V's batch and head strides from each call (``decode.SCALARS``, keyed by specialization class).
A plan that froze one of them would give wrong numbers silently, so every step's logits are
compared here with the same model's through the JIT path (launch cache off: Triton dispatches
every call from freshly built arguments; under the interpreter the cached path runs the kernel
from the plan's bound arguments, so the two differ exactly where a frozen argument would) and
with SDPA on the same mask, and the cache's counters must show misses per tile boundary, not per
step.

transformers is imported inside the tests (a test dependency; missing, they error, never skip).
"""
from __future__ import annotations

import pytest
import torch

from parity.integrations import transformers as parity_tf
from parity.kernels import attention
from llama_subject import LlamaSubject

# The layout's blocks: a key block fills every 16 steps. 28 steps (keys 6..33) cross two block
# boundaries, each both ways (a block fills at 16 and 32 keys, one starts at 17 and 33): the second
# crossing is a kept layout moved again after a rebuild, all a third would check too, at 60% of the
# interpreter time of 45 steps (the work grows about linearly with the steps).
BLOCK = 16
STEPS = 28
PROMPT = 5
# fp32 logits of the tiny Llama, the kernel against SDPA: measured 2-4e-6 (tests/
# test_integrations_compile.py's LOGITS_TOL); a frozen key length or diagonal drops or adds a
# key, which moves them by 1e-2 and more.
LOGITS_TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture
def small_blocks():
    import transformers  # noqa: F401  (a test dependency: missing, the tests error, never skip)

    parity_tf.register(block_m=BLOCK, block_n=BLOCK)
    yield
    parity_tf.register()  # the default blocks, as every other test registers them


def _model(impl: str):
    from transformers import AutoModelForCausalLM

    subject = LlamaSubject(layers=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(subject.config(), attn_implementation=impl).eval()
    parity_tf.attach(model)
    return model


def _decode(model, tokens: torch.Tensor) -> list[torch.Tensor]:
    """The logits of a prefill of PROMPT tokens and then one forward per further token (teacher
    forced, a DynamicCache: K/V concatenated anew each step), no padding (mask-less steps)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = []
    with torch.no_grad():
        out = model(input_ids=tokens[:, :PROMPT], cache=cache, use_cache=True)
        logits.append(out.logits)
        for step in range(PROMPT, tokens.shape[1]):
            out = model(input_ids=tokens[:, step:step + 1], cache=cache, use_cache=True)
            logits.append(out.logits)
    return logits


@pytest.mark.slow  # 28 decode steps of a transformers model, three times, through the Triton interpreter
def test_a_decode_loop_keeps_its_plan_and_every_step_matches(small_blocks, monkeypatch):
    tokens = torch.randint(1, 128, (2, PROMPT + STEPS), generator=torch.Generator().manual_seed(3))
    built = []
    original = parity_tf.kernel_layout

    def counting(*args, **kwargs):
        built.append(args[1])  # the key length of each layout the integration builds
        return original(*args, **kwargs)

    monkeypatch.setattr(parity_tf, "kernel_layout", counting)
    cache = attention._launch_cache("decode")
    hits, misses = cache.hits, cache.misses
    planned = _decode(_model(parity_tf.KERNEL_NAME), tokens)
    hits, misses = cache.hits - hits, cache.misses - misses
    decode_builds = [seq_k for seq_k in built if seq_k > PROMPT]

    monkeypatch.setattr(attention, "LAUNCH_CACHE_DEFAULT", False)
    dispatched = _decode(_model(parity_tf.KERNEL_NAME), tokens)
    monkeypatch.setattr(attention, "LAUNCH_CACHE_DEFAULT", True)
    reference = _decode(_model(parity_tf.REFERENCE_NAME), tokens)

    for step, (mine, jit, ref) in enumerate(zip(planned, dispatched, reference)):
        assert torch.equal(mine, jit), f"step {step}: the planned launch differs from Triton's dispatch"
        torch.testing.assert_close(mine, ref, **LOGITS_TOL, msg=lambda m, step=step: f"step {step}: {m}")

    # 28 steps from 6 to 33 keys: the first step's layout (the prefill's has 5 query rows), then
    # the tiles change where a key block fills (16, 32 keys) and where one starts (17, 33): five
    # layouts built, not 28
    assert decode_builds == [6, 16, 17, 32, 33]
    # every call of both layers went through the decode plans (the 5-row prefill, one query block,
    # takes the decode path too)
    assert hits + misses == (STEPS + 1) * 2
    # a miss per new layout, and per new specialization class of the key length or the offset on
    # it (a multiple of 16, or 1): at most two per layout; one per step would be 28
    assert misses <= 2 * len(decode_builds), (hits, misses)
    print(f"decode calls: {hits} hits, {misses} misses")
