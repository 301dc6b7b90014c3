"""Host time and aten ops of one Hugging Face attention layer's call, per attention implementation.

A decode step of a large model in eager mode is bound by the host (bench/BENCHMARK.md, fourth
round: 32 layers x ~0.7 ms of Python), so what each layer's attention call costs the host is the
per-token gap between ``sdpa``, ``parity_sdpa`` and ``parity_sparse``. This calls the attention
function transformers registered for each implementation exactly as a Llama layer does (the
module, query [B, Hq, Sq, D] as a transposed view of the projection, key/value [B, Hkv, Sk, D] as
the cache's concatenation, the mask its mask function made once per forward, ``scaling``), for
``--layers`` layer modules per forward, and reports per implementation:

- ``decode``: ``--steps`` decode forwards (one query token, one key more per step, fresh K/V per
  step), the median microseconds of the first layer's call (which finds or builds what the
  forward shares) and of the other layers', and the mask function's per forward;
- ``prefill``: forwards of ``--seq`` tokens (mask-less causal, as transformers passes it), the
  same split; the output's transpose copy (the same in every implementation) is included;
- ``ops``: the aten ops one layer's call issues (torch.profiler, top-level ops only, by name), for
  a decode layer and a prefill layer after the first: every copy, cast or new tensor is device
  work and host time on a GPU too;
- ``parts``: cProfile of the decode loop, cumulative microseconds per layer call of the
  functions on the path (cProfile's own cost inflates every Python call: compare, do not add).

CPU (the default): Triton's part is stubbed as in ``bench/launch_overhead.py``'s CPU mode (a
build returns a stand-in compiled kernel, an issue does nothing) and SDPA's compute is a stand-in
that allocates its output, so what is timed is the Python and the tensor bookkeeping around the
attention compute, nothing of the compute; q, k, v are allocated and never written. ``--device
cuda``: nothing stubbed, the calls queued without synchronizing (the host time a queued step
sees); ``bench/hf_host.py`` reports it for its model as ``layer_host``.

    python bench/hf_layer_host.py                          # Llama-3-8B's heads, B=1, 4096 keys
    python bench/hf_layer_host.py --batch 8 --seq 2048 --json out.json

Needs transformers.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import torch  # noqa: E402

IMPLS = ("sdpa", "parity_sdpa", "parity_sparse")
HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128  # Llama-3-8B's attention
# the functions of the path whose cumulative time ``parts`` reports (cProfile's names)
PATH_FUNCTIONS = ("sdpa_attention_forward", "attention", "_call_impl", "forward", "_plan", "_run_kernel",
                  "sparse_attention", "block_sparse_attention", "_planned", "_plan_key", "find", "issue",
                  "state", "_sdpa", "scaled_dot_product_attention", "contiguous", "__call__", "_decide",
                  "_execute", "_sdpa_run", "_bind_step", "bind_planned", "reuse")


class _Layer(torch.nn.Module):
    """What transformers' attention function reads from a Llama attention module."""

    def __init__(self, config, index: int):
        super().__init__()
        self.config, self.layer_idx, self.is_causal = config, index, True
        self.num_key_value_groups = HEADS_Q // HEADS_KV


def _sdpa_stand_in(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA's compute replaced (CPU timing): its output, allocated as the GPU's flash and cuDNN
    backends return it ([B, Sq, H, D] in memory, so transformers' transpose back is no copy)."""
    batch, heads, seq_q, _ = query.shape
    return query.new_empty(batch, seq_q, heads, value.shape[-1]).transpose(1, 2)


@contextlib.contextmanager
def _stubbed(cpu: bool):
    if not cpu:
        yield
        return
    from bench.launch_overhead import _stubbed_launches

    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _sdpa_stand_in
    try:
        with _stubbed_launches():
            yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def _tensors(batch: int, seq_q: int, seq_k: int, dtype, device):
    # query as Llama makes it: [B, Sq, Hq, D] projected, viewed, transposed to [B, Hq, Sq, D]
    q = torch.empty(batch, seq_q, HEADS_Q, HEAD_DIM, dtype=dtype, device=device).transpose(1, 2)
    k = torch.empty(batch, HEADS_KV, seq_k, HEAD_DIM, dtype=dtype, device=device)
    return q, k, torch.empty_like(k)


def _mask_kwargs(batch: int, seq_q: int, seq_k: int, padding: torch.Tensor, config, dtype, device) -> dict:
    """What ``create_causal_mask`` passes an implementation's mask function (no padding)."""
    from transformers.masking_utils import causal_mask_function

    return dict(batch_size=batch, q_length=seq_q, kv_length=seq_k, q_offset=seq_k - seq_q, kv_offset=0,
                mask_function=causal_mask_function, attention_mask=padding, allow_is_causal_skip=True,
                dtype=dtype, config=config, use_vmap=False, device=device)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _forwards(impl: str, batch: int, seq: int, steps: int, layers: int, decode: bool, device, dtype,
              record: dict | None = None, labelled: bool = False, first: cProfile.Profile | None = None):
    """Run ``steps`` forwards' attention calls; into ``record`` (when given) the host µs of the
    mask function, of each forward's first layer call and of the others; ``first`` (a profiler)
    is enabled around each forward's first layer call only."""
    from transformers import LlamaConfig
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = LlamaConfig(num_attention_heads=HEADS_Q, num_key_value_heads=HEADS_KV, head_dim=HEAD_DIM,
                         hidden_size=HEADS_Q * HEAD_DIM, num_hidden_layers=layers)
    config._attn_implementation = impl
    modules = [_Layer(config, index) for index in range(layers)]
    attention, mask_function = ALL_ATTENTION_FUNCTIONS[impl], ALL_MASK_ATTENTION_FUNCTIONS[impl]
    scaling = HEAD_DIM ** -0.5
    for step in range(steps):
        seq_k = seq + step if decode else seq
        seq_q = 1 if decode else seq
        q, k, v = _tensors(batch, seq_q, seq_k, dtype, device)  # fresh K/V, as DynamicCache's torch.cat
        padding = torch.ones(batch, seq_k, dtype=torch.bool, device=device)
        _sync(device)
        start = time.perf_counter()
        mask = mask_function(**_mask_kwargs(batch, seq_q, seq_k, padding, config, dtype, device))
        spent = time.perf_counter() - start
        if record is not None:
            record["mask"].append(spent * 1e6)
        for layer, module in enumerate(modules):
            label = torch.profiler.record_function(f"layer{layer}") if labelled else contextlib.nullcontext()
            profiled = first is not None and layer == 0
            if profiled:
                first.enable()
            start = time.perf_counter()
            with label:
                attention(module, q, k, v, mask, dropout=0.0, scaling=scaling)
            spent = time.perf_counter() - start
            if profiled:
                first.disable()
            if record is not None:
                record["first" if layer == 0 else "other"].append(spent * 1e6)
        _sync(device)


def _op_counts(impl: str, batch: int, seq: int, decode: bool, device, dtype) -> dict[str, float]:
    """Top-level aten ops of one layer's call after the forward's first (by name, per call)."""
    from torch.profiler import ProfilerActivity, profile

    layers = 4
    _forwards(impl, batch, seq, 1, layers, decode, device, dtype)  # plans made
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        _forwards(impl, batch, seq, 1, layers, decode, device, dtype, labelled=True)
    counts: dict[str, float] = {}
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent, layer = event.cpu_parent, None
        while parent is not None and not parent.name.startswith("aten::"):
            if parent.name.startswith("layer"):
                layer = parent.name
                break
            parent = parent.cpu_parent
        if layer is not None and layer != "layer0":  # a top-level op of a layer after the first
            counts[event.name] = counts.get(event.name, 0) + 1
    return {name: round(count / (layers - 1), 2) for name, count in sorted(counts.items())}


def _parts(impl: str, batch: int, seq: int, steps: int, layers: int, device, dtype,
           first_only: bool = False) -> dict[str, float]:
    """Cumulative µs per call of the path's functions: over every layer call of ``steps`` decode
    forwards, or (``first_only``) over each forward's first layer call, the one that finds or
    binds what the forward shares."""
    profile = cProfile.Profile()
    if first_only:
        _forwards(impl, batch, seq, steps, layers, True, device, dtype, first=profile)
    else:
        profile.enable()
        _forwards(impl, batch, seq, steps, layers, True, device, dtype)
        profile.disable()
    stats = pstats.Stats(profile, stream=io.StringIO()).stats
    calls = steps if first_only else steps * layers
    out = {}
    for (file, line, name), (_, _, _, cum, _) in stats.items():
        if name in PATH_FUNCTIONS and ("parity" in file or "kernels" in file or "transformers" in file
                                       or "bench" in file or name in ("_call_impl", "contiguous")):
            label = f"{Path(file).name}:{name}"
            out[label] = round(out.get(label, 0.0) + cum * 1e6 / calls, 1)
    return dict(sorted(out.items(), key=lambda item: -item[1]))


def measure(impl: str, *, batch: int, seq: int, steps: int, layers: int, device, dtype,
            prefill_forwards: int = 5) -> dict:
    """One implementation's row (see the module docstring)."""
    row: dict = {"impl": impl}
    _forwards(impl, batch, seq, 2, layers, True, device, dtype)  # warm-up: imports, plans
    record = {"mask": [], "first": [], "other": []}
    _forwards(impl, batch, seq, steps, layers, True, device, dtype, record)
    row["decode"] = {"first_layer_us": round(statistics.median(record["first"]), 1),
                     "other_layer_us": round(statistics.median(record["other"]), 1),
                     "other_layer_mean_us": round(statistics.fmean(record["other"]), 1),
                     "mask_function_us": round(statistics.median(record["mask"]), 1)}
    record = {"mask": [], "first": [], "other": []}
    _forwards(impl, batch, seq, 1, layers, False, device, dtype)  # warm-up
    _forwards(impl, batch, seq, prefill_forwards, layers, False, device, dtype, record)
    row["prefill"] = {"first_layer_us": round(statistics.median(record["first"]), 1),
                      "other_layer_us": round(statistics.median(record["other"]), 1),
                      "mask_function_us": round(statistics.median(record["mask"]), 1)}
    row["ops"] = {"decode_layer": _op_counts(impl, batch, seq, True, device, dtype),
                  "prefill_layer": _op_counts(impl, batch, seq, False, device, dtype)}
    row["parts"] = _parts(impl, batch, seq, max(steps // 4, 4), layers, device, dtype)
    row["first_layer_parts"] = _parts(impl, batch, seq, max(steps // 4, 4), layers, device, dtype, first_only=True)
    return row


def run(impls, *, batch: int, seq: int, steps: int, layers: int, device, dtype, rounds: int = 1) -> list[dict]:
    """Every implementation's row; with ``rounds`` > 1 the decode timing again, implementations
    in turn (``decode_rounds``: first and other layer µs per round)."""
    from parity.integrations import transformers as parity_tf

    parity_tf.register()
    cpu = device.type == "cpu"
    with _stubbed(cpu):
        rows = [measure(impl, batch=batch, seq=seq, steps=steps, layers=layers, device=device, dtype=dtype)
                for impl in impls]
        for _ in range(rounds - 1):
            for row in rows:
                record = {"mask": [], "first": [], "other": []}
                _forwards(row["impl"], batch, seq, steps, layers, True, device, dtype, record)
                row.setdefault("decode_rounds", []).append(
                    [round(statistics.median(record["first"]), 1), round(statistics.median(record["other"]), 1)])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096, help="cached keys before the first decode step; prefill length")
    parser.add_argument("--steps", type=int, default=64, help="decode forwards timed")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="decode timing rounds, implementations in turn")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    impls = args.impls.split(",")
    if (min(args.batch, args.seq, args.steps, args.layers, args.rounds) < 1 or args.layers < 2
            or any(impl not in IMPLS for impl in impls)):
        print(f"hf_layer_host: --batch, --seq, --steps, --rounds must be >= 1, --layers >= 2, --impls among "
              f"{','.join(IMPLS)}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("hf_layer_host: --device cuda needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported: the launcher's CPU mode
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("hf_layer_host: needs transformers (pip install 'parity[transformers]')", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    # bf16 on a GPU; fp16 on the CPU (under the interpreter bf16 adds an fp32 staging buffer a GPU never makes)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    rows = run(impls, batch=args.batch, seq=args.seq, steps=args.steps, layers=args.layers, device=device,
               dtype=dtype, rounds=args.rounds)
    result = {"batch": args.batch, "seq": args.seq, "steps": args.steps, "layers": args.layers,
              "device": args.device if device.type == "cpu" else torch.cuda.get_device_name(),
              "python": platform.python_version(), "torch": torch.__version__, "rows": rows}
    for row in rows:
        print(json.dumps({"impl": row["impl"], "decode": row["decode"], "prefill": row["prefill"],
                          "decode_rounds": row.get("decode_rounds")}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
