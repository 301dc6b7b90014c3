"""Weights by reference: a bundle that names the checkpoint's safetensors files (with their BLAKE3) instead of storing the weights.

Both hosts of a port usually hold the model's checkpoint already; storing its weights again in
every bundle costs their size per bundle (20 GB at ten billion bf16 parameters). A bundle captured
with ``weights_from`` records, in the manifest's ``weights`` object (schema version 5):

- ``files``: each checkpoint file's name, the path it had on the capture host, its size and its
  BLAKE3 (``blake3``). Bundles captured before the BLAKE3 record the file's ``sha256`` instead,
  and bundles of one parity version record both; compare checks the BLAKE3 where it is recorded,
  else the sha256. Capture no longer takes the sha256: one file's sha256 is one sequential pass
  on one core (1.22 GB/s on an H200 host: 16 s for the 19.6 GB single-file checkpoint of a 10B
  model, docs/scale.md), a floor under every capture of such a model whatever it records,
  where BLAKE3 hashes one file on every core;
- ``tensors``: ``[state name, file index, key in that file]`` for every state tensor a file holds.

State tensors no file holds (buffers, or a tied weight that is not an alias of a stored one) are
stored in the bundle as before. At capture every referenced tensor is checked equal (bitwise) to
the file's, one tensor at a time, so the bundle cannot name files that are not what ran; the
files' digests are taken on a thread of their own meanwhile (:class:`BackgroundDigests`: nothing
needs them before the manifest is written, which waits for them). Compare verifies every file's
size and digest (:func:`verify`) *before* it builds the model and refuses a mismatch with one
line naming the file, then reads the weights from the files one tensor at a time. Nothing in a
checkpoint is executed: safetensors is data.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import blake3
import torch
from safetensors import safe_open

from parity.base.errors import UsageError
from parity.base.prefetch import default_workers
from parity.base.text import printable

# sha256 is read in blocks of this size (hashlib releases the GIL on large updates).
_READ_BYTES = 16 * 2**20
# BLAKE3 hashes a mapped file in slices of this size, each on every core; between two slices a
# hashing thread that was told to stop (a capture that failed meanwhile) returns.
_BLAKE3_SLICE_BYTES = 256 * 2**20

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


@dataclasses.dataclass(frozen=True)
class CheckpointFile:
    """One checkpoint file: where it is, its size and keys, and its digests once taken (empty
    before; ``sha256`` stays empty in what capture takes now, :func:`describe`)."""
    path: Path
    bytes: int
    keys: tuple[str, ...]
    blake3: str = ""
    sha256: str = ""
    # (device, inode, size, modification time in ns) when located: the file the weights check and
    # the digest read must still be this one when the digest is recorded (``_identity``)
    identity: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    files: list[CheckpointFile]

    def location(self) -> dict[str, tuple[int, str]]:
        """state key -> (file index, key): the first file that holds a key wins."""
        where: dict[str, tuple[int, str]] = {}
        for index, file in enumerate(self.files):
            for key in file.keys:
                where.setdefault(key, (index, key))
        return where


def _blocks(path: Path) -> Iterator[bytes]:
    """The file's blocks in order, the next one read (``pread``, on a thread of its own) while the
    caller hashes this one: reading and hashing both release the GIL, so a cold file is hashed at
    about the slower of the disk and the hash rather than at the two one after the other."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        with contextlib.suppress(OSError, AttributeError):  # a hint: read ahead further, drop behind
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="parity-digest-read") as reader:
            offset = 0
            pending = reader.submit(os.pread, fd, _READ_BYTES, offset)
            while block := pending.result():
                offset += len(block)
                pending = reader.submit(os.pread, fd, _READ_BYTES, offset)
                yield block
    finally:
        os.close(fd)


def sha256_of(path: Path) -> str:
    """The file's sha256, read ahead of the hash (``_blocks``; one file's sha256 cannot be split)."""
    digest = hashlib.sha256()
    for block in _blocks(path):
        digest.update(block)
    return digest.hexdigest()


def digests_of(path: Path) -> tuple[str, str]:
    """(sha256, BLAKE3) of the file in one read (``_blocks``): the BLAKE3 of each block on another
    thread (on every core) while this one feeds the sha256: about the sha256's pass for both. What
    recording the sha256 beside the BLAKE3 would cost a capture (``bench/checkpoint_sha256.py``
    times it against the BLAKE3 alone)."""
    sha = hashlib.sha256()
    b3 = blake3.blake3(max_threads=blake3.blake3.AUTO)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="parity-blake3") as hasher:
        for block in _blocks(path):
            other = hasher.submit(b3.update, block)
            sha.update(block)
            other.result()
    return sha.hexdigest(), b3.hexdigest()


def blake3_of(path: Path, stop: threading.Event | None = None) -> str:
    """The file's BLAKE3, hashed on every core: the file mapped, fed to the hash a slice at a time
    (no copy; each slice split over the hash's own threads). ``stop`` set: return "" at the next
    slice (a capture that failed does not wait for the hash of a checkpoint it will not record)."""
    digest = blake3.blake3(max_threads=blake3.blake3.AUTO)
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if not size:  # an empty file cannot be mapped
            return digest.hexdigest()
        with mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_READ) as mapped:
            with contextlib.suppress(AttributeError, OSError):  # a hint: read ahead further
                mapped.madvise(mmap.MADV_SEQUENTIAL)
            view = memoryview(mapped)
            try:
                for offset in range(0, size, _BLAKE3_SLICE_BYTES):
                    if stop is not None and stop.is_set():
                        return ""
                    digest.update(view[offset:offset + _BLAKE3_SLICE_BYTES])
            finally:
                view.release()
    return digest.hexdigest()


def sha256_in_turn(path: Path) -> str:
    """:func:`sha256_of` with each block read, then hashed (for ``bench/checkpoint_sha256.py``)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_READ_BYTES):
            digest.update(block)
    return digest.hexdigest()


def sha256_of_each(paths: Sequence[Path]) -> list[str]:
    """The sha256 of every file, several files at a time: one file's sha256 runs on one core at
    about the speed of a disk (1.4-1.8 GB/s), and a checkpoint is several files, so hashing them
    in turn would take the disk's time again per core-bound file instead of overlapping them."""
    if len(paths) <= 1:
        return [sha256_of(path) for path in paths]
    with ThreadPoolExecutor(max_workers=min(len(paths), default_workers()), thread_name_prefix="parity-sha256") as pool:
        return list(pool.map(sha256_of, paths))


def _files_of(paths: Sequence[str | os.PathLike]) -> list[Path]:
    files: list[Path] = []
    for item in paths:
        path = Path(item)
        if path.is_dir():
            found = sorted(path.glob("*.safetensors"))
            if not found:
                raise UsageError(f"--weights-from {printable(str(path))}: the directory holds no .safetensors file")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise UsageError(f"--weights-from {printable(str(path))}: no such file or directory")
    names = [file.name for file in files]
    if len(set(names)) != len(names):
        raise UsageError("--weights-from: two checkpoint files share a file name; compare finds files by name")
    return files


def locate(paths: Sequence[str | os.PathLike]) -> Checkpoint:
    """The checkpoint files named by ``paths`` (files, or directories of ``*.safetensors``): their
    sizes and tensor keys, from the files' headers; no digest yet (:class:`BackgroundDigests`).
    A UsageError names a path that is missing or not safetensors."""
    located = []
    for path in _files_of(paths):
        with _open_checkpoint(path) as handle:
            keys = tuple(handle.keys())
        identity = _identity(path)
        located.append(CheckpointFile(path.resolve(), identity[2], keys, identity=identity))
    return Checkpoint(located)


def _identity(path: Path) -> tuple[int, ...]:
    """What changes when a file is replaced or rewritten in place: device, inode, size and
    modification time (ns). A rewrite that restores the modification time is not seen."""
    stat = path.stat()
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def _check_unchanged(file: CheckpointFile) -> None:
    """A UsageError (one line naming the file) where it is no longer the file that was located:
    the weights were checked and hashed over a span in which it could have been rewritten."""
    try:
        now = _identity(file.path)
    except OSError as err:
        raise UsageError(f"--weights-from {printable(str(file.path))}: cannot read it after the capture's run: "
                         f"{err.strerror or err}") from None
    if file.identity and now != file.identity:
        raise UsageError(f"--weights-from {printable(str(file.path))}: the file changed during the capture "
                         f"({file.identity[2]} bytes when located, {now[2]} now, or rewritten in place): "
                         "the digest would not be of the weights that ran")


def _open_checkpoint(path: Path) -> Any:
    """``safe_open`` of a checkpoint file; a UsageError (one line naming it) where its header is
    malformed, or no longer covers the file (it changed after it was located)."""
    try:
        return safe_open(str(path), framework="pt")
    except Exception as err:  # safetensors raises its own error types for a malformed header
        raise UsageError(f"--weights-from {printable(str(path))}: not a safetensors file "
                         f"({' '.join(str(err).split())[:120]})") from None


class BackgroundDigests:
    """The BLAKE3 of every file of a checkpoint, taken on a thread of its own (the files one after
    the other, each on every core) while the caller builds and runs the model: nothing needs them
    before the manifest is written. :meth:`result` waits for them and returns the checkpoint with
    its digests, or raises a UsageError (one line naming the file) where a file could not be read
    or changed size while it was hashed. Leaving the ``with`` block without :meth:`result` (the
    capture failed) stops the thread at its next slice and waits for it: no thread outlives the
    block. ``seconds``: how long the hashing took, on its thread."""

    def __init__(self, checkpoint: Checkpoint, hash_file: Callable[[Path, threading.Event], str] | None = None):
        self.checkpoint = checkpoint
        self.seconds = 0.0
        self._hash_file = hash_file or blake3_of
        self._stop = threading.Event()
        self._digests: list[str] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="parity-checkpoint-digests", daemon=True)

    def __enter__(self) -> "BackgroundDigests":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        started = time.monotonic()
        try:
            for file in self.checkpoint.files:
                digest = self._hash_file(file.path, self._stop)
                if self._stop.is_set():
                    return
                size = file.path.stat().st_size
                if size != file.bytes:
                    raise UsageError(f"--weights-from {printable(str(file.path))}: the file changed while it was "
                                     f"hashed ({file.bytes} bytes when read, {size} after)")
                _check_unchanged(file)
                self._digests.append(digest)
        except OSError as err:
            self._error = UsageError(f"--weights-from {printable(str(getattr(err, 'filename', None) or file.path))}: "
                                     f"cannot read it for its digest: {err.strerror or err}")
        except BaseException as err:  # raised again, as it is, by result() on the caller's thread
            self._error = err
        finally:
            self.seconds = time.monotonic() - started

    def result(self) -> Checkpoint:
        """The checkpoint with every file's BLAKE3, once the thread is done (it raises what the thread
        raised), each file checked to be the one located (``_check_unchanged``): the caller asks
        after its weights check, so the digests recorded are of the weights that ran."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        for file in self.checkpoint.files:  # after the weights check too: a rewrite since is refused
            _check_unchanged(file)
        return Checkpoint([dataclasses.replace(file, blake3=digest)
                           for file, digest in zip(self.checkpoint.files, self._digests)])


def describe(paths: Sequence[str | os.PathLike]) -> Checkpoint:
    """:func:`locate` and the files' BLAKE3, taken now (for a caller with nothing to overlap them with)."""
    with BackgroundDigests(locate(paths)) as digests:
        return digests.result()


def file_entries(checkpoint: Checkpoint) -> list[dict[str, Any]]:
    """The manifest's ``weights.files`` of ``checkpoint``: the digests it holds."""
    return [{"name": file.path.name, "path": str(file.path), "bytes": file.bytes,
             **({"sha256": file.sha256} if file.sha256 else {}), **({"blake3": file.blake3} if file.blake3 else {})}
            for file in checkpoint.files]


def by_reference(checkpoint: Checkpoint, state: Mapping[str, torch.Tensor]) -> tuple[dict[str, Any], list[str]]:
    """The manifest's ``weights`` object for ``state`` (the module's own tensors; ``files`` with the
    digests ``checkpoint`` holds: :func:`file_entries` again once they are taken) and the names of
    the state tensors no file holds (to be stored in the bundle). Every referenced tensor is
    compared bitwise with the file's, one at a time; a UsageError names the first that differs.
    A tensor that is an alias of a referenced one (a tied weight) is referenced too."""
    where = checkpoint.location()
    tensors: list[list[Any]] = []
    stored: list[str] = []
    by_storage: dict[tuple[int, tuple[int, ...], tuple[int, ...], str], tuple[int, str]] = {}
    handles: dict[int, Any] = {}
    for name, tensor in state.items():
        alias = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), str(tensor.device))
        if name not in where and alias in by_storage and tensor.numel() > 0:
            index, key = by_storage[alias]
            tensors.append([name, index, key])
            continue
        if name not in where:
            stored.append(name)
            continue
        index, key = where[name]
        if index not in handles:
            handles[index] = _open_checkpoint(checkpoint.files[index].path)
        # Compared where the module's tensor is: one file tensor at a time goes to the device
        # (the model, on a GPU, is not copied back to the host).
        on_file = handles[index].get_tensor(key).to(tensor.device)
        mine = tensor.detach()
        if on_file.dtype != mine.dtype or tuple(on_file.shape) != tuple(mine.shape) or not torch.equal(
                on_file.view(-1).view(torch.uint8) if on_file.numel() else on_file,
                mine.contiguous().view(-1).view(torch.uint8) if mine.numel() else mine):
            raise UsageError(f"--weights-from: state tensor {printable(name)!r} differs from {key!r} in "
                             f"{checkpoint.files[index].path.name} ({mine.dtype}{list(mine.shape)} here, "
                             f"{on_file.dtype}{list(on_file.shape)} in the file, or other values): the model "
                             "that ran does not hold these weights")
        del on_file, mine
        tensors.append([name, index, key])
        if tensor.numel() > 0:
            by_storage[alias] = (index, key)
    handles.clear()
    return {"files": file_entries(checkpoint), "tensors": tensors}, stored


def _where(file: Mapping[str, Any], directory: str | os.PathLike | None) -> Path:
    """Where a named checkpoint file is looked for: in ``directory`` by name, else its recorded path."""
    return Path(directory) / file["name"] if directory is not None else Path(file["path"])


def _check_size(file: Mapping[str, Any], path: Path) -> None:
    if path.stat().st_size != file["bytes"]:
        raise UsageError(f"checkpoint file {printable(str(path))} is {path.stat().st_size} bytes, the bundle was "
                         f"captured with {file['bytes']}: not the same weights")


def _check_files(pairs: Sequence[tuple[Mapping[str, Any], Path]], checksums: bool = True) -> None:
    """Sizes, then digests of checkpoint files that are there: the BLAKE3 where the bundle records
    one (each file on every core, in turn), else the sha256 (several files at a time); a
    UsageError naming the first, in the bundle's order, whose size or digest differs."""
    for file, path in pairs:
        _check_size(file, path)
    if not checksums:
        return
    by_blake3 = [(file, path) for file, path in pairs if "blake3" in file]
    by_sha256 = [(file, path) for file, path in pairs if "blake3" not in file]
    found = {id(file): ("BLAKE3", blake3_of(path)) for file, path in by_blake3}
    found.update((id(file), ("sha256", digest)) for (file, _), digest in
                 zip(by_sha256, sha256_of_each([path for _, path in by_sha256])))
    for file, path in pairs:
        name, digest = found[id(file)]
        if digest != file["blake3" if name == "BLAKE3" else "sha256"]:
            raise UsageError(f"checkpoint file {printable(str(path))} does not match the bundle's {name}: not the "
                             "weights the golden was captured with")


def verify(weights: Mapping[str, Any], directory: str | os.PathLike | None = None, *,
           checksums: bool = True) -> list[Path]:
    """The checkpoint files a bundle names, found (in ``directory`` by name, else at the recorded
    path) and verified: size, then digest (``_check_files``; ``checksums=False``: the size alone,
    where another process checks the same files' digests). A UsageError (exit 2) names the first file that is
    missing or differs; nothing is built before this returns."""
    found: list[tuple[Mapping[str, Any], Path]] = []
    for file in weights["files"]:
        path = _where(file, directory)
        if not path.is_file():
            hint = "" if directory is not None else "; pass --weights-dir DIR where the checkpoint is on this host"
            raise UsageError(f"checkpoint file {printable(str(path))} named by the bundle is not there{hint}")
        found.append((file, path))
    _check_files(found, checksums)
    return [path for _, path in found]


def verify_present(weights: Mapping[str, Any], directory: str | os.PathLike | None = None) -> tuple[
        list[Path], list[Path]]:
    """``(verified, missing)``: every named file that is there verified (size, sha256; a UsageError
    names the first that differs), and where each one that is not there was looked for. For
    ``parity verify``, which reports every file it could not check rather than the first."""
    present: list[tuple[Mapping[str, Any], Path]] = []
    missing: list[Path] = []
    for file in weights["files"]:
        path = _where(file, directory)
        if not path.is_file():
            missing.append(path)
            continue
        present.append((file, path))
    _check_files(present)
    return [path for _, path in present], missing


def file_state(weights: Mapping[str, Any], files: Sequence[Path]) -> tuple[
        dict[str, tuple[tuple[int, ...], torch.dtype]], Callable[[str], torch.Tensor]]:
    """(name -> (shape, dtype), load(name)) of the state tensors the verified ``files`` hold: read
    one at a time, from the file's header for the shapes, from its data for a tensor asked for."""
    place = {name: (index, key) for name, index, key in weights["tensors"]}
    meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    handles: dict[int, Any] = {}

    def handle(index: int) -> Any:
        if index not in handles:
            handles[index] = safe_open(str(files[index]), framework="pt")
        return handles[index]

    for name, (index, key) in place.items():
        sliced = handle(index).get_slice(key)
        meta[name] = (tuple(sliced.get_shape()), _DTYPES[sliced.get_dtype()])

    lock = threading.Lock()  # the state is read ahead on threads; one read of the files at a time

    def load(name: str) -> torch.Tensor:
        index, key = place[name]
        with lock:
            return handle(index).get_tensor(key)

    return meta, load
