"""The transformers integration where inference runs: one kernel layout per forward (not per
layer), ``torch.compile(fullgraph=True)`` of a tiny Llama with no graph break from parity's code
(prefill, a padded batch, a sliding window, decode with a static cache) for ``parity_sdpa`` and
for the kernel (``parity_sparse``: its layouts derived inside the graph, ``traceable=True``),
``generate`` with the kernel giving ``sdpa``'s tokens wherever the reference's top-2 logit margin
exceeds the logits' measured difference, and on a GPU ``mode="reduce-overhead"`` (CUDA graphs).

transformers is imported inside the tests, never at the top: the GPU test must be collectable on
a device host without the test extra (bench/h200_run.sh leaves out only the modules that import a
test-only dependency at the top, and those may hold no GPU test). Without it the CPU tests error
(the fixture's import), never skip; the GPU test skips, as the module would be left out there.
"""
from __future__ import annotations

import pytest
import torch

from parity.integrations import transformers as parity_tf
from parity.kernels import layout as layouts
from llama_subject import LlamaSubject

# fp32 logits of the tiny Llama, the kernel against SDPA: measured 2-4e-6 (eager, aot_eager and
# Inductor alike, 2-core CPU, torch 2.13, Triton interpreter); a dropped padding mask or a wrong
# diagonal moves them by 1e-1 and more.
LOGITS_TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(autouse=True)
def _registered(request):
    if request.node.get_closest_marker("gpu"):
        pytest.importorskip("transformers", reason="the GPU host lacks the test extra")
    import transformers  # noqa: F401  (a test dependency: missing, the CPU tests error, never skip)

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


def _count_full_launches(monkeypatch) -> list[int]:
    """One entry per call of the launcher's full path (``attention._launch``: checks, config and
    a launch plan built), from now on."""
    from parity.kernels import attention

    full: list[int] = []
    original = attention._launch

    def counting(*args, **kwargs):
        full.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(attention, "_launch", counting)
    return full


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


@pytest.mark.slow  # a transformers model through the Triton interpreter
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_one_full_launch_per_forward_also_under_inference_mode(monkeypatch, mode):
    """Every layer after a forward's first issues the launch plan the first one built, and a
    decode step whose layout keeps its tiles the plan of the step before (its layout moved over
    the same tensors, its key length and diagonal taken per call): the launcher's full path runs
    for the prefill and the first decode step only, also under torch.inference_mode, whose
    tensors have no version counter for the plan to check."""
    model = _model(parity_tf.KERNEL_NAME, layers=4)
    full = _count_full_launches(monkeypatch)
    # the integration's memory of earlier tests' decode layouts (kept across forwards) left out
    monkeypatch.setattr(parity_tf, "_PLANS", parity_tf._Plans())
    ids, mask = _prompt(pad=0)
    with torch.inference_mode() if mode == "inference_mode" else torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                       pad_token_id=0)
    # 4 forwards of 4 layers each: the prefill (12 keys) and the first step (13) build their
    # plans; the steps at 14 and 15 keys stay in the same key block and specialization classes
    assert len(full) == 2


@pytest.mark.slow  # a transformers model through the Triton interpreter
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("case", ["window", "padded"])
def test_a_forward_with_a_mask_builds_one_layout_and_plan_also_under_inference_mode(monkeypatch, mode, case):
    """A forward whose layers get a 4-D mask (a sliding window; a left-padded batch) classifies
    it once and builds one launch plan, not one per layer, also under torch.inference_mode: the
    kernel's mask function makes the mask an ordinary tensor, with the version counter a layout
    kept for it needs (an inference tensor has none, and each layer would classify the mask and
    plan its launch again). A window decode step whose cache keeps the window's keys is the last
    step's layout again: no build, no plan. The tokens are those of the run under torch.no_grad."""
    window = 8
    model = _model(parity_tf.KERNEL_NAME, layers=4, sliding_window=window if case == "window" else 0)
    built, full = _count_layouts(monkeypatch), _count_full_launches(monkeypatch)
    monkeypatch.setattr(parity_tf, "_PLANS", parity_tf._Plans())
    ids, mask = _prompt(batch=1 if case == "window" else 2, pad=0 if case == "window" else 5)
    tokens, counts = {}, {}
    for run in ("no_grad", mode):
        built.clear()
        full.clear()
        with torch.inference_mode() if run == "inference_mode" else torch.no_grad():
            tokens[run] = model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4,
                                         do_sample=False, pad_token_id=0)
        counts[run] = (list(built), len(full))
        monkeypatch.setattr(parity_tf, "_PLANS", parity_tf._Plans())  # the next run starts afresh
    assert torch.equal(tokens["no_grad"], tokens[mode])
    if case == "window":
        # the prefill's window layout (12 x 12) and the first decode step's (1 x 8: the cache
        # keeps the window's 8 keys), each with its plan; the next steps have the same 8 keys and
        # diagonal: the first step's layout and plan again
        assert counts[mode] == (["window8", "window8"], 2)
    else:
        # each forward's padding layout, made by the mask function (4 forwards), never in a layer,
        # and one plan per forward (each step's padding layout is new)
        assert counts[mode] == (["padding-left"] * 4, 4)
    assert counts[mode] == counts["no_grad"]


@pytest.mark.slow  # a transformers model through the Triton interpreter
def test_window_decode_steps_on_moved_layouts_give_sdpa_logits(monkeypatch):
    """A prompt shorter than the window: each decode step has one key more and its diagonal one
    further, so the mask function moves the last step's window layout (``layout.with_keys``, a
    new layout over the same tensors) wherever its tiles stay, and builds one where a key block
    starts. Every step's logits are SDPA's on the same weights and masks (a moved layout that kept
    a stale diagonal or key length would hide or show a key: logits off by 1e-1 and more), under
    torch.inference_mode, for a batch of two."""
    from parity.kernels import layout as layouts_module

    window = 24  # the cache keeps every key: 6 prompt tokens + 16 steps stay inside the window
    moved: list[bool] = []
    original = layouts_module.with_keys

    def counting(layout, seq_k, offset):
        out = original(layout, seq_k, offset)
        moved.append(out is not None and out is not layout)
        return out

    monkeypatch.setattr(layouts_module, "with_keys", counting)
    monkeypatch.setattr(parity_tf, "_PLANS", parity_tf._Plans())
    ids, mask = _prompt(batch=2, seq=6, pad=0)
    logits = {}
    for impl in (parity_tf.KERNEL_NAME, parity_tf.REFERENCE_NAME):
        model = _model(impl, layers=2, sliding_window=window)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        logits[impl] = torch.stack(out.logits)
    # 15 decode steps (7 to 21 keys, all inside the first of the integration's 64-key blocks):
    # the first builds its layout, the other 14 move it
    assert sum(moved) == 14
    torch.testing.assert_close(logits[parity_tf.KERNEL_NAME], logits[parity_tf.REFERENCE_NAME], **LOGITS_TOL)


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


# ---- traceable layouts: the same elements as the eager builders, static shapes ------------------


def _dense_cases():
    gen = torch.Generator().manual_seed(0)
    random = torch.rand(2, 1, 37, 70, generator=gen) < 0.4
    padded = torch.ones(3, 1, 20, 20, dtype=torch.bool).tril()
    padded[1, ..., :7] = False  # left padding
    padded[2, ..., 13:] = False  # right padding
    decode = torch.zeros(2, 1, 1, 96, dtype=torch.bool)  # a static cache: 40 and 25 keys filled of 96
    decode[0, ..., :40] = True
    decode[1, ..., 15:40] = True
    return {"random": random, "padded": padded, "decode-static-cache": decode}


@pytest.mark.parametrize("case", ["random", "padded", "decode-static-cache"])
def test_a_traceable_dense_layout_shows_the_mask_with_static_shapes(case):
    mask = _dense_cases()[case]
    batch, _, seq_q, seq_k = mask.shape
    layout = layouts.layout_from_dense_mask(mask, block_m=16, block_n=16, traceable=True).validate()
    assert torch.equal(layout.element_visible().expand_as(mask), mask)
    nq, nk = -(-seq_q // 16), -(-seq_k // 16)
    # shapes from the mask's alone: the batch kept, index lists nK wide, the bits always there
    assert tuple(layout.kv_indices.shape) == tuple(layout.full_kv_indices.shape) == (batch, 1, nq, nk)
    assert tuple(layout.mask_bits.shape) == (batch, 1, seq_q, -(-seq_k // 32))
    eager = layouts.layout_from_dense_mask(mask, block_m=16, block_n=16)
    assert torch.equal(layout.block_classes(), eager.block_classes().expand_as(layout.block_classes()))


@pytest.mark.parametrize("seq_q, seq_k, window", [(48, 48, 0), (1, 70, 0), (5, 77, 0), (40, 56, 20), (1, 96, 33)])
def test_traceable_formula_layouts_equal_the_eager_ones_but_for_the_index_width(seq_q, seq_k, window):
    def build(**traceable):
        if window:
            return layouts.sliding_window_layout(seq_q, seq_k, window, block_m=16, block_n=16, **traceable)
        return layouts.causal_layout(seq_q, seq_k, block_m=16, block_n=16, **traceable)

    traced, eager = build(traceable=True).validate(), build()
    assert traced.kv_indices.shape[-1] == traced.full_kv_indices.shape[-1] == -(-seq_k // 16)
    assert traced.mask == eager.mask
    assert torch.equal(traced.block_classes(), eager.block_classes())
    for count, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        assert torch.equal(getattr(traced, count), getattr(eager, count))
        width = getattr(eager, indices).shape[-1]
        assert torch.equal(getattr(traced, indices)[..., :width], getattr(eager, indices))
        assert not getattr(traced, indices)[..., width:].any()  # slots past every count stay 0


def test_traceable_dense_layout_compiles_fullgraph_on_the_cpu():
    mask = _dense_cases()["padded"]
    build = torch.compile(lambda m: layouts.layout_from_dense_mask(m, block_m=16, block_n=16, traceable=True),
                          fullgraph=True, backend="aot_eager")
    compiled, eager = build(mask), layouts.layout_from_dense_mask(mask, block_m=16, block_n=16, traceable=True)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "mask_bits"):
        assert torch.equal(getattr(compiled, name), getattr(eager, name)), name


# ---- the tiny Llama, compiled ------------------------------------------------------------------

# name -> (LlamaSubject arguments, whether the inputs keep their attention mask)
PREFILL = {
    "padded_left": ({"case": "padded_left"}, True),
    "padded_right": ({"case": "padded_right"}, True),
    "no_mask": ({"case": "padded_left"}, False),  # transformers passes None: the causal formula
    "window_padded_left": ({"case": "padded_left", "sliding_window": 6}, True),
}


def _models(**args):
    """(subject, kernel model, parity_sdpa model), the same random weights."""
    subject = LlamaSubject(**args)
    state = subject.make_state()
    kernel, reference = subject.build("kernel"), subject.build("sdpa")
    kernel.load_state_dict(state)
    reference.load_state_dict(state)
    return subject, kernel, reference


def _prefill_inputs(subject, keep_mask: bool) -> dict:
    tensors = dict(subject.make_inputs().tensors)
    if not keep_mask:  # every row real: no padding, no mask
        tensors = {"input_ids": tensors["input_ids"].clamp(min=1)}
    return {**tensors, "use_cache": False}


def _traced_layouts_in_eager(monkeypatch):
    """Make the eager path use the layouts a graph derives, for a bit-for-bit comparison."""
    def plan(mask, visible, documents, seq_q, seq_k, is_causal, window, block_m, block_n, device):
        return parity_tf._traced_layout(visible, documents, seq_q, seq_k, is_causal, window, device,
                                        block_m=block_m, block_n=block_n)

    monkeypatch.setattr(parity_tf, "_plan", plan)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(PREFILL))
def test_prefill_compiles_fullgraph_and_equals_eager(case, monkeypatch):
    """No graph break anywhere in the forward (explain), and the compiled logits equal the eager
    ones bit for bit, both with the eager path's remembered layouts and with the layouts the
    graph derives (aot_eager runs the same ATen ops, and the kernel shows the same elements);
    both hold parity with SDPA."""
    args, keep_mask = PREFILL[case]
    subject, kernel, reference = _models(**args)
    inputs = _prefill_inputs(subject, keep_mask)
    with torch.no_grad():
        explained = torch._dynamo.explain(kernel)(**inputs)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        torch._dynamo.reset()
        compiled = torch.compile(kernel, fullgraph=True, backend="aot_eager", dynamic=False)(**inputs).logits
        eager = kernel(**inputs).logits
        want = reference(**inputs).logits
        _traced_layouts_in_eager(monkeypatch)
        eager_traced = kernel(**inputs).logits
    assert torch.equal(compiled, eager_traced)
    assert torch.equal(compiled, eager)
    torch.testing.assert_close(compiled, want, **LOGITS_TOL)


@pytest.mark.slow
def test_the_graph_builds_no_layout_object(monkeypatch):
    """Under torch.compile the forward's graph holds tensors and the operator only: no
    BlockLayout or MaskSpec is constructed while tracing (torch 2.11's Dynamo cannot build those
    dataclasses inside a graph: 'Unexpected type in sourceless builder ... MaskSpec')."""
    built: list[str] = []
    for cls in (layouts.BlockLayout, layouts.MaskSpec):
        original = cls.__post_init__

        def counting(self, original=original, name=cls.__name__):
            if torch.compiler.is_compiling():
                built.append(name)
            return original(self)

        monkeypatch.setattr(cls, "__post_init__", counting)
    subject, kernel, _ = _models(case="padded_left")
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(kernel, fullgraph=True, backend="aot_eager", dynamic=False)(**_prefill_inputs(subject, True))
        torch.compile(kernel, fullgraph=True, backend="aot_eager", dynamic=False)(
            **_prefill_inputs(subject, False))  # mask-less: the causal mask made from the shapes
    assert built == []


@pytest.mark.slow
def test_prefill_compiles_with_inductor_on_the_cpu():
    """Inductor compiles the layout derivation around the opaque operator (its CPU code
    generator included); its own fusions of the rest of the model move the logits by a few ulps."""
    subject, kernel, reference = _models(case="padded_left")
    inputs = _prefill_inputs(subject, True)
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(kernel, fullgraph=True, dynamic=False)(**inputs).logits
        eager, want = kernel(**inputs).logits, reference(**inputs).logits
    torch.testing.assert_close(compiled, eager, **LOGITS_TOL)
    torch.testing.assert_close(compiled, want, **LOGITS_TOL)


def _generate(model, subject, **extra):
    tensors = subject.make_inputs().tensors
    prompt = slice(0, 12)  # llama_subject.PROMPT: the second row left-padded by 4
    return model.generate(input_ids=tensors["input_ids"][:, prompt], attention_mask=tensors["attention_mask"][:, prompt],
                          max_new_tokens=4, do_sample=False, cache_implementation="static", pad_token_id=0,
                          return_dict_in_generate=True, output_logits=True, **extra)


@pytest.mark.slow
def test_static_cache_generate_with_the_forward_compiled_fullgraph():
    """generate with a static cache, the forward compiled with fullgraph=True: one graph for the
    prefill and one for every decode step (Sq = 1 over the cache's 16 slots, the unfilled ones
    hidden by the mask, the cache position a tensor), the same tokens and bit-equal logits as
    eager generate with the kernel, parity with SDPA at every step."""
    from torch._dynamo.testing import CompileCounterWithBackend

    subject, kernel, reference = _models(case="decode", padding="left")
    with torch.no_grad():
        want = _generate(reference, subject)
        eager = _generate(kernel, subject)
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        kernel.forward = torch.compile(kernel.forward, fullgraph=True, backend=counter, dynamic=False)
        got = _generate(kernel, subject)
    assert counter.frame_count == 2, f"{counter.frame_count} graphs: a decode step recompiled"
    assert torch.equal(got.sequences, eager.sequences)
    assert torch.equal(got.sequences, want.sequences)
    for step, (compiled_logits, eager_logits, sdpa_logits) in enumerate(zip(got.logits, eager.logits, want.logits)):
        assert torch.equal(compiled_logits, eager_logits), f"step {step}"
        torch.testing.assert_close(compiled_logits, sdpa_logits, **LOGITS_TOL)


@pytest.mark.gpu
def test_gpu_reduce_overhead_static_cache_generate():
    """generate with a static cache compiling its decode step itself (``compile_config``:
    torch.compile(fullgraph=True, mode="reduce-overhead"), CUDA graphs around the whole forward,
    the layout derivation and the operator included, with the step marking that CUDA-graph trees
    need between calls, which a hand-compiled forward lacks): the tokens and logits of eager
    generate."""
    from transformers.generation.configuration_utils import CompileConfig

    subject, kernel, reference = _models(case="decode", padding="left")
    kernel, reference = kernel.cuda(), reference.cuda()

    def on_gpu(model, compiled: bool):
        tensors = {name: tensor.cuda() for name, tensor in subject.make_inputs().tensors.items()}
        how = {"compile_config": CompileConfig(fullgraph=True)} if compiled else {"disable_compile": True}
        return model.generate(input_ids=tensors["input_ids"][:, :12], attention_mask=tensors["attention_mask"][:, :12],
                              max_new_tokens=4, do_sample=False, cache_implementation="static", pad_token_id=0,
                              return_dict_in_generate=True, output_logits=True, **how)

    with torch.no_grad():
        want, eager = on_gpu(reference, False), on_gpu(kernel, False)
        torch._dynamo.reset()
        on_gpu(kernel, True)  # warm-up: CUDA-graph trees record on a later call
        got = on_gpu(kernel, True)
    assert torch.equal(got.sequences, eager.sequences)
    for compiled_logits, eager_logits, sdpa_logits in zip(got.logits, eager.logits, want.logits):
        torch.testing.assert_close(compiled_logits, eager_logits, **LOGITS_TOL)
        torch.testing.assert_close(compiled_logits, sdpa_logits, **LOGITS_TOL)
