"""Host time of building the block layouts the Hugging Face integration uses, per call.

Times each layout builder (and the integration's own entry points) with ``time.perf_counter``
on the CPU, where host time is exactly what is measured, and writes the median, min and max of
``--repeats`` calls per row as JSON. The machine's cores may be shared: read medians, and
compare two versions only from runs of the same command on the same machine.

    .venv/bin/python bench/layout_time.py --sizes 4096 16384 --repeats 7 --out layout_time.json

Rows (block 64 x 64, the integration's default):

- ``causal``, ``window1024``: ``causal_layout`` / ``sliding_window_layout`` at S x S;
- ``decode``: ``causal_layout(1, S)`` (one query row over an S-token cache);
- ``padded-B8``: ``padding_layout`` of 8 left-padded rows (lengths S, 7S/8, ..., S/8);
- ``documents``: ``document_layout`` of 8 packed documents of unequal lengths summing to S;
- ``integration-*``: what one forward of the integration derives for that mask, once, for
  every layer: ``kernel_layout`` for mask-less calls (causal, window, decode); for a padded
  batch the layout the kernel's mask function derives from the 2-D padding mask; for a packed
  batch (S <= 4096 only) ``kernel_layout`` recognising documents in the 4-D mask, which reads
  every element.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Callable

import torch

BLOCK = 64
BATCH = 8
DOCUMENTS = 8
DENSE_LIMIT = 4096  # the largest S at which a 4-D mask is materialised for a row


def _padding_lengths(seq: int) -> list[int]:
    return [seq * (BATCH - i) // BATCH for i in range(BATCH)]


def _document_lengths(seq: int) -> list[int]:
    # unequal lengths (weights 1..8) that sum to seq exactly
    weights = list(range(1, DOCUMENTS + 1))
    lengths = [seq * w // sum(weights) for w in weights]
    lengths[-1] += seq - sum(lengths)
    return lengths


def builder_cases(seq: int) -> dict[str, Callable[[], object]]:
    from parity.kernels import layout as layouts

    blocks = {"block_m": BLOCK, "block_n": BLOCK}
    return {
        "causal": lambda: layouts.causal_layout(seq, seq, **blocks),
        "window1024": lambda: layouts.sliding_window_layout(seq, seq, 1024, **blocks),
        "decode": lambda: layouts.causal_layout(1, seq, **blocks),
        "padded-B8": lambda: layouts.padding_layout(seq, seq, _padding_lengths(seq), side="left", **blocks),
        "documents": lambda: layouts.document_layout(_document_lengths(seq), **blocks),
    }


def integration_cases(seq: int) -> dict[str, Callable[[], object]]:
    from parity.integrations import transformers as parity_tf

    blocks = {"block_m": BLOCK, "block_n": BLOCK}
    padding = torch.zeros(BATCH, seq, dtype=torch.bool)
    for row, length in enumerate(_padding_lengths(seq)):
        padding[row, seq - length:] = True
    cases = {
        "integration-causal": lambda: parity_tf.kernel_layout(seq, seq, **blocks),
        "integration-window1024": lambda: parity_tf.kernel_layout(seq, seq, window=1024, **blocks),
        "integration-decode": lambda: parity_tf.kernel_layout(1, seq, **blocks),
        # what the kernel's mask function runs once per forward: the layout from the 2-D padding
        "integration-padded-B8": lambda: parity_tf._described_padding_layout(seq, seq, padding, 0, **blocks),
    }
    if seq <= DENSE_LIMIT:  # a packed batch is recognised by reading its 4-D mask: S^2 bytes
        starts = torch.tensor([0] + _document_lengths(seq)).cumsum(0)
        doc = torch.searchsorted(starts[1:], torch.arange(seq), right=True)
        visible = ((doc[:, None] == doc[None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril())[None, None]
        cases["integration-documents"] = lambda: parity_tf.kernel_layout(seq, seq, visible=visible, **blocks)
    return cases


def time_call(build: Callable[[], object], repeats: int) -> dict[str, float]:
    build()  # first call: imports, allocator warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        build()
        samples.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": statistics.median(samples), "min_ms": min(samples), "max_ms": max(samples),
            "samples_ms": samples}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384], help="sequence lengths S")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per row (median reported)")
    parser.add_argument("--only", default="", help="run only rows whose name contains this")
    parser.add_argument("--out", default=None, help="write the JSON here (default: stdout only)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or any(size < 1 for size in args.sizes):
        print("error: --repeats and --sizes must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # the host time of one caller, not of a shared pool
    rows = []
    for seq in args.sizes:
        for name, build in {**builder_cases(seq), **integration_cases(seq)}.items():
            if args.only not in name:
                continue
            row = {"name": name, "seq": seq, "block": BLOCK, **time_call(build, args.repeats)}
            rows.append(row)
            print(f"{name:28s} S={seq:6d}  median {row['median_ms']:9.3f} ms  (min {row['min_ms']:.3f}, "
                  f"max {row['max_ms']:.3f})", flush=True)
    result = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
              "threads": torch.get_num_threads(), "repeats": args.repeats, "rows": rows}
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
