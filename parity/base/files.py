"""Report files: checked before a long run, and written whole or not at all.

Every report parity writes (JSON, JUnit XML, Markdown, HTML, the show and benchmark documents,
the plugin's report) goes through :func:`write_atomically`: a new temporary file in the target's
directory (created with the user's umask), flushed and fsynced, then renamed over the target. A
crash or a full disk leaves the old file or no file, never half of one. Bundles have their own,
stronger protocol (``parity.bundle``).

What is already at the target decides how it is written (:func:`disposition`): a regular file is
replaced; a character device (``/dev/null``, a terminal) or a FIFO is written through, never
replaced by a regular file; a symbolic link is followed and its target replaced (the link stays);
anything else (a directory, a socket, a block device) is refused. A path that names this
process's own standard output or error (``/dev/stdout``, ``/dev/fd/1``, whatever they are
redirected to) is written to that stream, after what it already holds.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from parity.base.errors import UsageError
from parity.base.text import printable

REPLACE, WRITE_THROUGH, REFUSE = "replace", "write through", "refuse"

_SHOWN_CHARS = 160  # of a path echoed in a message: a name too long to write is shortened


def shown(path: str | os.PathLike) -> str:
    """``path`` as a message shows it: printable, a very long one shortened."""
    return printable(os.fspath(path), limit=_SHOWN_CHARS)


def disposition(info: os.stat_result | None) -> str:
    """How a report is written where ``os.stat`` found ``info`` (None: nothing there yet):
    :data:`REPLACE` a regular file or nothing, :data:`WRITE_THROUGH` a character device or a FIFO,
    :data:`REFUSE` anything else."""
    if info is None or stat.S_ISREG(info.st_mode):
        return REPLACE
    if stat.S_ISCHR(info.st_mode) or stat.S_ISFIFO(info.st_mode):
        return WRITE_THROUGH
    return REFUSE


def _kind(info: os.stat_result) -> str:
    return "a socket" if stat.S_ISSOCK(info.st_mode) else "a block device" if stat.S_ISBLK(info.st_mode) else "a special file"


def _cannot_write(what: str, file: str | os.PathLike, err: OSError) -> UsageError:
    if err.errno == errno.ENAMETOOLONG:
        return UsageError(f"{what} {shown(file)}: file name too long")
    return UsageError(f"{what} {shown(file)}: cannot write: {err.strerror or err}")


def _stat(file: Path, what: str) -> os.stat_result | None:
    """``os.stat(file)`` (links followed), None where nothing is there yet; UsageError if the name
    itself is unusable (too long, a loop of links, no permission)."""
    try:
        return os.stat(file)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        raise _cannot_write(what, file, err) from None


def check_writable(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a Path; UsageError (``what`` names the flag) if a report could not be written
    there: a directory or another file that is neither regular, a character device nor a FIFO, a
    name too long, a directory that does not exist. Call it before a long run, so a typo fails at once."""
    file = Path(path)
    info = _stat(file, what)
    if info is not None and stat.S_ISDIR(info.st_mode):
        raise UsageError(f"{what} {shown(file)} is a directory; give a file name")
    if disposition(info) == REFUSE:
        raise UsageError(f"{what} {shown(file)} is {_kind(info)}, not a regular file; refusing to replace it")
    if info is None:
        # A name not there yet, or a link to one: the file is made where the link points.
        parent = Path(os.path.realpath(file)).parent
        if not parent.is_dir():
            raise UsageError(f"{what} {shown(file)}: directory {shown(parent)} does not exist")
    return file


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether ``a`` and ``b`` name the same file: one resolved path, or one file under two names."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def check_distinct(path: str | os.PathLike, what: str, others: Sequence[tuple[str, str | os.PathLike]]) -> None:
    """UsageError if ``path`` (given as ``what``) is the same file as one of ``others``, (flag, path)
    pairs: the command's input files and its other reports. A character device (``/dev/null``)
    may take several reports: nothing written to it replaces anything."""
    try:
        if stat.S_ISCHR(os.stat(path).st_mode):
            return
    except (OSError, ValueError):
        pass
    for flag, other in others:
        if same_file(path, other):
            raise UsageError(f"{what} {shown(path)} is also the {flag} file")


def is_standard_output(file: str | os.PathLike) -> bool:
    """Whether ``file`` names the file behind this process's standard output (``/dev/stdout``,
    ``/proc/self/fd/1``, or the file stdout is redirected to)."""
    try:
        info = os.stat(file)
    except (OSError, ValueError):
        return False
    return _standard_stream(info) is sys.stdout


def _standard_stream(info: os.stat_result | None):
    """``sys.stdout`` or ``sys.stderr`` where ``info`` is the file behind it (``/dev/stdout``, or
    the file it is redirected to), else None."""
    if info is None:
        return None
    for stream in (sys.stdout, sys.stderr):
        try:
            own = os.fstat(stream.fileno())
        except (AttributeError, OSError, ValueError):  # a stream without a descriptor (captured)
            continue
        if (own.st_dev, own.st_ino) == (info.st_dev, info.st_ino):
            return stream
    return None


def _write_through(file: Path, text: str, *, wait_for_reader: bool) -> None:
    """Write ``text`` into the device or FIFO at ``file`` (opened by the name given, never created
    or replaced). A FIFO nobody reads blocks until a reader comes, unless not ``wait_for_reader``
    (then ENXIO, an OSError)."""
    fd = os.open(file, os.O_WRONLY | (0 if wait_for_reader else os.O_NONBLOCK))
    if not wait_for_reader:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)


def _replace(file: Path, text: str) -> None:
    """Replace ``file`` by a temporary file holding ``text`` (:func:`_replace_filled`)."""
    def fill(temporary: Path) -> None:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)

    _replace_filled(file, fill)


def _replace_filled(file: Path, fill: Callable[[Path], None], suffix: str = "") -> None:
    """Replace ``file`` by a temporary file beside it that ``fill(temporary)`` writes (its name
    ending in ``suffix``), fsynced, then renamed over ``file``. If anything fails (a full disk, an
    interrupt) it goes on up, and the temporary goes, with any ``<temporary>.tmp`` a writer left."""
    temporary = file.parent / f".{file.name[:32]}.{secrets.token_hex(4)}.tmp{suffix}"
    renamed = False
    try:
        fill(temporary)
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, file)
        renamed = True
    finally:
        if not renamed:
            for left in (temporary, Path(f"{temporary}.tmp")):
                with contextlib.suppress(OSError):
                    os.unlink(left)


def write_atomically(path: str | os.PathLike, text: str, what: str, *, wait_for_reader: bool = True) -> Path:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all, as :func:`disposition` says; UsageError
    naming ``what`` if it cannot be written. ``wait_for_reader``: False for a best-effort write
    (an error report after a failure), which skips a FIFO nobody reads instead of waiting for
    one. Returns the path written."""
    file = check_writable(path, what)
    info = _stat(file, what)
    try:
        stream = _standard_stream(info)
        if stream is not None:  # /dev/stdout and the like: the stream, after what it holds
            stream.write(text)
            stream.flush()
        elif disposition(info) == WRITE_THROUGH:
            _write_through(file, text, wait_for_reader=wait_for_reader)
        else:  # a symbolic link stays; the regular file it names (or will name) is replaced
            _replace(Path(os.path.realpath(file)), text)
    except OSError as err:
        raise _cannot_write(what, file, err) from None
    return file


def write_file_atomically(path: str | os.PathLike, fill: Callable[[Path], None], what: str, *,
                          suffix: str = "") -> Path:
    """As :func:`write_atomically`, for content that ``fill(temporary_path)`` writes to a file
    (a large output, such as a profiler trace, never held in memory). A regular file (or nothing
    yet) at ``path`` is replaced by a temporary filled beside it, fsynced and renamed over it
    (``suffix`` ends the temporary's name, e.g. ``.gz`` for a writer that compresses by name); a
    stream, a character device or a FIFO gets the content filled into a temporary elsewhere, with
    no ``suffix`` (uncompressed), written through as text. A ``fill`` that writes nothing (a writer
    that logs its failure instead of raising) is a UsageError; nothing it left beside the target
    (its own ``<temporary>.tmp``) stays."""
    file = check_writable(path, what)
    info = _stat(file, what)
    if _standard_stream(info) is not None or disposition(info) == WRITE_THROUGH:
        try:
            handle, temporary = tempfile.mkstemp(prefix=".parity-", suffix=".tmp")
            os.close(handle)
        except OSError as err:
            raise _cannot_write(what, file, err) from None
        try:
            _fill(fill, Path(temporary), what, file, empty_ok=False)
            return write_atomically(file, Path(temporary).read_text(encoding="utf-8"), what)
        finally:
            for left in (temporary, f"{temporary}.tmp"):
                Path(left).unlink(missing_ok=True)
    try:  # a symbolic link stays; the file it names is replaced
        _replace_filled(Path(os.path.realpath(file)), lambda temporary: _fill(fill, temporary, what, file, empty_ok=True),
                        suffix)
    except OSError as err:
        raise _cannot_write(what, file, err) from None
    return file


def _fill(fill: Callable[[Path], None], temporary: Path, what: str, file, *, empty_ok: bool) -> None:
    """``fill(temporary)``; a UsageError naming ``what`` where it fails or writes no file."""
    try:
        fill(temporary)
    except OSError as err:
        raise _cannot_write(what, file, err) from None
    if not temporary.exists() or (not empty_ok and temporary.stat().st_size == 0):
        raise UsageError(f"{what} {shown(file)}: cannot write: nothing was written (see the message above)")


__all__ = ["REFUSE", "REPLACE", "WRITE_THROUGH", "check_distinct", "check_writable", "disposition",
           "is_standard_output", "same_file", "shown", "write_atomically", "write_file_atomically"]
