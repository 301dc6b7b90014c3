"""``python -m parity diff A B``: judge bundle B against golden bundle A, running nothing.

Both are captures of the same subject, arguments, inputs and weights (checked by checksum):
one from the NVIDIA host and one from the AMD host, or two CI runs, or a plugin golden and its
``.obtained`` bundle. The report, flags and exit statuses are compare's (:mod:`parity.judge.diff`).
"""
from __future__ import annotations

import argparse

from parity.cli.commands._output import check_judging_args, run_reporting_errors, stderr_progress, write_outputs
from parity.cli.options import HelpFormatter, add_cli_options, add_judging_options

EPILOG = """\
Reads both bundles (never imports or runs what they name) and judges every tensor B recorded
against A's: the same metrics, tolerance policy, error budget and report as compare. Refused
(exit 2, one line): a damaged bundle, bundles of different subjects, arguments, inputs or
weights (checksums in the manifests), bundles with no recorded tensor in common.
Exit status: 0 parity holds, 1 it fails, 2 unusable input, 3 internal error.

"This host" in the options above is B. A tensor only in A is missing (or fused, inside a
compared module, or absent, where B recorded other outputs of its layer call); one only in B is a warning (--strict-structure: a failure). The error budget
applies where both bundles hold references: B's error against A's reference at most k times
A's own; --budget requires references in both.
Tolerances: --tolerances FILE, else [tool.parity] of ./pyproject.toml, else built-in defaults.
Table: fits 120 columns (long names shortened in the middle with "…"); --wide shows every column.
Reports: --json, --junit-xml, --html, --markdown FILE; FILE "-" is standard output, instead of
the text report (a file named "-" is ./-).
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "diff", help="compare two bundles of the same subject and inputs, without running anything",
        description="Judge every recorded tensor of bundle B against golden bundle A: cosine, max abs, rel L2, "
                    "mismatches, the error budget, judged by a tolerance policy.",
        epilog=EPILOG, formatter_class=HelpFormatter,
    )
    parser.add_argument("golden", metavar="A", help="the golden bundle (expected)")
    parser.add_argument("candidate", metavar="B", help="the bundle judged against it")
    add_cli_options(parser, "tolerances", "json", "junit_xml")
    add_judging_options(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    return run_reporting_errors(_run, args)


def _run(args: argparse.Namespace) -> int:
    from parity.bundle.reader import open_bundle
    from parity.judge.diff import diff_bundles
    from parity.judge.policy import policy_for_cli

    check_judging_args(args)
    from parity.distributed.rankset import looks_like_rank_set

    if looks_like_rank_set(args.golden) or looks_like_rank_set(args.candidate):  # parity.distributed
        from parity.cli.commands._distributed import diff as diff_ranks

        report = diff_ranks(args, None if args.quiet else stderr_progress("diff"))
        write_outputs(report, args)
        return 0 if report.passed else 1
    golden, candidate = open_bundle(args.golden), open_bundle(args.candidate)
    policy = policy_for_cli(args.tolerances, bundles=[golden.path, candidate.path],
                            strict_structure=args.strict_structure)
    report = diff_bundles(golden, candidate, policy=policy, budget=args.budget,
                          progress=None if args.quiet else stderr_progress("diff"))
    write_outputs(report, args)
    return 0 if report.passed else 1
