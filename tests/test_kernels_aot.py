"""Ahead-of-time compilation (kernels.aot, ``python -m parity inspect``): compile-only checks.

Nothing here runs on a GPU: the kernel is compiled for gfx942 and sm_90 on this CPU machine and
the compiler's output is checked. Every config is compiled once, in one parallel batch, by a
module-scoped fixture that sets TRITON_INTERPRET=1 to prove the interpreter setting of the CPU
test suite does not leak into the compile.
"""
from __future__ import annotations

import json

import pytest

from parity.base import dtypes, jsonformat
from parity.run import platform
from parity.cli.main import main
from parity.kernels import aot, targets

GFX942_CASES = [("gfx942", dtype, head_dim) for dtype in ("fp16", "bf16") for head_dim in (64, 128, 256)]
SM90_CASE = ("sm_90", "bf16", 128)


def case_id(case) -> str:
    target, dtype, head_dim = case
    return f"{target}-{dtype}-D{head_dim}"


@pytest.fixture(scope="module")
def compiled():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        results = aot.inspect_cases(GFX942_CASES + [SM90_CASE])
    return {(r.target, r.dtype, r.head_dim): r for r in results}


def describe(r) -> str:
    return json.dumps(r.to_dict(), indent=1, default=str)


@pytest.mark.parametrize("case", GFX942_CASES, ids=case_id)
def test_gfx942_config_compiles_to_mfma(compiled, case):
    r = compiled[case]
    assert r.error is None, r.error
    opcode_suffix = {"fp16": "_f16", "bf16": "_bf16"}[r.dtype]
    assert r.matrix_instructions, f"no MFMA instructions:\n{describe(r)}"
    assert all(op.startswith("v_mfma_") and op.endswith(opcode_suffix) for op in r.matrix_instructions), \
        r.matrix_instructions
    # The launcher's pinned config, not something else.
    target, dtype, head_dim = case
    assert r.config == aot.pinned_config(target, dtype, head_dim).clamp(128, 128).to_dict()
    assert r.overrides == {}


@pytest.mark.parametrize("case", GFX942_CASES, ids=case_id)
def test_gfx942_config_lds_within_64kib(compiled, case):
    r = compiled[case]
    assert r.error is None, r.error
    lds = r.shared_bytes + r.static_shared_bytes
    assert 0 < lds <= 64 * 1024, f"LDS {lds} B per workgroup:\n{describe(r)}"
    assert r.shared_limit_bytes == platform.arch_spec("gfx942").shared_mem_bytes == 64 * 1024


@pytest.mark.parametrize("case", GFX942_CASES, ids=case_id)
def test_gfx942_config_does_not_spill(compiled, case):
    r = compiled[case]
    assert r.error is None, r.error
    assert r.scratch_bytes == 0, (
        f"{case_id(case)} with {r.config}: {r.vgpr_spills} VGPR and {r.sgpr_spills} SGPR spills, "
        f"{r.scratch_bytes} B scratch per lane, {r.total_vgprs} VGPRs (AGPRs {r.agprs}); "
        f"try `python -m parity inspect --target gfx942 --dtype {r.dtype} --head-dim {r.head_dim} --set ...`")
    assert r.waves_per_simd >= 1
    assert r.passed, r.problems


def test_sm90_bf16_uses_tensor_cores(compiled):
    r = compiled[SM90_CASE]
    assert r.error is None, r.error
    assert any(op.startswith(("wgmma.mma_async", "mma.sync")) for op in r.matrix_instructions), describe(r)
    assert all(".bf16" in op for op in r.matrix_instructions)
    assert r.wgmma is any(op.startswith("wgmma") for op in r.matrix_instructions)
    assert r.registers and r.registers <= 255
    assert r.shared_bytes <= platform.arch_spec("sm_90").shared_mem_bytes
    # The pinned config stays in registers (the earlier 128x128 tile spilled 2-6 registers).
    assert r.spills == 0 and r.scratch_bytes == 0, describe(r)
    assert r.passed, r.problems
    # occupancy from the same counts: 8 warps of r.registers each against the SM's 64 Ki registers
    per_cta = -(-r.registers * 32 // 256) * 256 * r.config["num_warps"]
    assert r.blocks_per_sm_by["by_registers"] == 65536 // per_cta
    assert r.blocks_per_sm == min(r.blocks_per_sm_by.values()) >= 1


def test_sm90_exp2_overlap_is_read_from_the_machine_code(compiled):
    """The pinned D=128 kernel: each thread of the 8 warps computes its share of the 128x128
    tile's exponentials (64) plus the rescale factors; the reading of its SASS is recorded and
    named in a note. In the kernel's usual order none of them can issue while a product runs:
    the scores' wait also drains the previous P @ V (bench/BENCHMARK.md)."""
    r = compiled[SM90_CASE]
    overlap = r.exp2_overlap
    tile = r.config["block_m"] * r.config["block_n"] // (32 * r.config["num_warps"])
    assert tile <= overlap["exp2"] <= tile + 4, overlap
    assert overlap["exp2_while_mma"] == 0 and set(overlap["waits"]) == {"0"}, overlap
    assert overlap["loop_exp2"] == overlap["exp2"], overlap  # one loop, nothing peeled
    assert (f"exp2 that can issue while a wgmma product may run: 0 of {overlap['exp2']}, in loops 0 of "
            f"{overlap['exp2']}") in r.notes
    assert all(compiled[case].exp2_overlap is None for case in GFX942_CASES)  # an NVIDIA-only reading
    # the report's schema takes the field
    from jsonschema import Draft202012Validator

    schema = jsonformat.schema_for(jsonformat.INSPECT_REPORT)
    Draft202012Validator({"$ref": "#/$defs/result", "$defs": schema["$defs"]}).validate(r.to_dict())


def test_pipelining_probe_sees_the_overlap_where_the_order_allows_it():
    """``python -m bench.probe_pipelining`` at D=64: the usual order lets no exponential
    issue while a product runs; folding the rescale into the lagged P @ V lets every one in the
    loop body (half: the last tile's softmax is peeled out of the loop); the control (a product
    that only feeds the next one's accumulator) lets all. The other two orders depend on how
    ptxas schedules and are reported, not asserted."""
    from bench import probe_pipelining

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")  # the probe's compiles must not inherit it
        rows = probe_pipelining.probe([64])
    by_order = {row["order"]: row for row in rows}
    assert list(by_order) == list(probe_pipelining.ORDERS)
    for row in rows:
        assert "error" not in row, row
        assert row["exp2"] >= 128 * 64 // 256 and row["spill_bytes"] == 0 and 0 < row["registers"] <= 255, row
    assert by_order["usual"]["exp2_while_mma"] == 0, by_order["usual"]
    folded = by_order["pv behind, rescale in product"]
    assert folded["loop_exp2_while_mma"] == folded["loop_exp2"] == folded["exp2_while_mma"] == folded["exp2"] // 2 > 0
    control = by_order["control"]
    assert control["exp2_while_mma"] == control["exp2"] and int(max(control["waits"], key=int)) >= 1, control


def test_flatten_probe_fuses_a_persistent_loop_only_with_a_uniform_trip_count():
    """``tl.range(..., flatten=True)`` around the key loop changes the sm_90 code when every tile
    runs the same number of key steps (the control) and leaves it unchanged when the count is
    loaded per tile, as a block-sparse layout's is: a persistent grid would not pipeline across
    this kernel's tiles (bench/BENCHMARK.md)."""
    from bench import probe_pipelining

    rows = probe_pipelining.probe_flatten()
    assert [(row["trip_count"], row.get("verdict"), row.get("error")) for row in rows] == [
        ("per tile", "ignored", None), ("uniform", "flattened", None)]


@pytest.mark.parametrize("regs, warps, shared, expected", [
    (255, 4, 112 * 1024, {"blocks": 2, "by_registers": 2, "by_shared": 2, "by_warps": 16}),  # Flex's D=64 shape
    (152, 8, 64 * 1024, {"blocks": 1, "by_registers": 1, "by_shared": 3, "by_warps": 8}),  # 152*32 -> 4864 regs/warp
    (128, 4, 0, {"blocks": 4, "by_registers": 4, "by_shared": 228, "by_warps": 16}),
    (32, 1, 0, {"blocks": 32, "by_registers": 64, "by_shared": 228, "by_warps": 64}),  # the 32-CTA cap
    (128, 4, 120 * 1024, {"blocks": 1, "by_registers": 4, "by_shared": 1, "by_warps": 16}),  # 2 x 121 KiB > 228
])
def test_nvidia_ctas_per_sm(regs, warps, shared, expected):
    got = platform.arch_spec("sm_90").sm_resources.blocks_per_sm(regs, warps, shared)
    assert got == expected


# ---- the compile uses what the launcher would pass ---------------------------------------------

class _RecordingKernel:
    """Stands in for block_sparse_attn_fwd and records the launcher's call instead of running."""

    def __init__(self, kernel):
        self.fn = kernel.fn  # the signature the launch builder checks its arguments against

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.grid, self.args, self.kwargs = grid, args, kwargs
        return launch


@pytest.mark.parametrize("case", [("gfx942", "bf16", 128), ("gfx942", "fp32", 64), ("sm_90", "fp16", 256)],
                         ids=case_id)
def test_arguments_match_a_recorded_launcher_call(monkeypatch, case):
    import torch

    from parity.kernels import attention, layout as layouts, triton_attention

    target, dtype, head_dim = case
    problem = aot.Problem(batch=2, heads_q=8, heads_kv=2, seq_q=1000, seq_k=1000, sparse_block=64)
    args, constexprs, options, _ = aot.launch_arguments(target, dtype, head_dim, problem)
    recorder = _RecordingKernel(triton_attention.block_sparse_attn_fwd)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(triton_attention, "block_sparse_attn_fwd", recorder)
    # The launcher asks the kernel's targets module which architecture and vendor the device is:
    # answer the target's.
    monkeypatch.setattr(targets, "arch_of", lambda device: target)
    monkeypatch.setattr(targets, "vendor_of", lambda device: targets.arch_spec(target).vendor)
    # AMD gets the Triton 3.6 work-around for loads through a selected pointer (kernels/triton_attention.py)
    assert constexprs["SELECT_LOADED"] is (target == "gfx942")
    meta = torch.device("meta")
    tdtype = dtypes.torch_dtype(dtype)
    q = torch.empty(2, 8, 1000, head_dim, dtype=tdtype, device=meta)
    k = torch.empty(2, 2, 1000, head_dim, dtype=tdtype, device=meta)
    layout = layouts.causal_layout(1000, 1000, block_m=64, block_n=64)
    attention.block_sparse_attention(q, k, torch.empty_like(k), layout, return_lse=True)

    # Every argument by name: runtime ones, constexprs, then compiler options.
    assert recorder.args == ()
    recorded_args = {name: value for name, value in recorder.kwargs.items() if name in args}
    recorded_constexprs = {name: value for name, value in recorder.kwargs.items() if name in constexprs}
    recorded_options = {name: value for name, value in recorder.kwargs.items()
                        if name not in constexprs and name not in args}
    assert recorded_constexprs == constexprs
    assert recorded_options == options
    assert list(recorded_args) == list(args)
    assert recorder.grid == (2 * 8 * -(-1000 // constexprs["BLOCK_M"]),)
    for (name, ours), theirs in zip(args.items(), recorded_args.values()):
        if isinstance(ours, torch.Tensor):
            assert (ours.dtype, ours.shape, ours.stride()) == (theirs.dtype, theirs.shape, theirs.stride()), name
        elif isinstance(ours, float):
            assert ours == pytest.approx(theirs, rel=1e-12), name
        else:
            assert ours == theirs, name


@pytest.fixture(scope="module")
def compiled_decode():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        results = aot.inspect_cases([("gfx942", "bf16", 128), ("sm_90", "bf16", 128)], problem=aot.DECODE_PROBLEM,
                                    kernel="decode")
    return {r.target: r for r in results}


@pytest.mark.parametrize("target", ["gfx942", "sm_90"])
def test_decode_kernel_compiles_spill_free_with_matrix_instructions(compiled_decode, target):
    r = compiled_decode[target]
    assert r.kernel == "decode" and r.config["path"] == "decode", describe(r)
    assert r.passed, describe(r)
    assert r.spills == 0 and not r.scratch_bytes, describe(r)
    prefix = "v_mfma_" if target == "gfx942" else "mma.sync"
    assert any(op.startswith(prefix) for op in r.matrix_instructions), describe(r)
    # One token of a 32:8 GQA group: 4 query rows padded to the 16-row tile, split programs.
    assert r.constexprs["GROUP"] == 4 and r.constexprs["BLOCK_M"] == 16 and r.constexprs["SPLIT"] is True
    assert r.constexprs["SELECT_LOADED"] is (target == "gfx942")
    # The launcher's split count on the target's flagship part: 8 x 8 (batch x K/V heads) programs,
    # about 4 per compute unit in whole waves: 132 x 4 // 64 = 8 on an H200, 304 x 4 // 64 = 19 on MI300X.
    splits = {"sm_90": 8, "gfx942": 19}[target]
    assert f"{splits} splits of the key range" in " ".join(r.notes), describe(r)
    # The fused merge: one arrival atomic with release/acquire at device scope, the counter's
    # reset, and loads of the other splits' partials that bypass L1 (sm_90: ld.global.cg;
    # gfx942: the acquire's buffer_inv invalidates the stale lines, the release's buffer_wbl2
    # writes the partials back to the level every compute unit reads).
    assert r.constexprs["FUSED"] is True
    if target == "sm_90":
        assert any(op.startswith("atom.") and ".acq_rel" in op and ".gpu" in op and ".add" in op
                   for op in r.atomics), r.atomics
        assert any(op.startswith("atom.") and ".exch" in op for op in r.atomics), r.atomics
        assert any(op.startswith("ld.global.cg") for op in r.atomics), r.atomics
    else:
        assert {"global_atomic_add", "global_atomic_swap", "buffer_inv", "buffer_wbl2"} <= set(r.atomics), r.atomics


def test_decode_refuses_prefill_overrides(capsys):
    assert main(["inspect", "--kernel", "decode", "--set", "block_n=32", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--kernel decode" in err[0]


# ---- reading the AMD code object (no compile) --------------------------------------------------

_AMDGCN_WITH_AGPRS = """\
\tv_mfma_f32_16x16x16_bf16 a[0:3], v[0:1], v[2:3], a[0:3]
\tv_mfma_f32_16x16x16_bf16 a[4:7], v[0:1], v[4:5], a[4:7]
; NumVgprs: 256
; NumAgprs: 166
; TotalNumVgprs: 422
; Occupancy: 1
amdhsa.kernels:
  - .agpr_count:     166
    .group_segment_fixed_size: 0
    .private_segment_fixed_size: 0
    .sgpr_count:     102
    .sgpr_spill_count: 0
    .vgpr_count:     422
    .vgpr_spill_count: 0
"""


def _amd_result(num_warps: int, shared: int) -> aot.AotResult:
    return aot.AotResult(target="gfx942", vendor="amd", dtype="bf16", head_dim=128,
                         config={"num_warps": num_warps}, shared_bytes=shared, shared_limit_bytes=64 * 1024)


def test_amd_occupancy_counts_agprs_in_the_unified_register_file():
    r = _amd_result(num_warps=4, shared=32 * 1024)
    aot._read_amdgcn(r, _AMDGCN_WITH_AGPRS, platform.arch_spec("gfx942"))
    assert r.matrix_instructions == {"v_mfma_f32_16x16x16_bf16": 2}
    assert (r.vgprs, r.agprs, r.total_vgprs, r.sgprs) == (256, 166, 422, 102)
    assert r.waves_per_simd_vgpr == 1  # 422 of 512 registers per lane: one wave
    assert r.waves_per_simd_lds == 2  # 2 workgroups of 32 KiB per CU, 4 waves each over 4 SIMDs
    assert r.waves_per_simd == 1 == r.compiler_occupancy


def test_amd_occupancy_by_lds_is_capped_by_wave_slots():
    r = _amd_result(num_warps=8, shared=8 * 1024)
    asm = _AMDGCN_WITH_AGPRS.replace("422", "64").replace("166", "0").replace("NumVgprs: 256", "NumVgprs: 64")
    aot._read_amdgcn(r, asm, platform.arch_spec("gfx942"))
    assert (r.total_vgprs, r.waves_per_simd_vgpr) == (64, 8)
    assert r.waves_per_simd_lds == 8  # 8 workgroups x 8 waves / 4 SIMDs = 16, capped at 8 slots
    aot._judge(r)
    assert r.passed, r.problems


def test_spills_into_registers_are_a_note_and_spills_to_scratch_fail():
    r = _amd_result(num_warps=4, shared=16 * 1024)
    aot._read_amdgcn(r, _AMDGCN_WITH_AGPRS.replace(".sgpr_spill_count: 0", ".sgpr_spill_count: 7"),
                     platform.arch_spec("gfx942"))
    aot._judge(r)
    assert r.passed and r.notes == ["0 VGPR + 7 SGPR spills into registers (no scratch)"]
    r = _amd_result(num_warps=4, shared=16 * 1024)
    asm = (_AMDGCN_WITH_AGPRS.replace(".vgpr_spill_count: 0", ".vgpr_spill_count: 12")
           .replace(".private_segment_fixed_size: 0", ".private_segment_fixed_size: 52"))
    aot._read_amdgcn(r, asm, platform.arch_spec("gfx942"))
    aot._judge(r)
    assert not r.passed and "12 VGPR" in r.problems[0] and "52 B per lane" in r.problems[0]


# ---- the CLI -----------------------------------------------------------------------------------


def test_cli_prints_the_table_and_exits_by_the_verdict(capsys, tmp_path, compiled):
    # A case the fixture compiled: Triton's cache makes this a cache hit.
    report = tmp_path / "aot.json"
    status = main(["inspect", "--target", "gfx942", "--dtype", "bf16", "--head-dim", "64", "--json", str(report)])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("ahead-of-time compilation only (no GPU executed")
    assert lines[1].startswith("| target") and "matrix instructions" in lines[1] and "waves/SIMD" in lines[1]
    row = next(line for line in lines if line.startswith("| gfx942"))
    assert "| bf16" in row and "v_mfma_f32_16x16x16_bf16" in row
    document = json.loads(report.read_text())
    assert status == (0 if document["passed"] else 1)
    assert ("| ok" in row) == document["passed"]
    assert document["passed"] == compiled[("gfx942", "bf16", 64)].passed


def test_cli_json_to_stdout_has_the_fields(capsys):
    status = main(["inspect", "--target", "gfx942", "--dtype", "fp16", "--head-dim", "64", "--json", "-"])
    document = json.loads(capsys.readouterr().out)
    assert document["compile_only"] is True and "no GPU executed" in document["note"]
    assert status == (0 if document["passed"] else 1)
    (result,) = document["results"]
    for field in ("target", "dtype", "head_dim", "config", "matrix_instructions", "vgprs", "agprs",
                  "total_vgprs", "sgprs", "vgpr_spills", "sgpr_spills", "scratch_bytes", "shared_bytes",
                  "static_shared_bytes", "shared_limit_bytes", "waves_per_simd_vgpr", "waves_per_simd_lds",
                  "waves_per_simd", "compiler_occupancy", "problems", "notes", "passed", "compile_seconds"):
        assert field in result, field
    assert (result["target"], result["dtype"], result["head_dim"]) == ("gfx942", "fp16", 64)
    assert result["config"]["waves_per_eu"] == dict(aot.pinned_config("gfx942", "fp16", 64).amd)["waves_per_eu"]


@pytest.mark.parametrize("argv, needle", [
    (["--target", "gfx000"], "unknown target 'gfx000'"),
    (["--dtype", "fp8"], "unknown dtype 'fp8'"),
    (["--head-dim", "48"], "head_dim 48 is not supported"),
    (["--set", "tiles=3"], "unknown config key 'tiles'"),
    (["--head-dim", "abc"], "invalid int value: 'abc'"),
], ids=["target", "dtype", "head-dim", "set-key", "head-dim-not-int"])
def test_cli_bad_argument_is_one_line_and_exit_2(capsys, argv, needle):
    status = main(["inspect", *argv])
    captured = capsys.readouterr()
    assert status == 2
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("parity: error: ") and needle in captured.err


def test_cli_progress_on_stderr_unless_quiet(capsys):
    argv = ["inspect", "--target", "gfx942", "--dtype", "fp16", "--head-dim", "64", "--json", "-"]
    status = main(argv)
    captured = capsys.readouterr()
    assert status in (0, 1) and json.loads(captured.out)["results"]
    assert captured.err == "parity inspect: compiling 1 config ahead of time for gfx942\n"
    status = main([*argv, "--quiet"])
    captured = capsys.readouterr()
    assert status in (0, 1) and json.loads(captured.out)["results"] and captured.err == ""


def test_code_digest_ignores_line_info_and_debug_sections_only():
    ptx = """.version 8.7
.target sm_90a
\t.loc\t1 42 7
$L__tmp3:
\tmul.wide.s32 \t%rd1, %r1, 2;
\tadd.s64 \t%rd2, %rd3, %rd1;
\t.file\t1 "/somewhere/triton_attention.py"
\t.section\t.debug_abbrev
\t{
.b8 1
\t}
"""
    moved = (ptx.replace("42 7", "57 3").replace("$L__tmp3", "$L__tmp9").replace("/somewhere", "/elsewhere")
             .replace(".b8 1", ".b8 2"))
    assert aot.code_digest(ptx) == aot.code_digest(moved)
    assert aot.code_digest(ptx) != aot.code_digest(ptx.replace("add.s64", "sub.s64"))
    amdgcn = "\ts_load_dwordx2 s[0:1], s[4:5], 0x0\n.Ltmp7:\n\tv_mfma_f32_16x16x16_bf16 v[0:3], v[4:5], v[6:7], 0\n"
    assert aot.code_digest(amdgcn) == aot.code_digest(amdgcn.replace(".Ltmp7", ".Ltmp2"))


def test_compiled_results_carry_a_code_digest(compiled):
    digests = [r.code_digest for r in compiled.values() if r.error is None]
    assert digests and all(isinstance(d, str) and len(d) == 12 for d in digests)


def test_the_compiled_config_is_the_launchers_for_the_problems_blocks():
    """``parity inspect`` compiles what the launcher runs for the problem's blocks: on 64-row
    blocks sm_90's small-tile row (64x64, 4 warps), not the pinned 128 x 128 8-warp tile shrunk
    (the recorded-call test above cannot cover it: the launcher takes no TMA on meta tensors)."""
    import torch

    from parity.kernels import configs

    for target, head_dim in (("sm_90", 128), ("sm_90", 64), ("gfx942", 128)):
        for block in (64, 128):
            config = aot.launch_arguments(target, "bf16", head_dim, aot.Problem(sparse_block=block))[3]
            assert config == configs.config_for_blocks(target, head_dim, torch.bfloat16, block, block), (target, block)
    assert aot.launch_arguments("sm_90", "bf16", 128, aot.Problem(sparse_block=64))[3].num_warps == 4
