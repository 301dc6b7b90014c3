"""Text that came from a bundle or a user, made safe to print: one line, no control characters.

Layer names, file names and subject specs in a manifest are data written by someone else. Printed
raw they could carry terminal escape codes (recolour, move the cursor, forge a verdict line) or
newlines that fake extra report lines, so every such string goes through :func:`printable`.
"""
from __future__ import annotations

import unicodedata

_MAX_LENGTH = 300


def printable(value: object, *, limit: int = _MAX_LENGTH) -> str:
    """``value`` as text with control and format characters escaped (``\\x1b``, ``\\n``,
    ``\\u202e``) and cut to ``limit`` characters (the rest counted, never silently dropped)."""
    text = value if isinstance(value, str) else str(value)
    out = []
    for char in text:
        if char == "\\":
            out.append("\\\\")
        elif unicodedata.category(char) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"):
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(char)
    escaped = "".join(out)
    if len(escaped) > limit:
        escaped = f"{escaped[:limit]}... ({len(escaped) - limit} more characters)"
    return escaped
