"""Text that came from a bundle or a user, made safe to print: one line, no control characters.

Layer names, file names and subject specs in a manifest are data written by someone else. Printed
raw they could carry terminal escape codes (recolour, move the cursor, forge a verdict line) or
newlines that fake extra report lines, so every such string goes through :func:`printable`.
"""
from __future__ import annotations

import difflib
import unicodedata
from collections.abc import Iterable
from typing import TextIO

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


def plural(count: int, noun: str) -> str:
    """``1 tensor``, ``2 tensors``: a count and its noun, agreeing."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def write_line(stream: TextIO, line: str) -> None:
    """``line`` and its newline in one ``write`` call, then a flush. ``print`` writes the text and
    the newline separately, and on an unbuffered stream (``PYTHONUNBUFFERED``, as torchrun's
    workers often run) those are two system calls, between which another process sharing the
    stream (another rank) can write: ``...tensorsparity capture [rank 1]: ...``. One write of a
    whole line below the pipe's atomic size (4 KiB on Linux) is never interleaved."""
    stream.write(line + "\n")
    stream.flush()


def subject_name(name: object, spec: object = None) -> str:
    """What follows the word "subject" in a message, printable: the subject's name, or its spec
    where the name is missing or is the protocol's placeholder ``subject`` (a ``Subject`` subclass
    that sets no name), which would print ``subject subject``."""
    text = "" if name is None else str(name)
    if not text.strip() or text == "subject":
        text = "" if spec is None else str(spec)
    return printable(text or "?")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean X?)`` for the choice closest to a mistyped ``word`` (difflib's ratio at
    least 0.6, as Python's own NameError suggestions use), else ``""``."""
    close = difflib.get_close_matches(word, sorted(set(choices)), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""
