"""Where a decode call's device time goes: the split kernel and the merge, per merge setting (GPU).

    python -m bench.probe_decode_merge                      # the three decode rows, JSON lines
    python -m bench.probe_decode_merge --rows decode-b1-4k --unroll u1,default --merge tile

For each decode row of bench/launch_overhead.py (Hq=32, Hkv=8, D=128, bf16, one query token),
each merge (``fused``: the split kernel's last program per head group merges; ``kernel``: the
``decode_combine`` launch after it), each form of the merge's first pass (``tile``: every split's
LSEs read as one tile, the pinned ``DecodeConfig.merge_lse_tile``; ``loop``: split by split,
``merge_lse_tile=0``; both give the same bits) and each merge unrolling (``uN``: N splits' tiles read per iteration of the merge; ``default`` is
``kernels.decode.merge_unroll``), at the pinned
split count and at a few others: the call's time replayed from a CUDA graph
(``do_bench_cudagraph``, µs) and each kernel's device time under the torch profiler (µs per call,
mean of ``--calls`` calls), beside PyTorch's SDPA on the same tensors. A probe: it patches the
unrolling by replacing ``merge_unroll`` in ``kernels.decode`` for the duration of one setting.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import torch  # noqa: E402

from bench.launch_overhead import DECODE_ROWS  # noqa: E402


@contextlib.contextmanager
def _unroll(setting: str):
    from parity.kernels import attention, decode

    original = decode.merge_unroll
    if setting != "default":  # uN: N splits read per iteration of the merge
        decode.merge_unroll = lambda splits: int(setting[1:])
    attention._LAUNCH_CACHES.clear()
    try:
        yield
    finally:
        decode.merge_unroll = original
        attention._LAUNCH_CACHES.clear()


def _kernel_us(fn, calls: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if device_us > 0:
            times[event.key[:60]] = round(device_us / calls, 2)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(DECODE_ROWS))
    parser.add_argument("--unroll", default="default")
    parser.add_argument("--merge", default="tile,loop", help="the merge's first pass: tile, loop or both")
    parser.add_argument("--splits", default="auto,4,8,16", help="split counts: auto (the pinned choice) and forced")
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args(argv)
    merges = args.merge.split(",")
    if not merges or any(merge not in ("tile", "loop") for merge in merges):
        parser.error(f"--merge takes tile and loop, got {args.merge!r}")
    from triton.testing import do_bench_cudagraph

    from parity.kernels import block_sparse_attention, causal_layout
    from parity.kernels.attention import decode_config
    from parity.kernels.testing import random_qkv

    from parity.kernels import decode

    chosen = []
    pick = decode.choose_splits

    def recording(*a, **kw):  # the pinned split count of each build, recorded
        n = pick(*a, **kw)
        chosen.append({"programs": a[0], "max_tiles": a[1], "units": a[2], "splits": n})
        return n
    decode.choose_splits = recording
    device = torch.device("cuda")
    for row in args.rows.split(","):
        batch, seq_k = DECODE_ROWS[row]
        layout = causal_layout(1, seq_k, block_m=128, block_n=128).to(device)
        q, k, v = random_qkv(batch, 32, 8, 1, seq_k, 128, torch.bfloat16, 0, device)
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
        result = {"row": row, "device": torch.cuda.get_device_name(), "sdpa": {
            "graph_us": round(do_bench_cudagraph(sdpa, rep=100) * 1e3, 2), "kernels": _kernel_us(sdpa, args.calls)}}
        reference = None
        same_count = {}  # (mode, unrolling, splits) -> the first merge's output at that split count
        for mode, fused, merge in ((m, f, g) for m, f in (("fused", True), ("kernel", False)) for g in merges):
            config = dataclasses.replace(decode_config(device, 128, q.dtype).clamp(layout.block_n), fused_combine=fused)
            if merge == "loop":
                config = dataclasses.replace(config, merge_lse_tile=0)
            for setting in args.unroll.split(","):
                with _unroll(setting):
                    for splits in args.splits.split(","):
                        n = None if splits == "auto" else int(splits)
                        key = f"{mode}/{merge}/{setting}/splits={splits}"

                        def call():
                            return block_sparse_attention(q, k, v, layout, decode=True, config=config, num_splits=n)
                        try:
                            res = call()
                            out = res[0] if isinstance(res, tuple) else res
                            if reference is None:
                                reference = out
                            err = float((out.float() - reference.float()).abs().max())
                            result[key] = {"graph_us": round(do_bench_cudagraph(call, rep=100) * 1e3, 2),
                                           "kernels": _kernel_us(call, args.calls), "max_diff_vs_first": err}
                            # the merges at one split count must agree bit for bit (the first pass
                            # takes a max, exact in any order; fused and combine sum in one order)
                            first = same_count.setdefault((setting, splits), out)
                            if first is not out:
                                result[key]["bits_equal_at_this_count"] = bool(torch.equal(first, out))
                        except Exception as exc:  # a probe: keep what the other settings measured
                            result[key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        result["choose_splits"] = chosen[:4]
        chosen.clear()
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
