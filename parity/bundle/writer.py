"""Writing a bundle: :class:`BundleWriter` fills shards through a ring of reused memory, hashes
and writes them on background threads, then writes the manifest and commits the directory
(:mod:`parity.bundle.commit`).

Layout of a bundle directory::

    manifest.json              what was captured, where each tensor lives, and its checksum
    shard-00000.safetensors    tensors, in the order they were produced
    shard-00001.safetensors    ... a new shard starts when the current one reaches its size limit

Tensors are stored under generated keys (``t0000000``) in generated file names, never under
names derived from layer names: a model's layer names may hold slashes, ``..``, unicode or be
very long. The manifest may only name plain files inside the bundle directory.
"""
from __future__ import annotations

import datetime
import json
import os
import secrets
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import torch

from parity import __version__
from parity.base.errors import UsageError
from parity.base.text import printable
from parity.bundle import checksums
from parity.bundle.commit import (
    Mover,
    check_target,
    close_file,
    create_new_file,
    discard,
    fsync_dir,
    make_private_dir,
    recover,
    step,
    sync_and_close,
    write_all,
    write_new_file,
)
from parity.bundle.manifest import (
    DIGEST_FIELD,
    FORMAT_NAME,
    KINDS,
    MANIFEST_NAME,
    SCHEMA_VERSION,
    SEEDS_VERSION,
    WEIGHTS_BY_REFERENCE_VERSION,
    Entry,
    canonical_json,
    parse_json,
    seal,
)
from parity.bundle.shards import DEFAULT_SHARD_BYTES, WRITE_CHECKSUM, dtype_name, shard_chunks, tensor_checksum

# Tensors at least this large are hashed on the writer's hashing thread, smaller ones at once.
_HASH_IN_THREAD_BYTES = 2**20
# The writer copies tensors into a reused ring of one shard's bytes (at most this many; larger
# tensors are copied on their own), each at an offset aligned for any dtype and for vector copies.
_MAX_ARENA_BYTES = 512 * 2**20
_ARENA_ALIGN = 64


def _hash_workers() -> int:
    """Threads that hash a writer's tensors: one fewer than the cores, at least 2 and at most 4.
    Measured on the 2-core machine with sha256, writing 2 GB: 1.1-1.3 GB/s with one hashing
    thread, 1.3-1.9 with two (bench/harness/BENCHMARK.md); hashlib and blake3 release the GIL, so two
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
    header's digest, :mod:`parity.bundle.manifest`), another writes the shard file, and a third fsyncs
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
            step("mkdir", self.target)
            try:
                self._tmp = make_private_dir(self.target)
            except OSError as err:
                raise UsageError(f"cannot write bundle {printable(self.target)}: {err.strerror or err}") from None

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
            discard(self._tmp)
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
            digest = (self._thread("hash").submit(tensor_checksum, data) if nbytes >= _HASH_IN_THREAD_BYTES
                      else tensor_checksum(data))
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
        step("write", file)
        try:
            fd = create_new_file(file)  # here, not on the thread: once add() returns, the file exists
        except OSError as err:
            raise UsageError(f"cannot write {printable(file)}: {err.strerror or err}") from None
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
            chunks = list(shard_chunks(tensors, metadata))
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
            size = write_all(fd, chunks[0]) + write_all(fd, chunks[1])
            for chunk, (digest, in_ring) in zip(chunks[2:], tensors, strict=True):
                size += write_all(fd, chunk)
                if in_ring:
                    if isinstance(digest, Future):
                        digest.exception()  # waits: the hashing thread reads the copy too
                    ring.give_back()
                    owed -= 1
            synced = sync.submit(sync_and_close if durable else close_file, fd, file)  # from here it closes fd
        except OSError as err:  # a full disk, a quota: one line naming the file
            os.close(fd)
            raise UsageError(f"cannot write {printable(file)}: {err.strerror or err}") from None
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
    def finish_shards(self) -> None:
        """Write out every tensor added so far and wait until each shard is on disk (fsynced where
        ``durable``): ``bytes_written`` is then final unless more is added. ``commit`` does this
        first; a caller calls it earlier to measure the writing before it builds the manifest."""
        self.open()
        self._flush()
        self._finish_in_flight()
        for synced in self._syncs:  # every shard is on disk before the manifest names it
            synced.result()
        self._syncs = []

    def commit(self, fields: Mapping[str, Any]) -> Path:
        """Write the manifest (``fields`` plus what the writer owns) and move the bundle into place.

        ``fields`` must be JSON-safe. The writer sets ``format``, ``schema_version``,
        ``parity_version``, ``created``, ``shards``, ``entries`` and ``manifest_sha256``.
        """
        if self._committed:
            raise RuntimeError("bundle already committed")
        self.finish_shards()
        self._stop_threads()
        assert self._tmp is not None
        reserved = {"format", "schema_version", "parity_version", "created", "shards", "entries", "manifest_sha256"}
        clash = reserved & set(fields)
        if clash:
            raise ValueError(f"manifest fields {sorted(clash)} are set by the writer")
        manifest = {
            "format": FORMAT_NAME,
            "schema_version": (SEEDS_VERSION if "seeds" in fields
                               else WEIGHTS_BY_REFERENCE_VERSION if "weights" in fields else SCHEMA_VERSION),
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
        step("write", self._tmp / MANIFEST_NAME)
        self._write(self._tmp / MANIFEST_NAME, iter([(text + "\n").encode("utf-8")]), self.durable)
        step("fsync", self._tmp)
        fsync_dir(self._tmp)
        mover = Mover(self._tmp, self.target)
        try:
            if self.force:
                mover.replace()
            else:
                mover.install()
        except OSError as err:  # a filesystem that refuses the renames: one line, and the partial is removed
            raise UsageError(f"cannot move the bundle into place at {printable(self.target)}: "
                             f"{err.strerror or err}") from None
        finally:
            self._tmp = mover.tmp
        self._committed = True
        return self.target

    @staticmethod
    def _write(file: Path, chunks: Iterator[Any], durable: bool) -> int:
        try:
            return write_new_file(file, chunks, durable)
        except OSError as err:  # a full disk, a quota: one line naming the file
            raise UsageError(f"cannot write {printable(file)}: {err.strerror or err}") from None


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def edit_manifest(path: str | os.PathLike, edit: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``edit`` to a bundle's manifest and write it back sealed (for tests and deliberate fixes:
    an edit by hand would fail the manifest checksum). The result is checked like any manifest."""
    bundle = Path(path)
    file = bundle / MANIFEST_NAME
    manifest = parse_json(file.read_bytes(), printable(file))
    edit(manifest)
    if isinstance(manifest, dict) and DIGEST_FIELD in manifest:  # an edit that drops the digest keeps it dropped
        manifest = seal(manifest)
    tmp = bundle / f".{MANIFEST_NAME}.edit-{secrets.token_hex(4)}"
    write_new_file(tmp, iter([json.dumps(manifest, indent=1, ensure_ascii=False).encode("utf-8")]))
    os.replace(tmp, file)

