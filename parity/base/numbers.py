"""Numbers as every report and every verdict reason writes them: one formatter for the harness.

Reports (tables, Markdown, HTML, the plugin's lines) write compact numbers with two significant
digits (:func:`format_number`: ``3.1e-3``, ``0`` for exactly zero) and cosines as the gap to 1 at
or above :data:`COSINE_NEAR_ONE` (:func:`format_cosine`: ``1-2.0e-6``). A verdict's reasons
compare an observed value with its limit, so they print both with just enough digits that a
failing pair never reads as equal (:func:`number_pair`, :func:`cosine_pair`), and a tolerance the
user typed as typed (:func:`format_plain`). "Would pass with" values are rounded away from failing
(:func:`round_up`). Imports only :mod:`parity.base.dtypes`.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from parity.base import dtypes

# At or above, a cosine is written 1-x: the gap to 1 is what tells fp32 cosines apart.
COSINE_NEAR_ONE = 0.999


def scientific(value: float, digits: int = 1, style: str = "e") -> str:
    """``value`` with ``digits`` digits after the point, ``3.1e-2`` (not ``3.1e-02``); style
    ``"g"`` gives ``digits + 4`` significant digits as a decimal. ``nan``/``inf`` as Python writes them."""
    if style == "g":
        return f"{value:.{digits + 4}g}"
    text = f"{value:.{digits}e}"
    mantissa, _, exponent = text.partition("e")
    return f"{mantissa}e{int(exponent)}" if exponent else text


def format_number(value: float | None, digits: int = 2) -> str:
    """``3.1e-3`` (``digits`` significant), ``0`` for exactly zero, ``inf``/``nan``, ``-`` for None."""
    if value is None:
        return "-"
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0:
        return "0"
    return scientific(value, digits - 1)


def format_ratio(ratio: float | None) -> str:
    """A factor: ``7.3x`` (three significant digits) from 0.01 to 1000, else ``2.1e4x``; never
    ``7.3e0x``."""
    if ratio is None:
        return "-"
    ratio = float(ratio)
    if math.isfinite(ratio) and 0.01 <= abs(ratio) < 1000:
        return f"{ratio:.3g}x"
    return f"{format_number(ratio)}x"


def format_cosine(value: float | None) -> str:
    """``1`` exactly, ``1-2.0e-6`` at or above 0.999, else a decimal (``0.9731``)."""
    if value is None:
        return "-"
    value = float(value)
    if math.isnan(value):
        return "nan"
    if value == 1.0:
        return "1"
    if value >= COSINE_NEAR_ONE:
        return f"1-{format_number(1.0 - value)}"
    return f"{value:.4f}"


def format_percent(fraction: float | None) -> str:
    if fraction is None:
        return "-"
    if fraction == 0:
        return "0"
    percent = 100.0 * fraction
    return f"{percent:.2g}" if percent < 100 else "100"


def format_shape(shape: Sequence[int] | None) -> str:
    if shape is None:
        return "-"
    return "x".join(str(n) for n in shape) if len(shape) else "scalar"


def format_dtype(dtype: str | None) -> str:
    if dtype is None:
        return "-"
    return dtypes.lookup(dtype) or dtype


def format_plain(value: float) -> str:
    """A tolerance the user typed, as typed: 4 not 4.0e0."""
    return f"{value:g}"


def round_up(value: float, digits: int = 2) -> float:
    """The smallest number of ``digits`` significant digits that is >= ``value``."""
    if value <= 0 or not math.isfinite(value):
        return value
    exponent = math.floor(math.log10(value)) - (digits - 1)
    scale = 10.0 ** exponent
    rounded = math.ceil(value / scale - 1e-9) * scale
    if rounded < value:  # float rounding of the scaled value
        rounded = (math.ceil(value / scale) + 1) * scale
    return float(f"{rounded:.{digits - 1}e}")


def _cosine_digits(value: float, digits: int) -> str:
    """A cosine as the table writes it, with ``digits`` digits: ``1`` exactly, ``1-2.0e-10`` at or
    above 0.999, a decimal below."""
    if not math.isfinite(value) or value == 1.0:
        return f"{value:g}"
    if value >= COSINE_NEAR_ONE:
        return f"1-{scientific(1.0 - value, digits)}"
    return scientific(value, digits, style="g")


def cosine_pair(observed: float, limit: float) -> tuple[str, str]:
    """Both cosines with just enough digits that a failing pair never prints as equal
    (``cosine 1-2.0e-8 < 1-2.0e-10``, not ``cosine 0.99999998 < 1``)."""
    for digits in range(1, 17):
        pair = _cosine_digits(observed, digits), _cosine_digits(limit, digits)
        if pair[0] != pair[1]:
            return pair
    return pair


def number_pair(observed: float, limit: float, style: str = "e") -> tuple[str, str]:
    """Both numbers with just enough digits that a failing pair never prints as equal."""
    for digits in range(1, 17):
        pair = scientific(observed, digits, style), scientific(limit, digits, style)
        if pair[0] != pair[1]:
            return pair
    return pair
