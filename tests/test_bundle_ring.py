"""The bundle writer's copy ring: one shard's bytes, reused first in, first out (issue 16's memory bound).

The writer keeps its copies in :class:`parity.bundle.writer._Ring`; these tests drive the ring on its
own (placement, wrapping, waiting for space the writing thread owes back, never waiting for space
nothing will free) and through the writer (every copy of a long write lands in the ring, the
bundle reads back bit for bit, and a failing shard write gives its space back).
"""
import os
import threading
import time

import pytest
import torch

from parity.bundle import writer as B
from parity.bundle.writer import BundleWriter
from parity.bundle.reader import open_bundle
from parity.base.errors import UsageError


def test_places_in_order_wraps_and_refuses_what_cannot_fit():
    ring = B._Ring(1024)
    assert ring.buffer is None  # nothing allocated before the first copy
    assert [ring.place(256) for _ in range(4)] == [0, 256, 512, 768]
    assert ring.buffer is not None and ring.buffer.numel() == 1024
    assert ring.place(64) is None  # full of copies not handed over: nothing will free them, so no wait
    assert ring.place(2048) is None  # larger than the ring
    ring.hand_over(4)  # the writing thread owns them now
    ring.give_back(2)  # [0, 512) written: free again
    assert ring.place(512) == 0  # wraps to the start
    ring.give_back(2)  # [512, 1024) free; [0, 512) holds a copy not handed over
    assert ring.place(512) == 512
    assert ring.place(64) is None  # full again of copies nothing will free: refused, never waited for


def test_offsets_are_aligned_and_copies_never_overlap():
    ring = B._Ring(4096)
    ring.hand_over(10**6)  # everything placed is owed back, so a full ring would wait, not refuse
    live: list[tuple[int, int]] = []
    sizes = [1, 63, 64, 65, 200, 1000, 7, 640, 3000, 5]
    for step in range(200):
        size = sizes[step % len(sizes)]
        while True:
            with ring._changed:
                fits = ring._fit(size) is not None
            if fits:
                break
            ring.give_back()
            live.pop(0)
        start = ring.place(size)
        assert start % B._ARENA_ALIGN == 0 and 0 <= start and start + size <= 4096
        assert all(start + size <= begin or end <= start for begin, end in live), (step, start, size, live)
        live.append((start, start + size))


def test_waits_for_space_the_writing_thread_owes_back():
    ring = B._Ring(1024)
    assert ring.place(1024) == 0
    ring.hand_over(1)
    placed = []
    waiter = threading.Thread(target=lambda: placed.append(ring.place(512)))
    waiter.start()
    time.sleep(0.2)
    assert placed == [] and waiter.is_alive()  # waiting: the owed copy will come back
    ring.give_back()
    waiter.join(timeout=5)
    assert placed == [0]


def _record_placements(monkeypatch):
    placements = []
    original = B._Ring.place

    def place(self, nbytes):
        start = original(self, nbytes)
        placements.append(start)
        return start

    monkeypatch.setattr(B._Ring, "place", place)
    return placements


def test_a_long_write_keeps_every_copy_in_one_shards_ring(tmp_path, monkeypatch):
    placements = _record_placements(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(3, 1000, generator=gen) for _ in range(40)]  # 12000 B each, 3 per shard
    originals = [tensor.clone() for tensor in tensors]
    with BundleWriter(tmp_path / "b", shard_bytes=40_000) as writer:
        for number, tensor in enumerate(tensors):
            writer.add("output", f"t{number}", tensor)
            tensor.add_(1.0)  # the caller reuses its tensor: the bundle holds the copy made at add()
        writer.commit({"subject": {"spec": "test", "name": "ring", "args": {}}})
        ring_bytes = writer._ring.buffer.numel()
    assert ring_bytes == 40_000 and len(placements) == 40 and None not in placements
    bundle = open_bundle(tmp_path / "b")
    assert len(bundle.shards) == 14 and bundle.verify() == 40
    for number, original in enumerate(originals):
        assert torch.equal(bundle.load(f"t{number}"), original)


def test_a_failed_shard_write_gives_its_space_back_and_fails_one_line(tmp_path, monkeypatch):
    real_write = B.write_all
    calls = {"n": 0}

    def failing(fd, chunk):
        calls["n"] += 1
        if calls["n"] == 4:  # inside the first shard's tensors
            raise OSError(28, "No space left on device")
        return real_write(fd, chunk)

    monkeypatch.setattr(B, "write_all", failing)
    with pytest.raises(UsageError, match=r"cannot write .*shard-00000\.safetensors: No space left on device"):
        with BundleWriter(tmp_path / "b", shard_bytes=40_000) as writer:
            for number in range(12):
                writer.add("output", f"t{number}", torch.full((3, 1000), float(number)))
            writer.commit({"subject": {"spec": "test", "name": "ring", "args": {}}})
    assert not (tmp_path / "b").exists() and list(tmp_path.iterdir()) == []


def test_an_add_that_fails_leaves_the_writer_as_it_was(tmp_path, monkeypatch):
    real_hash = B.tensor_checksum

    def failing_once(tensor):
        if tensor.numel() == 7:  # inline-hashed (small): the failure reaches add()'s caller
            raise RuntimeError("hash failed")
        return real_hash(tensor)

    monkeypatch.setattr(B, "tensor_checksum", failing_once)
    with BundleWriter(tmp_path / "b", shard_bytes=40_000) as writer:
        writer.add("output", "a", torch.ones(3, 1000))
        with pytest.raises(RuntimeError, match="hash failed"):
            writer.add("output", "bad", torch.ones(7))
        assert writer._ring._spans and len(writer._ring._spans) == 1  # its ring copy was taken back
        for number in range(8):  # fills and writes shards: nothing out of step, nothing waits forever
            writer.add("output", f"t{number}", torch.full((3, 1000), float(number)))
        writer.commit({"subject": {"spec": "test", "name": "ring", "args": {}}})
    bundle = open_bundle(tmp_path / "b")
    assert bundle.verify() == 9 and not bundle.has("bad")
    assert torch.equal(bundle.load("t7"), torch.full((3, 1000), 7.0))


def test_a_shard_that_cannot_be_handed_to_the_writing_thread_closes_its_file(tmp_path, monkeypatch):
    def broken(tensors, metadata):
        raise RuntimeError("cannot lay out the shard")

    fds_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(RuntimeError, match="cannot lay out the shard"):
        with BundleWriter(tmp_path / "b", shard_bytes=40_000) as writer:
            for number in range(3):
                writer.add("output", f"t{number}", torch.full((3, 1000), float(number)))
            monkeypatch.setattr(B, "shard_chunks", broken)
            writer.add("output", "t3", torch.zeros(3, 1000))  # fills the first shard: its flush fails
    assert len(os.listdir("/proc/self/fd")) == fds_before  # the shard's file was closed
    assert list(tmp_path.iterdir()) == []  # and everything written was deleted
