"""``python -m parity inspect``: compile the attention kernel ahead of time for GPUs that are not
here and check each pinned config against the target's limits (compile-only, nothing runs)."""
from __future__ import annotations

import argparse
import sys

from tabulate import tabulate

from parity.base import dtypes
from parity.base.errors import UsageError, require_dependency
from parity.base.files import write_atomically
from parity.base.jsonformat import INSPECT_REPORT, dumps, envelope
from parity.base.overrides import parse_overrides
from parity.cli.commands._output import check_outputs
from parity.cli.options import STDOUT, HelpFormatter, add_cli_options

EPILOG = """\
Every number comes from ahead-of-time compilation (triton.compile for the target, no GPU):
registers, spills, LDS/shared memory and occupancy are what the compiler reports, not
measurements. Each config is the one the launcher would use on that target (kernels.configs),
specialized for a representative problem (B=4, H=16, S=4096, causal 128x128 layout, with LSE).
Verdict: no spills, LDS/shared within the target's limit, matrix instructions present (fp32 on
NVIDIA has none by design: IEEE fp32 has no tensor-core instruction). Exit 0 when every config
passes, 1 when any fails, 2 for a bad argument or missing Triton, 3 internal error.
Try a proposed config change with --set, e.g. --set num_warps=8 --set block_n=32.
"""

DEFAULT_TARGETS = ("gfx942",)
DEFAULT_DTYPES = dtypes.KERNEL_DTYPES
DEFAULT_HEAD_DIMS = (64, 128)


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "inspect", help="compile the kernel ahead of time for a target and check its limits",
        description="Compile the Triton attention kernel for a GPU target that is not present "
                    "(gfx942, gfx90a, gfx950, sm_80, sm_90) with the launcher's pinned configs and "
                    "report matrix instructions, registers, spills, LDS/shared memory, occupancy.",
        epilog=EPILOG, formatter_class=HelpFormatter,
    )
    parser.add_argument("--target", action="append", metavar="ARCH",
                        help="gfx942, gfx90a, gfx950, sm_80 or sm_90; repeatable (default: gfx942)")
    parser.add_argument("--dtype", action="append", metavar="DTYPE",
                        help="fp16, bf16 or fp32; repeatable (default: all three)")
    parser.add_argument("--head-dim", action="append", type=int, metavar="D",
                        help="head dimension; repeatable (default: 64 and 128)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="override a field of the pinned config (block_m, block_n, num_warps, "
                             "num_stages, the flags tma, one_loop, host_tma as 0/1, and on AMD "
                             "waves_per_eu, matrix_instr_nonkdim, kpack); repeatable")
    parser.add_argument("--kernel", choices=("prefill", "decode"), default="prefill",
                        help="which kernel: the prefill kernel (default) or the decode path's split-KV kernel "
                             "(compiled for one token against a 32k cache, GQA 32:8)")
    add_cli_options(parser, "json")
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="parallel compile processes (default: one per available core)")
    add_cli_options(parser, "quiet")
    parser.set_defaults(func=run)
    return parser


def _overrides(items: list[str]) -> dict[str, int | bool]:
    """``--set`` items -> config changes, by kernels.configs' keys and bounds (parity.base.overrides)."""
    from parity.kernels import configs

    return parse_overrides(items, flag="--set", allowed=configs.OVERRIDE_KEYS, key_name="config key")


def _tile(r) -> str:
    c = r.config
    rows = f"{r.constexprs['BLOCK_M']}" if c.get("path") == "decode" else f"{c['block_m']}"
    text = f"{rows}x{c['block_n']} w{c['num_warps']} s{c['num_stages']}"
    if "waves_per_eu" in c:
        text += f" wpe{c['waves_per_eu']} nonk{c['matrix_instr_nonkdim']} kpack{c['kpack']}"
    return text + (" (--set)" if r.overrides else "")


def _matrix(r) -> str:
    if not r.matrix_instructions:
        return "none (FMA, expected)" if not r.matrix_unit_expected else "none"
    text = ", ".join(f"{op} x{count}" for op, count in r.matrix_instructions.items())
    if r.wgmma is not None:
        text += "  [wgmma]" if r.wgmma else "  [no wgmma]"
    return text


def _registers(r) -> str:
    if r.vendor == "amd":
        return f"vgpr {r.total_vgprs} ({r.vgprs}+{r.agprs} agpr), sgpr {r.sgprs}"
    return f"{r.registers}"


def _spills(r) -> str:
    if r.vendor == "amd":
        return f"{r.vgpr_spills} vgpr / {r.sgpr_spills} sgpr, {r.scratch_bytes} B scratch"
    return f"{r.spills} ({r.scratch_bytes} B local)"


def _shared(r) -> str:
    used = (r.shared_bytes or 0) + ((r.static_shared_bytes or 0) if r.vendor == "amd" else 0)
    return f"{used / 1024:g} / {r.shared_limit_bytes / 1024:g} KiB"


def _occupancy(r) -> str:
    if r.vendor != "amd":
        if r.blocks_per_sm is None:
            return "-"
        by = r.blocks_per_sm_by or {}
        return (f"{r.blocks_per_sm} CTA/SM (regs {by.get('by_registers')}, smem {by.get('by_shared')}, "
                f"warps {by.get('by_warps')})")
    text = f"{r.waves_per_simd} (vgpr {r.waves_per_simd_vgpr}, lds {r.waves_per_simd_lds})"
    if r.compiler_occupancy is not None and r.compiler_occupancy != r.waves_per_simd:
        if r.compiler_occupancy == r.config.get("waves_per_eu"):
            text += f"; llvm {r.compiler_occupancy} = waves_per_eu cap"
        else:
            text += f"; llvm says {r.compiler_occupancy}"
    return text


def _verdict(r) -> str:
    if r.error:
        return f"FAIL: did not compile: {r.error}"
    text = "ok" if r.passed else "FAIL: " + "; ".join(r.problems)
    return text + "".join(f" (note: {note})" for note in r.notes)


def format_table(results) -> str:
    headers = ["target", "dtype", "D", "tile", "matrix instructions", "registers", "spills",
               "LDS/shared", "occupancy (AMD: waves/SIMD)", "verdict"]
    rows = [[r.target, r.dtype, r.head_dim, _tile(r), _matrix(r), _registers(r) if not r.error else "-",
             _spills(r) if not r.error else "-", _shared(r) if not r.error else "-",
             _occupancy(r) if not r.error else "-", _verdict(r)] for r in results]
    return tabulate(rows, headers=headers, tablefmt="github")


def header_line(problem) -> str:
    from parity.kernels import aot
    from parity.run import platform

    p = problem
    layout = f"window {p.window}" if p.window else "causal"
    return (f"ahead-of-time compilation only (no GPU executed; numbers are compiler output): "
            f"Triton {platform.triton_version()}, kernel source {aot.kernel_source_digest()}, "
            f"problem B={p.batch} Hq={p.heads_q} Hkv={p.heads_kv} Sq={p.seq_q} Sk={p.seq_k} "
            f"{layout} {p.sparse_block}x{p.sparse_block} layout, LSE {'on' if p.return_lse else 'off'}")


def run(args: argparse.Namespace) -> int:
    check_outputs(args)  # now, before compiling
    require_dependency("triton", "inspect")  # compiling is all it does
    from parity.kernels import aot
    from parity.run import platform

    targets = tuple(args.target or DEFAULT_TARGETS)
    # Any spelling of a dtype (bfloat16, torch.bfloat16), reported by its short name.
    dtype_names = tuple(dtypes.check_name(name, aot.DTYPES) for name in args.dtype or DEFAULT_DTYPES)
    head_dims = tuple(args.head_dim or DEFAULT_HEAD_DIMS)
    overrides = _overrides(args.overrides)
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs must be at least 1, got {args.jobs}")
    problem = aot.DECODE_PROBLEM if args.kernel == "decode" else aot.Problem()
    cases = [(t, d, h) for t in targets for d in dtype_names for h in head_dims]
    try:  # one line for a bad argument, before any progress
        for target, dtype_name, head_dim in cases:
            aot.check_request(target, dtype_name, head_dim)
            aot.pinned_config(target, dtype_name, head_dim, overrides, args.kernel)
    except aot.RequestError as err:
        raise UsageError(str(err)) from None
    if not args.quiet:
        print(f"parity inspect: compiling {len(cases)} config{'s' if len(cases) != 1 else ''} ahead of time "
              f"for {', '.join(targets)}", file=sys.stderr, flush=True)
    results = aot.inspect_configs(targets, dtype_names, head_dims, problem=problem, overrides=overrides,
                                  jobs=args.jobs, kernel=args.kernel)
    passed = all(r.passed for r in results)
    header = header_line(problem) + ("; the decode path's split kernel" if args.kernel == "decode" else "")
    if args.json != STDOUT:
        print(header)
        print(format_table(results))
        failed = sum(not r.passed for r in results)
        print(f"{len(results) - failed} of {len(results)} configs within limits"
              + (f"; {failed} FAIL" if failed else ""))
    if args.json:
        document = {
            **envelope(INSPECT_REPORT),
            "compile_only": True,
            "note": header,
            "triton": platform.triton_version(),
            "kernel_source": aot.kernel_source_digest(),
            "problem": problem.to_dict(),
            "overrides": overrides,
            "passed": passed,
            "results": [r.to_dict() for r in results],
        }
        text = dumps(document, indent=2, ensure_ascii=True)
        if args.json == STDOUT:
            sys.stdout.write(text + "\n")
        else:
            write_atomically(args.json, text + "\n", "--json")
    return 0 if passed else 1
