"""parity.bundle.staging: the ring of page-locked pieces on the way to a GPU, run on the CPU with a
device whose copies are deferred (tests/deferred_device.py), and the read-aheads handing their
threads the stream of the thread that uses the tensors; the real GPU path is marked ``gpu``."""
from __future__ import annotations

import threading

import pytest
import torch

from deferred_device import Consumer, DeferredBackend
from parity.bundle import staging
from parity.bundle.staging import DeviceStager, Ring


def _data(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _load(stager: DeviceStager, data: torch.Tensor, consumer: Consumer) -> torch.Tensor:
    return stager.load(data.numel(), lambda piece, offset: piece.copy_(data[offset:offset + piece.numel()]), consumer)


def test_pieces_are_bounded_by_the_ring_and_arrive_whole_when_the_consumer_waits():
    backend = DeferredBackend()
    stager = DeviceStager(backend, count=3, piece=4096)
    data = _data(10 * 4096 + 123, 0)  # 11 pieces, the last one short
    consumer = Consumer()
    out = _load(stager, data, consumer)
    assert backend.buffers_made == 3 and stager.ring.made == 3
    assert len(consumer.waits) == 1 and consumer.recorded == [out]  # waits on the last piece, marks the tensor used
    consumer.use()
    assert torch.equal(out, data)


def test_a_buffer_is_refilled_only_after_its_copy_completed():
    backend = DeferredBackend()
    stager = DeviceStager(backend, count=2, piece=1024)
    consumer = Consumer()
    _load(stager, _data(8 * 1024, 1), consumer)
    # 8 pieces through 2 buffers: every refill waited for the copy that last read the buffer
    assert backend.stream.done >= 6


def test_without_waiting_for_the_copy_a_reused_buffer_would_be_read_wrong(monkeypatch):
    """The fake can fail: a ring that refills a buffer before its copy ran gives wrong bytes."""
    monkeypatch.setattr(staging.Ring, "acquire", _acquire_without_waiting)
    backend = DeferredBackend()
    stager = DeviceStager(backend, count=2, piece=1024)
    data = _data(6 * 1024, 2)
    consumer = Consumer()
    out = _load(stager, data, consumer)
    consumer.use()
    assert not torch.equal(out, data)


def _acquire_without_waiting(self):
    with self._lock:
        index = self._free.popleft()
        self._events[index] = None
    if self._buffers[index] is None:
        self._buffers[index] = self._make(self.nbytes)
    return index, self._buffers[index]


def test_without_the_consumer_waiting_the_tensor_is_not_complete():
    backend = DeferredBackend()
    stager = DeviceStager(backend, count=3, piece=1024)
    data = _data(5 * 1024, 3)
    out = _load(stager, data, Consumer())
    assert not torch.equal(out, data)  # the last copies are still queued: only the consumer's wait brings them in


def test_threads_share_the_ring_and_never_hold_more_than_its_buffers():
    backend = DeferredBackend()
    stager = DeviceStager(backend, count=3, piece=512)
    datas = [_data(37 * 512 + seed, seed) for seed in range(6)]
    outs: list = [None] * len(datas)
    consumers = [Consumer() for _ in datas]
    errors: list[BaseException] = []

    def work(number: int) -> None:
        try:
            outs[number] = _load(stager, datas[number], consumers[number])
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(number,)) for number in range(len(datas))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and not any(thread.is_alive() for thread in threads)
    assert backend.buffers_made == 3
    for consumer, out, data in zip(consumers, outs, datas):
        consumer.use()
        assert torch.equal(out, data)


def test_a_failing_read_gives_its_buffer_back():
    backend = DeferredBackend()
    stager = DeviceStager(backend, count=2, piece=1024)
    calls = []

    def fill(piece, offset):
        calls.append(offset)
        if offset == 2048:
            raise OSError("disk gone")
        piece.fill_(1)

    with pytest.raises(OSError, match="disk gone"):
        stager.load(4 * 1024, fill, Consumer())
    assert calls == [0, 1024, 2048] and len(stager.ring._free) == 2
    out = stager.load(1024, lambda piece, offset: piece.fill_(7), Consumer())  # the ring still works
    assert out.numel() == 1024


def test_a_host_tensor_goes_through_the_ring_with_its_dtype_and_shape():
    backend = DeferredBackend()
    stager = DeviceStager(backend, count=2, piece=256)
    for tensor in (torch.randn(33, 17), torch.zeros(0, 4, dtype=torch.bfloat16), torch.tensor([True, False])):
        consumer = Consumer()
        out = stager.load_tensor(tensor, consumer)
        consumer.use()
        assert out.dtype == tensor.dtype and out.shape == tensor.shape and torch.equal(out, tensor)


def test_a_ring_refuses_no_buffers():
    with pytest.raises(ValueError):
        Ring(0, 1024, lambda n: torch.empty(n))


@pytest.mark.gpu
def test_on_a_gpu_a_busy_default_stream_neither_grows_the_pieces_nor_sees_an_incomplete_tensor(tmp_path):
    """A 640 MiB tensor (ten pieces) loaded through the reader while the default stream is kept
    busy: the ring made its three page-locked pieces and no more, and the default stream, which
    waits for the copies made on the side stream, sees every byte."""
    from parity.bundle.reader import open_bundle
    from parity.bundle.writer import BundleWriter

    tensor = torch.randint(-2**31, 2**31 - 1, (160 * 2**20,), dtype=torch.int32)
    with BundleWriter(tmp_path / "b", shard_bytes=1 << 30) as writer:
        writer.add("output", "big", tensor, layer="big", module="big", call_index=0, path="")
        writer.commit({"subject": {"spec": "test", "name": "test", "args": {}}})
    bundle = open_bundle(tmp_path / "b")
    device = torch.device("cuda")
    busy = torch.randn(8192, 8192, device=device)
    for _ in range(20):  # queued on the default stream before the load starts
        busy = busy @ busy / 8192
    out = bundle.load_to("big", device=device)
    assert bundle.stager(device).ring.made == staging.STAGE_COUNT
    assert torch.equal(out.cpu(), tensor)  # on the default stream, after it waited for the copies
    bundle.close()


def _cuda_stream_of_this_thread(monkeypatch):
    """torch.cuda.current_stream stood in for on the CPU: each thread's own stream object."""
    streams: dict[int, str] = {}

    def current_stream(device=None):
        return streams.setdefault(threading.get_ident(), f"stream of {threading.current_thread().name}")

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    return current_stream


def test_the_state_read_ahead_hands_its_threads_the_stream_of_the_thread_that_uses_the_tensors(monkeypatch):
    from parity.run.subjects.base import StateSource

    current = _cuda_stream_of_this_thread(monkeypatch)
    state = {f"w{number}": torch.full((4,), float(number)) for number in range(6)}
    calls = []

    def load_to(name, device, stream):
        calls.append((name, device.type, stream, threading.current_thread().name))
        return state[name]

    source = StateSource({name: ((4,), torch.float32) for name in state}, state.__getitem__, load_to=load_to)
    got = dict(source.stream(list(state), device=torch.device("cuda")))
    assert all(torch.equal(got[name], state[name]) for name in state)
    mine = current()
    assert sorted(name for name, *_ in calls) == sorted(state)
    assert all(device == "cuda" and stream == mine and thread.startswith("parity-state")
               for _, device, stream, thread in calls)  # read on a worker, for this thread's stream


def test_the_golden_read_ahead_hands_its_threads_the_stream_of_the_thread_that_judges(monkeypatch, tmp_path):
    from parity.bundle.reader import open_bundle
    from parity.bundle.writer import BundleWriter
    from parity.judge.engine import ReadAhead

    current = _cuda_stream_of_this_thread(monkeypatch)
    with BundleWriter(tmp_path / "b") as writer:
        for number in range(5):
            writer.add("output", f"t{number}", torch.full((8,), float(number)), layer=f"t{number}", module="m",
                       call_index=0, path="")
        writer.commit({"subject": {"spec": "test", "name": "test", "args": {}}})
    bundle = open_bundle(tmp_path / "b")
    calls = []
    plain_load = bundle.load

    class OnDevice:  # what a GPU read returns, without a GPU: ``.to(device)`` is itself
        def __init__(self, tensor):
            self.tensor = tensor

        def to(self, device):
            return self

    def load_to(name, kind, *, device, stream=None):
        calls.append((name, stream, threading.current_thread().name))
        return OnDevice(plain_load(name, kind))

    monkeypatch.setattr(bundle, "load_to", load_to)
    monkeypatch.setattr(bundle, "load", lambda name, kind="output", **_: OnDevice(plain_load(name, kind)))
    reader = ReadAhead(bundle, [("output", f"t{number}") for number in range(5)], workers=1)
    try:
        for number in range(5):
            got = reader.load("output", f"t{number}", "cuda").tensor
            assert torch.equal(got, torch.full((8,), float(number)))
    finally:
        reader.close()
    assert calls and all(stream == current() and thread.startswith("parity-read") for _, stream, thread in calls)
