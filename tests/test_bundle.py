"""The bundle format: round trips, shard rotation, atomic writes, --force, and every kind of damage."""
import json
import os
import pickle
import struct

import pytest
import torch
from safetensors import safe_open

from parity.bundle import (
    MANIFEST_NAME,
    SCHEMA_VERSION,
    BundleReader,
    BundleWriter,
    open_bundle,
)
from parity.errors import BundleError, UsageError


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
    from parity.recorder import flatten, unflatten

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


def test_a_killed_writers_partial_directory_is_removed_by_the_next_writer(tmp_path):
    """A capture killed with SIGKILL cannot clean up its hidden partial directory; the next
    writer of the same target removes it when its process is gone, on this host only."""
    import signal
    import subprocess
    import sys

    from parity.bundle import _partial_prefix

    target = tmp_path / "b"
    code = ("import sys, torch; from parity.bundle import BundleWriter\n"
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
    file = path / MANIFEST_NAME
    manifest = json.loads(file.read_text())
    edit(manifest)
    file.write_text(json.dumps(manifest))


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
        _edit_manifest(path, lambda m: m["entries"][0].update(sha256="0" * 64))
    elif how == "entry lacks field":
        _edit_manifest(path, lambda m: m["entries"][0].pop("sha256"))
    else:
        raise AssertionError(how)


DAMAGE = {
    "truncated shard": r"shard-00000\.safetensors: shard truncated",
    "flipped byte": r"shard-00000\.safetensors: checksum mismatch for output 'b'",
    "corrupted header": r"shard-00000\.safetensors: shard corrupted",
    "deleted shard": r"shard-00000\.safetensors: shard missing",
    "bad json": r"manifest\.json: invalid JSON",
    "deleted manifest": r"manifest\.json: manifest missing",
    "unknown schema": r"manifest\.json: unknown schema version 42; .* newer parity",
    "escaping shard name": r"manifest\.json: shard file '\.\./\.\./outside\.safetensors' points outside the bundle",
    "absolute shard name": r"manifest\.json: shard file '/etc/passwd' points outside the bundle",
    "tensor missing": r"shard-00000\.safetensors: tensor t9999999 \(output 'a'\) missing from the shard",
    "shape disagrees": r"shard-00000\.safetensors: output 'a' is float32\[64\] in the shard but float32\[8, 8\]",
    "dtype disagrees": r"shard-00000\.safetensors: output 'a' is float32\[64\] in the shard but int32\[64\]",
    "checksum disagrees": r"checksum mismatch for output 'a'",
    "entry lacks field": r"manifest\.json: invalid manifest: entry 0 lacks sha256",
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
