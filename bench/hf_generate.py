"""Inference with the kernel in a Hugging Face model nobody here wrote: prefill and generate timed
with ``sdpa``, ``parity_sdpa`` and ``parity_sparse``, eager and compiled, tokens compared.

A model is built from a config with random weights directly in bf16 on the GPU (no download):
``llama8b`` has Llama-3-8B's shape (32 layers, hidden 4096, 32 heads, 8 K/V heads, head dim 128,
MLP 14336, vocabulary 128256); ``mistral7b`` has Mistral-7B's with a 4096-token sliding window
(vocabulary 32000). The three implementations share one set of weights: the model is built
once and switched with ``set_attn_implementation``.

Per implementation, mode and case (``BxS``: batch x prompt tokens):

- ``prefill_ms``: one forward over the prompt with a cache, as ``generate`` runs it (median of
  ``--repeats`` after a warm-up);
- ``ms_per_token``: (time of ``generate`` with N new tokens - time with 1) / (N - 1): the decode
  steps alone, host included, as a user of ``generate`` sees them;
- ``interleaved`` (eager, ``--rounds``): prefill and ms per token again, every implementation
  timed in turn round after round, so that a drifting host moves all alike (the rows above time
  each implementation's repeats together): the numbers to compare implementations by;
- ``tokens``: the greedy tokens. Each implementation's tokens are compared with ``sdpa``'s in the
  same mode: at the first step where a batch row differs, both runs had the same prefix, so the
  reference's top-2 logit margin there is set against the largest logit difference between the
  two runs at that step. A flip is ``explained`` when the margin is at most twice that
  difference (each of the two logits moved by at most the difference). Random weights give
  flat logits, so flips are expected; unexplained ones are not.

Modes: ``eager`` (the default dynamic cache, no compilation) and ``compiled`` (a static cache,
whose decode steps ``generate`` compiles with ``torch.compile(fullgraph=True,
mode="reduce-overhead")``, i.e. CUDA graphs).

    python bench/hf_generate.py --model llama8b --cases 1x4096,8x2048 --json out.json
    python bench/hf_generate.py --model mistral7b --cases 1x16384 --modes eager --json out.json

The JSON is rewritten after every row, so a run cut short keeps what it measured. Needs a CUDA
GPU, transformers and the checkout on the path.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

MODELS = {
    "llama8b": dict(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                    max_position_embeddings=32768, rope_theta=500000.0),
    "mistral7b": dict(family="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      max_position_embeddings=32768, rope_theta=10000.0, sliding_window=4096),
}
IMPLS = ("sdpa", "parity_sdpa", "parity_sparse")
MODES = ("eager", "compiled")


def build_model(name: str, layers: int | None):
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

    spec = dict(MODELS[name])
    family = spec.pop("family")
    if layers:
        spec["num_hidden_layers"] = layers
    config = (LlamaConfig if family == "llama" else MistralConfig)(**spec, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def use(model, impl: str) -> None:
    from parity.integrations import transformers as parity_tf

    model.set_attn_implementation(impl)
    if impl.startswith("parity_"):
        parity_tf.attach(model)


def timed(fn, repeats: int) -> tuple[float, list[float]]:
    """Median wall milliseconds of ``fn`` (synchronized), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), times


def prompt(batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(batch * 100003 + seq)
    ids = torch.randint(1, vocab, (batch, seq), generator=gen).cuda()
    return ids, torch.ones_like(ids)


def generate(model, ids, mask, new_tokens: int, mode: str):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import CompileConfig

    extra = {}
    if mode == "compiled":
        extra = dict(cache_implementation="static", compile_config=CompileConfig(fullgraph=True))
    else:
        extra = dict(disable_compile=True)
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0, eos_token_id=None, output_logits=True, return_dict_in_generate=True,
                              **extra)
    with torch.inference_mode():
        return model.generate(ids, attention_mask=mask, generation_config=config)


def run_case(model, impl: str, mode: str, batch: int, seq: int, new_tokens: int, repeats: int) -> dict:
    ids, mask = prompt(batch, seq, model.config.vocab_size)
    row = {"impl": impl, "mode": mode, "batch": batch, "seq": seq, "new_tokens": new_tokens}

    def prefill():
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)

    if mode == "eager":
        row["prefill_ms"], row["prefill_all_ms"] = timed(prefill, repeats)
    start = time.perf_counter()
    generate(model, ids, mask, 2, mode)  # warm-up (compiles in compiled mode)
    torch.cuda.synchronize()
    row["warmup_s"] = time.perf_counter() - start
    one, one_all = timed(lambda: generate(model, ids, mask, 1, mode), repeats)
    result = {}

    def full():
        result["out"] = generate(model, ids, mask, new_tokens, mode)

    many, many_all = timed(full, repeats)
    row["generate_1_ms"], row["generate_n_ms"] = one, many
    row["ms_per_token"] = (many - one) / (new_tokens - 1)
    row["generate_n_all_ms"] = many_all
    out = result["out"]
    row["tokens"] = out.sequences[:, seq:].tolist()
    row["_logits"] = [step.float().cpu() for step in out.logits]  # dropped before writing
    return row


def interleaved(model, impls: list[str], batch: int, seq: int, new_tokens: int, rounds: int) -> dict:
    """Eager prefill and ms per token of every implementation, timed in turn, round after round:
    a host whose speed drifts (a shared machine, clocks) moves every implementation alike, where
    timing one implementation's repeats after the other's would charge the drift to one of them.
    Per implementation: the medians over the rounds and every round's value."""
    ids, mask = prompt(batch, seq, model.config.vocab_size)
    samples = {impl: {"prefill_ms": [], "ms_per_token": []} for impl in impls}

    def wall(fn) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    def prefill():
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)

    for _ in range(rounds):
        for impl in impls:
            use(model, impl)
            samples[impl]["prefill_ms"].append(wall(prefill))
            one = wall(lambda: generate(model, ids, mask, 1, "eager"))
            many = wall(lambda: generate(model, ids, mask, new_tokens, "eager"))
            samples[impl]["ms_per_token"].append((many - one) / (new_tokens - 1))
    return {impl: {**{key: statistics.median(values) for key, values in by.items()},
                   **{f"{key}_rounds": values for key, values in by.items()}} for impl, by in samples.items()}


def compare_tokens(row: dict, reference: dict) -> dict:
    """Where ``row``'s greedy tokens first leave ``reference``'s, per batch row, and whether the
    reference's top-2 margin there is within twice the largest logit difference."""
    rows = []
    for b, (mine, theirs) in enumerate(zip(row["tokens"], reference["tokens"])):
        step = next((i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y), None)
        if step is None:
            rows.append({"batch_row": b, "first_difference": None})
            continue
        ref_logits = reference["_logits"][step][b]
        my_logits = row["_logits"][step][b]
        top2 = torch.topk(ref_logits, 2).values
        margin = float(top2[0] - top2[1])
        error = float((my_logits - ref_logits).abs().max())
        rows.append({"batch_row": b, "first_difference": step, "ref_margin": margin, "max_logit_diff": error,
                     "explained": margin <= 2 * error})
    same = sum(r["first_difference"] is None for r in rows)
    return {"rows_identical": same, "rows": len(rows),
            "all_explained": all(r.get("explained", True) for r in rows), "detail": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama8b")
    parser.add_argument("--cases", default="1x4096,8x2048", help="BxS prompts, comma-separated")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (a quick check of the script)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="eager: rounds of every implementation timed in turn after the rows (0: none)")
    parser.add_argument("--deadline-s", type=float, default=540, help="skip rows once this much time has passed")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("hf_generate: needs a CUDA GPU", file=sys.stderr)
        return 2
    from parity.integrations import transformers as parity_tf

    parity_tf.register()
    started = time.perf_counter()
    import transformers
    import triton

    report = {"model": args.model, "shape": MODELS[args.model], "layers": args.layers,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "transformers": transformers.__version__, "rows": [], "skipped": [], "errors": []}
    path = Path(args.json)

    def write():
        rows = [{k: v for k, v in row.items() if not k.startswith("_")} for row in report["rows"]]
        path.write_text(json.dumps({**report, "rows": rows}, indent=1))

    model = build_model(args.model, args.layers)
    cases = [tuple(int(x) for x in case.split("x")) for case in args.cases.split(",")]
    for mode in args.modes.split(","):
        for batch, seq in cases:
            reference = None
            for impl in args.impls.split(","):
                label = f"{impl} {mode} {batch}x{seq}"
                if time.perf_counter() - started > args.deadline_s:
                    report["skipped"].append(label)
                    continue
                try:
                    use(model, impl)
                    torch._dynamo.reset()
                    row = run_case(model, impl, mode, batch, seq, args.new_tokens, args.repeats)
                except Exception as err:  # one broken row must not lose the others' numbers
                    report["errors"].append({"row": label, "error": f"{type(err).__name__}: {err}",
                                             "traceback": traceback.format_exc()[-3000:]})
                    print(f"{label}: {type(err).__name__}: {str(err)[:300]}", flush=True)
                    torch.cuda.empty_cache()
                    write()
                    continue
                if impl == "sdpa":
                    reference = row
                elif reference is not None:
                    row["vs_sdpa"] = compare_tokens(row, reference)
                report["rows"].append(row)
                print(f"{label}: prefill {row.get('prefill_ms', float('nan')):.1f} ms, "
                      f"{row['ms_per_token']:.2f} ms/token, warm-up {row['warmup_s']:.1f} s"
                      + (f", same tokens in {row['vs_sdpa']['rows_identical']}/{row['vs_sdpa']['rows']} rows"
                         if "vs_sdpa" in row else ""), flush=True)
                write()
            for row in report["rows"]:  # the case's logits were needed only for its comparisons
                row.pop("_logits", None)
            done = [row["impl"] for row in report["rows"] if (row["mode"], row["batch"], row["seq"]) == (mode, batch, seq)]
            if mode == "eager" and args.rounds and len(done) > 1 and time.perf_counter() - started < args.deadline_s:
                report.setdefault("interleaved", []).append(
                    {"batch": batch, "seq": seq, "rounds": args.rounds,
                     "impls": interleaved(model, done, batch, seq, args.new_tokens, args.rounds)})
                print(json.dumps(report["interleaved"][-1]), flush=True)
                write()
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
