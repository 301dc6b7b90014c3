"""Golden bundles: a directory of safetensors shards plus ``manifest.json``, committed so that none is lost.

Layout of a bundle directory::

    manifest.json              what was captured, where each tensor lives, and its checksum
    shard-00000.safetensors    tensors, in the order they were produced
    shard-00001.safetensors    ... a new shard starts when the current one reaches its size limit

Tensors are stored under generated keys (``t0000000``) in generated file names, never under
names derived from layer names: a model's layer names may hold slashes, ``..``, unicode or be
very long. The manifest may only name plain files inside the bundle directory.

Reading never executes code: the manifest is JSON, checked against the schema in
:mod:`parity.manifest` before any field is used, and tensors are read from the safetensors
files by this module (the 8-byte header length is checked against the file size, the header
against the manifest, then the bytes are read with ``pread``: no pickle, no ``torch.load``, no
memory map that a truncated file could turn into SIGBUS). A shard's header digest is checked when
its header is first read, every tensor's digest when it is read (BLAKE3 from schema 4, sha256
before: :mod:`parity.checksums`); :meth:`BundleReader.verify`
checks every shard and every tensor in one pass, hashing each byte once (:mod:`parity.manifest`).
Any damage is one :class:`~parity.errors.BundleError` line naming the file.

Writing goes to a hidden partial directory next to the target (``.NAME.partial-HOST-PID-*``,
created with the user's umask), which is moved into place only once the manifest is complete:

- without ``force``, by a rename that never replaces anything (``renameat2(RENAME_NOREPLACE)``);
  if another process created the target meanwhile, the new bundle is kept beside it as
  ``NAME.conflict-HOST-PID-*`` and the writer fails with a UsageError;
- with ``force``, by atomically exchanging the two directories (``RENAME_EXCHANGE``), so the
  target always holds a complete bundle, then deleting the old one. Where the filesystem cannot
  exchange, the old bundle is first renamed to ``.NAME.old-HOST-PID-*`` (a journal): if the
  writer dies before the new one is in place, the next writer or reader of the target restores it.

A writer that is killed leaves its partial or old directory behind; the next writer of the same
target removes those whose process is gone (on this host only: another host's pids mean nothing
here) and restores an old bundle when the target is missing.
"""
from __future__ import annotations

import ctypes
import datetime
import errno
import hashlib
import json
import os
import platform as _py_platform
import secrets
import shutil
import stat
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import torch

from . import __version__, checksums
from .errors import BundleError, UsageError
from .manifest import (
    DTYPES,
    FORMAT_NAME,
    KINDS,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    SCHEMA_VERSION,
    Entry,
    Manifest,
    Shard,
    DIGEST_FIELD,
    canonical_json,
    load_manifest,
    parse_json,
    seal,
)
from .text import printable

__all__ = [
    "BundleReader", "BundleWriter", "Entry", "KINDS", "MANIFEST_NAME", "SCHEMA_VERSION", "FORMAT_NAME",
    "DEFAULT_SHARD_BYTES", "check_target", "dtype_name", "edit_manifest", "open_bundle",
]

DEFAULT_SHARD_BYTES = 256 * 1024 * 1024
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

# safetensors' dtype codes for the dtypes a bundle stores.
_ST_CODES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}
_ST_NAMES = {code: name for name, code in _ST_CODES.items()}
_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
_READ_CHUNK = 16 * 2**20
# Tensors at least this large are hashed on the writer's hashing thread, smaller ones at once.
_HASH_IN_THREAD_BYTES = 2**20
# The writer copies tensors into a reused ring of one shard's bytes (at most this many; larger
# tensors are copied on their own), each at an offset aligned for any dtype and for vector copies.
_MAX_ARENA_BYTES = 512 * 2**20
_ARENA_ALIGN = 64


# What a new bundle's tensors and shard headers are hashed with (schema 4: BLAKE3, parity.checksums).
WRITE_CHECKSUM = checksums.ALGORITHM_OF_VERSION[SCHEMA_VERSION]


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name for a torch dtype (``"bfloat16"``)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise UsageError(f"tensors of dtype {dtype} cannot be stored in a bundle") from None


def _tensor_checksum(tensor: torch.Tensor) -> str:
    """The digest a new bundle records for a tensor (:data:`WRITE_CHECKSUM`)."""
    return checksums.of_tensor(WRITE_CHECKSUM, tensor)


def _show(path: object) -> str:
    """A path or name from a manifest or a user, safe to put in a one-line message."""
    return printable(str(path))


# --------------------------------------------------------------------------------------------
# Filesystem primitives of the commit


# Tests replace this to stop a writer between two filesystem operations (a simulated kill).
_fs_step: Callable[..., None] | None = None


def _step(operation: str, *paths: Path) -> None:
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


def _make_private_dir(target: Path) -> Path:
    """A new partial directory for ``target``, with the umask's permissions (mkdtemp would make it 0700)."""
    for _ in range(100):
        path = _sibling(target, _partial_prefix(target))
        try:
            os.mkdir(path, 0o777)
            return path
        except FileExistsError:
            continue
    raise UsageError(f"cannot create a partial directory next to {_show(target)}")


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


def _discard(path: Path) -> None:
    """Delete a bundle or partial directory, its manifest first: a half-deleted one never looks complete."""
    if not _is_real_dir(path):
        return
    try:
        os.unlink(path / MANIFEST_NAME)
    except OSError:
        pass
    _step("rmtree", path)
    shutil.rmtree(path, ignore_errors=True)


def _restore_if_missing(target: Path, olds: list[Path]) -> bool:
    """Put the newest stale old bundle back where the target was, if the target is missing."""
    if os.path.lexists(target):
        return False
    for old in sorted(olds, key=_mtime, reverse=True):
        if not (old / MANIFEST_NAME).is_file():
            continue  # deleted halfway: its manifest went first
        try:
            _step("restore", old, target)
            rename_noreplace(old, target)
            _fsync_dir(target.parent)
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
        _step("discard", path)
        _discard(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    try:
        _fsync(directory)
    except OSError:  # not every filesystem lets a directory be opened for fsync
        pass


def _create_new_file(path: Path) -> int:
    """Create ``path`` (never an existing one) with the umask's permissions; the fd, for writing."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)


def _write_chunks(fd: int, chunks: Iterator[Any]) -> int:
    """Write ``chunks`` to ``fd``; the size written."""
    return sum(_write_all(fd, chunk) for chunk in chunks)


def _write_all(fd: int, chunk: Any) -> int:
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


def _close(fd: int, file: Path) -> None:
    os.close(fd)


def _sync_and_close(fd: int, file: Path) -> None:
    try:
        os.fsync(fd)
    except OSError as err:
        raise UsageError(f"cannot write {_show(file)}: {err.strerror or err}") from None
    finally:
        os.close(fd)


def _write_new_file(path: Path, chunks: Iterator[Any], durable: bool = True) -> int:
    """Create ``path`` (never an existing one) with the umask's permissions, write, fsync (unless
    not ``durable``); the size."""
    return _write_to_fd(_create_new_file(path), chunks, durable)


def _shard_chunks(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> Iterator[Any]:
    """A safetensors file: 8-byte little-endian header length, JSON header padded with spaces
    to a multiple of 8, then each tensor's bytes in order (the format's contiguous layout)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": _ST_CODES[dtype_name(tensor.dtype)], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    yield struct.pack("<Q", len(text))
    yield text
    for tensor in tensors.values():
        yield tensor.reshape(-1).view(torch.uint8).numpy()


# --------------------------------------------------------------------------------------------
# Writer


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
            raise UsageError(f"cannot write bundle {_show(target)}: parent directory {_show(target.parent)} "
                             "does not exist")
        return target
    if not force:
        raise UsageError(f"output {_show(target)} already exists; pass --force to replace it")
    if state == "not a directory":
        raise UsageError(f"output {_show(target)} exists and is not a directory; refusing to replace it")
    if state == "other files":
        raise UsageError(f"output {_show(target)} exists and is not a parity bundle; refusing to replace it")
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
            raise UsageError(f"cannot write bundle {_show(path)}: {getattr(err, 'strerror', None) or err}") from None
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


def _hash_workers() -> int:
    """Threads that hash a writer's tensors: one fewer than the cores, at least 2 and at most 4.
    Measured on the 2-core machine with sha256, writing 2 GB: 1.1-1.3 GB/s with one hashing
    thread, 1.3-1.9 with two (parity/BENCHMARK.md); hashlib and blake3 release the GIL, so two
    use both cores when the model leaves one idle."""
    return max(2, min(4, (os.cpu_count() or 2) - 1))


def _align(offset: int) -> int:
    return -(-offset // _ARENA_ALIGN) * _ARENA_ALIGN


class _Ring:
    """Reused memory for the writer's copies: ``size`` bytes, handed out and given back first in,
    first out.

    The caller's thread places each copy after the newest one (wrapping to the start when the end
    is reached); the writing thread gives each back, oldest first, once it is written to its shard
    and hashed. So the shard that fills reuses the space of the one being written as fast as that
    one reaches the disk, and the writer holds about one shard's bytes, not one per shard in
    flight. :meth:`place` waits for space only while space is owed back (copies of shards handed
    to the writing thread); otherwise, or for a tensor larger than the ring, it returns ``None`` and
    the caller copies on its own. The memory is allocated at the first placement.
    """

    def __init__(self, size: int):
        self.size = size
        self.buffer: torch.Tensor | None = None
        self._spans: deque[tuple[int, int]] = deque()  # (start, end) of the live copies, oldest first
        self._owed = 0  # how many of them were handed to the writing thread, which gives them back
        self._changed = threading.Condition()

    def _fit(self, nbytes: int) -> int | None:
        if not self._spans:
            return 0
        tail, head = self._spans[0][0], _align(self._spans[-1][1])
        if self._spans[-1][0] >= tail:  # the live copies are one run [tail, head)
            if head + nbytes <= self.size:
                return head
            return 0 if nbytes <= tail else None
        return head if head + nbytes <= tail else None  # they wrap: [tail, size) and [0, head)

    def place(self, nbytes: int) -> int | None:
        """An offset for ``nbytes`` (> 0) of the next copy, or None: copy elsewhere."""
        if nbytes > self.size:
            return None
        with self._changed:
            while (start := self._fit(nbytes)) is None:
                if not self._owed:  # only copies not yet handed over block it: nothing will free them
                    return None
                self._changed.wait()
            self._spans.append((start, start + nbytes))
        if self.buffer is None:
            self.buffer = torch.empty(self.size, dtype=torch.uint8)
        return start

    def give_back_after(self, digests: list[str | Future], count: int) -> None:
        """Give back ``count`` copies once every hash among ``digests`` is done reading them."""
        for digest in digests:
            if isinstance(digest, Future):
                digest.exception()  # waits; its error, if any, is the caller's to report
        self.give_back(count)

    def unplace(self) -> None:
        """Take back the newest copy, placed but never handed over (its caller failed)."""
        with self._changed:
            self._spans.pop()
            self._changed.notify_all()

    def hand_over(self, count: int) -> None:
        """The oldest ``count`` copies not yet handed over now belong to the writing thread."""
        with self._changed:
            self._owed += count

    def give_back(self, count: int = 1) -> None:
        """On the writing thread: the oldest ``count`` copies are written and hashed; reuse them."""
        with self._changed:
            for _ in range(count):
                self._spans.popleft()
            self._owed -= count
            self._changed.notify_all()


class _ShardJob(NamedTuple):
    """A shard handed to the threads: its write (size, fsync future), its header's digest, its file
    name, entry fields and tensors' digests (strings or futures), and its open fd."""

    written: Future
    header_checksum: str
    shard: str
    metas: list[dict[str, Any]]
    hashes: list[str | Future]
    fd: int


class BundleWriter:
    """Writes a bundle shard by shard; use as a context manager and call :meth:`commit`.

    >>> with BundleWriter(out, force=False) as writer:
    ...     writer.add("input", "x", x)
    ...     writer.commit({"subject": {...}})

    Tensors are buffered (copied to CPU, into a ring of one shard's bytes, :class:`_Ring`) until
    the current shard reaches ``shard_bytes``, then written. Writing runs on background threads, so
    the caller goes on producing tensors while a shard goes to disk: each tensor's BLAKE3 digest
    is computed on one thread as it is added (the only hash of its bytes: the shard records its
    header's digest, :mod:`parity.manifest`), another writes the shard file, and a third fsyncs
    it (once per shard) while the next shard is written.
    ``durable=False`` skips the fsyncs of the shards and the manifest (the directory renames are
    still synced): as fast as the page cache takes the bytes, but a crash of the machine (power
    loss, kernel panic; not of parity) can leave a bundle whose shards fail their checksums.
    At most one shard is written while the next one fills the ring space the written tensors
    give back, so the copies held are bounded by about one shard's bytes (plus any tensor larger
    than the ring, or placed while the ring was full of the filling shard's own copies). A write error surfaces at the next :meth:`add` that fills a shard, or at
    :meth:`commit`, which waits for every fsync before the manifest is written. Leaving the
    ``with`` block without a commit (an exception, KeyboardInterrupt) waits for the threads and
    deletes everything written.
    """

    # How often a --force commit retries when other writers keep changing the target under it.
    MAX_ATTEMPTS = 64

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        force: bool = False,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        progress: Callable[[str], None] | None = None,
        durable: bool = True,
    ):
        if shard_bytes <= 0:
            raise UsageError(f"shard size must be positive, got {shard_bytes} bytes")
        recover(path)  # first: a killed writer's old bundle is restored before we look at the target
        self.target = check_target(path, force=force)
        self.force = force
        self.shard_bytes = int(shard_bytes)
        self.durable = durable
        self._progress = progress
        self._tmp: Path | None = None
        self._entries: list[Entry] = []
        self._names: set[tuple[str, str]] = set()
        self._shards: list[dict[str, Any]] = []
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_meta: list[dict[str, Any]] = []
        self._pending_hashes: list[str | Future] = []
        self._pending_bytes = 0
        self._shard_count = 0  # shard files created, written or not
        self._in_flight: _ShardJob | None = None  # the shard being written
        self._ring = _Ring(min(self.shard_bytes, _MAX_ARENA_BYTES))
        self._pending_in_ring: list[bool] = []  # which of the filling shard's copies are in the ring
        self._threads: dict[str, ThreadPoolExecutor] = {}
        self._syncs: list[Future] = []  # fsyncs of written shards, waited for before the manifest
        self._committed = False
        self.bytes_written = 0

    # context management ------------------------------------------------------------------
    def __enter__(self) -> "BundleWriter":
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._committed:
            self.abort()

    def open(self) -> None:
        if self._tmp is None:
            _step("mkdir", self.target)
            try:
                self._tmp = _make_private_dir(self.target)
            except OSError as err:
                raise UsageError(f"cannot write bundle {_show(self.target)}: {err.strerror or err}") from None

    def abort(self) -> None:
        """Delete everything written so far; the target is left as it was."""
        if self._in_flight is not None:
            job, self._in_flight = self._in_flight, None
            if job.written.cancel():  # never started: its file is still open here
                os.close(job.fd)
            for future in (job.written, *[value for value in job.hashes if isinstance(value, Future)]):
                try:
                    future.result()  # the threads must be done with the directory and the copies first
                except Exception:  # noqa: BLE001 - its error no longer matters: all of it is deleted
                    pass  # (an interrupt while waiting still propagates)
        self._stop_threads()  # after the write thread: it may still hand fsyncs to the sync thread
        self._syncs = []
        if self._tmp is not None:
            _discard(self._tmp)
            self._tmp = None
        self._pending.clear()
        self._pending_meta.clear()
        self._pending_hashes.clear()
        self._pending_in_ring.clear()
        self._ring = _Ring(self._ring.size)

    def _thread(self, name: str) -> ThreadPoolExecutor:
        if name not in self._threads:
            # Tensors are hashed independently, several at once (_hash_workers); shard writes
            # and fsyncs stay in order, one thread each.
            workers = _hash_workers() if name == "hash" else 1
            self._threads[name] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"parity-{name}")
        return self._threads[name]

    def _stop_threads(self) -> None:
        for executor in self._threads.values():
            executor.shutdown(wait=True)  # never cancel: a cancelled fsync would leave its fd open
        self._threads = {}

    @property
    def busy_threads(self) -> int:
        """How many of the writer's background threads compute (hashing and writing; the fsync
        thread mostly waits for the disk): what a caller's own CPU work should leave cores for."""
        return _hash_workers() + 1

    # adding tensors ----------------------------------------------------------------------
    @property
    def entries(self) -> list[Entry]:
        """Entries written to shards so far (after :meth:`commit`: all of them)."""
        return list(self._entries)

    def names(self, kind: str) -> set[str]:
        """Names of every tensor of ``kind`` added so far, written or still buffered."""
        return {name for entry_kind, name in self._names if entry_kind == kind}

    def add(
        self,
        kind: str,
        name: str,
        tensor: torch.Tensor,
        *,
        layer: str | None = None,
        module: str | None = None,
        call_index: int | None = None,
        path: str | None = None,
        copy: bool = True,
        device: str | None = None,
    ) -> None:
        """Queue one tensor; it is copied to CPU now and written when its shard fills up.

        ``copy=False`` skips the copy of a CPU tensor the caller hands over and never changes
        until the bundle is committed (or aborted). ``device``: where a recorded tensor was
        produced (``Entry.device``), for models spread over devices.
        """
        if kind not in KINDS:
            raise ValueError(f"unknown entry kind {kind!r}; expected one of {KINDS}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"entry {name!r} is a {type(tensor).__name__}, not a tensor")
        if (kind, name) in self._names:
            raise UsageError(f"two recorded {kind} tensors share the name {printable(name)!r}; names must be unique")
        self.open()
        dtype = dtype_name(tensor.dtype)
        tensor = tensor.detach()
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.shard_bytes:
            self._flush()
        in_ring = False
        if copy:
            data, in_ring = self._copy_in(tensor)
        else:
            data = tensor.to("cpu").contiguous()
        # Large tensors are hashed on their own thread while the caller goes on (blake3 releases
        # the GIL); small ones now, where a thread hand-off would cost more than the hash. Before
        # any state changes: a failure here leaves the writer as it was.
        try:
            digest = (self._thread("hash").submit(_tensor_checksum, data) if nbytes >= _HASH_IN_THREAD_BYTES
                      else _tensor_checksum(data))
        except BaseException:
            if in_ring:
                self._ring.unplace()
            raise
        key = f"t{self._key_count():07d}"
        self._names.add((kind, name))
        self._pending[key] = data
        self._pending_bytes += nbytes
        self._pending_in_ring.append(in_ring)
        self._pending_hashes.append(digest)
        self._pending_meta.append(
            dict(kind=kind, name=name, dtype=dtype, shape=tuple(data.shape), key=key,
                 nbytes=nbytes, layer=layer, module=module, call_index=call_index, path=path, device=device)
        )

    def _copy_in(self, tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """A contiguous CPU copy of ``tensor``, in the ring when it has room; (copy, in the ring).

        The ring (allocated once, reused by every shard) keeps the copies out of the allocator:
        fresh tensor-sized allocations page-fault on first touch and, interleaved with the model's
        own activations, fragmented the heap (measured: peak RSS of a capture grew by 0.6 GB over
        its reference run).
        """
        nbytes = tensor.numel() * tensor.element_size()
        start = self._ring.place(nbytes) if nbytes else None
        if start is None:
            return tensor.to("cpu", copy=True).contiguous(), False
        assert self._ring.buffer is not None
        place = self._ring.buffer[start:start + nbytes].view(tensor.dtype).view(tensor.shape)
        return place.copy_(tensor), True

    def _key_count(self) -> int:
        in_flight = len(self._in_flight.metas) if self._in_flight is not None else 0
        return len(self._entries) + in_flight + len(self._pending)

    def _flush(self) -> None:
        """Hand the buffered tensors to the writing thread as the next shard; wait for the shard
        before it first, so that at most one is being written while the next one fills."""
        if not self._pending:
            return
        assert self._tmp is not None
        shard = f"shard-{self._shard_count:05d}.safetensors"
        metadata = {"format": "pt", FORMAT_NAME: str(SCHEMA_VERSION)}
        file = self._tmp / shard
        _step("write", file)
        try:
            fd = _create_new_file(file)  # here, not on the thread: once add() returns, the file exists
        except OSError as err:
            raise UsageError(f"cannot write {_show(file)}: {err.strerror or err}") from None
        self._shard_count += 1
        tensors, metas, hashes, in_ring = self._pending, self._pending_meta, self._pending_hashes, self._pending_in_ring
        self._pending, self._pending_meta, self._pending_hashes, self._pending_in_ring = {}, [], [], []
        self._pending_bytes = 0
        try:
            self._finish_in_flight()
        except BaseException:
            os.close(fd)
            raise
        # The shard's bytes are written on one thread while the tensors' own digests (taken on
        # others since they were added) finish; the header, a few KiB, is hashed here.
        handed = 0
        try:
            chunks = list(_shard_chunks(tensors, metadata))
            header_checksum = checksums.of_buffer(WRITE_CHECKSUM, b"".join(chunks[:2]))
            handed = sum(in_ring)
            self._ring.hand_over(handed)
            written = self._thread("write").submit(self._write_shard, fd, file, chunks,
                                                   list(zip(hashes, in_ring, strict=True)), self._ring,
                                                   self._thread("sync"), self.durable)
        except BaseException:  # the shard never reached the writing thread: close it, free its copies
            os.close(fd)
            if handed:
                self._ring.give_back_after(hashes, handed)
            raise
        self._in_flight = _ShardJob(written, header_checksum, shard, metas, hashes, fd)

    @staticmethod
    def _write_shard(fd: int, file: Path, chunks: list[Any], tensors: list[tuple[str | Future, bool]], ring: _Ring,
                     sync: ThreadPoolExecutor, durable: bool) -> tuple[int, Future]:
        """On the writing thread: write the shard's bytes (the length and header, then each tensor's,
        giving its ring space back once it is written and hashed), then hand its fsync (and close;
        only the close where not ``durable``) to the syncing thread, so the disk catches up while
        the next shard is written; (size, the fsync). Whatever happens, every ring copy of the
        shard is given back."""
        owed = sum(in_ring for _, in_ring in tensors)
        try:
            size = _write_all(fd, chunks[0]) + _write_all(fd, chunks[1])
            for chunk, (digest, in_ring) in zip(chunks[2:], tensors, strict=True):
                size += _write_all(fd, chunk)
                if in_ring:
                    if isinstance(digest, Future):
                        digest.exception()  # waits: the hashing thread reads the copy too
                    ring.give_back()
                    owed -= 1
            synced = sync.submit(_sync_and_close if durable else _close, fd, file)  # from here it closes fd
        except OSError as err:  # a full disk, a quota: one line naming the file
            os.close(fd)
            raise UsageError(f"cannot write {_show(file)}: {err.strerror or err}") from None
        except BaseException:
            os.close(fd)
            raise
        finally:
            if owed:
                ring.give_back_after([digest for digest, _ in tensors], owed)
        return size, synced

    def _finish_in_flight(self) -> None:
        """Wait for the shard being written (raising its error) and record it."""
        if self._in_flight is None:
            return
        job, self._in_flight = self._in_flight, None
        try:
            size, synced = job.written.result()
        finally:  # the hashing threads are done with the tensors' copies
            tensor_digests = [value if isinstance(value, str) else value.result() for value in job.hashes]
        self._syncs.append(synced)
        self._shards.append({"file": job.shard, "bytes": size, "tensors": len(job.metas),
                             f"header_{WRITE_CHECKSUM}": job.header_checksum})
        self._entries.extend(Entry(shard=job.shard, checksum=digest, **meta)
                             for meta, digest in zip(job.metas, tensor_digests, strict=True))
        self.bytes_written += size
        if self._progress is not None:
            self._progress(
                f"wrote {job.shard}: {len(job.metas)} tensors, {_mib(size)}; "
                f"{len(self._entries)} tensors, {_mib(self.bytes_written)} in all"
            )

    # finishing -----------------------------------------------------------------------------
    def commit(self, fields: Mapping[str, Any]) -> Path:
        """Write the manifest (``fields`` plus what the writer owns) and move the bundle into place.

        ``fields`` must be JSON-safe. The writer sets ``format``, ``schema_version``,
        ``parity_version``, ``created``, ``shards``, ``entries`` and ``manifest_sha256``.
        """
        if self._committed:
            raise RuntimeError("bundle already committed")
        self.open()
        self._flush()
        self._finish_in_flight()
        for synced in self._syncs:  # every shard is on disk before the manifest names it
            synced.result()
        self._syncs = []
        self._stop_threads()
        assert self._tmp is not None
        reserved = {"format", "schema_version", "parity_version", "created", "shards", "entries", "manifest_sha256"}
        clash = reserved & set(fields)
        if clash:
            raise ValueError(f"manifest fields {sorted(clash)} are set by the writer")
        manifest = {
            "format": FORMAT_NAME,
            "schema_version": SCHEMA_VERSION,
            "parity_version": __version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **fields,
            "shards": self._shards,
            "entries": [entry.to_json(WRITE_CHECKSUM) for entry in self._entries],
        }
        try:
            canonical_json(manifest)  # what the digest is taken of must be plain JSON
            text = json.dumps(seal(manifest), indent=1, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise UsageError(f"bundle manifest is not JSON-safe: {err}") from None
        _step("write", self._tmp / MANIFEST_NAME)
        self._write(self._tmp / MANIFEST_NAME, iter([(text + "\n").encode("utf-8")]), self.durable)
        _step("fsync", self._tmp)
        _fsync_dir(self._tmp)
        try:
            if self.force:
                self._replace()
            else:
                self._install()
        except OSError as err:  # a filesystem that refuses the renames: one line, and the partial is removed
            raise UsageError(f"cannot move the bundle into place at {_show(self.target)}: "
                             f"{err.strerror or err}") from None
        self._committed = True
        return self.target

    @staticmethod
    def _write(file: Path, chunks: Iterator[Any], durable: bool) -> int:
        try:
            return _write_new_file(file, chunks, durable)
        except OSError as err:  # a full disk, a quota: one line naming the file
            raise UsageError(f"cannot write {_show(file)}: {err.strerror or err}") from None

    def _install(self) -> None:
        """Without force: rename into place, never replacing what another process put there."""
        assert self._tmp is not None
        _step("rename_noreplace", self._tmp, self.target)
        try:
            rename_noreplace(self._tmp, self.target)
        except FileExistsError:
            kept = self._keep_beside()
            raise UsageError(
                f"output {_show(self.target)} was created by another process while this bundle was written; "
                f"it was not replaced (pass --force to replace it); this bundle was kept as {_show(kept)}"
            ) from None
        self._tmp = None
        _step("fsync", self.target.parent)
        _fsync_dir(self.target.parent)

    def _keep_beside(self) -> Path:
        """A complete bundle that lost a race without force is not thrown away: it becomes
        ``NAME.conflict-HOST-PID-*`` next to the target, for the user to look at."""
        assert self._tmp is not None
        kept = _sibling(self.target, f"{self.target.name}.conflict-{_host()}-")
        _step("rename_noreplace", self._tmp, kept)
        rename_noreplace(self._tmp, kept)
        self._tmp = None
        return kept

    def _replace(self) -> None:
        """With force: exchange the new bundle with whatever bundle is at the target, then delete the old.

        Other writers may change the target between our check and our rename; each attempt
        re-checks and retries, so concurrent --force writers end with one complete bundle (the
        last to commit) and nothing left over.
        """
        assert self._tmp is not None
        for _ in range(self.MAX_ATTEMPTS):
            check_target(self.target, force=True)
            if not os.path.lexists(self.target):
                if self._try_install():
                    return
                continue
            try:
                _step("rename_exchange", self._tmp, self.target)
                rename_exchange(self._tmp, self.target)
            except FileNotFoundError:
                continue  # the target vanished under us: install on the next attempt
            except _Unsupported:
                if self._replace_by_journal():
                    return
                continue
            self._dispose_of_swapped_out()
            return
        raise UsageError(f"output {_show(self.target)} kept changing while this bundle was moved into place; "
                         f"gave up after {self.MAX_ATTEMPTS} attempts")

    def _try_install(self) -> bool:
        assert self._tmp is not None
        try:
            _step("rename_noreplace", self._tmp, self.target)
            rename_noreplace(self._tmp, self.target)
        except FileExistsError:
            return False
        self._tmp = None
        _step("fsync", self.target.parent)
        _fsync_dir(self.target.parent)
        return True

    def _dispose_of_swapped_out(self) -> None:
        """After the exchange our partial directory holds what was at the target: delete it if it is a
        bundle (or empty); if another process put other files there in the meantime, swap back."""
        assert self._tmp is not None
        swapped = self._tmp
        if not _replaceable(swapped):
            _step("rename_exchange", swapped, self.target)
            rename_exchange(swapped, self.target)
            raise UsageError(f"output {_show(self.target)} was replaced by something that is not a parity bundle "
                             "while this bundle was written; refusing to replace it")
        self._tmp = None
        _step("fsync", self.target.parent)
        _fsync_dir(self.target.parent)
        _step("discard", swapped)
        _discard(swapped)

    def _replace_by_journal(self) -> bool:
        """Where directories cannot be exchanged: park the old bundle as ``.NAME.old-HOST-PID-*``,
        rename the new one in, delete the old. A writer killed in between leaves the old one
        parked, and the next writer or reader restores it (:func:`recover`)."""
        assert self._tmp is not None
        old = _sibling(self.target, _old_prefix(self.target))
        try:
            _step("rename", self.target, old)
            os.rename(self.target, old)
        except FileNotFoundError:
            return self._try_install()
        try:
            _step("rename_noreplace", self._tmp, self.target)
            rename_noreplace(self._tmp, self.target)
        except FileExistsError:
            # Another writer installed its bundle while the target was free; ours goes on top of
            # it on the next attempt, and the parked one is superseded by both.
            _step("discard", old)
            _discard(old)
            return False
        except BaseException:
            try:
                rename_noreplace(old, self.target)
            except OSError:
                pass  # left parked: recover() restores it
            raise
        self._tmp = None
        _step("fsync", self.target.parent)
        _fsync_dir(self.target.parent)
        _step("discard", old)
        _discard(old)
        return True


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def edit_manifest(path: str | os.PathLike, edit: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``edit`` to a bundle's manifest and write it back sealed (for tests and deliberate fixes:
    an edit by hand would fail the manifest checksum). The result is checked like any manifest."""
    bundle = Path(path)
    file = bundle / MANIFEST_NAME
    manifest = parse_json(file.read_bytes(), _show(file))
    edit(manifest)
    if isinstance(manifest, dict) and DIGEST_FIELD in manifest:  # an edit that drops the digest keeps it dropped
        manifest = seal(manifest)
    tmp = bundle / f".{MANIFEST_NAME}.edit-{secrets.token_hex(4)}"
    _write_new_file(tmp, iter([json.dumps(manifest, indent=1, ensure_ascii=False).encode("utf-8")]))
    os.replace(tmp, file)


# --------------------------------------------------------------------------------------------
# Reader


class _ShardLayout:
    """A shard's checked safetensors header: where each tensor's bytes are."""

    def __init__(self, header_bytes: bytes, offsets: dict[str, tuple[int, int]], data_start: int):
        self.header_bytes = header_bytes  # the first 8 + header length bytes of the file, for its sha256
        self.offsets = offsets  # key -> (begin, end) in the file
        self.data_start = data_start


def _open_regular(file: Path, what: str) -> tuple[int, int]:
    """``(fd, size)`` for reading ``file``, which must be a regular file and not a symlink
    (O_NOFOLLOW), opened without blocking (O_NONBLOCK: a FIFO would wait for a writer forever)."""
    flags = os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(file, flags)
    except FileNotFoundError:
        raise  # the caller says what is missing
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise BundleError(f"{_show(file)}: {what} is a symbolic link; a bundle holds plain files") from None
        raise BundleError(f"{_show(file)}: cannot read {what}: {err.strerror or err}") from None
    try:
        info = os.fstat(fd)
    except OSError as err:
        os.close(fd)
        raise BundleError(f"{_show(file)}: cannot read {what}: {err.strerror or err}") from None
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise BundleError(f"{_show(file)}: {what} is not a regular file ({_file_type(info.st_mode)})")
    return fd, info.st_size


def _file_type(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a plain file"


def _read_exact(fd: int, offset: int, buffer: memoryview, file: Path) -> None:
    done = 0
    while done < len(buffer):
        try:
            got = os.preadv(fd, [buffer[done:]], offset + done)
        except OSError as err:
            raise BundleError(f"{_show(file)}: cannot read shard: {err.strerror or err}") from None
        if got == 0:
            raise BundleError(f"{_show(file)}: shard truncated while reading (it changed after the bundle was opened)")
        done += got


class BundleReader:
    """A bundle opened for reading: the checked manifest, and tensors loaded lazily and verified.

    Opening checks the manifest against its schema and that every shard exists as a plain file of
    the size the manifest records; a tensor's dtype, shape and checksum are checked when it is
    loaded (:meth:`load`), and ``verified`` records which were. :meth:`verify` checks every tensor
    and every shard file up front.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._check_directory()
        self._manifest: Manifest = load_manifest(self._read_manifest_bytes(), _show(self._manifest_file))
        self.manifest: dict[str, Any] = self._manifest.raw
        self.entries: list[Entry] = list(self._manifest.entries)
        self._index: dict[tuple[str, str], Entry] = {(e.kind, e.name): e for e in self.entries}
        self._shards: dict[str, Shard] = {shard.file: shard for shard in self._manifest.shards}
        self._by_shard: dict[str, dict[str, Entry]] = {name: {} for name in self._shards}
        for entry in self.entries:
            self._by_shard[entry.shard][entry.key] = entry
        self._check_shard_files()
        self._layouts: dict[str, _ShardLayout] = {}
        self._inputs_by_layer: dict[str | None, list[Entry]] | None = None
        self.verified: set[tuple[str, str]] = set()  # (kind, name) of every entry whose checksum was checked

    # opening -------------------------------------------------------------------------------
    @property
    def _manifest_file(self) -> Path:
        return self.path / MANIFEST_NAME

    def _check_directory(self) -> None:
        try:
            mode = os.stat(self.path).st_mode
        except FileNotFoundError:
            recover(self.path)  # an interrupted --force replacement may have parked it
            if not os.path.isdir(self.path):
                raise BundleError(f"bundle {_show(self.path)} does not exist") from None
            mode = os.stat(self.path).st_mode
        except (OSError, ValueError) as err:
            raise BundleError(f"bundle {_show(self.path)}: cannot open: {getattr(err, 'strerror', None) or err}") from None
        if not stat.S_ISDIR(mode):
            raise BundleError(f"bundle {_show(self.path)} is not a directory")

    def _read_manifest_bytes(self) -> bytes:
        file = self._manifest_file
        try:
            fd, size = _open_regular(file, "manifest")
        except FileNotFoundError:
            raise BundleError(f"{_show(file)}: manifest missing; {_show(self.path)} is not a complete parity "
                              "bundle") from None
        try:
            if size > MAX_MANIFEST_BYTES:
                raise BundleError(f"{_show(file)}: manifest of {size} bytes is larger than the "
                                  f"{MAX_MANIFEST_BYTES // 2**20} MiB limit")
            chunks, total = [], 0
            while True:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                total += len(chunk)
                if total > MAX_MANIFEST_BYTES:  # grew while being read
                    raise BundleError(f"{_show(file)}: manifest larger than the {MAX_MANIFEST_BYTES // 2**20} MiB limit")
                chunks.append(chunk)
            return b"".join(chunks)
        except OSError as err:
            raise BundleError(f"{_show(file)}: cannot read manifest: {err.strerror or err}") from None
        finally:
            os.close(fd)

    def _check_shard_files(self) -> None:
        for shard in self._manifest.shards:
            file = self.path / shard.file
            try:
                info = os.lstat(file)
            except FileNotFoundError:
                raise BundleError(f"{_show(file)}: shard missing") from None
            except OSError as err:
                raise BundleError(f"{_show(file)}: cannot read shard: {err.strerror or err}") from None
            if stat.S_ISLNK(info.st_mode):
                raise BundleError(f"{_show(file)}: shard is a symbolic link; a bundle holds plain files")
            if not stat.S_ISREG(info.st_mode):
                raise BundleError(f"{_show(file)}: shard is not a regular file ({_file_type(info.st_mode)})")
            if info.st_size != shard.bytes:
                damage = "truncated" if info.st_size < shard.bytes else "damaged"
                raise BundleError(f"{_show(file)}: shard {damage}: {info.st_size} bytes, manifest says {shard.bytes}")

    # the shard's header --------------------------------------------------------------------
    def _open_shard(self, name: str) -> tuple[int, Path]:
        file = self.path / name
        try:
            fd, size = _open_regular(file, "shard")
        except FileNotFoundError:
            raise BundleError(f"{_show(file)}: shard missing") from None
        if size != self._shards[name].bytes:
            os.close(fd)
            raise BundleError(f"{_show(file)}: shard changed size: {size} bytes, manifest says {self._shards[name].bytes}")
        return fd, file

    def _layout(self, name: str) -> _ShardLayout:
        layout = self._layouts.get(name)
        if layout is None:
            fd, file = self._open_shard(name)
            try:
                layout = self._read_layout(fd, file, self._shards[name].bytes)
            finally:
                os.close(fd)
            self._layouts[name] = layout
        return layout

    def _read_layout(self, fd: int, file: Path, size: int) -> _ShardLayout:
        """Read and check a safetensors header before anything is allocated from it."""
        prefix = bytearray(8)
        _read_exact(fd, 0, memoryview(prefix), file)
        length = struct.unpack("<Q", prefix)[0]
        if length < 2 or length > size - 8 or length > _MAX_HEADER_BYTES:
            raise BundleError(f"{_show(file)}: shard corrupted: header length {length} does not fit the "
                              f"{size}-byte file")
        header_bytes = bytearray(8 + length)
        _read_exact(fd, 0, memoryview(header_bytes), file)
        expected = self._shards[file.name].header_checksum
        if expected is not None and checksums.of_buffer(self._manifest.checksum, header_bytes) != expected:
            raise BundleError(f"{_show(file)}: shard corrupted: header checksum mismatch (the header changed "
                              "after it was written)")
        header = parse_json(bytes(header_bytes[8:]), _show(file), "shard corrupted: invalid header")
        if not isinstance(header, dict):
            raise BundleError(f"{_show(file)}: shard corrupted: the header is not a JSON object")
        data_start = 8 + length
        offsets = self._check_header(file, header, size - data_start)
        return _ShardLayout(bytes(header_bytes), {key: (data_start + b, data_start + e) for key, (b, e) in offsets.items()},
                            data_start)

    def _check_header(self, file: Path, header: dict[str, Any], data_size: int) -> dict[str, tuple[int, int]]:
        """The header must describe exactly this shard's entries, contiguously, as the manifest says."""
        metadata = header.pop("__metadata__", {})
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise BundleError(f"{_show(file)}: shard corrupted: header metadata is not a map of strings")
        expected = self._by_shard[file.name]
        if set(header) != set(expected):
            extra = sorted(set(header) - set(expected))
            missing = sorted(set(expected) - set(header))
            if missing:
                entry = expected[missing[0]]
                raise BundleError(f"{_show(file)}: tensor {printable(missing[0])} ({entry.kind} "
                                  f"'{printable(entry.name, limit=120)}') missing from the shard")
            raise BundleError(f"{_show(file)}: shard corrupted: it holds tensor {printable(extra[0], limit=120)}, which "
                              "the manifest does not list")
        offsets: dict[str, tuple[int, int]] = {}
        for key, info in header.items():
            offsets[key] = self._check_tensor_info(file, key, info, expected[key])
        position = 0
        for key, (begin, end) in sorted(offsets.items(), key=lambda item: item[1]):
            if begin != position:
                problem = "overlaps another" if begin < position else "leaves a gap before it"
                raise BundleError(f"{_show(file)}: shard corrupted: tensor {printable(key)} {problem}")
            position = end
        if position != data_size:
            raise BundleError(f"{_show(file)}: shard corrupted: tensors cover {position} of {data_size} data bytes")
        return offsets

    def _check_tensor_info(self, file: Path, key: str, info: Any, entry: Entry) -> tuple[int, int]:
        label = f"{entry.kind} '{printable(entry.name, limit=120)}'"
        if not isinstance(info, dict):
            raise BundleError(f"{_show(file)}: shard corrupted: header entry of {label} is not an object")
        dtype, shape, span = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        shape_ok = isinstance(shape, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
        span_ok = (isinstance(span, list) and len(span) == 2
                   and all(isinstance(n, int) and not isinstance(n, bool) for n in span) and 0 <= span[0] <= span[1])
        if not isinstance(dtype, str) or dtype not in _ST_NAMES or not shape_ok or not span_ok:
            raise BundleError(f"{_show(file)}: shard corrupted: header entry of {label} is malformed")
        if _ST_NAMES[dtype] != entry.dtype or tuple(shape) != entry.shape:
            raise BundleError(
                f"{_show(file)}: {label} is {_ST_NAMES[dtype]}{shape} in the shard but "
                f"{entry.dtype}{list(entry.shape)} in the manifest")
        if span[1] - span[0] != entry.nbytes:
            raise BundleError(f"{_show(file)}: shard corrupted: {label} spans {span[1] - span[0]} bytes, "
                              f"its shape needs {entry.nbytes}")
        return span[0], span[1]

    # convenient views of the manifest ----------------------------------------------------
    @property
    def schema_version(self) -> int:
        return self._manifest.version

    @property
    def checksum(self) -> str:
        """The algorithm of this bundle's tensor and shard header digests (``"blake3"``, ``"sha256"``)."""
        return self._manifest.checksum

    @property
    def sealed(self) -> bool:
        """Whether the manifest and shard files carry their own checksums (schema 2 and later)."""
        return self._manifest.sealed

    @property
    def shards(self) -> list[Shard]:
        return list(self._manifest.shards)

    @property
    def subject(self) -> dict[str, Any]:
        """``{"spec": ..., "name": ..., "args": {...}}``: what :func:`parity.subjects.load_subject` takes."""
        return self._manifest.subject

    @property
    def impl(self) -> str | None:
        return self._manifest.impl

    @property
    def device(self) -> str | None:
        return self._manifest.device

    @property
    def platform(self) -> dict[str, Any]:
        return self._manifest.platform

    @property
    def kernel_configs(self) -> dict[str, Any] | None:
        return self._manifest.kernel_configs

    @property
    def hooks_check(self) -> dict[str, Any] | None:
        return self._manifest.hooks_check

    @property
    def inputs_meta(self) -> dict[str, Any]:
        return self._manifest.inputs_meta

    @property
    def capture_info(self) -> dict[str, Any]:
        """The manifest's ``capture`` object (``{}`` for bundles not written by capture)."""
        return self._manifest.capture or {}

    @property
    def capture_layers(self) -> list[str] | None:
        """The capture's ``--layers`` globs; None when every module was recorded."""
        return self._manifest.capture_layers

    @property
    def record_inputs(self) -> bool:
        """Whether layer inputs were recorded (``--record-inputs``), so layers can be replayed."""
        return self._manifest.record_inputs

    def subject_inputs(self):
        """The stored subject inputs as :class:`parity.subjects.Inputs` (tensors and ``inputs_meta``)."""
        from .subjects.base import Inputs

        return Inputs(self.tensors("input"), self.inputs_meta)

    def subject_state(self) -> dict[str, torch.Tensor]:
        """The stored subject state (weights and buffers) by state_dict key."""
        return self.tensors("state")

    def module_inputs(self, layer: str, *, device=None) -> dict[str, torch.Tensor]:
        """A recorded layer's input tensors by path (``args/0``, ``kwargs/mask``), for replay."""
        if self._inputs_by_layer is None:
            self._inputs_by_layer = {}
            for entry in self.entries_of("module_input"):
                self._inputs_by_layer.setdefault(entry.layer, []).append(entry)
        return {entry.path or "": self.load(entry, device=device) for entry in self._inputs_by_layer.get(layer, [])}

    def entries_of(self, kind: str) -> list[Entry]:
        """Entries of one kind, in the order they were produced (execution order for outputs)."""
        return [entry for entry in self.entries if entry.kind == kind]

    def has(self, name: str, kind: str = "output") -> bool:
        return (kind, name) in self._index

    def entry(self, name: str, kind: str = "output") -> Entry:
        try:
            return self._index[(kind, name)]
        except KeyError:
            raise BundleError(f"{_show(self._manifest_file)}: no {kind} tensor named "
                              f"'{printable(name, limit=120)}' in the bundle") from None

    def layers(self, group: str = "layers") -> list[dict[str, Any]]:
        """Recorded module calls in execution order (``group``: ``layers`` or ``reference_layers``).

        Each is ``{"name", "module", "call_index", "outputs": tree, "inputs": tree | None}``; a tree
        is the structure of the output or input (see :mod:`parity.recorder`). All checked on open.
        """
        if group == "layers":
            return list(self._manifest.layers)
        if group == "reference_layers":
            return list(self._manifest.reference_layers)
        raise ValueError(f"unknown layer group {group!r}")

    # tensors --------------------------------------------------------------------------------
    def load(self, entry: Entry | str, kind: str = "output", *, device: torch.device | str | None = None) -> torch.Tensor:
        """Load one tensor, verifying dtype, shape and checksum against the manifest."""
        if isinstance(entry, str):
            entry = self.entry(entry, kind)
        layout = self._layout(entry.shard)
        begin, end = layout.offsets[entry.key]
        data = torch.empty(end - begin, dtype=torch.uint8)
        fd, file = self._open_shard(entry.shard)
        try:
            view = memoryview(data.numpy())
            _read_exact(fd, begin, view, file)
        finally:
            os.close(fd)
        if checksums.of_buffer(self._manifest.checksum, view) != entry.checksum:
            raise self._checksum_error(file, entry)
        self.verified.add((entry.kind, entry.name))
        tensor = data.view(entry.torch_dtype).reshape(entry.shape)
        return tensor if device is None else tensor.to(device)

    @staticmethod
    def _checksum_error(file: Path, entry: Entry) -> BundleError:
        return BundleError(f"{_show(file)}: checksum mismatch for {entry.kind} '{printable(entry.name, limit=120)}': "
                           "the shard is corrupted")

    def iter_tensors(self, kind: str = "output", *, device=None) -> Iterator[tuple[Entry, torch.Tensor]]:
        """Stream ``(entry, tensor)`` for one kind in the order recorded; one tensor in memory at a time."""
        for entry in self.entries_of(kind):
            yield entry, self.load(entry, device=device)

    def tensors(self, kind: str, *, device=None) -> dict[str, torch.Tensor]:
        """All tensors of one kind by name (for inputs and state, which are loaded whole)."""
        return {entry.name: tensor for entry, tensor in self.iter_tensors(kind, device=device)}

    def verify(self) -> int:
        """Check every shard (header and its digest, layout, the whole file's sha256 where a version 2
        manifest recorded it) and every tensor's checksum, reading each file once; return how many
        tensors were checked."""
        for shard in self._manifest.shards:
            self._verify_shard(shard)
        self._check_no_stray_files()
        return len(self.entries)

    def _check_no_stray_files(self) -> None:
        """A bundle directory holds its manifest and listed shards only: anything else was added later."""
        expected = {MANIFEST_NAME, *self._shards}
        try:
            names = sorted(os.listdir(self.path))
        except OSError as err:
            raise BundleError(f"bundle {_show(self.path)}: cannot list: {err.strerror or err}") from None
        for name in names:
            if name not in expected:
                raise BundleError(f"{_show(self.path / name)}: the bundle holds a file its manifest does not list")

    def _verify_shard(self, shard: Shard) -> None:
        layout = self._layout(shard.file)
        by_key = self._by_shard[shard.file]
        whole = hashlib.sha256(layout.header_bytes) if shard.sha256 is not None else None  # version 2 only
        buffer = memoryview(bytearray(_READ_CHUNK))
        fd, file = self._open_shard(shard.file)
        try:
            for key, (begin, end) in sorted(layout.offsets.items(), key=lambda item: item[1]):
                digest = checksums.new(self._manifest.checksum)
                for start in range(begin, end, _READ_CHUNK):
                    part = buffer[: min(_READ_CHUNK, end - start)]
                    _read_exact(fd, start, part, file)
                    digest.update(part)
                    if whole is not None:
                        whole.update(part)
                entry = by_key[key]
                if digest.hexdigest() != entry.checksum:
                    raise self._checksum_error(file, entry)
                self.verified.add((entry.kind, entry.name))
        finally:
            os.close(fd)
        if whole is not None and whole.hexdigest() != shard.sha256:
            raise BundleError(f"{_show(file)}: shard checksum mismatch: the file changed after it was written "
                              "(outside the tensors' data)")

    def close(self) -> None:
        self._layouts.clear()

    def __enter__(self) -> "BundleReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_bundle(path: str | os.PathLike) -> BundleReader:
    """Open a bundle for reading (raises BundleError if it is missing or damaged)."""
    return BundleReader(path)
