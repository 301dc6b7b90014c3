"""Hypothesis strategies that draw attention cases and block layouts (never tensors), and the profiles.

Cases are :class:`parity.run.subjects.attention.AttentionCase` objects drawn from the case space of
:mod:`parity.run.fuzz` (one definition of the ranges for Hypothesis and for the seeded cross-host
fuzzer); tensors are made from a case on the CPU (``case.make_qkv()``, ``case.make_layout()``).
Size limits are arguments (a :class:`~parity.run.fuzz.CaseBounds` or a preset name, plus changes), so
a GPU run can draw larger cases than the Triton interpreter can afford::

    @parity_settings()
    @given(case=attention_cases(case_bounds()))          # cpu or gpu bounds, by profile
    def test_kernel(case): ...

    attention_cases("gpu", max_seq_q=1024, layouts=("causal", "window"))

Profiles: importing this module registers ``parity-local``, ``parity-ci`` and ``parity-gpu``
(its only import-time effect; nothing is loaded). :func:`parity_settings` applies one to a test
as a decorator, chosen by :func:`profile_name`: ``PARITY_HYPOTHESIS_PROFILE`` (``local``, ``ci``,
``gpu``), else a parity profile loaded with ``pytest --hypothesis-profile parity-gpu``, else
``ci`` when ``CI`` is set, else ``local``. A decorator rather than ``settings.load_profile``, so
that installing parity (whose pytest plugin loads in every run) never changes the Hypothesis
settings of anyone else's tests.
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st

from parity.base.errors import UsageError
from parity.run import fuzz
from parity.run.fuzz import CPU_BOUNDS, GPU_BOUNDS, CaseBounds, resolve_bounds
from parity.run.subjects.attention import AttentionCase

__all__ = [
    "PROFILE_ENV", "MAX_EXAMPLES_ENV", "PROFILES", "register_profiles", "profile_name", "parity_settings", "case_bounds",
    "attention_cases", "batch_sizes", "head_counts", "seq_lengths", "head_dims", "block_sizes", "dtypes",
    "seeds", "note_case", "LAYOUT_BUILDERS", "LayoutSpec", "layout_specs", "CaseBounds", "CPU_BOUNDS",
    "GPU_BOUNDS",
]

PROFILE_ENV = "PARITY_HYPOTHESIS_PROFILE"
MAX_EXAMPLES_ENV = "PARITY_HYPOTHESIS_MAX_EXAMPLES"
PROFILE_PREFIX = "parity-"
# No deadline anywhere: interpreter runs and first-call GPU compilation take seconds, and a
# deadline failure there says nothing about correctness.
PROFILES: Mapping[str, Mapping[str, Any]] = {
    # Random, with the example database, so local runs keep exploring and replay past failures.
    "local": {"max_examples": 20, "deadline": None, "print_blob": True},
    # Derandomized (the same examples on every run and every xdist worker), no database to
    # carry between runs, failures printed with their reproduce blob.
    "ci": {"max_examples": 20, "deadline": None, "derandomize": True, "database": None, "print_blob": True,
           "suppress_health_check": (HealthCheck.too_slow,)},
    # A real GPU: more and larger cases (case_bounds() gives GPU_BOUNDS under this profile).
    "gpu": {"max_examples": 200, "deadline": None, "print_blob": True,
            "suppress_health_check": (HealthCheck.too_slow,)},
}


def register_profiles() -> None:
    """Register ``parity-local``, ``parity-ci`` and ``parity-gpu`` (idempotent; loads none)."""
    for name, values in PROFILES.items():
        settings.register_profile(PROFILE_PREFIX + name, **values)


register_profiles()


def _short(name: str) -> str:
    return name[len(PROFILE_PREFIX):] if name.startswith(PROFILE_PREFIX) else name


def _truthy(value: str | None) -> bool:
    return bool(value) and value.strip().lower() not in ("0", "false", "no", "off")


def profile_name(environ: Mapping[str, str] | None = None) -> str:
    """The parity profile in effect: ``local``, ``ci`` or ``gpu`` (see the module docstring)."""
    environ = os.environ if environ is None else environ
    requested = environ.get(PROFILE_ENV, "").strip()
    if requested:
        name = _short(requested)
        if name not in PROFILES:
            raise UsageError(f"{PROFILE_ENV}={requested!r}: unknown profile; choose from {', '.join(PROFILES)}")
        return name
    loaded = settings.get_current_profile_name()
    if loaded.startswith(PROFILE_PREFIX) and _short(loaded) in PROFILES:
        return _short(loaded)
    return "ci" if _truthy(environ.get("CI")) else "local"


def parity_settings(profile: str | None = None, **changes: Any) -> settings:
    """Settings of a parity profile (default: :func:`profile_name`), with changes; use as a decorator.

    ``PARITY_HYPOTHESIS_MAX_EXAMPLES=N`` scales every test's examples to N per profile-default
    test (tests that ask for a multiple of the profile's count keep the ratio): a time-boxed GPU
    run can take the ``gpu`` bounds with fewer cases than its 200."""
    name = _short(profile) if profile else profile_name()
    if name not in PROFILES:
        raise UsageError(f"unknown parity Hypothesis profile {profile!r}; choose from {', '.join(PROFILES)}")
    base = settings.get_profile(PROFILE_PREFIX + name)
    requested = os.environ.get(MAX_EXAMPLES_ENV, "").strip()
    if requested:
        try:
            count = int(requested)
            if count < 1:
                raise ValueError
        except ValueError:
            raise UsageError(f"{MAX_EXAMPLES_ENV}={requested!r}: expected a positive integer") from None
        ratio = changes.get("max_examples", base.max_examples) / base.max_examples
        changes = {**changes, "max_examples": max(1, round(count * ratio))}
    return settings(base, **changes)


def case_bounds(profile: str | None = None, **changes: Any) -> CaseBounds:
    """The case bounds that suit a profile: GPU_BOUNDS under ``gpu``, else CPU_BOUNDS (the interpreter)."""
    name = _short(profile) if profile else profile_name()
    return resolve_bounds(GPU_BOUNDS if name == "gpu" else CPU_BOUNDS, **changes)


# ---- attention cases ------------------------------------------------------------------------------


class _HypothesisDraw:
    """:class:`parity.run.fuzz.Draw` over a Hypothesis ``draw``: shrinks towards low ints and first options."""

    def __init__(self, draw):
        self._draw = draw

    def integer(self, low: int, high: int) -> int:
        return self._draw(st.integers(low, high))

    def choice(self, options: Sequence):
        return self._draw(st.sampled_from(tuple(options)))

    def boolean(self) -> bool:
        return self._draw(st.booleans())


@st.composite
def _cases(draw, bounds: CaseBounds) -> AttentionCase:
    return fuzz.draw_case(_HypothesisDraw(draw), bounds)


def attention_cases(bounds: CaseBounds | str = "cpu", **changes: Any) -> st.SearchStrategy[AttentionCase]:
    """Attention cases inside ``bounds`` (``"cpu"``, ``"gpu"`` or a CaseBounds), with field changes.

    Covers batch, GQA ratios (1, 2, 4, 8 query heads per kv head), Sq and Sk of 1, multiples of the
    block size, multiples +- 1 and anything else, every head dim, block sizes 16-128, every layout
    kind of the attention subject (causal, window, sink, random densities in whole percents,
    dense, emptyrow: a query block with no key block; the element masks document, padleft,
    padright, prefixlm), fp16/bf16/fp32 and input seeds.
    """
    return _cases(resolve_bounds(bounds, **changes))


def note_case(case: AttentionCase, device: str | None = None) -> str:
    """Attach the case id and a one-line command that re-runs exactly this case to the test's
    failure report (Hypothesis prints notes of the final, shrunk example only); returns the command."""
    command = fuzz.repro_command(case, device)
    note(f"case {case.id}\nreproduce: {command}")
    return command


def _from_draw(function, *args):
    @st.composite
    def strategy(draw):
        return function(_HypothesisDraw(draw), *args)

    return strategy()


def batch_sizes(max_batch: int = CPU_BOUNDS.max_batch) -> st.SearchStrategy[int]:
    return st.integers(1, max_batch)


def head_counts(bounds: CaseBounds | str = "cpu", **changes: Any) -> st.SearchStrategy[tuple[int, int]]:
    """``(heads_q, heads_kv)`` with ``heads_q = heads_kv * group`` for a GQA group in ``bounds.groups``."""
    return _from_draw(fuzz.draw_heads, resolve_bounds(bounds, **changes))


def seq_lengths(max_len: int, block: int = 64) -> st.SearchStrategy[int]:
    """Lengths in [1, max_len]: any, 1, multiples of ``block``, and multiples +- 1."""
    return _from_draw(fuzz.draw_length, max_len, block)


def head_dims(allowed: Sequence[int] = fuzz.HEAD_DIMS) -> st.SearchStrategy[int]:
    return st.sampled_from(tuple(allowed))


def block_sizes(min_size: int = 16, max_size: int = 128) -> st.SearchStrategy[int]:
    """Powers of two in [min_size, max_size]; the kernel needs >= 16."""
    if min_size < 16 or max_size < min_size:
        raise UsageError(f"block sizes need 16 <= min_size <= max_size, got {min_size}, {max_size}")
    sizes = tuple(1 << e for e in range(4, max_size.bit_length()) if min_size <= (1 << e) <= max_size)
    return st.sampled_from(sizes)


def dtypes(allowed: Sequence[str] = fuzz.DTYPE_NAMES) -> st.SearchStrategy[str]:
    return st.sampled_from(tuple(allowed))


def seeds(max_seed: int = CPU_BOUNDS.max_seed) -> st.SearchStrategy[int]:
    return st.integers(0, max_seed)


# ---- block layouts --------------------------------------------------------------------------------

LAYOUT_BUILDERS = ("causal", "window", "sink", "random", "blockmask")


@dataclasses.dataclass(frozen=True)
class LayoutSpec:
    """One call of a layout builder, drawn: ``build()`` makes the BlockLayout on the CPU.

    ``kind`` names the builder: causal_layout, sliding_window_layout, sink_layout (``offset``,
    ``window``, ``sink_blocks``), random_layout (``density``, ``seed``, ``batch``, ``heads``,
    ``causal``, ``keep_diagonal``), or layout_from_block_mask over a seeded random block mask of
    ``density`` whose query blocks ``empty_rows`` select no key block.
    """

    kind: str
    seq_q: int
    seq_k: int
    block_m: int
    block_n: int
    offset: int = 0
    window: int = 0
    sink_blocks: int = 0
    density: float = 0.0
    seed: int = 0
    batch: int = 1
    heads: int = 1
    causal: bool = True
    keep_diagonal: bool = True
    empty_rows: tuple[int, ...] = ()

    @property
    def num_q_blocks(self) -> int:
        return math.ceil(self.seq_q / self.block_m)

    @property
    def num_kv_blocks(self) -> int:
        return math.ceil(self.seq_k / self.block_n)

    @property
    def id(self) -> str:
        params = {
            "causal": f"causal{self.offset:+d}",
            "window": f"window{self.window}{self.offset:+d}",
            "sink": f"window{self.window}-sink{self.sink_blocks}{self.offset:+d}",
            "random": (f"random{int(round(self.density * 100))}-B{self.batch}H{self.heads}"
                       f"{'' if self.causal else '-noncausal'}{'' if self.keep_diagonal else '-nodiag'}"),
            "blockmask": (f"blockmask{int(round(self.density * 100))}-B{self.batch}H{self.heads}"
                          f"-empty{'.'.join(map(str, self.empty_rows)) or 'none'}"),
        }[self.kind]
        seed = f"-s{self.seed}" if self.kind in ("random", "blockmask") else ""
        return f"Sq{self.seq_q}-Sk{self.seq_k}-bm{self.block_m}bn{self.block_n}-{params}{seed}"

    def block_mask(self):
        """The ``blockmask`` kind's input: [batch, heads, num_q_blocks, num_kv_blocks] bool."""
        import torch

        generator = torch.Generator().manual_seed(self.seed)
        shape = (self.batch, self.heads, self.num_q_blocks, self.num_kv_blocks)
        mask = torch.rand(shape, generator=generator) < self.density
        if self.empty_rows:
            mask[:, :, list(self.empty_rows), :] = False
        return mask

    def build(self):
        from parity import kernels

        blocks = {"block_m": self.block_m, "block_n": self.block_n}
        if self.kind == "causal":
            return kernels.causal_layout(self.seq_q, self.seq_k, offset=self.offset, **blocks)
        if self.kind == "window":
            return kernels.sliding_window_layout(self.seq_q, self.seq_k, self.window, offset=self.offset, **blocks)
        if self.kind == "sink":
            return kernels.sink_layout(self.seq_q, self.seq_k, self.window, self.sink_blocks, offset=self.offset,
                                       **blocks)
        if self.kind == "random":
            return kernels.random_layout(self.seq_q, self.seq_k, self.density, self.seed, batch=self.batch,
                                         heads=self.heads, causal=self.causal, keep_diagonal=self.keep_diagonal,
                                         **blocks)
        return kernels.layout_from_block_mask(self.block_mask(), self.seq_q, self.seq_k, **blocks)


@st.composite
def layout_specs(draw, max_seq: int = 192, kinds: Sequence[str] = LAYOUT_BUILDERS,
                 block_size: st.SearchStrategy[int] | None = None, max_batch: int = 2,
                 max_heads: int = 3) -> LayoutSpec:
    """A builder call with lengths in [1, max_seq] (1, block multiples +- 1 included), offsets that
    shift the diagonal either way (so rows with no visible key occur), random densities, and
    block masks with empty query blocks."""
    unknown = [kind for kind in kinds if kind not in LAYOUT_BUILDERS]
    if unknown:
        raise UsageError(f"unknown layout builders {unknown}; choose from {', '.join(LAYOUT_BUILDERS)}")
    kind = draw(st.sampled_from(tuple(kinds)))
    sizes = block_size if block_size is not None else block_sizes()
    block_m, block_n = draw(sizes), draw(sizes)
    seq_q = draw(seq_lengths(max_seq, block_m))
    same, other = draw(st.booleans()), draw(seq_lengths(max_seq, block_n))  # both drawn: see fuzz.draw_length
    seq_k = seq_q if same else other
    spec = LayoutSpec(kind, seq_q, seq_k, block_m, block_n)
    num_q, num_k = spec.num_q_blocks, spec.num_kv_blocks
    changes: dict[str, Any] = {}
    if kind in ("causal", "window", "sink"):
        changes["offset"] = draw(st.integers(-seq_q, seq_k))
    if kind in ("window", "sink"):
        changes["window"] = draw(st.integers(1, seq_k + 1))
    if kind == "sink":
        changes["sink_blocks"] = draw(st.integers(0, num_k))
    if kind in ("random", "blockmask"):
        changes["density"] = draw(st.integers(0, 100)) / 100
        changes["seed"] = draw(seeds())
        changes["batch"] = draw(st.integers(1, max_batch))
        changes["heads"] = draw(st.integers(1, max_heads))
    if kind == "random":
        changes["causal"] = draw(st.booleans())
        changes["keep_diagonal"] = draw(st.booleans())
    if kind == "blockmask":
        changes["empty_rows"] = tuple(sorted(draw(st.sets(st.integers(0, num_q - 1), max_size=num_q))))
    return dataclasses.replace(spec, **changes)
