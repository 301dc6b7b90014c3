"""The bundle manifest's schema: parse ``manifest.json`` strictly and check every field's type before use.

A manifest is data written by another host, possibly damaged or edited, so nothing in it is
trusted until :func:`load_manifest` has checked it: every field the harness reads (compare,
the recorder's replay, the subjects, the report) has its type, range and cross-references
checked here, and the result is a :class:`Manifest` of typed values. A problem is one
:class:`~parity.base.errors.BundleError` line naming the manifest file and the field.

The schema is a typed loader in code rather than a JSON Schema document: the checks that matter
most are cross-references (every entry's shard is listed, tensor paths in a layer's tree are the
entries of that layer, ``nbytes`` is the shape's product times the dtype size, names are unique),
which JSON Schema cannot express, and it would add a dependency. Long because every field of
every schema version is checked here, each next to its name: one place to read what a manifest may hold.

Parsing is strict: duplicate object keys, ``NaN``/``Infinity``, integers too long to convert, and
nesting deeper than the JSON decoder's recursion limit are errors, not surprises. Free-form
objects (subject args, platform, inputs_meta, kernel configs) are bounded in depth. Unknown extra
fields are tolerated (forward compatibility); a known field of the wrong type never is.

Integrity. From schema version 2 the writer seals the manifest: ``manifest_sha256`` is the
sha256 of the manifest's canonical JSON (:func:`manifest_digest`) without that field. Every
entry records its tensor's digest. Each shard records, from version 3, its header's digest: of
the file's first ``8 + header length`` bytes (the length and the safetensors header, padding
included). With the reader's check that the tensors tile the data section exactly (no gap, no
overlap, nothing after the last), every byte of a shard is covered by exactly one digest, so a
shard is written and verified hashing each byte once. The digests are BLAKE3 from version 4
(fields ``blake3`` and ``header_blake3``) and sha256 before (``sha256``, ``header_sha256``;
:mod:`parity.bundle.checksums`). Version 2 recorded instead of the header's digest the sha256 of the
whole file (``sha256``): each byte was hashed twice. Version 1 bundles (the committed goldens)
have neither and are still read; a digest that is present is checked whatever the version, so
changing the version number alone does not switch the check off. Digests detect damage and
careless edits, not a deliberate forger (nothing is signed).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from parity.base.errors import BundleError
from parity.base.text import printable
from parity.bundle.checksums import ALGORITHM_OF_VERSION

FORMAT_NAME = "parity-bundle"
SCHEMA_VERSION = 4
# A bundle whose weights are named by reference (the manifest's ``weights``, parity.bundle.weights)
# needs the checkpoint to be loaded: a parity that reads only version 4 would build the model
# without them, so such a bundle is version 5 (otherwise the same as 4); self-contained bundles
# stay version 4, readable by older parity.
WEIGHTS_BY_REFERENCE_VERSION = 5
# A bundle of more than one input draw (capture --seeds N, parity.run.seeds): its later draws are
# entries of the draw_* kinds, which a parity that reads only version 5 would refuse entry by
# entry; it is version 6 so that such a parity says so once. One draw stays version 4 (or 5).
SEEDS_VERSION = 6
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6)
MANIFEST_NAME = "manifest.json"
DIGEST_FIELD = "manifest_sha256"

# What an entry holds: the subject's inputs and state (weights, buffers), a recorded module output,
# a recorded module input (for replaying one layer), and a high-precision reference of an output.
# draw_input, draw_output, draw_reference: the same for the later input draws of capture --seeds
# (version 6, parity.run.seeds).
KINDS = ("input", "state", "output", "module_input", "reference", "draw_input", "draw_output", "draw_reference")

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16",
        "float8_e4m3fn", "float8_e5m2",
        "int64", "int32", "int16", "int8", "uint8", "bool",
    )
    if hasattr(torch, name)
}
ITEMSIZE: dict[str, int] = {name: torch.empty(0, dtype=dtype).element_size() for name, dtype in DTYPES.items()}

# Limits. A manifest is read whole, so its size is capped; free-form JSON objects are capped in
# depth (a replayed tree in depth too), names in length. Generous for real models, small enough
# that a hostile manifest cannot exhaust memory or the stack.
MAX_MANIFEST_BYTES = 256 * 2**20
MAX_FREEFORM_DEPTH = 32
MAX_TREE_DEPTH = 64
MAX_NAME_CHARS = 65536
MAX_FILE_NAME_BYTES = 255
MAX_DIMS = 64
MAX_ELEMENTS = 2**62

# The platform fingerprint's fields (parity.run.platform.fingerprint) that compare and the report
# read, with the JSON types each may have; other fields are free-form (forward compatibility).
_PLATFORM_TYPES: dict[str, tuple[type, ...]] = {
    **{key: (str,) for key in ("vendor", "arch", "device", "device_name", "host_os", "python", "torch", "triton",
                               "cuda_version", "hip_version", "driver", "driver_api", "float32_matmul_precision",
                               "triton_default_fp_fusion", "triton_f32_default")},
    **{key: (bool,) for key in ("triton_interpreter", "tf32_matmul", "tf32_cudnn", "fp16_reduced_precision_reduction",
                                "bf16_reduced_precision_reduction", "deterministic_algorithms")},
    "multiprocessors": (int,),
}

_HEX64 = re.compile(r"[0-9a-f]{64}")
_TREE_KINDS = ("tensor", "tuple", "list", "dict", "value", "float", "dtype", "opaque")
_SPECIAL_FLOATS = ("nan", "inf", "-inf")


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
    checksum: str  # hex digest of the tensor's bytes, by the manifest's algorithm (Manifest.checksum)
    nbytes: int
    layer: str | None = None
    module: str | None = None
    call_index: int | None = None
    path: str | None = None
    device: str | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def to_json(self, algorithm: str) -> dict[str, Any]:
        """The manifest's JSON of this entry, its checksum under the ``algorithm`` field."""
        data = dataclasses.asdict(self)
        data["shape"] = list(self.shape)
        data[algorithm] = data.pop("checksum")
        if data["device"] is None:  # written only where recorded: other manifests stay as they were
            del data["device"]
        return data


@dataclasses.dataclass(frozen=True)
class Shard:
    """One shard file: a plain file name inside the bundle, its size and tensor count, and its
    digest: of its header (version 3 and later, by the manifest's algorithm) or the sha256 of the
    whole file (version 2)."""

    file: str
    bytes: int
    tensors: int
    sha256: str | None
    header_checksum: str | None = None


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A checked manifest: ``raw`` is the parsed JSON (safe to read: every known field is typed)."""

    raw: dict[str, Any]
    version: int
    sealed: bool  # carries manifest_sha256 (and shard digests), checked
    subject: dict[str, Any]
    impl: str | None
    device: str | None
    platform: dict[str, Any]
    kernel_configs: dict[str, Any] | None
    capture: dict[str, Any] | None
    hooks_check: dict[str, Any] | None
    inputs_meta: dict[str, Any]
    layers: list[dict[str, Any]]
    reference_layers: list[dict[str, Any]]
    shards: list[Shard]
    entries: list[Entry]
    weights: dict[str, Any] | None = None  # checkpoint files named instead of stored weights (version 5)
    seeds: dict[str, Any] | None = None  # the input draws of capture --seeds (version 6, parity.run.seeds)

    @property
    def checksum(self) -> str:
        """The algorithm of the entries' and shard headers' digests (``"blake3"``, ``"sha256"``)."""
        return ALGORITHM_OF_VERSION[self.version]

    @property
    def capture_layers(self) -> list[str] | None:
        """The capture's ``--layers`` globs (None: every module was recorded)."""
        return None if self.capture is None else self.capture.get("layers")

    @property
    def record_inputs(self) -> bool:
        return bool(self.capture and self.capture.get("record_inputs"))


# --------------------------------------------------------------------------------------------
# Parsing and digests


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {printable(key, limit=80)!r}")
        result[key] = value
    return result


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as inf; it could not be written back as JSON
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def parse_json(data: bytes, where: str, what: str = "invalid JSON") -> Any:
    """Strict JSON from bytes; BundleError (``where: what: detail``) for anything else."""
    try:
        text = data.decode("utf-8")
        return json.loads(text, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant,
                          parse_float=_finite_float)
    except RecursionError:
        raise BundleError(f"{where}: {what}: nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as err:  # JSONDecodeError is a ValueError; so are huge ints
        raise BundleError(f"{where}: {what}: {_one_line(err)}") from None


def canonical_json(value: Any) -> bytes:
    """The canonical bytes a digest is taken of: sorted keys, no whitespace, UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    """sha256 of the canonical manifest without its ``manifest_sha256`` field."""
    body = {key: value for key, value in manifest.items() if key != DIGEST_FIELD}
    return hashlib.sha256(canonical_json(body)).hexdigest()


def seal(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with ``manifest_sha256`` set (or refreshed): what the writer stores."""
    return {**{k: v for k, v in manifest.items() if k != DIGEST_FIELD}, DIGEST_FIELD: manifest_digest(manifest)}


def _one_line(text: object) -> str:
    return printable(" ".join(str(text).split()))


# --------------------------------------------------------------------------------------------
# The checker


class _Checker:
    """Field checks that raise one BundleError naming the manifest file and the field."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, field: str, problem: str) -> BundleError:
        return BundleError(f"{self.where}: invalid manifest: {field}: {problem}")

    def obj(self, value: Any, field: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(field, f"expected an object, got {_type(value)}")
        return value

    def opt_obj(self, value: Any, field: str) -> dict[str, Any] | None:
        return None if value is None else self.obj(value, field)

    def list(self, value: Any, field: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(field, f"expected a list, got {_type(value)}")
        return value

    def str(self, value: Any, field: str, *, nonempty: bool = False, limit: int = MAX_NAME_CHARS) -> str:
        if not isinstance(value, str):
            raise self.fail(field, f"expected a string, got {_type(value)}")
        if nonempty and not value:
            raise self.fail(field, "empty string")
        if len(value) > limit:
            raise self.fail(field, f"string of {len(value)} characters (at most {limit})")
        return value

    def opt_str(self, value: Any, field: str, **kwargs) -> str | None:
        return None if value is None else self.str(value, field, **kwargs)

    def int(self, value: Any, field: str, *, minimum: int = 0, maximum: int = MAX_ELEMENTS) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(field, f"expected an integer, got {_type(value)}")
        if not minimum <= value <= maximum:
            raise self.fail(field, f"{value} is out of range [{minimum}, {maximum}]")
        return value

    def opt_int(self, value: Any, field: str, **kwargs) -> int | None:
        return None if value is None else self.int(value, field, **kwargs)

    def bool(self, value: Any, field: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(field, f"expected true or false, got {_type(value)}")
        return value

    def hex256(self, value: Any, field: str) -> str:
        """A 256-bit digest (sha256 or BLAKE3): 64 lowercase hex digits."""
        if not isinstance(value, str) or not _HEX64.fullmatch(value):
            raise self.fail(field, f"expected 64 lowercase hex digits, got {_short(value)}")
        return value

    def str_list(self, value: Any, field: str) -> list[str]:
        items = self.list(value, field)
        for number, item in enumerate(items):
            self.str(item, f"{field}[{number}]")
        return items

    def freeform(self, value: Any, field: str, depth: int = 0) -> Any:
        """Any JSON value, nested at most MAX_FREEFORM_DEPTH deep (the parser rejected NaN)."""
        if depth > MAX_FREEFORM_DEPTH:
            raise self.fail(field, f"nested more than {MAX_FREEFORM_DEPTH} levels deep")
        if isinstance(value, dict):
            for key, item in value.items():
                self.freeform(item, field, depth + 1)
        elif isinstance(value, list):
            for item in value:
                self.freeform(item, field, depth + 1)
        return value

    def freeform_obj(self, value: Any, field: str) -> dict[str, Any]:
        return self.freeform(self.obj(value, field), field)

    def opt_freeform_obj(self, value: Any, field: str) -> dict[str, Any] | None:
        return None if value is None else self.freeform_obj(value, field)


def _type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    return printable(repr(value), limit=80)


# --------------------------------------------------------------------------------------------
# Sections


def _check_header(c: _Checker, raw: dict[str, Any]) -> int:
    if raw.get("format") != FORMAT_NAME:
        raise BundleError(f"{c.where}: not a parity bundle manifest (format is {_short(raw.get('format'))})")
    version = raw.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise c.fail("schema_version", f"expected an integer, got {_short(version)}")
    if version not in READABLE_VERSIONS:
        newer = " (written by a newer parity; upgrade parity)" if version > SCHEMA_VERSION else ""
        raise BundleError(f"{c.where}: unknown schema version {version}; this parity reads versions "
                          f"{', '.join(map(str, READABLE_VERSIONS))}{newer}")
    for field in ("parity_version", "created"):
        c.opt_str(raw.get(field), field, limit=200)
    return version


def _check_digest(c: _Checker, raw: dict[str, Any], version: int) -> bool:
    if DIGEST_FIELD not in raw:
        if version >= 2:
            raise c.fail(DIGEST_FIELD, f"missing (version {version} manifests are sealed)")
        return False
    stored = c.hex256(raw[DIGEST_FIELD], DIGEST_FIELD)
    try:
        actual = manifest_digest(raw)
    except (TypeError, ValueError) as err:  # cannot happen after a strict parse; kept one line anyway
        raise c.fail(DIGEST_FIELD, _one_line(err)) from None
    if actual != stored:
        raise BundleError(f"{c.where}: manifest checksum mismatch: the manifest was changed after it was written "
                          "(damaged, or edited by hand)")
    return True


def _check_subject(c: _Checker, raw: dict[str, Any]) -> dict[str, Any]:
    subject = c.obj(raw.get("subject"), "subject")
    c.str(subject.get("spec"), "subject.spec", nonempty=True, limit=1000)
    c.str(subject.get("name", ""), "subject.name", limit=1000)
    c.freeform_obj(subject.get("args", {}), "subject.args")
    return subject


def _check_kernel_configs(c: _Checker, value: Any) -> dict[str, Any] | None:
    configs = c.opt_freeform_obj(value, "kernel_configs")
    if configs is not None:
        for key in ("used", "provided"):
            c.opt_obj(configs.get(key), f"kernel_configs.{key}")
    return configs


def _check_capture(c: _Checker, value: Any) -> dict[str, Any] | None:
    info = c.opt_freeform_obj(value, "capture")
    if info is None:
        return None
    layers = info.get("layers")
    if layers is not None:
        for number, pattern in enumerate(c.list(layers, "capture.layers")):
            c.str(pattern, f"capture.layers[{number}]", limit=10000)
    c.bool(info.get("record_inputs", False), "capture.record_inputs")
    c.opt_int(info.get("shard_bytes"), "capture.shard_bytes", minimum=1)
    c.bool(info.get("durable", True), "capture.durable")
    reference = c.opt_obj(info.get("reference"), "capture.reference")
    if reference is not None:
        for key in ("precision", "impl", "device", "dtype"):
            c.opt_str(reference.get(key), f"capture.reference.{key}", limit=200)
        if reference.get("outputs_without_reference") is not None:
            c.str_list(reference["outputs_without_reference"], "capture.reference.outputs_without_reference")
    repeat = c.opt_obj(info.get("repeat"), "capture.repeat")  # capture --repeat N (parity.run.repeats)
    if repeat is not None:
        c.int(repeat.get("runs"), "capture.repeat.runs", minimum=1)
        c.bool(repeat.get("bitwise_equal"), "capture.repeat.bitwise_equal")
        c.opt_str(repeat.get("first_nondeterministic"), "capture.repeat.first_nondeterministic")
        c.str_list(repeat.get("nondeterministic", []), "capture.repeat.nondeterministic")
    return info


def _check_weights(c: _Checker, value: Any, version: int, entries: list[Entry]) -> dict[str, Any] | None:
    """``weights`` (version 5): the checkpoint files (plain names, recorded paths, sizes, and their
    BLAKE3, sha256 or both)
    and which state tensor each file holds under which key; no state name both stored and named."""
    if value is None:
        if version == WEIGHTS_BY_REFERENCE_VERSION:
            raise c.fail("weights", f"missing (version {version} bundles name their checkpoint files)")
        return None
    if version < WEIGHTS_BY_REFERENCE_VERSION:
        raise c.fail("weights", f"present in a version {version} manifest (weights by reference are version "
                                f"{WEIGHTS_BY_REFERENCE_VERSION})")
    weights = c.obj(value, "weights")
    files = c.list(weights.get("files"), "weights.files")
    if not files:
        raise c.fail("weights.files", "empty")
    names: set[str] = set()
    for number, item in enumerate(files):
        field = f"weights.files[{number}]"
        item = c.obj(item, field)
        name = check_plain_file_name(item.get("name"), c.where, "checkpoint")
        if name in names:
            raise c.fail(field, f"checkpoint file '{printable(name)}' is listed twice")
        names.add(name)
        c.str(item.get("path"), f"{field}.path", nonempty=True, limit=4096)
        c.int(item.get("bytes"), f"{field}.bytes")
        # Either digest or both: bundles captured before the BLAKE3 record the sha256 alone, later
        # ones the BLAKE3 alone (compare checks the BLAKE3 where there is one).
        if "sha256" not in item and "blake3" not in item:
            raise c.fail(field, "records no digest (expected sha256, blake3 or both)")
        for digest in ("sha256", "blake3"):
            if digest in item and (not isinstance(item[digest], str) or not _HEX64.fullmatch(item[digest])):
                raise c.fail(f"{field}.{digest}", f"expected 64 lowercase hex digits, got {_short(item.get(digest))}")
    stored = {entry.name for entry in entries if entry.kind == "state"}
    seen: set[str] = set()
    for number, item in enumerate(c.list(weights.get("tensors"), "weights.tensors")):
        field = f"weights.tensors[{number}]"
        if not isinstance(item, list) or len(item) != 3:
            raise c.fail(field, "expected [state name, file index, key]")
        name = c.str(item[0], f"{field}[0]", nonempty=True)
        c.int(item[1], f"{field}[1]", maximum=len(files) - 1)
        c.str(item[2], f"{field}[2]", nonempty=True)
        if name in seen or name in stored:
            raise c.fail(field, f"state tensor '{printable(name, limit=120)}' is named twice")
        seen.add(name)
    return weights


def _check_seeds(c: _Checker, value: Any, version: int, entries: list[Entry]) -> dict[str, Any] | None:
    """``seeds`` (version 6): the draws' seeds, distinct integers, the first the bundle's own draw;
    one ``inputs_meta`` object per later draw; every draw_* entry named ``"<seed>|..."`` of a listed seed."""
    drawn = [entry for entry in entries if entry.kind.startswith("draw_")]
    if value is None:
        if drawn:
            raise c.fail("seeds", f"missing, but the bundle holds {len(drawn)} draw_* entries")
        return None
    if version < SEEDS_VERSION:
        raise c.fail("seeds", f"present in a version {version} manifest (input draws are version {SEEDS_VERSION})")
    seeds = c.obj(value, "seeds")
    c.str(seeds.get("arg"), "seeds.arg", nonempty=True, limit=200)
    values = c.list(seeds.get("values"), "seeds.values")
    if len(values) < 2:
        raise c.fail("seeds.values", f"expected at least 2 seeds, got {len(values)}")
    for number, seed in enumerate(values):
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise c.fail(f"seeds.values[{number}]", f"expected an integer, got {_type(seed)}")
    if len(set(values)) != len(values):
        raise c.fail("seeds.values", "lists a seed twice")
    metas = c.list(seeds.get("inputs_meta"), "seeds.inputs_meta")
    if len(metas) != len(values) - 1:
        raise c.fail("seeds.inputs_meta", f"expected {len(values) - 1} objects (one per later draw), got {len(metas)}")
    for number, meta in enumerate(metas):
        c.freeform_obj(meta, f"seeds.inputs_meta[{number}]")
    later = {str(seed) for seed in values[1:]}
    for entry in drawn:
        if entry.name.split("|", 1)[0] not in later:
            raise c.fail("entries", f"{entry.kind} '{printable(entry.name, limit=120)}' is of no later draw in "
                                    "seeds.values")
    return seeds


def _check_hooks(c: _Checker, value: Any) -> dict[str, Any] | None:
    hooks = c.opt_freeform_obj(value, "hooks_check")
    if hooks is not None:
        if "bitwise_equal" in hooks:
            c.bool(hooks["bitwise_equal"], "hooks_check.bitwise_equal")
        c.opt_int(hooks.get("tensors_compared"), "hooks_check.tensors_compared")
        c.opt_str(hooks.get("first_difference"), "hooks_check.first_difference")
    return hooks


def _check_platform(c: _Checker, value: Any) -> dict[str, Any]:
    platform = c.freeform_obj(value, "platform")
    for key, types in _PLATFORM_TYPES.items():
        item = platform.get(key)
        if item is not None and (not isinstance(item, types) or isinstance(item, bool) and bool not in types):
            raise c.fail(f"platform.{key}", f"expected {' or '.join(t.__name__ for t in types)} or null, got {_type(item)}")
        if isinstance(item, str):
            c.str(item, f"platform.{key}", limit=1000)
    return platform


def _check_plugin_golden(c: _Checker, value: Any) -> None:
    golden = c.opt_freeform_obj(value, "parity_golden")
    if golden is not None:
        c.opt_str(golden.get("format"), "parity_golden.format", limit=200)
        c.opt_str(golden.get("kind"), "parity_golden.kind", limit=200)
        c.opt_str(golden.get("test"), "parity_golden.test")
        if golden.get("keys") is not None:
            c.str_list(golden["keys"], "parity_golden.keys")


def check_plain_file_name(name: Any, where: str, what: str = "shard") -> str:
    """A file name the manifest may give: one plain component inside the bundle directory."""
    if not isinstance(name, str) or not name:
        raise BundleError(f"{where}: invalid manifest: {what} file name {_short(name)}")
    shown = printable(name, limit=120)
    if "/" in name or "\\" in name or name in (".", ".."):
        raise BundleError(f"{where}: {what} file '{shown}' points outside the bundle directory "
                          "(only plain file names inside it are allowed)")
    if len(name.encode("utf-8", "surrogatepass")) > MAX_FILE_NAME_BYTES:
        raise BundleError(f"{where}: invalid manifest: {what} file name of {len(name)} characters is too long")
    if printable(name) != name or name == MANIFEST_NAME or name.startswith("."):
        raise BundleError(f"{where}: invalid manifest: {what} file name '{shown}' is not allowed")
    return name


def _check_shards(c: _Checker, raw: dict[str, Any], sealed: bool, version: int) -> list[Shard]:
    """Shards; a sealed manifest must carry its version's shard digest (a present one is always checked)."""
    shards = []
    seen: set[str] = set()
    for number, item in enumerate(c.list(raw.get("shards"), "shards")):
        field = f"shards[{number}]"
        item = c.obj(item, field)
        name = check_plain_file_name(item.get("file"), c.where)
        if name in seen:
            raise c.fail(field, f"shard '{printable(name)}' is listed twice")
        seen.add(name)
        size = c.int(item.get("bytes"), f"{field}.bytes", minimum=10)  # 8-byte length + at least "{}"
        count = c.int(item.get("tensors"), f"{field}.tensors")
        header_key = f"header_{ALGORITHM_OF_VERSION[version]}"
        digest, header_digest = item.get("sha256"), item.get(header_key)
        if digest is not None or (sealed and version == 2):
            digest = c.hex256(digest, f"{field}.sha256")
        if header_digest is not None or (sealed and version >= 3):
            header_digest = c.hex256(header_digest, f"{field}.{header_key}")
        shards.append(Shard(name, size, count, digest, header_digest))
    return shards


def _check_entry(c: _Checker, number: int, item: Any, shards: Mapping[str, Shard], algorithm: str) -> Entry:
    field = f"entries[{number}]"
    item = c.obj(item, field)
    missing = [key for key in ("kind", "name", "dtype", "shape", "shard", "key", algorithm, "nbytes") if key not in item]
    if missing:
        raise c.fail(field, f"lacks {', '.join(missing)}")
    kind = item["kind"]
    if not isinstance(kind, str) or kind not in KINDS:
        raise c.fail(f"{field}.kind", f"unknown kind {_short(kind)}; expected one of {', '.join(KINDS)}")
    name = c.str(item["name"], f"{field}.name")
    label = f"{field} ({kind} '{printable(name, limit=120)}')"
    dtype = item["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise c.fail(label, f"unknown dtype {_short(dtype)}")
    shape = c.list(item["shape"], f"{label}.shape")
    if len(shape) > MAX_DIMS:
        raise c.fail(label, f"shape has {len(shape)} dimensions (at most {MAX_DIMS})")
    numel = 1
    for dim in shape:
        c.int(dim, f"{label}.shape", maximum=MAX_ELEMENTS)
        numel = min(numel * dim, MAX_ELEMENTS + 1)  # stays a small int however large the dims
    if numel > MAX_ELEMENTS:
        raise c.fail(label, f"shape {_short(shape)} has more than 2**62 elements")
    shard = item["shard"]
    if not isinstance(shard, str) or shard not in shards:
        check_plain_file_name(shard, c.where)  # an escaping name is reported as such
        raise c.fail(label, f"is in unlisted shard '{printable(shard, limit=120)}'")
    key = c.str(item["key"], f"{label}.key", nonempty=True, limit=1000)
    checksum = c.hex256(item[algorithm], f"{label}.{algorithm}")
    nbytes = c.int(item["nbytes"], f"{label}.nbytes")
    if nbytes != numel * ITEMSIZE[dtype]:
        raise c.fail(label, f"nbytes {nbytes} is not {numel} elements x {ITEMSIZE[dtype]} bytes of {dtype}")
    layer = c.opt_str(item.get("layer"), f"{label}.layer")
    module = c.opt_str(item.get("module"), f"{label}.module")
    call_index = c.opt_int(item.get("call_index"), f"{label}.call_index")
    path = c.opt_str(item.get("path"), f"{label}.path")
    device = c.opt_str(item.get("device"), f"{label}.device", limit=200)
    if layer is not None and path is not None and name != (f"{layer}/{path}" if path else layer):
        raise c.fail(label, "name is not its layer and path joined by '/'")
    return Entry(kind, name, dtype, tuple(shape), shard, key, checksum, nbytes, layer, module, call_index, path, device)


def _check_entries(c: _Checker, raw: dict[str, Any], shards: list[Shard], version: int) -> list[Entry]:
    by_file = {shard.file: shard for shard in shards}
    algorithm = ALGORITHM_OF_VERSION[version]
    entries = [_check_entry(c, number, item, by_file, algorithm)
               for number, item in enumerate(c.list(raw.get("entries"), "entries"))]
    names: set[tuple[str, str]] = set()
    keys: set[tuple[str, str]] = set()
    counts = {shard.file: 0 for shard in shards}
    used = {shard.file: 0 for shard in shards}
    for number, entry in enumerate(entries):
        if (entry.kind, entry.name) in names:
            raise c.fail(f"entries[{number}]", f"two {entry.kind} entries share the name '{printable(entry.name, limit=120)}'")
        if (entry.shard, entry.key) in keys:
            raise c.fail(f"entries[{number}]", f"two entries share key '{printable(entry.key)}' in shard "
                                               f"'{printable(entry.shard)}'")
        names.add((entry.kind, entry.name))
        keys.add((entry.shard, entry.key))
        counts[entry.shard] += 1
        used[entry.shard] += entry.nbytes
    for shard in shards:
        if counts[shard.file] != shard.tensors:
            raise c.fail(f"shard '{printable(shard.file)}'", f"lists {shard.tensors} tensors but {counts[shard.file]} "
                                                             "entries are in it")
        if used[shard.file] > shard.bytes - 10:
            raise c.fail(f"shard '{printable(shard.file)}'", f"its entries hold {used[shard.file]} bytes, more than "
                                                             f"the {shard.bytes}-byte file can")
    return entries


# Trees -------------------------------------------------------------------------------------


def _escape(key: str) -> str:
    return key.replace("%", "%25").replace("/", "%2F")


def _check_tree(c: _Checker, node: Any, field: str, path: str, depth: int, paths: list[str]) -> None:
    """A recorder tree (see parity.run.recorder); tensor paths must be where ``flatten`` puts them."""
    if depth > MAX_TREE_DEPTH:
        raise c.fail(field, f"tree nested more than {MAX_TREE_DEPTH} levels deep")
    if not isinstance(node, dict) or len(node) != 1 or next(iter(node)) not in _TREE_KINDS:
        raise c.fail(field, f"tree node must be an object with one key of {', '.join(_TREE_KINDS)}, "
                            f"got {_short(node)}")
    kind, value = next(iter(node.items()))
    if kind == "tensor":
        if value != path:
            raise c.fail(field, f"tensor path {_short(value)} where the structure puts {_short(path)}")
        paths.append(path)
    elif kind in ("tuple", "list"):
        for index, item in enumerate(c.list(value, field)):
            _check_tree(c, item, field, _join(path, str(index)), depth + 1, paths)
    elif kind == "dict":
        seen = set()
        for pair in c.list(value, field):
            if not isinstance(pair, list) or len(pair) != 2:
                raise c.fail(field, f"dict item must be a [key, node] pair, got {_short(pair)}")
            key, item = pair
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise c.fail(field, f"dict key must be a string or an integer, got {_short(key)}")
            if key in seen:
                raise c.fail(field, f"dict key {_short(key)} appears twice")
            seen.add(key)
            _check_tree(c, item, field, _join(path, _escape(str(key))), depth + 1, paths)
    elif kind == "value":
        if not (value is None or isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value))):
            raise c.fail(field, f"value must be a JSON scalar, got {_type(value)}")
    elif kind == "float":
        if value not in _SPECIAL_FLOATS:
            raise c.fail(field, f"float must be one of {', '.join(_SPECIAL_FLOATS)}, got {_short(value)}")
    elif kind == "dtype":
        if not isinstance(value, str) or not isinstance(getattr(torch, value, None), torch.dtype):
            raise c.fail(field, f"unknown torch dtype {_short(value)}")
    else:  # opaque: the type name of an object that was not recorded
        c.str(value, field, limit=1000)


def _join(prefix: str, part: str) -> str:
    return f"{prefix}/{part}" if prefix else part


def _check_inputs_root(c: _Checker, tree: dict[str, Any], field: str) -> None:
    """Replay rebuilds ``(args, kwargs)`` from an inputs tree: ``{"dict": [["args", tuple], ["kwargs", dict]]}``."""
    # Called after _check_tree, so every node is well formed.
    pairs = tree.get("dict")
    if not isinstance(pairs, list) or [pair[0] for pair in pairs] != ["args", "kwargs"]:
        raise c.fail(field, "an inputs tree must be a dict of 'args' and 'kwargs'")
    args, kwargs = pairs[0][1], pairs[1][1]
    if "tuple" not in args and "list" not in args:
        raise c.fail(field, "an inputs tree's 'args' must be a tuple")
    if "dict" not in kwargs or any(not isinstance(key, str) for key, _ in kwargs["dict"]):
        raise c.fail(field, "an inputs tree's 'kwargs' must be a dict with string keys")


def _check_layers(c: _Checker, raw: dict[str, Any], group: str, entries: list[Entry]) -> list[dict[str, Any]]:
    """``layers`` or ``reference_layers``: each recorded call well formed, its trees' tensors exactly
    the entries of that layer, and (where the group exists) every recorded entry in some layer."""
    if group not in raw:
        return []
    output_kind = "reference" if group == "reference_layers" else "output"
    by_layer: dict[tuple[str, str | None], list[str]] = {}
    for entry in entries:
        by_layer.setdefault((entry.kind, entry.layer), []).append(entry.path if entry.path is not None else "")
    layers = c.list(raw[group], group)
    names: set[str] = set()
    for number, layer in enumerate(layers):
        field = f"{group}[{number}]"
        layer = c.obj(layer, field)
        name = c.str(layer.get("name"), f"{field}.name", nonempty=True)
        field = f"{group}[{number}] ('{printable(name, limit=120)}')"
        module = c.str(layer.get("module"), f"{field}.module", nonempty=True)
        call_index = c.int(layer.get("call_index"), f"{field}.call_index")
        if name != (module if call_index == 0 else f"{module}#{call_index}"):
            raise c.fail(field, "name is not the module path with its call index")
        if name in names:
            raise c.fail(field, "layer name appears twice")
        names.add(name)
        output_paths: list[str] = []
        _check_tree(c, layer.get("outputs"), f"{field}.outputs", "", 0, output_paths)
        _check_paths(c, f"{field}.outputs", output_paths, by_layer.get((output_kind, name), []), output_kind)
        inputs = layer.get("inputs")
        if inputs is not None:
            if group == "reference_layers":
                raise c.fail(f"{field}.inputs", "reference runs record no inputs")
            input_paths: list[str] = []
            _check_tree(c, inputs, f"{field}.inputs", "", 0, input_paths)
            _check_inputs_root(c, inputs, f"{field}.inputs")
            _check_paths(c, f"{field}.inputs", input_paths, by_layer.get(("module_input", name), []), "module_input")
        elif by_layer.get(("module_input", name)) and group == "layers":
            raise c.fail(f"{field}.inputs", "null, but module_input entries exist for this layer")
    kinds = ("output", "module_input") if group == "layers" else ("reference",)
    for entry in entries:
        if entry.kind in kinds and entry.layer not in names:
            raise c.fail(group, f"{entry.kind} entry '{printable(entry.name, limit=120)}' belongs to no recorded layer")
    # Copies with every key present (a missing "inputs" is null), so readers index, never .get().
    return [{**layer, "inputs": layer.get("inputs")} for layer in layers]


def _check_paths(c: _Checker, field: str, tree_paths: list[str], entry_paths: list[str], kind: str) -> None:
    if len(set(tree_paths)) != len(tree_paths):
        raise c.fail(field, "a tensor path appears twice in the tree")
    if sorted(tree_paths) != sorted(entry_paths):
        extra = sorted(set(tree_paths) ^ set(entry_paths)) or ["(duplicates)"]
        raise c.fail(field, f"tree's tensors and the layer's {kind} entries differ (at '{printable(extra[0], limit=120)}')")


# --------------------------------------------------------------------------------------------
# Entry point


def load_manifest(data: bytes, where: str) -> Manifest:
    """Parse and check a manifest's bytes; ``where`` names the file in messages."""
    raw = parse_json(data, where)
    c = _Checker(where)
    if not isinstance(raw, dict):
        raise BundleError(f"{where}: invalid manifest: expected a JSON object, got {_type(raw)}")
    version = _check_header(c, raw)
    sealed = _check_digest(c, raw, version)
    subject = _check_subject(c, raw)
    shards = _check_shards(c, raw, sealed, version)
    entries = _check_entries(c, raw, shards, version)
    layers = _check_layers(c, raw, "layers", entries)
    reference_layers = _check_layers(c, raw, "reference_layers", entries)
    _check_plugin_golden(c, raw.get("parity_golden"))
    return Manifest(
        raw=raw, version=version, sealed=sealed, subject=subject,
        impl=c.opt_str(raw.get("impl"), "impl", limit=1000),
        device=c.opt_str(raw.get("device"), "device", limit=1000),
        platform=_check_platform(c, raw.get("platform", {})),
        kernel_configs=_check_kernel_configs(c, raw.get("kernel_configs")),
        capture=_check_capture(c, raw.get("capture")),
        hooks_check=_check_hooks(c, raw.get("hooks_check")),
        inputs_meta=c.freeform_obj(raw.get("inputs_meta", {}), "inputs_meta"),
        layers=layers, reference_layers=reference_layers, shards=shards, entries=entries,
        weights=_check_weights(c, raw.get("weights"), version, entries),
        seeds=_check_seeds(c, raw.get("seeds"), version, entries),
    )
