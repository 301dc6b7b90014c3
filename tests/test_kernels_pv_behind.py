"""The kernel's ``pv_behind`` option (``LaunchConfig.pv_behind``): the one loop with each tile's
P @ V issued one step late, after the next tile's scores, so that on Hopper the product runs
while the softmax's exponentials do (FlashAttention-3's intra-warpgroup overlap; what the compiled
code allows is read by ``kernels.sass_schedule``, tests/test_kernels_aot.py).

It changes the program order only: the same tiles in the same order, the same rescale and the
same rounding of p. So through the interpreter its output and LSE must equal the one loop's bit
for bit, on every layout kind, element mask and dtype, including query tiles that visit no key
tile, one tile (the loop body never runs), several tiles per layout block, and rows that see no
key; and both must pass the fp64 reference with poisoned outputs."""
import dataclasses

import pytest
import torch

from parity.base import dtypes
from parity.kernels import block_sparse_attention, causal_layout, configs, sliding_window_layout
from parity.kernels.attention import launch_config
from parity.kernels.testing import check_kernel_output, random_qkv
from test_kernels_attention import LAYOUTS
from test_kernels_rescale import ELEMENT_MASKS

DTYPES = {name: dtypes.torch_dtype(name) for name in dtypes.KERNEL_DTYPES}


def _pair(device, head_dim, dtype, block_m=32, block_n=32):
    """The one-loop config of these tiles, and the same with pv_behind."""
    base = dataclasses.replace(launch_config(device, head_dim, dtype), block_m=block_m, block_n=block_n,
                               one_loop=True, lazy_rescale=False)
    return base, dataclasses.replace(base, pv_behind=True)


def _run(q, k, v, layout, cfg):
    out, lse = block_sparse_attention(q, k, v, layout, return_lse=True, config=cfg,
                                      out=torch.full_like(q, float("nan")),
                                      lse_out=torch.full(q.shape[:3], float("nan"), device=q.device))
    check = check_kernel_output(out, lse, q, k, v, layout)
    assert check.nonfinite_outputs == 0 and not lse.isnan().any(), f"{cfg}: unwritten outputs"
    assert check.empty_rows_agree, f"{cfg}: rows without keys disagree with the reference"
    assert check.passed, f"{cfg}: {check}"
    return out, lse


def _same_bits(q, k, v, layout, head_dim, **tiles):
    plain, behind = _pair(q.device, head_dim, q.dtype, **tiles)
    want, want_lse = _run(q, k, v, layout, plain)
    got, got_lse = _run(q, k, v, layout, behind)
    assert torch.equal(got, want), f"{(got.float() - want.float()).abs().max()} off the one loop"
    assert torch.equal(got_lse, want_lse)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_pv_behind_gives_the_one_loops_bits(kind, dtype, device):
    """blockmask has a query block with no key block (the loop never starts) and one whose rows
    see no key; the random and block-mask layouts have query blocks that visit one tile (the loop
    body never runs)."""
    layout = LAYOUTS[kind](200, 232, 32, 32).to(device)
    q, k, v = random_qkv(2, 4, 2, 200, 232, 64, DTYPES[dtype], 5, device)
    _same_bits(q, k, v, layout, 64)


@pytest.mark.parametrize("kind", list(ELEMENT_MASKS))
def test_pv_behind_with_element_masks(kind, device):
    layout = ELEMENT_MASKS[kind]().to(device)
    batch = layout.batch_heads[0] if layout.batch_heads[0] > 1 else 1
    q, k, v = random_qkv(batch, 2, 1, 128, 128, 32, torch.bfloat16, 6, device)
    _same_bits(q, k, v, layout, 32)


def test_pv_behind_with_several_tiles_per_layout_block(device):
    """64-key layout blocks visited as two 32-key tiles each (full, then partial), a head dim
    padded to the next power of two (96 in 128 lanes) and a key length that ends inside a tile."""
    layout = sliding_window_layout(160, 190, 70, block_m=64, block_n=64).to(device)
    q, k, v = random_qkv(1, 2, 1, 160, 190, 96, torch.float16, 7, device)
    _same_bits(q, k, v, layout, 96, block_m=32, block_n=32)


def test_pv_behind_config_rules():
    base = configs.LaunchConfig(128, 64, 8, 3, one_loop=True)
    assert dataclasses.replace(base, pv_behind=True).to_dict()["pv_behind"] is True
    with pytest.raises(ValueError, match="pv_behind reorders the one loop: it needs one_loop=1"):
        configs.LaunchConfig(128, 64, 8, 3, pv_behind=True)
    with pytest.raises(ValueError, match="pv_behind and lazy_rescale cannot be combined"):
        dataclasses.replace(base, pv_behind=True, lazy_rescale=True)
    assert configs.with_overrides(base, {"pv_behind": 1}).pv_behind is True
    with pytest.raises(ValueError, match="needs one_loop=1"):
        configs.with_overrides(base, {"pv_behind": 1, "one_loop": 0})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_pv_behind_gives_the_pinned_configs_bits(head_dim, dtype):
    """On the GPU, with the launcher's pinned tiles (on sm_90: TMA, the one loop): the option's
    output and LSE are the pinned config's bits, on a causal and a window layout with a length
    that ends inside a tile (TMA's zero fill), and on a block mask with a query block that sees
    no key."""
    device = torch.device("cuda")
    for layout in (causal_layout(1000, 1000, block_m=128, block_n=128),
                   sliding_window_layout(1000, 1000, 300, block_m=128, block_n=128),
                   LAYOUTS["blockmask"](1000, 1000, 128, 128)):
        layout = layout.to(device)
        q, k, v = random_qkv(2, 8, 2, 1000, 1000, head_dim, dtype, 3, device)
        pinned = launch_config(device, head_dim, q.dtype, layout)
        if not pinned.one_loop:
            pinned = dataclasses.replace(pinned, one_loop=True, lazy_rescale=False)
        want, want_lse = _run(q, k, v, layout, pinned)
        got, got_lse = _run(q, k, v, layout, dataclasses.replace(pinned, pv_behind=True))
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)) and torch.equal(got_lse, want_lse)
