"""``python -m parity compare``: run a golden bundle's subject here and report per-layer parity."""
from __future__ import annotations

import argparse
import sys

from ..errors import UsageError
from ..options import add_cli_options

EPILOG = """\
Runs the bundle's subject on this host with --impl, on the bundle's stored inputs and weights,
and compares every recorded tensor with its golden as it is produced. Prints a table (Markdown-
pasteable), how the error grows with depth, each failing tensor with the smallest tolerance
that would have passed it, and a verdict line. Exit status: 0 parity holds, 1 it fails,
2 unusable input (bad bundle, tolerance file or argument).

--isolate   replay each layer on its golden inputs (bundle captured with --record-inputs):
            error a layer introduces vs error it inherits from upstream.
--budget    also check the error budget on every layer: this host's error against the bundle's
            high-precision reference at most k (the policy's budget_k, else 2) times the capture
            host's own. Without --budget it is checked where the tolerance policy sets budget_k.
--impl triton on a CPU device turns on the Triton interpreter (TRITON_INTERPRET=1) by itself.
Tolerances: --tolerances FILE, else [tool.parity] of ./pyproject.toml, else built-in defaults.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "compare", help="compare this host against a golden bundle, layer by layer",
        description="Run a golden bundle's subject on this host and compare every recorded layer "
                    "output with the golden: cosine, max abs, rel L2, mismatches, judged by a tolerance policy.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_cli_options(parser, "golden", "impl", "device", "tolerances", "json", "junit_xml", required=("golden",))
    parser.add_argument("--isolate", action="store_true",
                        help="also replay each layer on its golden inputs (needs a bundle captured with "
                             "--record-inputs)")
    parser.add_argument("--budget", action="store_true", default=None,
                        help="check the error budget against the bundle's high-precision reference on every "
                             "layer (default: where the policy sets budget_k)")
    parser.add_argument("--max-rows", type=int, default=None, metavar="N",
                        help="collapse runs of passing rows when the table has more than N rows "
                             "(default: show every row)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.set_defaults(func=run)
    return parser


def stderr_progress(message: str) -> None:
    print(f"parity compare: {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from .. import platform
    from ..capture import check_device
    from ..compare import compare_bundle, enable_triton_interpreter, policy_for_cli
    from ..report import check_report_paths, format_text, write_json, write_junit_xml

    if args.max_rows is not None and args.max_rows < 1:
        raise UsageError(f"--max-rows must be at least 1, got {args.max_rows}")
    device = check_device(args.device) if args.device is not None else platform.default_device()
    # Before anything imports Triton: the interpreter must be chosen before kernels are defined.
    enable_triton_interpreter(args.impl, device)
    policy = policy_for_cli(args.tolerances)
    check_report_paths(args.json, args.junit_xml)
    report = compare_bundle(
        args.golden, impl=args.impl, device=device, policy=policy, isolate=args.isolate,
        budget=args.budget, progress=None if args.quiet else stderr_progress,
    )
    print(format_text(report, max_rows=args.max_rows))
    if args.json is not None:
        write_json(report, args.json)
    if args.junit_xml is not None:
        write_junit_xml(report, args.junit_xml)
    return 0 if report.passed else 1
