"""``python -m parity capture``: run a subject and write a golden bundle.

Every argument is checked before anything runs (exit 2, one line): the subject's arguments by
the subject itself (types, ranges, and whether the sizes fit this host's memory), the numbers
here (``--shard-mib`` finite and in range, ``--fuzz`` bounded), and Triton's presence for
``--impl triton``. A user subject (``package.module:factory``) is looked up in the current
directory too, as under ``python -m``.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from parity.base import dtypes
from parity.base.errors import UsageError, require_dependency
from parity.base.overrides import json_value, parse_overrides
from parity.cli.options import DEPRECATED_UNTIL, HelpFormatter, add_cli_options, resolve_device
from parity.base.text import plural

# Bounds of numeric options: beyond these a value is a typo, not a wish.
MAX_SHARD_MIB = 2**20  # 1 TiB: no single safetensors shard should be larger
MAX_FUZZ_CASES = 10_000  # the attention subject's own limit on cases
MAX_ARG_INT = 2**63 - 1  # a subject argument beyond int64 cannot reach a tensor or a seed

EPILOG = """\
subjects: attention (the block-sparse op; --cases smoke|default|gpu), decoder (a small
block-sparse decoder LM), or package.module:factory for your own (see parity.run.subjects.base).
--impl triton on a CPU device turns on the Triton interpreter (TRITON_INTERPRET=1) by itself.
Exit status: 0 written, 2 unusable input (bad argument, subject arguments that do not validate
or do not fit this host's memory, missing Triton), 3 internal error (the subject's code raised).
Deprecated aliases (until 0.3): --out for --bundle, --arg for --set.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "capture", help="run a subject and record a golden bundle",
        description="Run a subject with one implementation, record inputs, weights and per-layer "
                    "outputs, and write them as a golden bundle (safetensors shards + manifest.json).",
        epilog=EPILOG, formatter_class=HelpFormatter,
    )
    parser.add_argument("--subject", required=True, help="attention, decoder, or package.module:factory")
    parser.add_argument("--bundle", "--out", dest="out", required=True, metavar="DIR",
                        help="the golden bundle directory to write "
                             f"(--out: deprecated alias, until {DEPRECATED_UNTIL})")
    add_cli_options(parser, "impl", "device", defaults={"impl": "reference"})
    parser.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: the subject's own)")
    parser.add_argument("--layers", nargs="+", action="extend", metavar="GLOB",
                        help="record only modules whose path matches a glob (default: every module)")
    parser.add_argument("--record-inputs", action="store_true",
                        help="also record each module's inputs (needed by compare --isolate)")
    parser.add_argument("--reference", default="fp64",
                        help="high-precision reference of every output: fp64 (CPU), fp32 (device) or none "
                             "(default: fp64)")
    parser.add_argument("--reference-scope", default="model", choices=("model", "module"),
                        help="model: a whole-model reference run (--reference fp64 on the CPU, fp32 on the device: "
                             "a second model in memory); module: each recorded module replayed on its own inputs in "
                             "--reference's precision on --device, one module's high-precision copy at a time "
                             "(compare checks its error budget under --isolate). Default: model")
    parser.add_argument("--weights-from", nargs="+", action="extend", default=None, metavar="PATH",
                        help="safetensors checkpoint files or directories that hold the model's weights: the bundle "
                             "names them with their sha256 instead of storing the weights (each weight is checked "
                             "equal to the file's at capture; compare checks the sha256 before it builds)")
    parser.add_argument("--cases", default=None, help="attention case set: smoke, default or gpu")
    parser.add_argument("--fuzz", type=int, default=None, metavar="N",
                        help="attention: record N cases drawn by parity.run.fuzz.draw_cases, a pure function of "
                             "N, --fuzz-seed and --fuzz-bounds (the bundle stores the cases; compare replays them)")
    parser.add_argument("--fuzz-seed", type=int, default=0, metavar="S", help="seed of the --fuzz draw (default: 0)")
    parser.add_argument("--fuzz-bounds", default="cpu", choices=("cpu", "gpu", "corpus"),
                        help="size bounds of --fuzz cases: cpu (small enough for the Triton interpreter), gpu, "
                             "or corpus (cpu cases small enough that 150 of them make a bundle of < 20 MB)")
    parser.add_argument("--set", "--arg", dest="arg", action="append", default=[], metavar="KEY=VALUE",
                        help="set a subject argument (VALUE parsed as JSON, else taken as a string); repeatable "
                             f"(--arg: deprecated alias, until {DEPRECATED_UNTIL})")
    parser.add_argument("--shard-mib", type=float, default=256.0, metavar="MIB", help="shard size limit in MiB")
    parser.add_argument("--force", action="store_true", help="replace an existing bundle at --bundle")
    parser.add_argument("--no-fsync", dest="durable", action="store_false",
                        help="do not wait for the disk: skip the fsync of each shard and the manifest (as "
                             "safetensors' save_file does). Faster where the disk is slower than the page cache; "
                             "a crash of the machine (power loss, not of parity) can then leave a bundle that "
                             "fails its checksums. Default: every file is fsynced before the manifest names it")
    parser.add_argument("--placement", dest="placements", action="append", default=None, metavar="GLOB=PLACEMENT",
                        help="under torchrun: the placement of a plain tensor of a manually split model, by module "
                             "glob (shard(DIM), replicate or partial), e.g. 'layers.*.mlp.up_proj=shard(-1)'; "
                             "repeatable, later wins. DTensor outputs and parallelize plans need none")
    add_cli_options(parser, "repeat")
    add_cli_options(parser, "seeds")
    add_cli_options(parser, "quiet")
    parser.set_defaults(func=run)
    return parser


def _subject_args(args: argparse.Namespace) -> dict:
    # VALUE is JSON where it parses (8, [1, 2], true), else the text; NaN/Infinity and integers
    # beyond MAX_ARG_INT are refused, as are repeated and empty keys (parity.base.overrides).
    subject_args = parse_overrides(args.arg, flag="--set", convert=json_value(max_int=MAX_ARG_INT))
    if args.dtype is not None:
        subject_args["dtype"] = dtypes.check_name(args.dtype, what="--dtype")
    if args.cases is not None:
        subject_args["cases"] = args.cases
    if args.fuzz is not None:
        if args.subject != "attention":
            raise UsageError("--fuzz draws attention cases; it needs --subject attention")
        if "cases" in subject_args:
            raise UsageError("--fuzz draws the cases; do not combine it with --cases or --set cases=...")
        if not 1 <= args.fuzz <= MAX_FUZZ_CASES:
            raise UsageError(f"--fuzz must be a number of cases from 1 to {MAX_FUZZ_CASES}, got {args.fuzz}")
        from parity.run.fuzz import draw_cases

        subject_args["cases"] = draw_cases(args.fuzz, seed=args.fuzz_seed, bounds=args.fuzz_bounds)
    return subject_args


def check_shard_mib(value: float) -> int:
    """``--shard-mib`` in bytes; a UsageError for nan, inf, zero, negative or absurdly large."""
    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"--shard-mib must be a positive finite number, got {value}")
    if value > MAX_SHARD_MIB:
        raise UsageError(f"--shard-mib must be at most {MAX_SHARD_MIB} (1 TiB), got {value:g}")
    return max(1, int(value * 2**20))


def run(args: argparse.Namespace) -> int:
    from parity.run.capture import REFERENCE_CHOICES, capture, stderr_progress
    from parity.run.resources import summary_line
    from parity.run.runtime import enable_triton_interpreter
    from parity.run.subjects.base import add_cwd_to_sys_path

    if args.impl == "triton":
        require_dependency("triton", "--impl triton")
    device = resolve_device(args.device or "cpu")
    # Same rule as compare: Triton on a CPU device runs through the interpreter, switched on
    # here while Triton is not imported yet (whatever the impl is called).
    if device.partition(":")[0] == "cpu":
        enable_triton_interpreter(args.impl, "cpu")
    if args.reference not in REFERENCE_CHOICES:
        raise UsageError(f"unknown --reference {args.reference!r}; choose from {', '.join(REFERENCE_CHOICES)}")
    shard_bytes = check_shard_mib(args.shard_mib)
    if ":" in args.subject:
        add_cwd_to_sys_path()  # the user named this module: find it where `python -m` would
    _make_parent(args.out)
    from parity.distributed.group import launched

    if launched() and (args.repeat > 1 or args.seeds > 1):
        raise UsageError("--repeat and --seeds apply to a single-process capture; a torchrun capture takes neither")
    if launched():  # one rank of a torchrun launch: a rank set (parity.distributed)
        from parity.cli.commands._distributed import capture as capture_ranks

        return capture_ranks(args, subject_args=_subject_args(args), shard_bytes=shard_bytes, device=device)
    if args.placements:
        raise UsageError("--placement applies to a distributed capture; run it under torchrun")
    result = capture(
        args.subject,
        args.out,
        subject_args=_subject_args(args),
        impl=args.impl,
        device=device,
        layers=args.layers,
        record_inputs=args.record_inputs,
        reference=args.reference,
        force=args.force,
        shard_bytes=shard_bytes,
        progress=None if args.quiet else stderr_progress,
        durable=args.durable,
        reference_scope=args.reference_scope,
        weights_from=args.weights_from,
        repeat=args.repeat,
        seeds=args.seeds,
    )
    print(f"wrote {result.path}: {plural(result.layers, 'layer')}, {plural(result.tensors, 'tensor')}, "
          f"{result.bytes / 2**20:.1f} MiB; {_checks_text(result)}")
    print(f"capture cost: {summary_line(result.resources)}")
    return 0


def _checks_text(result) -> str:
    """``hooks on/off bitwise equal`` and, with --repeat, whether the N runs were bitwise equal."""
    repeat = result.repeat
    if repeat is None:
        return "hooks on/off bitwise equal"
    if repeat["bitwise_equal"]:
        return f"hooks on/off and {repeat['runs']} runs bitwise equal"
    return (f"NOT deterministic: {len(repeat['nondeterministic'])} tensor(s) differ over {repeat['runs']} runs, "
            f"first {repeat['first_nondeterministic']} (spread {repeat['max_spread']}); recorded in the manifest")


def _make_parent(out: str) -> None:
    """``--bundle a/b/bundle`` creates ``a/b`` as ``mkdir -p`` would (the library itself refuses a
    missing parent, so that a typo in a script's path is an error there)."""

    parent = Path(out).parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot create the directory {parent} for --bundle: {err.strerror}") from None
