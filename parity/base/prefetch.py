"""Reading a known sequence of items ahead, in order, on background threads, with a bound on the bytes held.

:func:`read_ahead` yields ``(key, value)`` for every key in order, where ``fetch(key)`` produced
the value on one of ``workers`` threads. Reads that release the GIL (``pread``, BLAKE3 and sha256,
host-to-device copies) then overlap each other and whatever the consumer does with the previous
value. At most ``max_bytes`` of fetched values not yet handed over are in flight (one more when a
single key is larger than the bound, so that every key is fetched), so peak memory stays bounded
whatever the number of keys.

An exception raised by ``fetch`` is raised by the iterator at that key, in order; when the
consumer stops early (an exception, ``close``), fetches not started are cancelled and the
iterator waits for those in progress before it returns, so no thread outlives it.
"""
from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

K = TypeVar("K")


def default_workers() -> int:
    """Threads for reading: one fewer than the cores (one core computes), 1 to 4."""
    return max(1, min(4, (os.cpu_count() or 2) - 1))


def read_ahead(keys: Sequence[K], fetch: Callable[[K], Any], size: Callable[[K], int], *, max_bytes: int,
               workers: int | None = None, name: str = "parity-prefetch") -> Iterator[tuple[K, Any]]:
    """``(key, fetch(key))`` for each of ``keys`` in order, fetched ahead on ``workers`` threads
    while no more than ``max_bytes`` (by ``size(key)``) are fetched and not yet handed over."""
    workers = workers or default_workers()
    pending: deque[tuple[K, int, Future]] = deque()
    held = 0
    position = 0
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name) as executor:
        try:
            while pending or position < len(keys):
                while position < len(keys) and len(pending) <= workers:
                    nbytes = size(keys[position])
                    if pending and held + nbytes > max_bytes:
                        break
                    pending.append((keys[position], nbytes, executor.submit(fetch, keys[position])))
                    held += nbytes
                    position += 1
                key, nbytes, future = pending.popleft()
                value = future.result()
                held -= nbytes
                yield key, value
                del value
        finally:
            for _, _, future in pending:
                future.cancel()
