"""Benchmark: how fast compare loads a bundle's stored weights into the model, read ahead against read in turn.

``compare`` builds the subject's module and reads the bundle's state into it in chunks of
``STATE_CHUNK_BYTES`` (:meth:`parity.run.subjects.base.SubjectRunner.load_state`). This times
that load on a bundle, alternating two ways, on the same module in one process:

- ``in-turn``: each tensor read (``pread``) into pageable host memory, checksummed (BLAKE3) and
  then copied into the module (to the GPU with ``--device cuda``), one after another, chunk by
  chunk, as compare did before reading ahead;
- ``read-ahead``: ``load_state`` as compare runs it: the next tensors read and checksummed on
  background threads (:func:`parity.base.prefetch.read_ahead`) while this chunk is copied in;
  on a GPU through the reader's ring of page-locked pieces, copied on a side stream by those
  threads (``BundleReader.load_to``, :mod:`parity.bundle.staging`); the JSON then says how many
  pieces the ring made (``staging``).

With ``--cold`` the bundle's shard files are dropped from the page cache before each load
(``posix_fadvise(DONTNEED)``; it works without privileges on files one can read), so the disk is read.
Prints one JSON object: per way, the median seconds, GB/s and tensors/s of ``--repeats`` loads::

    PYTHONPATH=tests .venv/bin/python -m parity capture --subject scale_subject:make_subject \\
        --set width=2048 --set layers=24 --set tokens=64 --bundle /tmp/stack-c --reference none
    PYTHONPATH=tests .venv/bin/python bench/state_load.py /tmp/stack-c --repeats 5 [--cold] [--device cuda]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity.bundle.reader import open_bundle  # noqa: E402
from parity.judge.compare import subject_state  # noqa: E402
from parity.run.subjects import runner_from_manifest  # noqa: E402
from parity.run.subjects.base import STATE_CHUNK_BYTES, trusting  # noqa: E402


def drop_cache(bundle) -> None:
    for shard in bundle.shards:
        fd = os.open(bundle.path / shard.file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def in_turn(bundle, module) -> None:
    chunk, held = {}, 0
    for entry in bundle.entries_of("state"):
        if chunk and held + entry.nbytes > STATE_CHUNK_BYTES:
            module.load_state_dict(chunk, strict=False)
            chunk, held = {}, 0
        chunk[entry.name] = bundle.load(entry, "state")
        held += entry.nbytes
    if chunk:
        module.load_state_dict(chunk, strict=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cold", action="store_true", help="drop the shards from the page cache before each load")
    parser.add_argument("--impl", default=None, help="the impl to build (default: the bundle's)")
    parser.add_argument("--device", default="cpu",
                        help="where the module is built (cuda: the weights go to the GPU, as compare's do there)")
    args = parser.parse_args()
    bundle = open_bundle(args.bundle)
    spec = bundle.subject["spec"]
    with trusting(spec):
        runner = runner_from_manifest(bundle.subject, trusted=(spec,), bundle_dir=bundle.path)
    impl = args.impl or bundle.impl
    device = torch.device(args.device)
    module = runner.build(impl, state=None, device=device)
    entries = bundle.entries_of("state")
    nbytes = sum(entry.nbytes for entry in entries)
    times: dict[str, list[float]] = {"in-turn": [], "read-ahead": []}
    for _ in range(args.repeats):
        for way in times:
            if args.cold:
                drop_cache(bundle)
            start = time.perf_counter()
            if way == "in-turn":
                in_turn(bundle, module)
            else:
                runner.load_state(module, subject_state(bundle), impl)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[way].append(time.perf_counter() - start)
    result = {"bundle": str(bundle.path), "state_tensors": len(entries), "state_bytes": nbytes, "cold": args.cold,
              "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    if device.type == "cuda":
        # the ring of page-locked pieces the read-ahead way went through: made once, never more
        stager = bundle.stager(device)
        result["staging"] = {"pieces_made": stager.ring.made, "ring": stager.ring.count, "piece_bytes": stager.piece}
    for way, seconds in times.items():
        median = statistics.median(seconds)
        result[way] = {"median_s": round(median, 3), "gb_per_second": round(nbytes / 1e9 / median, 3),
                       "tensors_per_second": round(len(entries) / median, 1),
                       "all_s": [round(value, 3) for value in seconds]}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
