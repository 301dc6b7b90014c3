"""The transformers integration where inference runs: one kernel layout per forward (not per
layer), ``torch.compile(fullgraph=True)`` of a tiny Llama with no graph break from parity's code
(prefill, a padded batch, decode with a static cache), and ``generate`` with the kernel giving ``sdpa``'s tokens wherever the
reference's top-2 logit margin exceeds the logits' measured difference.

The compiled tests run ``parity_sdpa`` (PyTorch SDPA inside the same integration, pure torch) on
the CPU. ``mode="reduce-overhead"`` (CUDA graphs) is not tested here: a GPU run leaves out modules
that import transformers on hosts without it, and such modules may hold no GPU test.
"""
from __future__ import annotations

import pytest
import torch

import transformers  # noqa: F401  (a test dependency: missing, the file errors, never skips)

from parity.integrations import transformers as parity_tf
from llama_subject import LlamaSubject

@pytest.fixture(autouse=True)
def _registered():
    parity_tf.register()


def _model(impl: str, *, layers: int = 2, sliding_window: int = 0, seed: int = 0):
    from transformers import AutoModelForCausalLM

    subject = LlamaSubject(layers=layers, sliding_window=sliding_window)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(subject.config(), attn_implementation=impl).eval()
    if impl in (parity_tf.KERNEL_NAME, parity_tf.REFERENCE_NAME):
        parity_tf.attach(model)
    return model


def _prompt(batch: int = 2, seq: int = 12, pad: int = 5, seed: int = 1):
    ids = torch.randint(1, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1:, :pad] = 0  # left padding, as batched generation has it
    ids[mask == 0] = 0
    return ids, mask


def _count_layouts(monkeypatch) -> list[str]:
    built: list[str] = []
    original = parity_tf.kernel_layout

    def counting(*args, **kwargs):
        layout = original(*args, **kwargs)
        built.append(layout.kind)
        return layout

    monkeypatch.setattr(parity_tf, "kernel_layout", counting)
    return built


# ---- one layout per forward ---------------------------------------------------------------------
@pytest.mark.slow  # a transformers model, compiled or through the Triton interpreter
def test_one_layout_per_forward_for_every_layer(monkeypatch):
    """Three layers, one layout: a padded prefill (from the 2-D padding mask, in the mask
    function) and each decode step (mask-less) derive their layout once, not once per layer."""
    from transformers import DynamicCache

    model = _model(parity_tf.KERNEL_NAME, layers=3)
    built = _count_layouts(monkeypatch)
    ids, mask = _prompt()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        assert built == ["padding-left"]
        token = out.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        model(input_ids=token, attention_mask=mask, cache=cache, use_cache=True)
    # the decode step: a padded batch still carries a mask (Sq = 1 sees the real keys only)
    assert built == ["padding-left", "padding-left"]
    with torch.no_grad():
        model(input_ids=torch.randint(1, 128, (1, 20)))  # purely causal: no mask, one layout by shape
    assert built == ["padding-left", "padding-left", "causal"]


@pytest.mark.slow  # a transformers model, compiled or through the Triton interpreter
def test_a_mask_edited_in_place_gets_a_new_layout():
    q = torch.randn(1, 2, 20, 16)
    k, v = torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16)
    core = parity_tf.ParityAttention("kernel", block_m=16, block_n=16)
    visible = torch.ones(1, 1, 20, 20, dtype=torch.bool).tril()
    first = core(q, k, v, visible)
    visible[..., :, :3] = False  # the same tensor, other contents
    second = core(q, k, v, visible)
    reference = parity_tf.ParityAttention("reference")(q, k, v, visible)
    torch.testing.assert_close(second, reference, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(first, second)


# ---- torch.compile ------------------------------------------------------------------------------
def _no_breaks(model, *args, **kwargs) -> None:
    explanation = torch._dynamo.explain(model)(*args, **kwargs)
    reasons = [str(reason.reason)[:200] for reason in explanation.break_reasons]
    assert explanation.graph_break_count == 0, reasons
    assert explanation.graph_count == 1


@pytest.mark.slow  # a transformers model, compiled or through the Triton interpreter
@pytest.mark.parametrize("padded", [False, True], ids=["prefill", "padded-batch"])
def test_compiled_forward_has_no_graph_break_and_equals_eager(padded):
    torch._dynamo.reset()
    model = _model(parity_tf.REFERENCE_NAME)
    ids, mask = _prompt()
    kwargs = {"attention_mask": mask} if padded else {}
    with torch.no_grad():
        _no_breaks(model, ids, **kwargs)
        eager = model(ids, **kwargs).logits
        compiled = torch.compile(model, fullgraph=True)(ids, **kwargs).logits
    real = mask.bool() if padded else torch.ones_like(mask, dtype=torch.bool)
    # compiled and eager fp32 differ by the fusion's reduction order only: measured 1.5e-7 (2-core CPU,
    # torch 2.13); 1e-5 still catches a dropped padding mask (differences of order 1)
    torch.testing.assert_close(compiled[real], eager[real], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # a transformers model, compiled or through the Triton interpreter
def test_compiled_static_cache_generate_equals_eager():
    """Decode with a static cache, the forward compiled with fullgraph=True: the same tokens and
    (to the fusion's rounding) the same scores as eager."""
    torch._dynamo.reset()
    model = _model(parity_tf.REFERENCE_NAME)
    ids, mask = _prompt()
    settings = dict(max_new_tokens=6, do_sample=False, cache_implementation="static", pad_token_id=0,
                    output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        eager = model.generate(ids, attention_mask=mask, **settings)
        model.forward = torch.compile(model.forward, fullgraph=True)
        compiled = model.generate(ids, attention_mask=mask, **settings)
    assert torch.equal(compiled.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(compiled.scores), torch.stack(eager.scores), rtol=1e-4, atol=1e-4)


# ---- generate with the kernel -------------------------------------------------------------------
@pytest.mark.slow  # a transformers model, compiled or through the Triton interpreter
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_kernel_generates_sdpas_tokens(cache):
    """Greedy tokens of the kernel (eager, through the interpreter on a CPU) against stock
    ``sdpa``: equal at every step whose top-2 margin in sdpa's scores exceeds the largest score
    difference measured at the steps before it; the test fails if that leaves fewer than all
    steps compared, so a margin too small to judge shows up instead of passing silently."""
    steps = 5
    ids, mask = _prompt()
    settings = dict(max_new_tokens=steps, do_sample=False, pad_token_id=0, output_scores=True,
                    return_dict_in_generate=True)
    if cache == "static":
        settings["cache_implementation"] = "static"
    with torch.no_grad():
        stock = _model("sdpa").generate(ids, attention_mask=mask, **settings)
        ours = _model(parity_tf.KERNEL_NAME).generate(ids, attention_mask=mask, **settings)
    stock_scores, our_scores = torch.stack(stock.scores), torch.stack(ours.scores)  # [steps, B, V]
    top2 = stock_scores.topk(2, dim=-1).values
    margins = top2[..., 0] - top2[..., 1]  # [steps, B]
    compared = 0
    for step in range(steps):
        error = (our_scores[: step + 1] - stock_scores[: step + 1]).abs().max()
        if bool((margins[step] <= error).any()):
            break  # the reference itself cannot tell its top two apart at this precision
        assert torch.equal(ours.sequences[:, ids.shape[1] + step], stock.sequences[:, ids.shape[1] + step]), step
        compared += 1
    # measured (CPU, fp32, interpreter): smallest margin 7.2e-3 against a largest score difference of 1.2e-7
    assert compared == steps, (compared, margins.min().item())
