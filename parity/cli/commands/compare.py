"""``python -m parity compare``: run a golden bundle's subject here and report per-layer parity.

A bundle is data. Its manifest names the subject to re-create, and this host builds it only if it
trusts that spec (:func:`parity.run.subjects.check_trusted`): a built-in, the spec given here with
``--subject`` (which must equal the bundle's), or one in the ``trust`` list of the user's
tolerance file or ``[tool.parity]``. The check runs before anything from the bundle is imported;
the bundle's directory is taken off ``sys.path``, and a tolerance file inside it is refused (a
bundle may not set its own tolerances or trust).

Exit status: 0 holds, 1 fails, 2 unusable input, 3 internal error. With 2 or 3, every report file
asked for and not yet written by this run still gets a report recording the error
(:mod:`parity.report.error_report`). Report files,
the paths refused for them, and ``-`` (standard output): :mod:`parity.cli.commands._output`.
"""
from __future__ import annotations

import argparse
import dataclasses

from parity.base.errors import UsageError, require_dependency
from parity.cli.commands._output import check_judging_args, run_reporting_errors, stderr_progress, write_outputs
from parity.cli.options import HelpFormatter, add_cli_options, add_judging_options, resolve_device

EPILOG = """\
Runs the bundle's subject on this host with --impl, on the bundle's stored inputs and weights,
and compares every recorded tensor with its golden as it is produced. Prints a table (Markdown-
pasteable), how the error grows with depth, each failing tensor with the smallest tolerance
that would have passed it, and a verdict line. Exit status: 0 parity holds, 1 it fails,
2 unusable input (bad or untrusted bundle, tolerance file or argument), 3 internal error.

--subject   the subject spec this host should build (must equal the bundle's). Built-ins need
            no trust; a package.module:factory spec needs --subject or trust = ["spec"] in the
            tolerance file / [tool.parity]: a bundle is data and never chooses the code to run.

--repeat N  run --impl N times on the same inputs: every recorded tensor must be bitwise equal run
            to run (a race, or float atomics, is not); the report names the first tensor in
            execution order that differs and its spread max|run_i - run_0|, and the run fails
            unless --allow-nondeterministic GLOB names it.
--isolate   replay each layer on its golden inputs (bundle captured with --record-inputs):
            error a layer introduces vs error it inherits from upstream.
Rules. Where the bundle holds a high-precision reference of a tensor (capture's default), the
            error budget judges it: this host's error against the reference at most k (2) times
            the capture host's own plus a rounding floor, with the fixed per-dtype thresholds as a
            backstop. Elsewhere the thresholds alone judge. The report says which rule judged each
            tensor. --budget requires references; --no-budget uses the thresholds alone.
--impl triton on a CPU device turns on the Triton interpreter (TRITON_INTERPRET=1) by itself.
Tolerances: --tolerances FILE, else [tool.parity] of ./pyproject.toml, else built-in defaults.
Table: fits 120 columns (long names shortened in the middle with "…"); --wide shows every column.
Reports: --json, --junit-xml, --html, --markdown FILE; FILE "-" is standard output, instead of
the text report (a file named "-" is ./-).
Deprecated alias (until 0.3): --golden for --bundle.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "compare", help="compare this host against a golden bundle, layer by layer",
        description="Run a golden bundle's subject on this host and compare every recorded layer "
                    "output with the golden: cosine, max abs, rel L2, mismatches, judged by a tolerance policy.",
        epilog=EPILOG, formatter_class=HelpFormatter,
    )
    add_cli_options(parser, "golden", "impl", "device", "tolerances", "json", "junit_xml", required=("golden",))
    parser.add_argument("--isolate", action="store_true",
                        help="also replay each layer on its golden inputs (needs a bundle captured with "
                             "--record-inputs)")
    add_judging_options(parser)
    add_cli_options(parser, "repeat", "allow_nondeterministic")
    add_cli_options(parser, "weights_dir")
    parser.add_argument("--subject", default=None, metavar="SPEC",
                        help="trust and build this subject (must equal the bundle's; package.module:factory "
                             "or a built-in)")
    parser.add_argument("--placement", dest="placements", action="append", default=None, metavar="GLOB=PLACEMENT",
                        help="under torchrun: the placement of a plain tensor of this run's manual split, by "
                             "module glob (as capture's)")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    return run_reporting_errors(_run, args)


def _run(args: argparse.Namespace) -> int:
    from parity.bundle.reader import open_bundle
    from parity.judge.compare import compare_bundle, trusted_for_run
    from parity.judge.policy import policy_for_cli
    from parity.run import platform
    from parity.run.runtime import check_device, enable_triton_interpreter
    from parity.run.subjects.base import add_cwd_to_sys_path, is_builtin, remove_from_sys_path

    check_judging_args(args)  # before open(): a FIFO given as --tolerances would block forever
    if args.impl == "triton":
        require_dependency("triton", "--impl triton")
    device = (check_device(resolve_device(args.device)) if args.device is not None
              else platform.default_device())
    # Before anything imports Triton: the interpreter must be chosen before kernels are defined.
    enable_triton_interpreter(args.impl, device)

    from parity.distributed.group import launched
    from parity.distributed.rankset import looks_like_rank_set

    if launched() or looks_like_rank_set(args.golden):  # a rank set, or a torchrun launch (parity.distributed)
        from parity.cli.commands._distributed import compare as compare_ranks, quiet_other_ranks

        if args.repeat > 1:
            raise UsageError("--repeat applies to a single-process compare; a rank set takes none")
        quiet_other_ranks(args)
        report, passed = compare_ranks(args, device=device, progress=None if args.quiet else stderr_progress("compare"))
        if report is not None:
            write_outputs(report, args)
        return 0 if passed else 1
    if args.placements:
        raise UsageError("--placement applies to a distributed compare; run it under torchrun")
    bundle = open_bundle(args.golden)  # reads JSON and file sizes; imports and runs nothing
    root = bundle.path.resolve()
    remove_from_sys_path(root)  # a bundle directory is never where Python finds modules
    policy = policy_for_cli(args.tolerances, bundles=[bundle.path], strict_structure=args.strict_structure)
    trusted = trusted_for_run(args.subject, bundle.subject.get("spec"), bundle.path, policy.trusted_subjects)
    if not is_builtin(bundle.subject.get("spec")):
        # The user vouched for this module (--subject or their own config): find it in the
        # current directory as `python -m` would, but never inside the bundle.
        add_cwd_to_sys_path()
        remove_from_sys_path(root)
    policy = dataclasses.replace(policy, trusted_subjects=trusted)
    report = compare_bundle(
        bundle, impl=args.impl, device=device, policy=policy, isolate=args.isolate,
        budget=args.budget, progress=None if args.quiet else stderr_progress("compare"), weights_dir=args.weights_dir,
        repeat=args.repeat, allow_nondeterministic=args.allow_nondeterministic or (),
    )
    write_outputs(report, args)
    return 0 if report.passed else 1
