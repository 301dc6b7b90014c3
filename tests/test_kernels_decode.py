"""The split-KV decode path against the fp64 reference and against the prefill path: every split
count (more splits than key tiles too), every layout kind, GQA groups shared by one program or
split over several, ragged batches, empty rows, poisoned outputs, determinism, and bad requests.
Every check runs both merges of the splits (``COMBINES``: the split kernel's last program, and
the separate combine kernel) and asserts they give the same bits; the fused merge's arrival
counters are zero again after each call, also through the launch cache's hits. On CPU through the
Triton interpreter (conftest); the GPU tests run the same checks compiled."""
import dataclasses

import pytest
import torch

from parity.kernels import (
    block_sparse_attention,
    causal_layout,
    document_layout,
    launch_config,
    padding_layout,
    prefix_lm_layout,
    random_layout,
    sink_layout,
    sliding_window_layout,
)
from parity.kernels.configs import DECODE_MAX_SEQ_Q, DecodeConfig, LaunchConfig
from parity.kernels.decode import MAX_ROWS, build_decode_launch, choose_splits, heads_per_program, merge_splits
from parity.kernels.testing import LSE_TOLERANCE, check_kernel_output, kernel_reference, random_qkv

LAYOUTS = {
    "causal": lambda sq, sk: causal_layout(sq, sk, block_m=32, block_n=32),
    "window": lambda sq, sk: sliding_window_layout(sq, sk, 70, block_m=32, block_n=32),
    "sink": lambda sq, sk: sink_layout(sq, sk, 64, 1, block_m=32, block_n=32),
    # per-head block lists: one query head per program (no shared group)
    "random-per-head": lambda sq, sk: random_layout(sq, sk, 0.5, 4, batch=2, heads=4, block_m=32, block_n=32),
    # ragged cache lengths in one batch, one sequence with no key at all
    "ragged": lambda sq, sk: padding_layout(sq, sk, [sk, 0], block_m=32, block_n=32),
    # two packed documents: query rows 0..1 see keys 0..139, row 2 sees keys 140..199
    "documents": lambda sq, sk: document_layout([sq - 1, 1], [sk - 60, 60], block_m=32, block_n=32),
}
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def run_decode(q, k, v, layout, **kwargs):
    """The kernel into NaN-poisoned buffers; asserts every element was written."""
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device=q.device)
    result, result_lse = block_sparse_attention(q, k, v, layout, return_lse=True, out=out, lse_out=lse, **kwargs)
    assert result.data_ptr() == out.data_ptr() and result_lse.data_ptr() == lse.data_ptr()
    assert not out.isnan().any(), f"{int(out.isnan().sum())} outputs left NaN (unwritten)"
    assert not lse.isnan().any(), f"{int(lse.isnan().sum())} LSE entries left NaN (unwritten)"
    return out, lse


# DecodeConfig.fused_combine: the last split program merges (the default), or decode_combine does
COMBINES = {"fused": True, "kernel": False}


def combine_config(q, layout, fused: bool) -> DecodeConfig:
    """The pinned decode config for this call with the merge chosen."""
    from parity.kernels.attention import decode_config

    return dataclasses.replace(decode_config(q.device, q.shape[-1], q.dtype).clamp(layout.block_n),
                               fused_combine=fused)


def run_both_combines(q, k, v, layout, **kwargs):
    """The decode path with each merge of the splits, into poisoned buffers; asserts the two give
    the same bits (one merge order) and returns them. With one split there is no merge: the two
    configs build the same launch (asserted), so the kernel runs once."""
    configs = [combine_config(q, layout, fused) for fused in COMBINES.values()]
    if kwargs.get("num_splits") == 1:
        launches = [build_decode_launch(q, k, v, torch.empty_like(q), None, layout, cfg, sm_scale=1.0, num_splits=1)
                    for cfg in configs]
        assert all(launch.combine == "none" for launch in launches)
        assert launches[0].constexprs == launches[1].constexprs and launches[0].grid == launches[1].grid
        return run_decode(q, k, v, layout, decode=True, config=configs[0], **kwargs)
    results = [run_decode(q, k, v, layout, decode=True, config=cfg, **kwargs) for cfg in configs]
    (out, lse), (out_kernel, lse_kernel) = results
    assert torch.equal(out, out_kernel) and torch.equal(lse, lse_kernel), \
        f"fused and two-kernel merges differ: max {float((out.double() - out_kernel.double()).abs().max())}"
    return out, lse


def check_against_reference_and_prefill(q, k, v, layout, **kwargs):
    out, lse = run_both_combines(q, k, v, layout, **kwargs)
    check = check_kernel_output(out, lse, q, k, v, layout)
    assert check.passed, str(check)
    prefill, prefill_lse = block_sparse_attention(q, k, v, layout, return_lse=True, decode=False)
    # Same LSE as the prefill path (both fp32 accumulations of the same scores) and the same
    # empty rows; outputs agree within the reference rule's bound, which both satisfy.
    assert torch.equal(torch.isneginf(lse), torch.isneginf(prefill_lse))
    seen = torch.isfinite(prefill_lse)
    if seen.any():
        assert float((lse[seen] - prefill_lse[seen]).abs().max()) <= LSE_TOLERANCE
    assert float((out.double() - prefill.double()).abs().max()) <= 2 * check.bound
    return out, lse, check


@pytest.mark.parametrize("splits", [None, 1, 2, 3, 8], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_every_layout_and_split_count(kind, splits, device):
    seq_q = 1 if kind in ("causal", "ragged") else 3
    dtype = DTYPES[(list(LAYOUTS).index(kind) + (splits or 0)) % 3]
    layout = LAYOUTS[kind](seq_q, 200)
    q, k, v = random_qkv(2, 4, 2, seq_q, 200, 32, dtype, seed=splits or 0, device=device)
    check_against_reference_and_prefill(q, k, v, layout, num_splits=splits)


@pytest.mark.parametrize("seq_q", [1, 2, 5, DECODE_MAX_SEQ_Q])
@pytest.mark.parametrize("heads_q,heads_kv", [(8, 2), (8, 1), (4, 4)])
def test_query_lengths_and_gqa_groups(seq_q, heads_q, heads_kv, device):
    # Hq=8, Hkv=1, Sq=16: 128 rows per group, over MAX_ROWS, so two programs share the group.
    layout = causal_layout(seq_q, 150, block_m=32, block_n=32)
    q, k, v = random_qkv(1, heads_q, heads_kv, seq_q, 150, 64, torch.bfloat16, seed=seq_q, device=device)
    check_against_reference_and_prefill(q, k, v, layout, num_splits=2)


def test_bit_mask_layout(device):
    layout = prefix_lm_layout(40, 10, block_m=64, block_n=32)
    q, k, v = random_qkv(1, 4, 2, 40, 40, 32, torch.float16, seed=3, device=device)
    check_against_reference_and_prefill(q, k, v, layout, num_splits=3)


def test_more_splits_than_tiles_and_rows_that_see_nothing(device):
    # Two 32-key tiles, 7 splits: five splits see no key and must weigh nothing; the second
    # sequence has no key at all: 0 and LSE -inf, never NaN.
    layout = padding_layout(1, 64, [64, 0], block_m=32, block_n=32)
    q, k, v = random_qkv(2, 2, 1, 1, 64, 16, torch.float32, seed=1, device=device)
    out, lse, _ = check_against_reference_and_prefill(q, k, v, layout, num_splits=7)
    assert torch.all(out[1] == 0) and torch.all(torch.isneginf(lse[1]))
    assert torch.isfinite(lse[0]).all()


def test_default_path_and_recorded_config(device):
    short = causal_layout(DECODE_MAX_SEQ_Q, 64, block_m=32, block_n=32)
    longer = causal_layout(DECODE_MAX_SEQ_Q + 1, 64, block_m=32, block_n=32)
    assert isinstance(launch_config(device, 64, torch.float16, short), DecodeConfig)
    assert isinstance(launch_config(device, 64, torch.float16, longer), LaunchConfig)
    assert launch_config(device, 64, torch.float16, short).to_dict()["path"] == "decode"
    q, k, v = random_qkv(1, 2, 1, DECODE_MAX_SEQ_Q, 64, 64, torch.float16, seed=2, device=device)
    default = block_sparse_attention(q, k, v, short)
    explicit = block_sparse_attention(q, k, v, short, decode=True)
    assert torch.equal(default, explicit)  # the default is the decode path, and it is deterministic
    assert torch.equal(block_sparse_attention(q, k, v, short, decode=True, num_splits=3),
                       block_sparse_attention(q, k, v, short, decode=True, num_splits=3))


def test_heads_per_program():
    shared = causal_layout(1, 64)
    assert heads_per_program(4, 1, shared) == 4
    assert heads_per_program(8, 16, shared) == MAX_ROWS // 16  # 4 of the 8 heads: 64 rows
    assert heads_per_program(6, 16, shared) == 3  # the largest divisor of the group that fits
    per_head = random_layout(1, 64, 0.5, 0, heads=8, block_m=128, block_n=32)
    assert heads_per_program(4, 1, per_head) == 1


def test_choose_splits():
    cfg = DecodeConfig(64, 4, 3, programs_per_unit=4, min_tiles_per_split=4, max_splits=128)
    # 132 units x 4 programs each over 64 programs: 8 splits (512 programs), if the work allows.
    assert choose_splits(64, 64, 132, cfg) == 8
    assert choose_splits(64, 16, 132, cfg) == 4  # 16 tiles, at least 4 per split
    assert choose_splits(8, 2048, 132, cfg) == 66
    assert choose_splits(512, 32, 132, cfg) == 1  # 512 programs already fill the units
    assert choose_splits(1, 10**6, 132, cfg) == 128  # capped
    assert choose_splits(64, 0, 132, cfg) == 1
    assert choose_splits(64, 3, 132, cfg) == 1  # less work than one split's minimum


def test_split_buffers_are_sized_from_the_group(device):
    layout = causal_layout(2, 256, block_m=32, block_n=64)
    q, k, v = random_qkv(3, 8, 2, 2, 256, 32, torch.float16, seed=0, device=device)
    launch = build_decode_launch(q, k, v, torch.empty_like(q), None, layout, DecodeConfig(32, 4, 1), sm_scale=1.0,
                                 num_splits=5)
    assert launch.grid == (5, 3 * 2)  # 2 groups of 4 heads per batch element
    assert launch.args["PartOut"].shape == (3, 2, 5, 8, 32)  # [B, groups, splits, 4 heads x 2 rows, D]
    assert launch.constexprs["BLOCK_M"] == 16 and launch.constexprs["GROUP"] == 4
    # fused (the default): the split kernel merges, one counter per (batch, group) program column
    assert launch.combine == "fused" and launch.combine_grid is None and launch.constexprs["FUSED"]
    assert launch.args["Counter"].shape == (3 * 2,) and not launch.args["Counter"].any()
    unfused = build_decode_launch(q, k, v, torch.empty_like(q), None, layout,
                                  DecodeConfig(32, 4, 1, fused_combine=False), sm_scale=1.0, num_splits=5)
    assert unfused.combine == "kernel" and unfused.combine_grid == (3 * 2,) and not unfused.constexprs["FUSED"]
    # the merge tile: the group's 8 rows (4 heads x 2 positions), no padding to tl.dot's 16
    assert unfused.combine_constexprs["BLOCK_M"] == 8 and unfused.combine_constexprs["GROUP"] == 4
    # the first pass's tile: the config's most splits (128), whatever this launch's 5
    assert launch.constexprs["MERGE_M"] == 8 and launch.constexprs["MERGE_SPLITS"] == 128
    one = build_decode_launch(q, k, v, torch.empty_like(q), None, layout, DecodeConfig(32, 4, 1), sm_scale=1.0,
                              num_splits=1)
    assert one.combine_grid is None and not one.constexprs["SPLIT"] and one.combine == "none"
    assert DecodeConfig(32, 4, 1).to_dict()["fused_combine"] is True  # what bundles record


def test_merge_splits_reads_the_lses_as_one_tile_up_to_the_cap():
    cfg = DecodeConfig(32, 4, 1)
    assert cfg.merge_lse_tile == 4096 and cfg.to_dict()["merge_lse_tile"] == 4096
    # one tile for every split count a shape can get (max_splits 128): one compiled variant
    assert [merge_splits(n, 16, cfg) for n in (1, 2, 3, 5, 8, 66, 128)] == [128] * 7
    assert merge_splits(129, 16, cfg) == 0  # a forced count past the config's most: the loop
    assert merge_splits(8, 64, cfg) == 0  # 128 x 64 rows past the cap: the loop, whatever the count
    fewer = dataclasses.replace(cfg, max_splits=60)
    assert merge_splits(3, 64, fewer) == 64 and merge_splits(60, 64, fewer) == 64  # 64 x 64 = the cap
    off = dataclasses.replace(cfg, merge_lse_tile=0)
    assert merge_splits(1, 16, off) == 0 and merge_splits(8, 16, off) == 0


# (layout, batch, heads_q, heads_kv, seq_q, seq_k, splits): empty splits and an empty row (ragged
# with 7 splits over two key tiles), a power of two, a count just past one (5 -> an 8-split tile
# with 3 masked rows), and a group whose 6 rows pad a 16-row tile.
MERGE_CASES = {
    "ragged-7": (lambda: padding_layout(1, 64, [64, 0], block_m=32, block_n=32), 2, 2, 1, 1, 64, 7),
    "causal-4": (lambda: causal_layout(1, 200, block_m=32, block_n=32), 1, 8, 2, 1, 200, 4),
    "window-5": (lambda: sliding_window_layout(3, 300, 150, block_m=32, block_n=32), 2, 4, 2, 3, 300, 5),
}


@pytest.mark.parametrize("combine", list(COMBINES))
@pytest.mark.parametrize("case", list(MERGE_CASES))
def test_lse_tile_merge_gives_the_loops_bits(case, combine, device):
    """The merge's first pass as one [MERGE_SPLITS, rows] tile against the split-by-split loop it
    replaces (``merge_lse_tile=0``, still the path past the cap): a max is exact in any order, so
    the output and LSE bits are equal, fused merge and combine kernel alike."""
    make, batch, heads_q, heads_kv, seq_q, seq_k, splits = MERGE_CASES[case]
    layout = make()
    q, k, v = random_qkv(batch, heads_q, heads_kv, seq_q, seq_k, 32, torch.float32, seed=7, device=device)
    # at most 8 splits: an 8-split tile, its lanes past 4, 5 or 7 splits masked
    tile_cfg = dataclasses.replace(combine_config(q, layout, COMBINES[combine]), max_splits=8)
    loop_cfg = dataclasses.replace(tile_cfg, merge_lse_tile=0)
    results = []
    for cfg, expected in ((tile_cfg, 8), (loop_cfg, 0)):
        launch = build_decode_launch(q, k, v, torch.empty_like(q), None, layout, cfg, sm_scale=1.0, num_splits=splits)
        merging = launch.constexprs if launch.combine == "fused" else launch.combine_constexprs
        assert merging["MERGE_SPLITS"] == expected
        results.append(run_decode(q, k, v, layout, decode=True, config=cfg, num_splits=splits, launch_cache=False))
    (out, lse), (loop_out, loop_lse) = results
    assert torch.equal(out, loop_out) and torch.equal(lse, loop_lse), \
        f"tile and loop merges differ: max {float((out.double() - loop_out.double()).abs().max())}"
    assert torch.isfinite(lse).any()
    if case == "ragged-7":  # the sequence with no key: 0 and LSE -inf through both merges
        assert torch.all(out[1] == 0) and torch.all(torch.isneginf(lse[1]))
    assert check_kernel_output(out, lse, q, k, v, layout).passed


@pytest.mark.parametrize("kwargs,message", [
    ({"decode": True, "_seq_q": MAX_ROWS + 1}, "decode path needs"),
    ({"decode": True, "num_splits": 0}, "num_splits must be an int >= 1"),
    ({"decode": False, "num_splits": 2}, "prefill path"),
    ({"decode": False, "config": DecodeConfig(32, 4, 1)}, "DecodeConfig needs the decode path"),
    ({"decode": True, "config": LaunchConfig(32, 32, 4, 1)}, "prefill config"),
])
def test_bad_requests_are_one_clear_error(kwargs, message, device):
    seq_q = kwargs.pop("_seq_q", 2)
    layout = causal_layout(seq_q, 64, block_m=128, block_n=32)
    q, k, v = random_qkv(1, 2, 1, seq_q, 64, 32, torch.float16, seed=0, device=device)
    with pytest.raises(ValueError, match=message):
        block_sparse_attention(q, k, v, layout, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1, 2, 3, 4, 7, 16, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16", "fp32"])
def test_gpu_every_split_count(splits, dtype, device):
    layout = causal_layout(1, 4000)
    q, k, v = random_qkv(2, 32, 8, 1, 4000, 128, dtype, seed=1, device=device)
    check_against_reference_and_prefill(q, k, v, layout, num_splits=splits)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["window", "sink", "ragged", "random"])
def test_gpu_sparse_and_ragged(kind, device):
    seq_k = 9000
    layout = {
        "window": sliding_window_layout(4, seq_k, 2048),
        "sink": sink_layout(4, seq_k, 2048, 4),
        "ragged": padding_layout(4, seq_k, [9000, 5000, 129, 0]),
        "random": random_layout(4, seq_k, 0.25, 2, causal=True),
    }[kind]
    q, k, v = random_qkv(4, 16, 4, 4, seq_k, 128, torch.bfloat16, seed=2, device=device)
    check_against_reference_and_prefill(q, k, v, layout)


def test_decode_benchmark_runs_checks_and_reports_on_cpu(device, capsys):
    """The benchmark's whole flow at toy sizes through the interpreter (CPU timings are a smoke
    test, not measurements): every row checked against the fp32 reference where it computes the
    layout's function, bytes counted from the kept blocks, and the document's table."""
    if device.type != "cpu":
        pytest.skip("the toy sizes are for the interpreter; the GPU run is bench/h200_run.sh")
    from bench import benchmark_decode as bench

    sizes = bench.Sizes(heads_q=4, heads_kv=2, head_dim=32, dense=((1, 200),), sparse_batch=2, sparse_seq=512,
                        window=128, ragged=(512, 100), threshold=(1, 20), threshold_shapes=((1, 256),),
                        copy_elements=1024)
    result = bench.run(sweep=False, threshold=True, variants=[{"block_n": 32}], check=True, flex=False,
                       device=device, sizes=sizes, uncached=True)
    rows = result["dense"] + result["sparse"] + result["ragged"]
    # the uncached call's rows: in the dense and sparse cases, the default call's error (the
    # interpreter ignores the cache; on a GPU test_kernels_launch_cache.py compares the bits)
    by = {(r["case"], r["impl"]): r for r in rows}
    uncached = [r for r in rows if r["impl"] == bench.UNCACHED]
    assert len(uncached) == len(result["dense"]) // 4 + len(result["sparse"]) // 3 == 4
    assert all(r["rel_l2_vs_fp32_ref"] == by[(r["case"], "parity decode")]["rel_l2_vs_fp32_ref"] for r in uncached)
    checked = [r for r in rows if r["rel_l2_vs_fp32_ref"] is not None]
    assert {r["impl"] for r in rows} >= {"parity decode", "parity prefill path", "SDPA", "SDPA (dense)"}
    assert all(r["rel_l2_vs_fp32_ref"] < 5e-3 for r in checked), checked  # bf16 rounding only
    assert not any(r["rel_l2_vs_fp32_ref"] is not None for r in rows if r["impl"].endswith("(dense)"))
    # Ragged lengths 512 and 100 in a 512 cache of 128-key blocks: 4 + 1 blocks are read, not 8.
    ragged = next(r for r in result["ragged"] if r["case"].startswith("ragged"))
    assert ragged["kv_bytes"] == (512 + 128) * 2 * 32 * 2 * 2
    assert [r["seq_q"] for r in result["threshold"]] == [1, 1, 20, 20]
    assert len(result["sweep"]) == 1 and result["sweep"][0]["config"].startswith("n32")
    table = bench.markdown(result)
    assert table.count("\n") == len(rows) + 1 and "| ragged B2 lengths 100..512 | parity decode |" in table
    assert bench.parse_variant("block_n=32,num_stages=2") == {"block_n": 32, "num_stages": 2}
    for bad in ("block_m=32", "block_n=x", "block_n=0", "block_n=32,block_n=64", ","):
        with pytest.raises(ValueError):
            bench.parse_variant(bad)


@pytest.mark.parametrize("path", ["prefill one loop", "decode"])
def test_amd_index_select_gives_the_same_bits(path, device):
    """``SELECT_LOADED`` (the launcher sets it on AMD: Triton 3.6's buffer-load conversion aborts on
    a load through a selected pointer, so each tile's block index is read from both lists and the
    value selected) computes what the pointer select does: the same bits, on a layout with full and
    partial tiles (the interpreter runs the kernel either way)."""
    from parity.kernels import triton_attention
    from parity.kernels.launch import build_launch
    from parity.kernels.launch_cache import LaunchStep
    from parity.kernels.decode import decode_steps

    if device.type != "cpu":
        pytest.skip("the interpreter's case: on a GPU the launcher picks the form by the vendor")
    decode = path == "decode"
    seq_q = 2 if decode else 96
    layout = sliding_window_layout(seq_q, 160, 50, block_m=32, block_n=32)
    q, k, v = random_qkv(2, 4, 2, seq_q, 160, 32, torch.float16, seed=3, device=device)
    outs = []
    for amd in (False, True):
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:3], float("nan"), device=device)
        if decode:
            launch = build_decode_launch(q, k, v, out, lse, layout, DecodeConfig(32, 4, 1), sm_scale=0.2,
                                         num_splits=3, amd=amd)
            assert launch.constexprs["SELECT_LOADED"] is amd
            for step in decode_steps(launch):
                step.dispatch()
        else:
            cfg = LaunchConfig(32, 32, 4, 1, one_loop=True)
            launch = build_launch(q, k, v, out, lse, layout, cfg, sm_scale=0.2, amd=amd)
            assert launch.constexprs["SELECT_LOADED"] is amd
            LaunchStep(triton_attention.block_sparse_attn_fwd, launch.grid, launch.args, launch.constexprs,
                       launch.options).dispatch()
        assert not out.isnan().any() and not lse.isnan().any()
        outs.append((out, lse))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert check_kernel_output(outs[1][0], outs[1][1], q, k, v, layout, sm_scale=0.2).passed


def _decode_entries():
    """Every (entry, its split step's arguments by name) the launcher's decode caches hold."""
    from parity.kernels import attention

    found = []
    for path in ("decode", "decode-borrowed"):
        cache = attention._LAUNCH_CACHES.get(path)
        for _, entries in (cache._by_layout.values() if cache is not None else ()):
            for entry in entries.values():
                split = entry.steps[0]
                found.append((path, dict(zip(split.names, split.values))))
    return found


@pytest.mark.parametrize("combine", list(COMBINES))
def test_plan_hits_keep_their_buffers_give_the_same_bits_and_leave_counters_at_zero(combine, device):
    """Two calls through the launch cache (a miss, then a hit on the same entry, whose counters it
    keeps, and its partial buffers where the call is one launch): the same bits as each other and as an uncached call, every
    output row written (poisoned buffers), and the entry's arrival counters 0 after each call."""
    from parity.kernels import attention

    if device.type != "cpu":
        pytest.skip("the interpreter's entries; on a GPU test_gpu_fused_merge_repeats_and_replays checks the bits")
    attention._LAUNCH_CACHES.clear()
    layout = sliding_window_layout(2, 300, 150, block_m=32, block_n=32)
    q, k, v = random_qkv(2, 4, 2, 2, 300, 32, torch.float32, seed=5, device=device)
    cfg = combine_config(q, layout, COMBINES[combine])
    cache = attention._launch_cache("decode")
    outs = []
    for call in range(2):
        hits = cache.hits
        outs.append(run_decode(q, k, v, layout, decode=True, config=cfg, num_splits=4))
        assert cache.hits == hits + call  # the second call is a hit
        (path, args), = _decode_entries()
        assert path == "decode"
        if COMBINES[combine]:  # one launch: the entry keeps its workspace
            assert args["PartOut"].shape[2] == 4
        else:  # two launches: the workspace is made per call (another thread may launch between them)
            assert args["PartOut"] is None and args["PartLse"] is None
        assert args["Counter"].shape == ((2 * 2,) if COMBINES[combine] else (1,))
        assert not args["Counter"].any(), args["Counter"]
    uncached = run_decode(q, k, v, layout, decode=True, config=cfg, num_splits=4, launch_cache=False)
    for out, lse in outs[1:] + [uncached]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])
    assert check_kernel_output(*outs[0], q, k, v, layout).passed


def test_an_interrupted_decode_launch_drops_the_plans(device, monkeypatch):
    """A decode launch that raises (an interrupt may stop the interpreter's grid halfway, counters
    counted but not reset) drops every decode plan: the next call builds one from zeroed counters
    and computes the right result."""
    from parity.kernels import attention

    if device.type != "cpu":
        pytest.skip("an interrupted grid is the interpreter's case")
    attention._LAUNCH_CACHES.clear()
    layout = causal_layout(1, 200, block_m=32, block_n=32)
    q, k, v = random_qkv(1, 4, 2, 1, 200, 32, torch.float32, seed=6, device=device)
    before = run_decode(q, k, v, layout, decode=True, num_splits=3)
    (_, args), = _decode_entries()
    args["Counter"].fill_(1)  # what a grid stopped after one arrival leaves
    cache = attention._launch_cache("decode")

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cache, "issue", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_decode(q, k, v, layout, decode=True, num_splits=3)  # the first call's key: a hit
    assert "decode" not in attention._LAUNCH_CACHES and _decode_entries() == []
    after = run_decode(q, k, v, layout, decode=True, num_splits=3)
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
    (_, args), = _decode_entries()
    assert not args["Counter"].any()


def test_the_operator_plans_allocate_their_buffers_per_call(device):
    """The operator's calls (``attention_from_tensors``, ``borrowed_only``) keep nothing they
    allocated in a plan: their decode plans make the partial buffers and zeroed counters anew on
    every hit, and a hit gives the bits of the first call."""
    from parity.kernels import attention

    if device.type != "cpu":
        pytest.skip("the interpreter's entries")
    attention._LAUNCH_CACHES.clear()
    layout = causal_layout(1, 300, block_m=32, block_n=32)
    q, k, v = random_qkv(1, 4, 2, 1, 300, 32, torch.float32, seed=7, device=device)
    tensors = (layout.kv_num_blocks, layout.kv_indices, layout.full_kv_num_blocks, layout.full_kv_indices,
               layout.q_doc, layout.k_doc, layout.k_start, layout.k_end, layout.mask_bits)
    mask = layout.mask
    meta = (layout.block_m, layout.block_n, mask.causal, mask.window, mask.sink_tokens, mask.offset)
    first = attention.attention_from_tensors(q, k, v, tensors, meta, None, True)
    cache = attention._launch_cache("decode-borrowed")
    second = attention.attention_from_tensors(q, k, v, tensors, meta, None, True)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert check_kernel_output(*second, q, k, v, layout).passed
    assert cache.hits == 1
    (path, args), = _decode_entries()
    assert path == "decode-borrowed"
    assert all(args[name] is None for name in ("PartOut", "PartLse", "Counter"))  # made per hit, not kept


# The GPU rows of the decode table: (batch, cache length); Hq=32, Hkv=8, D=128, bf16.
GPU_ROWS = [(1, 4096), (8, 4096), (1, 131072), (8, 131072)]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,seq_k", GPU_ROWS, ids=lambda x: str(x))
def test_gpu_fused_merge_repeats_and_replays(batch, seq_k, device):
    """Every split count 1..max_splits: the fused merge 20 times (a race between the last program
    and a late split's write shows as a rare difference: every repeat must give the same bits),
    the combine kernel once (the same bits), the fp64 reference (within the rule's bound), and the
    fused call replayed from a CUDA graph (the same bits; the graph zeroes its own counters)."""
    layout = causal_layout(1, seq_k)
    q, k, v = random_qkv(batch, 32, 8, 1, seq_k, 128, torch.bfloat16, seed=3, device=device)
    fused = combine_config(q, layout, True)
    reference = kernel_reference(q, k, v, layout)  # once: at 128k the fp64 reference is the slow part
    for splits in range(1, fused.max_splits + 1):
        first = run_decode(q, k, v, layout, decode=True, config=fused, num_splits=splits)
        for _ in range(19):
            again = run_decode(q, k, v, layout, decode=True, config=fused, num_splits=splits)
            assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1]), f"{splits} splits"
        unfused = run_decode(q, k, v, layout, decode=True, config=combine_config(q, layout, False),
                             num_splits=splits)
        assert torch.equal(unfused[0], first[0]) and torch.equal(unfused[1], first[1]), f"{splits} splits"
        check = check_kernel_output(*first, q, k, v, layout, reference=reference)
        assert check.passed, f"{splits} splits: {check}"
    layout = layout.to(device)  # a graph cannot copy a host layout to the GPU while it records
    for splits in (2, 7, fused.max_splits):
        eager = run_decode(q, k, v, layout, decode=True, config=fused, num_splits=splits)
        out = torch.full_like(q, float("nan"))
        # the captured call's own form once outside the capture: Triton compiles it there
        block_sparse_attention(q, k, v, layout, decode=True, config=fused, num_splits=splits, out=out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            block_sparse_attention(q, k, v, layout, decode=True, config=fused, num_splits=splits, out=out)
        for _ in range(20):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager[0]), f"graph replay, {splits} splits"
