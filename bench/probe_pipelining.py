"""What Triton's software pipelining gives an attention loop on Hopper: two compile-only probes.

    python -m bench.probe_pipelining [--head-dim 64 128] [--only overlap|flatten]

Both compile small kernels for sm_90 without a GPU, each in its own process (the interpreter
setting of the tests must not reach it). bench/BENCHMARK.md records what Triton 3.6 (the
H200's) and 3.9 give.

**overlap**: can a product keep running during the softmax? FlashAttention-3 overlaps, within
one warpgroup, the softmax of one key tile with a matrix product: the scores of the next tile, or
the P @ V of the previous one (its "intra-warpgroup overlap"). In Triton the program order is the
only lever, so this probe writes one minimal attention loop (TMA-descriptor loads, online softmax
in base 2, 8 warps, 3 stages, bf16) in four orders, and a control:

- ``usual``: scores of tile t, softmax of tile t, P @ V of tile t (the prefill kernel's order);
- ``scores ahead``: scores of tile t + 1, then softmax and P @ V of tile t;
- ``pv behind``: scores of tile t, P @ V of tile t - 1, then softmax of tile t, then the
  accumulator's rescale;
- ``pv behind, rescale in product``: the same, with the rescale of the accumulator folded into
  the next P @ V's accumulator input (``dot(p, v, acc * alpha)``), so that nothing but the next
  product reads the product's result;
- ``control``: not attention: a product whose result only feeds the next product's accumulator,
  and exponentials of other data in the same loop. Here Triton may keep the product running
  (Hopper's MMA pipelining), so the count is not zero: it shows the reading can see an overlap.

For each it reports, from the machine code (``kernels.sass_schedule``), how many ``MUFU.EX2``
can issue while an HGMMA group may still run and how the waits are placed, and the registers and
spills.

**flatten**: can a persistent grid pipeline across its tiles? A persistent kernel loops over
query tiles (``tl.range(pid, tiles, programs, flatten=True)``) around the key loop; Triton can
fuse the two loops into one, so that the next tile's first loads overlap this tile's last
products, instead of one pipeline prologue and drain per tile. The probe compiles a minimal
persistent loop with and without ``flatten=True``, once with the key loop's trip count the same
for every tile (a dense layout) and once loaded per tile (a block-sparse layout's block count),
and says whether the option changed the code (``kernels.aot.code_digest`` of the PTX).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from parity.kernels.aot import code_digest, cubin_resources, cubin_sass
from parity.kernels.sass_schedule import exp2_overlap

__all__ = ["ORDERS", "TRIP_COUNTS", "probe", "probe_flatten", "compile_in_child"]

ORDERS = ("usual", "scores ahead", "pv behind", "pv behind, rescale in product", "control")
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
    elif ORDER == 3:  # pv behind, rescale in product: acc holds tiles < t - 1 scaled to the max before p's
        m, p, alpha, l = _softmax(tl.dot(q, tl.trans(k_desc.load([0, 0]))), m, l)
        for t in range(1, n_tiles):
            s = tl.dot(q, tl.trans(k_desc.load([t * BLOCK_N, 0])))
            acc = tl.dot(p.to(tl.bfloat16), v_desc.load([(t - 1) * BLOCK_N, 0]), acc * alpha[:, None])
            m, p, alpha, l = _softmax(s, m, l)
        acc = tl.dot(p.to(tl.bfloat16), v_desc.load([(n_tiles - 1) * BLOCK_N, 0]), acc * alpha[:, None])
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
with open(out + ".cubin", "wb") as fh:
    fh.write(kernel.asm["cubin"])
print(json.dumps({"triton": triton.__version__}))
'''


TRIP_COUNTS = ("per tile", "uniform")

_FLATTEN_CHILD = r'''
import json, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def persistent(X, Y, COUNTS, n_tiles, n_keys, PER_TILE: tl.constexpr, FLATTEN: tl.constexpr):
    rows = tl.arange(0, 128)
    cols = tl.arange(0, 64)
    desc = tl.make_tensor_descriptor(X, shape=[n_tiles * 64 + n_keys * 64, 64], strides=[64, 1],
                                     block_shape=[64, 64])
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), flatten=FLATTEN):
        a = tl.load(X + tile * 8192 + rows[:, None] * 64 + cols[None, :])
        acc = tl.zeros([128, 64], tl.float32)
        if PER_TILE:
            count = tl.load(COUNTS + tile)  # a block-sparse layout: each tile's own block count
        else:
            count = n_keys  # a dense layout: the same for every tile
        for j in range(count):
            acc = tl.dot(a, desc.load([tile * 64 + j * 64, 0]), acc)
        tl.store(Y + tile * 8192 + rows[:, None] * 64 + cols[None, :], acc)


per_tile, flatten, out = sys.argv[1] == "1", sys.argv[2] == "1", sys.argv[3]
signature = {"X": "*bf16", "Y": "*fp32", "COUNTS": "*i32", "n_tiles": "i32", "n_keys": "i32",
             "PER_TILE": "constexpr", "FLATTEN": "constexpr"}
source = ASTSource(fn=persistent, signature=signature, constexprs={"PER_TILE": per_tile, "FLATTEN": flatten})
kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3})
with open(out, "w") as fh:
    fh.write(kernel.asm["ptx"])
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
    row = {"probe": "overlap", "order": ORDERS[order], "head_dim": head_dim, "tile": f"128x{_BLOCK_N[head_dim]}", "target": "sm_90"}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "kernel")
        proc = compile_in_child(_CHILD, [str(order), str(_BLOCK_N[head_dim]), str(head_dim), out])
        if proc.returncode != 0:
            return {**row, "error": _child_error(proc)}
        row["triton"] = json.loads(proc.stdout.strip().splitlines()[-1])["triton"]
        cubin = Path(out + ".cubin").read_bytes()
        row.update(exp2_overlap(cubin_sass(cubin)).to_dict())
        usage = cubin_resources(cubin)
    row["registers"] = usage.get("REG")
    row["spill_bytes"] = usage.get("STACK", 0) + usage.get("LOCAL", 0)
    return row


def _child_error(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return (lines[-1] if lines else f"exit {proc.returncode}")[:300]


def probe(head_dims: list[int]) -> list[dict]:
    """The overlap probe: one row per (head dim, order) with the ``exp2_overlap`` counts,
    registers and spill bytes, or the compiler's error."""
    return [_one(order, head_dim) for head_dim in head_dims for order in range(len(ORDERS))]


def probe_flatten() -> list[dict]:
    """The flatten probe: one row per trip count (``TRIP_COUNTS``) with the verdict ``flattened``
    (``flatten=True`` changed the code) or ``ignored`` (the same code), or the compiler's error."""
    rows = []
    for per_tile in (True, False):
        row = {"probe": "flatten", "trip_count": TRIP_COUNTS[0] if per_tile else TRIP_COUNTS[1], "target": "sm_90"}
        digests = {}
        with tempfile.TemporaryDirectory() as tmp:
            for flatten in (False, True):
                out = os.path.join(tmp, f"flatten{int(flatten)}.ptx")
                proc = compile_in_child(_FLATTEN_CHILD, ["1" if per_tile else "0", "1" if flatten else "0", out])
                if proc.returncode != 0:
                    row["error"] = _child_error(proc)
                    break
                row["triton"] = json.loads(proc.stdout.strip().splitlines()[-1])["triton"]
                digests[flatten] = code_digest(Path(out).read_text())
        if "error" not in row:
            row["verdict"] = "ignored" if digests[False] == digests[True] else "flattened"
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, nargs="+", default=[128, 64], choices=sorted(_BLOCK_N),
                        help="head dims of the overlap probe")
    parser.add_argument("--only", choices=("overlap", "flatten"), help="run one probe (default: both)")
    args = parser.parse_args(argv)
    rows = []
    if args.only != "flatten":
        rows += probe(args.head_dim)
    if args.only != "overlap":
        rows += probe_flatten()
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
