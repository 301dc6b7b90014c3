"""Mutation testing of the bundle reader: seeded damaged variants of two small bundles, each run
through ``verify`` and ``compare`` in-process, never a traceback, a hang or a wrong verdict.

Two bundles are captured once: a one-case ``attention`` bundle (with fp64 references) and a
tiny ``decoder`` with ``--record-inputs``; both in several shards. Each variant is a copy with
one kind of damage (categories below). What must happen is decided by an oracle that diffs the
damaged copy against the original, independently of the reader's code:

- ``verify`` exits 2 with one line on stderr whenever the data changed (any shard byte, the
  manifest's parsed content, a file's type, a stray file), else 0;
- ``compare`` (``--impl reference --device cpu --quiet``; with ``--budget``; the decoder also
  with ``--isolate``) exits 2 with one stderr line whenever something it reads changed: the
  manifest's content, any listed file's type or size, a tensor it loads (the undamaged run's
  ``BundleReader.verified`` for that mode), or the parsed header of a shard it opens. Otherwise
  it exits 2 or behaves like the undamaged bundle (same exit status and verdict line).
- never exit 1, never an exception out of ``main``, never longer than ``TIME_LIMIT_S``.

Manifest edits come in two kinds. Raw edits (bytes flipped, cut, inserted; a field changed by
hand) break the manifest's checksum. Resealed edits (the checksum recomputed, as a careless tool
would) test the schema itself: only edits the schema must refuse are made (a wrong type, a
missing required field, out-of-range numbers, unknown dtypes and versions, duplicates, escaping
file names, broken trees), plus forward-compatible additions it must accept, plus edits to
entries that agree with the schema but not with the shard (found when the tensor is read).

``test_mutation_full`` (marker ``mutation``) runs at least 1000 variants and prints counts by
category and outcome; ``test_mutation_fast`` runs its first 150 alone, where the full run is not
selected (``-m "not mutation"``).
"""
from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import stat
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest

from parity.bundle import reader as B
from parity.cli.main import main
from parity.bundle.manifest import seal

TIME_LIMIT_S = 20.0

# Resealed edits of free-form subject data whose wrong outcome would be the subject's, not the
# reader's (the schema cannot know a subject's metadata). Empty: kernels/layout.py now checks
# the mask metadata it is given (a retyped or emptied mask used to become "no causal mask" and
# exit 1); a pattern here reports such a variant instead of failing the test.
KNOWN_OUTSIDE: list[str] = []
FAST_COUNT = 150
FULL_COUNT = 1200

ATTENTION_CASE = {"batch": 1, "heads_q": 2, "heads_kv": 1, "seq_q": 16, "seq_k": 16, "head_dim": 16,
                  "layout": "causal", "dtype": "fp16"}
TINY_DECODER = {"layers": 1, "seq_len": 16, "batch": 1, "d_model": 32, "heads": 2, "kv_heads": 1, "head_dim": 16,
                "ffn_dim": 32, "vocab": 32, "block": 16, "window": 16, "layer_layouts": ["causal"]}
COMPARE = ["--impl", "reference", "--device", "cpu", "--quiet"]
MODES = {"attention": ([], ["--budget"]), "decoder": ([], ["--budget"], ["--isolate"])}


# ---- running the CLI in-process ---------------------------------------------------------------


class _TimeLimit(BaseException):
    pass


@dataclasses.dataclass
class Run:
    rc: int | None
    out: str
    err: str
    crash: str | None = None  # the traceback's last lines, or "hang"


def run_cli(argv: list[str]) -> Run:
    def alarm(signum, frame):
        raise _TimeLimit()

    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, TIME_LIMIT_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
        return Run(rc, out.getvalue(), err.getvalue())
    except _TimeLimit:
        return Run(None, out.getvalue(), err.getvalue(), "hang")
    except BaseException:  # noqa: BLE001 - anything escaping main is a finding
        return Run(None, out.getvalue(), err.getvalue(), "".join(traceback.format_exc().splitlines(True)[-4:]))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def verdict(run: Run) -> str:
    lines = run.out.strip().splitlines()
    return lines[-1] if lines else ""


# ---- the two base bundles and their undamaged runs ---------------------------------------------------


@dataclasses.dataclass
class Base:
    name: str
    path: Path
    manifest: dict[str, Any]
    files: dict[str, bytes]
    headers: dict[str, tuple[int, dict[str, Any]]]  # shard -> (header length, parsed header)
    baseline: dict[tuple[str, ...], tuple[int, str, set]]  # mode -> (rc, verdict, verified)

    @property
    def shards(self) -> list[str]:
        return [shard["file"] for shard in self.manifest["shards"]]

    def entry_at(self, shard: str, offset: int) -> tuple[str, str] | None:
        """(kind, name) of the tensor whose data holds byte ``offset`` of ``shard``."""
        length, header = self.headers[shard]
        for key, info in header.items():
            if key == "__metadata__":
                continue
            begin, end = (8 + length + n for n in info["data_offsets"])
            if begin <= offset < end:
                entry = next(e for e in self.manifest["entries"] if e["shard"] == shard and e["key"] == key)
                return entry["kind"], entry["name"]
        return None


def _baseline(path: Path, mode: list[str]) -> tuple[int, str, set]:
    readers = []
    original = B.BundleReader.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        readers.append(self)

    B.BundleReader.__init__ = spy
    try:
        run = run_cli(["compare", "--golden", str(path), *COMPARE, *mode])
    finally:
        B.BundleReader.__init__ = original
    assert run.rc == 0 and run.crash is None, (mode, run)
    verified = set().union(*(reader.verified for reader in readers))
    return run.rc, verdict(run), verified


def _make_base(name: str, path: Path) -> Base:
    from parity.run.capture import capture

    if name == "attention":
        capture("attention", path, subject_args={"cases": [ATTENTION_CASE]}, shard_bytes=2048)
    else:
        capture("decoder", path, subject_args=TINY_DECODER, record_inputs=True, shard_bytes=16384)
    files = {entry: (path / entry).read_bytes() for entry in os.listdir(path)}
    manifest = json.loads(files["manifest.json"])
    headers = {}
    for shard in (s["file"] for s in manifest["shards"]):
        length = int.from_bytes(files[shard][:8], "little")
        headers[shard] = (length, json.loads(files[shard][8:8 + length]))
    base = Base(name, path, manifest, files, headers, {})
    assert len(base.shards) >= 3
    base.baseline = {tuple(mode): _baseline(path, mode) for mode in MODES[name]}
    return base


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("mutation-bases")
    return {name: _make_base(name, root / name) for name in MODES}


# ---- the oracle -------------------------------------------------------------------------------------


def _strict_json(data: bytes) -> Any:
    def pairs(items):
        keys = [key for key, _ in items]
        if len(set(keys)) != len(keys):
            raise ValueError("duplicate key")
        return dict(items)

    def constant(name):
        raise ValueError(name)

    return json.loads(data.decode("utf-8"), object_pairs_hook=pairs, parse_constant=constant)


@dataclasses.dataclass
class Expect:
    data_changed: bool
    fatal: bool  # compare reads something that changed, whatever the mode
    entries: set  # (kind, name) whose stored data or description changed (fatal when compare reads them)
    shards: set  # shards whose parsed header changed (fatal when compare opens them)
    verify_any: bool = False  # a legitimate-looking edit (free-form subject data): verify may pass

    def compare_must_fail(self, base: Base, verified: set) -> bool:
        if self.fatal or self.entries & verified:
            return True
        opened = {entry["shard"] for entry in base.manifest["entries"] if (entry["kind"], entry["name"]) in verified}
        return bool(self.shards & opened)


def _header_meaning(data: bytes) -> Any:
    """What compare reads of a shard header: its length and tensor descriptions (not metadata)."""
    try:
        length = int.from_bytes(data[:8], "little")
        header = _strict_json(data[8:8 + length])
        header.pop("__metadata__", None)
        return length, header
    except Exception:  # noqa: BLE001 - any damage that does not parse is a change
        return None


def judge(base: Base, path: Path, manifest_meaning: str = "fatal", entries: set | None = None) -> Expect:
    """Diff the damaged copy against the original bundle."""
    expect = Expect(False, False, set(), set())
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return Expect(True, True, set(), set())
    except OSError:
        return Expect(True, True, set(), set())
    names = set(os.listdir(path))
    if names - set(base.files):
        expect.data_changed = True  # a stray file: verify's business, not compare's
    manifest = path / "manifest.json"
    if not _is_regular(manifest):
        return Expect(True, True, set(), set())
    try:
        changed = manifest.stat().st_size > 2**24 or _strict_json(manifest.read_bytes()) != base.manifest
    except Exception:  # noqa: BLE001
        changed = True
    if changed:
        expect.data_changed = True
        if manifest_meaning == "fatal":
            expect.fatal = True
        elif manifest_meaning == "entries":
            expect.entries |= entries or set()
        elif manifest_meaning == "tolerated":
            expect.data_changed = False  # forward-compatible additions are not damage
        elif manifest_meaning == "subject":
            expect.verify_any = True
    for shard in base.shards:
        file = path / shard
        if not _is_regular(file) or file.stat().st_size != len(base.files[shard]):
            expect.data_changed = expect.fatal = True  # opening the bundle checks every shard's type and size
            continue
        data, original = file.read_bytes(), base.files[shard]
        if data == original:
            continue
        expect.data_changed = True
        length = base.headers[shard][0]
        differing = [i for i, (a, b) in enumerate(zip(data, original)) if a != b]
        if any(i < 8 + length for i in differing) and _header_meaning(data) != _header_meaning(original):
            expect.shards.add(shard)
        for offset in differing:
            if offset >= 8 + length:
                expect.entries.add(base.entry_at(shard, offset))
    return expect


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


# ---- mutations ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Mutation:
    category: str
    detail: str
    meaning: str = "fatal"
    entries: set = dataclasses.field(default_factory=set)
    bundle_path: Path | None = None  # where to point verify/compare (default: the damaged copy)


def _manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_text())


def _write_manifest(path: Path, manifest: Any, *, reseal: bool) -> None:
    if reseal:
        manifest = seal(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False))


def _flip(file: Path, offset: int, rng: random.Random) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= rng.randint(1, 255)
    file.write_bytes(bytes(data))


# Raw manifest damage -----------------------------------------------------------------------


def m_manifest_flip(base, path, rng):
    file = path / "manifest.json"
    offset = rng.randrange(file.stat().st_size)
    _flip(file, offset, rng)
    return Mutation("manifest: byte flipped", f"offset {offset}")


def m_manifest_truncate(base, path, rng):
    file = path / "manifest.json"
    data = file.read_bytes()
    cut = rng.choice([0, 1, rng.randrange(len(data)), len(data) - 2])
    file.write_bytes(data[:cut])
    return Mutation("manifest: truncated", f"to {cut} bytes")


def m_manifest_insert(base, path, rng):
    file = path / "manifest.json"
    data = file.read_bytes()
    at = rng.randrange(len(data))
    junk = rng.choice([b" ", b"\n", b",", b"]", b"{", b'"', b"0", b"\x00", b"\xff", b"NaN", b"\t", b"-"])
    file.write_bytes(data[:at] + junk + data[at:])
    return Mutation("manifest: bytes inserted", f"{junk!r} at {at}")


def m_manifest_hand_edit(base, path, rng):
    manifest = _manifest(path)
    path_to, value = rng.choice(list(_leaves(manifest)))
    _set(manifest, path_to, _other_value(value, rng))
    _write_manifest(path, manifest, reseal=False)
    return Mutation("manifest: edited without resealing", _fmt(path_to))


def m_manifest_unsealed(base, path, rng):
    manifest = _manifest(path)
    choice = rng.choice(["drop digest", "version 1 keeps digest", "version 1 drops digest", "wrong digest"])
    if choice == "drop digest":
        manifest.pop("manifest_sha256")
    elif choice.startswith("version 1"):
        manifest["schema_version"] = 1
        if "drops" in choice:
            manifest.pop("manifest_sha256")  # a v1 manifest with shard digests: still checked
            manifest["entries"][0]["sha256"] = hashlib.sha256(b"x").hexdigest()
    else:
        manifest["manifest_sha256"] = hashlib.sha256(b"x").hexdigest()
    _write_manifest(path, manifest, reseal=False)
    return Mutation("manifest: digest removed or wrong", choice)


def m_manifest_special(base, path, rng):
    file = path / "manifest.json"
    choice = rng.choice(["deep array", "deep object", "empty", "not an object", "huge sparse", "symlink",
                         "fifo", "directory", "deleted", "utf-16", "bom", "nan", "1e999", "duplicate key",
                         "huge int"])
    text = file.read_text()
    if choice == "deep array":
        file.write_text("[" * 10000 + "]" * 10000)
    elif choice == "deep object":
        file.write_text('{"a":' * 10000 + "1" + "}" * 10000)
    elif choice == "empty":
        file.write_text("")
    elif choice == "not an object":
        file.write_text(rng.choice(['"parity-bundle"', "[]", "null", "3"]))
    elif choice == "huge sparse":
        with open(file, "r+b") as handle:
            handle.truncate(257 * 2**20)
    elif choice == "symlink":  # to an intact copy outside the bundle: still refused
        outside = path.parent / f"{path.name}-outside-manifest.json"
        outside.write_text(text)
        file.unlink()
        file.symlink_to(outside)
    elif choice == "fifo":
        file.unlink()
        os.mkfifo(file)
    elif choice == "directory":
        file.unlink()
        file.mkdir()
    elif choice == "deleted":
        file.unlink()
    elif choice == "utf-16":
        file.write_bytes(text.encode("utf-16"))
    elif choice == "bom":
        file.write_bytes(b"\xef\xbb\xbf" + text.encode())
    elif choice == "nan":
        file.write_text(text.replace('"call_index": 0', '"call_index": NaN', 1).replace('"nbytes": ', '"nbytes": NaN, "x": ', 1))
    elif choice == "1e999":
        file.write_text(text.replace('"nbytes": ', '"nbytes": 1e999, "x": ', 1))
    elif choice == "duplicate key":
        file.write_text(text.replace('"impl": ', '"impl": "triton", "impl": ', 1))
    elif choice == "huge int":
        file.write_text(text.replace('"nbytes": ', '"nbytes": ' + "9" * 5000 + ', "x": ', 1))
    return Mutation("manifest: special file or content", choice)


# Resealed manifest edits the schema must refuse ------------------------------------------------------

WRONG_VALUES = [None, True, False, 0, -1, 1.5, "x", "", [], {}, [1], {"a": 1}]


def _typed_fields(manifest: dict[str, Any]) -> list[tuple[tuple, tuple]]:
    """(path, allowed JSON types) of every field the schema types; "nonneg" ints, "hex" strings."""
    fields = [(("format",), ("format",)), (("schema_version",), ("version",)), (("parity_version",), (str, None)),
              (("created",), (str, None)), (("manifest_sha256",), ("hex",)), (("subject",), (dict,)),
              (("subject", "spec"), ("nonempty",)), (("subject", "name"), (str,)), (("subject", "args"), (dict,)),
              (("impl",), (str, None)), (("device",), (str, None)), (("platform",), (dict,)),
              (("kernel_configs",), (dict, None)), (("hooks_check",), (dict, None)), (("inputs_meta",), (dict,)),
              (("shards",), (list,)), (("entries",), (list,))]
    for key in ("vendor", "arch", "device_name", "torch", "triton"):
        if key in manifest["platform"]:
            fields.append((("platform", key), (str, None)))
    for key in ("triton_interpreter", "tf32_matmul", "deterministic_algorithms"):
        fields.append((("platform", key), (bool, None)))
    for key in ("used", "provided"):
        fields.append((("kernel_configs", key), (dict, None)))
    fields += [(("capture",), (dict, None)), (("capture", "layers"), (list, None)),
               (("capture", "record_inputs"), (bool,)), (("capture", "shard_bytes"), ("positive", None)),
               (("capture", "reference"), (dict, None)), (("hooks_check", "bitwise_equal"), (bool,)),
               (("hooks_check", "tensors_compared"), ("nonneg", None)),
               (("hooks_check", "first_difference"), (str, None))]
    for i in range(len(manifest["shards"])):
        fields += [(("shards", i), (dict,)), (("shards", i, "file"), ("shardname",)),
                   (("shards", i, "bytes"), ("nonneg",)), (("shards", i, "tensors"), ("nonneg",)),
                   (("shards", i, "sha256"), ("hex",)), (("shards", i, "header_blake3"), ("hex",))]
    for i, entry in enumerate(manifest["entries"]):
        fields += [(("entries", i), (dict,)), (("entries", i, "kind"), ("kind",)), (("entries", i, "name"), (str,)),
                   (("entries", i, "dtype"), ("dtype",)), (("entries", i, "shape"), (list,)),
                   (("entries", i, "shard"), ("shardname",)), (("entries", i, "key"), ("nonempty",)),
                   (("entries", i, "blake3"), ("hex",)), (("entries", i, "nbytes"), ("nonneg",)),
                   (("entries", i, "module"), (str, None)), (("entries", i, "call_index"), ("nonneg", None))]
        fields += [(("entries", i, "shape", j), ("nonneg",)) for j in range(len(entry["shape"]))]
        if entry["kind"] in ("output", "module_input", "reference"):
            fields += [(("entries", i, "layer"), (str,)), (("entries", i, "path"), (str, None))]
    for group in ("layers", "reference_layers"):
        fields.append(((group,), (list,)))
        for i, layer in enumerate(manifest[group]):
            fields += [((group, i), (dict,)), ((group, i, "name"), ("nonempty",)), ((group, i, "module"), ("nonempty",)),
                       ((group, i, "call_index"), ("nonneg",)), ((group, i, "outputs"), ("tree",)),
                       ((group, i, "inputs"), ("tree", None) if layer["inputs"] is not None else (None,))]
    return [(path, allowed) for path, allowed in fields if _has(manifest, path)]


def _wrong_for(allowed: tuple) -> list[Any]:
    def fits(value):
        for kind in allowed:
            if kind is None and value is None:
                return True
            if kind in (str, "nonempty", "hex", "shardname", "kind", "dtype", "format") and isinstance(value, str):
                return kind is str or (kind == "nonempty" and value)
            if kind in ("nonneg", "positive", "version") and isinstance(value, int) and not isinstance(value, bool):
                return value >= (1 if kind == "positive" else 0)
            if kind in (bool, dict, list) and type(value) is kind:
                return True
            if kind == "tree" and False:
                return True
        return False

    return [value for value in WRONG_VALUES if not fits(value)]


def m_schema_retyped(base, path, rng):
    manifest = _manifest(path)
    field, allowed = rng.choice(_typed_fields(manifest))
    value = rng.choice(_wrong_for(allowed))
    _set(manifest, field, copy.deepcopy(value))
    _write_manifest(path, manifest, reseal=True)
    return Mutation("schema: field of the wrong type", f"{_fmt(field)} = {value!r}")


REQUIRED = ("format", "schema_version", "subject", "shards", "entries")


def m_schema_deleted(base, path, rng):
    manifest = _manifest(path)
    candidates = [(key,) for key in REQUIRED] + [("subject", "spec")]
    candidates += [("shards", i, key) for i in range(len(manifest["shards"])) for key in ("file", "bytes", "tensors", "header_blake3")]
    candidates += [("entries", i, key) for i in range(len(manifest["entries"]))
                   for key in ("kind", "name", "dtype", "shape", "shard", "key", "blake3", "nbytes", "layer")
                   if key in manifest["entries"][i] and (key != "layer" or manifest["entries"][i]["layer"] is not None)]
    candidates += [(group, i, key) for group in ("layers", "reference_layers") for i in range(len(manifest[group]))
                   for key in ("name", "module", "call_index", "outputs")]
    candidates += [("shards", i) for i in range(len(manifest["shards"]))]
    candidates += [("entries", i) for i in range(len(manifest["entries"]))]
    field = rng.choice(candidates)
    _delete(manifest, field)
    _write_manifest(path, manifest, reseal=True)
    return Mutation("schema: required field deleted", _fmt(field))


def m_schema_numbers(base, path, rng):
    manifest = _manifest(path)
    fields = [f for f, allowed in _typed_fields(manifest) if set(allowed) & {"nonneg", "positive", "version"}]
    field = rng.choice(fields)
    value = rng.choice([-1, -2**63, 2**63, 2**64 + 1, 10**30])
    if field == ("schema_version",):
        value = rng.choice([0, 3, 99, -1, 2**63])
    _set(manifest, field, value)
    _write_manifest(path, manifest, reseal=True)
    return Mutation("schema: negative or huge number", f"{_fmt(field)} = {value}")


def m_schema_huge(base, path, rng):
    manifest = _manifest(path)
    i = rng.randrange(len(manifest["entries"]))
    choice = rng.choice(["name", "layer", "platform.vendor", "capture glob", "elements", "nbytes beyond shard",
                         "deep args", "deep tree", "many dims"])
    entry = manifest["entries"][i]
    if choice in ("name", "layer"):
        entry[choice] = "x" * 70000
    elif choice == "platform.vendor":
        manifest["platform"]["vendor"] = "v" * 5000
    elif choice == "capture glob":
        manifest["capture"]["layers"] = ["*" * 20000]
    elif choice == "elements":
        entry["shape"] = [2**31, 2**31, 4]
        entry["nbytes"] = 2**64 * 4
    elif choice == "nbytes beyond shard":
        entry["shape"] = [2**40]
        entry["nbytes"] = 2**40 * int(entry["nbytes"] / max(1, _numel(base, entry)) or 1)
    elif choice == "deep args":
        nested = 1
        for _ in range(100):
            nested = [nested]
        manifest["subject"]["args"]["deep"] = nested
    elif choice == "deep tree":
        node = {"value": 1}
        for _ in range(100):
            node = {"tuple": [node]}
        layer = rng.choice(manifest["layers"])
        layer["outputs"] = {"tuple": [layer["outputs"], node]}
    else:
        entry["shape"] = [1] * 100
    _write_manifest(path, manifest, reseal=True)
    return Mutation("schema: huge value", f"entries[{i}] {choice}")


def _numel(base, entry):
    numel = 1
    for n in entry["shape"]:
        numel *= n
    return numel


def m_schema_unknown(base, path, rng):
    manifest = _manifest(path)
    choice = rng.choice(["dtype", "kind", "version", "format"])
    if choice == "dtype":
        i = rng.randrange(len(manifest["entries"]))
        manifest["entries"][i]["dtype"] = rng.choice(["float128", "complex64", "F32", "", "int4", "torch.float32",
                                                      "Float32", "object"])
        detail = f"entries[{i}].dtype {manifest['entries'][i]['dtype']!r}"
    elif choice == "kind":
        i = rng.randrange(len(manifest["entries"]))
        manifest["entries"][i]["kind"] = rng.choice(["weights", "", "Output", "outputs"])
        detail = f"entries[{i}].kind {manifest['entries'][i]['kind']!r}"
    elif choice == "version":
        # 1-3 are known versions, but their digests are sha256 fields this (version 4) manifest lacks
        manifest["schema_version"] = rng.choice([0, 1, 2, 3, 5, 99, 1000])
        detail = f"schema_version {manifest['schema_version']}"
    else:
        manifest["format"] = rng.choice(["parity-bundle-v2", "", "safetensors"])
        detail = f"format {manifest['format']!r}"
    _write_manifest(path, manifest, reseal=True)
    return Mutation("schema: unknown dtype, kind, version or format", detail)


def m_schema_duplicates(base, path, rng):
    manifest = _manifest(path)
    entries = manifest["entries"]
    choice = rng.choice(["name", "key", "shard listed twice", "layer"])
    if choice == "name":
        kind = rng.choice(sorted({e["kind"] for e in entries if sum(x["kind"] == e["kind"] for x in entries) > 1}))
        i, j = rng.sample([n for n, e in enumerate(entries) if e["kind"] == kind], 2)
        entries[j]["name"] = entries[i]["name"]
        for field in ("layer", "path"):
            entries[j][field] = entries[i][field]
    elif choice == "key":
        shard = rng.choice([s for s in {e["shard"] for e in entries} if sum(e["shard"] == s for e in entries) > 1])
        i, j = rng.sample([n for n, e in enumerate(entries) if e["shard"] == shard], 2)
        entries[j]["key"] = entries[i]["key"]
    elif choice == "shard listed twice":
        manifest["shards"].append(dict(manifest["shards"][rng.randrange(len(manifest["shards"]))]))
    else:
        layers = manifest["layers"]
        if len(layers) > 1:
            i, j = rng.sample(range(len(layers)), 2)
            layers[j] = copy.deepcopy(layers[i])
        else:
            layers.append(copy.deepcopy(layers[0]))
    _write_manifest(path, manifest, reseal=True)
    return Mutation("schema: duplicate names, keys, shards or layers", choice)


BAD_FILE_NAMES = ["../x.safetensors", "../../etc/passwd", "/etc/passwd", "a/b.safetensors", "..", ".", "",
                  "x" * 300, "manifest.json", "nul\x00.safetensors", ".hidden", "sub/../shard-00000.safetensors",
                  "shard\n.safetensors", "C:\\x.safetensors", "\x1b[31mred"]


def m_schema_file_names(base, path, rng):
    manifest = _manifest(path)
    bad = rng.choice(BAD_FILE_NAMES)
    i = rng.randrange(len(manifest["shards"]))
    old = manifest["shards"][i]["file"]
    where = rng.choice(["shard and its entries", "one entry"])
    if where == "shard and its entries":
        manifest["shards"][i]["file"] = bad
        for entry in manifest["entries"]:
            if entry["shard"] == old:
                entry["shard"] = bad
    else:
        next(e for e in manifest["entries"] if e["shard"] == old)["shard"] = bad
    _write_manifest(path, manifest, reseal=True)
    return Mutation("schema: escaping or bad shard file name", f"{where}: {bad!r}")


BAD_NODES = [{"tensor": "wrong/path"}, {"tensor": 5}, {"bogus": 1}, {"tensor": "", "value": 1}, {"dtype": "load"},
             {"dtype": "Tensor"}, {"float": "1.0"}, {"value": [1]}, {"value": {"a": 1}}, {"dict": [["k"]]},
             {"dict": [[True, {"value": 1}]]}, {"tuple": "x"}, {}, [], "x", None, {"opaque": 5}, {"list": [None]}]


def m_schema_tree(base, path, rng):
    manifest = _manifest(path)
    groups = [g for g in ("layers", "reference_layers") if manifest[g]]
    group = rng.choice(groups)
    i = rng.randrange(len(manifest[group]))
    layer = manifest[group][i]
    side = rng.choice([s for s in ("outputs", "inputs") if layer.get(s) is not None])
    nodes = list(_tree_nodes(layer[side], (group, i, side)))
    where = rng.choice(nodes)
    bad = copy.deepcopy(rng.choice(BAD_NODES))
    if where == (group, i, side) and rng.random() < 0.3 and side == "inputs":
        bad = {"tuple": [layer[side]]}  # an inputs tree whose root is not args/kwargs
    _set(manifest, where, bad)
    _write_manifest(path, manifest, reseal=True)
    return Mutation("schema: layer tree damaged", f"{_fmt(where)} = {bad!r}")


def _tree_nodes(node, at):
    yield at
    if isinstance(node, dict):
        for kind in ("tuple", "list"):
            for n, item in enumerate(node.get(kind, ())):
                yield from _tree_nodes(item, (*at, kind, n))
        for n, pair in enumerate(node.get("dict", ())):
            yield from _tree_nodes(pair[1], (*at, "dict", n, 1))


def m_entry_consistent(base, path, rng):
    """Edits the schema accepts but the shard contradicts: caught when that tensor is read."""
    manifest = _manifest(path)
    entries = manifest["entries"]
    i = rng.randrange(len(entries))
    entry = entries[i]
    choice = rng.choice(["blake3", "shape", "dtype", "key swap"])
    touched = {(entry["kind"], entry["name"])}
    if choice == "blake3":
        entry["blake3"] = hashlib.sha256(rng.randbytes(8)).hexdigest()  # any other 64 hex digits
    elif choice == "shape":
        entry["shape"] = [_numel(base, entry)] if len(entry["shape"]) > 1 else [1, *entry["shape"]]
    elif choice == "dtype":
        same_size = {"float16": "bfloat16", "bfloat16": "float16", "float32": "int32", "int32": "float32",
                     "float64": "int64", "int64": "float64", "uint8": "int8", "int8": "uint8", "bool": "uint8"}
        entry["dtype"] = same_size[entry["dtype"]]
    else:  # with a tensor of other contents (swapping two identical tensors changes nothing read)
        partners = [j for j, e in enumerate(entries) if e["shard"] == entry["shard"] and e["blake3"] != entry["blake3"]]
        j = rng.choice(partners)
        entry["key"], entries[j]["key"] = entries[j]["key"], entry["key"]
        touched.add((entries[j]["kind"], entries[j]["name"]))
    _write_manifest(path, manifest, reseal=True)
    return Mutation("schema-valid entry contradicting its shard", f"entries[{i}] {choice}", "entries", touched)


def m_tolerated(base, path, rng):
    manifest = _manifest(path)
    choice = rng.choice(["top-level field", "entry field", "shard field", "subject field", "layer field"])
    if choice == "top-level field":
        manifest["x_future"] = {"added": [1, 2, 3]}
    elif choice == "entry field":
        rng.choice(manifest["entries"])["x_note"] = "later"
    elif choice == "shard field":
        rng.choice(manifest["shards"])["x_compression"] = None
    elif choice == "subject field":
        manifest["subject"]["x_version"] = 3
    else:
        rng.choice(manifest["layers"])["x_seconds"] = 1.5
    _write_manifest(path, manifest, reseal=True)
    return Mutation("tolerated: unknown field added", choice, "tolerated")


def m_subject_data(base, path, rng):
    """Free-form subject data (args, inputs_meta) retyped and resealed: the subject's business."""
    manifest = _manifest(path)
    leaves = [(p, v) for p, v in _leaves(manifest["subject"]["args"], ("subject", "args"))]
    leaves += [(p, v) for p, v in _leaves(manifest["inputs_meta"], ("inputs_meta",))]
    leaves += [(p[:-1], None) for p, _ in leaves if len(p) > 2]
    field, value = rng.choice(leaves)
    replacement = rng.choice([v for v in WRONG_VALUES if type(v) is not type(value)])
    _set(manifest, field, copy.deepcopy(replacement))
    _write_manifest(path, manifest, reseal=True)
    return Mutation("subject data retyped (resealed)", f"{_fmt(field)} = {replacement!r}", "subject")


# Shard damage ---------------------------------------------------------------------------------------


def _shard(base, path, rng):
    name = rng.choice(base.shards)
    return name, path / name


def m_shard_data_flip(base, path, rng):
    name, file = _shard(base, path, rng)
    length = base.headers[name][0]
    offset = rng.randrange(8 + length, file.stat().st_size)
    _flip(file, offset, rng)
    return Mutation("shard: data byte flipped", f"{name} offset {offset}")


def m_shard_header_flip(base, path, rng):
    name, file = _shard(base, path, rng)
    length = base.headers[name][0]
    offset = rng.randrange(0, 8 + length)
    _flip(file, offset, rng)
    return Mutation("shard: header byte flipped", f"{name} offset {offset}")


def m_shard_header_length(base, path, rng):
    name, file = _shard(base, path, rng)
    data = bytearray(file.read_bytes())
    length = base.headers[name][0]
    value = rng.choice([2**60, 2**64 - 1, 0, 1, len(data), len(data) - 8, length + 8, length - 8, 2**63])
    data[:8] = value.to_bytes(8, "little")
    file.write_bytes(bytes(data))
    return Mutation("shard: header length", f"{name} = {value}")


def m_shard_size(base, path, rng):
    name, file = _shard(base, path, rng)
    data = file.read_bytes()
    if rng.random() < 0.6:
        cut = rng.choice([0, 4, 8, rng.randrange(len(data)), len(data) - 1])
        file.write_bytes(data[:cut])
        return Mutation("shard: truncated", f"{name} to {cut}")
    extra = rng.randbytes(rng.randint(1, 64))
    file.write_bytes(data + extra)
    return Mutation("shard: extended", f"{name} + {len(extra)} bytes")


def m_shard_files(base, path, rng):
    name, file = _shard(base, path, rng)
    choice = rng.choice(["deleted", "symlink outside", "symlink inside", "directory", "fifo", "swapped",
                         "extra shard", "extra file", "empty"])
    data = file.read_bytes()
    if choice == "deleted":
        file.unlink()
    elif choice == "symlink outside":  # an intact copy outside the bundle
        outside = path.parent / f"{path.name}-outside-{name}"
        outside.write_bytes(data)
        file.unlink()
        file.symlink_to(outside)
    elif choice == "symlink inside":
        hidden = path / "hidden.bin"
        hidden.write_bytes(data)
        file.unlink()
        file.symlink_to("hidden.bin")
    elif choice == "directory":
        file.unlink()
        file.mkdir()
    elif choice == "fifo":
        file.unlink()
        os.mkfifo(file)
    elif choice == "swapped":
        other = path / rng.choice([s for s in base.shards if s != name])
        other_data = other.read_bytes()
        other.write_bytes(data)
        file.write_bytes(other_data)
    elif choice == "extra shard":
        (path / "shard-99999.safetensors").write_bytes(data)
    elif choice == "extra file":
        (path / rng.choice(["notes.txt", ".DS_Store", "manifest.json.bak"])).write_text("x")
    else:
        file.write_bytes(b"")
    return Mutation("shard: missing, extra, symlinked or not a file", f"{name} {choice}")


def m_directory(base, path, rng):
    choice = rng.choice(["empty directory", "file instead", "missing", "symlink loop", "name too long",
                         "only manifest", "only shards"])
    target = None
    if choice == "empty directory":
        shutil.rmtree(path)
        path.mkdir()
    elif choice == "file instead":
        shutil.rmtree(path)
        path.write_text("not a bundle")
    elif choice == "missing":
        shutil.rmtree(path)
    elif choice == "symlink loop":
        shutil.rmtree(path)
        loop = path.parent / f"{path.name}-loop"
        path.symlink_to(loop)
        loop.symlink_to(path)
    elif choice == "name too long":
        target = path.parent / ("b" * 300)
    elif choice == "only manifest":
        for shard in base.shards:
            (path / shard).unlink()
    else:
        (path / "manifest.json").unlink()
    return Mutation("bundle directory missing, empty, a file or unreachable", choice, bundle_path=target)


CATEGORIES: list[Callable] = [
    m_manifest_flip, m_manifest_truncate, m_manifest_insert, m_manifest_hand_edit, m_manifest_unsealed,
    m_manifest_special, m_schema_retyped, m_schema_deleted, m_schema_numbers, m_schema_huge, m_schema_unknown,
    m_schema_duplicates, m_schema_file_names, m_schema_tree, m_entry_consistent, m_tolerated, m_subject_data,
    m_shard_data_flip, m_shard_header_flip, m_shard_header_length, m_shard_size, m_shard_files, m_directory,
]


# ---- JSON path helpers --------------------------------------------------------------------------------


def _has(value, path) -> bool:
    for part in path:
        if isinstance(value, dict) and part in value or isinstance(value, list) and isinstance(part, int) \
                and part < len(value):
            value = value[part]
        else:
            return False
    return True


def _set(root, path, value) -> None:
    for part in path[:-1]:
        root = root[part]
    root[path[-1]] = value


def _delete(root, path) -> None:
    for part in path[:-1]:
        root = root[part]
    del root[path[-1]]


def _leaves(value, at=()):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*at, key))
    elif isinstance(value, list) and value:
        for n, item in enumerate(value):
            yield from _leaves(item, (*at, n))
    else:
        yield at, value


def _other_value(value, rng):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + rng.choice([1, -1, 7])
    if isinstance(value, float):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "x" if value else "x"
    return "x"


def _fmt(path) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


# ---- the runner -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Tally:
    variants: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    outcomes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    failures: list = dataclasses.field(default_factory=list)
    outside: list = dataclasses.field(default_factory=list)  # known misbehaviour of code outside the bundle reader


def _one_line_error(run: Run) -> bool:
    return run.err.count("\n") == 1 and run.err.startswith("parity: error: ") and "Traceback" not in run.err


def check_variant(base: Base, number: int, mutation: Mutation, path: Path, expect: Expect, tally: Tally) -> None:
    target = str(mutation.bundle_path or path)
    label = f"#{number} {base.name}: {mutation.category}: {mutation.detail}"
    problems = []
    run = run_cli(["verify", target])
    want = "0 or 2" if expect.verify_any else (2 if expect.data_changed else 0)
    tally.outcomes[(mutation.category, "verify", run.crash and "crash" or run.rc)] += 1
    if run.crash:
        problems.append(f"verify crashed: {run.crash}")
    elif run.rc not in ((0, 2) if expect.verify_any else (want,)):
        problems.append(f"verify exit {run.rc}, expected {want}; stderr {run.err.strip()!r}")
    elif run.rc == 2 and not _one_line_error(run):
        problems.append(f"verify's stderr is not one line: {run.err!r}")
    for mode, (base_rc, base_verdict, verified) in base.baseline.items():
        run = run_cli(["compare", "--golden", target, *COMPARE, *mode])
        must_fail = expect.compare_must_fail(base, verified)
        outcome = run.crash and "crash" or ("2" if run.rc == 2 else "same as undamaged"
                                            if run.rc == base_rc and verdict(run) == base_verdict else f"exit {run.rc}")
        tally.outcomes[(mutation.category, "compare", outcome)] += 1
        where = f"compare {' '.join(mode) or '(default)'}"
        if run.crash:
            problems.append(f"{where} crashed: {run.crash}")
        elif run.rc == 2:
            if not _one_line_error(run):
                problems.append(f"{where}: stderr is not one line: {run.err!r}")
        elif must_fail:
            problems.append(f"{where} exit {run.rc}, but the damage changed what it reads")
        elif expect.verify_any and run.rc == 0:
            pass
        elif run.rc != base_rc or verdict(run) != base_verdict:
            problems.append(f"{where} exit {run.rc} ({verdict(run)!r}), undamaged: {base_rc} ({base_verdict!r})")
    if problems and mutation.meaning == "subject" and any(re.search(p, mutation.detail) for p in KNOWN_OUTSIDE):
        tally.outside.append(f"{label}: " + "; ".join(problems))
    elif problems:
        tally.failures.append(f"{label}: " + "; ".join(problems))


def run_mutations(bases: dict[str, Base], work: Path, count: int, seed: int) -> Tally:
    tally = Tally()
    names = list(bases)
    for number in range(count):
        category = CATEGORIES[number % len(CATEGORIES)]
        base = bases[names[(number // len(CATEGORIES)) % len(names)]]
        rng = random.Random(seed * 1_000_003 + number)
        where = work / f"v{number}"
        where.mkdir()
        path = where / "b"
        shutil.copytree(base.path, path)
        try:
            mutation = category(base, path, rng)
        except (ValueError, IndexError, StopIteration, KeyError):  # not applicable to this bundle
            shutil.rmtree(where)
            continue
        expect = judge(base, mutation.bundle_path or path, mutation.meaning, mutation.entries)
        tally.variants[mutation.category] += 1
        check_variant(base, number, mutation, path, expect, tally)
        _remove(where)
    return tally


def _remove(where: Path) -> None:
    for root, dirs, files in os.walk(where):
        for name in dirs + files:
            try:
                os.chmod(Path(root) / name, 0o700, follow_symlinks=False)
            except (OSError, NotImplementedError):
                pass
    shutil.rmtree(where, ignore_errors=True)


def summary(tally: Tally) -> str:
    lines = [f"{sum(tally.variants.values())} variants"]
    for category, number in sorted(tally.variants.items()):
        outcomes = {f"{tool} {result}": n for (cat, tool, result), n in sorted(tally.outcomes.items(), key=str)
                    if cat == category}
        lines.append(f"  {category}: {number} variants; " + ", ".join(f"{k}: {v}" for k, v in outcomes.items()))
    totals = collections.Counter()
    for (_, tool, result), n in tally.outcomes.items():
        totals[f"{tool} {result}"] += n
    lines.append("  all: " + ", ".join(f"{k}: {v}" for k, v in sorted(totals.items())))
    return "\n".join(lines)


def _check(tally: Tally, minimum: int) -> None:
    print("\n" + summary(tally))
    for finding in tally.outside:
        print(f"  known, outside the reader: {finding}")
    assert sum(tally.variants.values()) >= minimum
    assert not tally.failures, f"{len(tally.failures)} variants misbehaved:\n" + "\n".join(tally.failures[:40])


# One seed for both runs: the fast run's variants are the first FAST_COUNT of the full run's (each
# variant's damage is drawn from seed and number alone), so a session that runs the full one skips
# the fast one (tests/conftest.py, PREFIX_OF) and loses no variant.
SEED = 2


@pytest.mark.slow  # hundreds of damaged bundles (the full run has the mutation marker)
def test_mutation_fast(bases, tmp_path):
    _check(run_mutations(bases, tmp_path, FAST_COUNT, seed=SEED), minimum=FAST_COUNT * 9 // 10)


@pytest.mark.mutation
def test_mutation_full(bases, tmp_path):
    _check(run_mutations(bases, tmp_path, FULL_COUNT, seed=SEED), minimum=1000)


def test_undamaged_bundles_verify_and_compare(bases, tmp_path):
    for base in bases.values():
        run = run_cli(["verify", str(base.path)])
        assert run.rc == 0 and run.err == "" and "OK" in run.out.splitlines()[0]
        assert "every checksum matches" in run.out
        assert base.baseline[()][0] == 0 and base.baseline[()][2]  # compare loaded (and so verified) tensors
