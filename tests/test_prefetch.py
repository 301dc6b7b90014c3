"""parity.base.prefetch: reading ahead in order, on threads, with the bytes in flight bounded."""
from __future__ import annotations

import threading
import time

import pytest

from parity.base.prefetch import read_ahead


class Source:
    """Items of known sizes whose fetch takes a while; counts the bytes fetched and not yet
    handed over at every moment (the bound read_ahead keeps)."""

    def __init__(self, sizes: dict[str, int], delay: float = 0.002, fail: str | None = None):
        self.sizes = sizes
        self.delay = delay
        self.fail = fail
        self.lock = threading.Lock()
        self.in_flight = 0
        self.most_in_flight = 0
        self.threads: set[str] = set()
        self.fetched: list[str] = []

    def fetch(self, key: str) -> str:
        with self.lock:
            self.in_flight += self.sizes[key]
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.threads.add(threading.current_thread().name)
            self.fetched.append(key)
        time.sleep(self.delay)
        if key == self.fail:
            raise OSError(f"cannot read {key}")
        return key.upper()

    def handed_over(self, key: str) -> None:
        with self.lock:
            self.in_flight -= self.sizes[key]


def test_yields_every_key_in_order_fetched_on_threads():
    sizes = {f"k{i}": 10 + i for i in range(40)}
    source = Source(sizes)
    got = []
    for key, value in read_ahead(list(sizes), source.fetch, sizes.get, max_bytes=50, workers=3, name="t-read"):
        got.append((key, value))
        source.handed_over(key)
    assert got == [(key, key.upper()) for key in sizes]
    assert source.threads and all(name.startswith("t-read") for name in source.threads)
    # Never more than max_bytes fetched and not yet done with; more than one tensor at a time.
    assert 2 * min(sizes.values()) <= source.most_in_flight <= 50


def test_reads_ahead_of_the_consumer():
    sizes = {f"k{i}": 1 for i in range(8)}
    source = Source(sizes, delay=0.0)
    iterator = read_ahead(list(sizes), source.fetch, sizes.get, max_bytes=100, workers=2)
    key, _ = next(iterator)
    deadline = time.monotonic() + 10  # the consumer works on k0 (a loaded machine schedules threads late) ...
    while len(source.fetched) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert key == "k0" and source.fetched[:3] == ["k0", "k1", "k2"]  # ... while k1, k2 are read
    time.sleep(0.05)
    assert len(source.fetched) == 3  # workers + 1 in flight, not the rest
    assert [key for key, _ in iterator] == [f"k{i}" for i in range(1, 8)]


def test_a_key_larger_than_the_bound_is_still_fetched_alone():
    sizes = {"a": 5, "huge": 1000, "b": 5}
    source = Source(sizes)
    assert [key for key, _ in read_ahead(list(sizes), source.fetch, sizes.get, max_bytes=10, workers=2)] == list(sizes)


def test_an_error_is_raised_at_its_key_and_the_rest_is_not_read():
    sizes = {f"k{i}": 1 for i in range(50)}
    source = Source(sizes, fail="k3")
    got = []
    with pytest.raises(OSError, match="cannot read k3"):
        for key, _ in read_ahead(list(sizes), source.fetch, sizes.get, max_bytes=4, workers=2):
            got.append(key)
    assert got == ["k0", "k1", "k2"]
    assert len(source.fetched) <= 3 + 4 + 1  # what was in flight when k3 failed, not the other 46
    assert not [t for t in threading.enumerate() if t.name.startswith("parity-prefetch")]


def test_a_consumer_that_stops_early_leaves_no_thread_behind():
    sizes = {f"k{i}": 1 for i in range(100)}
    source = Source(sizes)
    iterator = read_ahead(list(sizes), source.fetch, sizes.get, max_bytes=5, workers=2)
    next(iterator)
    iterator.close()
    assert len(source.fetched) < 20
    assert not [t for t in threading.enumerate() if t.name.startswith("parity-prefetch")]
