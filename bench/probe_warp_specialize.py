"""Does this Triton warp-specialize an attention-style loop for Hopper? A compile-only probe.

    python -m bench.probe_warp_specialize [--warps 4 8]

Compiles a minimal loop (TMA-descriptor loads of K tiles, one ``tl.dot`` into a 128x64 fp32
accumulator) for sm_90 with ``tl.range(..., warp_specialize=True)`` and without, each in its own
process (the compiler may abort on an assertion rather than raise). Reports per warp count:
``aborted`` / ``failed`` (with the last line of the compiler's error), ``same code`` (the
option was ignored: the PTX equals the plain loop's), or ``specialized`` (the PTX differs).
No GPU needed. bench/BENCHMARK.md records what Triton 3.6 (the H200's) and 3.9 answer.
"""
from __future__ import annotations

import argparse
import json
import sys

from .probe_pipelining import compile_in_child

_CHILD = r'''
import hashlib, json, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def loop(X, Y, N, WS: tl.constexpr):
    rows = tl.arange(0, 128)
    cols = tl.arange(0, 64)
    a = tl.load(X + rows[:, None] * 64 + cols[None, :])
    desc = tl.make_tensor_descriptor(X, shape=[N * 64, 64], strides=[64, 1], block_shape=[64, 64])
    acc = tl.zeros([128, 64], tl.float32)
    for i in tl.range(N, warp_specialize=WS):
        acc = tl.dot(a, desc.load([i * 64, 0]), acc)
    tl.store(Y + rows[:, None] * 64 + cols[None, :], acc)

ws, warps = sys.argv[1] == "1", int(sys.argv[2])
src = ASTSource(fn=loop, signature={"X": "*bf16", "Y": "*fp32", "N": "i32", "WS": "constexpr"}, constexprs={"WS": ws})
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3})
# Line info and the debug sections name files and cache paths; the code is what is compared.
ptx = kernel.asm["ptx"]
cut = ptx.find(".section\t.debug")
ptx = ptx if cut < 0 else ptx[:cut]
code = "\n".join(l for l in ptx.splitlines() if not l.lstrip().startswith((".loc", ".file")))
print(json.dumps({"ptx_sha256": hashlib.sha256(code.encode()).hexdigest(), "setmaxnreg": "setmaxnreg" in code,
                  "num_warps": kernel.metadata.num_warps}))
'''


def _compile(ws: bool, warps: int) -> dict:
    proc = compile_in_child(_CHILD, ["1" if ws else "0", str(warps)])
    if proc.returncode == 0:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assertion = next((line for line in lines if "Assertion" in line), None)
    status = "aborted" if proc.returncode < 0 else "failed"
    return {"status": status, "detail": (assertion or (lines[-1] if lines else f"exit {proc.returncode}"))[:300]}


def probe(warps: list[int]) -> list[dict]:
    import triton

    rows = []
    for count in warps:
        plain, special = _compile(False, count), _compile(True, count)
        if "status" in special:
            verdict = special["status"]
        elif "status" in plain:
            verdict = "plain loop did not compile"
        else:
            verdict = "same code" if special["ptx_sha256"] == plain["ptx_sha256"] else "specialized"
        rows.append({"triton": triton.__version__, "target": "sm_90", "num_warps": count, "verdict": verdict,
                     "detail": special.get("detail", "")})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    args = parser.parse_args(argv)
    for row in probe(args.warps):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
