"""``python -m parity show``: what a golden bundle holds (subject, capture host, every tensor), checksums verified."""
from __future__ import annotations

import argparse
import json
import sys

from parity.base.files import write_atomically
from parity.cli.commands._output import check_outputs
from parity.cli.options import STDOUT, HelpFormatter, add_cli_options

EPILOG = """\
Reads the manifest (checked against its schema) and, unless --no-verify, every shard and every
tensor checksum, as `verify` does. Prints the subject (spec and arguments), how it was captured,
the capture host's platform fingerprint (the numerics settings on their own line), totals by
kind, then one table per kind of tensor: name, dtype, shape, bytes, and for recorded outputs
whether the bundle holds a high-precision reference and how many module inputs were recorded.
A rank set (torchrun capture) is shown as a set: world size, mesh, each rank's bundle and
checksums, each recorded output's placement and full shape. Nothing named in the bundle is
imported or run. Exit status: 0 shown, 2 damaged or unusable
bundle or argument (one line on stderr).
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "show", help="show what a golden bundle holds: subject, platform, tensors, checksums",
        description="Show a golden bundle's subject, capture platform and every stored tensor "
                    "(kind, dtype, shape, bytes, reference, module inputs), with its checksums verified.",
        epilog=EPILOG, formatter_class=HelpFormatter,
    )
    parser.add_argument("bundle", help="the bundle directory (or a rank set's, shown as a set)")
    add_cli_options(parser, "json")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="do not read the tensors to check their checksums (the manifest is still checked)")
    parser.set_defaults(func=run)
    return parser


def describe(path: str, *, verify: bool) -> dict:
    """The description of a bundle, one rank's bundle of a set (shown alone: it judges nothing), or a
    rank set (the set whole, parity.distributed)."""
    from parity.distributed.rankset import looks_like_rank_set

    if looks_like_rank_set(path):
        from parity.distributed.show import describe_rank_set

        return describe_rank_set(path, verify=verify)
    from parity.report.show import describe_bundle

    return describe_bundle(path, verify=verify)


def run(args: argparse.Namespace) -> int:
    from parity.report.show import render_show

    check_outputs(args)  # now, before a long verification
    description = describe(args.bundle, verify=args.verify)
    if args.json != STDOUT:
        print(render_show(description))
    if args.json:
        text = json.dumps(description, indent=1, ensure_ascii=False) + "\n"
        if args.json == STDOUT:
            sys.stdout.write(text)
        else:
            write_atomically(args.json, text, "--json")
    return 0
