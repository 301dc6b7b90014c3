"""Derived rounding bounds (parity.judge.bounds) against fp64 on random inputs: never exceeded,
tight where one rounding dominates (16-bit outputs), loose where a long fp32 reduction cancels,
exact where the arithmetic is (an fp32 sum of small integers, ReLU)."""
import numpy
import pytest
import torch
from torch import nn

from parity.judge import bounds
from parity.judge.op_bounds import module_bound


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _ratio(computed, exact, bound):
    error = (computed.to(torch.float64) - exact).abs()
    return float(torch.where(error == 0, torch.zeros_like(error), error / bound).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("positive", [True, False])
def test_linear_never_beyond_its_deterministic_bound(dtype, positive):
    g = _gen(1)
    draw = torch.rand if positive else torch.randn
    x, w, b = (draw(*shape, generator=g).to(dtype) for shape in ((64, 2048), (48, 2048), (48,)))
    y = nn.functional.linear(x, w, b)
    exact = x.double() @ w.double().T + b.double()
    bound = bounds.linear_bound(x, w, b)
    assert bound.k == 2049
    assert 0 < _ratio(y, exact, bound.det) <= 1
    if dtype == torch.bfloat16:  # the output rounding (2^-9 |y|) is nearly the whole bound: tight
        assert _ratio(y, exact, bound.det) > 0.5
    elif dtype == torch.float16:  # 2^-12 |y| next to K u_fp32 sum|x w|: tighter with positive inputs
        assert _ratio(y, exact, bound.det) > (0.5 if positive else 0.1)
    elif not positive:  # fp32, K = 2048 with cancellation: K u is far above what rounding does
        assert _ratio(y, exact, bound.det) < 1e-3


def test_probabilistic_bound_is_near_a_sequential_all_positive_sum():
    # numpy's add.accumulate adds one term at a time in fp32 (torch's CPU cumsum accumulates in
    # fp64): the recursive summation Higham and Mary analyse. With all terms positive the error
    # grows like sqrt(K) u, far inside K u and near lam sqrt(K) u.
    x = torch.rand(16, 200_000, generator=_gen(2))
    computed = torch.from_numpy(numpy.add.accumulate(x.numpy(), axis=-1)[:, -1].copy())
    exact = x.double().sum(-1)
    bound = bounds.sum_bound(x)
    det, prob = _ratio(computed, exact, bound.det), _ratio(computed, exact, bound.prob)
    assert det < 0.01
    assert 0.02 < prob <= 1


def test_fp32_sum_of_small_integers_is_exact_and_its_bound_is_positive():
    x = torch.randint(-1000, 1000, (8, 4096), generator=_gen(3)).float()
    bound = bounds.sum_bound(x)
    assert (x.sum(-1).double() - x.double().sum(-1)).abs().max() == 0
    assert float(bound.det.min()) > 0
    check = bounds.check_bound(x.sum(-1), x.double().sum(-1), bound, sides=1)
    assert check.ratio == 0 and not check.beyond and check.worst_index is None


def test_relu_bound_is_exactly_zero_and_a_changed_value_is_infinitely_beyond():
    x = torch.randn(1000, generator=_gen(4))
    bound = bounds.activation_bound("relu", x)
    assert float(bound.det.max()) == 0
    wrong = torch.relu(x)
    index = int(torch.nonzero(x > 0)[0])
    wrong[index] = wrong[index] * (1 + 2**-20)
    check = bounds.check_bound(wrong, torch.relu(x), bound, sides=1)
    assert check.ratio == float("inf") and check.beyond and check.worst_index is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["silu", "gelu", "tanh", "sigmoid"])
def test_activation_bounds_hold_against_fp64(dtype, name):
    x = (4 * torch.randn(4096, generator=_gen(5))).to(dtype)
    f = {"silu": nn.functional.silu, "gelu": nn.functional.gelu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}[name]
    ratio = _ratio(f(x), f(x.double()), bounds.activation_bound(name, x).det)
    assert 0 < ratio <= 1
    if dtype == torch.bfloat16:
        assert ratio > 0.5  # the output rounding dominates


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_softmax_bounds_hold_against_fp64(dtype):
    g = _gen(6)
    x, w, b = (torch.randn(*shape, generator=g).to(dtype) for shape in ((32, 1024), (1024,), (1024,)))
    ln = _ratio(nn.functional.layer_norm(x, (1024,), w, b, 1e-5),
                nn.functional.layer_norm(x.double(), (1024,), w.double(), b.double(), 1e-5),
                bounds.layer_norm_bound(x, w, b, 1e-5).det)
    rms = _ratio(nn.functional.rms_norm(x, (1024,), w, 1e-6), nn.functional.rms_norm(x.double(), (1024,), w.double(), 1e-6),
                 bounds.rms_norm_bound(x, w, 1e-6).det)
    wide = 3 * x  # a wider spread of scores (in x's dtype: the op's input)
    soft = _ratio(torch.softmax(wide, -1), torch.softmax(wide.double(), -1), bounds.softmax_bound(wide).det)
    for ratio in (ln, rms, soft):
        assert 0 < ratio <= 1
    if dtype == torch.bfloat16:
        assert min(ln, rms, soft) > 0.3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_attention_bound_holds_with_gqa_and_a_mask(dtype):
    g = _gen(7)
    q = torch.randn(2, 4, 96, 32, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, 130, 32, generator=g).to(dtype) for _ in range(2))
    visible = torch.ones(96, 130, dtype=torch.bool).tril(34)
    visible[5] = False  # a row that sees no key: 0, exactly
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = (q.float() @ kk.float().transpose(-1, -2)) * 32 ** -0.5
    out = (torch.softmax(scores.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0) @ vv.float()).to(dtype)
    exact_scores = (q.double() @ kk.double().transpose(-1, -2)) * 32 ** -0.5
    exact = torch.softmax(exact_scores.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0) @ vv.double()
    bound = bounds.attention_bound(q, k, v, visible)
    assert bound.op == "attention D=32 keys<=130"
    assert float(bound.det[:, :, 5].abs().max()) == 0
    ratio = _ratio(out, exact, bound.det)
    assert 0 < ratio <= 1
    if dtype == torch.bfloat16:
        assert ratio > 0.2


def test_module_bound_knows_linear_norms_activations_and_not_a_composite():
    x = torch.randn(4, 16, generator=_gen(8))
    linear = nn.Linear(16, 8)
    assert module_bound(linear, (x,), {}, "", linear(x)).op == "linear K=16"
    assert module_bound(nn.LayerNorm(16), (x,), {}, "", x).op == "layernorm n=16"
    assert module_bound(nn.RMSNorm(16), (x,), {}, "", x).op == "rmsnorm n=16"
    assert module_bound(nn.SiLU(), (x,), {}, "", x).op == "silu"
    assert module_bound(nn.Sequential(linear, nn.ReLU()), (x,), {}, "", linear(x)) is None
    assert module_bound(linear, (x,), {}, "0", linear(x)) is None


def test_bound_check_counts_both_hosts_roundings_and_serialises():
    x = torch.randn(8, 256, generator=_gen(9)).to(torch.bfloat16)
    w = torch.randn(16, 256, generator=_gen(10)).to(torch.bfloat16)
    bound = bounds.linear_bound(x, w)
    golden = nn.functional.linear(x, w)
    other = (x.double() @ w.double().T).to(torch.bfloat16)  # a correctly rounded second host
    check = bounds.check_bound(other, golden, bound)
    assert check.sides == 2 and 0 <= check.ratio <= 1 and not check.beyond
    assert bounds.BoundCheck.from_dict(check.to_dict()) == check
    wrong = golden * 1.02  # a 2% scale error: beyond any rounding of a bf16 output
    assert bounds.check_bound(wrong, golden, bound).beyond


@pytest.mark.parametrize("mask", ["causal", "window", "padding bool", "padding additive"])
def test_the_transformers_attention_core_is_bounded_on_its_own_output_layout(mask):
    """``ParityAttention`` (a Hugging Face model's attention core): the bound is the attention
    bound on the elements transformers' mask shows (none given: bottom-right causal, within the
    window), transposed to the core's [B, Sq, Hq, D] output; SDPA's bf16 output lies inside it
    against the fp64 result, and the bound is not loose by orders of magnitude."""
    from parity.integrations.transformers import ParityAttention

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, heads, 40, 32, generator=gen).to(torch.bfloat16) for heads in (4, 2, 2))
    keys = torch.arange(40)
    causal = keys[None, :] <= keys[:, None]
    padded = causal & (keys >= 6)[None, :]  # left padding of 6 keys
    given = {"causal": (None, {}), "window": (None, {"sliding_window": 8}),
             "padding bool": (padded[None, None], {}),
             "padding additive": (torch.where(padded, 0.0, torch.finfo(torch.bfloat16).min)[None, None], {})}[mask]
    attention_mask, extra = given
    core = ParityAttention("reference")
    kwargs = {"scaling": 32 ** -0.5, **extra}
    out = core(q, k, v, attention_mask, **kwargs)
    bound = module_bound(core, (q, k, v, attention_mask), kwargs, "", out)
    assert bound is not None and bound.op.startswith("attention D=32") and tuple(bound.det.shape) == tuple(out.shape)
    exact = ParityAttention("reference")(q.double(), k.double(), v.double(), attention_mask, **kwargs)
    check = bounds.check_bound(out, exact, bound, sides=1)
    assert 0.01 < check.ratio <= 1.0, check
    assert module_bound(core, (q, k, v, None), {"cu_seq_lens_q": torch.tensor([0, 40])}, "", out) is None
