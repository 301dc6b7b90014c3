"""GPU benchmark of the block-sparse kernel against FlexAttention (same block masks) and SDPA.

    python -m bench.benchmark --json out.json [--sweep] [--seq 4096 16384]
        [--config block_n=128,one_loop=0 ...]
    python -m bench.benchmark --masks document,padding --json masks.json

``--masks`` runs only the element-mask cases (``MASK_CASES``): each mask built as a layout for
the parity kernel and given to FlexAttention as the equivalent ``mask_mod`` through
``create_block_mask``, at --seq (default 16384), bf16; times are the median of 5 do_bench
medians with their spread ((max - min) / median).

``--config`` times a proposed variant of the pinned config (LaunchConfig fields, comma-separated)
on every length and mask, next to the pinned config and FlexAttention; the pinned config and
FlexAttention are timed a second time after the variants, to show the run-to-run spread.

Effective TFLOP/s counts only the computed blocks: 4 * B * H * D * (query x key elements in
computed blocks) / time, as in parity/NUMERICS.md. Times are medians of triton.testing.do_bench
(CUDA events, warm-up excluded). Before timing, every implementation's output is checked against
the fp32 PyTorch reference on the same inputs (relative L2 error). Needs a GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

import torch

from parity.kernels import configs, targets
from parity.kernels.attention import block_sparse_attention, launch_config
from parity.kernels.layout import (BlockLayout, causal_layout, document_layout, padding_layout, random_layout,
                     sliding_window_layout)
from parity.kernels.reference import reference_attention
from parity.kernels.testing import random_qkv

from . import roofline

# The result's JSON format; its schema is the lab's (bench/formats.py).
FORMAT, VERSION = "parity-benchmark-report", 1

MASKS = {
    "causal": lambda s: causal_layout(s, s, block_m=128, block_n=128),
    "sliding_window_1024": lambda s: sliding_window_layout(s, s, 1024, block_m=128, block_n=128),
    "random25_causal": lambda s: random_layout(s, s, 0.25, 0, causal=True, block_m=128, block_n=128),
}


# ---- element-mask cases: the parity layout and FlexAttention's mask_mod for the same mask ------
# Fractions of the sequence: 8 documents of uneven lengths (odd token counts, the short ones
# shorter than a block), and 4 right-padded key lengths (16k, 12k, 9k, 5k at 16384).
DOCUMENT_FRACTIONS = (0.21, 0.03, 0.17, 0.09, 0.14, 0.012, 0.19)
PADDING_FRACTIONS = (1.0, 0.75, 0.5625, 0.3125)


def document_lengths(seq: int) -> list[int]:
    """8 document lengths summing to ``seq`` (the last takes the rest), odd where possible."""
    lengths = [max(1, int(seq * f)) | 1 for f in DOCUMENT_FRACTIONS]
    lengths.append(seq - sum(lengths))
    if lengths[-1] < 1:
        raise ValueError(f"seq {seq} is too short for {len(lengths)} documents")
    return lengths


def padding_lengths(seq: int) -> list[int]:
    """4 key lengths, the first the whole sequence."""
    return [max(1, int(seq * f)) for f in PADDING_FRACTIONS]


def document_mask_mod(doc_lens, device="cpu"):
    """FlexAttention mask_mod: causal within documents laid end to end (self-attention)."""
    doc_id = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.as_tensor(doc_lens)).to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc_id[q_idx] == doc_id[kv_idx]) & (kv_idx <= q_idx)

    return mask_mod


def padding_mask_mod(lengths, device="cpu"):
    """FlexAttention mask_mod: keys [0, lengths[b]) visible (right padding), causal (Sq = Sk)."""
    key_len = torch.as_tensor(lengths).to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < key_len[b]) & (kv_idx <= q_idx)

    return mask_mod


@dataclasses.dataclass(frozen=True)
class MaskCase:
    """One element-mask benchmark case at a sequence length: the batch it runs with, the parity
    layout, and the equivalent FlexAttention mask_mod (``b`` None: broadcast over the batch)."""

    name: str
    batch: int
    layout: BlockLayout
    mask_mod: object
    flex_batch: int | None


def mask_case(name: str, seq: int, device="cpu") -> MaskCase:
    if name == "document":
        lens = document_lengths(seq)
        # 64-row blocks: the kernel's tiles for element-mask layouts (configs.IRREGULAR_CONFIGS)
        return MaskCase(f"document{len(lens)}", 1, document_layout(lens, block_m=64, block_n=64),
                        document_mask_mod(lens, device), None)
    if name == "padding":
        lens = padding_lengths(seq)
        layout = padding_layout(seq, seq, lens, side="right", block_m=128, block_n=128)
        return MaskCase(f"padding{len(lens)}-right", len(lens), layout, padding_mask_mod(lens, device), len(lens))
    raise ValueError(f"unknown mask case {name!r}; choose from {', '.join(MASK_CASES)}")


MASK_CASES = ("document", "padding")


def allow_recompiles(limit: int = 256) -> None:
    """Before compiling FlexAttention: one compiled graph per shape and mask, and a run of many
    cases recompiles it more often than dynamo's default limit of 8 per function, past which it
    would run FlexAttention unfused (and the benchmark would time that). Raises the limit under
    both of its names (``cache_size_limit`` was renamed ``recompile_limit``)."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(limit, getattr(dynamo_config, name)))


def flex_block_mask(layout: BlockLayout, device):
    """The same layout as a FlexAttention BlockMask, with our predicate as its mask_mod."""
    from torch.nn.attention.flex_attention import BlockMask

    mask = layout.mask
    nk = layout.num_kv_blocks

    def pad(indices):
        out = torch.zeros(*indices.shape[:3], nk, dtype=torch.int32)
        out[..., : indices.shape[-1]] = indices
        return out.to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        vis = kv_idx < layout.seq_k
        if mask.causal:
            vis = vis & (kv_idx <= q_idx + mask.offset)
        if mask.window:
            vis = vis & ((kv_idx > q_idx + mask.offset - mask.window) | (kv_idx < mask.sink_tokens))
        return vis

    return BlockMask.from_kv_blocks(
        layout.kv_num_blocks.to(device), pad(layout.kv_indices),
        layout.full_kv_num_blocks.to(device), pad(layout.full_kv_indices),
        BLOCK_SIZE=(layout.block_m, layout.block_n), mask_mod=mask_mod,
        seq_lengths=(layout.seq_q, layout.seq_k),
    )


def rel_l2(out, ref) -> float | str:
    """Relative L2 error, as the JSON carries it: a number, or "nan"/"inf"/"-inf" where not
    finite (the harness's JSON convention, parity.base.jsonformat)."""
    value = float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
    return value if math.isfinite(value) else str(value)


def bench(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=50, rep=200, return_mode="median"))


def bench_repeated(fn, repeats: int = 5) -> tuple[float, float]:
    """(median of ``repeats`` do_bench medians in ms, their spread (max - min) / median)."""
    return roofline.median_spread([bench(fn) for _ in range(repeats)])


def run_masks(names, seqs, heads, head_dim, check: bool):
    """The element-mask cases: parity kernel vs FlexAttention (create_block_mask from the
    equivalent mask_mod, BLOCK_SIZE 128), bf16. Before timing, both outputs are compared with
    the fp32 reference on the parity layout (exact for these masks: tests/test_masks.py checks
    layout == mask_mod element by element) and with each other."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    device = torch.device("cuda")
    allow_recompiles()
    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    for seq in seqs:
        for name in names:
            case = mask_case(name, seq, device)
            batch = case.batch
            layout = case.layout.to(device)
            q, k, v = random_qkv(batch, heads, heads, seq, seq, head_dim, torch.bfloat16, seed=seq, device=device)
            block_mask = create_block_mask(case.mask_mod, case.flex_batch, None, seq, seq, device=device,
                                           BLOCK_SIZE=128)
            impls = {
                "parity triton": lambda: block_sparse_attention(q, k, v, layout),
                "FlexAttention": lambda: flex(q, k, v, block_mask=block_mask),
            }
            computed = layout.computed_elements() * (batch * heads) // (layout.batch_heads[0] * layout.batch_heads[1])
            density = computed / (batch * heads * seq * seq)
            errors = {}
            if check:
                ref = reference_attention(q, k, v, layout, precision="fp32", chunk_rows=256)
                outs = {impl: fn() for impl, fn in impls.items()}
                errors = {impl: rel_l2(out, ref) for impl, out in outs.items()}
                errors["parity vs Flex"] = rel_l2(outs["parity triton"], outs["FlexAttention"])
                del ref, outs
            for impl, fn in impls.items():
                ms, spread = bench_repeated(fn)
                rows.append({
                    "seq": seq, "impl": impl, "mask": case.name, "batch": batch, "density": round(density, 4),
                    "ms": round(ms, 4), "spread": round(spread, 4),
                    "eff_tflops": round(4 * head_dim * computed / ms / 1e9, 1),
                    "rel_l2_vs_fp32_ref": errors.get(impl),
                })
                if impl == "parity triton":
                    rows[-1]["rel_l2_parity_vs_flex"] = errors.get("parity vs Flex")
                    rows[-1]["config"] = _label(launch_config(device, head_dim, q.dtype, layout))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def parse_config(spec: str) -> dict:
    """``block_n=64,num_stages=3,one_loop=1`` -> ``{"block_n": 64, "num_stages": 3, "one_loop": True}``
    (keys and bounds: ``configs.LAUNCH_FIELDS``); a ValueError names a bad item."""
    return configs.parse_fields(spec, configs.LAUNCH_FIELDS, flag="--config")


def parse_variant(spec: str, base: configs.LaunchConfig) -> configs.LaunchConfig:
    """``block_n=64,num_stages=3,one_loop=1`` -> ``base`` with those fields replaced."""
    return configs.with_overrides(base, parse_config(spec))


def _label(cfg: configs.LaunchConfig) -> str:
    flags = [flag for flag in configs.FLAGS if getattr(cfg, flag)]
    return f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}" + "".join(f" +{f}" for f in flags)


def run(seqs, batch, heads, head_dim, sweep: bool, check: bool, variants=()):
    from torch.nn.attention.flex_attention import flex_attention
    from triton.runtime.errors import OutOfResources

    device = torch.device("cuda")
    allow_recompiles()
    flex = torch.compile(flex_attention, dynamic=False)
    rows, sweep_rows = [], []
    for seq in seqs:
        q, k, v = random_qkv(batch, heads, heads, seq, seq, head_dim, torch.bfloat16, seed=seq, device=device)
        elements_dense = seq * seq
        flops_per_element = 4 * head_dim  # computed elements already count every (batch, head)
        for mask_name, build in MASKS.items():
            layout = build(seq).to(device)
            computed = layout.computed_elements() * (batch * heads) // (
                layout.batch_heads[0] * layout.batch_heads[1])
            density = computed / (batch * heads * elements_dense)
            block_mask = flex_block_mask(layout.to("cpu"), device)
            impls = {
                "parity triton": lambda: block_sparse_attention(q, k, v, layout),
                "FlexAttention": lambda: flex(q, k, v, block_mask=block_mask),
            }
            if mask_name == "causal":
                impls["SDPA"] = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            pinned = launch_config(device, head_dim, q.dtype)
            for cfg in variants:
                impls[f"parity {_label(cfg)}"] = (lambda cfg=cfg: block_sparse_attention(q, k, v, layout, config=cfg))
            errors, vs_pinned = {}, {}
            if check:
                # 4k: every implementation against the fp32 reference. Every length: each variant
                # against the pinned config's output (0 when only the program order or loop
                # structure changed; bf16 rounding when the tiles changed).
                ref = reference_attention(q, k, v, layout, precision="fp32") if seq <= 4096 else None
                base = impls["parity triton"]()
                for name, fn in impls.items():
                    try:
                        out = base if name == "parity triton" else fn()
                    except OutOfResources:
                        continue
                    if ref is not None:
                        errors[name] = rel_l2(out, ref)
                    if name.startswith("parity"):
                        vs_pinned[name] = rel_l2(out, base)
                del ref, base
            if variants:  # the spread: the pinned config and FlexAttention once more, last
                impls["parity triton (again)"] = impls["parity triton"]
                impls["FlexAttention (again)"] = impls["FlexAttention"]
            for name, fn in impls.items():
                try:
                    ms = bench(fn)
                except OutOfResources as err:  # a variant that does not fit is recorded
                    rows.append({"seq": seq, "impl": name, "mask": mask_name, "error": type(err).__name__})
                    print(json.dumps(rows[-1]), flush=True)
                    continue
                rows.append({
                    "seq": seq, "impl": name, "mask": mask_name, "density": round(density, 4),
                    "ms": round(ms, 4), "eff_tflops": round(flops_per_element * computed / ms / 1e9, 1),
                    "rel_l2_vs_fp32_ref": errors.get(name.replace(" (again)", "")),
                })
                if name in vs_pinned and name != "parity triton":
                    rows[-1]["rel_l2_vs_pinned"] = vs_pinned[name]
                if name == "parity triton":
                    rows[-1]["config"] = _label(pinned)
                print(json.dumps(rows[-1]), flush=True)
            if sweep and seq == seqs[0]:
                for cand in configs.candidates(targets.arch_of(device), head_dim):
                    try:
                        ms = bench(lambda: block_sparse_attention(q, k, v, layout, config=cand))
                    except OutOfResources as err:  # a candidate that does not fit is recorded
                        sweep_rows.append({"seq": seq, "mask": mask_name, **cand.to_dict(), "error": type(err).__name__})
                        continue
                    sweep_rows.append({"seq": seq, "mask": mask_name, **cand.to_dict(), "ms": round(ms, 4),
                                       "eff_tflops": round(flops_per_element * computed / ms / 1e9, 1)})
                    print(json.dumps(sweep_rows[-1]), flush=True)
        for name, causal in (("SDPA dense", False),):
            ms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
            rows.append({"seq": seq, "impl": name, "mask": "dense", "density": 1.0, "ms": round(ms, 4),
                         "eff_tflops": round(flops_per_element * batch * heads * elements_dense / ms / 1e9, 1),
                         "rel_l2_vs_fp32_ref": None})
            print(json.dumps(rows[-1]), flush=True)
    return rows, sweep_rows


def mask_markdown(mask_rows: list[dict]) -> str:
    """The element-mask table: parity kernel vs FlexAttention per length and mask."""
    lines = ["| S | mask | B | density | parity ms (spread) | parity eff TFLOP/s | Flex ms (spread) | "
             "Flex eff TFLOP/s | parity / Flex | rel L2 vs fp32 ref: parity / Flex | parity vs Flex |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def err(value):
        return f"{float(value):.2e}" if value is not None else "-"

    for seq, mask in dict.fromkeys((r["seq"], r["mask"]) for r in mask_rows):
        ours = next((r for r in mask_rows if (r["seq"], r["mask"], r["impl"]) == (seq, mask, "parity triton")), None)
        flex = next((r for r in mask_rows if (r["seq"], r["mask"], r["impl"]) == (seq, mask, "FlexAttention")), None)
        if not ours or not flex:
            continue
        lines.append(
            f"| {seq} | {mask} | {ours['batch']} | {ours['density']:.3f} | "
            f"{ours['ms']} ({100 * ours['spread']:.1f}%) | "
            f"{ours['eff_tflops']:.0f} | {flex['ms']} ({100 * flex['spread']:.1f}%) | {flex['eff_tflops']:.0f} | "
            f"{flex['ms'] / ours['ms']:.2f} | {err(ours.get('rel_l2_vs_fp32_ref'))} / "
            f"{err(flex.get('rel_l2_vs_fp32_ref'))} | {err(ours.get('rel_l2_parity_vs_flex'))} |")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    """The benchmark document's tables from a ``--json`` result: the summary (pinned config vs
    FlexAttention and SDPA), when variants were timed every variant's TFLOP/s per length and mask,
    and the element-mask table when ``--masks`` ran."""
    if not result.get("rows"):
        return mask_markdown(result.get("mask_rows", []))
    text = _suite_markdown(result)
    if result.get("mask_rows"):
        text += "\n\n" + mask_markdown(result["mask_rows"])
    return text


def _suite_markdown(result: dict) -> str:
    rows = [r for r in result["rows"] if "ms" in r]
    lines = ["| S | mask | density | parity ms | parity eff TFLOP/s | Flex ms | Flex eff TFLOP/s | "
             "parity / Flex | SDPA causal ms (eff TFLOP/s) | rel L2 vs fp32 ref: parity / Flex |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["seq"], r["mask"]) for r in rows if r["mask"] != "dense"}, key=lambda k: (k[0], list(MASKS).index(k[1])))

    def find(seq, mask, impl):
        return next((r for r in rows if r["seq"] == seq and r["mask"] == mask and r["impl"] == impl), None)

    def err(r):
        return f"{float(r['rel_l2_vs_fp32_ref']):.2e}" if r and r.get("rel_l2_vs_fp32_ref") is not None else "-"

    for seq, mask in keys:
        ours, flex, sdpa = find(seq, mask, "parity triton"), find(seq, mask, "FlexAttention"), find(seq, mask, "SDPA")
        if not ours or not flex:
            continue
        sdpa_cell = f"{sdpa['ms']} ({sdpa['eff_tflops']:.0f})" if sdpa else "-"
        lines.append(f"| {seq} | {mask} | {ours['density']:.3f} | {ours['ms']} | {ours['eff_tflops']:.0f} | "
                     f"{flex['ms']} | {flex['eff_tflops']:.0f} | {ours['eff_tflops'] / flex['eff_tflops']:.2f} | "
                     f"{sdpa_cell} | {err(ours)} / {err(flex)} |")
    for r in result["rows"]:
        if r["mask"] == "dense" and "ms" in r:
            lines.append(f"| {r['seq']} | dense, SDPA | 1.000 | - | - | - | - | - | {r['ms']} ({r['eff_tflops']:.0f}) | - |")
    impls = [name for name in dict.fromkeys(r["impl"] for r in rows) if name.startswith("parity") or name.startswith("Flex")]
    if len(impls) > 2:
        lines += ["", "| implementation | " + " | ".join(f"{seq} {mask}" for seq, mask in keys) + " |",
                  "|---|" + "---|" * len(keys)]
        for name in impls:
            cells = []
            for seq, mask in keys:
                r = find(seq, mask, name)
                cells.append(f"{r['eff_tflops']:.0f}" if r else "-")
            label = f"{name} ({find(*keys[0], name).get('config')})" if name == "parity triton" else name
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=None,
                        help="sequence lengths (default 4096 16384; with --masks 16384)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--sweep", action="store_true", help="also time every autotuning candidate")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness check")
    parser.add_argument("--config", action="append", default=[], metavar="KEY=VALUE,...",
                        help="also time this variant of the pinned config on every length and mask "
                             f"(fields {', '.join(configs.LAUNCH_FIELDS)}); repeatable")
    parser.add_argument("--masks", metavar="NAME,...",
                        help=f"run only the element-mask cases named ({', '.join(MASK_CASES)}, or all), "
                             "parity vs FlexAttention")
    parser.add_argument("--json", help="write rows and environment here")
    parser.add_argument("--markdown", metavar="RESULT.json",
                        help="print the benchmark document's tables from an earlier --json result (no GPU)")
    args = parser.parse_args(argv)
    if args.markdown:
        return render_result(args.markdown, "benchmark", markdown)
    parsed, status = arguments_or_status(
        "benchmark", lambda: (parse_masks(args.masks), [parse_config(spec) for spec in args.config]))
    if status is not None:
        return status
    masks, changes = parsed
    pinned = launch_config(torch.device("cuda"), args.head_dim, torch.bfloat16)
    variants = [configs.with_overrides(pinned, change) for change in changes]
    rows, sweep_rows, mask_rows = [], [], []
    if masks:
        mask_rows = run_masks(masks, args.seq or [16384], args.heads, args.head_dim, not args.no_check)
    else:
        rows, sweep_rows = run(args.seq or [4096, 16384], args.batch, args.heads, args.head_dim, args.sweep,
                               not args.no_check, variants)
    result = result_document(targets.environment("cuda"), pinned, args.batch, args.heads, args.head_dim,
                             rows, sweep_rows, mask_rows)
    print(_rows_table(rows or mask_rows))
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(json.dumps(result, indent=2, ensure_ascii=True, allow_nan=False))
    return 0


def arguments_or_status(prog: str, parse):
    """``(parse(), None)`` for a run on the GPU, or ``(None, 2)`` after one line on stderr: the
    ValueError of an argument ``parse`` rejects, or no GPU. Every argument is checked before the
    GPU is looked for. The three benchmarks' commands go through here."""
    try:
        value = parse()
    except ValueError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return None, 2
    if not torch.cuda.is_available():
        print(f"{prog}: needs a GPU", file=sys.stderr)
        return None, 2
    return value, None


def render_result(path: str, prog: str, render) -> int:
    """Print ``render(document)`` of an earlier ``--json`` result: 0, or 2 after one line on stderr
    naming the file and the problem (unreadable, not JSON, or missing what ``render`` needs).
    The benchmarks' ``--markdown`` (and the table's ``--pick``) go through here."""
    try:
        with open(path) as fh:
            text = render(json.load(fh))
    except (OSError, ValueError, KeyError, StopIteration, TypeError) as err:
        print(f"{prog}: cannot read {path}: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0


def _rows_table(rows: list[dict]) -> str:
    """The rows as a Markdown table (every key of every row, in first-seen order)."""
    keys = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join("" if row.get(key) is None else str(row[key]) for key in keys) + " |" for row in rows]
    return "\n".join(lines)


def result_document(fingerprint: dict, pinned: configs.LaunchConfig, batch: int, heads: int, head_dim: int,
                    rows: list[dict], sweep_rows: list[dict], mask_rows: list[dict]) -> dict:
    """The ``--json`` document (format ``parity-benchmark-report``, schema in parity/schemas/).
    Results committed before the format had a name (bench/results/h200-*.json) lack the
    ``format``/``version`` keys and are otherwise the same."""
    return {
        "format": FORMAT, "version": VERSION,
        "fingerprint": fingerprint,
        "pinned_config": dataclasses.asdict(pinned),
        "shape": {"batch": batch, "heads": heads, "head_dim": head_dim, "dtype": "bf16"},
        "rows": rows,
        "sweep": sweep_rows,
        "mask_rows": mask_rows,
    }


def parse_masks(spec: str | None) -> list[str]:
    """``document,padding`` (or ``all``) -> the mask case names; None -> []."""
    if spec is None:
        return []
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if names == ["all"]:
        return list(MASK_CASES)
    unknown = [name for name in names if name not in MASK_CASES]
    if unknown or not names:
        raise ValueError(f"bad --masks {spec!r}: choose from {', '.join(MASK_CASES)} or all")
    return names


if __name__ == "__main__":
    sys.exit(main())
