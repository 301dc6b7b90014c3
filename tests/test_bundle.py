"""The bundle format: round trips, shard rotation, atomic writes, --force, and every kind of damage."""
import hashlib
import json
import os
import pickle
import struct

import blake3
import pytest
import torch
from safetensors import safe_open

from parity.bundle.manifest import MANIFEST_NAME, SCHEMA_VERSION
from parity.bundle.reader import BundleReader, open_bundle
from parity.bundle.writer import BundleWriter, edit_manifest
from parity.base.errors import BundleError, UsageError

from bundle_versions import as_version


def _all_dtype_tensors():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, generator=gen)
    tensors = {
        "float64": base.double(),
        "float32": base,
        "float16": base.half(),
        "bfloat16": base.bfloat16(),
        "float8_e4m3fn": base.to(torch.float8_e4m3fn),
        "float8_e5m2": base.to(torch.float8_e5m2),
        "int64": torch.arange(-7, 8, dtype=torch.int64).view(3, 5),
        "int32": torch.arange(15, dtype=torch.int32),
        "int16": torch.arange(15, dtype=torch.int16),
        "int8": torch.arange(-3, 3, dtype=torch.int8),
        "uint8": torch.arange(200, 215, dtype=torch.uint8),
        "bool": base > 0,
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "noncontiguous": base.t(),
        "special": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40]),
    }
    return tensors


def _write(path, tensors, *, kind="output", shard_bytes=1 << 20, force=False, fields=None):
    with BundleWriter(path, force=force, shard_bytes=shard_bytes) as writer:
        for name, tensor in tensors.items():
            writer.add(kind, name, tensor, layer=name, module=name, call_index=0, path="")
        writer.commit(fields or {"subject": {"spec": "test", "name": "test", "args": {}}})
    return path


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def test_round_trip_every_dtype_bitwise(tmp_path):
    tensors = _all_dtype_tensors()
    bundle = open_bundle(_write(tmp_path / "b", tensors))
    assert [entry.name for entry in bundle.entries_of("output")] == list(tensors)
    for entry, loaded in bundle.iter_tensors("output"):
        assert _same_bits(loaded, tensors[entry.name].contiguous()), entry.name
    assert bundle.manifest["schema_version"] == SCHEMA_VERSION
    assert bundle.verify() == len(tensors)


def test_bf16_is_stored_natively(tmp_path):
    bundle = open_bundle(_write(tmp_path / "b", {"x": torch.ones(4, dtype=torch.bfloat16)}))
    entry = bundle.entry("x")
    with safe_open(str(tmp_path / "b" / entry.shard), framework="pt") as handle:
        assert handle.get_slice(entry.key).get_dtype() == "BF16"
    assert entry.nbytes == 8


def test_shards_rotate_at_the_size_limit(tmp_path):
    tensors = {f"t{i}": torch.full((256,), float(i)) for i in range(10)}  # 1 KiB each
    bundle = open_bundle(_write(tmp_path / "b", tensors, shard_bytes=3 * 1024))
    shards = bundle.manifest["shards"]
    assert len(shards) == 4  # 3 + 3 + 3 + 1 tensors
    assert [shard["tensors"] for shard in shards] == [3, 3, 3, 1]
    for shard in shards:
        assert shard["file"].startswith("shard-") and shard["bytes"] < 3 * 1024 + 1024
    for entry, loaded in bundle.iter_tensors():
        assert torch.equal(loaded, tensors[entry.name])


def test_a_tensor_larger_than_the_limit_gets_its_own_shard(tmp_path):
    tensors = {"small": torch.zeros(4), "big": torch.zeros(4096), "after": torch.zeros(4)}
    bundle = open_bundle(_write(tmp_path / "b", tensors, shard_bytes=1024))
    assert [shard["tensors"] for shard in bundle.manifest["shards"]] == [1, 1, 1]


def test_layer_names_never_become_file_names(tmp_path):
    names = ["../../escape", "/abs/path", "a/b/c", "naïve-ünïcode-層", "x" * 5000, "..", ".", "", "nul\x00byte"]
    tensors = {name: torch.tensor([float(i)]) for i, name in enumerate(names)}
    path = _write(tmp_path / "b", tensors)
    files = sorted(os.listdir(path))
    assert files == [MANIFEST_NAME, "shard-00000.safetensors"]
    bundle = open_bundle(path)
    for i, name in enumerate(names):
        assert bundle.load(name).item() == float(i)
    assert sorted(os.listdir(tmp_path)) == ["b"]


def test_nested_outputs_round_trip_through_flatten(tmp_path):
    from parity.run.recorder import flatten, unflatten

    value = {"logits": torch.randn(2, 3), "stats": (torch.ones(2), [torch.zeros(1, dtype=torch.bfloat16), None]),
             "a/b": torch.arange(3), 3: torch.tensor(True), "scale": 0.5, "nan": float("nan")}
    tree, tensors = flatten(value)
    assert [path for path, _ in tensors] == ["logits", "stats/0", "stats/1/0", "a%2Fb", "3"]
    bundle = open_bundle(_write(tmp_path / "b", {f"layer/{p}": t for p, t in tensors}))
    loaded = {p: bundle.load(f"layer/{p}") for p, _ in tensors}
    rebuilt = json.loads(json.dumps(tree, allow_nan=False))  # the tree is JSON-safe
    back = unflatten(rebuilt, loaded)
    assert set(back) == set(value) and back["scale"] == 0.5 and back["nan"] != back["nan"]
    assert torch.equal(back["stats"][1][0], value["stats"][1][0]) and back["stats"][1][1] is None
    assert isinstance(back["stats"], tuple) and isinstance(back["stats"][1], list)
    assert torch.equal(back[3], value[3])


def test_reading_never_unpickles(tmp_path, monkeypatch):
    path = _write(tmp_path / "b", _all_dtype_tensors())

    def forbidden(*args, **kwargs):
        raise AssertionError("a bundle read must never unpickle")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    assert open_bundle(path).verify() == len(_all_dtype_tensors())


# ---- atomic writes and --force ---------------------------------------------------------------


def _leftovers(directory):
    return [name for name in os.listdir(directory) if name.startswith(".")]


@pytest.mark.parametrize("interrupt", [RuntimeError("boom"), KeyboardInterrupt()])
def test_interrupted_write_leaves_nothing(tmp_path, interrupt):
    target = tmp_path / "b"
    with pytest.raises(type(interrupt)):
        with BundleWriter(target, shard_bytes=64) as writer:
            for i in range(5):
                writer.add("output", f"t{i}", torch.zeros(32))  # several shards already on disk
            raise interrupt
    assert not target.exists()
    assert _leftovers(tmp_path) == []


def test_interrupted_replacement_leaves_the_old_bundle_untouched(tmp_path):
    target = _write(tmp_path / "b", {"old": torch.ones(3)})
    before = {name: (target / name).read_bytes() for name in os.listdir(target)}
    with pytest.raises(KeyboardInterrupt):
        with BundleWriter(target, force=True, shard_bytes=64) as writer:
            for i in range(5):
                writer.add("output", f"t{i}", torch.zeros(32))
            raise KeyboardInterrupt
    assert {name: (target / name).read_bytes() for name in os.listdir(target)} == before
    assert _leftovers(tmp_path) == []
    assert open_bundle(target).load("old").tolist() == [1.0, 1.0, 1.0]


@pytest.mark.slow  # a writer in a real process, killed
def test_a_killed_writers_partial_directory_is_removed_by_the_next_writer(tmp_path):
    """A capture killed with SIGKILL cannot clean up its hidden partial directory; the next
    writer of the same target removes it when its process is gone, on this host only."""
    import signal
    import subprocess
    import sys

    from parity.bundle.commit import _partial_prefix

    target = tmp_path / "b"
    code = ("import sys, torch; from parity.bundle.writer import BundleWriter\n"
            f"w = BundleWriter({str(target)!r}, shard_bytes=64)\n"
            "w.add('output', 'x', torch.zeros(64)); w.add('output', 'z', torch.zeros(64))\n"
            "print('ready', flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGKILL)
    child.wait()
    stale = [p for p in tmp_path.iterdir() if p.name.startswith(_partial_prefix(target))]
    assert len(stale) == 1 and any(stale[0].iterdir()), "the killed writer left its shards behind"
    live = tmp_path / (_partial_prefix(target) + f"{os.getpid()}-live")       # a running writer's
    other = tmp_path / f".b.partial-otherhost-{child.pid}-x"                   # another host's
    live.mkdir()
    other.mkdir()
    _write(target, {"y": torch.ones(2)})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["b", live.name, other.name])
    assert open_bundle(target).load("y").tolist() == [1.0, 1.0]


def test_uncommitted_writer_leaves_nothing(tmp_path):
    with BundleWriter(tmp_path / "b") as writer:
        writer.add("output", "x", torch.zeros(2))
    assert os.listdir(tmp_path) == []


def test_existing_bundle_needs_force(tmp_path):
    target = _write(tmp_path / "b", {"old": torch.ones(1)})
    with pytest.raises(UsageError, match="already exists; pass --force"):
        BundleWriter(target)
    _write(target, {"new": torch.zeros(1)}, force=True)
    bundle = open_bundle(target)
    assert [entry.name for entry in bundle.entries] == ["new"]
    assert _leftovers(tmp_path) == []


def test_force_refuses_to_replace_a_directory_that_is_not_a_bundle(tmp_path):
    target = tmp_path / "notes"
    target.mkdir()
    (target / "thesis.txt").write_text("precious")
    with pytest.raises(UsageError, match="not a parity bundle; refusing"):
        BundleWriter(target, force=True)
    assert (target / "thesis.txt").read_text() == "precious"
    empty = tmp_path / "empty"
    empty.mkdir()
    _write(empty, {"x": torch.ones(1)}, force=True)
    assert open_bundle(empty).load("x").item() == 1.0


def test_missing_parent_directory_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="parent directory"):
        BundleWriter(tmp_path / "no" / "such" / "bundle")


def test_duplicate_names_are_refused(tmp_path):
    with BundleWriter(tmp_path / "b") as writer:
        writer.add("output", "x", torch.zeros(1))
        writer.add("reference", "x", torch.zeros(1, dtype=torch.float64))  # other kind: fine
        with pytest.raises(UsageError, match="share the name 'x'"):
            writer.add("output", "x", torch.zeros(1))


# ---- damage: each gives one clear BundleError line naming the file ---------------------------


@pytest.fixture
def bundle_path(tmp_path):
    tensors = {"a": torch.arange(64, dtype=torch.float32), "b": torch.ones(8, dtype=torch.bfloat16),
               "c": torch.zeros(16, dtype=torch.float16)}
    return _write(tmp_path / "b", tensors, shard_bytes=300)  # a and b, c: two shards


def _edit_manifest(path, edit):
    """A deliberate, resealed edit: what the schema check (not the manifest checksum) must catch."""
    edit_manifest(path, edit)


def _damage(path, how):
    shard = path / "shard-00000.safetensors"
    if how == "truncated shard":
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) - 10])
    elif how == "flipped byte":
        data = bytearray(shard.read_bytes())
        data[-3] ^= 0x40  # in the data of the shard's last tensor, 'b'
        shard.write_bytes(bytes(data))
    elif how == "corrupted header":
        data = bytearray(shard.read_bytes())
        data[8 + 2] = ord("}")  # breaks the JSON header, same size
        shard.write_bytes(bytes(data))
    elif how == "deleted shard":
        shard.unlink()
    elif how == "bad json":
        (path / MANIFEST_NAME).write_text('{"format": "parity-bundle", ')
    elif how == "deleted manifest":
        (path / MANIFEST_NAME).unlink()
    elif how == "unknown schema":
        _edit_manifest(path, lambda m: m.update(schema_version=SCHEMA_VERSION + 41))
    elif how == "escaping shard name":
        def escape(m):
            m["shards"][0]["file"] = "../../outside.safetensors"
            for entry in m["entries"]:
                if entry["shard"] == "shard-00000.safetensors":
                    entry["shard"] = "../../outside.safetensors"
        _edit_manifest(path, escape)
    elif how == "absolute shard name":
        _edit_manifest(path, lambda m: m["shards"][0].update(file="/etc/passwd"))
    elif how == "tensor missing":
        _edit_manifest(path, lambda m: m["entries"][0].update(key="t9999999"))
    elif how == "shape disagrees":
        _edit_manifest(path, lambda m: m["entries"][0].update(shape=[8, 8]))
    elif how == "dtype disagrees":
        _edit_manifest(path, lambda m: m["entries"][0].update(dtype="int32"))
    elif how == "checksum disagrees":
        _edit_manifest(path, lambda m: m["entries"][0].update(blake3="0" * 64))
    elif how == "entry lacks field":
        _edit_manifest(path, lambda m: m["entries"][0].pop("blake3"))
    else:
        raise AssertionError(how)


DAMAGE = {
    "truncated shard": r"shard-00000\.safetensors: shard truncated",
    "flipped byte": r"shard-00000\.safetensors: checksum mismatch for output 'b'",
    "corrupted header": r"shard-00000\.safetensors: shard corrupted",
    "deleted shard": r"shard-00000\.safetensors: shard missing",
    "bad json": r"manifest\.json: invalid JSON",
    "deleted manifest": r"manifest\.json: manifest missing",
    "unknown schema": rf"manifest\.json: unknown schema version {SCHEMA_VERSION + 41}; .* newer parity",
    "escaping shard name": r"manifest\.json: shard file '\.\./\.\./outside\.safetensors' points outside the bundle",
    "absolute shard name": r"manifest\.json: shard file '/etc/passwd' points outside the bundle",
    "tensor missing": r"shard-00000\.safetensors: tensor t9999999 \(output 'a'\) missing from the shard",
    "shape disagrees": r"shard-00000\.safetensors: output 'a' is float32\[64\] in the shard but float32\[8, 8\]",
    "dtype disagrees": r"shard-00000\.safetensors: output 'a' is float32\[64\] in the shard but int32\[64\]",
    "checksum disagrees": r"checksum mismatch for output 'a'",
    "entry lacks field": r"manifest\.json: invalid manifest: entries\[0\]: lacks blake3",
}


@pytest.mark.parametrize("how", list(DAMAGE))
def test_damage_gives_one_clear_bundle_error(bundle_path, how):
    _damage(bundle_path, how)
    with pytest.raises(BundleError) as info:
        open_bundle(bundle_path).verify()
    message = str(info.value)
    assert "\n" not in message
    assert str(bundle_path) in message
    assert info.match(DAMAGE[how])


def test_damage_in_one_shard_spares_reading_the_others(bundle_path):
    _damage(bundle_path, "flipped byte")
    bundle = open_bundle(bundle_path)
    assert torch.equal(bundle.load("c"), torch.zeros(16, dtype=torch.float16))  # in shard-00001
    assert torch.equal(bundle.load("a"), torch.arange(64, dtype=torch.float32))
    with pytest.raises(BundleError):
        bundle.load("b")


def test_missing_or_non_directory_bundle(tmp_path):
    with pytest.raises(BundleError, match="does not exist"):
        open_bundle(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(BundleError, match="is not a directory"):
        open_bundle(tmp_path / "file")


def test_manifest_that_is_not_a_parity_manifest(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"hello": 1}))
    with pytest.raises(BundleError, match="not a parity bundle manifest"):
        open_bundle(tmp_path)


def test_unknown_tensor_name_names_the_bundle(bundle_path):
    with pytest.raises(BundleError, match="no reference tensor named 'a'"):
        open_bundle(bundle_path).load("a", kind="reference")


def test_header_size_lie_is_caught(bundle_path):
    shard = bundle_path / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", len(data) * 4)  # header claims to be longer than the file
    shard.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"shard-00001\.safetensors: shard corrupted"):
        BundleReader(bundle_path).load("c")


# ---- reading is hardened: the manifest and shards are data from elsewhere ---------------------


def test_written_shards_are_standard_safetensors(tmp_path):
    tensors = _all_dtype_tensors()
    bundle = open_bundle(_write(tmp_path / "b", tensors, shard_bytes=256))
    assert len(bundle.shards) >= 3
    for entry in bundle.entries:
        with safe_open(str(tmp_path / "b" / entry.shard), framework="pt") as handle:
            assert _same_bits(handle.get_tensor(entry.key), bundle.load(entry)), entry.name


def test_new_bundles_are_sealed_and_the_goldens_still_read():
    from pathlib import Path

    golden = Path(__file__).resolve().parent.parent / "golden"
    for name in ("h200-attention", "h200-decoder"):
        bundle = open_bundle(golden / name)
        assert bundle.schema_version == 1 and not bundle.sealed
        assert bundle.verify() == len(bundle.entries) and len(bundle.verified) == len(bundle.entries)


def test_manifest_checksum_catches_hand_edits_and_a_resealed_edit_passes(bundle_path):
    manifest = json.loads((bundle_path / MANIFEST_NAME).read_text())
    assert manifest["schema_version"] == SCHEMA_VERSION == 4 and len(manifest["manifest_sha256"]) == 64
    assert all(len(shard["header_blake3"]) == 64 and "sha256" not in shard for shard in manifest["shards"])
    assert all(len(entry["blake3"]) == 64 and "sha256" not in entry for entry in manifest["entries"])
    manifest["platform"] = {"vendor": "nvidia"}
    (bundle_path / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=r"manifest\.json: manifest checksum mismatch: the manifest was changed"):
        open_bundle(bundle_path)
    edit_manifest(bundle_path, lambda m: None)  # reseals
    assert open_bundle(bundle_path).platform == {"vendor": "nvidia"}
    # A resealed downgrade does not switch the checks off: version 3 reads sha256 digests, which a
    # version 4 manifest does not have.
    edit_manifest(bundle_path, lambda m: m.update(schema_version=3))
    with pytest.raises(BundleError, match=r"invalid manifest: shards\[0\]\.header_sha256: expected 64 lowercase hex"):
        open_bundle(bundle_path)
    edit_manifest(bundle_path, lambda m: m.update(schema_version=4))
    assert open_bundle(bundle_path).verify() == 3
    (bundle_path / MANIFEST_NAME).write_text((bundle_path / MANIFEST_NAME).read_text().replace('"schema_version": 4',
                                                                                               '"schema_version": 3'))
    with pytest.raises(BundleError, match="manifest checksum mismatch"):
        open_bundle(bundle_path)
    edit_manifest(bundle_path, lambda m: m.pop("manifest_sha256"))
    with pytest.raises(BundleError, match=r"manifest_sha256: missing \(version 3 manifests are sealed\)"):
        open_bundle(bundle_path)


def test_a_sealed_manifest_needs_its_versions_shard_digest(bundle_path):
    edit_manifest(bundle_path, lambda m: m["shards"][1].pop("header_blake3"))
    with pytest.raises(BundleError, match=r"manifest\.json: invalid manifest: shards\[1\]\.header_blake3: expected 64 "
                                          r"lowercase hex digits, got None"):
        open_bundle(bundle_path)
    edit_manifest(bundle_path, lambda m: m.update(schema_version=3))  # version 3: the same digests, by sha256
    with pytest.raises(BundleError, match=r"shards\[0\]\.header_sha256: expected 64 lowercase hex digits, got None"):
        open_bundle(bundle_path)
    edit_manifest(bundle_path, lambda m: m.update(schema_version=2))  # version 2 sealed the whole file instead
    with pytest.raises(BundleError, match=r"shards\[0\]\.sha256: expected 64 lowercase hex digits, got None"):
        open_bundle(bundle_path)


def test_shard_checksum_catches_damage_outside_the_tensors(bundle_path):
    shard = bundle_path / "shard-00000.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data.replace(b'"format":"pt"', b'"formaT":"pt"'))  # header metadata: no tensor reads it
    for read in (lambda bundle: bundle.load("a"), lambda bundle: bundle.verify()):  # checked at the header's first read
        with pytest.raises(BundleError, match=r"shard-00000\.safetensors: shard corrupted: header checksum mismatch"):
            read(open_bundle(bundle_path))


def test_blake3_digests_are_of_the_bytes_on_disk(bundle_path):
    """The recorded digests are BLAKE3 of exactly the bytes a safetensors reader sees, computed
    here with the blake3 package directly, not through parity.bundle.checksums."""
    import blake3

    manifest = json.loads((bundle_path / MANIFEST_NAME).read_text())
    for shard in manifest["shards"]:
        data = (bundle_path / shard["file"]).read_bytes()
        assert shard["header_blake3"] == blake3.blake3(data[:8 + struct.unpack("<Q", data[:8])[0]]).hexdigest()
        with safe_open(str(bundle_path / shard["file"]), "pt") as handle:
            for entry in (e for e in manifest["entries"] if e["shard"] == shard["file"]):
                raw = handle.get_tensor(entry["key"]).contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                assert entry["blake3"] == blake3.blake3(raw).hexdigest()


def test_version_3_bundles_are_read_with_their_sha256_digests(bundle_path):
    as_version(bundle_path, 3)
    bundle = open_bundle(bundle_path)
    assert bundle.schema_version == 3 and bundle.checksum == "sha256" and bundle.verify() == 3
    assert torch.equal(bundle.load("a"), torch.arange(64, dtype=torch.float32))
    edit_manifest(bundle_path, lambda m: m["entries"][0].update(sha256=hashlib.sha256(b"other").hexdigest()))
    with pytest.raises(BundleError, match=r"shard-00000\.safetensors: checksum mismatch for output 'a'"):
        open_bundle(bundle_path).load("a")


def test_version_2_bundles_are_verified_by_their_whole_file_sha256(bundle_path):
    as_version(bundle_path, 2)
    bundle = open_bundle(bundle_path)
    assert bundle.schema_version == 2 and bundle.sealed and bundle.verify() == 3
    shard = bundle_path / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes().replace(b'"format":"pt"', b'"formaT":"pt"'))
    bundle = open_bundle(bundle_path)
    assert bundle.load("a").shape == (64,)  # version 2 has no header digest: only verify reads the whole file
    with pytest.raises(BundleError, match=r"shard-00000\.safetensors: shard checksum mismatch"):
        bundle.verify()


@pytest.mark.slow  # one damaged copy per byte of every shard
@pytest.mark.parametrize("version", [4, 3, 2])
def test_every_byte_of_every_shard_is_covered_by_a_checksum(bundle_path, version):
    """Flip each byte of both shard files in turn (length prefix, header, padding, every tensor's
    bytes): verify must refuse every one. Versions 4 (BLAKE3) and 3 (sha256) hash each byte once
    (header digest + tensor digests + the layout check), version 2 twice (tensor digests + the
    whole file's)."""
    if version < 4:
        as_version(bundle_path, version)
    for shard in sorted(bundle_path.glob("shard-*.safetensors")):
        original = shard.read_bytes()
        for position in range(len(original)):
            damaged = bytearray(original)
            damaged[position] ^= 0x01
            shard.write_bytes(bytes(damaged))
            with pytest.raises(BundleError) as info:
                open_bundle(bundle_path).verify()
            assert str(shard) in str(info.value), (shard.name, position)
        shard.write_bytes(original)
    assert open_bundle(bundle_path).verify() == 3


def test_manifest_must_be_a_regular_file(bundle_path, tmp_path):
    manifest = bundle_path / MANIFEST_NAME
    copy = tmp_path / "elsewhere.json"
    copy.write_bytes(manifest.read_bytes())
    manifest.unlink()
    manifest.symlink_to(copy)  # an intact manifest, but not inside the bundle
    with pytest.raises(BundleError, match=r"manifest\.json: manifest is a symbolic link"):
        open_bundle(bundle_path)
    manifest.unlink()
    os.mkfifo(manifest)  # opening a FIFO for reading would wait for a writer forever
    with pytest.raises(BundleError, match=r"manifest\.json: manifest is not a regular file \(a FIFO\)"):
        open_bundle(bundle_path)
    manifest.unlink()
    manifest.mkdir()
    with pytest.raises(BundleError, match=r"manifest is not a regular file \(a directory\)"):
        open_bundle(bundle_path)


def test_manifest_size_and_depth_are_bounded(bundle_path):
    manifest = bundle_path / MANIFEST_NAME
    with open(manifest, "r+b") as handle:
        handle.truncate(257 * 2**20)  # sparse: costs no disk, and is never read
    with pytest.raises(BundleError, match=r"manifest of 269484032 bytes is larger than the 256 MiB limit"):
        open_bundle(bundle_path)
    manifest.write_text("[" * 10000 + "]" * 10000)
    with pytest.raises(BundleError, match=r"manifest\.json: invalid JSON: nested too deeply"):
        open_bundle(bundle_path)
    for text, message in (('{"a": NaN}', "NaN is not valid JSON"), ('{"a": 1e999}', "out of range"),
                          ('{"a": 1, "a": 2}', "duplicate key 'a'"), ('{"a": ' + "9" * 5000 + "}", "digits")):
        manifest.write_text(text)
        with pytest.raises(BundleError, match=r"manifest\.json: invalid JSON: .*" + message):
            open_bundle(bundle_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_manifest_is_one_line(bundle_path):
    (bundle_path / MANIFEST_NAME).chmod(0)
    with pytest.raises(BundleError, match=r"manifest\.json: cannot read manifest: Permission denied"):
        open_bundle(bundle_path)


def test_unreachable_bundle_paths_are_bundle_errors(tmp_path):
    with pytest.raises(BundleError, match=r"cannot open: File name too long"):
        open_bundle(tmp_path / ("b" * 300))
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    with pytest.raises(BundleError, match=r"loop1: cannot open: Too many levels of symbolic links"):
        open_bundle(tmp_path / "loop1")


@pytest.mark.parametrize("name, message", [
    ("../x.safetensors", "points outside the bundle directory"),
    ("/etc/passwd", "points outside the bundle directory"),
    ("a/b.safetensors", "points outside the bundle directory"),
    ("..", "points outside the bundle directory"),
    ("x" * 300, "file name of 300 characters is too long"),
    ("manifest.json", "is not allowed"),
    (".hidden", "is not allowed"),
    ("shard\n.safetensors", r"'shard\\x0a\.safetensors' is not allowed"),
    ("", "invalid manifest: shard file name ''"),
])
def test_shard_file_names_must_be_plain_names_inside_the_bundle(bundle_path, name, message):
    def rename(manifest):
        old = manifest["shards"][0]["file"]
        manifest["shards"][0]["file"] = name
        for entry in manifest["entries"]:
            if entry["shard"] == old:
                entry["shard"] = name

    edit_manifest(bundle_path, rename)
    with pytest.raises(BundleError, match=message) as info:
        open_bundle(bundle_path)
    assert "\n" not in str(info.value)


def test_shards_must_be_plain_files(bundle_path, tmp_path):
    shard = bundle_path / "shard-00001.safetensors"
    outside = tmp_path / "copy.safetensors"
    outside.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(outside)
    with pytest.raises(BundleError, match=r"shard-00001\.safetensors: shard is a symbolic link"):
        open_bundle(bundle_path)
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(BundleError, match=r"shard-00001\.safetensors: shard is not a regular file \(a FIFO\)"):
        open_bundle(bundle_path)


@pytest.mark.parametrize("length", [2**60, 2**64 - 1, 0, 1])
def test_impossible_header_lengths_are_refused_before_reading(bundle_path, length):
    shard = bundle_path / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", length)
    shard.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=rf"shard-00001\.safetensors: shard corrupted: header length {length} does "
                                          rf"not fit the {len(data)}-byte file"):
        open_bundle(bundle_path).load("c")


def test_a_header_that_disagrees_with_the_manifest(bundle_path):
    shard = bundle_path / "shard-00001.safetensors"
    data = shard.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    header["extra"] = {"dtype": "F16", "shape": [0], "data_offsets": [32, 32]}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    shard.write_bytes(prefix + data[8 + length:])
    edit_manifest(bundle_path, lambda m: m["shards"][1].update(bytes=shard.stat().st_size))
    with pytest.raises(BundleError, match=r"shard-00001\.safetensors: shard corrupted: header checksum mismatch"):
        open_bundle(bundle_path).load("c")
    # With its digest fixed too (a careful hand edit), the header is still checked against the manifest.
    edit_manifest(bundle_path, lambda m: m["shards"][1].update(header_blake3=blake3.blake3(prefix).hexdigest()))
    with pytest.raises(BundleError, match=r"shard corrupted: it holds tensor extra, which the manifest does not list"):
        open_bundle(bundle_path).load("c")


def test_a_shard_that_shrinks_after_opening_is_a_bundle_error_not_sigbus(bundle_path):
    bundle = open_bundle(bundle_path)
    shard = bundle_path / "shard-00000.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:100])
    with pytest.raises(BundleError, match=r"shard-00000\.safetensors: shard changed size: 100 bytes"):
        bundle.load("a")


def test_verified_records_what_was_checked(bundle_path):
    bundle = open_bundle(bundle_path)
    assert bundle.verified == set()
    bundle.load("b")
    assert bundle.verified == {("output", "b")}
    bundle.verify()
    assert bundle.verified == {("output", name) for name in "abc"}


def test_verify_refuses_files_the_manifest_does_not_list(bundle_path):
    (bundle_path / "notes.txt").write_text("x")
    assert open_bundle(bundle_path).load("a").shape == (64,)  # reading ignores it
    with pytest.raises(BundleError, match=r"notes\.txt: the bundle holds a file its manifest does not list"):
        open_bundle(bundle_path).verify()


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["subject"].update(spec=""), r"subject\.spec: empty string"),
    (lambda m: m["subject"].update(args=[1]), r"subject\.args: expected an object, got a list"),
    (lambda m: m.update(impl=3), r"impl: expected a string, got an integer"),
    (lambda m: m.update(platform={"vendor": ["nvidia"]}), r"platform\.vendor: expected str or null, got a list"),
    (lambda m: m.update(capture={"layers": [1], "record_inputs": True}), r"capture\.layers\[0\]: expected a string"),
    (lambda m: m.update(capture={"layers": None, "record_inputs": "yes"}), r"capture\.record_inputs: expected true"),
    (lambda m: m["entries"][0].update(nbytes=255), r"nbytes 255 is not 64 elements x 4 bytes of float32"),
    (lambda m: m["entries"][0].update(shape=[-1]), r"entries\[0\] \(output 'a'\)\.shape: -1 is out of range"),
    (lambda m: m["entries"][0].update(blake3="A" * 64), r"blake3: expected 64 lowercase hex digits"),
    (lambda m: m["entries"][1].update(name="a", layer="a"), r"two output entries share the name 'a'"),
    (lambda m: m["entries"][1].update(key="t0000000"), r"two entries share key 't0000000' in shard"),
    (lambda m: m["shards"][0].update(tensors=5), r"lists 5 tensors but 2 entries are in it"),
    (lambda m: m.update(layers=[{"name": "a", "module": "a", "call_index": 0, "outputs": {"dtype": "load"}}]),
     r"layers\[0\] \('a'\)\.outputs: unknown torch dtype 'load'"),
    (lambda m: m.update(layers=[{"name": "a", "module": "a", "call_index": 0, "outputs": {"tensor": "x"}}]),
     r"tensor path 'x' where the structure puts ''"),
])
def test_schema_errors_name_the_field(bundle_path, edit, message):
    edit_manifest(bundle_path, edit)
    with pytest.raises(BundleError, match=r"manifest\.json: invalid manifest: .*" + message) as info:
        open_bundle(bundle_path)
    assert "\n" not in str(info.value)


# ---- python -m parity verify --------------------------------------------------------------------


def test_verify_command_summary_and_exit_status(bundle_path, capsys):
    from parity.cli.main import main

    edit_manifest(bundle_path, lambda m: m["subject"].update(name="evil\x1b[31m\nPARITY HOLDS"))
    assert main(["verify", str(bundle_path)]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert err == "" and len(lines) == 4 and lines[0] == f"parity verify: {bundle_path}: OK"
    assert "subject evil\\x1b[31m\\x0aPARITY HOLDS" in lines[1] and "schema 4 (manifest and shard files" in lines[1]
    assert lines[2] == "  2 shards, 0.0 MiB; 3 tensors, every checksum matches"
    assert lines[3] == "  output 3 (0.0 MiB)"
    _damage(bundle_path, "flipped byte")
    assert main(["verify", str(bundle_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"parity: error: {bundle_path}/shard-00000.safetensors: checksum mismatch for output 'b'")


def test_reader_exposes_checked_manifest_fields(tmp_path):
    from parity.run.capture import capture

    tiny = {"layers": 1, "seq_len": 16, "batch": 1, "d_model": 32, "heads": 2, "kv_heads": 1, "head_dim": 16,
            "ffn_dim": 32, "vocab": 32, "block": 16, "window": 16, "layer_layouts": ["causal"]}
    capture("decoder", tmp_path / "d", subject_args=tiny, record_inputs=True, layers=["layers.*"], reference="none")
    bundle = open_bundle(tmp_path / "d")
    assert bundle.capture_layers == ["layers.*"] and bundle.record_inputs is True
    assert bundle.impl == "reference" and bundle.device == "cpu" and bundle.inputs_meta == {}
    assert bundle.subject["spec"] == "decoder" and bundle.hooks_check["bitwise_equal"] is True
    layers = bundle.layers()
    assert layers and all(set(layer) >= {"name", "module", "call_index", "outputs", "inputs"} for layer in layers)
    assert all(layer["inputs"] is not None for layer in layers) and bundle.layers("reference_layers") == []
    plugin_like = _write(tmp_path / "p", {"x": torch.ones(1)})
    plain = open_bundle(plugin_like)
    assert plain.capture_layers is None and plain.record_inputs is False and plain.layers() == []
    assert plain.platform == {} and plain.kernel_configs is None and plain.capture_info == {}


def test_a_tensor_read_in_pieces_on_its_way_to_a_device_is_checksummed_whole(tmp_path):
    """load_to's path to a GPU (a ring of page-locked pieces, each hashed and copied on), run here on
    the CPU with copies deferred as a device stream's are (tests/deferred_device.py)."""
    from deferred_device import Consumer, DeferredBackend
    from parity.bundle.staging import DeviceStager

    tensors = {"big": torch.arange(10_000, dtype=torch.float32), "empty": torch.zeros(0), "odd": torch.ones(3, 7)}
    _write(tmp_path / "b", tensors)
    stager = DeviceStager(DeferredBackend(), count=2, piece=4096)  # 10 pieces for "big", the last one short
    bundle = open_bundle(tmp_path / "b")
    for name, tensor in tensors.items():
        consumer = Consumer()
        got = bundle._load_staged(bundle.entry(name), stager, consumer)
        consumer.use()
        assert got.dtype == tensor.dtype and torch.equal(got, tensor)
    assert bundle.load_to("odd", device="cpu").shape == (3, 7)  # no GPU: the plain load
    entry = bundle.entry("big")
    begin, _ = bundle._layout(entry.shard).offsets[entry.key]
    with open(tmp_path / "b" / entry.shard, "r+b") as handle:  # one byte of the ninth piece
        handle.seek(begin + 8 * 4096 + 5)
        byte = handle.read(1)
        handle.seek(begin + 8 * 4096 + 5)
        handle.write(bytes([byte[0] ^ 1]))
    with pytest.raises(BundleError, match="checksum mismatch for output 'big'"):
        open_bundle(tmp_path / "b")._load_staged(entry, stager, Consumer())
