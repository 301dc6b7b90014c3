"""Capture with weights by reference: the checkpoint's digests taken beside the build and the runs, the commit after them."""
from __future__ import annotations

import os
import threading
import time

import blake3
import pytest
import torch
from safetensors.torch import save_file

from parity.base.errors import UsageError
from parity.bundle import weights as checkpoint_weights
from parity.bundle.reader import open_bundle
from parity.bundle.writer import BundleWriter
from parity.cli.main import main
from parity.run.capture import capture
from parity.run.subjects import load_subject
from parity.run.subjects.base import SubjectRunner

SMALL_DECODER = {"layers": 2, "seq_len": 64, "batch": 1}
DIGEST_THREAD = "parity-checkpoint-digests"


@pytest.fixture()
def checkpoint(tmp_path):
    """The small decoder's floating weights in a safetensors file (its int layouts are not)."""
    state = load_subject("decoder", SMALL_DECODER).make_state()
    weights = {name: tensor.contiguous() for name, tensor in state.items() if tensor.is_floating_point()}
    file = tmp_path / "ckpt" / "model.safetensors"
    file.parent.mkdir()
    save_file(weights, str(file))
    return file, weights


def _leftovers(directory):
    """What a capture left in ``directory`` besides the checkpoint: partial or conflict directories."""
    return sorted(name for name in os.listdir(directory) if name != "ckpt")


def _digest_threads() -> list[str]:
    return [thread.name for thread in threading.enumerate() if thread.name == DIGEST_THREAD]


def test_the_digests_taken_beside_the_run_are_the_files_and_the_serial_paths(tmp_path, checkpoint):
    file, _ = checkpoint
    result = capture("decoder", tmp_path / "b", subject_args=SMALL_DECODER, reference="none", weights_from=[file])
    recorded = open_bundle(result.path).weights["files"]
    expected = blake3.blake3(file.read_bytes()).hexdigest()
    assert [item["blake3"] for item in recorded] == [expected]
    assert [f.blake3 for f in checkpoint_weights.describe([file]).files] == [expected]  # the one-call path
    assert checkpoint_weights.blake3_of(file) == expected  # what compare checks it with
    phases = result.resources["phases"]
    assert {"build", "weights_check", "forward", "recorded_run", "writing", "digests", "digests_wait"} <= set(phases)
    assert all(seconds >= 0 for seconds in phases.values())
    assert _digest_threads() == []


def test_the_digests_run_while_the_model_is_built_and_the_commit_waits_for_them(tmp_path, checkpoint, monkeypatch):
    """The hash waits until the build has returned: a capture that took the digests before building
    (as it did) would never get past it. The commit must find them done."""
    file, _ = checkpoint
    built, written = threading.Event(), threading.Event()
    seen: dict[str, object] = {}
    original_build, original_commit, original_hash = SubjectRunner.build, BundleWriter.commit, checkpoint_weights.blake3_of
    original_finish = BundleWriter.finish_shards

    def build(self, *args, **kwargs):
        module = original_build(self, *args, **kwargs)
        seen.setdefault("hashing_during_build", bool(_digest_threads()))
        built.set()
        return module

    def slow_hash(path, stop=None):
        assert built.wait(timeout=60), "the build never finished while the digests waited for it"
        assert written.wait(timeout=60)
        time.sleep(0.3)  # still hashing when every shard is written: the commit has to wait
        digest = original_hash(path, stop)
        seen["hashed_at"] = time.monotonic()
        return digest

    def finish_shards(self):
        original_finish(self)
        written.set()

    def commit(self, fields):
        seen["committed_at"] = time.monotonic()
        seen["files_at_commit"] = fields["weights"]["files"]
        return original_commit(self, fields)

    monkeypatch.setattr(SubjectRunner, "build", build)
    monkeypatch.setattr(BundleWriter, "commit", commit)
    monkeypatch.setattr(BundleWriter, "finish_shards", finish_shards)
    monkeypatch.setattr(checkpoint_weights, "blake3_of", slow_hash)
    result = capture("decoder", tmp_path / "b", subject_args=SMALL_DECODER, reference="none", weights_from=[file])
    assert seen["hashing_during_build"] is True
    assert seen["hashed_at"] < seen["committed_at"]
    assert seen["files_at_commit"][0]["blake3"] == blake3.blake3(file.read_bytes()).hexdigest()
    assert result.resources["phases"]["digests_wait"] >= 0.3  # the hash held after the shards, waited for
    assert result.resources["phases"]["digests"] >= 0.3


@pytest.mark.parametrize("failure", ["unreadable", "grew"])
def test_a_failure_of_the_digests_fails_the_capture_with_one_line_and_nothing_written(
        tmp_path, checkpoint, monkeypatch, capsys, failure):
    file, _ = checkpoint
    original_hash, original_finish = checkpoint_weights.blake3_of, BundleWriter.finish_shards
    written = threading.Event()

    def failing_hash(path, stop=None):
        if failure == "unreadable":
            raise PermissionError(13, "Permission denied", str(path))
        digest = original_hash(path, stop)
        assert written.wait(timeout=60)  # after the weights were checked against the file
        with open(path, "ab") as handle:  # the file changes under the capture after it was hashed
            handle.write(b"\0" * 8)
        return digest

    def finish_shards(self):
        original_finish(self)
        written.set()

    monkeypatch.setattr(checkpoint_weights, "blake3_of", failing_hash)
    monkeypatch.setattr(BundleWriter, "finish_shards", finish_shards)
    code = main(["capture", "--subject", "decoder", "--bundle", str(tmp_path / "b"), "--set", "layers=2",
                 "--set", "seq_len=64", "--set", "batch=1", "--reference", "none", "--weights-from", str(file),
                 "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    if failure == "unreadable":
        assert f"--weights-from {file}: cannot read it for its digest: Permission denied" in err[0]
    else:
        size = file.stat().st_size
        assert f"--weights-from {file}: the file changed while it was hashed ({size - 8} bytes when read, {size} after)" \
            in err[0]
    assert _leftovers(tmp_path) == []  # no bundle, no partial directory
    assert _digest_threads() == []


def test_a_capture_that_fails_elsewhere_stops_the_digests_and_leaves_no_thread(tmp_path, checkpoint, monkeypatch):
    file, weights = checkpoint
    slices = []

    def endless_hash(path, stop=None):
        while not stop.is_set():  # a file that takes longer to hash than the capture lives
            slices.append(1)
            time.sleep(0.01)
        return ""

    monkeypatch.setattr(checkpoint_weights, "blake3_of", endless_hash)
    other = {name: tensor * 2 for name, tensor in weights.items()}
    save_file(other, str(file))  # not the weights the model holds: capture refuses after its build
    started = time.monotonic()
    with pytest.raises(UsageError, match="differs from .* in model.safetensors"):
        capture("decoder", tmp_path / "b", subject_args=SMALL_DECODER, reference="none", weights_from=[file])
    assert time.monotonic() - started < 30
    assert slices and _digest_threads() == []
    assert _leftovers(tmp_path) == []


def test_background_digests_of_several_files_in_order(tmp_path):
    paths = []
    for index in range(3):
        path = tmp_path / f"model-{index}.safetensors"
        save_file({f"w{index}": torch.full((1000 * (index + 1),), float(index))}, str(path))
        paths.append(path)
    with checkpoint_weights.BackgroundDigests(checkpoint_weights.locate([tmp_path])) as digests:
        described = digests.result()
    assert [f.path for f in described.files] == [path.resolve() for path in paths]
    assert [f.blake3 for f in described.files] == [blake3.blake3(p.read_bytes()).hexdigest() for p in paths]
    assert [f.bytes for f in described.files] == [p.stat().st_size for p in paths]
    assert digests.seconds > 0


def test_a_checkpoint_changed_before_the_weights_are_checked_is_one_line(tmp_path, checkpoint, monkeypatch, capsys):
    file, _ = checkpoint
    original_build = SubjectRunner.build

    def build(self, *args, **kwargs):
        module = original_build(self, *args, **kwargs)
        with open(file, "ab") as handle:  # its header no longer covers the file
            handle.write(b"\0" * 8)
        return module

    monkeypatch.setattr(SubjectRunner, "build", build)
    code = main(["capture", "--subject", "decoder", "--bundle", str(tmp_path / "b"), "--set", "layers=2",
                 "--set", "seq_len=64", "--set", "batch=1", "--reference", "none", "--weights-from", str(file),
                 "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"--weights-from {file}: not a safetensors file" in err[0], err
    assert _leftovers(tmp_path) == [] and _digest_threads() == []


def test_a_rewrite_after_the_weights_check_is_refused(tmp_path, monkeypatch):
    """The digest is taken on its own thread, possibly after the weights were checked against the
    file: a same-size rewrite in between (a trainer saving the checkpoint in place) would give a
    bundle whose digest names weights that never ran. The file must still be the one located when
    the digest is recorded: capture refuses with one line, and writes nothing."""
    state = load_subject("decoder", SMALL_DECODER).make_state()
    file = tmp_path / "ckpt" / "model.safetensors"
    file.parent.mkdir()
    save_file({name: t.contiguous() for name, t in state.items() if t.is_floating_point()}, str(file))
    size = file.stat().st_size
    original_hash, original_finish = checkpoint_weights.blake3_of, BundleWriter.finish_shards
    checked = threading.Event()

    def finish_shards(self):  # after by_reference compared every weight with the file
        original_finish(self)
        checked.set()

    def hash_after_a_rewrite(path, stop=None):
        assert checked.wait(timeout=60)
        with open(path, "r+b") as handle:  # the last weight's last 4 bytes changed, same size
            handle.seek(size - 4)
            old = handle.read(4)
            handle.seek(size - 4)
            handle.write(bytes(b ^ 0x5A for b in old))
        return original_hash(path, stop)

    monkeypatch.setattr(BundleWriter, "finish_shards", finish_shards)
    monkeypatch.setattr(checkpoint_weights, "blake3_of", hash_after_a_rewrite)
    with pytest.raises(UsageError, match="changed during the capture") as err:
        capture("decoder", tmp_path / "b", subject_args=SMALL_DECODER, reference="none", weights_from=[file])
    assert "\n" not in str(err.value) and file.name in str(err.value)
    assert file.stat().st_size == size
    assert not (tmp_path / "b").exists()
