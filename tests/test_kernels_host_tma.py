"""The kernel's ``host_tma`` option (``LaunchConfig.host_tma``): TMA loads of K and V through two
descriptors the launcher makes once per call on the host (``launch.kv_descriptors``), instead of
two descriptors every program builds on the device (bench/BENCHMARK.md, table 4: TMA costs each
query tile 1.65-1.87 SM-microseconds, and the compiled prologue builds the descriptors with
GPU-scope fences).

The same tiles are loaded in the same order, so pointers, device-made descriptors and host-made
ones must give the same bits. The launcher takes the TMA path only on an NVIDIA GPU, so on the CPU
the kernel is driven through ``build_launch`` under the interpreter (which runs tensor
descriptors); the GPU test goes through the launcher and its cache."""
import dataclasses

import pytest
import torch

from parity.kernels import block_sparse_attention, causal_layout, configs, sliding_window_layout, targets
from parity.kernels.attention import install_tma_allocator, launch_config
from bench.benchmark_table import parse_variant
from parity.kernels.launch import DESCRIPTORS, PER_CALL, build_launch, host_tma_fits, kv_descriptors
from parity.kernels.launch_cache import LaunchCache, LaunchStep
from parity.kernels.layout import BlockLayout
from parity.kernels.testing import check_kernel_output, random_qkv

TILES = {"one_loop": dict(one_loop=True), "two_loops": dict(one_loop=False)}


def _tma_device(device):
    """Skip on a GPU whose pinned configs do not use TMA (the configs table says which do); the
    interpreter runs tensor descriptors on the CPU."""
    if device.type == "cuda":
        if not launch_config(device, 64, torch.float16).tma:
            pytest.skip("the pinned configs of this GPU do not use TMA (kernels/configs.py)")
        install_tma_allocator()  # device-side descriptors take Triton's scratch, as the launcher sets it


def _run(q, k, v, layout, cfg, mode):
    """Output and LSE of one launch with K/V loaded through ``mode``: pointers, device (descriptors
    built in the kernel) or host (descriptors made here)."""
    from parity.kernels import triton_attention

    use_tma = mode != "pointers"
    descriptors = kv_descriptors(k, v, cfg, use_tma) if mode == "host" else (None, None)
    assert (descriptors[0] is not None) == (mode == "host")  # the config fits the host-made ones
    # the interpreter's bf16 work-around, as the launcher sets it
    emulate = targets.triton_interpreter_enabled() and q.dtype == torch.bfloat16
    out = torch.full(q.shape, float("nan"), dtype=torch.float32 if emulate else q.dtype, device=q.device)
    lse = torch.full(q.shape[:3], float("nan"), device=q.device)
    launch = build_launch(q, k, v, out, lse, layout, cfg, sm_scale=q.shape[-1] ** -0.5, emulate_bf16=emulate,
                          use_tma=use_tma, descriptors=descriptors)
    assert launch.constexprs["HOST_TMA"] is (mode == "host")
    triton_attention.block_sparse_attn_fwd[launch.grid](**launch.args, **launch.constexprs, **launch.options)
    return out.to(q.dtype), lse


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("loop", list(TILES))
def test_host_descriptors_give_the_bits_of_device_descriptors_and_pointers(loop, dtype, device):
    """GQA 4:2 over two batches (each program's rows start at its own (batch, kv head)), 256 keys
    in 64-key tiles of 128-key layout blocks, causal (full and partial blocks, rows that end
    inside a tile)."""
    _tma_device(device)
    layout = causal_layout(192, 256, block_m=128, block_n=128).to(device)
    q, k, v = random_qkv(2, 4, 2, 192, 256, 64, dtype, 11, device)
    cfg = configs.LaunchConfig(64, 64, 4, 2, tma=True, host_tma=True, **TILES[loop])
    runs = {mode: _run(q, k, v, layout, cfg, mode) for mode in ("pointers", "device", "host")}
    check = check_kernel_output(*runs["host"], q, k, v, layout)
    assert check.passed and check.nonfinite_outputs == 0, check
    for mode in ("pointers", "device"):
        assert torch.equal(runs["host"][0], runs[mode][0]), f"host descriptors differ from {mode}"
        assert torch.equal(runs["host"][1], runs[mode][1])


def test_host_descriptors_on_a_window_with_tiles_that_visit_one_block(device):
    _tma_device(device)
    layout = sliding_window_layout(256, 256, 64, block_m=64, block_n=64).to(device)
    q, k, v = random_qkv(1, 2, 1, 256, 256, 32, torch.float16, 12, device)
    cfg = configs.LaunchConfig(64, 32, 4, 2, tma=True, host_tma=True, one_loop=True)
    host, device = _run(q, k, v, layout, cfg, "host"), _run(q, k, v, layout, cfg, "device")
    assert torch.equal(host[0], device[0]) and torch.equal(host[1], device[1])
    assert check_kernel_output(*host, q, k, v, layout).passed


def test_host_tma_fits_only_rows_it_can_describe():
    cfg = configs.LaunchConfig(128, 64, 8, 3, tma=True, host_tma=True)
    k = torch.empty(2, 4, 256, 64)
    assert host_tma_fits(cfg, k, k)
    assert not host_tma_fits(dataclasses.replace(cfg, host_tma=False), k, k)  # not asked for
    assert not host_tma_fits(cfg, k[:, :, :200], k[:, :, :200])  # a key tile would cross into the next head
    # 64-key tiles in 128-key layout blocks: Sk 192 ends inside a block, whose second tile (keys
    # 192-255) would read the next head's first rows
    k192 = torch.empty(2, 4, 192, 64)
    assert host_tma_fits(cfg, k192, k192) and not host_tma_fits(cfg, k192, k192, block_n=128)
    assert host_tma_fits(cfg, k, k, block_n=128)  # 256 keys: whole blocks
    assert not host_tma_fits(cfg, k, k[:, :2])  # a slice of the heads: batches are not one row array
    bshd = torch.empty(2, 256, 4, 64).transpose(1, 2)  # [B, S, H, D] storage: rows of a head are H rows apart
    assert not host_tma_fits(cfg, bshd, bshd)
    one = torch.empty(1, 8, 256, 64)[:, :1]  # one batch and one head: any stride is one row array
    assert host_tma_fits(cfg, one, one)
    huge = torch.empty(2**8, 2**9, 2**14, 64, device="meta")  # 2**31 rows: past TMA's 32-bit coordinates
    assert not host_tma_fits(cfg, huge, huge)


def test_kv_descriptors_describe_all_rows_with_key_tile_boxes():
    cfg = configs.LaunchConfig(128, 64, 8, 3, tma=True, host_tma=True)
    k, v = torch.empty(2, 4, 256, 96, dtype=torch.bfloat16), torch.empty(2, 4, 256, 96, dtype=torch.bfloat16)
    kd, vd = kv_descriptors(k, v, cfg, use_tma=True)
    assert kd.base is k and vd.base is v
    assert (kd.shape, kd.strides, kd.block_shape) == ([2 * 4 * 256, 96], [96, 1], [64, 128])
    assert kv_descriptors(k, v, cfg, use_tma=False) == (None, None)  # the pointer path
    assert kv_descriptors(k, v, dataclasses.replace(cfg, host_tma=False), use_tma=True) == (None, None)
    assert kv_descriptors(k[:, :, :200], v[:, :, :200], cfg, use_tma=True) == (None, None)  # device-side then


def test_host_tma_config_rules():
    with pytest.raises(ValueError, match="host_tma makes the TMA descriptors on the host: it needs tma=1"):
        configs.LaunchConfig(128, 64, 8, 3, host_tma=True)
    assert parse_variant("d128:tma=1,host_tma=1") == (128, {"tma": True, "host_tma": True})
    cfg = configs.LaunchConfig(128, 128, 8, 3, tma=True, one_loop=True, host_tma=True)
    assert cfg.to_dict()["host_tma"] is True and "host_tma" in configs.FLAGS


def test_a_cached_launch_takes_each_calls_own_descriptors():
    """The prefill cache's per-call values include the two descriptors (the launcher passes
    PER_CALL + DESCRIPTORS): a hit issues the second call's descriptors, over its own K and V."""
    from parity.kernels import triton_attention

    layout = causal_layout(256, 256, block_m=128, block_n=128)
    cfg = configs.LaunchConfig(128, 64, 8, 3, tma=True, one_loop=True, host_tma=True)
    issued = []
    cache = LaunchCache((triton_attention.block_sparse_attn_fwd,), PER_CALL + DESCRIPTORS,
                        issue=lambda compiled, grid, values, state: issued.append(values),
                        state=lambda kernels: ("device 0", "stream 7"), version=BlockLayout.version,
                        addresses=False)
    names = list(triton_attention.block_sparse_attn_fwd.arg_names)

    def call(seed):
        q, k, v = random_qkv(2, 4, 2, 256, 256, 64, torch.bfloat16, seed, "cpu")
        descriptors = kv_descriptors(k, v, cfg, use_tma=True)
        tensors = (q, k, v, torch.empty_like(q), None, *descriptors)
        launch = build_launch(q, k, v, tensors[3], None, layout, cfg, sm_scale=0.125, use_tma=True,
                              descriptors=descriptors)
        step = LaunchStep(triton_attention.block_sparse_attn_fwd, launch.grid, launch.args, launch.constexprs,
                          launch.options)
        step_dispatch = type("Compiled", (), {name: None for name in ("run", "function", "packed_metadata",
                                                                      "launch_metadata")})()
        cache.launch(layout, "key", tensors, lambda: [dataclasses.replace(step, kernel=_Stub(step, step_dispatch))])
        return descriptors

    call(0)
    second = call(1)
    assert (cache.hits, cache.misses) == (1, 1) and len(issued) == 1
    values = issued[0]
    assert values[names.index("K_DESC")] is second[0] and values[names.index("V_DESC")] is second[1]
    assert values[names.index("K")] is second[0].base


class _Stub:
    """A kernel whose dispatch returns a stand-in compiled kernel (no compile on the CPU)."""

    def __init__(self, step, compiled):
        self.arg_names = step.kernel.arg_names
        self._compiled = compiled

    def __getitem__(self, grid):
        return lambda **kwargs: self._compiled


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_host_descriptors_give_the_device_made_descriptors_bits(head_dim, device):
    """On an NVIDIA GPU through the launcher: the pinned tiles with host-made descriptors give
    the bits of the same tiles with device-made ones, on a first call and on a cached one with
    new tensors (host_tma is pinned for sm_90 since table 5, so both are set here explicitly)."""
    _tma_device(device)
    pinned = launch_config(device, head_dim, torch.bfloat16)
    device_made = dataclasses.replace(pinned, host_tma=False)
    host = dataclasses.replace(pinned, host_tma=True)
    for layout in (causal_layout(2048, 2048, block_m=128, block_n=128),
                   sliding_window_layout(2048, 2048, 512, block_m=128, block_n=128)):
        layout = layout.to(device)
        for seed in (0, 1):  # the second call of each config is a launch-cache hit with new tensors
            q, k, v = random_qkv(2, 8, 2, 2048, 2048, head_dim, torch.bfloat16, seed, device)
            want, want_lse = block_sparse_attention(q, k, v, layout, config=device_made, return_lse=True,
                                                    out=torch.full_like(q, float("nan")))
            got, got_lse = block_sparse_attention(q, k, v, layout, config=host, return_lse=True,
                                                  out=torch.full_like(q, float("nan")))
            assert torch.equal(got, want), f"{(got.float() - want.float()).abs().max()} off device-made descriptors"
            assert torch.equal(got_lse, want_lse)
            assert check_kernel_output(got, got_lse, q, k, v, layout).passed
