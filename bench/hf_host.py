"""Where a Hugging Face model's decode step spends the host's time, per attention implementation.

``bench/hf_generate.py`` times ``generate``; this looks inside one decode step of the same model
(``--model llama8b``, random bf16 weights on the GPU), for ``sdpa``, ``parity_sdpa`` and
``parity_sparse``, after a prefill of ``--seq`` tokens with the default dynamic cache:

- ``synced_ms``: one decode forward, synchronized before and after (median of ``--steps``);
- ``queued_ms``: ``--steps`` forwards issued back to back, one synchronize at the end, per step
  (what ``generate`` sees: the host's time where the host is the bottleneck); again at the end
  for ``--rounds`` rounds with the implementations in turn (``queued_ms_rounds``), the numbers
  to compare implementations by on a host whose speed drifts;
- ``syncs_per_step``: host synchronizations per step (``torch.cuda.set_sync_debug_mode``'s
  warnings: ``.item()``, ``bool(tensor)``, a copy to the host);
- ``python``: cProfile of the queued steps, the functions with the most time of their own, µs per
  step (cProfile adds its own cost to every Python call: compare implementations, not absolutes);
- ``api``: torch.profiler's host-side events per step (CUDA runtime and driver calls, aten ops),
  the largest by self time, with counts;
- ``attribution``: where a queued step's wall time goes, timed by wrappers (no profiler): the
  host time inside the mask function (once per forward), inside the attention function of the
  first layer and of the other layers (a forward's first call builds what the others reuse), and
  the rest of the step; beside it, ``device_us_per_step``: the GPU's kernel time per step (sum of
  kernel durations in a torch.profiler trace) and the attention kernels' share of it. A step
  whose host time exceeds its device time is bound by the host;
- ``layer_host``: one layer's attention call apart from the model, as ``bench/hf_layer_host.py``
  measures it on this GPU (host µs of a forward's first and other layers' calls, queued; the aten
  ops of one layer's call; cProfile parts), the same breakdown as that script's CPU run;
- ``plans``: the kernel's launch-plan misses and hits per queued step, per path: a decode step
  whose layout keeps its tiles finds the previous step's plan (0 misses), one in ``block_n``
  steps builds it again (``bench/decode_steps_host.py`` measures the same on the CPU).

    python -m bench.hf_host --model llama8b --batch 1 --seq 4096 --json hf-host.json

Needs a CUDA GPU, transformers and the checkout on the path.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import torch  # noqa: E402

from bench.hf_generate import IMPLS, MODELS, build_model, prompt, use  # noqa: E402


def _step_fn(model, batch: int, seq: int):
    """(step, reset): ``step()`` runs one decode forward on the cache a prefill of ``seq`` tokens
    made; ``reset()`` makes that prefill again (so every measurement starts from the same cache)."""
    from transformers import DynamicCache

    ids, mask = prompt(batch, seq, model.config.vocab_size)
    state = {}

    def reset():
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
            state.update(cache=cache, token=out.logits[:, -1:].argmax(-1), mask=mask)
        torch.cuda.synchronize()

    def step():
        with torch.inference_mode():
            state["mask"] = torch.cat([state["mask"], state["mask"].new_ones(batch, 1)], dim=1)
            model(input_ids=state["token"], attention_mask=state["mask"], past_key_values=state["cache"],
                  use_cache=True, logits_to_keep=1)

    return step, reset


def _plan_counts() -> dict[str, tuple[int, int]]:
    """(hits, misses) so far of the kernel's launch plans, per path (prefill, decode)."""
    from parity.kernels import attention

    return {path: (attention._launch_cache(path).hits, attention._launch_cache(path).misses)
            for path in ("prefill", "decode")}


def measure(model, impl: str, batch: int, seq: int, steps: int) -> dict:
    use(model, impl)
    step, reset = _step_fn(model, batch, seq)
    row = {"impl": impl, "batch": batch, "seq": seq, "steps": steps}
    reset()
    for _ in range(3):  # warm-up: compiles, plans
        step()
    reset()
    synced = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        synced.append((time.perf_counter() - start) * 1e3)
    row["synced_ms"] = round(statistics.median(synced), 3)
    reset()
    torch.cuda.synchronize()
    counts = _plan_counts()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    row["queued_ms"] = round((time.perf_counter() - start) * 1e3 / steps, 3)
    row["plans"] = {path: {"misses_per_step": round((after[1] - before[1]) / steps, 3),
                           "hits_per_step": round((after[0] - before[0]) / steps, 3)}
                    for path, before, after in zip(counts, counts.values(), _plan_counts().values())}

    reset()
    torch.cuda.set_sync_debug_mode(1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4):
                step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    row["syncs_per_step"] = len(caught) / 4
    row["sync_sites"] = sorted({str(w.message).splitlines()[0][:160] for w in caught})[:5]

    reset()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        step()
    profile.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profile, stream=io.StringIO())
    top = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:30]  # by own time
    row["python"] = [{"function": f"{Path(file).name}:{line}({name})", "calls_per_step": calls / steps,
                      "own_us_per_step": round(own * 1e6 / steps, 1), "cum_us_per_step": round(cum * 1e6 / steps, 1)}
                     for (file, line, name), (_, calls, own, cum, _) in top]

    reset()
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    events = sorted(averages, key=lambda e: -e.self_cpu_time_total)[:30]
    row["api"] = [{"name": e.key[:80], "count_per_step": e.count / 4, "self_us_per_step": round(e.self_cpu_time_total / 4, 1)}
                  for e in events]
    row["kernels"] = _kernels(averages, 4)
    row["attribution"] = _attribution(model, impl, step, reset, steps)
    return row


_ATTENTION_KERNELS = ("attn", "attention", "flash", "fmha", "decode", "combine", "cudnn", "sdpa")


def _kernels(averages, steps: int) -> dict:
    """GPU kernel time per step from a profiler's averages: total, the attention kernels' part
    (by name) and the largest kernels."""
    kernels = [e for e in averages if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
               and getattr(e, "self_device_time_total", 0) > 0]
    total = sum(e.self_device_time_total for e in kernels) / steps
    attention = sum(e.self_device_time_total for e in kernels
                    if any(word in e.key.lower() for word in _ATTENTION_KERNELS)) / steps
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]
    return {"device_us_per_step": round(total, 1), "attention_device_us_per_step": round(attention, 1),
            "top": [{"name": e.key[:90], "count_per_step": e.count / steps,
                     "us_per_step": round(e.self_device_time_total / steps, 1)} for e in top]}


def _attribution(model, impl: str, step, reset, steps: int) -> dict:
    """Host microseconds per queued step inside the mask function, the first layer's attention
    call, the other layers' calls, and the rest (wrappers around transformers' registered
    functions, restored afterwards)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    spent = {"mask": 0.0, "attention_first": 0.0, "attention_rest": 0.0}
    calls = {"n": 0}
    layers = model.config.num_hidden_layers
    attention, mask = ALL_ATTENTION_FUNCTIONS[impl], ALL_MASK_ATTENTION_FUNCTIONS[impl]

    def timed_attention(*args, **kwargs):
        start = time.perf_counter()
        try:
            return attention(*args, **kwargs)
        finally:
            slot = "attention_first" if calls["n"] % layers == 0 else "attention_rest"
            calls["n"] += 1
            spent[slot] += time.perf_counter() - start

    def timed_mask(*args, **kwargs):
        start = time.perf_counter()
        try:
            return mask(*args, **kwargs)
        finally:
            spent["mask"] += time.perf_counter() - start

    ALL_ATTENTION_FUNCTIONS._global_mapping[impl] = timed_attention
    ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[impl] = timed_mask
    try:
        reset()
        step()
        torch.cuda.synchronize()
        for key in spent:
            spent[key] = 0.0
        calls["n"] = 0
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - start
        torch.cuda.synchronize()
        total = time.perf_counter() - start
    finally:
        ALL_ATTENTION_FUNCTIONS._global_mapping[impl] = attention
        ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[impl] = mask
    out = {key: round(value * 1e6 / steps, 1) for key, value in spent.items()}
    out["host_step_us"] = round(wall * 1e6 / steps, 1)
    out["rest_us"] = round(out["host_step_us"] - sum(out[key] for key in spent), 1)
    out["queued_step_us"] = round(total * 1e6 / steps, 1)
    out["attention_calls_per_step"] = calls["n"] / steps
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama8b")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the model's")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--rounds", type=int, default=3, help="rounds of queued steps, implementations in turn")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("hf_host: needs a CUDA GPU", file=sys.stderr)
        return 2
    from parity.integrations import transformers as parity_tf

    parity_tf.register()
    model = build_model(args.model, args.layers)
    rows = []
    for impl in args.impls.split(","):
        rows.append(measure(model, impl, args.batch, args.seq, args.steps))
        brief = {key: rows[-1][key] for key in ("impl", "synced_ms", "queued_ms", "syncs_per_step")}
        print(json.dumps(brief), flush=True)
        write(args.json, args.model, rows)
    # Every implementation again, in turn, round after round (a drifting host moves all alike)
    for _ in range(args.rounds):
        for row in rows:
            use(model, row["impl"])
            step, reset = _step_fn(model, args.batch, args.seq)
            reset()
            step()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
            row.setdefault("queued_ms_rounds", []).append(round((time.perf_counter() - start) * 1e3 / args.steps, 3))
    # One layer's attention call apart from the model (bench/hf_layer_host.py on this GPU, Llama-3-8B's
    # heads): host µs of the first and the other layers' calls, the mask function, aten ops, cProfile parts
    from bench import hf_layer_host

    layer_rows = hf_layer_host.run([row["impl"] for row in rows], batch=args.batch, seq=args.seq, steps=args.steps,
                                   layers=model.config.num_hidden_layers, device=torch.device("cuda"),
                                   dtype=torch.bfloat16, rounds=args.rounds)
    for row, layer_row in zip(rows, layer_rows):
        row["layer_host"] = layer_row
        print(json.dumps({"impl": row["impl"], "layer_host_decode": layer_row["decode"],
                          "layer_host_rounds": layer_row.get("decode_rounds")}), flush=True)
    for row in rows:
        if row.get("queued_ms_rounds"):
            row["queued_ms_interleaved"] = statistics.median(row["queued_ms_rounds"])
            print(json.dumps({key: row[key] for key in ("impl", "queued_ms_rounds")}), flush=True)
    write(args.json, args.model, rows)
    return 0


def write(path: Path | None, model: str, rows: list[dict]) -> None:
    if path:
        path.write_text(json.dumps({"model": model, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
