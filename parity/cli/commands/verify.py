"""``python -m parity verify``: check a bundle's manifest, every shard and every tensor checksum, in one pass."""
from __future__ import annotations

import argparse

from parity.base.errors import UsageError
from parity.base.text import printable
from parity.cli.options import HelpFormatter

EPILOG = """\
Checks, without running anything: the manifest against its schema (and its own checksum, for
bundles written since schema 2); every shard file (a plain file of the recorded size, a
safetensors header that lists exactly the manifest's tensors for it, contiguous and without
overlap, and its header's checksum (BLAKE3 from schema 4, sha256 in schema 3) or the whole file's
sha256 (schema 2)); every tensor's dtype, shape and checksum.
Each shard is read once.
A bundle captured with --weights-from names its checkpoint files instead of storing the
weights: each is looked for (in --weights-dir by file name, else at the path recorded at
capture) and its size and sha256 checked; a file that differs is refused, naming it. A file
that is not there cannot be verified: the line names every such file and the exit status is 2,
unless --skip-weights says the checkpoint is checked elsewhere (compare checks it before it
builds), which the summary then states.
Exit status: 0 intact (a short summary on stdout), 2 damaged or unusable, or checkpoint files
that could not be verified (one line on stderr naming the file and the first problem).
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "verify", help="check a golden bundle's integrity: manifest schema, shards, every checksum",
        description="Check a golden bundle's manifest, shards and every tensor's checksum in one pass.",
        epilog=EPILOG, formatter_class=HelpFormatter,
    )
    parser.add_argument("bundle", help="the bundle directory")
    parser.add_argument("--weights-dir", default=None, metavar="DIR",
                        help="where this host holds the checkpoint files a bundle captured with --weights-from "
                             "names (found by file name; default: the paths recorded at capture)")
    parser.add_argument("--skip-weights", action="store_true",
                        help="do not look for the checkpoint files such a bundle names (they are checked elsewhere, "
                             "e.g. by compare before it builds): exit 0 when the bundle itself is intact")
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


def weights_line(bundle, directory: str | None, skip: bool) -> str | None:
    """The summary line of the checkpoint files a bundle names (None: it names none), after each
    one that is there is verified. A UsageError names a file that differs, or every file that is
    not there (unless ``skip``: then none is looked for and the line says so)."""
    from parity.bundle import weights as checkpoint_weights

    named = bundle.weights
    if named is None:
        if directory is not None:
            raise UsageError(f"--weights-dir: {printable(bundle.path)} stores its weights; it names no checkpoint files")
        return None
    files = named["files"]
    size = sum(file["bytes"] for file in files)
    what = f"{len(files)} checkpoint file{'s' if len(files) != 1 else ''} ({_mib(size)})"
    if skip:
        return f"  weights by reference: {what} named, NOT verified here (--skip-weights)"
    verified, missing = checkpoint_weights.verify_present(named, directory)
    if missing:
        shown = ", ".join(printable(str(path)) for path in missing[:4]) + (
            f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise UsageError(f"{printable(bundle.path)}: the bundle is intact, but {len(missing)} of the {len(files)} "
                         f"checkpoint files it names could not be verified: not found at {shown}; pass --weights-dir "
                         "DIR where they are on this host, or --skip-weights where they are checked elsewhere")
    where = f"in {printable(directory)}" if directory is not None else "at the paths recorded at capture"
    digests = sorted({"BLAKE3" if "blake3" in file else "sha256" for file in files})
    return f"  weights by reference: {what} {where}, size and {' or '.join(digests)} verified"


def run(args: argparse.Namespace) -> int:
    from parity.bundle.reader import open_bundle
    from parity.distributed.rankset import looks_like_rank_set

    if looks_like_rank_set(args.bundle):  # a rank set: the set whole, then every rank's bundle (parity.distributed)
        from parity.distributed.rankset import open_rank_set, verify_rank_set

        lines = verify_rank_set(args.bundle, summary_lines)
        ranks = open_rank_set(args.bundle).ranks
        # Rank 0's bundle holds the subject's state, so it is the one that can name checkpoint files.
        holders = [reader for reader in ranks if reader.weights is not None] or ranks[:1]
        named = [weights_line(reader, args.weights_dir, args.skip_weights) for reader in holders]
        print("\n".join(lines + [line for line in named if line is not None]))
        return 0
    with open_bundle(args.bundle, rank_of_a_set=True) as bundle:  # a lone rank: verified, judged nothing
        bundle.verify()
        line = weights_line(bundle, args.weights_dir, args.skip_weights)
        print("\n".join(summary_lines(bundle) + ([line] if line is not None else [])))
    return 0
