"""The space of attention cases that fuzzing draws from, drawn by Hypothesis or by a seeded RNG.

One definition of the ranges (:func:`draw_case` over a :class:`CaseBounds`) serves two drawers:
``parity.testing.strategies`` wraps it in Hypothesis strategies (shrinking, ``@example``), and
:func:`draw_cases` walks it with a seeded ``random.Random``, so a capture host can record N cases
into a bundle and the compare host replays exactly those (the cases travel in the bundle's
subject arguments, so the replay never depends on re-drawing). This module does not import
Hypothesis: a GPU capture host needs neither it nor pytest.

Cases are :class:`parity.run.subjects.attention.AttentionCase` objects, so a drawn case is directly
an attention subject case (``AttentionSubject(cases=[case.to_json(), ...])``) and its id
(``B2-Hq8-Hkv2-Sq1000-Sk1000-D64-causal-bf16-s0``) is the pytest id and the bundle layer name.

Command line (``python -m parity.run.fuzz``)::
    draw N [--seed S] [--bounds cpu|gpu]   JSON list of N case dicts, for
                                           python -m parity capture --subject attention --arg cases=...
    check --case JSON [--device D]         run one case through the kernel and the fp64 reference
                                           (the flash-attention rule); exit 0 pass, 1 fail, 2 bad input
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shlex
import sys
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import torch

from parity.base import dtypes
from parity.base.errors import UsageError
from parity.run import platform
from parity.run.subjects.attention import LAYOUT_KINDS, AttentionCase

T = TypeVar("T")

DTYPE_NAMES = dtypes.KERNEL_DTYPES
HEAD_DIMS = (16, 32, 64, 96, 128, 256)  # every head dim the kernel supports
BLOCK_SIZES = (16, 32, 64, 128)
GQA_GROUPS = (1, 2, 4, 8)  # query heads per key/value head
# Ways to draw a sequence length, first the one Hypothesis shrinks towards.
LENGTH_KINDS = ("any", "one", "block_multiple", "off_by_one")


@dataclasses.dataclass(frozen=True)
class CaseBounds:
    """Limits of the drawn cases.

    ``max_tiles`` bounds the interpreter's work: ``batch * heads_q * ceil(Sq / tq) * ceil(Sk / tk)``
    with ``tq = min(block_m, cost_tile)`` (and ``tk`` likewise) is the number of (query tile, key
    tile) iterations the kernel runs when every tile is visited; the Triton interpreter costs
    about 9 ms per iteration on one CPU core (measured here, 2026-12), whatever the head dim.
    ``cost_tile`` is the CPU launch config's tile (64). ``max_score_elements`` bounds
    ``batch * heads_q * Sq * Sk``, the size of the fp64 reference's score matrix. ``None``: no bound.
    """

    max_batch: int = 2
    max_heads_kv: int = 2
    max_heads_q: int = 8
    groups: tuple[int, ...] = GQA_GROUPS
    max_seq_q: int = 256
    max_seq_k: int = 256
    head_dims: tuple[int, ...] = HEAD_DIMS
    block_sizes: tuple[int, ...] = BLOCK_SIZES
    layouts: tuple[str, ...] = LAYOUT_KINDS
    dtypes: tuple[str, ...] = DTYPE_NAMES
    max_seed: int = 99_999
    max_tiles: int | None = 24
    cost_tile: int = 64
    max_score_elements: int | None = None

    def __post_init__(self):
        for name in ("groups", "head_dims", "block_sizes", "layouts", "dtypes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
            if not getattr(self, name):
                raise UsageError(f"case bounds: {name} must not be empty")
        for name in ("max_batch", "max_heads_kv", "max_heads_q", "max_seq_q", "max_seq_k", "cost_tile"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"case bounds: {name} must be a positive int, got {value!r}")
        if not isinstance(self.max_seed, int) or self.max_seed < 0:
            raise UsageError(f"case bounds: max_seed must be an int >= 0, got {self.max_seed!r}")
        if 1 not in self.groups or any(not isinstance(g, int) or g < 1 for g in self.groups):
            raise UsageError(f"case bounds: groups must be positive ints including 1, got {self.groups}")
        if self.max_heads_kv > self.max_heads_q:
            raise UsageError("case bounds: max_heads_kv must be <= max_heads_q")
        bad = [b for b in self.block_sizes if not isinstance(b, int) or b < 16 or b & (b - 1)]
        if bad:
            raise UsageError(f"case bounds: block sizes must be powers of two >= 16, got {bad}")
        bad = [d for d in self.head_dims if d not in HEAD_DIMS]
        if bad:
            raise UsageError(f"case bounds: head dims {bad} are not supported by the kernel ({HEAD_DIMS})")
        bad = [name for name in self.layouts if name not in LAYOUT_KINDS]
        if bad:
            raise UsageError(f"case bounds: unknown layouts {bad}; choose from {', '.join(LAYOUT_KINDS)}")
        bad = [name for name in self.dtypes if name not in DTYPE_NAMES]
        if bad:
            raise UsageError(f"case bounds: unknown dtypes {bad}; choose from {', '.join(DTYPE_NAMES)}")
        # Every draw must have room for one query and one key per head.
        if self.max_tiles is not None and self.max_tiles < self.max_heads_q:
            raise UsageError("case bounds: max_tiles must be >= max_heads_q")
        if self.max_score_elements is not None and self.max_score_elements < self.max_heads_q:
            raise UsageError("case bounds: max_score_elements must be >= max_heads_q")

    def replace(self, **changes: Any) -> "CaseBounds":
        return dataclasses.replace(self, **changes)

    def tiles(self, case: AttentionCase) -> int:
        """The interpreter cost of ``case`` in the units of ``max_tiles``."""
        tile_q = min(case.block_m, self.cost_tile)
        tile_k = min(case.block_n, self.cost_tile)
        return (case.batch * case.heads_q * math.ceil(case.seq_q / tile_q) * math.ceil(case.seq_k / tile_k))

    def admits(self, case: AttentionCase) -> bool:
        """Whether ``case`` lies inside these bounds (what every drawn case satisfies)."""
        return (
            1 <= case.batch <= self.max_batch
            and 1 <= case.heads_kv <= self.max_heads_kv
            and case.heads_q <= self.max_heads_q
            and case.heads_q // case.heads_kv in self.groups
            and case.heads_q % case.heads_kv == 0
            and 1 <= case.seq_q <= self.max_seq_q
            and 1 <= case.seq_k <= self.max_seq_k
            and case.head_dim in self.head_dims
            and case.block_m in self.block_sizes
            and case.block_n in self.block_sizes
            and case.layout in self.layouts
            and case.dtype in self.dtypes
            and 0 <= case.seed <= self.max_seed
            and (self.max_tiles is None or self.tiles(case) <= self.max_tiles)
            and (self.max_score_elements is None
                 or case.batch * case.heads_q * case.seq_q * case.seq_k <= self.max_score_elements)
        )


# CPU: the Triton interpreter, ~0.05-1 s per case with the fp64 check (measured: 0.5 s on average
# at max_tiles 32; 24 keeps 20 cases near 8 s).
CPU_BOUNDS = CaseBounds()
# GPU: production-like shapes; the score bound keeps check_kernel_output's fp64 CPU reference
# within a few GiB.
GPU_BOUNDS = CaseBounds(
    max_batch=4, max_heads_kv=8, max_heads_q=32, max_seq_q=4096, max_seq_k=4096,
    max_tiles=None, max_score_elements=2**27,
)
# Cross-host corpora committed to the repo (golden/): CPU-sized cases, small enough that 150 of
# them with their fp64 references (which are most of the bytes) stay under 20 MB (measured:
# 15-18 MiB for two seeds) and replay through the interpreter in CI in well under a minute.
CORPUS_BOUNDS = CPU_BOUNDS.replace(max_tiles=6, max_heads_q=4, max_heads_kv=2, max_batch=1, max_seq_q=96,
                                   max_seq_k=160)
BOUNDS: dict[str, CaseBounds] = {"cpu": CPU_BOUNDS, "gpu": GPU_BOUNDS, "corpus": CORPUS_BOUNDS}


def resolve_bounds(bounds: CaseBounds | str = "cpu", **changes: Any) -> CaseBounds:
    """A CaseBounds from a preset name (``cpu``, ``gpu``) or a CaseBounds, with field changes."""
    if isinstance(bounds, str):
        try:
            bounds = BOUNDS[bounds]
        except KeyError:
            raise UsageError(f"unknown case bounds {bounds!r}; choose from {', '.join(BOUNDS)}") from None
    if not isinstance(bounds, CaseBounds):
        raise UsageError(f"bounds must be a CaseBounds or one of {', '.join(BOUNDS)}, got {type(bounds).__name__}")
    if changes:
        unknown = set(changes) - {f.name for f in dataclasses.fields(CaseBounds)}
        if unknown:
            raise UsageError(f"unknown case bound(s) {sorted(unknown)}")
        bounds = bounds.replace(**changes)
    return bounds


# ---- drawing ----------------------------------------------------------------------------------


class Draw(Protocol):
    """The three primitive draws the case space is defined by (Hypothesis or random.Random)."""

    def integer(self, low: int, high: int) -> int: ...

    def choice(self, options: Sequence[T]) -> T: ...

    def boolean(self) -> bool: ...


class RandomDraw:
    """Draws from a seeded ``random.Random``: uniform integers and choices, fair booleans."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def integer(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)

    def choice(self, options: Sequence[T]) -> T:
        return options[self.rng.randrange(len(options))]

    def boolean(self) -> bool:
        return self.rng.random() < 0.5


def draw_length(draw: Draw, cap: int, block: int) -> int:
    """A sequence length in [1, cap]: any, 1, a multiple of ``block``, or a multiple +- 1.

    Shrinking needs two things here: the length is drawn first and then snapped to the kind (so
    a failure at 65 = 4 * 16 + 1 can shrink past the kinds), and the same draws happen whatever
    the values (Hypothesis ranks an example with fewer draws as simpler, so a draw that exists
    only for small values would stop lengths from shrinking).
    """
    length = draw.integer(1, cap)
    kind = draw.choice(LENGTH_KINDS)
    below = draw.boolean()
    if kind == "one":
        return 1
    if kind == "block_multiple" and cap >= block:
        return block * min(max(1, round(length / block)), cap // block)
    if kind == "off_by_one" and cap > block:
        multiple = block * min(max(1, round(length / block)), (cap - 1) // block)
        return multiple - 1 if below else multiple + 1  # multiple - 1 >= 15, multiple + 1 <= cap
    return length


def draw_heads(draw: Draw, bounds: CaseBounds) -> tuple[int, int]:
    """(heads_q, heads_kv): heads_kv in [1, max_heads_kv], heads_q = heads_kv * a GQA group."""
    heads_kv = draw.integer(1, bounds.max_heads_kv)
    groups = [g for g in bounds.groups if heads_kv * g <= bounds.max_heads_q]
    return heads_kv * draw.choice(groups), heads_kv


# Layout kinds defined for Sq = Sk only (AttentionCase checks it).
SQUARE_LAYOUTS = ("document", "prefixlm")


def draw_case(draw: Draw, bounds: CaseBounds = CPU_BOUNDS) -> AttentionCase:
    """One attention case inside ``bounds`` (``bounds.admits(case)`` holds).

    Order matters for shrinking: the dtype, head dim, layout kind and block sizes come first and
    shrink towards the first of their options; the shapes come next and shrink towards 1; the
    lengths are drawn last, inside what the cost bounds leave for them.
    """
    dtype = draw.choice(bounds.dtypes)
    head_dim = draw.choice(bounds.head_dims)
    layout = draw.choice(bounds.layouts)
    block_m = draw.choice(bounds.block_sizes)
    block_n = draw.choice(bounds.block_sizes)
    heads_q, heads_kv = draw_heads(draw, bounds)
    max_batch = bounds.max_batch
    if bounds.max_tiles is not None:
        max_batch = min(max_batch, bounds.max_tiles // heads_q)
    if bounds.max_score_elements is not None:
        max_batch = min(max_batch, bounds.max_score_elements // heads_q)
    batch = draw.integer(1, max_batch)

    tile_q = min(block_m, bounds.cost_tile)
    tile_k = min(block_n, bounds.cost_tile)
    q_cap = bounds.max_seq_q
    tiles_per_head = None
    elements_per_head = None
    if bounds.max_tiles is not None:
        tiles_per_head = bounds.max_tiles // (batch * heads_q)
        q_cap = min(q_cap, tiles_per_head * tile_q)
    if bounds.max_score_elements is not None:
        elements_per_head = bounds.max_score_elements // (batch * heads_q)
        q_cap = min(q_cap, elements_per_head)
    seq_q = draw_length(draw, q_cap, block_m)
    k_cap = bounds.max_seq_k
    if tiles_per_head is not None:
        k_cap = min(k_cap, (tiles_per_head // math.ceil(seq_q / tile_q)) * tile_k)
    if elements_per_head is not None:
        k_cap = min(k_cap, elements_per_head // seq_q)
    # Self-attention (Sq == Sk) is the common case, so draw it half of the time. Both draws
    # always happen (see draw_length).
    same = draw.boolean()
    other = draw_length(draw, k_cap, block_n)
    seq_k = seq_q if same and seq_q <= k_cap else other
    if layout in SQUARE_LAYOUTS and seq_k != seq_q:
        # These masks are defined for self-attention. other <= k_cap < seq_q here, so an
        # other x other case lies inside the cost bounds that seq_q x other did.
        seq_q = seq_k = min(seq_q, other)

    params: dict[str, Any] = {}
    num_q_blocks = math.ceil(seq_q / block_m)
    num_k_blocks = math.ceil(seq_k / block_n)
    if layout in ("window", "sink"):
        params["window"] = draw.integer(1, max(1, seq_k))
    if layout == "sink":
        params["sink_blocks"] = draw.integer(0, min(2, num_k_blocks))
    if layout == "random":
        params["density"] = draw.integer(0, 100) / 100  # whole percents: the id shows the density exactly
    if layout == "emptyrow":
        params["empty_block"] = draw.integer(0, num_q_blocks - 1)
    if layout == "document":
        params["docs"] = draw.integer(1, min(4, seq_q))
    if layout == "prefixlm":
        params["prefix"] = draw.integer(0, seq_q)
    seed = draw.integer(0, bounds.max_seed)
    return AttentionCase(batch, heads_q, heads_kv, seq_q, seq_k, head_dim, layout=layout, dtype=dtype,
                         seed=seed, block_m=block_m, block_n=block_n, **params)


def draw_cases(n: int, seed: int = 0, bounds: CaseBounds | str = "cpu") -> list[dict[str, Any]]:
    """``n`` distinct cases (JSON-safe dicts, ``AttentionSubject(cases=...)``), a pure function of the arguments.

    Deterministic across hosts and runs: a ``random.Random`` seeded with ``seed`` walks the same
    ranges the Hypothesis strategies draw from (:func:`draw_case`). Cases with an id already
    drawn are skipped, so the list has ``n`` distinct ids.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UsageError(f"number of fuzz cases must be a positive int, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise UsageError(f"fuzz seed must be an int, got {seed!r}")
    bounds = resolve_bounds(bounds)
    draw = RandomDraw(random.Random(seed))
    cases: dict[str, AttentionCase] = {}
    for _ in range(50 * n):
        case = draw_case(draw, bounds)
        cases.setdefault(case.id, case)
        if len(cases) == n:
            return [case.to_json() for case in cases.values()]
    raise UsageError(f"could not draw {n} distinct cases inside these bounds (got {len(cases)})")


# ---- running one case ---------------------------------------------------------------------------


def case_json(case: AttentionCase) -> str:
    """The case as one line of JSON (what ``check --case`` and ``--arg cases=[...]`` take)."""
    return json.dumps(case.to_json(), separators=(",", ":"), sort_keys=True)


def repro_command(case: AttentionCase, device: str | None = None) -> str:
    """A shell command that re-runs exactly this case through the kernel and the reference."""
    command = f"python -m parity.run.fuzz check --case {shlex.quote(case_json(case))}"
    return command + (f" --device {shlex.quote(device)}" if device else "")


def check_case(case: AttentionCase, device: Any = None):
    """Run ``case`` through the Triton kernel (on a NaN-poisoned output) and judge it against
    the fp64 reference with ``parity.kernels.testing.check_kernel_output``; returns its KernelCheck.

    Inputs and layout are made on the CPU from the case, then moved to ``device`` (default:
    cuda if present, else cpu, which needs TRITON_INTERPRET=1 set before Triton is imported).
    """

    from parity.kernels import block_sparse_attention
    from parity.kernels.testing import check_kernel_output

    if device is None:
        device = platform.default_device().type
    q, k, v = (t.to(device) for t in case.make_qkv())
    layout = case.make_layout()
    poisoned = torch.full_like(q, float("nan"))
    out, lse = block_sparse_attention(q, k, v, layout.to(device), return_lse=True, out=poisoned)
    return check_kernel_output(out, lse, q, k, v, layout)


# ---- command line -------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m parity.run.fuzz", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    draw = sub.add_parser("draw", help="print N drawn cases as a JSON list (for --arg cases=...)")
    draw.add_argument("n", type=int)
    draw.add_argument("--seed", type=int, default=0)
    draw.add_argument("--bounds", default="cpu", choices=sorted(BOUNDS))
    check = sub.add_parser("check", help="run one case through the kernel and judge it against the reference")
    check.add_argument("--case", required=True, help="the case as JSON (as printed by a failing property test)")
    check.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "draw":
            print(json.dumps(draw_cases(args.n, args.seed, args.bounds), separators=(",", ":")))
            return 0
        try:
            data = json.loads(args.case)
        except json.JSONDecodeError as err:
            raise UsageError(f"--case is not JSON: {err}") from None
        if not isinstance(data, dict):
            raise UsageError("--case must be a JSON object (one case)")
        case = AttentionCase.from_json(data)
        device = args.device or platform.default_device().type
        if device.startswith("cpu"):
            # Must precede the first import of triton, which happens in check_case.
            os.environ.setdefault("TRITON_INTERPRET", "1")
        result = check_case(case, device)
    except UsageError as err:
        print(f"parity.run.fuzz: error: {err}", file=sys.stderr)
        return 2
    print(f"{case.id}: {'pass' if result.passed else 'FAIL'}: {result}")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
