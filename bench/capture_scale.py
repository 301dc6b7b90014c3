"""Benchmark: wall time, peak host memory and bundle size of ``capture`` on a Hugging Face Llama built from a config.

Each configuration runs in its own child process (so its peak resident set, VmHWM, is its own):
the Llama is built with random weights directly in bf16 (or loaded with ``from_pretrained`` from
a checkpoint this script saves first, for weights by reference) and captured with
``--impl sdpa``-style attention on the CPU. Configurations:

- ``model``: the default whole-model reference (fp64 on the CPU), weights stored;
- ``module``: the per-module fp64 reference (``reference_scope="module"``), weights stored;
- ``none``: ``reference="none"``, weights stored;
- ``none+ref`` / ``module+ref``: the same with weights by reference (``weights_from``).

Usage (JSON on stdout, one object per configuration, then a summary)::

    .venv/bin/python bench/capture_scale.py --layers 4 --configs model,module,none,none+ref,module+ref
    .venv/bin/python bench/capture_scale.py --layers 16 --configs module+ref,none+ref

Sizes default to the issue's 1.1B model (hidden 2048, 32 heads, 8 K/V heads, MLP 8192, vocab
32000) at 256 tokens; ``--layers`` sets the depth. Bytes per parameter = peak RSS / parameters.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent


def llama_config(layers: int, hidden: int, heads: int, kv_heads: int, mlp: int, vocab: int):
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         max_position_embeddings=4096, use_cache=False, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return config


class LlamaScaleSubject:
    """A parity subject: a Llama from a config in bf16 (random weights, or ``checkpoint``'s),
    built on the device it runs on; input: ``tokens`` random token ids; output: the logits."""

    name = "llama-scale"
    impls = ("sdpa",)
    reference_impl = "sdpa"

    def __init__(self, layers: int = 16, hidden: int = 2048, heads: int = 32, kv_heads: int = 8, mlp: int = 8192,
                 vocab: int = 32000, tokens: int = 256, checkpoint: str = "", seed: int = 0):
        self.args = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, mlp=mlp, vocab=vocab,
                         tokens=tokens, checkpoint=checkpoint, seed=seed)

    def config(self):
        a = self.args
        return llama_config(a["layers"], a["hidden"], a["heads"], a["kv_heads"], a["mlp"], a["vocab"])

    def make_inputs(self):
        gen = torch.Generator().manual_seed(self.args["seed"] + 1)
        return {"tokens": torch.randint(0, self.args["vocab"], (1, self.args["tokens"]), generator=gen)}

    def build(self, impl: str, device: torch.device | str = "cpu") -> nn.Module:
        from transformers import LlamaForCausalLM

        device = torch.device(device)
        if self.args["checkpoint"] and device.type != "meta":
            # Onto the GPU with device_map (needs accelerate); on the CPU, where it loads by default.
            placed = {} if device.type == "cpu" else {"device_map": str(device)}
            return LlamaForCausalLM.from_pretrained(self.args["checkpoint"], dtype=torch.bfloat16,
                                                    attn_implementation="sdpa", **placed)
        torch.manual_seed(self.args["seed"])
        with torch.device(device):
            return LlamaForCausalLM._from_config(self.config(), dtype=torch.bfloat16)

    def call(self, module: nn.Module, inputs) -> torch.Tensor:
        return module(input_ids=inputs.tensors["tokens"]).logits


def make_subject(**args) -> LlamaScaleSubject:
    return LlamaScaleSubject(**args)


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _bundle_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.iterdir() if file.is_file())


def child(config: str, sizes: dict, out: Path, checkpoint: str) -> dict:
    """One capture in this process; the measurement as a dict."""
    sys.path.insert(0, str(HERE))
    from parity.run.capture import capture
    from parity.run.subjects import load_subject

    by_reference = config.endswith("+ref")
    scope = config.removesuffix("+ref")
    args = dict(sizes, checkpoint=checkpoint if by_reference else "")
    runner = load_subject("capture_scale:make_subject", args)
    started = time.monotonic()
    result = capture(runner, out, impl="sdpa", device="cpu", reference="none" if scope == "none" else "fp64",
                     reference_scope="module" if scope == "module" else "model",
                     weights_from=[checkpoint] if by_reference else None, durable=False, force=True)
    seconds = time.monotonic() - started
    params = sum(p.numel() for p in runner.build_module("sdpa", "meta").parameters())
    peak = _peak_rss_bytes()
    from parity.bundle.reader import open_bundle

    info = (open_bundle(result.path).capture_info or {}).get("reference") or {}
    return {"config": config, "layers": sizes["layers"], "tokens": sizes["tokens"], "parameters": params,
            "weights_bytes": 2 * params, "wall_s": round(seconds, 1), "peak_rss_bytes": peak,
            "peak_rss_gib": round(peak / 2**30, 2), "bytes_per_parameter": round(peak / params, 2),
            "bundle_bytes": _bundle_bytes(result.path), "bundle_gib": round(_bundle_bytes(result.path) / 2**30, 2),
            "recorded_tensors": result.tensors, "reference_peak_copy_bytes": info.get("peak_copy_bytes"),
            "phases": result.resources.get("phases")}


def save_checkpoint(sizes: dict, directory: Path) -> None:
    """The random bf16 Llama of ``sizes`` saved with save_pretrained (model.safetensors + config)."""
    sys.path.insert(0, str(HERE))
    subject = LlamaScaleSubject(**sizes)
    subject.build("sdpa").save_pretrained(directory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--mlp", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--configs", default="model,module,none,none+ref,module+ref")
    parser.add_argument("--workdir", default=None, help="where bundles and the checkpoint go (default: a temp dir)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--save-checkpoint", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = dict(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads, mlp=args.mlp,
                 vocab=args.vocab, tokens=args.tokens)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="capture-scale-"))
    checkpoint = work / "checkpoint"
    if args.save_checkpoint:
        save_checkpoint(sizes, Path(args.save_checkpoint))
        return 0
    if args.child:
        print(json.dumps(child(args.child, sizes, work / f"bundle-{args.child}", str(checkpoint))))
        return 0
    configs = [name.strip() for name in args.configs.split(",") if name.strip()]
    base = [sys.executable, str(Path(__file__).resolve()), "--workdir", str(work)] + [
        item for key, value in sizes.items() for item in (f"--{key.replace('_', '-')}", str(value))]
    if any(name.endswith("+ref") for name in configs) and not (checkpoint / "model.safetensors").exists():
        subprocess.run(base + ["--save-checkpoint", str(checkpoint)], check=True)
    results = []
    for name in configs:
        done = subprocess.run(base + ["--child", name], check=True, capture_output=True, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        result = json.loads(done.stdout.strip().splitlines()[-1])
        shutil.rmtree(work / f"bundle-{name}", ignore_errors=True)
        results.append(result)
        print(json.dumps(result), flush=True)
    print(json.dumps({"machine": {"cpus": os.cpu_count(), "torch": torch.__version__}, "sizes": sizes,
                      "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
