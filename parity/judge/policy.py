"""Tolerance policies: per-dtype defaults, per-layer overrides, config loading, the checks and their
calibration, and the "would pass with" arithmetic (the smallest tolerance-file values that pass).

A ``Policy`` maps ``(layer_name, dtype)`` to a ``Tolerance``; ``judge`` (:mod:`parity.judge.checks`)
applies a ``Tolerance`` to a ``LayerMetrics`` (``parity.judge.metrics``) and returns a ``Verdict``
that says what failed and the smallest tolerances that would have passed; :func:`would_pass_from_checks`
turns those into ``key = value`` lines a tolerance file accepts. Long because this docstring holds
the meaning and the calibration table of every check and default (about 170 lines); the code is
under 600. Compare must compute the metrics with the resolved
tolerance's ``atol``/``atol_rms``/``rtol``: ``measure(out, ref, tol)`` does (``judge`` refuses
metrics computed with other values).

Checks made by ``judge`` (each failed check gives one reason):

- ``nan_policy = "positions"``: NaN/Inf positions must agree (NaN with NaN, +Inf with +Inf).
  ``"ignore"``: they are not checked; all other checks only ever see positions where both sides
  are finite.
- mismatch: at most ``max_mismatch_fraction`` of the finite elements may lie outside their
  bound ``atol + atol_rms * rms(ref) + rtol * |ref|``. The RMS term is what makes one default fit
  tensors of any scale: benign error near zero is proportional to the tensor's typical
  magnitude (measured: its tail reaches 2-6x the layer's own rel_l2, in units of the RMS).
- outliers: the mismatch allowance forgives only elements *near* their bound. An element whose
  error exceeds ``outlier_factor`` (default 4) times its own bound fails the tensor however
  large the tensor is: one element off by 100x in a 4M-element tensor is a bug (a race, a
  boundary, one wrong mask row), not a rounding tail. The count and the worst element are
  reported.
- ``min_cosine``, ``max_rel_l2``, and, when set, ``max_abs`` and ``max_ulp`` (fp16/bf16 only).
- bias: the error projected on the reference, ``sum((out - ref) * ref) / sum(ref * ref)``, fails
  when its size exceeds ``max_bias`` *and* it lies more than ``bias_z`` standard errors from 0
  (``bias_z`` of :mod:`parity.judge.metrics`). Rounding error is unbiased and averages out of the
  projection; a wrong scale, a missing term, a wrong epsilon or an accumulation in the wrong
  precision does not, and moves every element the same way: one bf16 block scaled by 1.005
  moves every element by one bf16 step, a rel L2 no larger than a correct fp32 port's, but a
  bias 30x the port's. The reason says "biased" with the measured bias. Calibration:
  parity/NUMERICS.md, "Bias".
- error budget, when ``budget_k`` is set and compare supplies an ``ErrorBudget`` (it does for
  every tensor the bundle holds a high-precision reference of): this host's error against the
  reference may be at most ``budget_k`` times the capture host's own error against the same
  reference, plus a rounding floor, for ``rel_l2`` and for ``max_abs`` (the flash-attention
  rule, parity/NUMERICS.md). See "The error budget's floor" below.

Which rule judges a tensor. With a reference in the bundle, the budget *and* the fixed
thresholds below (a backstop) are checked: the budget is the sharp rule, relative to what the
capture host's own arithmetic achieved on this very tensor; the thresholds catch what a budget
computed from a bad golden would let through. A threshold the golden itself fails against the
reference is waived where the budget holds (``checks.waive_backstop``): a deep bf16 model's golden
is beyond it, and a correct port would fail where the capture host does. Without a reference,
the thresholds alone judge.

The error budget's floor, and why it is derived rather than fixed. ``k x capture error`` judges
rounding noise when the capture host's error is itself only rounding: an fp32 LSE whose golden is
0.6 ulp from fp64 and whose correct port is 2-4 ulp away (parity/NUMERICS.md, measured across hosts)
has a ratio of 3-7, so a floor is needed; a fixed number per dtype (the old fp32 1e-9) is far
below one ulp of a tensor of scale 10 and far above one of scale 1e-6. The floor is therefore in
ulps of the tensor's own arithmetic at the reference's scale::
    floor(rel_l2)  = budget_ulps * eps_acc
    floor(max_abs) = max(budget_ulps * eps_acc * M, ulp_T(M))          M = max |reference|

``eps_acc`` is the machine epsilon of the arithmetic a correct kernel does for dtype ``T``: fp32
(2^-23) for fp32, fp16 and bf16 tensors (16-bit kernels accumulate in fp32), fp64 (2^-52) for fp64.
``budget_ulps`` = 64: correct fp32 kernels differ from one another by many more ulps than their
rounding alone suggests where a reduction cancels (a score that is a 256-term dot product of
unit-scale values but close to 0; an LSE near 0): measured on the H200, a one-element fp32 LSE
(D=256, one visible key) was 1.5e-6 from fp64 as the cuBLAS reference computed it and 8.3e-6 as
the compiled Triton kernel did: 45 ulps beyond 2x the capture host's, 1.9e-7 absolute where the
LSE was 0.023 (the fp32 corpus comparison in golden/README.md). 64 ulps covers that with a factor
1.4; an 8-ulp floor (what the 0.4-4 ulp differences of parity/NUMERICS.md suggested) did not. ``ulp_T(M)`` is the spacing of ``T``
at the reference's largest magnitude: two correct hosts may round the same value to neighbouring
``T`` numbers, one ulp apart. The storage rounding of the output dtype needs no ``rel_l2`` term:
under round-to-nearest the golden's own error is at least the error of storing the reference in
``T``, so ``k x capture`` (k = 2) already covers a correct host whose values round the other way.
For bf16 and fp16 the floor is therefore negligible next to ``k x capture`` (whose golden error is
dominated by the 16-bit rounding) and does not blunt the rule: a 1% fault in a bf16 model whose
capture host is 4.9e-3 from fp64 still exceeds 2 x 4.9e-3. ``budget_floor`` (default 0) adds a
fixed amount in the units of each quantity on top, for users who need one.

What the budget can resolve: a fault adds its own error ``f`` to a host's error roughly in
quadrature, so with k = 2 it is caught once ``f`` exceeds about ``sqrt(k^2 - 1) = 1.7`` times the
capture host's own error at that tensor.

Built-in defaults and the numbers behind them. Sources: "op" = the cross-host measurements in
parity/NUMERICS.md (Triton in the CPU interpreter against an H200 SDPA golden, causal attention
B=2 H=4 S=1000 D=64). "decoder" = parity's own ``decoder`` subject (4 layers, unit-scale
weights, activations of RMS 0.3-1.8), its ``reference`` against its ``triton`` implementation
on the CPU, seeds 0-2, every recorded module (measured 2026-12-02, torch 2.13, Triton 3.9).
"bugs" = bf16 attention with a real bug against its fp32-computed golden (B=1 H=4 S=512 D=64,
64-blocks, and the op shapes above): a dropped key block, a 10% softmax-scale error, a zeroed
output row, the last partial key block dropped, 32 rows of one head scaled by 0.9.

======  =====================  ==========  ================================================
dtype   field                  default     number behind it
======  =====================  ==========  ================================================
bf16    max_rel_l2             2.5e-2      op 9.8e-4 (25x headroom); decoder's worst layer
                                           1.3e-2 (mlp.down_proj of the last layer, 1.9x),
                                           logits 9.6e-3 (parity/NUMERICS.md: 5e-3..1e-2). Bugs:
                                           dropped key block 5.2e-2..1.4e-1, scale error
                                           1.1e-1..1.3e-1
bf16    min_cosine             0.9997      ~ 1 - max_rel_l2**2 / 2, the cosine an error of
                                           that size gives (op: 1 - 5e-7; decoder worst:
                                           1 - 8.6e-5). Cosine is blind to scale errors
                                           (1.1 * ref has cosine 1): rel_l2 binds
bf16    rtol                   1.6e-2      torch.testing's bf16 rtol: 2 bf16 ULPs
bf16    atol_rms               0.1         4 x max_rel_l2: benign error tails reach 2-6x a
                                           layer's own rel_l2 in units of its RMS. Needed
                                           for no mismatch: decoder worst 6.3e-2, attention
                                           computed entirely in bf16 vs fp32 7.6e-2
bf16    atol                   1e-5        torch.testing's; matters only for tensors that
                                           are zero or nearly so (the RMS term is 0 there)
bf16    max_mismatch_fraction  5e-5        benign: 0 in every case above. Bugs that only
                                           this check catches (rel_l2 under the limit):
                                           zeroed row 1.1e-4..4.7e-4, last partial key
                                           block dropped 3.2e-3, 32 rows x 0.9 9.4e-4
fp16    max_rel_l2             3e-3        op 1.2e-4 (25x); decoder worst 1.6e-3 (1.8x)
fp16    min_cosine             0.999995    ~ 1 - max_rel_l2**2 / 2 (decoder: 1 - 1.4e-6)
fp16    rtol                   2e-3        2 fp16 ULPs, as torch's bf16 rtol is 2 bf16 ULPs
                                           (torch's fp16 1e-3 is one ULP)
fp16    atol_rms               1.2e-2      4 x max_rel_l2; decoder needs 8.6e-3
fp16    atol                   1e-5        torch.testing's
fp16    max_mismatch_fraction  5e-5        as bf16
fp32    max_rel_l2             2e-5        op 5.2e-7 (38x), with IEEE fp32 dots; decoder
                                           7.4e-7 on one CPU. TF32 on one side gives
                                           ~1e-4..1e-3 and fails, as it should: it is a
                                           platform difference, recorded in the fingerprint
fp32    min_cosine             1 - 2e-10   = 1 - max_rel_l2**2 / 2
fp32    rtol, atol             1.3e-6,     torch.testing's fp32 defaults; op max abs 1.4e-6
                               1e-5        (7x); the decoder passes on atol alone
fp32    atol_rms               8e-5        4 x max_rel_l2
fp32    max_mismatch_fraction  5e-5        as bf16
fp64    max_rel_l2             1e-13       two fp64 online-softmax orders differ by 3.3e-16
                                           (300x). fp64 is a reference dtype: any real bug
                                           is 1e9 above
fp64    min_cosine             1 - 1e-14   the resolution of a float64 cosine; rel_l2 binds
fp64    rtol, atol, atol_rms   1e-13,      max abs between those two orders: 7.2e-16
                               1e-13, 4e-13
integer exact                  0           ints and bool must be equal: atol = rtol = 0,
                                           max_mismatch_fraction 0, min_cosine 1, rel_l2 0
other   exact                  0           other dtypes (fp8, ...) have no calibrated
                                           default: exact until a config sets one
all     nan_policy             positions   NaN/Inf must appear at the same positions
all     max_abs, max_ulp       unchecked   scale-dependent; ULP distances between two
                                           accumulation orders reach 3e4 near zero
all     outlier_factor         4           benign errors stay inside their bound in every
                                           case above (0 mismatches); 4x the bound is an
                                           error no rounding tail reaches. Faults: one
                                           element x100 in 4M (bf16): ~60x its bound
float   budget_k               2.0         flash-attention's rule (parity/NUMERICS.md); checked
                                           wherever the bundle has a reference
float   budget_ulps            64          see "The error budget's floor" above
float   budget_floor           0           an extra fixed floor, off by default
bf16    max_bias               2.5e-3      benign |bias| (error projected on the reference,
                                           vs the golden) at most 8.4e-4 (fault matrix, a
                                           bf16 TP=4 all-reduce port), 6.3e-4 cross-host
                                           (CPU corpus on the H200), 3.7e-4 (decoder golden
                                           on the CPU): 3x headroom. Faults: one block x1.005
                                           5.7e-3, x1.01 9.7e-3, a dropped bias 3.5e-2
fp16    max_bias               5e-4        benign at most 1.0e-4 (TP=4 port), 5.2e-5 cross-
                                           host: 5x. Faults: x1.002 2.0e-3, x1.005 5.0e-3
fp32    max_bias               1e-6        benign at most 1.3e-7 on tensors of >= 16
                                           elements (8.3e-6 on one-element LSEs, which the
                                           significance keeps from failing). x1.002: 2.0e-3
fp64    max_bias               unchecked   |bias| <= rel_l2, and max_rel_l2 is 1e-13
float   bias_z                 4           a bias also fails only this many standard errors
                                           from 0 (a tensor under 16 elements never does);
                                           benign |z| reaches 15, but only at magnitudes
                                           10-100x under max_bias; faults: z 9-52
======  =====================  ==========  ================================================

What the defaults do not catch: an error as small as the benign ones, e.g. 40 rows of one head
scaled by 1.05 (rel_l2 4.2e-3, element errors within 7e-2 RMS), or a bf16 output scaled by 1.002
(it tips only some elements over a rounding boundary: bias 1.2e-4, under benign ports' 8.4e-4). Layers whose benign error is far
below the default (a single op) can be held tighter with a ``[[layers]]`` entry.

Config file (``parity.toml``, or the same tables under ``[tool.parity]`` in ``pyproject.toml``)::
    [defaults]                  # fields here apply to every dtype
    nan_policy = "positions"

    [defaults.bf16]             # then per-dtype changes to the built-in defaults
    min_cosine = 0.9999         # dtype names: bf16 fp16 fp32 fp64 integer other
    atol = 3e-2                 # (bfloat16, float16, half, float32, float, float64 and
                                # double are accepted as aliases)

    [budget]                    # the error budget, the same as budget_k / budget_ulps /
    k = 2.0                     # budget_floor in [defaults]; k = "off" judges by the
    ulps = 64                   # thresholds alone

    [[layers]]                  # ordered glob overrides (fnmatch, case-sensitive, "*"
    match = "model.layers.3.*"  # also matches dots); every matching entry applies in
    max_rel_l2 = 3e-2           # order, so later entries win
    reason = "deepest layer: error grows with depth"

    trust = ["mypkg.subjects:make_subject"]   # user subjects compare may build from a bundle
    strict_structure = false    # true: a recorded module this host never ran is a failure
                                # (missing-here), not "fused here"; so is an output a module
                                # call that ran here returned as None, not "absent here"

Fields: ``atol atol_rms rtol max_mismatch_fraction outlier_factor min_cosine max_abs max_rel_l2
max_ulp nan_policy budget_k budget_ulps budget_floor max_bias bias_z``. Precedence, lowest first: built-in
default of the dtype, ``[budget]`` and the fields of ``[defaults]``, ``[defaults.<dtype>]``, then
each matching ``[[layers]]``. ``max_abs``, ``max_ulp``, ``outlier_factor``, ``budget_k`` and
``max_bias`` accept ``"off"`` to unset them. Unknown keys, wrong types, out-of-range or non-finite values and
unknown dtype names raise ``UsageError`` naming the file and the key.
"""
from __future__ import annotations

import fnmatch
import math
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from collections.abc import Iterable
from typing import Any, Mapping

import torch

from parity.base import dtypes
from parity.base.errors import UsageError, check_readable_file
from parity.base.numbers import format_number, round_up
from parity.base.text import printable
from parity.judge.metrics import json_value

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        tomllib = None

NAN_POLICIES = ("positions", "ignore")
DTYPE_CLASSES = ("bf16", "fp16", "fp32", "fp64", "integer", "other")
_OFF = "off"


# ---------------------------------------------------------------------------------------------
# Tolerance


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if math.isnan(value):
        raise ValueError("expected a number, got nan")
    return value


def _nonnegative(value: Any, *, finite: bool = True) -> float:
    value = _number(value)
    if value < 0:
        raise ValueError(f"must be >= 0, got {value!r}")
    if finite and math.isinf(value):
        raise ValueError(f"must be finite, got {value!r}")
    return value


def _fraction(value: Any) -> float:
    value = _nonnegative(value)
    if value > 1:
        raise ValueError(f"is a fraction of elements, must be <= 1, got {value!r}")
    return value


def _cosine(value: Any) -> float:
    value = _number(value)
    if not -1.0 <= value <= 1.0:
        raise ValueError(f"must be between -1 and 1, got {value!r}")
    return value


def _optional(check):
    def optional_check(value: Any):
        if value is None or value == _OFF:
            return None
        return check(value)

    return optional_check


def _at_least_one(value: Any) -> float:
    value = _nonnegative(value)
    if value < 1:
        raise ValueError(f"must be >= 1 (a multiple of the tolerance bound), got {value!r}")
    return value


def _ulp_count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer number of ULPs, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"must be >= 0, got {value!r}")
    return value


def _nan_policy(value: Any) -> str:
    if value not in NAN_POLICIES:
        raise ValueError(f"must be one of {', '.join(map(repr, NAN_POLICIES))}, got {value!r}")
    return value


_FIELD_CHECKS = {
    "atol": _nonnegative,
    "atol_rms": _nonnegative,
    "rtol": _nonnegative,
    "max_mismatch_fraction": _fraction,
    "min_cosine": _cosine,
    "outlier_factor": _optional(_at_least_one),
    "max_abs": _optional(lambda v: _nonnegative(v, finite=False)),
    "max_rel_l2": lambda v: _nonnegative(v, finite=False),
    "max_ulp": _optional(_ulp_count),
    "nan_policy": _nan_policy,
    "budget_k": _optional(_nonnegative),
    "budget_ulps": _nonnegative,
    "budget_floor": _nonnegative,
    "max_bias": _optional(_nonnegative),
    "bias_z": _nonnegative,
}


@dataclass(frozen=True)
class Tolerance:
    """What one layer must satisfy; see the module docstring for each field's check."""

    atol: float
    rtol: float
    max_mismatch_fraction: float
    min_cosine: float
    max_rel_l2: float
    atol_rms: float = 0.0
    max_abs: float | None = None
    max_ulp: int | None = None
    nan_policy: str = "positions"
    budget_k: float | None = None
    budget_floor: float = 0.0
    outlier_factor: float | None = None
    budget_ulps: float = 64.0
    max_bias: float | None = None
    bias_z: float = 0.0

    def __post_init__(self):
        for name, check in _FIELD_CHECKS.items():
            try:
                object.__setattr__(self, name, check(getattr(self, name)))
            except ValueError as err:
                raise ValueError(f"Tolerance.{name}: {err}") from None

    def to_dict(self) -> dict:
        return {f.name: json_value(getattr(self, f.name)) for f in fields(self)}


TOLERANCE_FIELDS = tuple(f.name for f in fields(Tolerance))

_EXACT = Tolerance(atol=0.0, rtol=0.0, max_mismatch_fraction=0.0, min_cosine=1.0, max_rel_l2=0.0)
# An element this many times beyond its own bound fails the tensor (module docstring).
DEFAULT_OUTLIER_FACTOR = 4.0
# The flash-attention rule (parity/NUMERICS.md): at most twice the capture host's own error.
DEFAULT_BUDGET_K = 2.0
# A bias fails only this many standard errors away from 0 (module docstring): a tensor of fewer
# than BIAS_Z**2 elements can never reach it, so a small tensor's chance bias never fails.
DEFAULT_BIAS_Z = 4.0

# The numbers behind each value are in the module docstring's table.
DEFAULT_TOLERANCES: Mapping[str, Tolerance] = MappingProxyType({
    "bf16": Tolerance(atol=1e-5, atol_rms=0.1, rtol=1.6e-2, max_mismatch_fraction=5e-5,
                      min_cosine=0.9997, max_rel_l2=2.5e-2, budget_k=DEFAULT_BUDGET_K,
                      outlier_factor=DEFAULT_OUTLIER_FACTOR,
                      max_bias=2.5e-3, bias_z=DEFAULT_BIAS_Z),
    "fp16": Tolerance(atol=1e-5, atol_rms=1.2e-2, rtol=2e-3, max_mismatch_fraction=5e-5,
                      min_cosine=0.999995, max_rel_l2=3e-3, budget_k=DEFAULT_BUDGET_K,
                      outlier_factor=DEFAULT_OUTLIER_FACTOR,
                      max_bias=5e-4, bias_z=DEFAULT_BIAS_Z),
    "fp32": Tolerance(atol=1e-5, atol_rms=8e-5, rtol=1.3e-6, max_mismatch_fraction=5e-5,
                      min_cosine=1 - 2e-10, max_rel_l2=2e-5, budget_k=DEFAULT_BUDGET_K,
                      outlier_factor=DEFAULT_OUTLIER_FACTOR,
                      max_bias=1e-6, bias_z=DEFAULT_BIAS_Z),
    "fp64": Tolerance(atol=1e-13, atol_rms=4e-13, rtol=1e-13, max_mismatch_fraction=5e-5,
                      min_cosine=1 - 1e-14, max_rel_l2=1e-13, budget_k=DEFAULT_BUDGET_K,
                      outlier_factor=DEFAULT_OUTLIER_FACTOR),
    "integer": _EXACT,
    "other": _EXACT,
})


def dtype_class(dtype: torch.dtype | str) -> str:
    """The policy's name for a dtype: bf16, fp16, fp32, fp64, integer (ints and bool) or other.

    Accepts a ``torch.dtype`` or its name (``"bfloat16"``, ``"torch.bfloat16"``, ``"bf16"``).
    """
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name in DTYPE_CLASSES:
            return name
        short = dtypes.lookup(name)
        if short is not None:
            return short
        resolved = getattr(torch, name, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        dtype = resolved
    short = dtypes.lookup(dtype)
    if short is not None:
        return short
    if dtype.is_floating_point or dtype.is_complex:
        return "other"
    return "integer"


# ---------------------------------------------------------------------------------------------
# Policy


@dataclass(frozen=True)
class LayerOverride:
    """Changes to the tolerance of every layer whose name matches the glob ``match``."""

    match: str
    changes: Mapping[str, Any]
    reason: str | None = None

    def __post_init__(self):
        unknown = set(self.changes) - set(TOLERANCE_FIELDS)
        if unknown:
            raise ValueError(f"LayerOverride: unknown tolerance fields {sorted(unknown)}")
        object.__setattr__(self, "changes", MappingProxyType(dict(self.changes)))

    def matches(self, layer_name: str) -> bool:
        return fnmatch.fnmatchcase(layer_name, self.match)


@dataclass(frozen=True)
class Policy:
    """Per-dtype tolerances plus ordered per-layer glob overrides (later overrides win)."""

    dtype_defaults: Mapping[str, Tolerance] = field(default_factory=lambda: DEFAULT_TOLERANCES)
    overrides: tuple[LayerOverride, ...] = ()
    source: str = "built-in defaults"
    # User subject specs (``package.module:factory``) that compare may build from a bundle's
    # manifest without naming them on the command line (top-level ``trust = [...]``).
    trusted_subjects: tuple[str, ...] = ()
    # Report a recorded module that this host never ran, inside a compared enclosing module,
    # as a failure (``missing-here``) instead of ``fused-here``, and a recorded output that a
    # module call which ran here returned as None instead of ``absent-here`` (top-level
    # ``strict_structure``).
    strict_structure: bool = False

    def __post_init__(self):
        missing = set(DTYPE_CLASSES) - set(self.dtype_defaults)
        if missing:
            raise ValueError(f"Policy: no tolerance for dtype classes {sorted(missing)}")
        object.__setattr__(self, "dtype_defaults", MappingProxyType(dict(self.dtype_defaults)))
        object.__setattr__(self, "overrides", tuple(self.overrides))
        object.__setattr__(self, "trusted_subjects", tuple(self.trusted_subjects))

    def resolve(self, layer_name: str, dtype: torch.dtype | str) -> Tolerance:
        tolerance = self.dtype_defaults[dtype_class(dtype)]
        for override in self.overrides:
            if override.matches(layer_name):
                tolerance = replace(tolerance, **override.changes)
        return tolerance

    def to_dict(self) -> dict:
        """JSON-safe description, for recording the policy a report was judged under."""
        return {
            "source": self.source,
            "trusted_subjects": list(self.trusted_subjects),
            "strict_structure": self.strict_structure,
            "defaults": {name: tol.to_dict() for name, tol in self.dtype_defaults.items()},
            "layers": [
                {"match": o.match, **{k: json_value(v) for k, v in o.changes.items()},
                 **({"reason": o.reason} if o.reason else {})}
                for o in self.overrides
            ],
        }

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str, *, key_prefix: str = "") -> "Policy":
        """A policy from parsed TOML tables; errors are ``UsageError`` naming ``source`` and the key."""
        return _PolicyReader(source, key_prefix).read(data)

    @classmethod
    def from_toml(cls, path: str | os.PathLike) -> "Policy":
        """A policy from a ``parity.toml``-style file (the schema is in the module docstring)."""
        return cls.from_mapping(_read_toml(path), source=os.fspath(path))

    @classmethod
    def from_pyproject(cls, path: str | os.PathLike) -> "Policy":
        """A policy from the ``[tool.parity]`` table of a ``pyproject.toml``."""
        tool = _read_toml(path).get("tool", {})
        table = tool.get("parity") if isinstance(tool, dict) else None
        if table is None:
            raise UsageError(f"{os.fspath(path)}: tool.parity: no [tool.parity] table")
        if not isinstance(table, dict):
            raise UsageError(f"{os.fspath(path)}: tool.parity: expected a table")
        return cls.from_mapping(table, source=os.fspath(path), key_prefix="tool.parity.")


def load_policy(path: str | os.PathLike) -> Policy:
    """``Policy.from_pyproject`` for a file named ``pyproject.toml``, ``Policy.from_toml`` otherwise."""
    if os.path.basename(os.fspath(path)) == "pyproject.toml":
        return Policy.from_pyproject(path)
    return Policy.from_toml(path)


def as_policy(policy: "Policy | str | os.PathLike | None" = None, *,
              rootdir: str | os.PathLike | None = None) -> Policy:
    """The one way a policy is resolved: a ``Policy`` as is; a path: that tolerance file (checked
    to be a readable regular file first: a FIFO would block forever); None: ``[tool.parity]`` of
    ``rootdir/pyproject.toml`` when ``rootdir`` is given and the file has that table, else the
    built-in defaults. UsageError for a bad file or a value of another type."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, (str, os.PathLike)):
        check_readable_file(policy, "tolerance file")
        return load_policy(policy)
    if policy is not None:
        raise UsageError(f"a parity policy is a parity.judge.policy.Policy or a TOML path, got {type(policy).__name__}")
    if rootdir is None:
        return Policy()
    pyproject = Path(rootdir) / "pyproject.toml"
    if not pyproject.is_file():
        return Policy()
    if tomllib is None:
        return Policy()
    try:
        data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise UsageError(f"{pyproject}: invalid TOML (read for [tool.parity]): {' '.join(str(err).split())}") from None
    tool = data.get("tool")
    if isinstance(tool, dict) and "parity" in tool:
        return Policy.from_pyproject(pyproject)
    return Policy()


def policy_file(tolerances: str | os.PathLike | None, *, cwd: str | os.PathLike | None = None) -> Path | None:
    """The file the CLI's policy is read from: ``--tolerances``, else ``./pyproject.toml`` if any."""
    if tolerances is not None:
        return Path(tolerances)
    pyproject = Path(cwd or os.getcwd()) / "pyproject.toml"
    return pyproject if pyproject.is_file() else None


def refuse_policy_inside(policy_path: Path | None, bundle_dir: str | os.PathLike) -> None:
    """A bundle cannot set its own tolerances or trust: UsageError for a policy file inside it."""
    root = Path(bundle_dir).resolve()
    if policy_path is not None and (policy_path.resolve() == root or root in policy_path.resolve().parents):
        raise UsageError(f"tolerance file {printable(str(policy_path))} is inside the bundle directory "
                         f"{printable(str(bundle_dir))}; a bundle cannot set its own tolerances or trust "
                         "(keep tolerance files outside bundles; run from another directory)")


def policy_for_cli(tolerances: str | os.PathLike | None, *, cwd: str | os.PathLike | None = None,
                   bundles: Iterable[str | os.PathLike] = (), strict_structure: bool = False) -> Policy:
    """The command line's policy, resolved once: ``--tolerances FILE`` if given, else
    ``[tool.parity]`` of ``./pyproject.toml`` if it has one, else the built-in defaults (the
    pytest plugin's ``--parity-tolerances`` means the same). The file is refused first if it lies
    inside one of ``bundles`` (:func:`refuse_policy_inside`); ``strict_structure`` is the flag of
    the same name."""
    for bundle in bundles:
        refuse_policy_inside(policy_file(tolerances, cwd=cwd), bundle)
    if tolerances is not None:
        policy = load_policy(tolerances)
    else:
        policy = as_policy(None, rootdir=cwd or os.getcwd())
    return replace(policy, strict_structure=True) if strict_structure else policy


def _read_toml(path: str | os.PathLike) -> dict:
    name = os.fspath(path)
    if tomllib is None:
        raise UsageError(f"{name}: reading TOML needs Python >= 3.11 or the 'tomli' package")
    try:
        with open(name, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise UsageError(f"{name}: policy file not found") from None
    except IsADirectoryError:
        raise UsageError(f"{name}: is a directory, not a policy file") from None
    except tomllib.TOMLDecodeError as err:
        raise UsageError(f"{name}: invalid TOML: {err}") from None
    except UnicodeDecodeError as err:
        raise UsageError(f"{name}: not UTF-8 text: {err}") from None


class _PolicyReader:
    """Validates parsed TOML tables, naming the file and the full key of the first problem."""

    def __init__(self, source: str, key_prefix: str):
        self.source = source
        self.key_prefix = key_prefix

    def fail(self, key: str, problem: str) -> UsageError:
        return UsageError(f"{self.source}: {self.key_prefix}{key}: {problem}")

    def table(self, value: Any, key: str) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(key, f"expected a table, got {type(value).__name__}")
        return value

    def tolerance_changes(self, table: Mapping[str, Any], key: str, *, ignore=()) -> dict[str, Any]:
        changes = {}
        for name, value in table.items():
            if name in ignore:
                continue
            if name not in _FIELD_CHECKS:
                fields_list = ", ".join(TOLERANCE_FIELDS)
                raise self.fail(f"{key}.{name}", f"unknown key (tolerance fields: {fields_list})")
            try:
                changes[name] = _FIELD_CHECKS[name](value)
            except ValueError as err:
                raise self.fail(f"{key}.{name}", str(err)) from None
            if isinstance(value, float) and not math.isfinite(value):
                # An infinite limit in a file is a check silently switched off; say "off" instead.
                raise self.fail(f"{key}.{name}", f"must be finite, got {value!r} (use \"off\" where a check "
                                "can be turned off: max_abs, max_ulp, outlier_factor, budget_k, max_bias)")
        return changes

    def read(self, data: Mapping[str, Any]) -> Policy:
        unknown = set(data) - {"defaults", "budget", "layers", "trust", "strict_structure"}
        if unknown:
            raise self.fail(sorted(unknown)[0],
                            "unknown key (expected defaults, budget, layers, trust, strict_structure)")
        trusted = data.get("trust", [])
        if not isinstance(trusted, list) or not all(isinstance(spec, str) and ":" in spec for spec in trusted):
            raise self.fail("trust", "expected an array of subject specs (\"package.module:factory\")")
        strict_structure = data.get("strict_structure", False)
        if not isinstance(strict_structure, bool):
            raise self.fail("strict_structure", f"expected true or false, got {type(strict_structure).__name__}")

        all_dtypes: dict[str, Any] = {}
        per_dtype: dict[str, dict[str, Any]] = {}
        if "budget" in data:
            all_dtypes.update(self.read_budget(self.table(data["budget"], "budget")))
        defaults = self.table(data.get("defaults", {}), "defaults")
        for name, value in defaults.items():
            canonical = dtypes.lookup(name) or name
            if canonical in DTYPE_CLASSES and not isinstance(value, dict):
                got = type(value).__name__
                raise self.fail(f"defaults.{name}", f"expected a table ([defaults.{name}]), got {got}")
            if isinstance(value, dict):
                if canonical not in DTYPE_CLASSES:
                    expected = ", ".join(DTYPE_CLASSES)
                    raise self.fail(f"defaults.{name}", f"unknown dtype (expected one of {expected})")
                if canonical in per_dtype:
                    raise self.fail(f"defaults.{name}", f"given twice (as {canonical} and an alias)")
                per_dtype[canonical] = self.tolerance_changes(value, f"defaults.{name}")
            else:
                field_change = self.tolerance_changes({name: value}, "defaults")
                if name in all_dtypes:
                    raise self.fail(f"defaults.{name}", "also set in [budget]")
                all_dtypes.update(field_change)

        # Every value was checked on its own above and no check spans two fields, so
        # replace() cannot fail here.
        dtype_defaults = {
            dtype_name: replace(builtin, **{**all_dtypes, **per_dtype.get(dtype_name, {})})
            for dtype_name, builtin in DEFAULT_TOLERANCES.items()
        }

        layers = data.get("layers", [])
        if not isinstance(layers, list):
            raise self.fail("layers", "expected an array of tables ([[layers]])")
        overrides = tuple(self.read_layer(entry, f"layers[{i}]") for i, entry in enumerate(layers))
        return Policy(dtype_defaults=dtype_defaults, overrides=overrides, source=self.source,
                      trusted_subjects=tuple(trusted), strict_structure=strict_structure)

    def read_budget(self, table: Mapping[str, Any]) -> dict[str, Any]:
        changes = {}
        for name, value in table.items():
            if name not in ("k", "ulps", "floor"):
                raise self.fail(f"budget.{name}", "unknown key (expected k, ulps, floor)")
            try:
                changes[f"budget_{name}"] = _FIELD_CHECKS[f"budget_{name}"](value)
            except ValueError as err:
                raise self.fail(f"budget.{name}", str(err)) from None
        return changes

    def read_layer(self, entry: Any, key: str) -> LayerOverride:
        entry = self.table(entry, key)
        pattern = entry.get("match")
        if not isinstance(pattern, str) or not pattern:
            raise self.fail(f"{key}.match", "required: a non-empty glob string naming layers")
        reason = entry.get("reason")
        if reason is not None and not isinstance(reason, str):
            raise self.fail(f"{key}.reason", f"expected a string, got {type(reason).__name__}")
        changes = self.tolerance_changes(entry, key, ignore=("match", "reason"))
        return LayerOverride(match=pattern, changes=changes, reason=reason)


def accepts_override(key: str, value: Any) -> bool:
    """Whether ``key = value`` is accepted in a ``[[layers]]`` entry of a tolerance file (the
    loader's own checks: an infinite limit never is, it is a check switched off)."""
    try:
        _PolicyReader("would pass with", "").read_layer({"match": "*", key: value}, "layers[0]")
    except (UsageError, ValueError, TypeError):
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Would pass with: the smallest values of a tolerance file that pass a failed tensor

# Any one of these relaxes the mismatch check as well as max_mismatch_fraction does.
MISMATCH_ALTERNATIVES = ("atol", "atol_rms", "rtol")


def passing_value(key: str, needed: Any) -> str:
    """The value to write in a tolerance file for a failed check (see the module docstring)."""
    if key in ("missing", "shape", "dtype", "replay"):
        return str(needed)
    if key == "nan_policy":
        return f'"{needed}"'
    if key == "max_ulp":
        return str(int(needed))
    value = float(needed)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf"
    if key == "min_cosine":
        gap = 1.0 - value
        return repr(1.0 - round_up(gap)) if 0 < gap < 1 else repr(value)
    return format_number(round_up(value))



def _loadable(key: str, text: str) -> bool:
    """Whether ``key = text`` is a value the policy loader accepts in a ``[[layers]]`` entry
    (``inf`` and ``nan`` never are: an infinite limit is a check switched off)."""
    try:
        value = tomllib.loads(f"value = {text}")["value"]
    except (tomllib.TOMLDecodeError, ValueError):
        return False
    return accepts_override(key, value)


def loadable_passing_value(key: str, needed: Any) -> str | None:
    """:func:`passing_value` where the loader accepts it; None where no value of ``key`` passes."""
    text = passing_value(key, needed)
    return text if _loadable(key, text) else None


def unrelaxable_from_checks(checks: Mapping[str, Any]) -> list[str]:
    """The keys of ``checks`` (a result's failed checks) that no value in a tolerance file relaxes
    enough (the value that would pass is infinite or not a number: a rel L2 against an all-zero
    golden, say)."""
    return [key for key, needed in checks.items()
            if key not in ("missing", "shape", "replay", "dtype") and loadable_passing_value(key, needed) is None]


def would_pass_from_checks(checks: Mapping[str, Any]) -> str | None:
    """The suggestion of :func:`would_pass_text` from a result's ``failed_checks`` (live or read
    back from the JSON, where non-finite values are strings).

    Only values the policy loader accepts are proposed: a mismatch alternative that would need an
    infinite value is named as one that cannot relax the check; any other check that only an
    infinite value would pass means no tolerance passes."""
    checks = {key: float(value) if isinstance(value, str) and value in ("nan", "inf", "-inf") else value
              for key, value in checks.items()}
    if any(key in checks for key in ("missing", "shape", "replay")):
        return None
    parts = []
    mismatch, cannot = [], []
    for key in ("max_mismatch_fraction",) + MISMATCH_ALTERNATIVES:
        if key in checks:
            value = loadable_passing_value(key, checks[key])
            if value is None:
                cannot.append(key)
            else:
                mismatch.append(f"{key} = {value}")
    for key, needed in checks.items():
        if key in ("dtype",) or key in MISMATCH_ALTERNATIVES:
            continue
        if key == "max_mismatch_fraction":
            if not mismatch:
                return None
            parts.append("(mismatch, any one of) " + " or ".join(mismatch)
                         + (f" ({' and '.join(cannot)} cannot relax it: no finite value passes)" if cannot else ""))
        else:
            value = loadable_passing_value(key, needed)
            if value is None:
                return None
            parts.append(f"{key} = {value}")
    return ", ".join(parts) if parts else None
