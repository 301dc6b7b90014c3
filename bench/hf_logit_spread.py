"""How far apart correct attention implementations put a deep bf16 model's logits, against an fp32 forward.

``parity bench`` of the Llama-3-8B-shaped prefill (``bench/hf_subject.py``) judges each
implementation's logits against ``sdpa``'s with the default rule, which has no high-precision
reference to size an error budget by. This measures what that rule cannot see: on one set of
random bf16 weights and one 1 x ``--seq`` prompt, the logits of

- ``sdpa`` under each of PyTorch's SDPA backends that runs here (cuDNN, flash, memory-efficient),
- ``parity_sdpa`` and ``parity_sparse`` (the kernel, through parity's integration),

each against ``sdpa``'s default backend (rel L2, cosine, max abs) and against the same model run
in fp32 (weights upcast in place after the bf16 runs; SDPA's math backend), the reference an
error budget would use. Two correct bf16 implementations should be about as far from each other
as each is from fp32; one that is wrong is far from fp32 while the others are not.

    python -m bench.hf_logit_spread --model llama8b --seq 4096 --json logit-spread.json

Needs a CUDA GPU with room for the model in fp32 (32 GB at llama8b) and transformers.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import torch  # noqa: E402

from bench.hf_generate import MODELS, build_model, prompt, use  # noqa: E402


def distance(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """rel L2, cosine and max abs of ``out`` against ``ref``, in fp64."""
    a, b = out.double().flatten(), ref.double().flatten()
    diff = a - b
    return {"rel_l2": float(diff.norm() / b.norm()), "cosine": float(a @ b / (a.norm() * b.norm())),
            "max_abs": float(diff.abs().max())}


def logits(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits.float()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama8b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("hf_logit_spread: needs a CUDA GPU", file=sys.stderr)
        return 2
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from parity.integrations import transformers as parity_tf

    parity_tf.register()
    model = build_model(args.model, args.layers)
    ids, _ = prompt(1, args.seq, model.config.vocab_size)
    runs: dict[str, torch.Tensor] = {}
    use(model, "sdpa")
    runs["sdpa"] = logits(model, ids)
    backends = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
                "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}
    errors = {}
    for name, backend in backends.items():
        try:
            with sdpa_kernel([backend]):
                runs[name] = logits(model, ids)
        except RuntimeError as err:  # a backend that does not run this shape here
            errors[name] = str(err).splitlines()[0][:200]
    for impl in ("parity_sdpa", "parity_sparse"):
        use(model, impl)
        runs[impl] = logits(model, ids)
    use(model, "sdpa")
    model.float()  # in place: the bf16 weights upcast, no second copy
    with sdpa_kernel([SDPBackend.MATH]):
        reference = logits(model, ids)
    rows = {name: {"vs_sdpa": distance(out, runs["sdpa"]), "vs_fp32": distance(out, reference)}
            for name, out in runs.items()}
    result = {"model": args.model, "layers": model.config.num_hidden_layers, "seq": args.seq,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
              "backend_errors": errors}
    for name, row in rows.items():
        print(f"{name:16s} vs sdpa rel_l2 {row['vs_sdpa']['rel_l2']:.3e} cos {row['vs_sdpa']['cosine']:.6f} | "
              f"vs fp32 rel_l2 {row['vs_fp32']['rel_l2']:.3e} cos {row['vs_fp32']['cosine']:.6f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
