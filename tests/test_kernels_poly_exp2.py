"""The kernel's ``poly_exp2`` option (FlashAttention-4's exp2 emulation): the odd key columns of each
tile take 2**x from a degree-3 polynomial on the FMA units, the even ones from the hardware's exp2.

The polynomial itself against fp64 over the whole range the kernel feeds it (scores minus the row
max: [-125, 0], and -inf for hidden keys), then the kernel with the option against the fp64
reference on every layout kind, with element masks and rows that see no key, with poisoned outputs."""
import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from parity.base import dtypes
from parity.kernels import block_sparse_attention
from parity.kernels.attention import launch_config
from parity.kernels.testing import check_kernel_output, random_qkv
from parity.kernels.triton_attention import _exp2_fma
from test_kernels_attention import LAYOUTS
from test_kernels_rescale import ELEMENT_MASKS

SIXTEEN_BIT = {name: dtypes.torch_dtype(name) for name in ("bf16", "fp16")}
MAX_REL_ERROR = 7.5e-5  # of the coefficients' fit (kernels/triton_attention.py)


@triton.jit
def _apply_exp2_fma(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, _exp2_fma(tl.load(X + offs)))


def _exp2_fma_of(x: torch.Tensor) -> torch.Tensor:
    y = torch.full_like(x, float("nan"))
    _apply_exp2_fma[(1,)](x, y, N=x.numel())
    return y


def test_the_polynomial_is_within_its_bound_over_the_kernels_range():
    # Every x the kernel can give it: a dense sweep of [-125, 0] (both ends, integers, halves,
    # where round() switches), and values just inside each integer's rounding interval.
    x = torch.cat([torch.linspace(-125.0, 0.0, 16_384 - 6),
                   torch.tensor([-0.5, 0.5 - 1, -1.5, -2.5, -124.5, -1e-7])]).float()
    y = _exp2_fma_of(x)
    exact = torch.exp2(x.double())
    rel = ((y.double() - exact) / exact).abs()
    assert float(rel.max()) <= MAX_REL_ERROR
    assert float(rel.max()) > 1e-5  # the polynomial ran: hardware exp2 would be exact to ~1e-7


def test_hidden_and_tiny_scores_give_zero():
    x = torch.tensor([float("-inf"), -1e30, -200.0, -125.5, -125.0 - 1e-5] + [0.0] * 11)
    y = _exp2_fma_of(x)
    assert y[:5].tolist() == [0.0] * 5
    assert y[5].item() == pytest.approx(1.0, rel=MAX_REL_ERROR)


def _configs(device, head_dim, dtype, block=32):
    base = dataclasses.replace(launch_config(device, head_dim, dtype), block_m=block, block_n=block)
    return [dataclasses.replace(base, poly_exp2=True, one_loop=one_loop, lazy_rescale=lazy)
            for one_loop, lazy in ((False, False), (True, False), (True, True))]


def _run(q, k, v, layout, cfg):
    out, lse = block_sparse_attention(q, k, v, layout, return_lse=True, config=cfg,
                                      out=torch.full_like(q, float("nan")))
    check = check_kernel_output(out, lse, q, k, v, layout)
    assert check.nonfinite_outputs == 0, f"{cfg}: {check.nonfinite_outputs} outputs NaN/Inf"
    assert check.empty_rows_agree, f"{cfg}: rows without keys disagree with the reference"
    assert check.passed, f"{cfg}: {check}"
    return out


@pytest.mark.parametrize("dtype", list(SIXTEEN_BIT))
@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_poly_exp2_matches_the_reference(kind, dtype, device):
    layout = LAYOUTS[kind](200, 232, 32, 32).to(device)
    q, k, v = random_qkv(2, 4, 2, 200, 232, 64, SIXTEEN_BIT[dtype], 7, device)
    plain = dataclasses.replace(_configs(q.device, 64, q.dtype)[0], poly_exp2=False)
    reference_tiles = _run(q, k, v, layout, plain)
    for cfg in _configs(q.device, 64, q.dtype):
        out = _run(q, k, v, layout, cfg)
        if cfg.lazy_rescale is False and cfg.one_loop is False:
            # Same tiles, other exponentials: the outputs differ (the option ran), by about the
            # 16-bit rounding of p, not more.
            assert not torch.equal(out, reference_tiles)
            assert float((out.double() - reference_tiles.double()).abs().max()) < 0.05


@pytest.mark.parametrize("kind", list(ELEMENT_MASKS))
def test_poly_exp2_with_element_masks(kind, device):
    layout = ELEMENT_MASKS[kind]().to(device)
    batch = layout.batch_heads[0] if layout.batch_heads[0] > 1 else 1
    q, k, v = random_qkv(batch, 2, 1, 128, 128, 32, torch.bfloat16, 8, device)
    for cfg in _configs(q.device, 32, q.dtype):
        _run(q, k, v, layout, cfg)


def test_fp32_is_refused():
    q, k, v = random_qkv(1, 1, 1, 64, 64, 32, torch.float32, 1, torch.device("cpu"))
    layout = LAYOUTS["causal"](64, 64, 32, 32)
    cfg = dataclasses.replace(launch_config(q.device, 32, q.dtype), poly_exp2=True)
    with pytest.raises(ValueError, match="poly_exp2 is for 16-bit inputs"):
        block_sparse_attention(q, k, v, layout, config=cfg)


def test_poly_exp2_is_a_config_field_off_by_default():
    from parity.kernels import benchmark, configs

    for arch, rows in configs.CONFIGS.items():
        assert not any(cfg.poly_exp2 for _, cfg in rows), arch  # off unless measured and pinned
    base = launch_config(torch.device("cpu"), 64, torch.bfloat16)
    cfg = benchmark.parse_variant("poly_exp2=1", base)
    assert cfg.poly_exp2 is True and cfg.to_dict()["poly_exp2"] is True and "poly_exp2" not in base.to_dict()
    assert benchmark._label(cfg).endswith("+poly_exp2") and "poly_exp2" in configs.OVERRIDE_KEYS


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kind", ["causal", "window", "random", "blockmask"])
@pytest.mark.parametrize("dtype", list(SIXTEEN_BIT))
def test_gpu_poly_exp2(kind, dtype, head_dim):
    """The GPU at its pinned tiles with the option."""
    device = torch.device("cuda")
    layout = LAYOUTS[kind](2048, 2048, 128, 128).to(device)
    q, k, v = random_qkv(2, 4, 2, 2048, 2048, head_dim, SIXTEEN_BIT[dtype], 4, device)
    _run(q, k, v, layout, dataclasses.replace(launch_config(device, head_dim, q.dtype), poly_exp2=True))
