"""Host time of a decode loop's attention calls through the transformers integration, on the CPU
with the kernel's launches stubbed: a step's first layer against its other layers.

    python bench/decode_steps_host.py                      # Llama-3-8B's heads, B=1, 4096 cached keys
    python bench/decode_steps_host.py --batch 8 --seq 4096 --steps 256 --json out.json

A model's decode step calls the integration's attention once per layer; the first call of a step
finds (or makes) the step's layout and its launch plan, the others reuse both. What is timed is the
integration's core (``ParityAttention``, as transformers' attention function calls it: no mask, one
query token, K/V of one more key each step, fresh tensors as ``DynamicCache`` concatenates them)
after the per-forward reset the mask function makes (``_PLANS.new_forward``), for ``--steps``
consecutive steps, with Triton's part stubbed as in ``bench/launch_overhead.py``'s CPU mode (a
build returns a stand-in compiled kernel, an issue does nothing): the Python of the integration
and of the launcher, nothing of the kernel. Prints one JSON object: median microseconds of a
step's first-layer call and of an other-layer call, and the decode plan cache's misses and hits
per step. No GPU needed (a GPU run's numbers come from ``python -m bench.hf_host``, its
``plans`` key).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import torch  # noqa: E402


def measure(batch: int, seq: int, steps: int, layers: int = 4) -> dict:
    from bench.launch_overhead import _stubbed_launches
    from parity.integrations import transformers as parity_tf
    from parity.kernels import attention

    heads_q, heads_kv, dim = 32, 8, 128  # Llama-3-8B's attention
    core = parity_tf.ParityAttention("kernel")
    q = torch.empty(batch, heads_q, 1, dim, dtype=torch.float16)
    first, others = [], []
    with _stubbed_launches():
        cache = attention._launch_cache("decode")
        hits, misses = cache.hits, cache.misses
        for step in range(steps):
            seq_k = seq + step
            # never written: the kernel does not run; fresh per step, as DynamicCache's torch.cat
            k = torch.empty(batch, heads_kv, seq_k, dim, dtype=torch.float16)
            v = torch.empty_like(k)
            parity_tf._PLANS.new_forward()  # what the mask function does once per forward
            for layer in range(layers):
                start = time.perf_counter()
                core(q, k, v, None, scaling=dim ** -0.5)
                (first if layer == 0 else others).append((time.perf_counter() - start) * 1e6)
        hits, misses = cache.hits - hits, cache.misses - misses
    return {"batch": batch, "seq": seq, "steps": steps, "layers": layers,
            "first_layer_us": round(statistics.median(first), 1),
            "first_layer_mean_us": round(statistics.fmean(first), 1),
            "other_layer_us": round(statistics.median(others), 1),
            "plan_misses_per_step": round(misses / steps, 3), "plan_hits_per_step": round(hits / steps, 3),
            "python": platform.python_version(), "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096, help="cached keys before the first step")
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.seq < 1 or args.steps < 1:
        print("decode_steps_host: --batch, --seq and --steps must be >= 1", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported: the launcher's CPU mode
    result = measure(args.batch, args.seq, args.steps)
    text = json.dumps(result)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
