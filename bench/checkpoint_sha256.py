"""Benchmark: the digests of a checkpoint file: sha256 read then hashed, sha256 read ahead, both digests in one read (capture), and BLAKE3 on every core (compare).

``compare`` verifies every checkpoint file a bundle names (weights by reference) before it builds
anything (:func:`parity.bundle.weights.verify`); one file's sha256 is sequential, so for a
checkpoint of one large file (transformers' default shard is 50 GB) this pass is the file's size
at the slower of the disk and sha256, at best. Bundles now also record the file's BLAKE3, which
compare checks instead (``blake3-all-cores``: one file on every core), and capture computes both
in one read (``sha256+blake3``). This times each way on ``FILE``, alternating,
with the file dropped from the page cache before each (``--cold``, ``posix_fadvise(DONTNEED)``)
or not, and prints one JSON object (median seconds and GB/s of ``--repeats`` each)::

    .venv/bin/python bench/checkpoint_sha256.py /tmp/one-gib.bin --repeats 5 --cold
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity.bundle.weights import blake3_of, digests_of, sha256_in_turn, sha256_of  # noqa: E402


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cold", action="store_true", help="drop the file from the page cache before each hash")
    args = parser.parse_args(argv)
    path = Path(args.file)
    size = path.stat().st_size
    ways = {"in-turn": sha256_in_turn, "read-ahead": sha256_of, "sha256+blake3": lambda p: digests_of(p)[0],
            "blake3-all-cores": blake3_of}
    times: dict[str, list[float]] = {way: [] for way in ways}
    digests = set()
    blake3_digests = set()
    for _ in range(args.repeats):
        for way, function in ways.items():
            if args.cold:
                drop_cache(path)
            start = time.perf_counter()
            (blake3_digests if way == "blake3-all-cores" else digests).add(function(path))
            times[way].append(time.perf_counter() - start)
    if len(digests) != 1 or blake3_digests != {digests_of(path)[1]}:
        print("the ways gave different digests", file=sys.stderr)
        return 1
    result = {"file": str(path), "bytes": size, "cold": args.cold, "cpus": os.cpu_count()}
    for way, seconds in times.items():
        median = statistics.median(seconds)
        result[way] = {"median_s": round(median, 3), "gb_per_second": round(size / 1e9 / median, 3),
                       "all_s": [round(value, 3) for value in seconds]}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
