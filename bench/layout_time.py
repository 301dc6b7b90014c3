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
- ``integration-*``: what one forward of the integration builds for that mask
  (``parity.integrations.transformers.forward_layout`` where it exists: the plan every layer
  then reuses; else ``kernel_layout``, which every layer called). ``integration-padded-B8`` is
  built from the 2-D padding mask and ``integration-documents`` from packed ``position_ids``,
  as transformers hands them to the mask function.
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
    forward_layout = getattr(parity_tf, "forward_layout", None)
    cases = {
        "integration-causal": lambda: parity_tf.kernel_layout(seq, seq, **blocks),
        "integration-window1024": lambda: parity_tf.kernel_layout(seq, seq, window=1024, **blocks),
        "integration-decode": lambda: parity_tf.kernel_layout(1, seq, **blocks),
    }
    if forward_layout is not None:
        padding = torch.zeros(BATCH, seq, dtype=torch.long)
        for row, length in enumerate(_padding_lengths(seq)):
            padding[row, seq - length:] = 1
        positions = torch.cat([torch.arange(n) for n in _document_lengths(seq)])[None]
        cases["integration-padded-B8"] = lambda: forward_layout(seq, seq, padding_mask=padding, **blocks)
        cases["integration-documents"] = lambda: forward_layout(seq, seq, position_ids=positions, **blocks)
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
