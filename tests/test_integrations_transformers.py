"""The transformers integration (parity.integrations.transformers): the kernel registered as an
``attn_implementation``, checked on a tiny random-weight Llama (tests/llama_subject.py).

Each case is captured with ``parity_sdpa`` (fp64 references, recorded inputs) and compared with
the kernel (``parity_sparse``, through the Triton interpreter on a CPU) with ``--isolate``:
parity must hold on every recorded tensor, the attention call must be recorded and replayable
as ``model.layers.N.self_attn.attn_core``, and a deliberately broken kernel path must fail
with that module named as the introducing layer. Skipped where transformers is not installed
(``make test`` installs it through the ``test`` extra).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import transformers  # a test dependency (pyproject's test extra): missing, the file errors, never skips

from parity.run.capture import capture  # noqa: E402
from parity.judge.compare import compare_bundle  # noqa: E402
from parity.base.errors import SubjectError  # noqa: E402
from parity.integrations import transformers as parity_tf  # noqa: E402
from parity.run.subjects import load_subject, trusting  # noqa: E402

SPEC = "llama_subject:make_subject"
CASES = {
    "padded_left": {"case": "padded_left"},
    "padded_right": {"case": "padded_right"},
    "packed": {"case": "packed"},
    "decode": {"case": "decode"},
    "decode_left_padded": {"case": "decode", "padding": "left"},
    "window_padded_left": {"case": "padded_left", "sliding_window": 6},
    "window_packed": {"case": "packed", "sliding_window": 5},
    # no padding: the sliding-window mask becomes the window's predicate layout (no element bits)
    "window_decode": {"case": "decode", "sliding_window": 5},
    "bf16_padded_left": {"case": "padded_left", "dtype": "bf16"},
}
# The kernel's layout per case (kernel_layout), so a test notices if a case stops exercising
# the path it was written for.
LAYOUT_KINDS = {
    "padded_left": {"padding-left"},
    "padded_right": {"padding-right"},
    "packed": {"document"},
    "decode": {"causal"},
    "decode_left_padded": {"padding-left"},
    "window_padded_left": {"densemask"},
    "window_packed": {"densemask"},
    "window_decode": {"window5"},
    "bf16_padded_left": {"padding-left"},
}


@pytest.fixture(autouse=True)
def _trusted():
    parity_tf.register()
    with trusting(SPEC):
        yield


@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    """Golden bundles captured with parity_sdpa on this host's device, one per case, made on first use."""
    from parity.run import platform

    root = tmp_path_factory.mktemp("llama-goldens")
    made: dict[str, str] = {}

    def golden(case: str) -> str:
        if case not in made:
            out = root / case
            capture(SPEC, out, subject_args=CASES[case], impl="sdpa", device=platform.default_device(),
                    record_inputs=True, reference="fp64")
            made[case] = str(out)
        return made[case]

    return golden


def _layout_kinds(monkeypatch) -> list[str]:
    kinds: list[str] = []
    original = parity_tf.kernel_layout

    def recording(*args, **kwargs):
        layout = original(*args, **kwargs)
        kinds.append(layout.kind)
        return layout

    monkeypatch.setattr(parity_tf, "kernel_layout", recording)
    return kinds


# ---- parity on a tiny Llama: every layer, every case --------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_holds_parity_with_sdpa_on_every_layer(case, goldens, monkeypatch, device):
    kinds = _layout_kinds(monkeypatch)
    report = compare_bundle(goldens(case), impl="kernel", device=device, isolate=True)
    failing = [(r.name, r.status, r.verdict.reasons) for r in report.layers if not r.passed]
    assert report.passed, failing
    assert set(kinds) == LAYOUT_KINDS[case]
    cores = [r for r in report.layers if ".self_attn.attn_core" in r.name]
    calls = 5 if CASES[case]["case"] == "decode" else 1  # prefill + 4 steps
    assert len(cores) == 2 * calls
    assert {r.name for r in cores} >= {"model.layers.0.self_attn.attn_core", "model.layers.1.self_attn.attn_core"}
    for result in cores:
        assert result.rule == "budget" and result.budget is not None, result.name
        # replayed alone on its golden inputs with the kernel, and still within tolerance
        assert result.isolated is not None and result.isolated.status == "pass", result.name
    assert report.introducing_layers == []
    assert report.layers[-1].name.startswith("<root>")


def test_decode_records_one_attention_call_per_step(goldens):
    from parity.bundle.reader import open_bundle

    bundle = open_bundle(goldens("decode"))
    names = [layer["name"] for layer in bundle.layers() if layer["module"] == "model.layers.0.self_attn.attn_core"]
    assert names == ["model.layers.0.self_attn.attn_core"] + [f"model.layers.0.self_attn.attn_core#{i}"
                                                              for i in range(1, 5)]
    # the decode steps' calls see one query and the whole cache: 12 + step keys
    for step, name in enumerate(names[1:], start=1):
        inputs = bundle.module_inputs(name)
        assert inputs["args/0"].shape[2] == 1 and inputs["args/1"].shape[2] == 12 + step


# ---- a broken kernel path is caught, and attention is named ---------------------------------------


def _broken_layout(monkeypatch, *, align=None, drop_mask=False):
    original = parity_tf.kernel_layout

    def broken(seq_q, seq_k, *, visible=None, documents=None, **kwargs):
        if drop_mask:
            visible = None
        if align and visible is None and documents is None:
            from parity.kernels import layout as layouts

            return layouts.causal_layout(seq_q, seq_k, align=align, block_m=kwargs["block_m"],
                                         block_n=kwargs["block_n"])
        return original(seq_q, seq_k, visible=visible, documents=documents, **kwargs)

    monkeypatch.setattr(parity_tf, "kernel_layout", broken)
    # decode layouts are kept across forwards (moved to the next key length, also back to a
    # shorter one in the next run): every step's layout from the broken builder instead
    monkeypatch.setattr(parity_tf._Plans, "for_next_keys", lambda self, key, seq_k, offset: None)


def test_top_left_causal_on_decode_fails_and_isolate_names_attention(goldens, monkeypatch, device):
    _broken_layout(monkeypatch, align="top_left")
    report = compare_bundle(goldens("decode"), impl="kernel", device=device, isolate=True)
    assert not report.passed
    # the prefill (Sq == Sk) is unaffected; the first decode step is where it goes wrong
    assert report.first_failing_layer == "model.layers.0.self_attn.attn_core#1"
    introduced = report.introducing_layers
    assert introduced and all(".self_attn.attn_core#" in name for name in introduced), introduced
    assert "model.layers.0.self_attn.attn_core#1" in introduced


def test_ignoring_the_padding_mask_fails_and_isolate_names_attention(goldens, monkeypatch, device):
    _broken_layout(monkeypatch, drop_mask=True)
    report = compare_bundle(goldens("padded_left"), impl="kernel", device=device, isolate=True)
    assert not report.passed
    assert report.first_failing_layer == "model.layers.0.self_attn.attn_core"
    assert report.introducing_layers == ["model.layers.0.self_attn.attn_core", "model.layers.1.self_attn.attn_core"]
    failing = {r.name for r in report.layers if not r.passed}
    assert "model.layers.0.self_attn.q_proj" not in failing  # upstream of attention: untouched


# ---- the SDPA side is transformers' own sdpa, up to the empty-row convention ----------------------


@pytest.mark.parametrize("case", ["padded_left", "padded_right", "packed", "decode_left_padded", "window_packed"])
def test_parity_sdpa_matches_transformers_sdpa(case):
    """The golden side is what transformers' stock ``sdpa`` computes, wherever a query sees a key
    (padding query rows of left-padded batches are 0 here by the kernel's convention)."""
    runner = load_subject(SPEC, CASES[case])
    state, inputs = runner.make_state(), runner.make_inputs()
    ours = runner.run(runner.build("sdpa", state=state), inputs)
    stock_model = runner.subject._model("sdpa")
    stock_model.load_state_dict(state)
    stock = runner.run(stock_model.eval(), inputs)
    if isinstance(ours, dict):
        ours, stock = torch.cat([ours["prefill"], ours["steps"]], 1), torch.cat([stock["prefill"], stock["steps"]], 1)
    real = inputs.tensors.get("attention_mask")
    if real is not None:  # [B, S]; for decode the prefill's and the steps' logits are [B, 12 + 4]
        ours, stock = ours[real.bool()], stock[real.bool()]
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-5)


# ---- the attention module alone -----------------------------------------------------------------


def _qkv(batch=1, heads_q=4, heads_kv=2, seq_q=20, seq_k=20, dim=16, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads_q, seq_q, dim, generator=gen)
    k = torch.randn(batch, heads_kv, seq_k, dim, generator=gen)
    v = torch.randn(batch, heads_kv, seq_k, dim, generator=gen)
    return q.to(device), k.to(device), v.to(device)


def _dense(q, k, v, visible):
    """Plain fp64 attention on the CPU on a [B|1, 1, Sq, Sk] visibility; rows without keys 0."""
    q, k, v, visible = q.cpu().double(), k.cpu().double(), v.cpu().double(), visible.cpu()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return (probs @ v).transpose(1, 2)


@pytest.mark.parametrize("impl", parity_tf.IMPLS)
def test_no_mask_is_bottom_right_causal_for_a_chunk_against_a_cache(impl, device):
    q, k, v = _qkv(seq_q=5, seq_k=21, device=device)
    out = parity_tf.ParityAttention(impl, block_m=16, block_n=16)(q, k, v, None)
    visible = torch.arange(21)[None, :] <= torch.arange(5)[:, None] + 16
    torch.testing.assert_close(out.cpu().double(), _dense(q, k, v, visible), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", parity_tf.IMPLS)
def test_cu_seq_lens_without_a_mask_are_documents(impl, device):
    q, k, v = _qkv(seq_q=31, seq_k=31, device=device)
    cu = torch.tensor([0, 7, 20, 31], dtype=torch.int32, device=device)
    out = parity_tf.ParityAttention(impl, block_m=16, block_n=16)(q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):  # each document on its own
        n = end - start
        causal = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
        expected = _dense(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], causal)
        torch.testing.assert_close(out[:, start:end].cpu().double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", parity_tf.IMPLS)
def test_additive_masks_and_empty_rows(impl, device):
    q, k, v = _qkv(batch=2, seq_q=12, seq_k=12, device=device)
    visible = torch.ones(2, 1, 12, 12, dtype=torch.bool, device=device).tril()
    visible[1, :, :, :5] = False  # left padding of 5: query rows 0-4 see nothing
    additive = torch.zeros(visible.shape, device=device).masked_fill(~visible, torch.finfo(torch.float32).min)
    core = parity_tf.ParityAttention(impl, block_m=16, block_n=16)
    out_bool, out_add = core(q, k, v, visible), core(q, k, v, additive)
    torch.testing.assert_close(out_bool, out_add, rtol=0, atol=0)
    assert torch.equal(out_bool[1, :5], torch.zeros_like(out_bool[1, :5]))
    torch.testing.assert_close(out_bool.cpu().double(), _dense(q, k, v, visible), rtol=1e-5, atol=1e-5)


def test_masks_the_kernel_cannot_express_are_refused():
    q, k, v = _qkv(seq_q=8, seq_k=8)
    core = parity_tf.ParityAttention("kernel")
    with pytest.raises(ValueError, match="additive biases"):
        core(q, k, v, torch.full((1, 1, 8, 8), 0.5))
    with pytest.raises(ValueError, match="does not fit"):
        core(q, k, v, torch.ones(1, 1, 8, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="4-D"):
        core(q, k, v, torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="end at 8"):
        core(q, k, v, None, cu_seq_lens_q=torch.tensor([0, 3, 7]))


# ---- registration and attachment ---------------------------------------------------------------


def test_register_adds_both_implementations_with_their_mask_function():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert parity_tf.register() == ("parity_sparse", "parity_sdpa")
    for name in ("parity_sparse", "parity_sdpa"):
        assert name in AttentionInterface._global_mapping
        assert name in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    with pytest.raises(ValueError, match="new attention implementation name"):
        parity_tf.register("sdpa")
    with pytest.raises(ValueError, match="must differ"):
        parity_tf.register("x", reference_name="x")
    with pytest.raises(ValueError, match="power of two"):
        parity_tf.register(block_m=24)


def test_attach_adds_a_core_per_attention_layer_and_changes_no_state():
    runner = load_subject(SPEC, {"case": "packed", "layers": 3})
    model = runner.subject._model("parity_sparse")
    keys = set(model.state_dict())
    cores = parity_tf.attach(model)
    assert cores == [f"model.layers.{i}.self_attn.attn_core" for i in range(3)]
    assert parity_tf.attach(model) == cores  # idempotent
    assert set(parity_tf.attention_cores(model)) == set(cores)
    assert set(model.state_dict()) == keys
    assert {core.impl for core in parity_tf.attention_cores(model).values()} == {"kernel"}
    with pytest.raises(ValueError, match="has no attention layer"):
        parity_tf.attach(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="attention layers use sdpa"):
        parity_tf.attach(runner.subject._model("sdpa"))


def test_an_implementation_without_a_mask_function_refuses_to_guess():
    """transformers gives a custom implementation without a mask function no mask at all, even
    for a padded batch (what made 26 of 33 layers of a padded Llama fail); refuse that."""
    from transformers import AttentionInterface

    AttentionInterface.register("parity_no_mask_fn", AttentionInterface._global_mapping["parity_sdpa"])
    runner = load_subject(SPEC, {"case": "padded_left"})
    model = runner.subject._model("parity_no_mask_fn")
    with pytest.raises(SubjectError, match="has no mask function"):
        runner.run(model, runner.make_inputs())


def test_the_harness_never_imports_transformers():
    code = ("import sys, parity, parity.run.capture, parity.judge.compare, parity.cli.main, parity.testing.plugin, parity.integrations, "
            "parity.integrations.transformers; import json; print(json.dumps('transformers' in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(result.stdout) is False


def test_a_sliding_window_mask_is_its_predicate_only_when_it_is_exactly_that():
    """``kernel_layout`` with a window recognises transformers' sliding-window mask (bottom-right,
    or on the diagonal ``offset`` the mask function knows) as the window's predicate layout, and
    anything else, one element off or another window, as the mask itself."""
    seq_q, seq_k, window = 40, 70, 9
    q = torch.arange(seq_q)[:, None] + (seq_k - seq_q)
    k = torch.arange(seq_k)[None, :]
    visible = ((k <= q) & (k > q - window))[None, None]
    layout = parity_tf.kernel_layout(seq_q, seq_k, visible=visible, window=window, block_m=16, block_n=16)
    assert layout.kind == f"window{window}" and not layout.has_bits and layout.mask.offset == seq_k - seq_q
    shifted = ((k <= q - 2) & (k > q - 2 - window))[None, None]
    explicit = parity_tf.kernel_layout(seq_q, seq_k, visible=shifted, window=window, offset=seq_k - seq_q - 2,
                                       block_m=16, block_n=16)
    assert explicit.kind == f"window{window}" and explicit.mask.offset == seq_k - seq_q - 2
    other = visible.clone()
    other[0, 0, 5, 3] = ~other[0, 0, 5, 3]  # one element more than the window shows
    wrong = parity_tf.kernel_layout(seq_q, seq_k, visible=other, window=window, block_m=16, block_n=16)
    assert wrong.kind == "densemask" and torch.equal(wrong.element_visible().expand_as(other), other)
    assert parity_tf.kernel_layout(seq_q, seq_k, visible=visible, window=window + 1, block_m=16,
                                   block_n=16).kind == "densemask"
