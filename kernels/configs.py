"""Pinned launch configurations for the block-sparse attention kernel, as data, per architecture.

Parity runs need the same tiles every time: BLOCK_N changes the order of the online softmax and
so the rounding, and autotuning can pick different tiles on different machines. So the launcher
takes its config from this table; autotuning over ``candidates()`` happens only when asked for.
AMD-only knobs (``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack``) appear only in HIP rows.

Each architecture maps to rows ``(max_head_dim, LaunchConfig)``; the first row whose
``max_head_dim`` is at least the head dim applies. Where a number came from a measurement, the
comment says which (see kernels/BENCHMARK.md for the H200 sweep).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from . import dtypes

__all__ = ["LaunchConfig", "DecodeConfig", "DECODE_CONFIGS", "DECODE_MAX_SEQ_Q", "decode_config_for", "DECODE_FIELDS", "parse_fields", "CONFIGS", "OVERRIDE_KEYS", "config_for", "config_for_blocks", "candidates", "known_archs", "with_overrides"]


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # HIP-only compiler knobs, as (name, value) pairs; empty for NVIDIA and the interpreter.
    amd: tuple[tuple[str, int], ...] = ()
    # NVIDIA Hopper only: load K/V tiles through TMA tensor descriptors. Same values, same
    # order of operations; only the copy engine differs.
    tma: bool = False
    # Full and partial key blocks in one loop (a runtime mask flag) instead of two loops.
    one_loop: bool = False
    # With tma: the two K/V descriptors made on the host, once per call, and passed to the kernel,
    # instead of built in every program (Triton's TensorDescriptor arguments). Same tiles, same
    # loads, same values; used where the launcher can describe K and V as one [B * Hkv * Sk, D]
    # row array whose key blocks never cross a head (``launch.host_tma_fits``), else the
    # device-side descriptors run. Measured per-tile cost of TMA: kernels/BENCHMARK.md, table 4.
    host_tma: bool = False

    def __post_init__(self):
        if self.host_tma and not self.tma:
            raise ValueError("host_tma makes the TMA descriptors on the host: it needs tma=1")

    def launch_kwargs(self) -> dict[str, Any]:
        """Compiler options for the kernel launch (``kernel[grid](..., **cfg.launch_kwargs())``)."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages, **dict(self.amd)}

    def clamp(self, sparse_block_m: int, sparse_block_n: int) -> "LaunchConfig":
        """Tiles must divide the layout's blocks; shrink them when the layout's blocks are smaller
        (this config itself where they fit: a launch clamps on every call)."""
        if self.block_m <= sparse_block_m and self.block_n <= sparse_block_n:
            return self
        return dataclasses.replace(
            self, block_m=min(self.block_m, sparse_block_m), block_n=min(self.block_n, sparse_block_n)
        )

    def to_dict(self) -> dict[str, Any]:
        return {"block_m": self.block_m, "block_n": self.block_n, "num_warps": self.num_warps,
                "num_stages": self.num_stages, **dict(self.amd),
                **{flag: True for flag in FLAGS if getattr(self, flag)}}


# The boolean options of LaunchConfig, in the order labels and dicts list them.
FLAGS = ("tma", "one_loop", "host_tma")


def _amd(block_m, block_n, num_warps, num_stages, *, waves_per_eu=2, nonkdim=16, kpack=1):
    return LaunchConfig(block_m, block_n, num_warps, num_stages,
                        (("waves_per_eu", waves_per_eu), ("matrix_instr_nonkdim", nonkdim), ("kpack", kpack)))


CONFIGS: dict[str, tuple[tuple[int, LaunchConfig], ...]] = {
    # Triton interpreter on CPU: large tiles mean fewer interpreted operations (numpy does the
    # work); staging knobs are meaningless there.
    "cpu": ((256, LaunchConfig(64, 64, 4, 1)),),
    # Ampere: 163 KiB shared memory per block. No Ampere GPU was available: these are the
    # spill-free choices of ahead-of-time inspection (python -m parity inspect --target sm_80),
    # with Triton 3.9: at D=128, 128x64 w8 s3 spills 18 registers with two loops and none with
    # one; at D=256, 64x32 spills 36 with 4 warps and none with 8.
    "sm_80": (
        (64, LaunchConfig(128, 64, 8, 3)),
        (128, LaunchConfig(128, 64, 8, 3, one_loop=True)),
        (256, LaunchConfig(64, 32, 8, 1)),
    ),
    # Hopper (H100/H200), 8 warps (two warpgroups of 64 rows), 3 stages, K/V through TMA, one
    # loop over full and partial blocks. D=128: 128x128 tiles; D=64: 128x64. Picked by the table
    # sweep on the H200 and then measured next to FlexAttention and SDPA in one run (issue 26,
    # kernels/BENCHMARK.md, kernels/results/h200-table-1.json): over the 128x64 pointer tiles
    # pinned before, D=128 gains 5-16% on every case but random 25% at 4k (-11%); D=64 gains
    # 20-70% on causal, window and random 16k (TMA frees the registers for 2 CTAs per SM: 124
    # instead of 152; inspect) and 0-3% dense, but loses 16% on random 25% at 4k. One loop at
    # D=64: +2 to +19% on causal 4k and 16k, window and random 25% at 4k (geometric mean 294
    # against 269 TFLOP/s; kernels/results/h200-table-sweep-2.json), 125 registers, still 2 CTAs
    # per SM (inspect). Spill-free with TMA under Triton 3.6 (inspect); where TMA cannot
    # describe the tensors, the same tiles run on pointers (D=128 then spills 8 B, inspect).
    # D=256 one stage (two need 288 KiB) and 8 warps (with 4, Triton 3.6 on the H200 spilled 6
    # registers; inspect). Element-mask layouts use IRREGULAR_CONFIGS (128x128 s3 with a bit
    # mask needs 233,496 B of shared memory, 1 KiB past the H200's; measured).
    # K/V descriptors made on the host (host_tma; device-made ones where the tensors do not fit
    # them, launch.host_tma_fits): two table runs on an H100 with the implementations timed in
    # turns (kernels/results/h100-table-3.json, -4.json) put the geometric mean over the table's
    # cases at 358.8 / 358.5 against 343.4 / 341.9 TFLOP/s at D=64 and 445.4 / 443.8 against
    # 433.1 / 434.8 at D=128 (its worst row: dense 16k, -5.5% / -1.9%); the tile set-up no longer
    # builds descriptors on the GPU (BENCHMARK.md, table 5). Spill-free (inspect).
    "sm_90": (
        (64, LaunchConfig(128, 64, 8, 3, tma=True, one_loop=True, host_tma=True)),
        (128, LaunchConfig(128, 128, 8, 3, tma=True, one_loop=True, host_tma=True)),
        (256, LaunchConfig(64, 32, 8, 1)),
    ),
    # CDNA2 (MI200): 64 KiB LDS; MFMA subnormal flushing is a known numerics difference.
    # 16-bit D=128 spills at 128x64 even with 8 warps (inspect); 128x32 does not.
    "gfx90a": (
        (64, _amd(128, 64, 8, 1)),
        (128, _amd(128, 32, 8, 1)),
        (256, _amd(64, 32, 8, 1)),
    ),
    # CDNA3 (MI300X): the common attention starting point BLOCK_M=128, BLOCK_N=64, 1 stage,
    # waves_per_eu=2, 16x16 MFMA (parity/NUMERICS.md), with 8 warps: at 4 warps D=128 and D=256 spill
    # 160-385 VGPRs to scratch (`python -m parity inspect --target gfx942`, compile-only).
    "gfx942": (
        (64, _amd(128, 64, 8, 1)),
        (128, _amd(128, 64, 8, 1)),
        (256, _amd(64, 32, 8, 1)),
    ),
    # CDNA4 (MI350): 160 KiB LDS; same starting point as gfx942 until measured on hardware.
    "gfx950": (
        (64, _amd(128, 64, 8, 1)),
        (128, _amd(128, 64, 8, 1)),
        (256, _amd(64, 64, 8, 1)),
    ),
}


# fp32 tiles take twice the shared memory/LDS of 16-bit ones and use no matrix units for IEEE
# products; 128x128x3-stage tiles need 384 KiB on sm_90 (measured OutOfResources on the H200).
FP32_CONFIGS: dict[str, tuple[tuple[int, LaunchConfig], ...]] = {
    "cpu": CONFIGS["cpu"],
    # NVIDIA fp32 (IEEE) is an FMA dot: each thread holds its rows of Q and columns of K over the
    # whole head dim, so the tiles must be small to stay in registers. These are the largest
    # spill-free ones of the sizes tried (`python -m parity inspect --target sm_90 --dtype fp32
    # --set ...`): 64x64 at D=64 spilled 952 B per thread, 64x32 at D=128 7 KiB. Compile-only
    # choice; fp32 is the exactness path, not a timed one.
    "sm_80": ((64, LaunchConfig(32, 32, 4, 2)), (128, LaunchConfig(32, 16, 4, 2)), (256, LaunchConfig(32, 16, 4, 1))),
    "sm_90": ((64, LaunchConfig(32, 32, 4, 2)), (128, LaunchConfig(32, 16, 4, 2)), (256, LaunchConfig(32, 16, 4, 1))),
    # AMD fp32: 8 warps at D=128 and one wave per EU at D=256 avoid scratch spills (inspect).
    "gfx90a": ((64, _amd(64, 64, 4, 1)), (128, _amd(64, 32, 8, 1)), (256, _amd(32, 32, 4, 1, waves_per_eu=1))),
    "gfx942": ((64, _amd(64, 64, 4, 1)), (128, _amd(64, 32, 8, 1)), (256, _amd(32, 32, 4, 1, waves_per_eu=1))),
    "gfx950": ((64, _amd(64, 64, 4, 1)), (128, _amd(64, 32, 8, 1)), (256, _amd(32, 32, 4, 1, waves_per_eu=1))),
}


# Layouts with per-token element masks (documents, bit masks): many query tiles visit only a
# few key blocks (short documents, the start of each document), so per-tile pipeline prologues
# and the tail of the launch dominate. Measured on the H200 (bf16, D=128, H=16, 8 documents in
# 16k, causal within documents; kernels/BENCHMARK.md), ms: FlexAttention 0.592; 128x64 w8 s3
# one loop (the pinned config) 0.698, two loops 0.659; 128x128 w8 s2 0.604; 64x64 w4 s3 0.591
# on a 128-block layout and 0.566 on a 64-block one. 16-bit only, D<=128; other rows keep the
# pinned config until measured.
# With K/V descriptors made on the host (the same two H100 runs as the sm_90 pins): 358 / 357
# against 335 / 336 TFLOP/s on the documents row.
IRREGULAR_CONFIGS: dict[str, tuple[tuple[int, LaunchConfig], ...]] = {
    "sm_90": ((128, LaunchConfig(64, 64, 4, 3, tma=True, host_tma=True)),),
}


# ---- decode (split-KV) path --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Launch settings of the decode path (``kernels.decode``): the key tile, warps and pipeline
    stages of the split kernel, and how many splits to aim for. The query tile is not a setting:
    it is the rows of one GQA group (heads x query positions) padded to a power of two >= 16.

    ``programs_per_unit``: splits are added until the launch has about this many programs per
    multiprocessor / compute unit; ``min_tiles_per_split``: but no split gets fewer key tiles
    than this (a split's fixed cost is its prologue, epilogue and partial write).

    ``fused_combine``: with more than one split, the last program of each head group to finish
    merges the splits' partials (one launch per call); False launches ``decode_combine`` after
    the split kernel instead (two launches). Both merge in the same order: the same bits. Kept
    as a setting so that one run can time both (bench/launch_overhead.py).

    ``merge_lse_tile``: the most LSEs (splits x query rows of a program) the merge's first pass,
    the rows' max over the splits, reads as one tile; more splits than fit, or 0, take the max
    split by split in a loop. The max is exact in any order: both give the same bits, and the
    setting lets one run time both (bench/probe_decode_merge.py). 4096 fp32 values are 32
    registers per thread at 4 warps, held only until the reduction."""

    block_n: int
    num_warps: int
    num_stages: int
    amd: tuple[tuple[str, int], ...] = ()
    programs_per_unit: int = 4
    min_tiles_per_split: int = 4
    max_splits: int = 128
    fused_combine: bool = True
    merge_lse_tile: int = 4096

    def launch_kwargs(self) -> dict[str, Any]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages, **dict(self.amd)}

    def clamp(self, sparse_block_n: int) -> "DecodeConfig":
        if self.block_n <= sparse_block_n:
            return self
        return dataclasses.replace(self, block_n=sparse_block_n)

    def to_dict(self) -> dict[str, Any]:
        return {"path": "decode", "block_n": self.block_n, "num_warps": self.num_warps,
                "num_stages": self.num_stages, **dict(self.amd), "programs_per_unit": self.programs_per_unit,
                "min_tiles_per_split": self.min_tiles_per_split, "max_splits": self.max_splits,
                "fused_combine": self.fused_combine, "merge_lse_tile": self.merge_lse_tile}


def _amd_decode(block_n, num_warps, num_stages, *, waves_per_eu=0, nonkdim=16, kpack=1, **split):
    return DecodeConfig(block_n, num_warps, num_stages,
                        (("waves_per_eu", waves_per_eu), ("matrix_instr_nonkdim", nonkdim), ("kpack", kpack)), **split)


# Query lengths up to this take the decode path by default (the launcher also needs them to fit
# one query block of the layout).
DECODE_MAX_SEQ_Q = 16

DECODE_CONFIGS: dict[str, tuple[tuple[int, DecodeConfig], ...]] = {
    # The interpreter: one split unless asked for (tests force every split count).
    "cpu": ((256, DecodeConfig(64, 4, 1, programs_per_unit=1)),),
    # Hopper, D<=128: 32-key tiles, 4 warps, 3 stages, about 4 programs per SM. Measured on the H200
    # (bf16, Hq=32, Hkv=8, D=128, one token; CUDA-graph device time; kernels/BENCHMARK.md,
    # kernels/results/h200-decode-tuning-*.json): within 0-4% of SDPA at B8/4k, B8/32k, B1/128k
    # and B64/2k, where 64-key tiles were 2-11% behind at B1/128k and 2 stages fell to 1.35x
    # at B8/32k in one of two runs. Spill-free (parity inspect --kernel decode --target sm_90).
    # At least 8 key tiles per split: with the merge in the split kernel (one program reads every
    # split's partials), 33 splits of a B1/4k call cost 17.7 us of device time on an H100 against
    # 15.0 for 16 (bench/results/h100-inference-7/probe-merge.log); rows whose split count the
    # programs-per-SM rule sets (B8/4k, B1/128k) are unchanged.
    # Ampere takes the same rows until measured (compile-only: spill-free at sm_80).
    "sm_80": ((128, DecodeConfig(32, 4, 3, min_tiles_per_split=8)), (256, DecodeConfig(32, 4, 2, min_tiles_per_split=8))),
    "sm_90": ((128, DecodeConfig(32, 4, 3, min_tiles_per_split=8)), (256, DecodeConfig(32, 4, 2, min_tiles_per_split=8))),
    # CDNA: one stage (LDS is 64 KiB; Triton's AMD pipeliner streams through registers), 64-key
    # tiles; compile-only (parity inspect --kernel decode --target gfx942: spill-free, MFMA).
    "gfx90a": ((128, _amd_decode(64, 4, 1)), (256, _amd_decode(32, 4, 1))),
    "gfx942": ((128, _amd_decode(64, 4, 1)), (256, _amd_decode(32, 4, 1))),
    "gfx950": ((128, _amd_decode(64, 4, 1)), (256, _amd_decode(32, 4, 1))),
}
# fp32 (IEEE products: an FMA dot whose operands stay in registers) takes narrow key tiles.
FP32_DECODE_CONFIGS: dict[str, tuple[tuple[int, DecodeConfig], ...]] = {
    "cpu": DECODE_CONFIGS["cpu"],
    **{arch: ((128, DecodeConfig(32, 4, 2)), (256, DecodeConfig(16, 4, 2))) for arch in ("sm_80", "sm_90")},
    **{arch: ((128, _amd_decode(32, 4, 1)), (256, _amd_decode(16, 4, 1))) for arch in ("gfx90a", "gfx942", "gfx950")},
}


def decode_config_for(arch: str, head_dim: int, dtype: object = None) -> DecodeConfig:
    """The pinned decode config for an architecture, head dim and dtype (as ``config_for``)."""
    table = FP32_DECODE_CONFIGS if _is_fp32(dtype) else DECODE_CONFIGS
    return _row_for(table, arch, head_dim, "decode config")


def _is_fp32(dtype: object) -> bool:
    return dtype is not None and dtypes.short_name(dtype) == "fp32"


def _row_for(table: dict[str, tuple[tuple[int, Any], ...]], arch: str, head_dim: int, what: str):
    """The first row of ``table[arch]`` whose max head dim covers ``head_dim``; ValueError naming
    the known architectures or the largest head dim otherwise."""
    try:
        rows = table[arch]
    except KeyError:
        raise ValueError(f"no {what} for architecture {arch!r}; known: {', '.join(table)}") from None
    for max_head_dim, config in rows:
        if head_dim <= max_head_dim:
            return config
    raise ValueError(f"head_dim {head_dim} is larger than any {what} for {arch} (max {rows[-1][0]})")


def known_archs() -> tuple[str, ...]:
    return tuple(CONFIGS)


def config_for(arch: str, head_dim: int, dtype: object = None, *, irregular: bool = False) -> LaunchConfig:
    """The pinned config for an architecture, head dim and dtype (torch dtype or "fp32"/"bf16"/
    "fp16"; None means a 16-bit dtype). ``irregular``: the layout carries per-token element
    masks (``IRREGULAR_CONFIGS`` where a row exists, else the pinned config)."""
    fp32 = _is_fp32(dtype)
    if irregular and not fp32:
        for max_head_dim, config in IRREGULAR_CONFIGS.get(arch, ()):
            if head_dim <= max_head_dim:
                return config
    return _row_for(FP32_CONFIGS if fp32 else CONFIGS, arch, head_dim, "launch config")


def config_for_blocks(arch: str, head_dim: int, dtype: object, block_m: int, block_n: int, *,
                      irregular: bool = False) -> LaunchConfig:
    """The config for a layout with ``block_m`` x ``block_n`` blocks: ``config_for``'s, clamped
    to the blocks; where its tile does not fit them and the architecture has a small-tile row
    (``IRREGULAR_CONFIGS``: 64x64 w4 s3 on sm_90), that row instead. A pinned 8-warp tile shrunk
    to 64x64 keeps its 8 warps: on the H200 it took 1.19 ms where the 4-warp row took 0.566 on the
    same layout (bench/BENCHMARK.md, the document row)."""
    config = config_for(arch, head_dim, dtype, irregular=irregular)
    if config.block_m > block_m or config.block_n > block_n:
        config = config_for(arch, head_dim, dtype, irregular=True)
    return config.clamp(block_m, block_n)


# The keys a proposed config may change (``inspect --set``, the benchmark's ``--config``) and how
# each value is read. Bounds: beyond them a value is a typo. waves_per_eu=0 and
# matrix_instr_nonkdim=0 are the compiler's "no constraint" / "pick one", hence minimum 0.
# Each key's kind and bounds, as plain data: ("int", minimum, maximum) or ("bool",); the harness
# turns them into its converters (parity.base.overrides).
_SIZE = ("int", 1, 2**16)
_KNOB = ("int", 0, 2**16)
LAUNCH_FIELDS = {"block_m": _SIZE, "block_n": _SIZE, "num_warps": _SIZE, "num_stages": _KNOB,
                 **{flag: ("bool",) for flag in FLAGS}}
AMD_KNOBS = {"waves_per_eu": _KNOB, "matrix_instr_nonkdim": _KNOB, "kpack": _KNOB}
OVERRIDE_KEYS = {**LAUNCH_FIELDS, **AMD_KNOBS}


# The decode config's fields a benchmark variant may change (``benchmark_decode --variant``).
DECODE_FIELDS = {"block_n": _SIZE, "num_warps": _SIZE, "num_stages": _KNOB, "programs_per_unit": _SIZE,
                 "min_tiles_per_split": _SIZE, "max_splits": _SIZE, "fused_combine": ("bool",),
                 "merge_lse_tile": _KNOB}


def parse_fields(spec: str, fields: dict[str, tuple], *, flag: str) -> dict[str, Any]:
    """``"block_n=64, one_loop=1"`` -> ``{"block_n": 64, "one_loop": True}`` for config fields given
    as data (``("int", minimum, maximum)`` or ``("bool",)``): the kernel layer's own reader of its
    benchmarks' variants (the harness reads ``--set`` through ``parity.base.overrides`` from the
    same data). A ValueError names the flag, the item and the problem."""
    out: dict[str, Any] = {}
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        key, sep, text = (part.strip() for part in item.partition("="))
        if not sep:
            raise ValueError(f"{flag} {item!r} must look like KEY=VALUE")
        if key not in fields:
            raise ValueError(f"{flag} {item!r}: unknown config key {key!r}; use one of {', '.join(sorted(fields))}")
        if key in out:
            raise ValueError(f"{flag} {item!r}: config key {key!r} is given twice")
        kind, *bounds = fields[key]
        if kind == "bool":
            if text.lower() not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(f"{flag} {item!r}: expected 0 or 1 (or true/false), got {text!r}")
            out[key] = text.lower() in ("1", "true", "yes", "on")
            continue
        low, high = bounds
        if not text.lstrip("+-").isdigit() or len(text) > 20:
            raise ValueError(f"{flag} {item!r}: expected an integer from {low} to {high}, got {text!r}")
        if not low <= int(text) <= high:
            raise ValueError(f"{flag} {item!r}: expected an integer from {low} to {high}, got {int(text)}")
        out[key] = int(text)
    if not out:
        raise ValueError(f"{flag} {spec!r} names no KEY=VALUE")
    return out


def with_overrides(config: LaunchConfig, changes: dict[str, Any], arch: str = "") -> LaunchConfig:
    """``config`` with fields (``LAUNCH_FIELDS``) and AMD knobs replaced by ``changes`` (values as
    ``parity.base.overrides.parse_overrides(..., allowed=OVERRIDE_KEYS)`` returns them). An AMD knob
    for a config without AMD knobs is a ValueError naming the keys ``arch`` accepts. ``tma=0``
    without ``host_tma`` also turns host-made descriptors off (they are a way of doing TMA)."""
    amd = dict(config.amd)
    plain = {}
    for key, value in changes.items():
        if key in LAUNCH_FIELDS:
            plain[key] = bool(value) if LAUNCH_FIELDS[key][0] == "bool" else int(value)
        elif key in amd:
            amd[key] = int(value)
        else:
            known = sorted(set(LAUNCH_FIELDS) | set(amd))
            where = f" for {arch}" if arch else ""
            raise ValueError(f"unknown config key {key!r}{where}; use one of {', '.join(known)}")
    if plain.get("tma") is False:
        plain.setdefault("host_tma", False)
    return dataclasses.replace(config, **plain, amd=tuple(amd.items()))


def candidates(arch: str, head_dim: int, dtype: object = None) -> list[LaunchConfig]:
    """Configs that opt-in autotuning tries (the pinned one first)."""
    pinned = config_for(arch, head_dim, dtype)
    out = [pinned]
    big = head_dim > 128
    tiles = [(64, 32), (64, 64)] if big else [(128, 64), (128, 128), (64, 128)]
    warps = (4, 8)
    stages = (1, 2) if arch.startswith("gfx") else (2, 3)
    for block_m, block_n in tiles:
        for num_warps in warps:
            for num_stages in stages:
                cfg = dataclasses.replace(pinned, block_m=block_m, block_n=block_n, num_warps=num_warps,
                                          num_stages=num_stages)
                if cfg not in out:
                    out.append(cfg)
    if arch == "sm_90":  # TMA variants of every candidate
        out += [with_overrides(cfg, {"tma": not cfg.tma}) for cfg in list(out)]
    return out
