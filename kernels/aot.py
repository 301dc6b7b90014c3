"""Ahead-of-time (compile-only) inspection of the attention kernel for GPUs that are not present.

``inspect_configs`` compiles ``triton_attention.block_sparse_attn_fwd`` for a target (gfx942,
gfx90a, gfx950, sm_80, sm_90) with exactly the arguments, constexprs and launch options the
launcher (``kernels.attention.block_sparse_attention``) would pass on that GPU, and reads the
compiler's output: matrix instructions, registers, spills, shared memory/LDS, occupancy. Nothing
runs on a GPU: every number is what the compiler says, not a measurement.

Why compile in child processes: with ``TRITON_INTERPRET=1`` (the CPU test setting), ``@triton.jit``
returns interpreter objects that ``triton.compile`` cannot lower, and the interpreter patches
``triton.language`` while kernels run. Each compile therefore runs in a fresh
``python -m parity.kernels.aot`` process whose environment lacks ``TRITON_INTERPRET``; this leaves
the caller's process and environment untouched and spreads configs over the available cores.
Triton's own on-disk cache is used as usual (a repeated config is a cache hit); nothing else is
written.

How the launcher's specialization is reproduced: the launcher's JIT specializes every non-constexpr
argument at launch (an int equal to 1 becomes a constexpr, ints and pointers divisible by 16 get
``tt.divisibility``, on HIP pointers to tensors under 2 GiB get ``tt.pointer_range`` for buffer
loads). ``launch_arguments`` calls the launcher's own argument builder (``kernels.launch``) for a
representative problem (``Problem``: contiguous [B, H, S, D] meta tensors and a causal layout)
and ``_specialize`` applies Triton's own ``native_specialize_impl`` with the
target's backend, so the compiled code is the code the launcher would get for that problem.
tests/test_kernels_aot.py checks this against a recorded launcher call.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

from . import dtypes, targets
from .sass_schedule import exp2_overlap

__all__ = [
    "DTYPES", "TARGETS", "Problem", "AotResult", "inspect_configs", "inspect_cases", "launch_arguments",
    "expects_matrix_unit", "kernel_source_digest", "pinned_config", "check_request", "RequestError", "KERNELS",
    "DECODE_PROBLEM", "code_digest", "cubin_resources", "cubin_sass",
]

# Compile targets; each must have an ArchSpec in kernels.targets and rows in kernels.configs.
TARGETS = ("gfx942", "gfx90a", "gfx950", "sm_80", "sm_90")
DTYPES = dtypes.KERNEL_DTYPES
_RESULT_MARK = "PARITY-AOT-RESULT "
# CDNA: 4 SIMDs per compute unit share its LDS; waves of a workgroup are spread over them.
_SIMDS_PER_CU = 4


@dataclasses.dataclass(frozen=True)
class Problem:
    """The representative launch whose specialization is compiled (shapes change the code only
    through Triton's specialization: ints equal to 1 and divisibility by 16)."""

    batch: int = 4
    heads_q: int = 16
    heads_kv: int = 16
    seq_q: int = 4096
    seq_k: int = 4096
    sparse_block: int = 128  # the layout's block size (kernels.layout's default)
    window: int = 0  # 0: causal layout; > 0: causal sliding-window layout
    # The capture path records LSE; the LSE store is the heavier variant, so it is the default.
    return_lse: bool = True

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# The kernels ``inspect`` can compile: the prefill kernel and the decode path's split kernel.
KERNELS = ("prefill", "decode")
# The decode path's representative launch: one token against a 32k cache, GQA 32:8, split as the
# launcher would split it on the target (the split variant, which writes partial outputs, is the
# heavier one).
DECODE_PROBLEM = Problem(batch=8, heads_q=32, heads_kv=8, seq_q=1, seq_k=32768)


@dataclasses.dataclass
class AotResult:
    """One compiled (target, dtype, head_dim) config and its verdict. Compile-only: no GPU ran."""

    target: str
    vendor: str
    dtype: str
    head_dim: int
    config: dict[str, Any]  # LaunchConfig.to_dict() after the launcher's clamp to the layout
    overrides: dict[str, int] = dataclasses.field(default_factory=dict)  # {} = the pinned config
    constexprs: dict[str, Any] = dataclasses.field(default_factory=dict)
    problem: dict[str, Any] = dataclasses.field(default_factory=dict)
    # opcode -> count: v_mfma_* (AMD), mma.sync.* / wgmma.mma_async.* (NVIDIA PTX)
    matrix_instructions: dict[str, int] = dataclasses.field(default_factory=dict)
    matrix_unit_expected: bool = True
    wgmma: bool | None = None  # sm_90 only: whether Hopper's warpgroup MMA is used
    # Registers. AMD: per-lane arch VGPRs, AGPRs, their sum in the unified file (gfx90a and later:
    # alignTo(vgpr, 4) + agpr, the figure occupancy depends on) and SGPRs. NVIDIA: regs per thread.
    vgprs: int | None = None
    agprs: int | None = None
    total_vgprs: int | None = None
    sgprs: int | None = None
    registers: int | None = None
    # Spills. AMD: .vgpr_spill_count/.sgpr_spill_count; NVIDIA: Triton's n_spills (local bytes / 4).
    vgpr_spills: int | None = None
    sgpr_spills: int | None = None
    spills: int | None = None
    scratch_bytes: int | None = None  # AMD private segment / NVIDIA stack frame, per lane/thread
    # Shared memory / LDS per workgroup: Triton's dynamic allocation (metadata "shared") plus the
    # static part (.group_segment_fixed_size on AMD), against the target's per-workgroup limit.
    shared_bytes: int | None = None
    static_shared_bytes: int | None = None
    shared_limit_bytes: int | None = None
    # AMD occupancy in waves per SIMD: by VGPRs (kernels.targets table), by LDS, the minimum, and the
    # compiler's own estimate (LLVM's "; Occupancy:" comment) as a cross-check. LLVM's figure is
    # also capped by waves_per_eu (Triton sets "amdgpu-waves-per-eu"="N,N"), which the hardware
    # does not know: it fits as many waves as the registers and LDS allow.
    waves_per_simd_vgpr: int | None = None
    waves_per_simd_lds: int | None = None
    waves_per_simd: int | None = None
    compiler_occupancy: int | None = None
    # NVIDIA occupancy: CTAs one SM holds at once, by registers, shared memory and warps, and the
    # minimum (kernels.targets.SmResources). Two CTAs per SM let one's softmax overlap the other's
    # matrix work; one CTA leaves the SM to the software pipeline alone.
    blocks_per_sm: int | None = None
    blocks_per_sm_by: dict[str, int] | None = None
    # sm_90: the kernel's MUFU.EX2 instructions, how many can issue while an HGMMA product may still
    # run, and its WARPGROUP.DEPBAR waits (kernels.sass_schedule; read from the SASS, static).
    exp2_overlap: dict[str, Any] | None = None
    # sha256 (12 hex digits) of the compiled code, PTX or AMDGCN, without line info, debug
    # sections and debug labels: equal before and after a change means the change compiled to the
    # same code on this target (how a refactor of the kernel is checked without a GPU).
    code_digest: str | None = None
    enable_fp_fusion: bool | None = None
    compile_seconds: float | None = None
    error: str | None = None
    kernel: str = "prefill"  # KERNELS: block_sparse_attn_fwd or the decode path's block_sparse_decode_fwd
    problems: list[str] = dataclasses.field(default_factory=list)  # failed checks (verdict)
    # opcode -> count of the atomics and the cache maintenance/bypass that orders them: atom.* and
    # ld.global.cg* (PTX); *_atomic_*, buffer_wbl2, buffer_inv (AMDGCN). The decode kernel's
    # fused merge has one arrival atomic per program; the prefill kernel has none.
    atomics: dict[str, int] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)  # worth knowing, not failures

    @property
    def passed(self) -> bool:
        return self.error is None and not self.problems

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["passed"] = self.passed
        out["compile_only"] = True
        return out


def expects_matrix_unit(target: str, dtype: str) -> bool:
    """Whether the kernel's dots should lower to matrix instructions on this target.

    The launcher passes DOT_PRECISION="ieee". fp16/bf16 dots use MFMA / tensor cores everywhere.
    fp32 IEEE dots use fp32 MFMA on CDNA (v_mfma_f32_*_f32), but NVIDIA tensor cores have no IEEE
    fp32 mode (TF32 would round the inputs), so Triton emits FMAs there by design.
    """
    return not (dtype == "fp32" and not target.startswith("gfx"))


class RequestError(ValueError):
    """A target, dtype, head dim or config change that ahead-of-time inspection cannot take; its
    message is one line (``parity inspect`` prints it as a usage error)."""


# ---- arguments, exactly as the launcher passes them --------------------------------------------

def check_request(target: str, dtype: str, head_dim: int) -> None:
    """Raise RequestError (one line) for an unknown target, dtype or head dim."""
    from .attention import SUPPORTED_HEAD_DIMS

    if target not in TARGETS:
        try:
            targets.arch_spec(target)
        except ValueError as err:  # a name no target has
            raise RequestError(str(err)) from None
        raise RequestError(f"target {target!r} has no ahead-of-time support; use one of {', '.join(TARGETS)}")
    if dtype not in DTYPES:  # short names only: a report's rows and JSON keys use them
        raise RequestError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise RequestError(f"head_dim {head_dim} is not supported; use one of "
                         f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}")


def pinned_config(target: str, dtype: str, head_dim: int, overrides: dict[str, int] | None = None,
                  kernel: str = "prefill"):
    """The launcher's pinned config for ``target`` (kernels.configs), with ``overrides`` applied
    (``configs.OVERRIDE_KEYS``; AMD knobs on AMD targets only), before the clamp. For the decode
    kernel, its ``DecodeConfig`` (no overrides: ``--set`` names prefill fields)."""
    from . import configs

    if kernel == "decode":
        if overrides:
            raise RequestError("--set changes the prefill config; it cannot be combined with --kernel decode")
        return configs.decode_config_for(target, head_dim, dtypes.torch_dtype(dtype))
    cfg = configs.config_for(target, head_dim, dtypes.torch_dtype(dtype))
    if not overrides:
        return cfg
    try:
        return configs.with_overrides(cfg, overrides, target)
    except ValueError as err:
        raise RequestError(str(err)) from None


def launch_arguments(target: str, dtype: str, head_dim: int, problem: Problem = Problem(),
                     overrides: dict[str, int] | None = None, kernel: str = "prefill"):
    """The launcher's kernel launch for ``problem`` on ``target`` (``kernels.launch.build_launch``,
    the builder the launcher itself calls), on meta tensors: only dtype, strides, alignment and
    size matter to the compile. ``overrides`` stand for passing ``config=LaunchConfig(...)`` to the
    launcher. EMULATE_BF16 is interpreter-only, so off; TMA is decided as on a GPU.

    Returns (args, constexprs, options, config) as in ``KernelLaunch``.
    """
    import torch

    from .launch import build_launch, kv_descriptors, tma_fits
    from .layout import causal_layout, sliding_window_layout

    check_request(target, dtype, head_dim)
    amd = targets.arch_spec(target).vendor == "amd"  # as the launcher decides it (kernels.attention)
    p = problem
    meta = torch.device("meta")
    tdtype = dtypes.torch_dtype(dtype)
    q = torch.empty(p.batch, p.heads_q, p.seq_q, head_dim, dtype=tdtype, device=meta)
    k = torch.empty(p.batch, p.heads_kv, p.seq_k, head_dim, dtype=tdtype, device=meta)
    v = torch.empty_like(k)
    lse = torch.empty(p.batch, p.heads_q, p.seq_q, dtype=torch.float32, device=meta) if p.return_lse else None
    if p.window:
        layout = sliding_window_layout(p.seq_q, p.seq_k, p.window, block_m=p.sparse_block, block_n=p.sparse_block)
    else:
        layout = causal_layout(p.seq_q, p.seq_k, block_m=p.sparse_block, block_n=p.sparse_block)
    layout = layout.to(meta)
    if kernel == "decode":
        from .decode import build_decode_launch

        cfg = pinned_config(target, dtype, head_dim, kernel="decode").clamp(layout.block_n)
        # The split count the launcher would choose on the target's flagship part.
        launch = build_decode_launch(q, k, v, torch.empty_like(q), lse, layout, cfg, sm_scale=head_dim ** -0.5,
                                     units=targets.arch_spec(target).compute_units, amd=amd,
                                     warp_size=targets.arch_spec(target).warp_size)
        return launch.args, launch.constexprs, launch.options, launch.config
    if overrides:
        cfg = pinned_config(target, dtype, head_dim, overrides).clamp(layout.block_m, layout.block_n)
    else:  # the launcher's own choice for these blocks (kernels.attention._prefill_config)
        from . import configs

        cfg = configs.config_for_blocks(target, head_dim, dtypes.torch_dtype(dtype), layout.block_m, layout.block_n)
    use_tma = tma_fits(cfg, q, k, v)
    launch = build_launch(q, k, v, torch.empty_like(q), lse, layout, cfg, sm_scale=head_dim ** -0.5,
                          use_tma=use_tma, amd=amd,
                          descriptors=kv_descriptors(k, v, cfg, use_tma, block_n=layout.block_n))
    return launch.args, launch.constexprs, launch.options, launch.config


def kernel_source_digest() -> str:
    """Short sha256 of kernels/triton_attention.py: which kernel source a report describes."""
    import hashlib
    from pathlib import Path

    return hashlib.sha256(Path(__file__).with_name("triton_attention.py").read_bytes()).hexdigest()[:12]


# ---- compiling (runs in the child process) ------------------------------------------------------

def _specialize(fn, backend, args: dict[str, Any], constexprs: dict[str, Any]):
    """(signature, constexprs, attrs) for ASTSource, as the JIT computes them at launch."""
    from triton.runtime.jit import native_specialize_impl

    signature: dict[str, str] = {}
    consts = dict(constexprs)
    attrs: dict[tuple[int, ...], Any] = {}
    for index, param in enumerate(fn.params):
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
            continue
        kind, spec = native_specialize_impl(type(backend), args[name], param.is_const,
                                            not param.do_not_specialize,
                                            not param.do_not_specialize_on_alignment)
        signature[name] = kind
        if kind == "constexpr":  # an int equal to 1
            consts[name] = spec
        elif isinstance(spec, str):
            attrs[(index,)] = backend.parse_attr(spec)
    return signature, consts, attrs


def _compile_one(request: dict[str, Any]) -> dict[str, Any]:
    import warnings

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    from . import triton_attention

    target, dtype, head_dim = request["target"], request["dtype"], int(request["head_dim"])
    problem = Problem(**request["problem"])
    spec = targets.arch_spec(target)
    kernel_name = request.get("kernel", "prefill")
    result = AotResult(target=target, vendor=spec.vendor, dtype=dtype, head_dim=head_dim, config={}, kernel=kernel_name,
                       overrides=dict(request.get("overrides") or {}),
                       problem=problem.to_dict(), matrix_unit_expected=expects_matrix_unit(target, dtype),
                       shared_limit_bytes=spec.shared_mem_bytes)
    try:
        args, constexprs, options, cfg = launch_arguments(target, dtype, head_dim, problem,
                                                          request.get("overrides"), kernel_name)
        result.config = cfg.to_dict()
        result.constexprs = constexprs
        if kernel_name == "decode":
            splits = args["PartOut"].shape[2]
            result.notes.append(f"{splits} splits of the key range: the launcher's choice on {spec.compute_units} "
                                f"compute units for this problem")
        gpu_target = GPUTarget(spec.backend, spec.triton_arch, spec.warp_size)
        fn = (triton_attention.block_sparse_decode_fwd if kernel_name == "decode"
              else triton_attention.block_sparse_attn_fwd)
        signature, consts, attrs = _specialize(fn, make_backend(gpu_target), args, constexprs)
        if signature["Q"] != dtypes.triton_pointer(dtype):  # the builder's tensors carry the dtype
            raise RuntimeError(f"Q is specialized as {signature['Q']}, expected {dtypes.triton_pointer(dtype)}")
        start = time.perf_counter()
        with warnings.catch_warnings():
            # The FP-fusion default is recorded in the result (enable_fp_fusion) instead.
            warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
            kernel = triton.compile(ASTSource(fn, signature, consts, attrs), target=gpu_target, options=options)
        result.compile_seconds = round(time.perf_counter() - start, 2)
    except Exception as err:  # recorded on the result and shown in the report, never swallowed
        result.error = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        return result.to_dict()
    result.code_digest = code_digest(kernel.asm["amdgcn"] if spec.backend == "hip" else kernel.asm["ptx"])
    result.enable_fp_fusion = bool(kernel.metadata.enable_fp_fusion)
    result.shared_bytes = int(kernel.metadata.shared)
    if spec.backend == "hip":
        _read_amdgcn(result, kernel.asm["amdgcn"], spec)
    else:
        _read_nvidia(result, kernel.asm["ptx"], kernel.asm["cubin"])
    result.atomics = read_atomics(kernel.asm["amdgcn"] if spec.backend == "hip" else kernel.asm["ptx"])
    if result.atomics:  # the decode kernel's fused merge: shown in the table's verdict column
        result.notes.append("atomics: " + ", ".join(f"{op} x{count}" for op, count in result.atomics.items()))
    _judge(result)
    return result.to_dict()


_ATOMIC_OPCODES = re.compile(r"^\s*(?:@!?%\w+\s+)?(atom\.[\w.]+|ld\.global\.cg[\w.]*|\w+_atomic_\w+|buffer_wbl2|buffer_inv)\b",
                             re.MULTILINE)


def read_atomics(asm: str) -> dict[str, int]:
    """Opcode -> count of the atomics in PTX or AMDGCN and of the instructions that order or
    bypass caches around them (``AotResult.atomics``)."""
    counts: dict[str, int] = {}
    for opcode in _ATOMIC_OPCODES.findall(asm):
        counts[opcode] = counts.get(opcode, 0) + 1
    return dict(sorted(counts.items()))


def code_digest(asm: str) -> str:
    """Digest of compiled code with what names files and source lines removed: ``.loc``/``.file``
    lines, everything from the first debug section or DWARF entry on, and the labels LLVM emits
    for debug scopes (``$L__tmpN:`` in PTX, ``.LtmpN:`` in AMDGCN)."""
    import hashlib

    kept = []
    for line in asm.splitlines():
        stripped = line.strip()
        if re.search(r"\.section\s*\.debug|DW_TAG|DW_AT|Length of Unit|Abbrev \[", line):
            break
        if stripped.startswith((".loc", ".file")) or re.fullmatch(r"(\$L__tmp|\.Ltmp)\d+:", stripped):
            continue
        kept.append(line)
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:12]


def _meta_int(text: str, key: str) -> int | None:
    match = re.search(rf"^\s*-?\s*\.{key}:\s+(\d+)\s*$", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def _comment_int(text: str, key: str) -> int | None:
    match = re.search(rf"^; {key}: (\d+)", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def _read_amdgcn(result: AotResult, asm: str, spec) -> None:
    result.matrix_instructions = dict(sorted(collections.Counter(
        re.findall(r"^\s*(v_mfma_\w+|v_smfmac_\w+)", asm, re.MULTILINE)).items()))
    # On gfx90a/gfx942/gfx950 arch VGPRs and AGPRs share one 512-entry file per lane: the
    # allocation is alignTo(vgpr, 4) + agpr (.amdhsa_accum_offset + .agpr_count) and that total
    # sets the occupancy. The code-object note's .vgpr_count already is that total (checked with
    # waves_per_eu=1 on gfx942, bf16 D=128: NumVgprs 256 + NumAgprs 166 = TotalNumVgprs 422 =
    # .vgpr_count); the arch-only figure is LLVM's "; NumVgprs:" comment.
    result.total_vgprs = _meta_int(asm, "vgpr_count")
    if result.total_vgprs is None:
        result.total_vgprs = _comment_int(asm, "TotalNumVgprs")
    result.agprs = _meta_int(asm, "agpr_count")
    if result.agprs is None:
        result.agprs = _comment_int(asm, "NumAgprs") or 0
    result.vgprs = _comment_int(asm, "NumVgprs")
    if result.vgprs is None and result.total_vgprs is not None:
        result.vgprs = result.total_vgprs - result.agprs
    result.sgprs = _meta_int(asm, "sgpr_count")
    result.vgpr_spills = _meta_int(asm, "vgpr_spill_count")
    result.sgpr_spills = _meta_int(asm, "sgpr_spill_count")
    result.spills = (result.vgpr_spills or 0) + (result.sgpr_spills or 0)
    result.scratch_bytes = _meta_int(asm, "private_segment_fixed_size")
    result.static_shared_bytes = _meta_int(asm, "group_segment_fixed_size") or 0
    result.compiler_occupancy = _comment_int(asm, "Occupancy")

    num_warps = result.config["num_warps"]
    result.waves_per_simd_vgpr = _waves_by_vgprs(result.total_vgprs, spec)
    lds = result.shared_bytes + result.static_shared_bytes
    if lds == 0:
        result.waves_per_simd_lds = spec.max_waves_per_simd
    else:
        # 64 KiB (gfx90a/gfx942) or 160 KiB (gfx950) of LDS per CU, shared by its workgroups;
        # spec.shared_mem_bytes is both the per-workgroup and the per-CU figure on CDNA.
        workgroups = spec.shared_mem_bytes // lds
        waves = (workgroups * num_warps) // _SIMDS_PER_CU
        # A workgroup smaller than 4 waves still puts one wave on the SIMDs it uses.
        result.waves_per_simd_lds = min(spec.max_waves_per_simd, max(waves, 1) if workgroups else 0)
    known = [w for w in (result.waves_per_simd_vgpr, result.waves_per_simd_lds) if w is not None]
    result.waves_per_simd = min(known) if known else None


def _waves_by_vgprs(vgprs: int | None, spec) -> int | None:
    if vgprs is None:
        return None
    for limit, waves in spec.vgpr_waves:
        if vgprs <= limit:
            return min(waves, spec.max_waves_per_simd)
    return 0


def _read_nvidia(result: AotResult, ptx: str, cubin: bytes) -> None:
    ops = re.findall(r"^\s*((?:wgmma\.mma_async|mma\.sync)\.[\w.]+)", ptx, re.MULTILINE)
    result.matrix_instructions = dict(sorted(collections.Counter(ops).items()))
    if result.target == "sm_90":
        result.wgmma = any(op.startswith("wgmma") for op in ops)
        overlap = exp2_overlap(cubin_sass(cubin))
        result.exp2_overlap = overlap.to_dict()
        if result.wgmma:
            result.notes.append(f"exp2 that can issue while a wgmma product may run: {overlap.exp2_while_mma} of "
                                f"{overlap.exp2}, in loops {overlap.loop_exp2_while_mma} of {overlap.loop_exp2}")
    usage = cubin_resources(cubin)
    result.registers = usage.get("REG")
    # Triton's CompiledKernel.n_spills is CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES / 4, the per-thread
    # local memory (ptxas's stack frame: with everything inlined, only spills live there).
    stack = usage.get("STACK", 0) + usage.get("LOCAL", 0)
    result.scratch_bytes = stack
    result.spills = stack // 4
    # cuobjdump's SHARED is static shared memory (the 1 KiB Hopper/Ampere reserve for the system
    # shows up here); Triton's allocation is dynamic and counted in shared_bytes.
    result.static_shared_bytes = usage.get("SHARED")
    resources = targets.arch_spec(result.target).sm_resources
    if resources is not None and result.registers is not None:
        occupancy = resources.blocks_per_sm(result.registers, result.config["num_warps"], result.shared_bytes or 0)
        result.blocks_per_sm = occupancy.pop("blocks")
        result.blocks_per_sm_by = occupancy


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """REG/STACK/SHARED/LOCAL of the kernel from Triton's bundled cuobjdump (cache independent:
    Triton discards ptxas's -v log unless asked to print it)."""
    text = _cuobjdump(cubin, "-res-usage")
    line = next((ln for ln in text.splitlines() if "REG:" in ln), "")
    return {key: int(value) for key, value in re.findall(r"(\w+(?:\[\d+\])?):(\d+)", line)}


def cubin_sass(cubin: bytes) -> str:
    """The machine code (SASS) of a cubin, as Triton's bundled cuobjdump lists it."""
    return _cuobjdump(cubin, "-sass")


def _cuobjdump(cubin: bytes, flag: str) -> str:
    import tempfile

    from triton import knobs

    tool = knobs.nvidia.cuobjdump.path  # Triton's bundled one unless TRITON_CUOBJDUMP_PATH is set
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        return subprocess.run([tool, flag, handle.name], check=True, capture_output=True, text=True).stdout


def _judge(result: AotResult) -> None:
    """The verdict: no spills to memory, LDS/shared memory within the limit, matrix instructions.

    On AMD a spill fails when it reaches scratch memory (a non-zero private segment). Spills that
    stay in registers are a note: LLVM spills SGPRs into VGPR lanes (v_writelane) and, on
    gfx90a and later, VGPRs into free AGPRs (v_accvgpr_write) before it uses scratch; with a zero
    private segment they cost an instruction each and no memory traffic.
    """
    if result.vendor == "amd":
        spilled = f"{result.vgpr_spills} VGPR + {result.sgpr_spills} SGPR spills"
        if result.scratch_bytes:
            result.problems.append(f"spills to scratch ({spilled}, {result.scratch_bytes} B per lane)")
        elif result.vgpr_spills or result.sgpr_spills:
            result.notes.append(f"{spilled} into registers (no scratch)")
        shared = (result.shared_bytes or 0) + (result.static_shared_bytes or 0)
        what = "LDS"
        # A workgroup's waves are resident at once: num_warps / 4 per SIMD at least.
        needed = -(-result.config.get("num_warps", 1) // _SIMDS_PER_CU)
        if result.waves_per_simd is not None and result.waves_per_simd < needed:
            result.problems.append(f"a workgroup needs {needed} waves per SIMD, resources allow "
                                   f"{result.waves_per_simd}")
    else:
        if result.spills:
            result.problems.append(f"spills ({result.scratch_bytes} B local memory per thread)")
        # Triton checks its (dynamic) allocation against the device's opt-in limit at load time;
        # cuobjdump's static SHARED on sm_90 is the 1 KiB the system reserves per block.
        shared = result.shared_bytes or 0
        what = "shared memory"
    if shared > result.shared_limit_bytes:
        result.problems.append(f"{what} {shared} B > limit {result.shared_limit_bytes} B")
    if result.matrix_unit_expected and not result.matrix_instructions:
        result.problems.append("no matrix instructions")


# ---- the public entry point (parent process) ----------------------------------------------------

def inspect_configs(targets=("gfx942",), dtypes=DTYPES, head_dims=(64, 128), *,
                    problem: Problem = Problem(), overrides: dict[str, int] | None = None,
                    jobs: int | None = None, kernel: str = "prefill") -> list[AotResult]:
    """Compile every (target, dtype, head_dim) with the launcher's config; compile-only, no GPU.

    See ``inspect_cases``; results come in the order target, dtype, head_dim.
    """
    cases = [(t, d, int(h)) for t in targets for d in dtypes for h in head_dims]
    return inspect_cases(cases, problem=problem, overrides=overrides, jobs=jobs, kernel=kernel)


def inspect_cases(cases, *, problem: Problem = Problem(), overrides: dict[str, int] | None = None,
                  jobs: int | None = None, kernel: str = "prefill") -> list[AotResult]:
    """Compile each (target, dtype, head_dim) case with the launcher's config; compile-only.

    ``overrides`` replace fields of the pinned config (as if ``config=`` were given to the launcher),
    to evaluate a proposed change. Raises RequestError for an unknown target, dtype, head dim or
    config key. A config that fails to compile is returned with ``error`` set (and fails its
    verdict). ``jobs`` child processes compile in parallel (default: one per available core, at
    most one per case); each costs about 2 s of start-up (importing torch and Triton).
    """
    requests = []
    for target, dtype, head_dim in cases:
        check_request(target, dtype, int(head_dim))
        pinned_config(target, dtype, int(head_dim), overrides, kernel)  # reject unknown keys here
        requests.append({"target": target, "dtype": dtype, "head_dim": int(head_dim), "kernel": kernel,
                         "problem": problem.to_dict(), "overrides": dict(overrides or {})})
    if not requests:
        return []
    if jobs is None:
        jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    jobs = max(1, min(jobs, len(requests)))
    # Largest head dims first, dealt round-robin, so the slowest compiles spread over the workers.
    order = sorted(range(len(requests)), key=lambda i: -requests[i]["head_dim"])
    shares = [order[w::jobs] for w in range(jobs)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    workers = [
        (share, subprocess.Popen([sys.executable, "-m", "parity.kernels.aot"], env=env, text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        for share in shares
    ]
    results: list[AotResult | None] = [None] * len(requests)
    failure = None
    for share, proc in workers:
        stdout, stderr = proc.communicate(json.dumps([requests[i] for i in share]))
        payload = next((ln[len(_RESULT_MARK):] for ln in reversed(stdout.splitlines())
                        if ln.startswith(_RESULT_MARK)), None)
        if proc.returncode != 0 or payload is None:
            tail = (stderr.strip().splitlines() or ["(no output)"])[-1]
            failure = failure or f"ahead-of-time compile worker exited with status {proc.returncode}: {tail}"
            continue
        for index, data in zip(share, json.loads(payload)):
            data.pop("passed")
            data.pop("compile_only")
            results[index] = AotResult(**data)
    if failure:
        raise RuntimeError(failure)
    return results  # type: ignore[return-value]


def _worker_main() -> int:
    requests = json.loads(sys.stdin.read())
    # Triton may print (e.g. kernel-override notices); keep stdout for the result line.
    real_stdout = sys.stdout
    sys.stdout = sys.stderr
    try:
        results = [_compile_one(request) for request in requests]
    finally:
        sys.stdout = real_stdout
    print(_RESULT_MARK + json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("parity.kernels.aot worker: TRITON_INTERPRET must be unset (compiles need real JIT functions)")
    sys.exit(_worker_main())
