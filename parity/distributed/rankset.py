"""A rank set on disk: one bundle per rank plus a top manifest, committed as a whole and opened only whole.

Layout::

    SET/rankset.json        world size, mesh, each rank's bundle and its manifest digest, each tensor's placement
    SET/rank-00000/         rank 0's bundle (parity.bundle): its shards of every recorded tensor,
                            plus the subject's inputs and full state (stored once, by rank 0)
    SET/rank-00001/         rank 1's bundle: its shards only
    ...

Commit protocol (:func:`prepare` and :func:`commit`, driven by :mod:`parity.distributed.capture`):

1. rank 0 prepares the directory: with ``force``, the old ``rankset.json`` is deleted *first*
   (and the deletion synced), so from then on the old set no longer opens as valid;
2. every rank writes its bundle with the bundle writer's own atomic commit (parity.bundle), whose
   manifest records the set's id (a random token rank 0 drew for this capture), its rank and the
   world size;
3. after a barrier, rank 0 writes ``rankset.json`` atomically (a temporary file, fsynced, renamed,
   the directory fsynced), naming each rank's bundle by its manifest digest.

So a set whose capture was interrupted anywhere, a rank killed included, has no top manifest, and
:func:`open_rank_set` refuses it with one line naming the missing or unfinished rank; a rank
bundle replaced after the commit (a stale or foreign rank) no longer matches its recorded digest
or set id and is refused too. The top manifest is data like a bundle manifest: parsed strictly,
sealed with the sha256 of its canonical JSON, every field checked before use (a shard placement's
dim too, against the tensor it places). A rank's bundle holds its shards only: the single-bundle
path (:func:`parity.bundle.reader.open_bundle`) refuses it, and the set alone opens its ranks.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from parity import __version__
from parity.bundle.reader import RANK_SET_FIELD, RANK_SET_MANIFEST, BundleReader, open_bundle, set_membership
from parity.base.errors import BundleError, UsageError
from parity.base.files import write_atomically
from parity.bundle.manifest import DIGEST_FIELD, MANIFEST_NAME, canonical_json, manifest_digest, parse_json, seal
from parity.base.text import printable
from .placement import Placement, placement_from_json

TOP_NAME = RANK_SET_MANIFEST
FORMAT = "parity-rank-set"
VERSION = 1
MAX_TOP_BYTES = 256 * 2**20
MAX_WORLD_SIZE = 65536
# The field of a rank bundle's manifest that ties it to its set.
BUNDLE_FIELD = RANK_SET_FIELD
_RANK_DIR = re.compile(r"rank-(\d{5,})")
# A rank's bundle being written (parity.bundle's hidden partial directory, ``.NAME.partial-HOST-PID-*``).
_RANK_PARTIAL = re.compile(r"\.rank-(\d{5,})\.partial-.*")
_HEX = re.compile(r"[0-9a-f]{64}")
_SET_ID = re.compile(r"[0-9a-f]{32}")


def rank_dir(rank: int) -> str:
    return f"rank-{rank:05d}"


def _show(path: object) -> str:
    return printable(str(path))


def looks_like_rank_set(path: str | os.PathLike) -> bool:
    """A directory holding ``rankset.json`` or a rank's bundle (``rank-NNNNN``, complete or partial): what
    the CLI routes to the rank-set commands, so an unfinished set is reported as one."""
    root = Path(path)
    try:
        if (root / TOP_NAME).is_file():
            return True
        return root.is_dir() and not (root / MANIFEST_NAME).exists() and any(
            _RANK_DIR.fullmatch(entry.name) or _RANK_PARTIAL.fullmatch(entry.name) for entry in os.scandir(root))
    except OSError:
        return False


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # not every filesystem lets a directory be fsynced
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------
# Writing (rank 0)


def prepare(path: str | os.PathLike, *, world_size: int, force: bool) -> Path:
    """Rank 0, before any rank writes: make ``path`` ready for a new set; UsageError if it may not be.

    A missing directory is created (its parent must exist). An existing rank set is refused without
    ``force``; with it, its top manifest is deleted first (the old set stops being valid before
    anything of the new one is written) and bundles of ranks beyond the new world size are
    removed. An existing directory that is neither empty nor a rank set is never touched.
    """
    root = Path(path)
    try:
        info = os.lstat(root)
    except FileNotFoundError:
        if not root.parent.is_dir():
            raise UsageError(f"cannot write rank set {_show(root)}: parent directory {_show(root.parent)} "
                             "does not exist") from None
        try:
            os.mkdir(root, 0o777)
        except FileExistsError:
            raise UsageError(f"output {_show(root)} was created by another process; pass --force to replace it") from None
        except OSError as err:
            raise UsageError(f"cannot write rank set {_show(root)}: {err.strerror or err}") from None
        _fsync_directory(root.parent)
        return root
    if not stat.S_ISDIR(info.st_mode):
        raise UsageError(f"output {_show(root)} exists and is not a directory; refusing to replace it")
    names = os.listdir(root)
    if not names:
        return root
    if not looks_like_rank_set(root) or any(
            name != TOP_NAME and not _RANK_DIR.fullmatch(name) and not name.startswith(".rank-") for name in names):
        raise UsageError(f"output {_show(root)} exists and is not a parity rank set; refusing to replace it")
    if not force:
        raise UsageError(f"output {_show(root)} already exists; pass --force to replace it")
    try:
        os.unlink(root / TOP_NAME)
    except FileNotFoundError:
        pass
    except OSError as err:
        raise UsageError(f"cannot replace rank set {_show(root)}: {err.strerror or err}") from None
    _fsync_directory(root)
    for name in names:
        match = _RANK_DIR.fullmatch(name)
        if match and int(match.group(1)) >= world_size:
            shutil.rmtree(root / name, ignore_errors=True)
    return root


def bundle_fields(set_id: str, rank: int, world_size: int) -> dict[str, Any]:
    """What a rank's bundle manifest records of its set (under ``distributed``)."""
    return {BUNDLE_FIELD: {"set_id": set_id, "rank": rank, "world_size": world_size}}


def commit(path: str | os.PathLike, *, set_id: str, world_size: int, mesh: Mapping[str, Any], backend: str,
           ranks: list[dict[str, Any]], placements: Mapping[str, Placement],
           placement_rules: list[dict[str, Any]]) -> Path:
    """Rank 0, after every rank committed its bundle: write the top manifest atomically, last.

    ``ranks``: ``{"rank", "bundle", "manifest_sha256"}`` of every rank, in rank order.
    """
    root = Path(path)
    top = {
        "format": FORMAT,
        "version": VERSION,
        "parity_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "set_id": set_id,
        "world_size": world_size,
        "mesh": dict(mesh),
        "backend": backend,
        "ranks": ranks,
        "placements": {name: placement.to_json() for name, placement in placements.items()},
        "placement_rules": placement_rules,
    }
    try:
        canonical_json(top)
        text = json.dumps(seal(top), indent=1, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise UsageError(f"rank set manifest is not JSON-safe: {err}") from None
    write_atomically(root / TOP_NAME, text + "\n", "rank set manifest")
    _fsync_directory(root)
    return root


# --------------------------------------------------------------------------------------------
# Opening


@dataclasses.dataclass
class RankSet:
    """A committed, checked rank set: ``ranks[r]`` is rank r's open bundle."""

    path: Path
    set_id: str
    world_size: int
    mesh: dict[str, Any]
    backend: str
    ranks: list[BundleReader]
    placements: dict[str, Placement]
    raw: dict[str, Any]

    @property
    def rank0(self) -> BundleReader:
        return self.ranks[0]

    def close(self) -> None:
        for reader in self.ranks:
            reader.close()


def _fail(root: Path, problem: str) -> BundleError:
    return BundleError(f"rank set {_show(root)}: {problem}")


def _diagnose_unfinished(root: Path) -> BundleError:
    """No top manifest: name the rank that is missing or unfinished, as far as the directory tells.

    A rank whose process died while writing leaves its partial bundle directory (nobody removes
    it before the next capture of the set): that rank is named first. Otherwise the first rank,
    of the world size the committed bundles record, whose bundle is missing.
    """
    names = sorted(os.listdir(root))
    died = sorted({int(match.group(1)) for name in names for match in [_RANK_PARTIAL.fullmatch(name)] if match})
    if died:
        listed = ", ".join(map(str, died))
        return _fail(root, f"not committed (no {TOP_NAME}): rank {listed}'s bundle was never finished (a partial "
                           "bundle is left: that rank died during the capture)")
    present: dict[int, BundleReader | BundleError] = {}
    for entry in names:
        match = _RANK_DIR.fullmatch(entry)
        if match:
            try:
                present[int(match.group(1))] = open_bundle(root / entry, rank_of_a_set=True)
            except BundleError as err:
                present[int(match.group(1))] = err
    world_sizes = {info["world_size"] for reader in present.values() if isinstance(reader, BundleReader)
                   for info in [set_membership(reader)] if info and isinstance(info.get("world_size"), int)}
    world = max(world_sizes) if world_sizes else None
    expected = range(world) if world is not None and 0 < world <= MAX_WORLD_SIZE else sorted(present)
    for rank in expected:
        found = present.get(rank)
        if found is None:
            return _fail(root, f"not committed (no {TOP_NAME}): rank {rank}'s bundle {rank_dir(rank)} is missing; "
                               "that rank died or the capture did not finish")
        if isinstance(found, BundleError):
            return _fail(root, f"not committed (no {TOP_NAME}): rank {rank}'s bundle is unusable: {found}")
    return _fail(root, f"not committed (no {TOP_NAME}): the capture did not finish (rank 0 never committed the set"
                       + (f" of {world} ranks)" if world is not None else ")"))


def _read_top(root: Path) -> dict[str, Any]:
    file = root / TOP_NAME
    try:
        info = os.lstat(file)
    except FileNotFoundError:
        raise _diagnose_unfinished(root) from None
    except OSError as err:
        raise _fail(root, f"cannot read {TOP_NAME}: {err.strerror or err}") from None
    if not stat.S_ISREG(info.st_mode):
        raise _fail(root, f"{TOP_NAME} is not a regular file")
    if info.st_size > MAX_TOP_BYTES:
        raise _fail(root, f"{TOP_NAME} of {info.st_size} bytes is larger than the {MAX_TOP_BYTES // 2**20} MiB limit")
    with open(file, "rb") as handle:
        data = handle.read(MAX_TOP_BYTES + 1)
    raw = parse_json(data, _show(file))
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise _fail(root, f"{TOP_NAME} is not a parity rank set manifest")
    if raw.get("version") != VERSION:
        raise _fail(root, f"{TOP_NAME}: unknown version {printable(repr(raw.get('version')), limit=40)}; this parity "
                          f"reads version {VERSION}")
    stored = raw.get(DIGEST_FIELD)
    if not isinstance(stored, str) or not _HEX.fullmatch(stored) or stored != manifest_digest(raw):
        raise _fail(root, f"{TOP_NAME}: checksum mismatch: the manifest was changed after it was written")
    return raw


def _int(root: Path, value: Any, field: str, minimum: int, maximum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= maximum:
        raise _fail(root, f"{TOP_NAME}: {field} must be an integer from {minimum} to {maximum}")
    return value


def open_rank_set(path: str | os.PathLike) -> RankSet:
    """Open and check a rank set; a BundleError (exit 2, one line naming the rank) unless it is whole.

    Checked: the top manifest (format, version, seal, types), that it lists every rank 0..N-1 in
    order at ``rank-NNNNN``, that each rank's bundle opens (its own checks, :class:`BundleReader`),
    is the one committed (its manifest digest) and belongs to this set (set id, rank, world size),
    that every rank recorded the same tensors, and that every recorded output has a placement.
    """
    root = Path(path)
    if not root.is_dir():
        raise BundleError(f"rank set {_show(root)} does not exist or is not a directory")
    raw = _read_top(root)
    world = _int(root, raw.get("world_size"), "world_size", 1, MAX_WORLD_SIZE)
    set_id = raw.get("set_id")
    if not isinstance(set_id, str) or not _SET_ID.fullmatch(set_id):
        raise _fail(root, f"{TOP_NAME}: set_id must be 32 hex digits")
    mesh = raw.get("mesh")
    if not isinstance(mesh, dict) or mesh.get("shape") != [world]:
        raise _fail(root, f"{TOP_NAME}: mesh must be an object with shape [{world}] (1-D meshes only)")
    backend = raw.get("backend")
    if not isinstance(backend, str) or len(backend) > 100:
        raise _fail(root, f"{TOP_NAME}: backend must be a short string")
    listed = raw.get("ranks")
    if not isinstance(listed, list) or len(listed) != world:
        raise _fail(root, f"{TOP_NAME}: ranks must list all {world} ranks")
    readers: list[BundleReader] = []
    for rank, item in enumerate(listed):
        if not isinstance(item, dict) or item.get("rank") != rank or item.get("bundle") != rank_dir(rank):
            raise _fail(root, f"{TOP_NAME}: ranks[{rank}] must be rank {rank} at {rank_dir(rank)}")
        digest = item.get("manifest_sha256")
        if not isinstance(digest, str) or not _HEX.fullmatch(digest):
            raise _fail(root, f"{TOP_NAME}: ranks[{rank}].manifest_sha256 must be 64 hex digits")
        where = root / rank_dir(rank)
        if not where.is_dir():
            raise _fail(root, f"rank {rank}'s bundle {rank_dir(rank)} is missing")
        try:
            reader = open_bundle(where, rank_of_a_set=True)
        except BundleError as err:
            raise _fail(root, f"rank {rank}'s bundle is unusable: {err}") from None
        if reader.manifest.get(DIGEST_FIELD) != digest:
            raise _fail(root, f"rank {rank}'s bundle {rank_dir(rank)} is stale: it is not the bundle the set was "
                              "committed with (replaced or rewritten afterwards)")
        info = set_membership(reader)
        if info is None or info.get("set_id") != set_id or info.get("rank") != rank or info.get("world_size") != world:
            raise _fail(root, f"rank {rank}'s bundle {rank_dir(rank)} belongs to another capture (its set id, rank or "
                              "world size differs)")
        readers.append(reader)
    placements_raw = raw.get("placements")
    if not isinstance(placements_raw, dict):
        raise _fail(root, f"{TOP_NAME}: placements must be an object")
    placements = {name: placement_from_json(value, f"rank set {_show(root)}: placement of '{printable(name, limit=120)}'")
                  for name, value in placements_raw.items()}
    _check_same_tensors(root, readers, placements)
    return RankSet(path=root, set_id=set_id, world_size=world, mesh=mesh, backend=backend, ranks=readers,
                   placements=_fit_placements(root, readers[0], placements), raw=raw)


def _check_same_tensors(root: Path, readers: list[BundleReader], placements: Mapping[str, Placement]) -> None:
    for kind in ("output", "reference"):
        names = [entry.name for entry in readers[0].entries_of(kind)]
        for rank, reader in enumerate(readers[1:], start=1):
            other = [entry.name for entry in reader.entries_of(kind)]
            if other != names:
                missing = sorted(set(names) - set(other)) or sorted(set(other) - set(names)) or names[:1]
                raise _fail(root, f"rank {rank} recorded other {kind} tensors than rank 0 "
                                  f"(first: '{printable(missing[0], limit=120)}')")
        for name in names:
            if name not in placements:
                raise _fail(root, f"{kind} tensor '{printable(name, limit=120)}' has no placement in {TOP_NAME}")


def _fit_placements(root: Path, rank0: BundleReader, placements: Mapping[str, Placement]) -> dict[str, Placement]:
    """Each placement with its shard dim counted from the front (``shard(-1)`` of a 3-D tensor is
    ``shard(2)``); a BundleError naming the tensor whose shard dim its recorded tensors do not have."""
    fitted = dict(placements)
    for kind in ("output", "reference"):
        for entry in rank0.entries_of(kind):
            placement, ndim = placements[entry.name], len(entry.shape)
            if placement.dim is not None and not -ndim <= placement.dim < ndim:
                allowed = f"a shard dim from {-ndim} to {ndim - 1}" if ndim else "a scalar is not sharded"
                raise _fail(root, f"{TOP_NAME}: tensor '{printable(entry.name, limit=120)}' is placed "
                                  f"{placement.text}, but it has {ndim} dimensions ({allowed})")
            fitted[entry.name] = placement.normalized(ndim, what=entry.name)
    return fitted


def verify_rank_set(path: str | os.PathLike, summary: Any) -> list[str]:
    """``parity verify`` of a rank set: open it whole (:func:`open_rank_set`), then verify every rank's
    bundle (:meth:`BundleReader.verify`); the lines to print (``summary(reader)``: one bundle's).
    A BundleError naming the rank for the first problem."""
    rank_set = open_rank_set(path)
    verify_ranks(rank_set)
    lines = [f"parity verify: rank set {_show(rank_set.path)}: OK, {rank_set.world_size} ranks "
             f"({rank_set.backend}), {len(rank_set.placements)} placed tensors"]
    for reader in rank_set.ranks:
        lines.extend(f"  {line}" for line in summary(reader))
    return lines


def verify_ranks(rank_set: RankSet) -> None:
    """Verify every rank's bundle (:meth:`BundleReader.verify`); a BundleError naming the rank of the
    first problem."""
    for rank, reader in enumerate(rank_set.ranks):
        try:
            reader.verify()
        except BundleError as err:
            raise _fail(rank_set.path, f"rank {rank}: {err}") from None
