"""Reading a bundle: :class:`BundleReader` checks the manifest and the shard files, parses each
shard's safetensors header, and loads and verifies tensors (:func:`open_bundle`).

Reading never executes code: the manifest is JSON, checked against the schema in
:mod:`parity.bundle.manifest` before any field is used, and tensors are read from the safetensors
files by this module (the 8-byte header length is checked against the file size, the header
against the manifest, then the bytes are read with ``pread``: no pickle, no ``torch.load``, no
memory map that a truncated file could turn into SIGBUS). A shard's header digest is checked when
its header is first read, every tensor's digest when it is read (BLAKE3 from schema 4, sha256
before: :mod:`parity.bundle.checksums`); :meth:`BundleReader.verify`
checks every shard and every tensor in one pass, hashing each byte once (:mod:`parity.bundle.manifest`).
Any damage is one :class:`~parity.base.errors.BundleError` line naming the file.
"""
from __future__ import annotations

import errno
import hashlib
import os
import stat
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from parity.base.errors import BundleError
from parity.base.text import printable
from parity.bundle import checksums
from parity.bundle.commit import recover
from parity.bundle.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Entry, Manifest, Shard, load_manifest, parse_json
from parity.bundle.shards import MAX_HEADER_BYTES, ST_NAMES
from parity.bundle.staging import DeviceStager

_READ_CHUNK = 16 * 2**20
# What the single-bundle path knows of rank sets (parity.distributed.rankset), to refuse them: a set's
# directory holds this top manifest, and a rank's bundle manifest names its set under this field.
RANK_SET_MANIFEST = "rankset.json"
RANK_SET_FIELD = "distributed"
_TAKE_A_SET = "compare, diff, verify and show take a rank set"


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
            raise BundleError(f"{printable(file)}: {what} is a symbolic link; a bundle holds plain files") from None
        raise BundleError(f"{printable(file)}: cannot read {what}: {err.strerror or err}") from None
    try:
        info = os.fstat(fd)
    except OSError as err:
        os.close(fd)
        raise BundleError(f"{printable(file)}: cannot read {what}: {err.strerror or err}") from None
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise BundleError(f"{printable(file)}: {what} is not a regular file ({_file_type(info.st_mode)})")
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
            raise BundleError(f"{printable(file)}: cannot read shard: {err.strerror or err}") from None
        if got == 0:
            raise BundleError(f"{printable(file)}: shard truncated while reading (it changed after the bundle was opened)")
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
        self._manifest: Manifest = load_manifest(self._read_manifest_bytes(), printable(self._manifest_file))
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
        self._stagers: dict[torch.device, DeviceStager] = {}
        self._stagers_lock = threading.Lock()

    # opening -------------------------------------------------------------------------------
    @property
    def _manifest_file(self) -> Path:
        return self.path / MANIFEST_NAME

    def _check_directory(self) -> None:
        # First, whether or not the target exists: an interrupted --force replacement may have
        # parked the old bundle, and a killed writer's partial directory (up to a whole bundle's
        # size, hidden beside the target) is deleted by the next reader as well as the next
        # writer. Only directories whose writer process is gone from this host are touched.
        recover(self.path)
        try:
            mode = os.stat(self.path).st_mode
        except FileNotFoundError:
            raise BundleError(f"bundle {printable(self.path)} does not exist") from None
        except (OSError, ValueError) as err:
            raise BundleError(f"bundle {printable(self.path)}: cannot open: {getattr(err, 'strerror', None) or err}") from None
        if not stat.S_ISDIR(mode):
            raise BundleError(f"bundle {printable(self.path)} is not a directory")

    def _read_manifest_bytes(self) -> bytes:
        file = self._manifest_file
        try:
            fd, size = _open_regular(file, "manifest")
        except FileNotFoundError:
            if (self.path / RANK_SET_MANIFEST).is_file():
                raise _rank_set_error(self.path) from None
            raise BundleError(f"{printable(file)}: manifest missing; {printable(self.path)} is not a complete parity "
                              "bundle") from None
        try:
            if size > MAX_MANIFEST_BYTES:
                raise BundleError(f"{printable(file)}: manifest of {size} bytes is larger than the "
                                  f"{MAX_MANIFEST_BYTES // 2**20} MiB limit")
            chunks, total = [], 0
            while True:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                total += len(chunk)
                if total > MAX_MANIFEST_BYTES:  # grew while being read
                    raise BundleError(f"{printable(file)}: manifest larger than the {MAX_MANIFEST_BYTES // 2**20} MiB limit")
                chunks.append(chunk)
            return b"".join(chunks)
        except OSError as err:
            raise BundleError(f"{printable(file)}: cannot read manifest: {err.strerror or err}") from None
        finally:
            os.close(fd)

    def _check_shard_files(self) -> None:
        for shard in self._manifest.shards:
            file = self.path / shard.file
            try:
                info = os.lstat(file)
            except FileNotFoundError:
                raise BundleError(f"{printable(file)}: shard missing") from None
            except OSError as err:
                raise BundleError(f"{printable(file)}: cannot read shard: {err.strerror or err}") from None
            if stat.S_ISLNK(info.st_mode):
                raise BundleError(f"{printable(file)}: shard is a symbolic link; a bundle holds plain files")
            if not stat.S_ISREG(info.st_mode):
                raise BundleError(f"{printable(file)}: shard is not a regular file ({_file_type(info.st_mode)})")
            if info.st_size != shard.bytes:
                damage = "truncated" if info.st_size < shard.bytes else "damaged"
                raise BundleError(f"{printable(file)}: shard {damage}: {info.st_size} bytes, manifest says {shard.bytes}")

    # the shard's header --------------------------------------------------------------------
    def _open_shard(self, name: str) -> tuple[int, Path]:
        file = self.path / name
        try:
            fd, size = _open_regular(file, "shard")
        except FileNotFoundError:
            raise BundleError(f"{printable(file)}: shard missing") from None
        if size != self._shards[name].bytes:
            os.close(fd)
            raise BundleError(f"{printable(file)}: shard changed size: {size} bytes, manifest says {self._shards[name].bytes}")
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
        if length < 2 or length > size - 8 or length > MAX_HEADER_BYTES:
            raise BundleError(f"{printable(file)}: shard corrupted: header length {length} does not fit the "
                              f"{size}-byte file")
        header_bytes = bytearray(8 + length)
        _read_exact(fd, 0, memoryview(header_bytes), file)
        expected = self._shards[file.name].header_checksum
        if expected is not None and checksums.of_buffer(self._manifest.checksum, header_bytes) != expected:
            raise BundleError(f"{printable(file)}: shard corrupted: header checksum mismatch (the header changed "
                              "after it was written)")
        header = parse_json(bytes(header_bytes[8:]), printable(file), "shard corrupted: invalid header")
        if not isinstance(header, dict):
            raise BundleError(f"{printable(file)}: shard corrupted: the header is not a JSON object")
        data_start = 8 + length
        offsets = self._check_header(file, header, size - data_start)
        return _ShardLayout(bytes(header_bytes), {key: (data_start + b, data_start + e) for key, (b, e) in offsets.items()},
                            data_start)

    def _check_header(self, file: Path, header: dict[str, Any], data_size: int) -> dict[str, tuple[int, int]]:
        """The header must describe exactly this shard's entries, contiguously, as the manifest says."""
        metadata = header.pop("__metadata__", {})
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise BundleError(f"{printable(file)}: shard corrupted: header metadata is not a map of strings")
        expected = self._by_shard[file.name]
        if set(header) != set(expected):
            extra = sorted(set(header) - set(expected))
            missing = sorted(set(expected) - set(header))
            if missing:
                entry = expected[missing[0]]
                raise BundleError(f"{printable(file)}: tensor {printable(missing[0])} ({entry.kind} "
                                  f"'{printable(entry.name, limit=120)}') missing from the shard")
            raise BundleError(f"{printable(file)}: shard corrupted: it holds tensor {printable(extra[0], limit=120)}, which "
                              "the manifest does not list")
        offsets: dict[str, tuple[int, int]] = {}
        for key, info in header.items():
            offsets[key] = self._check_tensor_info(file, key, info, expected[key])
        position = 0
        for key, (begin, end) in sorted(offsets.items(), key=lambda item: item[1]):
            if begin != position:
                problem = "overlaps another" if begin < position else "leaves a gap before it"
                raise BundleError(f"{printable(file)}: shard corrupted: tensor {printable(key)} {problem}")
            position = end
        if position != data_size:
            raise BundleError(f"{printable(file)}: shard corrupted: tensors cover {position} of {data_size} data bytes")
        return offsets

    def _check_tensor_info(self, file: Path, key: str, info: Any, entry: Entry) -> tuple[int, int]:
        label = f"{entry.kind} '{printable(entry.name, limit=120)}'"
        if not isinstance(info, dict):
            raise BundleError(f"{printable(file)}: shard corrupted: header entry of {label} is not an object")
        dtype, shape, span = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        shape_ok = isinstance(shape, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
        span_ok = (isinstance(span, list) and len(span) == 2
                   and all(isinstance(n, int) and not isinstance(n, bool) for n in span) and 0 <= span[0] <= span[1])
        if not isinstance(dtype, str) or dtype not in ST_NAMES or not shape_ok or not span_ok:
            raise BundleError(f"{printable(file)}: shard corrupted: header entry of {label} is malformed")
        if ST_NAMES[dtype] != entry.dtype or tuple(shape) != entry.shape:
            raise BundleError(
                f"{printable(file)}: {label} is {ST_NAMES[dtype]}{shape} in the shard but "
                f"{entry.dtype}{list(entry.shape)} in the manifest")
        if span[1] - span[0] != entry.nbytes:
            raise BundleError(f"{printable(file)}: shard corrupted: {label} spans {span[1] - span[0]} bytes, "
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
        """``{"spec": ..., "name": ..., "args": {...}}``: what :func:`parity.run.subjects.load_subject` takes."""
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

    @property
    def seeds(self) -> dict[str, Any] | None:
        """The input draws of ``capture --seeds`` (schema 6, :mod:`parity.run.seeds`); None for one draw."""
        return self._manifest.seeds

    @property
    def weights(self) -> dict[str, Any] | None:
        """The checkpoint files named instead of stored weights (schema 5, :mod:`parity.bundle.weights`)."""
        return self._manifest.weights

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
            raise BundleError(f"{printable(self._manifest_file)}: no {kind} tensor named "
                              f"'{printable(name, limit=120)}' in the bundle") from None

    def layers(self, group: str = "layers") -> list[dict[str, Any]]:
        """Recorded module calls in execution order (``group``: ``layers`` or ``reference_layers``).

        Each is ``{"name", "module", "call_index", "outputs": tree, "inputs": tree | None}``; a tree
        is the structure of the output or input (see :mod:`parity.run.recorder`). All checked on open.
        """
        if group == "layers":
            return list(self._manifest.layers)
        if group == "reference_layers":
            return list(self._manifest.reference_layers)
        raise ValueError(f"unknown layer group {group!r}")

    # tensors --------------------------------------------------------------------------------
    def load(self, entry: Entry | str, kind: str = "output", *, device: torch.device | str | None = None) -> torch.Tensor:
        """Load one tensor, verifying dtype, shape and checksum against the manifest.

        The bytes are read once, into the tensor's own buffer, and hashed there (no second pass
        over the file); on an accelerator, see :meth:`load_to`.
        """
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

    def load_to(self, entry: Entry | str, kind: str = "output", *, device: torch.device | str,
                stream: Any | None = None) -> torch.Tensor:
        """:meth:`load` onto ``device``. On a CUDA (or ROCm) device the bytes go through the reader's
        ring of page-locked pieces (:mod:`parity.bundle.staging`): each read, hashed and copied on
        asynchronously on a side stream while the next is read, so the host holds a few pieces,
        not the tensor, and the copies run at the link's speed (a pageable copy is staged and
        synchronous). ``stream``: the stream that will use the tensor (default: the calling
        thread's current one); it waits for the copies. The checksum is checked once the last
        piece is read; a mismatch is raised as by :meth:`load`. Thread-safe."""
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return self.load(entry, kind, device=device)
        return self._load_staged(self.entry(entry, kind) if isinstance(entry, str) else entry, self.stager(device),
                                 stream)

    def stager(self, device: torch.device | str) -> DeviceStager:
        """The reader's ring of page-locked pieces onto ``device`` (made on first use, released by
        :meth:`close`): one per device, shared by every thread that loads through it."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        with self._stagers_lock:
            if device not in self._stagers:
                self._stagers[device] = DeviceStager.for_device(device)
            return self._stagers[device]

    def _load_staged(self, entry: Entry, stager: DeviceStager, stream: Any | None = None) -> torch.Tensor:
        """:meth:`load_to`'s pieces through ``stager``, each hashed as it is read."""
        begin, end = self._layout(entry.shard).offsets[entry.key]
        digest = checksums.new(self._manifest.checksum)
        fd, file = self._open_shard(entry.shard)

        def fill(piece: torch.Tensor, offset: int) -> None:
            view = memoryview(piece.numpy())
            _read_exact(fd, begin + offset, view, file)
            digest.update(view)

        try:
            out = stager.load(end - begin, fill, stream)
        finally:
            os.close(fd)
        if digest.hexdigest() != entry.checksum:
            raise self._checksum_error(file, entry)
        self.verified.add((entry.kind, entry.name))
        return out.view(entry.torch_dtype).reshape(entry.shape)

    @staticmethod
    def _checksum_error(file: Path, entry: Entry) -> BundleError:
        return BundleError(f"{printable(file)}: checksum mismatch for {entry.kind} '{printable(entry.name, limit=120)}': "
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
            raise BundleError(f"bundle {printable(self.path)}: cannot list: {err.strerror or err}") from None
        for name in names:
            if name not in expected:
                raise BundleError(f"{printable(self.path / name)}: the bundle holds a file its manifest does not list")

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
            raise BundleError(f"{printable(file)}: shard checksum mismatch: the file changed after it was written "
                              "(outside the tensors' data)")

    def close(self) -> None:
        self._layouts.clear()
        with self._stagers_lock:
            stagers, self._stagers = list(self._stagers.values()), {}
        for stager in stagers:
            stager.close()

    def __enter__(self) -> "BundleReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _rank_set_error(path: Path) -> BundleError:
    """A rank set's directory given where one bundle is taken (world size from its top manifest, where
    readable: the set itself is checked by parity.distributed, which opens it whole)."""
    try:
        with open(path / RANK_SET_MANIFEST, "rb") as handle:
            world = parse_json(handle.read(MAX_MANIFEST_BYTES), "").get("world_size")
    except (OSError, BundleError, AttributeError):
        world = None
    size = f" (world size {world})" if isinstance(world, int) and not isinstance(world, bool) else ""
    return BundleError(f"{printable(path)} is a rank set{size}, not a single bundle: this command takes one bundle "
                       f"({_TAKE_A_SET})")


def set_membership(reader: BundleReader) -> dict[str, Any] | None:
    """What a rank's bundle records of its rank set (``set_id``, ``rank``, ``world_size``, checked by
    parity.distributed.rankset when it opens the set); None for a bundle of its own."""
    info = reader.manifest.get(RANK_SET_FIELD)
    return info if isinstance(info, dict) else None


def _lone_rank_error(reader: BundleReader) -> BundleError:
    info = set_membership(reader) or {}
    rank, world = info.get("rank"), info.get("world_size")
    parent = reader.path.parent if reader.path.parent != Path(".") else reader.path.resolve().parent
    which = (f"rank {rank} of the rank set {printable(parent)} (world size {world})"
             if isinstance(rank, int) and isinstance(world, int) else f"one rank's bundle of the rank set {printable(parent)}")
    return BundleError(f"{printable(reader.path)} is {which}; pass the set directory {printable(parent)} "
                       f"({_TAKE_A_SET})")


def open_bundle(path: str | os.PathLike, *, rank_of_a_set: bool = False) -> BundleReader:
    """Open a bundle for reading (raises BundleError if it is missing or damaged).

    A rank set's directory is refused, and so is one rank's bundle of a set unless ``rank_of_a_set``:
    it holds that rank's shards of each tensor, which mean something only within the set (judged
    alone they would be taken for full tensors). parity.distributed opens the ranks of a set with it, and
    ``verify`` and ``show`` (which judge nothing) accept a lone rank's bundle.
    """
    reader = BundleReader(path)
    if not rank_of_a_set and reader.manifest.get(RANK_SET_FIELD) is not None:
        raise _lone_rank_error(reader)
    return reader
