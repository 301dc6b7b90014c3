"""Eager cost of calling a Python function through the PyTorch dispatcher: ``custom_op`` against a
``torch.library.Library`` op against the bare function (each makes two new tensors), microseconds
per call (best of 5 rounds of 20,000 calls). Why ``kernels/op.py`` registers the kernel as it does.

    python bench/op_dispatch.py
"""
import json
import time
from typing import Optional

import torch

_LIB = torch.library.Library("parity_bench", "DEF")
_LIB.define("library_op(Tensor q, Tensor a, Tensor? b, int m, float s, bool r) -> (Tensor, Tensor)")


def _bare(q, a, b, m, s, r):
    return torch.empty(1), torch.empty(1)


_LIB.impl("library_op", _bare, "CPU")


@torch.library.register_fake("parity_bench::library_op", lib=_LIB)
def _fake(q, a, b, m, s, r):
    return torch.empty_like(q), torch.empty_like(a)


@torch.library.custom_op("parity_bench::custom", mutates_args=())
def _custom(q: torch.Tensor, a: torch.Tensor, b: Optional[torch.Tensor], m: int, s: float,
            r: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(1), torch.empty(1)


def _us(fn, calls=20000, rounds=5) -> float:
    q, a = torch.randn(2, 2), torch.randn(3)
    for _ in range(2000):
        fn(q, a, None, 3, 0.5, False)
    best = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn(q, a, None, 3, 0.5, False)
        best.append((time.perf_counter() - start) / calls * 1e6)
    return round(min(best), 2)


if __name__ == "__main__":
    print(json.dumps({"torch": torch.__version__, "bare_us": _us(_bare),
                      "library_op_us": _us(torch.ops.parity_bench.library_op.default),
                      "custom_op_us": _us(torch.ops.parity_bench.custom.default)}))
