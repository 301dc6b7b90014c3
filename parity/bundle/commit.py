"""Committing a bundle directory so that none is lost: checking the target, the partial directory,
the move into place (renameat2, the journal) and the recovery after a killed writer.

Writing goes to a hidden partial directory next to the target (``.NAME.partial-HOST-PID-*``,
created with the user's umask), which is moved into place only once the manifest is complete:

- without ``force``, by a rename that never replaces anything (``renameat2(RENAME_NOREPLACE)``);
  if another process created the target meanwhile, the new bundle is kept beside it as
  ``NAME.conflict-HOST-PID-*`` and the writer fails with a UsageError;
- with ``force``, by atomically exchanging the two directories (``RENAME_EXCHANGE``), so the
  target always holds a complete bundle, then deleting the old one. Where the filesystem cannot
  exchange, the old bundle is first renamed to ``.NAME.old-HOST-PID-*`` (a journal): if the
  writer dies before the new one is in place, the next writer or reader of the target restores it.

A writer that is killed leaves its partial or old directory behind; the next writer *or reader*
of the same target (capture, verify, compare: :func:`recover`, whether or not the target exists)
removes those whose process is gone (on this host only: another host's pids mean nothing here; a
live writer's are never touched) and restores an old bundle when the target is missing.

Every filesystem step goes through :func:`step`, where tests stop a writer (a simulated kill).
The durable file primitives the writer uses (create, write, fsync) live here too.
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform as _py_platform
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from parity.base.errors import UsageError
from parity.base.text import printable
from parity.bundle.manifest import MANIFEST_NAME

# Tests replace this to stop a writer between two filesystem operations (a simulated kill).
_fs_step: Callable[..., None] | None = None


def step(operation: str, *paths: Path) -> None:
    if _fs_step is not None:
        _fs_step(operation, *paths)


class _Unsupported(Exception):
    """renameat2 or the flag asked for is not available here (libc, kernel or filesystem)."""


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "ppc64le": 357, "s390x": 347}


def _load_renameat2() -> Callable[..., int] | None:
    """libc's renameat2 (glibc >= 2.28), else the raw syscall on Linux, else None."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    function = getattr(libc, "renameat2", None)
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        function.restype = ctypes.c_int
        return function
    number = _SYS_RENAMEAT2.get(_py_platform.machine())
    syscall = getattr(libc, "syscall", None)
    if number is None or syscall is None or not _py_platform.system() == "Linux":
        return None
    syscall.restype = ctypes.c_long

    def call(olddirfd, old, newdirfd, new, flags):
        return syscall(ctypes.c_long(number), ctypes.c_int(olddirfd), ctypes.c_char_p(old),
                       ctypes.c_int(newdirfd), ctypes.c_char_p(new), ctypes.c_uint(flags))

    return call


_renameat2_function = _load_renameat2()


def _renameat2(src: Path, dst: Path, flags: int) -> None:
    if _renameat2_function is None:
        raise _Unsupported("renameat2 is not available")
    if _renameat2_function(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP) or code == errno.EXDEV and flags == _RENAME_EXCHANGE:
        # The kernel or this filesystem lacks the flag (overlayfs answers EXDEV for a directory of
        # a lower layer): the caller falls back to plain renames.
        raise _Unsupported(os.strerror(code))
    if code == errno.EEXIST:
        raise FileExistsError(code, os.strerror(code), str(src), None, str(dst))
    if code == errno.ENOENT:
        raise FileNotFoundError(code, os.strerror(code), str(src), None, str(dst))
    raise OSError(code, os.strerror(code), str(src), None, str(dst))


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename directory ``src`` to ``dst``; FileExistsError if ``dst`` exists, never replacing it.

    renameat2(RENAME_NOREPLACE) makes the check and the rename one atomic step. Where it is
    missing (non-Linux, NFS, old kernels) plain rename(2) is used, which is still safe for what
    matters: renaming a directory never replaces a non-empty directory (ENOTEMPTY/EEXIST), a
    file or a symlink (ENOTDIR), so an existing bundle is never lost; only an empty directory
    could be replaced. A lock file or mkdir-based lock would protect only against writers that
    honour it, and os.link does not work on directories.
    """
    try:
        _renameat2(src, dst, _RENAME_NOREPLACE)
        return
    except _Unsupported:
        pass
    try:
        os.rename(src, dst)
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(src), None, str(dst)) from None
        raise


def rename_exchange(src: Path, dst: Path) -> None:
    """Atomically swap ``src`` and ``dst`` (both must exist); _Unsupported where the system cannot."""
    _renameat2(src, dst, _RENAME_EXCHANGE)


def _host() -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in os.uname().nodename) or "host"


def _pid() -> int:
    return os.getpid()


def _partial_prefix(target: Path) -> str:
    """Hidden sibling directory a bundle is written in before the rename: ``.NAME.partial-HOST-PID-*``."""
    return f".{target.name}.partial-{_host()}-"


def _old_prefix(target: Path) -> str:
    """Hidden sibling an old bundle is parked in during a replacement (the journal): ``.NAME.old-HOST-PID-*``."""
    return f".{target.name}.old-{_host()}-"


def _sibling(target: Path, prefix: str) -> Path:
    return target.parent / f"{prefix}{_pid()}-{secrets.token_hex(4)}"


def make_private_dir(target: Path) -> Path:
    """A new partial directory for ``target``, with the umask's permissions (mkdtemp would make it 0700)."""
    for _ in range(100):
        path = _sibling(target, _partial_prefix(target))
        try:
            os.mkdir(path, 0o777)
            return path
        except FileExistsError:
            continue
    raise UsageError(f"cannot create a partial directory next to {printable(target)}")


def _owner_gone(host: str, pid_text: str) -> bool:
    """True when a sibling's owner (host, pid) is a process of this host that no longer runs."""
    if host != _host() or not pid_text.isdigit() or int(pid_text) <= 0:
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except (OverflowError, OSError):
        return False  # alive under another user (EPERM), or not a pid
    return False


def _stale_siblings(target: Path) -> tuple[list[Path], list[Path]]:
    """Partial and old directories of ``target`` whose writer process is gone."""
    partial, old = f".{target.name}.partial-", f".{target.name}.old-"
    partials, olds = [], []
    try:
        names = os.listdir(target.parent)
    except OSError:
        return [], []
    for name in names:
        for prefix, found in ((partial, partials), (old, olds)):
            if not name.startswith(prefix):
                continue
            parts = name[len(prefix):].split("-")
            if len(parts) != 3 or not parts[0].replace("_", "").isalnum() or not _owner_gone(parts[0], parts[1]):
                continue
            path = target.parent / name
            if _is_real_dir(path):
                found.append(path)
    return partials, olds


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def discard(path: Path) -> None:
    """Delete a bundle or partial directory, its manifest first: a half-deleted one never looks complete."""
    if not _is_real_dir(path):
        return
    try:
        os.unlink(path / MANIFEST_NAME)
    except OSError:
        pass
    step("rmtree", path)
    shutil.rmtree(path, ignore_errors=True)


def _restore_if_missing(target: Path, olds: list[Path]) -> bool:
    """Put the newest stale old bundle back where the target was, if the target is missing."""
    if os.path.lexists(target):
        return False
    for old in sorted(olds, key=_mtime, reverse=True):
        if not (old / MANIFEST_NAME).is_file():
            continue  # deleted halfway: its manifest went first
        try:
            step("restore", old, target)
            rename_noreplace(old, target)
            fsync_dir(target.parent)
            return True
        except FileExistsError:
            return False  # someone else restored or wrote it meanwhile
        except OSError:
            continue
    return False


def _mtime(path: Path) -> float:
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return 0.0


def recover(target: str | os.PathLike) -> None:
    """Tidy up after writers of ``target`` that were killed: restore an old bundle where the target is
    missing, then delete their partial and old directories. Only directories whose owner process is
    gone are touched, so a running writer is never disturbed."""
    target = Path(target)
    partials, olds = _stale_siblings(target)
    _restore_if_missing(target, olds)
    for path in partials + olds:  # a restored one is no longer there: discarding it does nothing
        step("discard", path)
        discard(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    try:
        _fsync(directory)
    except OSError:  # not every filesystem lets a directory be opened for fsync
        pass


def create_new_file(path: Path) -> int:
    """Create ``path`` (never an existing one) with the umask's permissions; the fd, for writing."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)


def _write_chunks(fd: int, chunks: Iterator[Any]) -> int:
    """Write ``chunks`` to ``fd``; the size written."""
    return sum(write_all(fd, chunk) for chunk in chunks)


def write_all(fd: int, chunk: Any) -> int:
    """``os.write`` all of a buffer, straight from it (no copy); its size."""
    view = memoryview(chunk).cast("B")
    remaining = view
    while remaining:
        remaining = remaining[os.write(fd, remaining):]
    return len(view)


def _write_to_fd(fd: int, chunks: Iterator[Any], durable: bool = True) -> int:
    """Write ``chunks`` to ``fd`` and fsync it (unless not ``durable``); the size. Closes ``fd``."""
    try:
        size = _write_chunks(fd, chunks)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    return size


def close_file(fd: int, file: Path) -> None:
    os.close(fd)


def sync_and_close(fd: int, file: Path) -> None:
    try:
        os.fsync(fd)
    except OSError as err:
        raise UsageError(f"cannot write {printable(file)}: {err.strerror or err}") from None
    finally:
        os.close(fd)


def write_new_file(path: Path, chunks: Iterator[Any], durable: bool = True) -> int:
    """Create ``path`` (never an existing one) with the umask's permissions, write, fsync (unless
    not ``durable``); the size."""
    return _write_to_fd(create_new_file(path), chunks, durable)



def check_target(path: str | os.PathLike, *, force: bool) -> Path:
    """Raise UsageError unless a bundle may be written at ``path``; return it as a Path.

    Without ``force`` the target must not exist. With ``force`` it may be an existing bundle
    (a directory holding ``manifest.json``) or an empty directory; anything else is refused, so
    that ``--force`` never deletes a directory of someone's files.
    """
    target = Path(path)
    state = _target_state(target)
    if state == "missing":
        if not target.parent.is_dir():
            raise UsageError(f"cannot write bundle {printable(target)}: parent directory {printable(target.parent)} "
                             "does not exist")
        return target
    if not force:
        raise UsageError(f"output {printable(target)} already exists; pass --force to replace it")
    if state == "not a directory":
        raise UsageError(f"output {printable(target)} exists and is not a directory; refusing to replace it")
    if state == "other files":
        raise UsageError(f"output {printable(target)} exists and is not a parity bundle; refusing to replace it")
    return target


def _target_state(path: Path) -> str:
    """``missing``, ``bundle`` (a directory holding manifest.json), ``empty`` (directory), ``other
    files`` or ``not a directory``, as one consistent reading.

    Concurrent --force writers rename bundles in and out of the target while we look; a directory
    renamed away between two looks would read as "not a bundle". So the look is repeated until
    the same directory (device and inode) was at the path before and after it.
    """
    for _ in range(100):
        try:
            before = os.lstat(path)
        except FileNotFoundError:
            return "missing"
        except (OSError, ValueError) as err:
            raise UsageError(f"cannot write bundle {printable(path)}: {getattr(err, 'strerror', None) or err}") from None
        if not stat.S_ISDIR(before.st_mode):
            return "not a directory"
        try:
            bundle = stat.S_ISREG(os.stat(path / MANIFEST_NAME).st_mode)
        except FileNotFoundError:
            bundle = False
        except OSError:
            return "other files"
        try:
            empty = not bundle and not any(os.scandir(path))
            after = os.lstat(path)
        except FileNotFoundError:
            continue  # renamed away while we looked
        except OSError:
            return "other files"
        if (before.st_dev, before.st_ino) == (after.st_dev, after.st_ino):
            return "bundle" if bundle else "empty" if empty else "other files"
    return "other files"


def _replaceable(path: Path) -> bool:
    """A real directory that is a bundle (holds manifest.json) or is empty."""
    try:
        return _target_state(path) in ("bundle", "empty")
    except UsageError:
        return False


class Mover:
    """Moves a complete partial directory ``tmp`` into place at ``target``: :meth:`install`
    without force, :meth:`replace` with it. ``tmp`` is None once nothing is left of it to delete
    (moved into place, or kept beside the target); otherwise it still holds what the caller must
    discard."""

    # How often a --force commit retries when other writers keep changing the target under it.
    MAX_ATTEMPTS = 64

    def __init__(self, tmp: Path, target: Path):
        self.tmp: Path | None = tmp
        self.target = target

    def install(self) -> None:
        """Without force: rename into place, never replacing what another process put there."""
        assert self.tmp is not None
        step("rename_noreplace", self.tmp, self.target)
        try:
            rename_noreplace(self.tmp, self.target)
        except FileExistsError:
            kept = self._keep_beside()
            raise UsageError(
                f"output {printable(self.target)} was created by another process while this bundle was written; "
                f"it was not replaced (pass --force to replace it); this bundle was kept as {printable(kept)}"
            ) from None
        self.tmp = None
        step("fsync", self.target.parent)
        fsync_dir(self.target.parent)

    def _keep_beside(self) -> Path:
        """A complete bundle that lost a race without force is not thrown away: it becomes
        ``NAME.conflict-HOST-PID-*`` next to the target, for the user to look at."""
        assert self.tmp is not None
        kept = _sibling(self.target, f"{self.target.name}.conflict-{_host()}-")
        step("rename_noreplace", self.tmp, kept)
        rename_noreplace(self.tmp, kept)
        self.tmp = None
        return kept

    def replace(self) -> None:
        """With force: exchange the new bundle with whatever bundle is at the target, then delete the old.

        Other writers may change the target between our check and our rename; each attempt
        re-checks and retries, so concurrent --force writers end with one complete bundle (the
        last to commit) and nothing left over.
        """
        assert self.tmp is not None
        for _ in range(self.MAX_ATTEMPTS):
            check_target(self.target, force=True)
            if not os.path.lexists(self.target):
                if self._try_install():
                    return
                continue
            try:
                step("rename_exchange", self.tmp, self.target)
                rename_exchange(self.tmp, self.target)
            except FileNotFoundError:
                continue  # the target vanished under us: install on the next attempt
            except _Unsupported:
                if self._replace_by_journal():
                    return
                continue
            self._dispose_of_swapped_out()
            return
        raise UsageError(f"output {printable(self.target)} kept changing while this bundle was moved into place; "
                         f"gave up after {self.MAX_ATTEMPTS} attempts")

    def _try_install(self) -> bool:
        assert self.tmp is not None
        try:
            step("rename_noreplace", self.tmp, self.target)
            rename_noreplace(self.tmp, self.target)
        except FileExistsError:
            return False
        self.tmp = None
        step("fsync", self.target.parent)
        fsync_dir(self.target.parent)
        return True

    def _dispose_of_swapped_out(self) -> None:
        """After the exchange our partial directory holds what was at the target: delete it if it is a
        bundle (or empty); if another process put other files there in the meantime, swap back."""
        assert self.tmp is not None
        swapped = self.tmp
        if not _replaceable(swapped):
            step("rename_exchange", swapped, self.target)
            rename_exchange(swapped, self.target)
            raise UsageError(f"output {printable(self.target)} was replaced by something that is not a parity bundle "
                             "while this bundle was written; refusing to replace it")
        self.tmp = None
        step("fsync", self.target.parent)
        fsync_dir(self.target.parent)
        step("discard", swapped)
        discard(swapped)

    def _replace_by_journal(self) -> bool:
        """Where directories cannot be exchanged: park the old bundle as ``.NAME.old-HOST-PID-*``,
        rename the new one in, delete the old. A writer killed in between leaves the old one
        parked, and the next writer or reader restores it (:func:`recover`)."""
        assert self.tmp is not None
        old = _sibling(self.target, _old_prefix(self.target))
        try:
            step("rename", self.target, old)
            os.rename(self.target, old)
        except FileNotFoundError:
            return self._try_install()
        try:
            step("rename_noreplace", self.tmp, self.target)
            rename_noreplace(self.tmp, self.target)
        except FileExistsError:
            # Another writer installed its bundle while the target was free; ours goes on top of
            # it on the next attempt, and the parked one is superseded by both.
            step("discard", old)
            discard(old)
            return False
        except BaseException:
            try:
                rename_noreplace(old, self.target)
            except OSError:
                pass  # left parked: recover() restores it
            raise
        self.tmp = None
        step("fsync", self.target.parent)
        fsync_dir(self.target.parent)
        step("discard", old)
        discard(old)
        return True

