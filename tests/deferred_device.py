"""A stand-in for a GPU's side of parity.bundle.staging, run on the CPU: copies are queued, as on a
device stream, and carried out only when an event behind them is waited for, so a buffer
overwritten before its copy completed, or a tensor used before its copies are in, reads wrong."""
from __future__ import annotations

import threading

import torch


class DeferredEvent:
    def __init__(self, stream: "DeferredStream", position: int):
        self.stream = stream
        self.position = position
        self.waited = False

    def synchronize(self) -> None:
        self.waited = True
        self.stream.run_until(self.position)


class DeferredStream:
    """Queued copies, carried out in order (one stream's copies complete in order)."""

    def __init__(self):
        self.queue: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.done = 0
        self.lock = threading.Lock()

    def run_until(self, position: int) -> None:
        with self.lock:
            while self.done <= position:
                destination, source = self.queue[self.done]
                destination.copy_(source)
                self.done += 1


class Consumer:
    """The consumer's stream: what it waited for is carried out before it uses a tensor (``use``)."""

    def __init__(self):
        self.waits: list[DeferredEvent] = []
        self.recorded: list[torch.Tensor] = []

    def wait_event(self, event: DeferredEvent) -> None:
        self.waits.append(event)

    def use(self) -> None:
        for event in self.waits:
            event.stream.run_until(event.position)


class DeferredBackend:
    def __init__(self):
        self.stream = DeferredStream()
        self.buffers_made = 0
        self.default_consumer = Consumer()

    def buffer(self, nbytes: int) -> torch.Tensor:
        self.buffers_made += 1
        return torch.full((nbytes,), 0xEE, dtype=torch.uint8)  # garbage until filled

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), 0xDD, dtype=torch.uint8)

    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> DeferredEvent:
        with self.stream.lock:
            self.stream.queue.append((destination, source))  # the source is read when the copy runs
            return DeferredEvent(self.stream, len(self.stream.queue) - 1)

    def consumer(self) -> Consumer:
        return self.default_consumer

    def hand_over(self, tensor: torch.Tensor, last: DeferredEvent | None, consumer: Consumer) -> None:
        if last is not None:
            consumer.wait_event(last)
        consumer.recorded.append(tensor)
