"""A repeated launch without the set-up: the kernel's arguments bound once per problem, then
issued again with the new call's tensors.

A call of the prefill kernel costs the host more than a short kernel costs the device (issue 26,
kernels/BENCHMARK.md: 0.24-0.35 ms per call on the H200's host for a 0.16-0.23 ms kernel). Two
parts of that cost are the same on every call of one problem: building the 59 runtime arguments
(``kernels.launch.build_launch``) and Triton's dispatch, which specializes every argument again
(alignment of each pointer, divisibility of each integer) to find the compiled kernel. A model
calls the kernel with one layout, one shape and one config in every layer, so both can be done
once.

``LaunchCache`` keeps, per layout and per key (``kernels.launch.launch_key``: everything the
launch depends on besides the layout and the addresses of the per-call tensors), the compiled
kernel Triton chose and the argument list it was called with. A later call with an equal key on
the same layout object swaps in its own per-call tensors (q, k, v, out, lse) and issues the
compiled kernel directly, as Triton's own ``JITFunction.run`` does after its cache lookup. The key
holds every input of Triton's specialization that can change between such calls (the per-call
tensors' dtypes, shapes, strides and 16-byte alignment), so the kernel issued is the one Triton
would pick; ``tests/test_kernels_launch_cache.py`` checks that against Triton's own binder.

Entries live as long as their layout (a weak reference) and at most ``MAX_PER_LAYOUT`` per layout.
A layout is a value: its tensors are not to be edited in place after it is used. Under the Triton
interpreter, or with a Triton whose compiled kernels lack the launch interface used here, every
call goes through Triton's dispatch as before.
"""
from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["LaunchCache", "MAX_PER_LAYOUT", "issue_compiled", "direct_launch_supported"]

MAX_PER_LAYOUT = 16

# What a compiled kernel needs for ``issue_compiled`` (Triton 3.6 to 3.9: CompiledKernel).
_COMPILED_INTERFACE = ("run", "function", "packed_metadata", "launch_metadata")


@dataclasses.dataclass
class _Entry:
    compiled: Any  # Triton's CompiledKernel
    grid: tuple[int, ...]
    values: list[Any]  # every parameter's value, in the kernel's order (runtime and constexpr)
    positions: tuple[int, ...]  # where the per-call tensors go in ``values``


def direct_launch_supported(compiled: Any) -> bool:
    """Whether ``compiled`` (what ``kernel[grid](...)`` returned) can be issued directly."""
    return compiled is not None and all(hasattr(compiled, name) for name in _COMPILED_INTERFACE)


def issue_compiled(compiled: Any, grid: tuple[int, ...], values: Sequence[Any]) -> None:
    """Launch a compiled Triton kernel on the current device's current stream, as
    ``JITFunction.run`` does once it has found it (launch hooks included, so profilers still see
    the launch)."""
    from triton import knobs
    from triton.runtime import driver

    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)
    grid = tuple(grid) + (1,) * (3 - len(grid))
    metadata = compiled.launch_metadata(grid, stream, *values)
    compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, metadata,
                 knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *values)


class LaunchCache:
    """Launches of one Triton kernel, bound once per (layout, key) and issued again with new tensors.

    ``kernel``: the ``@triton.jit`` function; ``per_call``: the names of the parameters that take
    the call's own tensors (the key must not depend on their addresses beyond alignment).
    ``issue``: how a cached launch is issued (``issue_compiled``; tests pass a recorder).
    """

    def __init__(self, kernel: Any, per_call: Sequence[str], *,
                 issue: Callable[[Any, tuple[int, ...], Sequence[Any]], None] = issue_compiled,
                 max_per_layout: int = MAX_PER_LAYOUT):
        self._kernel = kernel
        self._per_call = tuple(per_call)
        self._issue = issue
        self._max = max_per_layout
        self._by_layout: weakref.WeakKeyDictionary[Any, collections.OrderedDict] = weakref.WeakKeyDictionary()
        self.hits = 0
        self.misses = 0

    def launch(self, layout: Any, key: tuple, tensors: Sequence[Any], build: Callable[[], Any]) -> None:
        """Launch the kernel for this call. ``tensors``: the per-call tensors, in ``per_call``
        order, None where the launch builds a stand-in (whether each is None must be part of
        ``key``); ``build``: makes the call's ``KernelLaunch`` (grid, args, constexprs, options)
        when no entry matches, from the same ``tensors``."""
        entries = self._by_layout.get(layout)
        entry = entries.get(key) if entries is not None else None
        if entry is not None:
            self.hits += 1
            entries.move_to_end(key)
            values = list(entry.values)
            for position, tensor in zip(entry.positions, tensors):
                if tensor is not None:  # None: the launch's own stand-in (e.g. no LSE), kept
                    values[position] = tensor
            self._issue(entry.compiled, entry.grid, values)
            return
        self.misses += 1
        launch = build()
        compiled = self._kernel[launch.grid](**launch.args, **launch.constexprs, **launch.options)
        if not direct_launch_supported(compiled):
            return  # the interpreter, or a Triton without the interface: no entry, dispatch each time
        names = list(self._kernel.arg_names)
        given = {**launch.args, **launch.constexprs}
        if (set(names) != set(given) or len(tensors) != len(self._per_call)
                or any(t is not None and given[name] is not t for name, t in zip(self._per_call, tensors))):
            raise RuntimeError("LaunchCache: the launch's arguments do not match the kernel's parameters "
                               f"and the per-call tensors {self._per_call}")
        values = [given[name] for name in names]
        positions = tuple(names.index(name) for name in self._per_call)
        for position, tensor in zip(positions, tensors):
            if tensor is not None:
                values[position] = None  # the entry does not keep this call's tensors alive
        entry = _Entry(compiled, tuple(launch.grid), values, positions)
        if entries is None:
            entries = self._by_layout.setdefault(layout, collections.OrderedDict())
        entries[key] = entry
        while len(entries) > self._max:
            entries.popitem(last=False)

    def clear(self) -> None:
        self._by_layout = weakref.WeakKeyDictionary()
