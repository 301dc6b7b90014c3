"""Report files: checked before a long run, and written whole or not at all.

Every report parity writes (JSON, JUnit XML, Markdown, HTML, the show and benchmark documents,
the plugin's report) goes through :func:`write_atomically`: a new temporary file in the target's
directory (created with the user's umask), flushed and fsynced, then renamed over the target. A
crash or a full disk leaves the old file or no file, never half of one. Bundles have their own,
stronger protocol (``parity.bundle``).
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path

from parity.base.errors import UsageError


def check_writable(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a Path; UsageError (``what`` names the flag) if it is a directory or its
    directory does not exist. Call it before a long run, so a typo fails at once."""
    file = Path(path)
    if file.is_dir():
        raise UsageError(f"{what} {file} is a directory; give a file name")
    if not file.parent.is_dir():
        raise UsageError(f"{what} {file}: directory {file.parent} does not exist")
    return file


def write_atomically(path: str | os.PathLike, text: str, what: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all; UsageError naming ``what`` if it
    cannot be written. Returns the path written."""
    file = check_writable(path, what)
    temporary = file.parent / f".{file.name}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as err:
        raise UsageError(f"{what} {file}: cannot write: {err.strerror or err}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, file)
    except BaseException as err:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        if isinstance(err, OSError):
            raise UsageError(f"{what} {file}: cannot write: {err.strerror or err}") from None
        raise
    return file


__all__ = ["check_writable", "write_atomically"]
