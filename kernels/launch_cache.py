"""A repeated launch without the set-up: the kernel's arguments bound once per problem, then
issued again with the new call's tensors.

A call of the prefill kernel costs the host more than a short kernel costs the device (issue 26,
kernels/BENCHMARK.md: 0.24-0.35 ms per call on the H200's host for a 0.16-0.23 ms kernel). Two
parts of that cost are the same on every call of one problem: building the 61 runtime arguments
(``kernels.launch.build_launch``) and Triton's dispatch, which specializes every argument again
(alignment of each pointer, divisibility of each integer) to find the compiled kernel. A model
calls the kernel with one layout, one shape and one config in every layer, so both can be done
once. Decode steps are shorter still (tens of microseconds on the device, kernels/BENCHMARK.md)
and launch two kernels.

``LaunchCache`` keeps, per layout and per key (``kernels.launch.launch_key``, and
``kernels.decode.decode_key`` for the decode path: everything the launches depend on besides the
layout and the addresses of the per-call tensors), the compiled kernels Triton chose and the
argument lists they were called with: one launch on the prefill path, the split kernel (and,
unfused, the combine kernel) on the decode path, whose workspace the entry keeps or makes anew per
call (``fresh``; kernels/decode.py says when each is safe). A later call with an equal key on the same layout
object swaps in its own per-call tensors (q, k, v, out, lse) and issues the compiled kernels
directly, as Triton's own ``JITFunction.run`` does after its cache lookup. The key holds every
input of Triton's specialization that can change between such calls (the per-call
tensors' dtypes, shapes, strides and 16-byte alignment), so the kernel issued is the one Triton
would pick; ``tests/test_kernels_launch_cache.py`` checks that against Triton's own binder.
Integer arguments a caller names as per-call scalars (a decode step's key length, causal offset
and K/V batch and head strides, which grow every step) are issued with each call's values; the
key then holds only what Triton specializes them on (``int_class``), so consecutive decode
steps on one layout's tensors find one entry.

The key also holds the current device and stream (``dispatch_state``): an entry keeps the
read-only tensors its launch built (a stand-in LSE buffer that is never written, copies of layout
tensors that needed one), and they are used only on the stream they were allocated on. Entries
live as long as their layout object (a weak reference) and at most ``MAX_PER_LAYOUT`` per layout.
A layout is meant as a value, but its tensors can be edited in place: an entry also records the
layout's ``version`` (torch's count of in-place edits of its tensors, ``BlockLayout.version``) and
is built again when that has moved, so an edited layout is launched as a new one. Where the
version is not known (a layout made under ``torch.inference_mode``, whose tensors count no edits),
Triton dispatches every call. A layout on another device than q is copied on every call, so such
calls never hit. As in Triton's dispatch, a hit first checks that the globals the kernel was
compiled with are unchanged. Triton dispatches the call itself where the kernel has pre-run hooks
or a stages-inspection hook is set, and while the stream is capturing a CUDA graph. Under the
interpreter (and with a Triton whose compiled kernels lack the launch interface used here) an
entry is kept all the same and a hit dispatches the kernel from the entry's bound arguments: the
interpreter then computes what the cached path passes, so the CPU test suite checks the bound
arguments of every launch it makes twice.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import targets
from .targets import arch_spec, triton_interpreter_enabled

__all__ = ["LaunchCache", "LaunchStep", "Entry", "MAX_PER_LAYOUT", "issue_compiled", "direct_launch_supported",
           "dispatch_state", "triton_binder", "int_class", "pointer_key"]

MAX_PER_LAYOUT = 16

# What a compiled kernel needs for ``issue_compiled`` (Triton 3.6 to 3.9: CompiledKernel).
_COMPILED_INTERFACE = ("run", "function", "packed_metadata", "launch_metadata")


@dataclasses.dataclass(frozen=True)
class LaunchStep:
    """One kernel launch: ``kernel[grid](**args, **constexprs, **options)``."""

    kernel: Any  # the @triton.jit function
    grid: tuple[int, ...]
    args: dict[str, Any]  # runtime arguments by parameter name
    constexprs: dict[str, Any]
    options: dict[str, Any]  # compiler options: num_warps, num_stages, AMD knobs

    def dispatch(self) -> Any:
        """Launch through Triton's dispatch; returns what it returns (the compiled kernel)."""
        return self.kernel[self.grid](**self.args, **self.constexprs, **self.options)


@dataclasses.dataclass
class _Bound:
    kernel: Any  # the @triton.jit function (dispatched from ``values`` where ``compiled`` is None)
    compiled: Any  # Triton's CompiledKernel, or None (the interpreter, or no launch interface)
    grid: tuple[int, ...]
    values: list[Any]  # every parameter's value, in the kernel's order (runtime and constexpr)
    slots: tuple[tuple[int, int], ...]  # (position in values, index in the per-call tensors)
    scalar_slots: tuple[tuple[int, int], ...]  # (position in values, index in the per-call scalars)
    fresh: tuple[tuple[int, str], ...]  # (position in values, name of a tensor made anew per call)
    names: tuple[str, ...]  # the kernel's parameter names (the order of ``values``)
    options: dict[str, Any]  # compiler options, for a dispatch from ``values``
    # ``values`` with every kept tensor as its device address (an int), where the cache issues
    # addresses (``LaunchCache(addresses=True)``, a compiled kernel); None otherwise
    addresses: list[Any] | None = None


@dataclasses.dataclass
class Entry:
    """One plan: the launches of one call, bound, for every later call with an equal key."""

    steps: tuple[_Bound, ...]
    fresh: dict[str, tuple[tuple, tuple, Any, Any]]  # name -> shape, strides, dtype, device
    version: Any  # the layout's version when the entry was built (``LaunchCache``'s ``version``)
    extra: Any = None  # what the caller needs to prepare a hit's per-call tensors (its own data)
    keep: tuple = ()  # objects whose identity the key holds (kept alive with the entry)


def int_class(value: int) -> tuple[bool, bool, str]:
    """What Triton's dispatch specializes an integer argument on: whether it is 1 (compiled as
    the constant), whether it is divisible by 16 (an alignment the compiler assumes), and its
    type by range (i32, u64 or i64). Two values of one class select the same compiled kernel
    (``tests/test_kernels_launch_cache.py`` checks it with Triton's binder), so a per-call scalar
    (``LaunchCache``'s ``scalars``) is keyed on this instead of its value."""
    return (value == 1, value % 16 == 0,
            "i32" if -2**31 <= value < 2**31 else "u64" if 2**63 <= value < 2**64 else "i64")


def direct_launch_supported(compiled: Any) -> bool:
    """Whether ``compiled`` (what ``kernel[grid](...)`` returned) can be issued directly."""
    return compiled is not None and all(hasattr(compiled, name) for name in _COMPILED_INTERFACE)


def dispatch_state(kernels: Sequence[Any]) -> tuple | None:
    """What Triton's dispatch reads on each call besides the arguments, as part of the key: the
    current device (a compiled kernel is loaded per device) and stream (entries are then used on
    the stream whose allocations they hold), and the debug, instrumentation and fpsan settings
    (compiler options; the last from Triton 3.9), and an overridden architecture (3.9). None where
    the cache must step aside and let Triton dispatch: one of ``kernels`` has pre-run hooks, a
    stages-inspection hook is set (3.9), or the stream is capturing a CUDA graph (a graph would
    hold the entry's buffers, which an eviction frees; and capture is not where host time
    matters)."""
    if triton_interpreter_enabled():  # no device, no stream, no compiled kernel: dispatched from the entry
        return ("interpreter",)
    knobs, driver = _triton()

    if (any(getattr(kernel, "pre_run_hooks", None) for kernel in kernels)
            or getattr(knobs.runtime, "add_stages_inspection_hook", None)
            or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())):
        return None
    device = driver.active.get_current_device()
    return (device, driver.active.get_current_stream(device), knobs.runtime.debug,
            knobs.compilation.instrumentation_mode, getattr(knobs.compilation, "fpsan_homomorphic_casts", None),
            getattr(knobs.runtime, "override_arch", None))


_TRITON: tuple = ()


def _triton() -> tuple:
    """(triton.knobs, triton.runtime.driver), imported once: every hit reads them, and an import
    statement costs a lookup through the import machinery on each call."""
    global _TRITON
    if not _TRITON:
        from triton import knobs
        from triton.runtime import driver

        _TRITON = (knobs, driver)
    return _TRITON


def issue_compiled(compiled: Any, grid: tuple[int, ...], values: Sequence[Any], state: tuple) -> None:
    """Launch a compiled Triton kernel on ``state``'s device and stream (``dispatch_state``), as
    ``JITFunction.run`` does once it has found it (launch hooks included, so profilers still see
    the launch)."""
    knobs = _triton()[0]
    stream = state[1]
    metadata = compiled.launch_metadata(grid, stream, *values)
    grid = tuple(grid) + (1,) * (3 - len(grid))
    compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, metadata,
                 knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *values)


def triton_binder(kernel: Any, arch: str) -> tuple[Callable[..., tuple], list[str]]:
    """(binder, parameter names) of ``kernel`` as Triton's dispatch builds them for ``arch``
    (``kernels.targets`` names): ``binder(**arguments, **options)`` returns the bound arguments,
    the specialization and the options ``JITFunction.run`` keys its cache on. Needs no GPU; made
    from the kernel's Python source, so it works under the interpreter too."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    spec = arch_spec(arch)
    fn = JITFunction(kernel.fn)
    backend = make_backend(GPUTarget(spec.backend, spec.triton_arch, spec.warp_size))
    return create_function_from_signature(fn.signature, fn.params, backend), fn.arg_names


def _globals_unchanged(kernel: Any) -> bool:
    """Triton's own check before each launch: the globals the kernel read when compiled still
    hold those values (where one changed, dispatch raises Triton's error)."""
    used = getattr(kernel, "used_global_vals", None)
    if not used:  # every hit asks: no generator where there is nothing to check
        return True
    missing = object()
    return all(scope.get(name, missing) == value for (name, _), (value, scope) in used.items())


def pointer_key(tensor: torch.Tensor) -> tuple[bool, ...]:
    """What Triton specializes a tensor argument on besides its dtype, as part of a launch key:
    its base's 16-byte alignment, and where the backend narrows pointers to 32-bit offsets
    (``targets.POINTER_RANGE_SPECIALIZED``: AMD's buffer loads) whether its storage is within
    2**31 - 1 bytes. A key with the alignment alone would let a plan built on a K/V cache under
    2 GiB serve one that grew past it (a decode loop's cache grows every step): 32-bit offsets
    that wrap."""
    aligned = tensor.data_ptr() % 16 == 0
    if not targets.POINTER_RANGE_SPECIALIZED:
        return (aligned,)
    return aligned, tensor.untyped_storage().size() <= 2**31 - 1


def kept_tensors(entry: Entry) -> list[torch.Tensor]:
    """Every tensor ``entry`` holds: its steps' bound values and ``keep``."""
    held = [value for bound in entry.steps for value in bound.values] + list(entry.keep)
    return [value for value in held if isinstance(value, torch.Tensor)]


def _borrowed(entry: Entry, owners: Sequence[Any]) -> bool:
    """Whether every tensor ``entry`` holds lies in the memory of one of ``owners``."""
    spans = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in owners
             if isinstance(t, torch.Tensor)]
    for tensor in kept_tensors(entry):
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        if not any(base <= start and start + storage.nbytes() <= base + size for base, size in spans):
            return False
    return True


def _unlinked(value: Any) -> Any:
    """A tensor the entry keeps, as a tensor over the same memory that is not a view of its base
    (a view holds its base alive: an entry would keep a layout tensor, maybe its own anchor, alive
    for ever). Anything else as it is."""
    if not isinstance(value, torch.Tensor) or value._base is None:
        return value
    alias = torch.empty(0, dtype=value.dtype, device=value.device)
    return alias.set_(value.untyped_storage(), value.storage_offset(), value.size(), value.stride())


class LaunchCache:
    """Launches of a fixed sequence of Triton kernels, bound once per (layout, key) and issued
    again with new tensors.

    ``kernels``: the ``@triton.jit`` functions a call may launch (their pre-run hooks and globals
    are checked); ``per_call``: the names of the parameters that take the call's own tensors (the
    key must not depend on their addresses beyond alignment); ``fresh``: the names of tensors a
    launch builds that kernels write (a workspace): each hit allocates them anew, with the same
    shape, strides and dtype, so that two calls in flight never share one. Any other tensor a
    launch builds (a stand-in never written, a copy of a layout tensor) is kept in the entry and
    only read, on the stream the entry belongs to (a caller may keep written buffers there too, where
    stream order serializes the calls that share them). ``zeroed``: those of ``fresh`` made filled
    with zeros. ``fresh_stand_ins``: False keeps a stand-in for a per-call tensor left None in the
    entry instead of making it anew per hit (only for calls that need nothing they allocate freed).
    ``shared``: written tensors kept in an entry of one launch but made anew per hit, like
    ``fresh``, in an entry of several: stream order serializes one launch against another
    caller's, but between two launches of one call another host thread may issue its own on the
    same stream, which would overwrite what the first call's next launch reads.
    ``version``: what changes when a layout is edited in place (``BlockLayout.version``); an
    entry built under another version is built again, and a layout whose version is None (not
    known) is never cached.
    ``issue`` and ``state``: how a cached launch is issued and what dispatch state it is keyed on
    (``issue_compiled``, ``dispatch_state``; tests pass stand-ins).
    ``addresses``: a compiled kernel's hit passes every tensor as its device address (an int),
    which Triton's launcher takes as is, instead of the tensor, which it validates with a driver
    query per pointer on every launch. The key already pins what that query checks (every
    per-call tensor on the entry's device; the entry's own tensors were checked when it was
    built). False passes the tensors (tests that look at them).

    Where a launch returns no compiled kernel with the launch interface (the interpreter), its
    entry still binds the arguments and a hit dispatches the kernel from them: the same bound
    arguments a GPU's hit issues, so the interpreter's tests run through the cached path too.

    ``scalars``: the names of integer parameters whose values come from each call (a decode
    step's key length and strides grow every step): the caller's key holds only their
    specialization class (``int_class``), never their values, and a hit issues the call's own.
    A parameter a launch computes from anything but the call's scalars must not be one.

    ``launch`` is one call; the launcher's fast path uses its parts: ``find`` (the entry for a key,
    or None), ``issue`` (a found entry with this call's tensors), and ``launch`` on a miss, which
    builds, dispatches and stores the entry under the same key (with ``extra``, the caller's
    recipe for a hit's tensors, and ``keep``, objects whose identity the key holds).
    """

    def __init__(self, kernels: Sequence[Any], per_call: Sequence[str], *, fresh: Sequence[str] = (),
                 zeroed: Sequence[str] = (), fresh_stand_ins: bool = True, shared: Sequence[str] = (),
                 issue: Callable[[Any, tuple[int, ...], Sequence[Any], tuple], None] = issue_compiled,
                 state: Callable[[Sequence[Any]], tuple | None] = dispatch_state,
                 version: Callable[[Any], Any] = lambda layout: (), max_per_layout: int = MAX_PER_LAYOUT,
                 addresses: bool = True, scalars: Sequence[str] = ()):
        self.kernels = tuple(kernels)
        self._scalars = tuple(scalars)
        self._addresses = addresses
        self._per_call = tuple(per_call)
        self._fresh = tuple(fresh)
        self._shared = tuple(name for name in shared if name not in self._fresh)
        self._zeroed = frozenset(zeroed)
        self._fresh_stand_ins = fresh_stand_ins
        self._issue = issue
        self._state = state
        self._version = version
        self._max = max_per_layout
        # id(layout) -> (weak reference to it, its entries): by identity, since a layout may be a
        # tensor (whose == is elementwise); the reference's callback drops the entries with it
        self._by_layout: dict[int, tuple[weakref.ref, collections.OrderedDict]] = {}
        self._lock = threading.RLock()  # the bookkeeping and the counts only (re-entered by a weak reference's callback run by a collection inside); launches are not serialized
        self.hits = 0
        self.misses = 0

    def state(self) -> tuple | None:
        """This call's dispatch state (``dispatch_state``), None where Triton must dispatch."""
        return self._state(self.kernels)

    def launch(self, layout: Any, key: tuple, tensors: Sequence[Any], build: Callable[[], Sequence[LaunchStep]],
               *, version: Any = dataclasses.MISSING, state: Any = dataclasses.MISSING, extra: Any = None,
               keep: tuple = (), borrowed_only: bool = False, scalars: Sequence[int] = ()) -> None:
        """Launch this call's kernels. ``tensors``: the per-call tensors, in ``per_call`` order,
        None where the launch builds a stand-in (whether each is None must be part of ``key``);
        ``scalars``: the call's values of the ``scalars`` parameters, in that order (the launch
        must pass exactly these; their classes must be part of ``key``);
        ``build``: makes the call's launches, in order, when no entry matches, from the same
        ``tensors``. ``version`` and ``state``: the caller's, where it has read them already.
        ``borrowed_only``: store the entry only where every tensor it keeps shares memory with
        ``layout`` or ``keep`` (a view of the caller's tensors), none the launch allocated (a
        converted or reordered copy of a layout tensor): the call then leaves nothing it
        allocated alive, as CUDA-graph trees require of an operator they record."""
        if state is dataclasses.MISSING:
            state = self._state(self.kernels)
        if version is dataclasses.MISSING:
            version = self._version(layout) if state is not None else None
        if state is None or version is None:  # Triton must dispatch this call itself
            self._count(hit=False)
            for step in build():
                step.dispatch()
            return
        key = (state, key)
        entry = self.find(layout, key, version)
        if entry is not None:
            self.issue(entry, tensors, state, scalars)
            return
        self._count(hit=False)
        steps, fresh = [], {}
        built = list(build())
        made_anew = self._fresh + (self._shared if len(built) > 1 else ())
        for step in built:
            compiled = step.dispatch()
            steps.append(self._bind(step, compiled if direct_launch_supported(compiled) else None, tensors, fresh,
                                    scalars, made_anew))
        entry = Entry(tuple(steps), {name: spec for name, (spec, _) in fresh.items()}, version, extra, tuple(keep))
        if borrowed_only and not _borrowed(entry, (layout, *keep)):
            return
        with self._lock:
            entries = self._entries(layout)
            if entries is None:
                entries = collections.OrderedDict()
                self._by_layout[id(layout)] = (weakref.ref(layout, self._forget(id(layout))), entries)
            entries[key] = entry
            while len(entries) > self._max:
                entries.popitem(last=False)

    def find(self, layout: Any, key: tuple, version: Any, *, count: bool = True) -> Entry | None:
        """The entry of ``layout`` under ``key`` (which holds the dispatch state) built under
        ``version``, counted as a hit (``count``: a caller that only binds it, issuing nothing,
        passes False); None (nothing counted) where there is none, the layout was edited since,
        or a global the kernels were compiled with has changed (Triton's dispatch then raises
        its error)."""
        with self._lock:
            entries = self._entries(layout)
            entry = entries.get(key) if entries is not None else None
            if entry is None or entry.version != version:
                return None  # an edited layout's entry is replaced when the call is built again
            entries.move_to_end(key)
        if not all(_globals_unchanged(kernel) for kernel in self.kernels):
            return None
        if count:
            self._count(hit=True)
        return entry

    def reuse(self, entry: Entry) -> bool:
        """Whether an entry the caller found earlier (``find``) may be issued again now: the
        globals its kernels were compiled with are unchanged (as ``find`` checks); counted as a hit.
        The caller answers for the rest of what ``find`` checks (the same key, the layout alive and
        at the entry's version)."""
        for kernel in self.kernels:
            if not _globals_unchanged(kernel):
                return False
        with self._lock:
            self.hits += 1
        return True

    def issues_addresses(self, entry: Entry) -> bool:
        """Whether a hit of ``entry`` hands every launch its tensors as device addresses (so of a
        per-call tensor only its data pointer is read: its shape and strides are the entry's)."""
        return all(bound.addresses is not None for bound in entry.steps)

    def issue(self, entry: Entry, tensors: Sequence[Any], state: tuple, scalars: Sequence[int] = ()) -> None:
        """Issue a found entry's launches, in order, with this call's ``tensors`` and ``scalars``
        and one new workspace shared by its steps (as the build shared it). Where the steps carry addresses,
        every tensor goes to the launcher as its device address: the workspace is freed when this
        returns, which the caching allocator makes safe as for any tensor (its memory is reused
        only by work queued later on the same stream)."""
        made = {name: torch.empty_strided(shape, strides, dtype=dtype, device=device)
                for name, (shape, strides, dtype, device) in entry.fresh.items()} if entry.fresh else None
        for name in self._zeroed.intersection(made or ()):
            made[name].zero_()
        for bound in entry.steps:
            addresses = bound.addresses
            if addresses is not None:
                values = list(addresses)
                for position, index in bound.slots:
                    tensor = tensors[index]
                    values[position] = tensor.data_ptr() if isinstance(tensor, torch.Tensor) else tensor
                for position, index in bound.scalar_slots:
                    values[position] = scalars[index]
                for position, name in bound.fresh:
                    values[position] = made[name].data_ptr()
                self._issue(bound.compiled, bound.grid, values, state)
                continue
            values = list(bound.values)
            for position, index in bound.slots:
                values[position] = tensors[index]
            for position, index in bound.scalar_slots:
                values[position] = scalars[index]
            for position, name in bound.fresh:
                values[position] = made[name]
            if bound.compiled is None:
                bound.kernel[bound.grid](**dict(zip(bound.names, values)), **bound.options)
            else:
                self._issue(bound.compiled, bound.grid, values, state)

    def _entries(self, layout: Any) -> collections.OrderedDict | None:
        slot = self._by_layout.get(id(layout))
        return slot[1] if slot is not None and slot[0]() is layout else None

    def _forget(self, ident: int) -> Callable[[weakref.ref], None]:
        def forget(ref: weakref.ref) -> None:  # the layout is gone: its entries with it
            with self._lock:
                slot = self._by_layout.get(ident)
                if slot is not None and slot[0] is ref:
                    del self._by_layout[ident]
        return forget

    def _count(self, *, hit: bool) -> None:
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1

    def _bind(self, step: LaunchStep, compiled: Any, tensors: Sequence[Any], fresh: dict,
              scalars: Sequence[int] = (), made_anew: Sequence[str] | None = None) -> _Bound:
        """The step's argument list without this call's tensors; ``fresh`` collects, by name, the
        workspace tensors the steps share (the same object in each, else a RuntimeError)."""
        names = list(step.kernel.arg_names)
        given = {**step.args, **step.constexprs}
        slots = tuple((names.index(name), index) for index, (name, tensor) in enumerate(zip(self._per_call, tensors))
                      if tensor is not None and name in given)
        if (set(names) != set(given) or len(tensors) != len(self._per_call)
                or any(given[names[position]] is not tensors[index] for position, index in slots)):
            raise RuntimeError("LaunchCache: the launch's arguments do not match the kernel's parameters "
                               f"and the per-call tensors {self._per_call}")
        # a per-call scalar the launch computed otherwise than the caller said would be frozen
        # at the first call's value for the caller's: refused
        scalar_slots = tuple((names.index(name), index) for index, name in enumerate(self._scalars) if name in given)
        if len(scalars) != len(self._scalars) or any(
                type(given[names[position]]) is not int or given[names[position]] != scalars[index]
                for position, index in scalar_slots):
            raise RuntimeError(f"LaunchCache: the launch passes other values for the per-call scalars "
                               f"{self._scalars} than the call's {tuple(scalars)}")
        # the entry does not keep this call's tensors alive: their slots hold None
        per_call = {position for position, _ in slots}
        values = [None if position in per_call else _unlinked(given[name]) for position, name in enumerate(names)]
        made = []
        # A per-call parameter the caller left None gets a stand-in the launch allocates (the LSE
        # of a call without one): it is made anew on each hit like a workspace, so that the entry
        # holds no tensor allocated by the call (CUDA-graph trees fail a recording after which a
        # tensor allocated in their pool stays alive without being an output).
        stand_ins = tuple(name for name, tensor in zip(self._per_call, tensors)
                          if tensor is None and isinstance(given.get(name), torch.Tensor)) if self._fresh_stand_ins else ()
        for name in (self._fresh if made_anew is None else tuple(made_anew)) + stand_ins:
            if name in given:
                tensor = given[name]
                spec, first = fresh.setdefault(name, ((tuple(tensor.shape), tensor.stride(), tensor.dtype,
                                                       tensor.device), tensor))
                if first is not tensor:
                    raise RuntimeError(f"LaunchCache: the steps of one launch pass different {name} tensors")
                made.append((names.index(name), name))
                values[names.index(name)] = None
        addresses = None
        if self._addresses and compiled is not None:
            # Triton's launcher turns a tensor argument into its address with a Python call
            # (``data_ptr``) and a driver query (``cuPointerGetAttribute``) per pointer, on every
            # launch; it takes an int as the address itself. The entry holds these tensors
            # (``values``), so their addresses stay valid while it lives.
            addresses = [value.data_ptr() if isinstance(value, torch.Tensor) else value for value in values]
        return _Bound(step.kernel, compiled, tuple(step.grid), values, slots, scalar_slots, tuple(made),
                      tuple(names), dict(step.options), addresses)
