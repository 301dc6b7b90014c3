"""The prefill kernel's table in one run: every case next to FlexAttention and SDPA, with what limits it.

    python -m bench.benchmark_table --json table.json
        [--config [dD:]KEY=VALUE,... ...] [--cases NAME,...] [--repeats N]
    python -m bench.benchmark_table --markdown table.json [--as LABEL ...]
    python -m bench.benchmark_table --pick sweep.json

The cases (``CASES``) are those of bench/BENCHMARK.md: bf16, B=4, H=16 unless named;
causal, sliding window 1024 and random 25% (causal) layouts at D=64 and D=128, S=4k and 16k;
dense causal and dense non-causal next to SDPA; GQA 32:8 and fp16 at 8k; the documents and
padding element masks at 16k. In each case, every implementation gets the same inputs and the
same mask (FlexAttention through ``BlockMask.from_kv_blocks`` on the layout's own block lists,
or ``create_block_mask`` of the equivalent mask_mod for the element masks).

Before timing, each output is compared with the fp32 PyTorch reference (relative L2 error); an
implementation above ``CHECK_REL_L2`` is timed but marked and gets no ratio. Times: the median of
``--repeats`` do_bench medians and their spread ((max - min) / median), the implementations of a
case timed in turns (``timed_in_turns``: none of them always last on a GPU that heats). Each row carries the
roofline (``bench.roofline``): effective TFLOP/s over the computed blocks and its fraction of
the dense matmul ceiling measured at the start of the same run, the least-bytes TB/s and its
fraction of the measured copy rate.

"parity triton" is the kernel as a caller gets it by default: through the launch cache (the
host's set-up done once per problem; kernels/launch_cache.py). ``--uncached`` adds the same pinned
config called without it (``UNCACHED``: the arguments built and dispatched on every call).
``--config`` adds a variant of the pinned config (``LaunchConfig`` fields, ``configs.LAUNCH_FIELDS``),
to every case, or with a ``d64:`` prefix only to cases of that head dim. ``--markdown`` writes
the benchmark document's table from a result; ``--as LABEL`` takes the variant named LABEL as
"the kernel" (a variant measured in the run and pinned afterwards; repeatable: per case the first
label present counts, so one per head dim). ``--pick`` reads a sweep's result and prints, per head
dim, the ``--config dD:...`` of the variant with the highest geometric-mean TFLOP/s over the
cases of that head dim, if it beats the pinned config there and passed every check (``pick``). Needs a GPU to measure;
``run`` also accepts a CPU device and tiny ``Sizes`` (a smoke run through the interpreter).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any, Callable

import torch

from parity.kernels import configs, targets
from parity.kernels.attention import block_sparse_attention, launch_config
from parity.kernels.layout import (BlockLayout, causal_layout, layout_from_block_mask, random_layout, sliding_window_layout)
from parity.kernels.reference import reference_attention
from parity.kernels.testing import random_qkv

from . import roofline
from .benchmark import allow_recompiles, arguments_or_status, flex_block_mask, mask_case, parse_config, render_result

FORMAT, VERSION = "parity-benchmark-table-report", 1
# The kernel called with launch_cache=False (kernels/launch_cache.py), with --uncached.
UNCACHED = "parity triton, uncached"
CHECK_REL_L2 = 2e-2  # bf16/fp16 outputs of a correct kernel sit near 3e-3 / 5e-4 (BENCHMARK.md)


@dataclasses.dataclass(frozen=True)
class Case:
    """One row of the table: the problem and the layout (``layout`` names a builder below)."""

    name: str
    head_dim: int
    seq: int
    layout: str
    batch: int = 4
    heads_q: int = 16
    heads_kv: int = 16
    dtype: str = "bf16"


PLAIN_LAYOUTS = ("causal", "window1024", "random25", "dense")  # the block layouts; the rest are element masks


def plain_layout(seq: int, name: str, block: int) -> BlockLayout:
    """The block layout ``name`` (one of ``PLAIN_LAYOUTS``) of a case of length ``seq``."""
    nb = -(-seq // block)
    builders: dict[str, Callable[[], BlockLayout]] = {
        "causal": lambda: causal_layout(seq, seq, block_m=block, block_n=block),
        "window1024": lambda: sliding_window_layout(seq, seq, min(1024, seq), block_m=block, block_n=block),
        "random25": lambda: random_layout(seq, seq, 0.25, 0, causal=True, block_m=block, block_n=block),
        "dense": lambda: layout_from_block_mask(torch.ones(1, 1, nb, nb, dtype=torch.bool), seq, seq,
                                                block_m=block, block_n=block),
    }
    if name not in builders:
        raise ValueError(f"unknown block layout {name!r}; the layouts: {', '.join(PLAIN_LAYOUTS)}")
    return builders[name]()


def _cases() -> list[Case]:
    # Names without spaces, so that a shell variable can list them (bench/h200_run.sh).
    out = [Case(f"d{d}-s{s // 1024}k-{lay}", d, s, lay) for d in (128, 64) for s in (4096, 16384)
           for lay in ("causal", "window1024", "random25")]
    out += [Case(f"d{d}-s{s // 1024}k-dense", d, s, "dense") for d in (128, 64) for s in (4096, 16384)]
    out += [Case("gqa32:8-d128-s8k-causal", 128, 8192, "causal", heads_q=32, heads_kv=8),
            Case("gqa32:8-d128-s8k-window1024", 128, 8192, "window1024", heads_q=32, heads_kv=8),
            Case("fp16-d128-s8k-causal", 128, 8192, "causal", dtype="fp16"),
            Case("d128-s16k-documents", 128, 16384, "document"),
            Case("d128-s16k-padding", 128, 16384, "padding")]
    return out


CASES: tuple[Case, ...] = tuple(_cases())
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Scale of a run: the real one, or a tiny one for the CPU smoke test."""

    block: int = 128
    repeats: int = 5
    matmul_n: int = 8192
    copy_elements: int = 2**30
    seq_cap: int | None = None  # cap every case's length (the smoke test)
    batch_cap: int | None = None
    heads_cap: int | None = None


def parse_variant(spec: str) -> tuple[int | None, dict[str, Any]]:
    """``d64:block_n=128,num_warps=8`` -> ``(64, {...})``; no prefix -> ``(None, {...})``."""
    head, sep, rest = spec.partition(":")
    if sep and head.lower().startswith("d") and head[1:].isdigit():
        return int(head[1:]), parse_config(rest)
    if sep:
        raise ValueError(f"--config {spec!r}: a prefix must look like d64: or d128:")
    return None, parse_config(spec)


def label(cfg: configs.LaunchConfig) -> str:
    flags = [flag for flag in configs.FLAGS if getattr(cfg, flag)]
    return f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}" + "".join(f" +{f}" for f in flags)


def _scaled(case: Case, sizes: Sizes) -> Case:
    seq = min(case.seq, sizes.seq_cap) if sizes.seq_cap else case.seq
    batch = min(case.batch, sizes.batch_cap) if sizes.batch_cap else case.batch
    heads_q = min(case.heads_q, sizes.heads_cap) if sizes.heads_cap else case.heads_q
    heads_kv = heads_q // (case.heads_q // case.heads_kv)
    return dataclasses.replace(case, seq=seq, batch=batch, heads_q=heads_q, heads_kv=max(1, heads_kv))


def timed_in_turns(fns: dict[str, Callable[[], Any]], repeats: int,
                   time_ms: Callable[[Callable[[], Any]], float]) -> dict[str, tuple[float, float] | Exception]:
    """Each implementation's median time over ``repeats`` and its spread ((max - min) / median),
    timed in turns: one run of each per round, the round's first one moved along by one each
    round. Timed one after the other instead, the implementation timed later in a case saw a
    hotter, slower-clocked GPU: on an H100 the same kernel timed second came out 1-8% slower on
    the 16k causal, dense and padding rows, with 14-17% spreads (table 4, its uncached column).
    An implementation whose run raises triton's ``OutOfResources`` gets the error instead and is
    not run again."""
    from triton.runtime.errors import OutOfResources

    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    failed: dict[str, Exception] = {}
    for round_ in range(max(1, repeats)):
        for i in range(len(names)):
            name = names[(round_ + i) % len(names)]
            if name in failed:
                continue
            try:
                times[name].append(time_ms(fns[name]))
            except OutOfResources as err:
                failed[name] = err
    return {name: failed[name] if name in failed else roofline.median_spread(times[name]) for name in names}


def _rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float | str:
    """Relative L2 error; "nan"/"inf" as strings where not finite (the JSON convention)."""
    value = float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
    return value if math.isfinite(value) else str(value)


def _check(error: float | str | None) -> str | None:
    if error is None:
        return None
    return "ok" if isinstance(error, float) and error <= CHECK_REL_L2 else "FAILED"


def _problem(case: Case, device: torch.device, sizes: Sizes):
    """(layout, q, k, v, batch, flex BlockMask or mask_mod case) for a case."""
    dtype = DTYPES[case.dtype]
    if case.layout in ("document", "padding"):
        mc = mask_case(case.layout, case.seq, device)
        q, k, v = random_qkv(mc.batch, case.heads_q, case.heads_kv, case.seq, case.seq, case.head_dim, dtype,
                             seed=case.seq, device=device)
        return mc.layout.to(device), q, k, v, mc.batch, mc
    layout = plain_layout(case.seq, case.layout, sizes.block).to(device)
    q, k, v = random_qkv(case.batch, case.heads_q, case.heads_kv, case.seq, case.seq, case.head_dim, dtype,
                         seed=case.seq, device=device)
    return layout, q, k, v, case.batch, None


def _impls(case: Case, layout, q, k, v, mc, device, variants, flex: bool,
           uncached: bool = False) -> dict[str, Callable[[], torch.Tensor]]:
    gqa = case.heads_q != case.heads_kv
    impls: dict[str, Callable[[], torch.Tensor]] = {"parity triton": lambda: block_sparse_attention(q, k, v, layout)}
    if uncached:
        impls[UNCACHED] = lambda: block_sparse_attention(q, k, v, layout, launch_cache=False)
    for cfg in variants:
        impls[f"parity {label(cfg)}"] = (lambda cfg=cfg: block_sparse_attention(q, k, v, layout, config=cfg))
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        allow_recompiles()
        compiled = torch.compile(flex_attention, dynamic=False)
        if mc is not None:
            block_mask = create_block_mask(mc.mask_mod, mc.flex_batch, None, case.seq, case.seq, device=device,
                                           BLOCK_SIZE=128)
        else:
            block_mask = flex_block_mask(layout.to("cpu"), device)
        impls["FlexAttention"] = lambda: compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    if case.layout in ("causal", "dense") and mc is None:
        causal = case.layout == "causal"
        impls["SDPA"] = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                                 enable_gqa=gqa)
    return impls


def run_case(case: Case, device: torch.device, ceilings: dict[str, float], variant_changes, *, flex: bool = True,
             check: bool = True, sizes: Sizes = Sizes(), uncached: bool = False) -> list[dict[str, Any]]:
    """Every implementation of one case: checked, then timed; one row each."""
    from triton.runtime.errors import OutOfResources

    case = _scaled(case, sizes)
    layout, q, k, v, batch, mc = _problem(case, device, sizes)
    pinned = launch_config(device, case.head_dim, q.dtype, layout)
    variants = [configs.with_overrides(pinned, change) for head, change in variant_changes
                if head in (None, case.head_dim)]
    impls = _impls(case, layout, q, k, v, mc, device, variants, flex, uncached)
    changes_of = {f"parity {label(cfg)}": change for cfg, (head, change) in
                  zip(variants, [vc for vc in variant_changes if vc[0] in (None, case.head_dim)])}
    computed = layout.computed_elements() * (batch * case.heads_q) // (layout.batch_heads[0] * layout.batch_heads[1])
    flops = roofline.attention_flops(computed, case.head_dim)
    hbm = roofline.min_hbm_bytes(batch, case.heads_q, case.heads_kv, case.seq, case.seq, case.head_dim,
                                 q.element_size())
    errors: dict[str, float | str] = {}
    failed: dict[str, str] = {}  # implementations that could not run: the error's name
    if check:
        ref = reference_attention(q, k, v, layout, precision="fp32", chunk_rows=256)
        for name, fn in impls.items():
            try:
                errors[name] = _rel_l2(fn(), ref)
            except OutOfResources as err:
                failed[name] = type(err).__name__
        del ref
    timings = timed_in_turns({name: fn for name, fn in impls.items() if name not in failed}, sizes.repeats,
                             lambda fn: roofline._time_ms(fn, device))
    rows = []
    for name in impls:
        base = {"case": case.name, "impl": name, "head_dim": case.head_dim, "seq": case.seq, "batch": batch,
                "heads_q": case.heads_q, "heads_kv": case.heads_kv, "dtype": case.dtype, "layout": case.layout,
                "density": round(computed / (batch * case.heads_q * case.seq * case.seq), 4)}
        if name in ("parity triton", UNCACHED):
            base["config"] = label(pinned)
        elif name in changes_of:
            base["config_changes"] = changes_of[name]
        if name in failed:
            rows.append({**base, "error": failed[name]})
            continue
        error = errors.get(name)
        if isinstance(timings[name], Exception):
            rows.append({**base, "error": type(timings[name]).__name__})
            continue
        ms, spread = timings[name]
        rows.append({**base, "ms": round(ms, 4), "spread": round(spread, 4), "rel_l2_vs_fp32_ref": error,
                     "check": _check(error),
                     **roofline.limits(flops, hbm, ms * 1e-3, ceilings)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def run(names: list[str] | None, variant_changes, *, device: torch.device | None = None, flex: bool = True,
        check: bool = True, sizes: Sizes = Sizes(), uncached: bool = False,
        after_case: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The cases named (all when None), in the table's order. ``after_case`` gets the document
    so far after every case (the command writes it out, so a run cut short keeps its rows)."""
    device = device or torch.device("cuda")
    ceilings = roofline.measure_ceilings(device, matmul_n=sizes.matmul_n, copy_elements=sizes.copy_elements)
    print(json.dumps(ceilings), flush=True)
    document = {"format": FORMAT, "version": VERSION, "environment": targets.environment(device),
                "ceilings": ceilings, "check_rel_l2": CHECK_REL_L2,
                "variants": [{"head_dim": head, "changes": change} for head, change in variant_changes], "rows": []}
    for case in CASES:
        if names is None or case.name in names:
            document["rows"] += run_case(case, device, ceilings, variant_changes, flex=flex, check=check, sizes=sizes,
                                         uncached=uncached)
            if after_case is not None:
                after_case(document)
    return document


def write_json(path: str, document: dict[str, Any]) -> None:
    """Write whole or not at all: a temporary file renamed over ``path``."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(json.dumps(document, indent=2, ensure_ascii=True, allow_nan=False))
    os.replace(tmp, path)


# ---- the document's table ---------------------------------------------------------------------
def _find(rows, case, impl):
    return next((r for r in rows if r["case"] == case and r["impl"] == impl and "ms" in r), None)


def _valid(row) -> bool:
    return row is not None and row.get("check") != "FAILED"


def pick(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Per head dim, the variant (its changes) with the highest geometric mean of TFLOP/s over the
    cases of that head dim, among variants that ran and passed the check in every case the
    pinned config ran in; only if that mean beats the pinned config's. A variant is its changes,
    whatever config they were applied to: a case with its own pinned tiles (the element-mask
    rows, ``configs.IRREGULAR_CONFIGS``) gives the same changes another label."""
    rows = result["rows"]
    best: dict[int, dict[str, Any]] = {}
    for head_dim in sorted({r["head_dim"] for r in rows}):
        cases = [c for c in dict.fromkeys(r["case"] for r in rows if r["head_dim"] == head_dim)
                 if _find(rows, c, "parity triton") is not None]

        def geomean(found):
            if not found or any(r is None or r.get("check") != "ok" for r in found):
                return None  # missing somewhere, not checked, or failed its check
            return math.exp(sum(math.log(r["tflops"]) for r in found) / len(found))

        def variant_row(case, key):
            return next((r for r in rows if r["case"] == case and "ms" in r and "config_changes" in r
                         and json.dumps(r["config_changes"], sort_keys=True) == key), None)

        base = geomean([_find(rows, c, "parity triton") for c in cases])
        # the variants of the pinned config (not the plain call, nor the uncached call of it)
        keys = list(dict.fromkeys(json.dumps(r["config_changes"], sort_keys=True) for r in rows
                                  if r["head_dim"] == head_dim and "config_changes" in r))
        scored = [(geomean([variant_row(c, key) for c in cases]), key) for key in keys]
        scored = [(g, key) for g, key in scored if g is not None]
        if base is None or not scored:
            continue
        top, key = max(scored)
        if top > base:
            found = [variant_row(c, key) for c in cases]
            best[head_dim] = {"impl": " / ".join(dict.fromkeys(r["impl"] for r in found)),
                              "changes": found[0]["config_changes"], "geomean_tflops": round(top, 1),
                              "pinned_geomean_tflops": round(base, 1)}
    return best


def pick_arguments(best: dict[int, dict[str, Any]]) -> list[str]:
    """``pick``'s choice as benchmark arguments: ``--config d64:block_n=128,num_warps=8 ...``."""
    out = []
    for head_dim, choice in best.items():
        fields = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in choice["changes"].items())
        out += ["--config", f"d{head_dim}:{fields}"]
    return out


def _pick_text(result: dict[str, Any]) -> str:
    """``--pick``: the arguments on stdout (for a script), the reasons on stderr."""
    best = pick(result)
    for head_dim, choice in best.items():
        print(f"D={head_dim}: {choice['impl']} {choice['geomean_tflops']} vs pinned "
              f"{choice['pinned_geomean_tflops']} TFLOP/s (geometric mean)", file=sys.stderr)
    return " ".join(pick_arguments(best))


def markdown(result: dict[str, Any], kernel: str | list[str] = "parity triton") -> str:
    """One line per case: the kernel's time and TFLOP/s, its ratio to FlexAttention and SDPA (a
    ratio only where both outputs passed the check), and what limits it (fractions of the
    measured ceilings). Then one line per variant timed: its TFLOP/s per case."""
    rows, ceil = result["rows"], result["ceilings"]
    kernels = [kernel] if isinstance(kernel, str) else list(kernel)
    lines = [f"Ceilings measured in this run: dense bf16 matmul {ceil['matmul_tflops']} TFLOP/s, "
             f"copy {ceil['copy_tbps']} TB/s. Ratios are speedups (time of the other / time of the kernel).", "",
             "| case | density | kernel ms (spread) | kernel TFLOP/s | vs Flex | vs SDPA | "
             "of matmul ceiling | of HBM (least bytes) | rel L2: kernel / Flex / SDPA |",
             "|---|---|---|---|---|---|---|---|---|"]

    def ratio(other, ours):
        return f"{other['ms'] / ours['ms']:.2f}x" if _valid(other) and _valid(ours) else "-"

    def err(row):
        value = row.get("rel_l2_vs_fp32_ref") if row else None
        return "-" if value is None else f"{float(value):.1e}" + ("!" if row.get("check") == "FAILED" else "")

    for case in dict.fromkeys(r["case"] for r in rows):
        ours = next((r for r in (_find(rows, case, k) for k in kernels) if r is not None), None)
        if ours is None:
            lines.append(f"| {case} | - | not measured | - | - | - | - | - | - |")
            continue
        flex, sdpa = _find(rows, case, "FlexAttention"), _find(rows, case, "SDPA")
        lines.append(
            f"| {case} | {ours['density']:.3f} | {ours['ms']} ({100 * ours['spread']:.1f}%) | {ours['tflops']:.0f} | "
            f"{ratio(flex, ours) if flex else '-'} | {ratio(sdpa, ours) if sdpa else '-'} | "
            f"{100 * ours['fraction_of_matmul']:.0f}% | {100 * ours['fraction_of_hbm']:.1f}% | "
            f"{err(ours)} / {err(flex)} / {err(sdpa)} |")
    impls = [name for name in dict.fromkeys(r["impl"] for r in rows) if name.startswith("parity")]
    if len(impls) > 1:
        cases = list(dict.fromkeys(r["case"] for r in rows))
        lines += ["", "TFLOP/s of each configuration (`!`: output failed the check):", "",
                  "| config | " + " | ".join(cases) + " |", "|---|" + "---|" * len(cases)]
        for name in impls:
            cells = []
            for case in cases:
                r = _find(rows, case, name)
                cells.append("-" if r is None else f"{r['tflops']:.0f}" + ("" if _valid(r) else "!"))
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cases_named(spec: str) -> list[Case]:
    """``"d64-s4k-causal,d128-s4k-causal"`` -> those cases, in that order (ValueError naming an
    unknown one)."""
    known = {case.name: case for case in CASES}
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown case {unknown[0]!r}; the cases: {', '.join(known)}")
    return [known[n] for n in names]


def case_implementations(case: Case, device: torch.device,
                         uncached: bool = False) -> dict[str, Callable[[], torch.Tensor]]:
    """A case's implementations as the table times them (the kernel at its pinned config, and
    with ``uncached`` the same without the launch cache, FlexAttention, SDPA where it computes
    the same function), on the table's inputs."""
    layout, q, k, v, _batch, mc = _problem(case, device, Sizes())
    return _impls(case, layout, q, k, v, mc, device, [], True, uncached)


def _parse_arguments(args: argparse.Namespace) -> tuple[list, list[str] | None]:
    """The variants and the case names of the command line (ValueError naming a bad one)."""
    changes = [parse_variant(spec) for spec in args.config]
    names = None if not args.cases else [case.name for case in cases_named(args.cases)]
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    return changes, names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", metavar="NAME,...", help="only these cases (names as in the table)")
    parser.add_argument("--config", action="append", default=[], metavar="[dD:]KEY=VALUE,...",
                        help="also time this variant of the pinned config; repeatable")
    parser.add_argument("--repeats", type=int, default=5, help="do_bench runs per implementation (default 5)")
    parser.add_argument("--no-flex", action="store_true", help="leave FlexAttention out")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness check")
    parser.add_argument("--uncached", action="store_true",
                        help=f"also time the kernel without the launch cache (as {UNCACHED!r})")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--markdown", metavar="RESULT.json", help="print the table of an earlier result (no GPU)")
    parser.add_argument("--as", dest="kernel", action="append", metavar="LABEL",
                        help="with --markdown: the implementation shown as the kernel (e.g. 'parity 128x128 w8 s3'); "
                             "repeatable, the first present in a case counts")
    parser.add_argument("--pick", metavar="SWEEP.json",
                        help="print the --config arguments of the best variant per head dim in a result (no GPU)")
    args = parser.parse_args(argv)
    if args.pick:
        return render_result(args.pick, "benchmark_table", _pick_text)
    if args.markdown:
        return render_result(args.markdown, "benchmark_table", lambda doc: markdown(doc, args.kernel or "parity triton"))
    parsed, status = arguments_or_status("benchmark_table", lambda: _parse_arguments(args))
    if status is not None:
        return status
    changes, names = parsed
    result = run(names, changes, flex=not args.no_flex, check=not args.no_check,
                 sizes=dataclasses.replace(Sizes(), repeats=args.repeats), uncached=args.uncached,
                 after_case=(lambda doc: write_json(args.json, doc)) if args.json else None)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
