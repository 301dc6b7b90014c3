"""The one parser of ``KEY=VALUE`` options (``inspect --set``, ``capture --arg``, the benchmark's
``--config``): each bad item is a one-line UsageError naming the option, the item and the problem.

A value is converted by the converter of its key (``allowed``) or by ``convert`` when any key is
accepted. Where ``allowed`` gives a key's kind and bounds as plain data (``("int", 1, 65536)``,
``("bool",)``: how the kernel layer describes its launch fields, ``parity.kernels.configs``), the
converter is made from them (:func:`converter`). Converters take the text after ``=`` and raise ValueError with the reason; the helpers
here (``integer``, ``boolean``, ``number``, ``json_value``) also reject values that cannot be meant:
non-finite numbers and integers beyond a bound the caller gives.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from parity.base.errors import UsageError
from parity.base.text import printable

__all__ = ["Converter", "parse_overrides", "converter", "integer", "boolean", "number", "json_value"]

Converter = Callable[[str], Any]

# Beyond this many characters an item is not a typo but data; it is cut in the message.
_SHOWN_CHARS = 80
_INTEGER = re.compile(r"[+-]?\d+")


def parse_overrides(items: Iterable[str], *, flag: str, allowed: Mapping[str, Converter | tuple] | None = None,
                    convert: Converter | None = None, key_name: str = "key") -> dict[str, Any]:
    """``["block_n=64", "one_loop=1"]`` -> ``{"block_n": 64, "one_loop": True}``, in the given order.

    ``allowed``: the accepted keys and each one's converter (an unknown key is an error naming
    them); None accepts any key and converts with ``convert`` (default: the text as is). ``flag``
    names the option in messages (``--set``) and ``key_name`` what a key is (``config key``).
    UsageError for a missing ``=``, an empty or unknown or repeated key, and a value its converter
    refuses.
    """
    out: dict[str, Any] = {}
    for item in items:
        shown = _shown(item)
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep:
            raise UsageError(f"{flag} {shown} must look like KEY=VALUE")
        if not key:
            raise UsageError(f"{flag} {shown}: the {key_name} before '=' is empty")
        if allowed is not None and key not in allowed:
            raise UsageError(f"{flag} {shown}: unknown {key_name} {_shown(key)}; "
                             f"use one of {', '.join(sorted(allowed))}")
        if key in out:
            raise UsageError(f"{flag} {shown}: {key_name} {_shown(key)} is given twice")
        convert_value = converter(allowed[key]) if allowed is not None else convert
        try:
            out[key] = convert_value(text) if convert_value is not None else text
        except (ValueError, TypeError) as err:
            raise UsageError(f"{flag} {shown}: {err}") from None
    return out


def converter(field: Converter | tuple) -> Converter:
    """A key's converter: ``field`` itself, or one made from a kind and its bounds given as data:
    ``("int", minimum, maximum)`` -> :func:`integer`, ``("bool",)`` -> :func:`boolean`."""
    if callable(field):
        return field
    kind, *bounds = field
    if kind == "int":
        return integer(*bounds)
    if kind == "bool" and not bounds:
        return boolean
    raise ValueError(f"no converter for a field of kind {field!r}")


def integer(minimum: int, maximum: int) -> Converter:
    """A converter to an int in ``[minimum, maximum]`` (decimal digits only: no ``1e3``, ``inf``)."""

    def convert(text: str) -> int:
        text = text.strip()
        if not _INTEGER.fullmatch(text) or len(text) > 100:  # int() of 4300+ digits raises
            raise ValueError(f"expected an integer from {minimum} to {maximum}, got {_shown(text)}")
        value = int(text)
        if not minimum <= value <= maximum:
            raise ValueError(f"expected an integer from {minimum} to {maximum}, got {value}")
        return value

    return convert


def boolean(text: str) -> bool:
    """``1``/``true``/``yes``/``on`` -> True, ``0``/``false``/``no``/``off`` -> False (any case)."""
    word = text.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected 0 or 1 (or true/false), got {_shown(text)}")


def number(minimum: float, maximum: float) -> Converter:
    """A converter to a finite float in ``[minimum, maximum]`` (``nan``, ``inf`` are refused)."""

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {_shown(text)}") from None
        if not math.isfinite(value) or not minimum <= value <= maximum:
            raise ValueError(f"expected a finite number from {minimum:g} to {maximum:g}, got {_shown(text)}")
        return value

    return convert


def json_value(max_int: int) -> Converter:
    """A converter that parses JSON (``8``, ``[1, 2]``, ``{"a": true}``) and otherwise keeps the
    text as a string (``causal``). Refused anywhere inside: non-finite numbers (JSON's ``NaN``,
    ``Infinity``) and integers beyond ``max_int`` in magnitude (one too long to parse included)."""

    def convert(text: str) -> Any:
        try:
            value = json.loads(text)
        except ValueError:
            if _INTEGER.fullmatch(text.strip()):  # an integer too long for Python to parse
                raise ValueError(f"integer of {len(text.strip())} digits is out of range "
                                 f"(at most {max_int} in magnitude)") from None
            return text
        _check_json(value, max_int)
        return value

    return convert


def _check_json(value: Any, max_int: int) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, bool) or item is None or isinstance(item, str):
            continue
        if isinstance(item, int):
            if abs(item) > max_int:
                raise ValueError(f"integer {item} is out of range (at most {max_int} in magnitude)")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise ValueError(f"{item} is not a finite number")
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())


def _shown(text: str) -> str:
    return printable(repr(text), limit=_SHOWN_CHARS)
