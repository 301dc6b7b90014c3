"""Can a Triton attention loop keep a Hopper matrix product running during its softmax? A
compile-only probe.

    python -m parity.kernels.probe_mma_overlap [--head-dim 64 128]

FlashAttention-3 overlaps, within one warpgroup, the softmax of one key tile with a matrix
product: the scores of the next tile, or the P @ V of the previous one (its "intra-warpgroup
overlap"). In Triton the program order is the only lever, so this probe writes one minimal
attention loop (TMA-descriptor loads, online softmax in base 2, 8 warps, 3 stages, bf16) in three
orders and compiles each for sm_90 without a GPU:

- ``usual``: scores of tile t, softmax of tile t, P @ V of tile t (the prefill kernel's order);
- ``scores ahead``: scores of tile t + 1, then softmax and P @ V of tile t;
- ``pv behind``: scores of tile t, P @ V of tile t - 1, then softmax of tile t;
- ``control``: not attention: a product whose result only feeds the next product's accumulator,
  and exponentials of other data in the same loop. Here Triton may keep the product running
  (Hopper's MMA pipelining), so the count is not zero: it shows the reading can see an overlap.

For each it reports, from the PTX (``kernels.ptx_schedule``), how many ``ex2`` instructions can
issue while a wgmma group is still running and how the waits are placed, and the registers and
spills from the cubin. Each compile runs in its own process (the interpreter setting of the
tests must not reach it). kernels/BENCHMARK.md records what Triton 3.6 (the H200's) and 3.9 give.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .aot import cubin_resources
from .ptx_schedule import exp2_overlap

__all__ = ["ORDERS", "probe", "compile_in_child"]

ORDERS = ("usual", "scores ahead", "pv behind", "control")
# The pinned sm_90 tiles of each head dim (kernels/configs.py): 128x128 at D=128, 128x64 at D=64.
_BLOCK_N = {64: 64, 128: 128}

_CHILD = r'''
import json, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _softmax(s, m, l):
    # online softmax of one score tile (scores already in log2 units): new max, p, rescale factor, sum
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m - m_new)
    return m_new, p, alpha, l * alpha + tl.sum(p, 1)


@triton.jit
def loop(Q, K, V, O, n_tiles, ORDER: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    rows = tl.arange(0, 128)
    cols = tl.arange(0, D)
    q = tl.load(Q + rows[:, None] * D + cols[None, :])
    k_desc = tl.make_tensor_descriptor(K, shape=[n_tiles * BLOCK_N, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    v_desc = tl.make_tensor_descriptor(V, shape=[n_tiles * BLOCK_N, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    m = tl.full([128], float("-inf"), tl.float32)
    l = tl.zeros([128], tl.float32)
    acc = tl.zeros([128, D], tl.float32)
    if ORDER == 0:  # usual
        for t in range(n_tiles):
            s = tl.dot(q, tl.trans(k_desc.load([t * BLOCK_N, 0])))
            m, p, alpha, l = _softmax(s, m, l)
            acc = tl.dot(p.to(tl.bfloat16), v_desc.load([t * BLOCK_N, 0]), acc * alpha[:, None])
    elif ORDER == 1:  # scores ahead
        s = tl.dot(q, tl.trans(k_desc.load([0, 0])))
        for t in range(1, n_tiles):
            s_next = tl.dot(q, tl.trans(k_desc.load([t * BLOCK_N, 0])))
            m, p, alpha, l = _softmax(s, m, l)
            acc = tl.dot(p.to(tl.bfloat16), v_desc.load([(t - 1) * BLOCK_N, 0]), acc * alpha[:, None])
            s = s_next
        m, p, alpha, l = _softmax(s, m, l)
        acc = tl.dot(p.to(tl.bfloat16), v_desc.load([(n_tiles - 1) * BLOCK_N, 0]), acc * alpha[:, None])
    elif ORDER == 2:  # pv behind: acc holds tiles < t - 1 scaled to m; p is tile t - 1's
        m, p, alpha, l = _softmax(tl.dot(q, tl.trans(k_desc.load([0, 0]))), m, l)
        for t in range(1, n_tiles):
            s = tl.dot(q, tl.trans(k_desc.load([t * BLOCK_N, 0])))
            acc = tl.dot(p.to(tl.bfloat16), v_desc.load([(t - 1) * BLOCK_N, 0]), acc)
            m, p, alpha, l = _softmax(s, m, l)
            acc = acc * alpha[:, None]
        acc = tl.dot(p.to(tl.bfloat16), v_desc.load([(n_tiles - 1) * BLOCK_N, 0]), acc)
    else:  # control: a product that only feeds the next one's accumulator, exp2 on other data
        x = tl.zeros([128, D], tl.float32)
        for t in range(n_tiles):
            acc = tl.dot(q, tl.trans(k_desc.load([t * BLOCK_N, 0])), acc)  # [128, BLOCK_N]: BLOCK_N == D here
            x = tl.math.exp2(x * 0.5 - 1.0)
        acc = acc + x
    tl.store(O + rows[:, None] * D + cols[None, :], acc / l[:, None])


order, block_n, head_dim, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
signature = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*fp32", "n_tiles": "i32",
             "ORDER": "constexpr", "BLOCK_N": "constexpr", "D": "constexpr"}
source = ASTSource(fn=loop, signature=signature, constexprs={"ORDER": order, "BLOCK_N": block_n, "D": head_dim})
kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3})
with open(out + ".ptx", "w") as fh:
    fh.write(kernel.asm["ptx"])
with open(out + ".cubin", "wb") as fh:
    fh.write(kernel.asm["cubin"])
print(json.dumps({"triton": triton.__version__}))
'''


def compile_in_child(source: str, argv: list[str], *, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``source`` as a script in a fresh Python (Triton reads a jit function's source from its
    file, so the script is written out, not passed with -c), without ``TRITON_INTERPRET``."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "parity_probe_child.py")
        with open(path, "w") as fh:
            fh.write(source)
        return subprocess.run([sys.executable, path, *argv], capture_output=True, text=True, timeout=timeout,
                              env=env)


def _one(order: int, head_dim: int) -> dict:
    row = {"order": ORDERS[order], "head_dim": head_dim, "tile": f"128x{_BLOCK_N[head_dim]}", "target": "sm_90"}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "kernel")
        proc = compile_in_child(_CHILD, [str(order), str(_BLOCK_N[head_dim]), str(head_dim), out])
        if proc.returncode != 0:
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            return {**row, "error": (lines[-1] if lines else f"exit {proc.returncode}")[:300]}
        row["triton"] = json.loads(proc.stdout.strip().splitlines()[-1])["triton"]
        row.update(exp2_overlap(Path(out + ".ptx").read_text()).to_dict())
        usage = cubin_resources(Path(out + ".cubin").read_bytes())
    row["registers"] = usage.get("REG")
    row["spill_bytes"] = usage.get("STACK", 0) + usage.get("LOCAL", 0)
    return row


def probe(head_dims: list[int]) -> list[dict]:
    """One row per (head dim, order): the ``exp2_overlap`` counts, registers and spill bytes, or
    the compiler's error."""
    return [_one(order, head_dim) for head_dim in head_dims for order in range(len(ORDERS))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, nargs="+", default=[128, 64], choices=sorted(_BLOCK_N))
    args = parser.parse_args(argv)
    for row in probe(args.head_dim):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
