"""``python -m parity bench``: time implementations of a subject; a speedup counts only where parity holds.

The library is :mod:`parity.speed.bench`. Exit status: 0 the fastest implementation holds parity,
1 it fails (its speed claims nothing), 2 unusable input (one line), 3 internal error.
"""
from __future__ import annotations

import argparse
from parity.base.errors import UsageError, require_dependency
from parity.cli.options import HelpFormatter, add_cli_options, resolve_device
from parity.base.text import printable
from parity.base.overrides import json_value, parse_overrides
from ._output import stderr_progress
from parity.base import jsonformat
from parity.speed import regression
from ._speed_output import check_report_files, run_reporting_errors, write_reports

EPILOG = """\
Times each implementation's forward on the same inputs (the bundle's stored inputs and weights
with --bundle, else the subject's own; a bundle captured with --weights-from has the checkpoint
files it names verified, size and digest, before anything is built, found in --weights-dir or at
the paths recorded at capture): warm-up calls, then --reps rounds in which every impl
runs once in a seeded random order, each call after a cache flush sized from the device (none on
a CPU) and between two whole-device synchronisations. The output of each impl's last TIMED call
is judged with the default rule against the bundle's golden, or without --bundle against the
first impl's output. The first impl is the baseline: each other impl's speedup is the ratio of
medians with a bootstrap 95% interval, FASTER/SLOWER only when the interval clears --min-effect,
else SAME or UNCLEAR; EQUIVALENT within +-E when the 90% interval lies inside 1 +- --equivalence
(two one-sided tests). A speedup is valid only where parity holds ("not valid: parity fails at
TENSOR"). Modules are then timed with hooks in separate rounds: the hot module group (or
--module GLOB) gets its own speedup and Amdahl's prediction for the whole forward; a subject with
several cases (attention) gets a fast_p line. Each impl's kernel-only time per call (3 profiled
calls: kernels, memcpy, memset; the CPU ops' self time on a CPU) is shown next to its wall time.
--baseline PREVIOUS.json compares each impl with a saved bench --json run of the same subject on
the same device (another subject, shapes or device: exit 2; other software: a warning):
REGRESSED when the 95% interval of median(now) / median(then) lies above 1 + --regression-threshold.
Exit status: 0 the fastest impl holds parity and nothing regressed, 1 the fastest impl fails
parity or an impl REGRESSED, 2 unusable input, 3 internal error.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench", help="time implementations; a speedup is valid only where parity holds",
        description="Time implementations of a subject on the same inputs and report each speedup over the "
                    "first with its statistics, valid only where the timed output holds parity.",
        epilog=EPILOG, formatter_class=HelpFormatter,
    )
    parser.add_argument("--subject", default=None, help="attention, decoder, or package.module:factory (with "
                                                         "--bundle: optional, must equal the bundle's)")
    parser.add_argument("--bundle", default=None, metavar="DIR",
                        help="golden bundle: its inputs and weights are timed and its golden judges the outputs")
    add_cli_options(parser, "weights_dir")
    parser.add_argument("--impls", required=True, metavar="A,B,...",
                        help="implementations to time, comma-separated; the first is the baseline")
    parser.add_argument("--set", dest="arg", action="append", default=[], metavar="KEY=VALUE",
                        help="set a subject argument (without --bundle); repeatable")
    add_cli_options(parser, "device", "tolerances")
    parser.add_argument("--warmup", type=int, default=3, metavar="N", help="untimed calls of each impl first")
    parser.add_argument("--reps", type=int, default=20, metavar="N", help="timed rounds (each impl once per round)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the round order and of the bootstrap")
    parser.add_argument("--min-effect", type=float, default=0.02, metavar="F",
                        help="smallest speedup named FASTER/SLOWER: the interval must clear 1 +- F")
    parser.add_argument("--equivalence", type=float, default=0.02, metavar="E",
                        help="margin of the equivalence verdict: EQUIVALENT when the 90%% interval of the "
                             "speedup lies inside 1 +- E (TOST at alpha 0.05)")
    parser.add_argument("--baseline", dest="previous", default=None, metavar="PREVIOUS.json",
                        help="a saved bench --json report of the same subject and device: each impl's time "
                             "now against then, exit 1 on a regression")
    parser.add_argument("--regression-threshold", type=float, default=None, metavar="F",
                        help="with --baseline: REGRESSED when the 95%% interval of median(now) / median(then) "
                             "lies above 1 + F (default 0.05)")
    parser.add_argument("--fast-p", type=float, default=1.2, metavar="P",
                        help="the fast_p threshold over cases: parity holds and speedup >= P")
    parser.add_argument("--no-flush", dest="flush", action="store_false",
                        help="no cache flush before timed calls (warm-cache timings)")
    parser.add_argument("--module", dest="modules", action="append", default=None, metavar="GLOB",
                        help="time modules matching GLOB (e.g. 'layers.*.attn.core'); repeatable "
                             "(default: the module group with the largest self time in the baseline)")
    parser.add_argument("--no-modules", dest="module_timing", action="store_false",
                        help="skip the per-module rounds")
    parser.add_argument("--no-device-time", dest="device_time", action="store_false",
                        help="skip the profiled calls that measure each impl's kernel-only (device) time")
    add_cli_options(parser, "json", "html", "quiet")
    parser.set_defaults(func=run_reporting_json_errors)
    return parser


def run_reporting_json_errors(args: argparse.Namespace) -> int:
    """:func:`run`; refused or crashed, it still leaves its ``--json`` and ``--html`` reports saying so."""
    return run_reporting_errors(run, args, jsonformat.BENCH_REPORT)


def run(args: argparse.Namespace) -> int:
    from parity.run import platform
    from parity.judge.policy import policy_for_cli
    from parity.run.runtime import check_device, enable_triton_interpreter
    from parity.speed import bench, pages, tables
    from parity.run.subjects.base import add_cwd_to_sys_path, check_trusted, remove_from_sys_path

    impls = bench.parse_impls(args.impls)
    check_report_files(args)
    if "triton" in impls:
        require_dependency("triton", "--impls triton")
    device = check_device(resolve_device(args.device)) if args.device is not None else platform.default_device()
    enable_triton_interpreter("triton" if "triton" in impls else impls[0], device)
    if args.regression_threshold is not None and args.previous is None:
        raise UsageError("--regression-threshold applies only with --baseline PREVIOUS.json")
    options = bench.BenchOptions(impls=impls, warmup=args.warmup, reps=args.reps, seed=args.seed,
                                 min_effect=args.min_effect, fast_p=args.fast_p, flush=args.flush,
                                 modules=tuple(args.modules) if args.modules else None,
                                 module_timing=args.module_timing, device_time=args.device_time,
                                 equivalence=args.equivalence,
                                 regression_threshold=(args.regression_threshold if args.regression_threshold
                                                       is not None else regression.DEFAULT_THRESHOLD))
    options.check()
    previous = regression.load_previous(args.previous) if args.previous is not None else None
    # A tolerance file inside the bundle is refused (a bundle is data, not configuration).
    policy = policy_for_cli(args.tolerances, bundles=[args.bundle] if args.bundle is not None else [])
    bundle = None
    trusted: tuple[str, ...] = tuple(policy.trusted_subjects)
    if args.bundle is not None:
        from parity.bundle.reader import open_bundle

        if args.arg:
            raise UsageError("--set does not apply with --bundle: the bundle fixes the subject's arguments")
        bundle = open_bundle(args.bundle)
        remove_from_sys_path(bundle.path.resolve())
        spec = bundle.subject.get("spec")
        if args.subject is not None:
            if args.subject != spec:
                raise UsageError(f"--subject {printable(args.subject)!r} does not match bundle "
                                 f"{printable(str(bundle.path))}, captured from subject {printable(str(spec))!r}")
            trusted += (args.subject,)
        check_trusted(spec, trusted, bundle=bundle.path)
        if isinstance(spec, str) and ":" in spec:
            add_cwd_to_sys_path()
            remove_from_sys_path(bundle.path.resolve())
    elif args.subject is None:
        raise UsageError("bench needs --subject (or --bundle)")
    elif ":" in args.subject:
        add_cwd_to_sys_path()
    subject_args = parse_overrides(args.arg, flag="--set", convert=json_value(max_int=2**63 - 1))
    document = bench.run_bench(args.subject, subject_args=subject_args, bundle=bundle, options=options,
                               device=device, policy=policy, trusted=trusted,
                               progress=None if args.quiet else stderr_progress("bench"),
                               previous=previous, previous_path=args.previous or "", weights_dir=args.weights_dir)
    write_reports(document, args, tables.bench_text, pages.render_bench)
    return bench.exit_status(document)
