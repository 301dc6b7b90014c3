"""The page-locked buffers a tensor passes through on its way to a GPU: a ring of a few, each written again only once the copy that read it has completed.

Why page-locked. A copy from pageable host memory to a GPU is staged by the driver and
synchronous; from page-locked memory it is asynchronous and runs at the link's speed, so the next
piece can be read from the disk (and hashed) while this one crosses the link.

Why a ring. Taking each piece from PyTorch's caching host allocator does not bound the pieces:
the allocator hands a block out again only once the event recorded behind its copy has
completed, so while copies wait in a busy stream's queue every new piece is a new page-locked
block, and the pieces grow with the tensor. Here ``count`` buffers are made once
(:class:`Ring`) and lent in turn; a buffer is written again only after the host waited for the
event recorded behind its last copy. Page-locked memory is then ``count`` x the piece size,
whatever the tensor's size or the device's queue.

Streams (:class:`DeviceStager`). The copies run on the stager's own side stream, so they do not
wait behind the consumer's kernels. The device tensor is allocated on the side stream; once its
last piece is queued, the consumer's stream waits for the event recorded behind that piece (the
copies of one side stream complete in order, so every piece is in) and the tensor is marked as
used by the consumer's stream (``record_stream``): when it is freed, its memory is not handed to
another allocation before the consumer's work on it has completed.

The device's part (:class:`CudaBackend`) is small and separate, so the ring and the piece loop run
on the CPU in the tests with a backend whose copies are deferred as a GPU's are.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

# A piece: large enough for the disk and the link to run at speed, a size the host allocator's
# power-of-two blocks fit exactly.
STAGE_BYTES = 64 * 2**20
# Buffers in the ring: two let one piece be filled while the other's copy runs; a third lets a
# second reading thread fill one without waiting for a copy to complete.
STAGE_COUNT = 3


class Event(Protocol):
    def synchronize(self) -> None: ...


class Ring:
    """``count`` buffers of ``nbytes``, made by ``make(nbytes)`` when first lent and reused in turn.

    :meth:`acquire` lends a buffer no one holds, after waiting (host side) for the event its last
    copy recorded; :meth:`release` gives it back with the event recorded behind the copy that
    reads it (None: no copy was queued). Thread-safe: several reading threads share one ring, and
    a thread holds one buffer at a time, so none waits for a buffer that only it could give back.
    """

    def __init__(self, count: int, nbytes: int, make: Callable[[int], torch.Tensor]):
        if count < 1 or nbytes < 1:
            raise ValueError(f"a ring needs at least one buffer of at least one byte, got {count} x {nbytes}")
        self.count = count
        self.nbytes = nbytes
        self._make = make
        self._buffers: list[torch.Tensor | None] = [None] * count
        self._events: list[Any] = [None] * count
        self._free: deque[int] = deque(range(count))  # first in, first out: the oldest copy is waited for
        self._lock = threading.Condition()
        self.made = 0  # buffers made so far: never more than ``count``

    def acquire(self) -> tuple[int, torch.Tensor]:
        with self._lock:
            while not self._free:
                self._lock.wait()
            index = self._free.popleft()
            event, self._events[index] = self._events[index], None
        try:
            if event is not None:
                event.synchronize()  # the copy that last read this buffer has completed
            if self._buffers[index] is None:
                self._buffers[index] = self._make(self.nbytes)
                self.made += 1
        except BaseException:
            self.release(index, None)
            raise
        return index, self._buffers[index]

    def release(self, index: int, event: Any | None) -> None:
        with self._lock:
            self._events[index] = event
            self._free.append(index)
            self._lock.notify()

    def drain(self) -> None:
        """Wait for every copy the ring's buffers were lent to (before they are freed)."""
        with self._lock:
            events = [event for event in self._events if event is not None]
        for event in events:
            event.synchronize()


class CudaBackend:
    """A CUDA (or ROCm) device's side of :class:`DeviceStager`: page-locked buffers, a side stream
    for the copies, and the hand-over to the consumer's stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def empty(self, nbytes: int) -> torch.Tensor:
        with torch.cuda.stream(self.stream):  # allocated for the side stream, which writes it
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> Any:
        with torch.cuda.stream(self.stream):
            destination.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def consumer(self) -> Any:
        """The calling thread's current stream on the device: the default consumer."""
        return torch.cuda.current_stream(self.device)

    def hand_over(self, tensor: torch.Tensor, last: Any | None, consumer: Any) -> None:
        if last is not None:
            consumer.wait_event(last)
        tensor.record_stream(consumer)


class DeviceStager:
    """Loads tensors onto one device through a :class:`Ring` of page-locked pieces."""

    def __init__(self, backend: Any, *, count: int = STAGE_COUNT, piece: int = STAGE_BYTES):
        self.backend = backend
        self.piece = piece
        self.ring = Ring(count, piece, backend.buffer)

    @classmethod
    def for_device(cls, device: torch.device) -> "DeviceStager":
        return cls(CudaBackend(device))

    def load(self, nbytes: int, fill: Callable[[torch.Tensor, int], None], consumer: Any | None = None) -> torch.Tensor:
        """A device tensor of ``nbytes`` bytes (uint8), piece by piece: ``fill(piece, offset)``
        writes the bytes at ``offset`` into the host buffer ``piece`` (its length is the piece's),
        then the piece is copied on asynchronously. ``consumer``: the stream that will use the
        tensor (default: the calling thread's current stream); it waits for the copies. An
        exception from ``fill`` gives its buffer back and propagates."""
        consumer = self.backend.consumer() if consumer is None else consumer
        out = self.backend.empty(nbytes)
        last = None
        for start in range(0, nbytes, self.piece):
            size = min(self.piece, nbytes - start)
            index, buffer = self.ring.acquire()
            event = None
            try:
                piece = buffer[:size]
                fill(piece, start)
                event = self.backend.copy(out[start:start + size], piece)
            finally:
                self.ring.release(index, event)
            last = event
        self.backend.hand_over(out, last, consumer)
        return out

    def load_tensor(self, tensor: torch.Tensor, consumer: Any | None = None) -> torch.Tensor:
        """A host tensor copied onto the device through the ring (same dtype and shape)."""
        source = tensor.detach().contiguous().reshape(-1).view(torch.uint8) if tensor.numel() else None
        nbytes = 0 if source is None else source.numel()

        def fill(piece: torch.Tensor, offset: int) -> None:
            piece.copy_(source[offset:offset + piece.numel()])

        out = self.load(nbytes, fill, consumer)
        return out.view(tensor.dtype).reshape(tensor.shape)

    def close(self) -> None:
        self.ring.drain()
