"""``python -m parity profile``: where a subject's device time goes, by module, op and kernel.

The library is :mod:`parity.speed.profile` (running and accounting) and
:mod:`parity.speed.importers` (``--import``: rocprofv3, rocprof v1 and nsys kernel summaries;
``--against``: those, or a profile's ``--json`` file, checked field by field).
Exit status: 0 a profile was shown, 2 unusable input or a profile that cannot be trusted (no
device events, a CUDA graph), one line; 3 internal error.
"""
from __future__ import annotations

import argparse

from parity.base.errors import UsageError, require_dependency
from parity.cli.options import HelpFormatter, add_cli_options, resolve_device
from parity.base.jsonformat import finite
from parity.base.overrides import json_value, parse_overrides
from ._output import stderr_progress
from parity.base import jsonformat
from ._speed_output import check_report_files, run_reporting_errors, write_reports

EPILOG = """\
Runs the subject's forward under torch.profiler (skip, warm-up, then --active steps), each module
wrapped in a record_function range parity/<module> named as in the goldens. Counts device
activity only (kernels, memcpy, memset; on a CPU-only host the CPU ops' self time), charged to
the innermost module, so the shares add up to 100% and nothing is counted twice. Three views:
modules (repeated layers grouped as layers.*.attn.core; --by-layer: one row per module), ops,
kernels, with the columns of rocprof --stats and nsys cuda_gpu_kern_sum plus the share of wall
time. Names the hot module and what porting it could give at most (Amdahl).
--import FILE shows a rocprofv3 kernel_stats.csv, a rocprof v1 results.stats.csv or an nsys stats
cuda_gpu_kern_sum CSV in the same kernel view. --against OTHER (a profile --json file or one of
those CSV files) puts two profiles side by side: by module where both are parity profiles, else
by kernel; per step where both have a step count (parity profiles), else the totals of the two
captures as given (warned); per call in every case.
Exit status: 0 shown, 2 unusable input or an untrustworthy profile (no device events, a CUDA
graph), 3 internal error.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "profile", help="where device time goes: by module, op and kernel (torch.profiler, or an imported "
                        "rocprof/nsys table)",
        description="Profile a subject's forward and show its device time by module, op and kernel, or show a "
                    "vendor profiler's kernel table in the same view.",
        epilog=EPILOG, formatter_class=HelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--subject", help="attention, decoder, or package.module:factory")
    source.add_argument("--import", dest="import_file", metavar="FILE",
                        help="a rocprofv3 kernel_stats.csv, rocprof v1 results.stats.csv or nsys stats "
                             "cuda_gpu_kern_sum CSV")
    add_cli_options(parser, "impl", "device", defaults={"impl": "reference"})
    parser.add_argument("--set", dest="arg", action="append", default=[], metavar="KEY=VALUE",
                        help="set a subject argument (VALUE parsed as JSON, else taken as a string); repeatable")
    parser.add_argument("--skip", type=int, default=1, metavar="N", help="steps run before the profiler records")
    parser.add_argument("--warmup", type=int, default=2, metavar="N",
                        help="steps recorded and discarded (the profiler's own start-up cost)")
    parser.add_argument("--active", type=int, default=10, metavar="N", help="steps counted")
    parser.add_argument("--by-layer", action="store_true",
                        help="one row per module instead of grouping repeated layers (layers.*.attn)")
    parser.add_argument("--rows", type=int, default=15, metavar="N", help="rows shown per view (0: all)")
    parser.add_argument("--trace", metavar="FILE", default=None,
                        help="write the Chrome/Perfetto trace (JSON) of the active steps")
    parser.add_argument("--against", metavar="OTHER", default=None,
                        help="another profile (profile --json output, or a rocprof/nsys CSV) to put side by side")
    add_cli_options(parser, "json", "html", "quiet")
    parser.set_defaults(func=run_reporting_json_errors)
    return parser


def _label(document) -> str:
    if document.get("subject"):
        return f"{document['subject'].get('name')} {document.get('impl')} on {document.get('device')}"
    return str((document.get("settings") or {}).get("file"))


def run_reporting_json_errors(args: argparse.Namespace) -> int:
    """:func:`run`; refused or crashed, it still leaves a ``--json`` report saying so."""
    return run_reporting_errors(run, args, jsonformat.PROFILE_REPORT)


def run(args: argparse.Namespace) -> int:
    from parity.speed import pages, tables
    from parity.speed.importers import import_profile, read_profile

    check_report_files(args)
    if args.trace is not None:
        if args.import_file is not None:
            raise UsageError("--trace needs a run (--subject); an imported table has no trace")
    if args.rows < 0:
        raise UsageError(f"--rows must be 0 (all) or more, got {args.rows}")
    other = read_profile(args.against, "--against") if args.against is not None else None
    if args.import_file is not None:
        if args.arg:
            raise UsageError("--set applies to --subject, not to --import")
        document = import_profile(args.import_file)
    else:
        from parity.run import platform
        from parity.run.runtime import check_device, enable_triton_interpreter
        from parity.speed.profile import profile_subject
        from parity.run.subjects.base import add_cwd_to_sys_path

        if args.impl == "triton":
            require_dependency("triton", "--impl triton")
        device = check_device(resolve_device(args.device)) if args.device is not None else platform.default_device()
        enable_triton_interpreter(args.impl, device)
        if ":" in args.subject:
            add_cwd_to_sys_path()
        document = profile_subject(args.subject, subject_args=parse_overrides(args.arg, flag="--set",
                                                                              convert=json_value(max_int=2**63 - 1)),
                                   impl=args.impl, device=device, skip_first=args.skip, warmup=args.warmup,
                                   active=args.active, trace=args.trace,
                                   progress=None if args.quiet else stderr_progress("profile"))
    if other is not None:
        from parity.speed.profile import against, against_warnings

        side = against(document, other, a_label=_label(document), b_label=_label(other))
        document["against"] = finite(side)
        document["warnings"] = [*document["warnings"], *against_warnings(side)]
    views = ("module_calls" if args.by_layer else "modules", "ops", "kernels")
    write_reports(document, args, lambda doc: tables.profile_text(doc, views=views, limit=args.rows or None),
                  pages.render_profile)
    return 0
