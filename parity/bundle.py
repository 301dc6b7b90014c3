"""Golden bundles: a directory of safetensors shards plus ``manifest.json``, written atomically.

Layout of a bundle directory::

    manifest.json              what was captured, where each tensor lives, and its checksum
    shard-00000.safetensors    tensors, in the order they were produced
    shard-00001.safetensors    ... a new shard starts when the current one reaches its size limit

Tensors are stored under generated keys (``t0000000``) in generated file names, never under
names derived from layer names: a model's layer names may hold slashes, ``..``, unicode or be
very long. Every path read from a manifest is checked to stay inside the bundle directory.

Reading never executes code: the manifest is JSON and tensors come from safetensors (no pickle,
no ``torch.load``). Every tensor's sha256 is checked when it is read. Any damage (missing or
invalid manifest, unknown schema, missing or truncated shard, checksum mismatch, a tensor that
disagrees with the manifest) is one :class:`~parity.errors.BundleError` line naming the file.

Writing goes to a hidden temporary directory next to the target, which is renamed into place only
once the manifest is complete; an exception or KeyboardInterrupt removes it and leaves any existing
bundle at the target untouched. An existing bundle is replaced only with ``force=True``.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from . import __version__
from .errors import BundleError, UsageError

FORMAT_NAME = "parity-bundle"
SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
DEFAULT_SHARD_BYTES = 256 * 1024 * 1024

# What an entry holds: the subject's inputs and state (weights, buffers), a recorded module output,
# a recorded module input (for replaying one layer), and a high-precision reference of an output.
KINDS = ("input", "state", "output", "module_input", "reference")

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16",
        "float8_e4m3fn", "float8_e5m2",
        "int64", "int32", "int16", "int8", "uint8", "bool",
    )
    if hasattr(torch, name)
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}

_ENTRY_FIELDS = ("kind", "name", "dtype", "shape", "shard", "key", "sha256", "nbytes")


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name for a torch dtype (``"bfloat16"``)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise UsageError(f"tensors of dtype {dtype} cannot be stored in a bundle") from None


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes in C order (native little-endian), independent of its strides."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()  # hashes the buffer, no copy


@dataclasses.dataclass(frozen=True)
class Entry:
    """One stored tensor, as the manifest describes it.

    ``name`` is unique within a ``kind``. For recorded tensors (``output``, ``module_input``,
    ``reference``), ``layer`` is the layer name (``layers.0.attn`` or ``layers.0.attn#1``),
    ``module`` the module path, ``call_index`` which call of that module, and ``path`` the key of
    the tensor inside the module's (flattened) output or input: ``""`` for a bare tensor, else
    e.g. ``"0"``, ``"logits"``, ``"args/0"``; ``name == layer`` or ``f"{layer}/{path}"``.
    """

    kind: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: str
    key: str
    sha256: str
    nbytes: int
    layer: str | None = None
    module: str | None = None
    call_index: int | None = None
    path: str | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["shape"] = list(self.shape)
        return data


# --------------------------------------------------------------------------------------------
# Writer


def check_target(path: str | os.PathLike, *, force: bool) -> Path:
    """Raise UsageError unless a bundle may be written at ``path``; return it as a Path.

    Without ``force`` the target must not exist. With ``force`` it may be an existing bundle
    (a directory holding ``manifest.json``) or an empty directory; anything else is refused, so
    that ``--force`` never deletes a directory of someone's files.
    """
    target = Path(path)
    if not target.exists() and not target.is_symlink():
        if not target.parent.is_dir():
            raise UsageError(f"cannot write bundle {target}: parent directory {target.parent} does not exist")
        return target
    if not force:
        raise UsageError(f"output {target} already exists; pass --force to replace it")
    if target.is_symlink() or not target.is_dir():
        raise UsageError(f"output {target} exists and is not a directory; refusing to replace it")
    if not (target / MANIFEST_NAME).is_file() and any(target.iterdir()):
        raise UsageError(f"output {target} exists and is not a parity bundle; refusing to replace it")
    return target


def _partial_prefix(target: Path) -> str:
    """Hidden sibling directory a bundle is written in before the rename: ``.NAME.partial-HOST-PID-*``."""
    host = "".join(ch if ch.isalnum() else "_" for ch in os.uname().nodename) or "host"
    return f".{target.name}.partial-{host}-"


def _remove_stale_partials(target: Path) -> None:
    """Delete partial directories of ``target`` left by a writer on this host that no longer runs
    (a capture killed with SIGKILL cannot clean up). Another host's, or a live process's, stay."""
    prefix = _partial_prefix(target)
    try:
        siblings = list(target.parent.glob(prefix + "*"))
    except OSError:
        return
    for path in siblings:
        pid_text = path.name[len(prefix):].split("-", 1)[0]
        if not pid_text.isdigit() or not path.is_dir():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (PermissionError, OverflowError):
            continue  # alive under another user, or not a pid


class BundleWriter:
    """Writes a bundle shard by shard; use as a context manager and call :meth:`commit`.

    >>> with BundleWriter(out, force=False) as writer:
    ...     writer.add("input", "x", x)
    ...     writer.commit({"subject": {...}})

    Tensors are buffered (copied to CPU) until the current shard reaches ``shard_bytes``, then
    written; memory held is bounded by one shard. Leaving the ``with`` block without a commit
    (an exception, KeyboardInterrupt) deletes everything written.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        force: bool = False,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        progress: Callable[[str], None] | None = None,
    ):
        if shard_bytes <= 0:
            raise UsageError(f"shard size must be positive, got {shard_bytes} bytes")
        self.target = check_target(path, force=force)
        self.force = force
        self.shard_bytes = int(shard_bytes)
        self._progress = progress
        self._tmp: Path | None = None
        self._entries: list[Entry] = []
        self._names: set[tuple[str, str]] = set()
        self._shards: list[dict[str, Any]] = []
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_meta: list[dict[str, Any]] = []
        self._pending_bytes = 0
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
            _remove_stale_partials(self.target)
            self._tmp = Path(tempfile.mkdtemp(prefix=_partial_prefix(self.target) + f"{os.getpid()}-",
                                              dir=self.target.parent))

    def abort(self) -> None:
        """Delete everything written so far; the target is left as it was."""
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        self._pending.clear()
        self._pending_meta.clear()

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
    ) -> None:
        """Queue one tensor; it is copied to CPU now and written when its shard fills up.

        ``copy=False`` skips the copy of a CPU tensor the caller hands over and never changes
        (the recorder's copies).
        """
        if kind not in KINDS:
            raise ValueError(f"unknown entry kind {kind!r}; expected one of {KINDS}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"entry {name!r} is a {type(tensor).__name__}, not a tensor")
        if (kind, name) in self._names:
            raise UsageError(f"two recorded {kind} tensors share the name {name!r}; names must be unique")
        self.open()
        dtype = dtype_name(tensor.dtype)
        data = tensor.detach().to("cpu", copy=copy).contiguous()
        nbytes = data.numel() * data.element_size()
        if self._pending and self._pending_bytes + nbytes > self.shard_bytes:
            self._flush()
        key = f"t{len(self._entries) + len(self._pending):07d}"
        self._names.add((kind, name))
        self._pending[key] = data
        self._pending_bytes += nbytes
        self._pending_meta.append(
            dict(kind=kind, name=name, dtype=dtype, shape=tuple(data.shape), key=key,
                 sha256=tensor_sha256(data), nbytes=nbytes, layer=layer, module=module,
                 call_index=call_index, path=path)
        )

    def _flush(self) -> None:
        if not self._pending:
            return
        from safetensors.torch import save_file

        assert self._tmp is not None
        shard = f"shard-{len(self._shards):05d}.safetensors"
        file = self._tmp / shard
        save_file(self._pending, str(file), metadata={"format": "pt", FORMAT_NAME: str(SCHEMA_VERSION)})
        _fsync(file)
        size = file.stat().st_size
        self._shards.append({"file": shard, "bytes": size, "tensors": len(self._pending)})
        self._entries.extend(Entry(shard=shard, **meta) for meta in self._pending_meta)
        self.bytes_written += size
        if self._progress is not None:
            self._progress(
                f"wrote {shard}: {len(self._pending)} tensors, {_mib(size)}; "
                f"{len(self._entries)} tensors, {_mib(self.bytes_written)} in all"
            )
        self._pending = {}
        self._pending_meta = []
        self._pending_bytes = 0

    # finishing -----------------------------------------------------------------------------
    def commit(self, fields: Mapping[str, Any]) -> Path:
        """Write the manifest (``fields`` plus what the writer owns) and move the bundle into place.

        ``fields`` must be JSON-safe. The writer sets ``format``, ``schema_version``,
        ``parity_version``, ``created``, ``shards`` and ``entries``.
        """
        if self._committed:
            raise RuntimeError("bundle already committed")
        self.open()
        self._flush()
        assert self._tmp is not None
        reserved = {"format", "schema_version", "parity_version", "created", "shards", "entries"}
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
            "entries": [entry.to_json() for entry in self._entries],
        }
        try:
            text = json.dumps(manifest, indent=1, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise UsageError(f"bundle manifest is not JSON-safe: {err}") from None
        manifest_tmp = self._tmp / (MANIFEST_NAME + ".tmp")
        manifest_tmp.write_text(text + "\n", encoding="utf-8")
        _fsync(manifest_tmp)
        os.replace(manifest_tmp, self._tmp / MANIFEST_NAME)
        self._move_into_place()
        self._committed = True
        return self.target

    def _move_into_place(self) -> None:
        assert self._tmp is not None
        # Checked again: another process may have created the target while we captured.
        check_target(self.target, force=self.force)
        old: Path | None = None
        if self.target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.old-", dir=self.target.parent))
            os.rmdir(old)
            os.rename(self.target, old)
        try:
            os.rename(self._tmp, self.target)
        except BaseException:
            if old is not None:
                os.rename(old, self.target)
            raise
        self._tmp = None
        _fsync_dir(self.target.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _fsync(file: Path) -> None:
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    try:
        _fsync(directory)
    except OSError:  # not every filesystem lets a directory be opened for fsync
        pass


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


# --------------------------------------------------------------------------------------------
# Reader


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


class BundleReader:
    """A bundle opened for reading: the manifest, and tensors loaded lazily and verified.

    Opening checks the manifest and that every shard exists with the size the manifest records;
    a tensor's checksum, dtype and shape are checked when it is loaded (:meth:`load`). Use
    :meth:`verify` to check every tensor up front.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise BundleError(f"bundle {self.path} does not exist")
        if not self.path.is_dir():
            raise BundleError(f"bundle {self.path} is not a directory")
        self._root = self.path.resolve()
        self.manifest = self._read_manifest()
        self._shard_files: dict[str, Path] = {}
        self._check_shards()
        self.entries: list[Entry] = self._read_entries()
        self._index: dict[tuple[str, str], Entry] = {(e.kind, e.name): e for e in self.entries}
        if len(self._index) != len(self.entries):
            raise BundleError(f"{self._manifest_file}: two entries share a kind and name")
        self._handles: dict[str, Any] = {}
        self._inputs_by_layer: dict[str, list[Entry]] | None = None

    # manifest -------------------------------------------------------------------------------
    @property
    def _manifest_file(self) -> Path:
        return self.path / MANIFEST_NAME

    def _read_manifest(self) -> dict[str, Any]:
        file = self._manifest_file
        if not file.is_file():
            raise BundleError(f"{file}: manifest missing; {self.path} is not a complete parity bundle")
        try:
            manifest = json.loads(file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise BundleError(f"{file}: invalid JSON: {_one_line(err)}") from None
        if not isinstance(manifest, dict):
            raise BundleError(f"{file}: invalid manifest: expected a JSON object")
        if manifest.get("format") != FORMAT_NAME:
            raise BundleError(f"{file}: not a parity bundle manifest (format is {manifest.get('format')!r})")
        version = manifest.get("schema_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise BundleError(f"{file}: invalid manifest: schema_version is {version!r}, expected an integer")
        if version != SCHEMA_VERSION:
            newer = " (written by a newer parity; upgrade parity)" if version > SCHEMA_VERSION else ""
            raise BundleError(
                f"{file}: unknown schema version {version}; this parity reads version {SCHEMA_VERSION}{newer}"
            )
        for field, kind in (("shards", list), ("entries", list), ("subject", dict)):
            if not isinstance(manifest.get(field), kind):
                raise BundleError(f"{file}: invalid manifest: {field!r} missing or not a {kind.__name__}")
        return manifest

    def _inside(self, name: object, what: str) -> Path:
        """Resolve a relative path from the manifest, refusing anything outside the bundle."""
        if not isinstance(name, str) or not name or "\x00" in name:
            raise BundleError(f"{self._manifest_file}: invalid manifest: {what} file name {name!r}")
        candidate = Path(name)
        resolved = (self._root / candidate).resolve()
        if candidate.is_absolute() or not resolved.is_relative_to(self._root) or resolved == self._root:
            raise BundleError(f"{self._manifest_file}: {what} file {name!r} points outside the bundle directory")
        return resolved

    def _check_shards(self) -> None:
        for number, shard in enumerate(self.manifest["shards"]):
            if not isinstance(shard, dict):
                raise BundleError(f"{self._manifest_file}: invalid manifest: shard {number} is not an object")
            name = shard.get("file")
            file = self._inside(name, "shard")
            expected = shard.get("bytes")
            if not isinstance(expected, int) or isinstance(expected, bool):
                raise BundleError(f"{self._manifest_file}: invalid manifest: shard {name!r} has no byte size")
            if not file.is_file():
                raise BundleError(f"{self.path / name}: shard missing")
            actual = file.stat().st_size
            if actual != expected:
                damage = "truncated" if actual < expected else "damaged"
                raise BundleError(f"{self.path / name}: shard {damage}: {actual} bytes, manifest says {expected}")
            self._shard_files[name] = file

    def _read_entries(self) -> list[Entry]:
        entries = []
        where = self._manifest_file
        for number, raw in enumerate(self.manifest["entries"]):
            if not isinstance(raw, dict):
                raise BundleError(f"{where}: invalid manifest: entry {number} is not an object")
            missing = [field for field in _ENTRY_FIELDS if field not in raw]
            if missing:
                raise BundleError(f"{where}: invalid manifest: entry {number} lacks {', '.join(missing)}")
            label = f"entry {number} ({raw.get('kind')} {raw.get('name')!r})"
            if raw["kind"] not in KINDS:
                raise BundleError(f"{where}: invalid manifest: {label} has unknown kind")
            if raw["dtype"] not in _DTYPES:
                raise BundleError(f"{where}: invalid manifest: {label} has unknown dtype {raw['dtype']!r}")
            shape = raw["shape"]
            if not isinstance(shape, list) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
            ):
                raise BundleError(f"{where}: invalid manifest: {label} has invalid shape {shape!r}")
            if raw["shard"] not in self._shard_files:
                self._inside(raw["shard"], "shard")  # an escaping path is reported as such
                raise BundleError(f"{where}: invalid manifest: {label} is in unlisted shard {raw['shard']!r}")
            if not isinstance(raw["name"], str) or not isinstance(raw["key"], str):
                raise BundleError(f"{where}: invalid manifest: {label} has a non-string name or key")
            fields = {f.name: raw.get(f.name) for f in dataclasses.fields(Entry)}
            fields["shape"] = tuple(shape)
            entries.append(Entry(**fields))
        return entries

    # convenient views of the manifest ----------------------------------------------------
    @property
    def subject(self) -> dict[str, Any]:
        """``{"spec": ..., "name": ..., "args": {...}}``: what :func:`parity.subjects.load_subject` takes."""
        return self.manifest["subject"]

    @property
    def impl(self) -> str | None:
        return self.manifest.get("impl")

    @property
    def platform(self) -> dict[str, Any]:
        return self.manifest.get("platform") or {}

    @property
    def kernel_configs(self) -> dict[str, Any] | None:
        return self.manifest.get("kernel_configs")

    @property
    def hooks_check(self) -> dict[str, Any] | None:
        return self.manifest.get("hooks_check")

    def subject_inputs(self):
        """The stored subject inputs as :class:`parity.subjects.Inputs` (tensors and ``inputs_meta``)."""
        from .subjects.base import Inputs

        meta = self.manifest.get("inputs_meta") or {}
        if not isinstance(meta, dict):
            raise BundleError(f"{self._manifest_file}: invalid manifest: 'inputs_meta' is not an object")
        return Inputs(self.tensors("input"), meta)

    def subject_state(self) -> dict[str, torch.Tensor]:
        """The stored subject state (weights and buffers) by state_dict key."""
        return self.tensors("state")

    def module_inputs(self, layer: str, *, device=None) -> dict[str, torch.Tensor]:
        """A recorded layer's input tensors by path (``args/0``, ``kwargs/mask``), for replay."""
        if self._inputs_by_layer is None:
            self._inputs_by_layer = {}
            for entry in self.entries_of("module_input"):
                self._inputs_by_layer.setdefault(entry.layer, []).append(entry)
        return {entry.path: self.load(entry, device=device) for entry in self._inputs_by_layer.get(layer, [])}

    def entries_of(self, kind: str) -> list[Entry]:
        """Entries of one kind, in the order they were produced (execution order for outputs)."""
        return [entry for entry in self.entries if entry.kind == kind]

    def has(self, name: str, kind: str = "output") -> bool:
        return (kind, name) in self._index

    def entry(self, name: str, kind: str = "output") -> Entry:
        try:
            return self._index[(kind, name)]
        except KeyError:
            raise BundleError(f"{self._manifest_file}: no {kind} tensor named {name!r} in the bundle") from None

    def layers(self, group: str = "layers") -> list[dict[str, Any]]:
        """Recorded module calls in execution order (``group``: ``layers`` or ``reference_layers``).

        Each is ``{"name", "module", "call_index", "outputs": tree, "inputs": tree | None}``; a tree
        is the structure of the output or input (see :mod:`parity.recorder`).
        """
        layers = self.manifest.get(group) or []
        if not isinstance(layers, list):
            raise BundleError(f"{self._manifest_file}: invalid manifest: {group!r} is not a list")
        return layers

    # tensors --------------------------------------------------------------------------------
    def _handle(self, shard: str):
        handle = self._handles.get(shard)
        if handle is None:
            from safetensors import safe_open

            file = self._shard_files[shard]
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as err:  # safetensors raises its own error type for a damaged header
                raise BundleError(f"{file}: shard corrupted: {_one_line(err)}") from None
            self._handles[shard] = handle
        return handle

    def load(self, entry: Entry | str, kind: str = "output", *, device: torch.device | str | None = None) -> torch.Tensor:
        """Load one tensor, verifying dtype, shape and checksum against the manifest."""
        if isinstance(entry, str):
            entry = self.entry(entry, kind)
        file = self._shard_files[entry.shard]
        handle = self._handle(entry.shard)
        if entry.key not in handle.keys():
            raise BundleError(f"{file}: tensor {entry.key} ({entry.kind} {entry.name!r}) missing from the shard")
        try:
            tensor = handle.get_tensor(entry.key)
        except Exception as err:
            raise BundleError(f"{file}: shard corrupted reading {entry.kind} {entry.name!r}: {_one_line(err)}") from None
        if tensor.dtype != entry.torch_dtype or tuple(tensor.shape) != entry.shape:
            raise BundleError(
                f"{file}: {entry.kind} {entry.name!r} is {dtype_name(tensor.dtype)}{list(tensor.shape)} in the "
                f"shard but {entry.dtype}{list(entry.shape)} in the manifest"
            )
        if tensor_sha256(tensor) != entry.sha256:
            raise BundleError(f"{file}: checksum mismatch for {entry.kind} {entry.name!r}: the shard is corrupted")
        return tensor if device is None else tensor.to(device)

    def iter_tensors(self, kind: str = "output", *, device=None) -> Iterator[tuple[Entry, torch.Tensor]]:
        """Stream ``(entry, tensor)`` for one kind in the order recorded; one tensor in memory at a time."""
        for entry in self.entries_of(kind):
            yield entry, self.load(entry, device=device)

    def tensors(self, kind: str, *, device=None) -> dict[str, torch.Tensor]:
        """All tensors of one kind by name (for inputs and state, which are loaded whole)."""
        return {entry.name: tensor for entry, tensor in self.iter_tensors(kind, device=device)}

    def verify(self) -> int:
        """Load and check every tensor; return how many were checked."""
        for entry in self.entries:
            self.load(entry)
        return len(self.entries)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "BundleReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_bundle(path: str | os.PathLike) -> BundleReader:
    """Open a bundle for reading (raises BundleError if it is missing or damaged)."""
    return BundleReader(path)

