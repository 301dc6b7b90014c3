"""``python -m parity verify``: check a bundle's manifest, every shard and every tensor checksum, in one pass."""
from __future__ import annotations

import argparse

from parity.base.text import printable
from parity.cli.options import HelpFormatter

EPILOG = """\
Checks, without running anything: the manifest against its schema (and its own checksum, for
bundles written since schema 2); every shard file (a plain file of the recorded size, a
safetensors header that lists exactly the manifest's tensors for it, contiguous and without
overlap, and its header's checksum (BLAKE3 from schema 4, sha256 in schema 3) or the whole file's
sha256 (schema 2)); every tensor's dtype, shape and checksum.
Each shard is read once. Exit status: 0 intact (a short summary on stdout), 2 damaged or
unusable (one line on stderr naming the file and the first problem).
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "verify", help="check a golden bundle's integrity: manifest schema, shards, every checksum",
        description="Check a golden bundle's manifest, shards and every tensor's checksum in one pass.",
        epilog=EPILOG, formatter_class=HelpFormatter,
    )
    parser.add_argument("bundle", help="the bundle directory")
    parser.set_defaults(func=run)
    return parser


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def summary_lines(bundle) -> list[str]:
    """What ``verify`` prints for a bundle that passed: its provenance, shards and tensors by kind."""
    from parity.bundle.manifest import KINDS

    subject = bundle.subject
    sealing = ("manifest and shard files checksummed" if bundle.sealed
               else "legacy: tensors checksummed, the manifest and shard headers not")
    host = bundle.platform.get("device_name") or bundle.platform.get("arch") or "?"
    shards = bundle.shards
    counts = {kind: [0, 0] for kind in KINDS}
    for entry in bundle.entries:
        counts[entry.kind][0] += 1
        counts[entry.kind][1] += entry.nbytes
    kinds = ", ".join(f"{kind} {number} ({_mib(size)})" for kind, (number, size) in counts.items() if number)
    return [
        f"parity verify: {printable(bundle.path)}: OK",
        f"  schema {bundle.schema_version} ({sealing}); subject {printable(subject.get('name') or subject['spec'])}, "
        f"captured with impl {printable(bundle.impl)} on {printable(host)}",
        f"  {len(shards)} shard{'s' if len(shards) != 1 else ''}, {_mib(sum(s.bytes for s in shards))}; "
        f"{len(bundle.entries)} tensors, every checksum matches",
        f"  {kinds or 'no tensors'}",
    ]


def run(args: argparse.Namespace) -> int:
    from parity.bundle.reader import open_bundle
    from parity.distributed.rankset import looks_like_rank_set

    if looks_like_rank_set(args.bundle):  # a rank set: the set whole, then every rank's bundle (parity.distributed)
        from parity.distributed.rankset import verify_rank_set

        print("\n".join(verify_rank_set(args.bundle, summary_lines)))
        return 0
    with open_bundle(args.bundle, rank_of_a_set=True) as bundle:  # a lone rank: verified, judged nothing
        bundle.verify()
        print("\n".join(summary_lines(bundle)))
    return 0
